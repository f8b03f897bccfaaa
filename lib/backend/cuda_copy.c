/* The CUDA backend's side of the tier mover (the copiers' streams, rounds
 * of copies by the zero-copy kernel or cudaMemcpyAsync, pinned staging) and
 * kvt_seq_warmup's scoring on the GPU (see cuda_pool.c for the design). */
#include "cuda_int.h"
#include "../policy/policy_int.h"
#include "../select/select_int.h"

/* ---- the tier mover's copies ---------------------------------------------- */

/* A copy thread's (or the I/O thread's) copies: a low-priority stream
 * and a pinned, device-visible list of the round's copies, issued together
 * by kvt__cuda_mv_sync. */
#define KVT__MV_LIST 256u
typedef struct kvt__cu_mv {
    void *stream;
    kvt__cu_copy *list;
    uint32_t n;
    int err;           /* first error of the round (a failed event wait) */
    void *last_ev;     /* the stream already waits for it */
    int device;        /* the pool's: current when the stream goes */
    bool to_dev;       /* the round copies into the device tier */
} kvt__cu_mv;

#ifdef KVT_TEST_HOOKS
size_t kvt__cuda_copy_kernel_max = KVT__CU_COPY_KERNEL_MAX;
uint32_t kvt__cuda_mv_delay_us;
uint32_t kvt__cuda_mv_fail_rounds;
bool kvt__cuda_pin_refuse;
size_t kvt__cuda_warm_budget = KVT__CU_WARM_BUDGET;
#define KVT__COPY_KERNEL_MAX kvt__cuda_copy_kernel_max
#define KVT__WARM_BUDGET kvt__cuda_warm_budget

/* The hooks' effect on a round: fail it (rounds into the device tier
 * while kvt__cuda_mv_fail_rounds lasts) and hold it back. */
static void kvt__mv_hooks(kvt__cu_mv *m)
{
    uint32_t fail = m->to_dev ? __atomic_load_n(&kvt__cuda_mv_fail_rounds, __ATOMIC_RELAXED) : 0;
    while (fail && !__atomic_compare_exchange_n(&kvt__cuda_mv_fail_rounds, &fail, fail - 1u,
                                                false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        ;
    if (fail && !m->err)
        m->err = kvt__err(KVT_EIO, "device copy: a round of %u copies failed (test hook)", m->n);
    const uint32_t us = __atomic_load_n(&kvt__cuda_mv_delay_us, __ATOMIC_RELAXED);
    if (us && m->n) {
        const struct timespec ts = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000L};
        (void)nanosleep(&ts, NULL);
    }
}
#else
#define KVT__COPY_KERNEL_MAX ((size_t)KVT__CU_COPY_KERNEL_MAX)
#define KVT__WARM_BUDGET ((size_t)KVT__CU_WARM_BUDGET)
#endif

int kvt__cuda_mv_stream(const kvt_pool *p, void **out)
{
    *out = NULL;
    int rc = kvt__cu_set_device(p->cu->device);
    if (rc)
        return rc;
    kvt__cu_mv *m = calloc(1, sizeof *m);
    if (!m)
        return kvt__err(KVT_ENOMEM, "mover: cannot allocate a CUDA copy list");
    m->device = p->cu->device;
    if ((rc = kvt__cu_stream_create(&m->stream, 1)) ||
        (rc = kvt__cu_host_alloc((void **)&m->list, KVT__MV_LIST * sizeof *m->list))) {
        kvt__cu_stream_destroy(m->stream);
        free(m);
        return rc;
    }
    *out = m;
    return 0;
}

void kvt__cuda_mv_stream_free(void *h)
{
    kvt__cu_mv *m = h;
    if (!m)
        return;
    (void)kvt__cu_set_device(m->device); /* the caller's thread may be on another */
    kvt__cu_stream_destroy(m->stream);
    kvt__cu_host_free(m->list);
    free(m);
}

int kvt__cuda_mv_mark(kvt_pool *p, void **event)
{
    struct kvt__cuda *c = p->cu;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cu_event_create(event);
    if (rc)
        return rc;
    /* Inside a step: after the step's work queued so far. Between steps:
     * after the last step's work (prefills have finished already). */
    rc = kvt__cup_after_step(c);
    if (!rc)
        rc = kvt__cu_event_record(*event, c->sst ? c->sst : c->stream);
    if (rc) {
        kvt__cu_event_destroy(*event);
        *event = NULL;
    }
    return rc;
}

void kvt__cuda_mv_event_free(void *event)
{
    kvt__cu_event_destroy(event);
}

int kvt__cuda_mv_copy(const kvt_pool *p, void *h, void *after, void *dst, const void *src,
                      size_t n, bool uva)
{
    kvt__cu_mv *m = h;
    int rc = kvt__cu_set_device(p->cu->device);
    if (!rc && m->n == KVT__MV_LIST) /* the list is full: issue it and wait */
        rc = kvt__cuda_mv_sync(p, m);
    if (!rc && after && after != m->last_ev) {
        /* Every copy of the round is issued after this wait. */
        rc = kvt__cu_stream_wait_event(m->stream, after);
        m->last_ev = rc ? NULL : after;
    }
    if (rc) {
        m->err = m->err ? m->err : rc;
        return rc;
    }
    const kvt__arena *dv = &p->tier[KVT_TIER_DEVICE];
    m->to_dev = m->to_dev || ((const uint8_t *)dst >= p->cu->d_dev &&
                              (const uint8_t *)dst < p->cu->d_dev + dv->n_blocks * dv->block_bytes);
    /* Copies the kernel may not serve (a host side not mapped for the GPU)
     * are marked with the top bit of their size. */
    m->list[m->n++] = (kvt__cu_copy){(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst,
                                     (uint64_t)n | (uva ? 0 : 1ull << 63)};
    return 0;
}

/* Issues the round's copies and waits for them: those of at most
 * kvt__cuda_copy_kernel_max bytes (with both sides visible to the GPU) in
 * one launch of the zero-copy kernel, the others with cudaMemcpyAsync.
 * The stream is waited for even after an error, so no copy is still
 * landing when the caller reuses or frees a block. */
int kvt__cuda_mv_sync(const kvt_pool *p, void *h)
{
    kvt__cu_mv *m = h;
    if (!m) /* the copier could not be made: its error is reported already */
        return 0;
    KVT__HOOK(kvt__mv_hooks(m));
    m->to_dev = false;
    const bool direct = p->cu->uva_direct;
    uint32_t nk = 0;
    int rc = m->err;
    for (uint32_t i = 0; i < m->n; i++) { /* kernel copies to the front */
        kvt__cu_copy c = m->list[i];
        if (direct && !(c.bytes >> 63) && c.bytes <= KVT__COPY_KERNEL_MAX) {
            m->list[i] = m->list[nk];
            m->list[nk++] = c;
        }
    }
    for (uint32_t i = nk; i < m->n; i++)
        m->list[i].bytes &= ~(1ull << 63);
    if (!rc && nk)
        rc = kvt__cu_copy_kernel(m->list, nk, 0, 0, m->stream);
    if (!rc && m->n > nk)
        rc = kvt__cu_copy_memcpy(m->list + nk, m->n - nk, m->stream);
    const int e2 = kvt__cu_stream_sync(m->stream);
    m->n = 0;
    m->err = 0;
    m->last_ev = NULL;
    return rc ? rc : e2;
}

int kvt__cuda_host_pin(const kvt_pool *p, void *h, size_t bytes)
{
#ifdef KVT_TEST_HOOKS
    if (kvt__cuda_pin_refuse)
        return kvt__err(KVT_EIO, "cudaHostRegister: refused by the test hook");
#endif
    int rc = kvt__cu_set_device(p->cu->device);
    return rc ? rc : kvt__cu_host_register(h, bytes);
}

void kvt__cuda_host_unpin(const kvt_pool *p, void *h)
{
    if (p->cu) /* the mover goes before the pool's CUDA state */
        (void)kvt__cu_set_device(p->cu->device);
    kvt__cu_host_unregister(h);
}

/* ---- kvt_seq_warmup's importance ------------------------------------------ */

/* Grows a pinned array (contents dropped) or a device buffer (contents
 * dropped; the pool's streams are quiet) to hold n elements of sz bytes. */
static int kvt__warm_pin(void **h, size_t *cap, size_t n, size_t sz)
{
    if (n <= *cap)
        return 0;
    int rc = kvt__cup_pin_grow(h, n, sz);
    *cap = rc ? 0 : n;
    return rc;
}

static int kvt__warm_dev(void **d, size_t *cap, size_t bytes)
{
    if (bytes <= *cap)
        return 0;
    int rc = kvt__cup_dev_grow(d, 0, bytes, NULL);
    *cap = rc ? 0 : bytes;
    return rc;
}


int kvt__cuda_warm_imp(kvt_pool *p, kvt__seq *s, const float *obs, uint32_t n_obs, float *imp,
                       size_t stride)
{
    struct kvt__cuda *c = p->cu;
    const kvt_selector *sel = p->sel;
    const uint32_t L = p->g.n_layers, H = p->g.n_kv_heads, Hq = p->g.n_q_heads;
    const uint32_t G = Hq / H, D = p->g.head_dim;
    /* The batched product scores from the metadata only: TOKEN and ORACLE
     * (whose keys it does not read) warm up by the MINMAX bound, each page's
     * upper bound of its exact score (ORACLE's ln(tokens) / c left out: it
     * moves only a partial last page), ORACLE with its SOFTVOTE. */
    const uint32_t method = sel->method == KVT_SCORE_MEAN ? KVT_SCORE_MEAN : KVT_SCORE_MINMAX;
    const uint32_t vote = sel->method == KVT_SCORE_ORACLE ? KVT_VOTE_SOFTVOTE : sel->vote;
    const uint32_t W = method == KVT_SCORE_MINMAX ? 2u * D : D;
    int rc = kvt__cu_set_device(c->device);
    if (!rc) /* the prefills' and the last step's work, before any scratch is reused */
        rc = kvt__cup_quiesce(c);
    if (rc)
        return rc;
    if (!c->blas_tried) {
        c->blas_tried = true;
        if (kvt__cu_blas_create(&c->blas, c->stream)) {
            c->blas = NULL; /* no libcublas: the fallback kernel scores */
            kvt_clear_error();
        }
    }
    uint32_t *hs = malloc((size_t)H * sizeof *hs);
    if (!hs)
        return kvt__err(KVT_ENOMEM, "kvt_seq_warmup: cannot allocate %u head indices", H);
    for (uint32_t l = 0; l < L && !rc; l++) {
        const uint32_t np = kvt__pages_for(p, s->n_tokens[l]);
        uint32_t nh = 0;
        for (uint32_t h = 0; h < H; h++)
            if (kvt__stable(p, kvt__lh(p, l, h)))
                hs[nh++] = h;
        if (!np || !nh)
            continue;
        /* Queries per call: one call's scores and query rows within the
         * budget (and, for the fallback kernel, within its grid). */
        const uint64_t per_obs = (uint64_t)nh * G * ((uint64_t)np + W) * sizeof(float);
        uint64_t oc64 = KVT__WARM_BUDGET / per_obs;
        if (!c->blas && oc64 > 65535ull * 16u / G)
            oc64 = 65535ull * 16u / G;
        const uint32_t oc = oc64 < 1 ? 1u : (oc64 > n_obs ? n_obs : (uint32_t)oc64);
        kvt__cu_warm_args a = {
            .n_heads = nh, .n_pages = np, .n_obs = oc, .G = G, .D = D, .dtype = p->g.dtype,
            .method = method, .vote = vote, .vote_scale = sel->vote_scale,
            .d_meta_base = c->d_meta, .meta_bytes = p->meta.block_bytes,
            .meta_slots = p->meta.n_blocks, .blas = c->blas};
        const size_t nslot = (size_t)nh * np, nq = (size_t)nh * oc * G * W;
        if ((rc = kvt__warm_pin((void **)&c->h_wslot, &c->cap_wslot, nslot, sizeof(uint32_t))) ||
            (rc = kvt__warm_dev((void **)&c->d_wslot, &c->cap_wslot_d, nslot * sizeof(uint32_t))) ||
            (rc = kvt__warm_pin((void **)&c->h_wimp, &c->cap_wimp, nslot, sizeof(float))) ||
            (rc = kvt__warm_dev((void **)&c->d_wimp, &c->cap_wimp_d, nslot * sizeof(float))) ||
            (rc = kvt__warm_pin((void **)&c->h_wq, &c->cap_wq, nq, sizeof(float))) ||
            (rc = kvt__warm_dev((void **)&c->d_wq, &c->cap_wq_d, nq * sizeof(float))) ||
            (rc = kvt__warm_dev(&c->d_wwork, &c->cap_wwork, kvt__cu_warm_workspace_bytes(&a))))
            break;
        for (uint32_t x = 0; x < nh; x++) {
            const size_t lh = kvt__lh(p, l, hs[x]);
            memcpy(c->h_wslot + (size_t)x * np, s->meta_slot + lh * s->cap_pages,
                   (size_t)np * sizeof(uint32_t));
        }
        memset(c->h_wimp, 0, nslot * sizeof(float));
        a.d_slots = c->d_wslot;
        a.d_q = c->d_wq;
        a.d_imp = c->d_wimp;
        a.d_work = c->d_wwork;
        if ((rc = kvt__cup_items_up(c->d_wslot, c->h_wslot, nslot * sizeof(uint32_t), c->stream)) ||
            (rc = kvt__cup_items_up(c->d_wimp, c->h_wimp, nslot * sizeof(float), c->stream)))
            break;
        for (uint32_t o0 = 0; o0 < n_obs && !rc; o0 += oc) {
            a.n_obs = n_obs - o0 < oc ? n_obs - o0 : oc;
            /* Rows [head][o * G + g][W]: [qa | qb] or q, formed as the CPU does. */
            float *dst = c->h_wq;
            for (uint32_t x = 0; x < nh; x++)
                for (uint32_t o = 0; o < a.n_obs; o++) {
                    const float *q = obs + (((size_t)l * n_obs + o0 + o) * Hq + (size_t)hs[x] * G) * D;
                    for (uint32_t g = 0; g < G; g++, q += D, dst += W) {
                        if (method != KVT_SCORE_MINMAX) {
                            memcpy(dst, q, (size_t)D * sizeof(float));
                            continue;
                        }
                        for (uint32_t d = 0; d < D; d++) {
                            dst[d] = q[d] > 0.0f ? q[d] : 0.0f;
                            dst[D + d] = q[d] < 0.0f ? q[d] : 0.0f;
                        }
                    }
                }
            const size_t qb = (size_t)nh * a.n_obs * G * W * sizeof(float);
            if (!(rc = kvt__cup_items_up(c->d_wq, c->h_wq, qb, c->stream)) &&
                !(rc = kvt__cu_warm(&a, c->stream)))
                rc = kvt__cu_stream_sync(c->stream); /* before h_wq is refilled */
        }
        const kvt__cu_copy back = {(uint64_t)(uintptr_t)c->d_wimp, (uint64_t)(uintptr_t)c->h_wimp,
                                   nslot * sizeof(float)};
        if (rc || (rc = kvt__cu_copy_memcpy(&back, 1, c->stream)) ||
            (rc = kvt__cu_stream_sync(c->stream)))
            break;
        for (uint32_t x = 0; x < nh; x++)
            memcpy(imp + kvt__lh(p, l, hs[x]) * stride, c->h_wimp + (size_t)x * np,
                   (size_t)np * sizeof(float));
    }
    if (rc) /* nothing queued may still read the pinned buffers */
        (void)kvt__cu_stream_sync(c->stream);
    free(hs);
    return rc;
}

int kvt__cuda_warm_topk(kvt_pool *p, kvt__seq *s)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t LH = c->LH, slot = kvt__cup_slot(p, s);
    uint32_t kmax = 1, n = 0;
    for (uint32_t lh = 0; lh < LH; lh++)
        if (s->sel.topk_k[lh] && kvt__stable(p, lh)) {
            kmax = s->sel.topk_k[lh] - 1u > kmax ? s->sel.topk_k[lh] - 1u : kmax;
            n++;
        }
    int rc = kvt__cu_set_device(c->device);
    if (!rc && n)
        rc = kvt__cup_slot_state(p, s, kmax);
    if (!rc && n) /* the warm-up's own work is done; earlier steps' too */
        rc = kvt__cup_quiesce(c);
    if (rc || !n)
        return rc;
    const uint32_t kcap = c->kcap;
    kvt__cu_copy *list = malloc((size_t)n * 2u * sizeof *list);
    if (!list)
        return kvt__err(KVT_ENOMEM, "kvt_seq_warmup: cannot allocate %u copies", 2u * n);
    /* Staging: [n][kcap] pages, then n counts. */
    if ((rc = kvt__warm_pin((void **)&c->h_wslot, &c->cap_wslot, (size_t)n * (kcap + 1u),
                            sizeof(uint32_t)))) {
        free(list);
        return rc;
    }
    uint32_t *pg = c->h_wslot, *cnt = c->h_wslot + (size_t)n * kcap, m = 0;
    for (uint32_t lh = 0; lh < LH; lh++) {
        if (!s->sel.topk_k[lh] || !kvt__stable(p, lh))
            continue;
        const uint32_t nk = s->sel.topk_n[lh] < kcap ? s->sel.topk_n[lh] : kcap;
        const size_t row = (size_t)slot * LH + lh;
        memcpy(pg + (size_t)m * kcap, s->sel.topk + (size_t)lh * s->sel.topk_cap, (size_t)nk * 4u);
        cnt[m] = nk;
        list[2u * m] = (kvt__cu_copy){(uint64_t)(uintptr_t)(pg + (size_t)m * kcap),
                                      (uint64_t)(uintptr_t)(c->d_saved + row * kcap),
                                      (uint64_t)nk * 4u};
        list[2u * m + 1u] = (kvt__cu_copy){(uint64_t)(uintptr_t)(cnt + m),
                                           (uint64_t)(uintptr_t)(c->d_nsaved + row), 4u};
        m++;
    }
    rc = kvt__cu_copy_memcpy(list, 2u * m, c->stream);
    if (!rc)
        rc = kvt__cu_stream_sync(c->stream);
    free(list);
    return rc;
}
