/* The per-step plan and the per-layer calls: append, select, sparse decode.
 *
 * kvt_step_plan checks the sequences, reserves block-table room, decides
 * which heads rerank, and sizes every buffer the per-layer calls use; those
 * calls then only run kernels over the pool's worker threads. The pool owns
 * one step workspace, reused by every plan, so a finished step handle stays
 * valid memory and reports KVT_ESTATE instead of being a dangling pointer. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "../policy/policy_int.h"
#include "../tier/tier.h"
#include "step_int.h"

#define KVT__STEP_OPTS_V1 24u
_Static_assert(offsetof(kvt_step_opts, reserved) + 4 == KVT__STEP_OPTS_V1, "step opts v1");
/* V2 (still 0.1.0): policy and profiler appended; V1 callers stay accepted. */
#define KVT__STEP_OPTS_V2 (KVT__STEP_OPTS_V1 + 2u * sizeof(void *))
_Static_assert(offsetof(kvt_step_opts, policy) == 24 && offsetof(kvt_step_opts, profiler) ==
               24 + sizeof(void *), "step opts v2 layout");
/* V3 (still 0.1.0): stream appended. */
#define KVT__STEP_OPTS_V3 (KVT__STEP_OPTS_V2 + sizeof(void *))
_Static_assert(offsetof(kvt_step_opts, stream) == KVT__STEP_OPTS_V2, "step opts v3 layout");
_Static_assert(sizeof(kvt_step_opts) == KVT__STEP_OPTS_V3, "step opts v3 size");
#define KVT__KNOWN_STEP_FLAGS (KVT_STEP_DENSE)

/* Pages per decode task. Fixed, so that the split (and the floating-point
 * merge order) depends on the selection only, never on the thread count. */
#define KVT__CHUNK_PAGES 32u
#define KVT__NO_LAYER 0xffffffffu


void kvt__step_free(struct kvt_step *st)
{
    if (!st)
        return;
    free(st->ids);
    free(st->seqs);
    free(st->expect);
    free(st->due);
    free(st->appended);
    free(st->recorded);
    free(st->rec);
    free(st->sel_off);
    free(st->sel_cnt);
    free(st->sel_rr);
    free(st->task0);
    free(st->ntask);
    free((void *)st->pending);
    free(st->sel_pages);
    free(st->task_ih);
    free(st->task_first);
    free(st->task_count);
    free(st->part);
    free(st->tmem);
    free(st->fence);
    free(st->fcode);
    free(st->fpend);
    free(st->wf);
    free(st->wcode);
    free(st->pm_off);
    free(st->pm_cnt);
    free(st->pm);
    free(st->pmdst);
    free(st->pmres);
    free(st->ev);
    free(st->pml);
    free(st->failed);
    free(st->run);
    free(st);
}

static void kvt__settle(kvt_step *st, uint32_t i, bool count);
static bool kvt__pending(kvt_step *st, uint32_t i);
static void kvt__fail_reset(kvt_step *st, uint32_t i);

bool kvt__step_is_open(const struct kvt_step *st)
{
    return st && st->open;
}

KVT_API int kvt_step_opts_init(kvt_step_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    return 0;
}

/* Grows *p to hold n elements of size sz (contents not kept). */
static int kvt__grow(void **p, size_t *cap, size_t n, size_t sz, const char *what)
{
    if (n <= *cap && *p)
        return 0;
    if (n > SIZE_MAX / sz)
        return kvt__err(KVT_EOVERFLOW, "step: %s of %zu entries overflow", what, n);
    void *q = malloc(n * sz != 0 ? n * sz : 1);
    if (!q)
        return kvt__err(KVT_ENOMEM, "step: cannot allocate %s (%zu bytes)", what, n * sz);
    free(*p);
    *p = q;
    *cap = n;
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}


/* An eviction candidate of one head: its score and page. */
typedef struct {
    float imp;
    uint32_t page;
} kvt__evc;

/* Highest score first; among equal scores the lower page. */
static int kvt__evc_desc(const void *a, const void *b)
{
    const kvt__evc *x = a, *y = b;
    if (x->imp != y->imp)
        return x->imp > y->imp ? -1 : 1;
    return x->page < y->page ? -1 : x->page > y->page;
}

/* Tiered pools: whether the selection a stable head of `layer` makes when it
 * does not rerank - every page when its budget covers them all, else the
 * forced pages and its kept top-K set - names a page with no device copy
 * and none arriving. A prefill's trim or an engine's explicit move may have
 * dropped one since the head's last rerank; such a head reranks, so that
 * kvt_rerank_recycle promotes the page (decode reads device copies; the
 * CUDA backend's reads no other tier). Reads sink + local + K entries, or
 * the pages when the budget covers them all (at most sink + local + K). */
static bool kvt__reuse_off_device(const kvt_pool *p, const kvt__seq *s, uint32_t layer,
                                  size_t lh, uint32_t k)
{
    const uint32_t tokens = s->n_tokens[layer], np = kvt__pages_for(p, tokens);
    const uint32_t sink = p->pol->sink[lh], local = p->pol->local[lh];
    const uint8_t *res = s->res + lh * s->cap_pages;
    const uint8_t here = KVT_RES_DEVICE | KVT__RES_INBOUND;
    const bool all = (uint64_t)k + sink + local >= np;
    const uint32_t s_end = all || sink > np ? np : sink;
    for (uint32_t pg = 0; pg < s_end; pg++)
        if (!(res[pg] & here))
            return true;
    if (all)
        return false;
    const uint32_t l0 = local < np ? np - local : 0;
    for (uint32_t pg = l0 > s_end ? l0 : s_end; pg < np; pg++)
        if (!(res[pg] & here))
            return true;
    if (np && tokens % p->g.page_tokens && !(res[np - 1u] & here))
        return true;
    if (s->topk && s->topk_k[lh]) {
        const uint32_t *t = s->topk + lh * s->topk_cap;
        for (uint32_t j = 0; j < s->topk_n[lh]; j++)
            if (t[j] < np && !(res[t[j]] & here))
                return true;
    }
    return false;
}

/* Whether head lh of `layer` of s reranks in this step (not dense): with no
 * kept top-K set (topk_k holds K + 1 of the kept pages, 0 = none), at
 * interval 1, or at the steps its interval and the sequence's phase pick;
 * in a tiered pool a stable head also when its reused selection names a
 * page off device. */
static bool kvt__head_due(const kvt_pool *p, const kvt__seq *s, uint32_t layer, size_t lh,
                          uint32_t k, uint32_t iv, bool tiered)
{
    return !s->topk || iv <= 1 || s->topk_k[lh] != k + 1u ||
           (s->steps + s->phase) % iv == 0 ||
           (tiered && kvt__stable(p, lh) && kvt__reuse_off_device(p, s, layer, lh, k));
}

/* Adds to *need the device blocks the rerank/recycle of s's due stable
 * heads may take beyond the blocks they give back, and to *pm the moves it
 * may issue. After a rerank a head keeps its forced pages, at most K x
 * window others, and the pages it cannot evict (no complete copy elsewhere
 * or a move in flight); one more page may leave the local window with the
 * step's token and not be evictable yet (the new page itself is counted
 * with the appends). */
static void kvt__promote_bound(const kvt_pool *p, const kvt__seq *s, const uint32_t *ak,
                               const uint32_t *aiv, uint64_t *need, uint64_t *pm)
{
    const uint32_t L = p->g.n_layers, H = p->g.n_kv_heads, P = p->g.page_tokens;
    for (uint32_t l = 0; l < L; l++) {
        const uint32_t tokens = s->n_tokens[l], np = kvt__pages_for(p, tokens);
        for (uint32_t h = 0; h < H; h++) {
            const size_t lh = kvt__lh(p, l, h);
            if (!kvt__stable(p, lh))
                continue;
            /* Room for every stable head's promotions, due or not: a failed
             * warm-up makes all of a sequence's heads rescore mid-step. */
            *pm += ak[lh] < np + 1u ? ak[lh] : np + 1u;
            if (!kvt__head_due(p, s, l, lh, ak[lh], aiv[lh], true))
                continue;
            const uint32_t sink = p->pol->sink[lh], local = p->pol->local[lh];
            uint64_t dev = 0, stuck = 0, forced = 0;
            for (uint32_t pg = 0; pg < np; pg++) {
                const uint8_t r = s->res[lh * s->cap_pages + pg];
                const bool f = kvt__forced(pg, np, tokens, P, sink, local);
                forced += f;
                if (!(r & (KVT_RES_DEVICE | KVT__RES_INBOUND)))
                    continue;
                dev++;
                /* Pages arriving count as resident (the recycle waits for
                 * them), not as stuck. */
                if (!f && !(r & KVT__RES_INBOUND) &&
                    ((r & KVT__RES_BUSY) || !(r & (KVT_RES_HOST | KVT_RES_DISK))))
                    stuck++;
            }
            uint64_t kw = (uint64_t)ak[lh] * p->pol->window[lh];
            kw = kw < np ? kw : np; /* a budget above the context keeps every page */
            uint64_t after = forced + 1u + kw + stuck;
            after = after < np + 1u ? after : np + 1u;
            if (after > dev)
                *need += after - dev;
        }
    }
}

KVT_API int kvt_step_plan(kvt_pool *pool, const kvt_seq_id *seqs, uint32_t n_seqs,
                          const kvt_step_opts *opts, kvt_step **out)
{
    kvt_step_opts o;
    int rc;
    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(seqs);
    if (opts) {
        rc = kvt__opts_copy(&o, sizeof o, opts, KVT__STEP_OPTS_V1, "opts");
        if (rc)
            return rc;
    } else {
        kvt_step_opts_init(&o);
    }
    if (n_seqs == 0)
        return kvt__err(KVT_EINVAL, "n_seqs: must be at least 1");
    if (n_seqs > pool->max_seqs)
        return kvt__err(KVT_EINVAL, "n_seqs: %u is above the pool's max_seqs %u", n_seqs,
                        pool->max_seqs);
    if (o.flags & ~KVT__KNOWN_STEP_FLAGS)
        return kvt__err(KVT_EINVAL, "opts->flags: unknown bits 0x%x",
                        o.flags & ~KVT__KNOWN_STEP_FLAGS);
    if (o.reserved)
        return kvt__err(KVT_EINVAL, "opts->reserved: must be zero");
    if (!(o.scale >= 0.0f) || isinf(o.scale))
        return kvt__err(KVT_EINVAL, "opts->scale: %g is not a finite value >= 0",
                        (double)o.scale);
    const bool dense = (o.flags & KVT_STEP_DENSE) != 0;
    if (!o.selector && !dense)
        o.selector = pool->sel;
    if (!dense && !o.selector)
        return kvt__err(KVT_EINVAL, "opts->selector: NULL needs flags KVT_STEP_DENSE (or a "
                        "pool with a selector)");
    if (pool->pol && !dense) {
        if (o.policy && o.policy != pool->pol)
            return kvt__err(KVT_EINVAL, "opts->policy: a tiered pool places pages by its own "
                            "policy; pass NULL or the pool's");
        o.policy = pool->pol;
    }
    const bool tiered = pool->pol && !dense;
    if (dense && pool->pol && pool->cu)
        return kvt__err(KVT_ENOTSUP, "opts->flags: KVT_STEP_DENSE on a tiered CUDA pool (its "
                        "decode reads device pages only, and stable heads keep most pages "
                        "off the device)");
    if (o.selector) {
        rc = kvt__selector_match(o.selector, pool);
        if (rc)
            return rc;
    }
    /* A dense step selects every page: a policy or profiler has no part in it. */
    const kvt_policy *pol = dense ? NULL : o.policy;
    kvt_profiler *prof = dense ? NULL : o.profiler;
    if (pol && (rc = kvt__geometry_same(&pol->g, &pool->g, "opts->policy", "the policy",
                                        "the pool")))
        return rc;
    if (prof && (rc = kvt__geometry_same(kvt__profiler_geometry(prof), &pool->g,
                                         "opts->profiler", "the profiler", "the pool")))
        return rc;
    if (prof && pool->cu)
        return kvt__err(KVT_ENOTSUP, "opts->profiler: the CUDA backend does not feed a "
                        "profiler in this release (profile on the CPU backend)");
    if (pool->step && pool->step->open)
        return kvt__err(KVT_ESTATE, "pool: a step is still open (call kvt_step_finish)");

    const uint32_t L = pool->g.n_layers, H = pool->g.n_kv_heads, P = pool->g.page_tokens;
    const uint32_t Hq = pool->g.n_q_heads, G = Hq / H, D = pool->g.head_dim;

    /* Sequences: live and distinct. */
    kvt__seq **ss = malloc((size_t)n_seqs * sizeof *ss);
    uint64_t *sorted = malloc((size_t)n_seqs * sizeof *sorted);
    if (!ss || !sorted) {
        free(ss);
        free(sorted);
        return kvt__err(KVT_ENOMEM, "kvt_step_plan: cannot allocate for %u sequences", n_seqs);
    }
    for (uint32_t i = 0; i < n_seqs; i++) {
        rc = kvt__seq_lookup(pool, seqs[i], &ss[i]);
        if (rc) {
            kvt__err(rc, "seqs[%u]: id 0x%llx names no live sequence of this pool", i,
                     (unsigned long long)seqs[i]);
            goto out_free;
        }
        sorted[i] = seqs[i];
    }
    qsort(sorted, n_seqs, sizeof *sorted, cmp_u64);
    for (uint32_t i = 1; i < n_seqs; i++)
        if (sorted[i] == sorted[i - 1]) {
            rc = kvt__err(KVT_EINVAL, "seqs: id 0x%llx appears twice",
                          (unsigned long long)sorted[i]);
            goto out_free;
        }

    /* Room for one more token per sequence and layer: blocks now, table
     * capacity reserved so that kvt_append never allocates. */
    uint64_t need = 0, need_pm = 0, sel_total = 0, task_total = 0, pm_total = 0;
    if (tiered)
        kvt__mover_apply(pool->mover); /* finished moves free their blocks first */
    uint32_t np_max = 1;
    uint32_t kmax = 0, smax = 0, lmax = 0, imax = 1;
    const uint32_t *ak = NULL, *asink = NULL, *alocal = NULL, *aiv = NULL;
    if (o.selector) {
        ak = pol ? pol->k : o.selector->k;
        asink = pol ? pol->sink : o.selector->sink;
        alocal = pol ? pol->local : o.selector->local;
        aiv = pol ? pol->interval : o.selector->interval;
        const size_t nb = (size_t)L * H;
        for (size_t b = 0; b < nb; b++) {
            kmax = ak[b] > kmax ? ak[b] : kmax;
            smax = asink[b] > smax ? asink[b] : smax;
            lmax = alocal[b] > lmax ? alocal[b] : lmax;
            imax = aiv[b] > imax ? aiv[b] : imax;
        }
    }
    for (uint32_t i = 0; i < n_seqs; i++) {
        kvt__seq *s = ss[i];
        uint32_t tmax = 0;
        for (uint32_t l = 0; l < L; l++) {
            const uint32_t t = s->n_tokens[l];
            tmax = t > tmax ? t : tmax;
            if (t % P == 0)
                need += H;
        }
        if (tmax >= s->max_tokens) {
            rc = kvt__err(KVT_ERANGE, "seqs[%u]: the sequence holds %u tokens, its limit "
                          "(max_tokens %u); it cannot take the step's token", i, tmax,
                          s->max_tokens);
            goto out_free;
        }
        const uint32_t t1 = tmax + 1;
        const uint32_t np = kvt__pages_for(pool, t1);
        rc = kvt__seq_reserve(pool, s, np);
        if (rc)
            goto out_free;
        if (!dense && (imax > 1 || s->topk || tiered)) {
            rc = kvt__seq_topk_reserve(pool, s, kmax < s->cap_pages ? kmax : s->cap_pages);
            if (rc)
                goto out_free;
        }
        if (prof && (rc = kvt__profiler_reserve(prof, seqs[i], kmax < np ? kmax : np)))
            goto out_free;
        np_max = np > np_max ? np : np_max;
        if (tiered)
            kvt__promote_bound(pool, s, ak, aiv, &need_pm, &pm_total);
        const uint32_t b = dense ? np : kvt__sel_bound(np, kmax, smax, lmax);
        sel_total += (uint64_t)b * H;
        task_total += (uint64_t)((b + KVT__CHUNK_PAGES - 1) / KVT__CHUNK_PAGES) * H;
    }
    if (tiered && need + need_pm > pool->tier[KVT_TIER_DEVICE].n_free) {
        /* Short: pages whose copy-out is still in flight cannot be evicted
         * yet and count against the step. Let them land and count again. */
        need_pm = 0;
        uint64_t pm2 = 0;
        for (uint32_t i = 0; i < n_seqs; i++)
            kvt__mover_drain_seq(pool->mover, ss[i]);
        for (uint32_t i = 0; i < n_seqs; i++)
            kvt__promote_bound(pool, ss[i], ak, aiv, &need_pm, &pm2);
    }
    if (need + need_pm > pool->tier[KVT_TIER_DEVICE].n_free) {
        rc = kvt__err(KVT_ENOSPC, "device tier: the step's appends%s need up to %llu blocks, "
                      "%u free", tiered ? " and promotions" : "",
                      (unsigned long long)(need + need_pm), pool->tier[KVT_TIER_DEVICE].n_free);
        goto out_free;
    }
    if (need > pool->meta.n_free) {
        rc = kvt__err(KVT_ENOSPC, "metadata store: the step's appends need up to %llu pages, "
                      "%u free", (unsigned long long)need, pool->meta.n_free);
        goto out_free;
    }

    /* The workspace. */
    if (!pool->tp.inited) {
        rc = kvt__tp_init(&pool->tp, pool->n_threads);
        if (rc) {
            kvt__tp_fini(&pool->tp);
            goto out_free;
        }
    }
    if (!pool->step) {
        pool->step = calloc(1, sizeof *pool->step);
        if (!pool->step) {
            rc = kvt__err(KVT_ENOMEM, "kvt_step_plan: cannot allocate the step");
            goto out_free;
        }
        pool->step->pool = pool;
        pool->step->appended = calloc(L, 1);
        pool->step->recorded = calloc(L, 1);
        if (!pool->step->appended || !pool->step->recorded) {
            free(pool->step->appended);
            free(pool->step->recorded);
            free(pool->step);
            pool->step = NULL;
            rc = kvt__err(KVT_ENOMEM, "kvt_step_plan: cannot allocate the step");
            goto out_free;
        }
    }
    kvt_step *st = pool->step;
    const size_t nh = (size_t)n_seqs * H, nlh = (size_t)n_seqs * L * H;
    if (n_seqs > st->cap_n) {
        size_t c = 0;
        st->cap_n = 0; /* until every per-sequence array has grown */
        void *p;
#define KVT__REALLOC(field, count)                                                         \
    do {                                                                                   \
        c = 0;                                                                             \
        p = st->field;                                                                     \
        st->field = NULL;                                                                  \
        free(p);                                                                           \
        rc = kvt__grow((void **)&st->field, &c, (count), sizeof *st->field, #field);       \
        if (rc)                                                                            \
            goto out_reset;                                                                \
    } while (0)
        KVT__REALLOC(ids, n_seqs);
        KVT__REALLOC(seqs, n_seqs);
        KVT__REALLOC(expect, (size_t)n_seqs * L);
        KVT__REALLOC(due, nlh);
        KVT__REALLOC(sel_off, nh);
        KVT__REALLOC(sel_cnt, nh);
        KVT__REALLOC(sel_rr, nh);
        KVT__REALLOC(task0, nh);
        KVT__REALLOC(ntask, nh);
        KVT__REALLOC(pending, nh);
        KVT__REALLOC(fence, n_seqs);
        KVT__REALLOC(fcode, n_seqs);
        KVT__REALLOC(fpend, n_seqs);
        KVT__REALLOC(wf, n_seqs);
        KVT__REALLOC(wcode, n_seqs);
        KVT__REALLOC(pm_off, n_seqs);
        KVT__REALLOC(pm_cnt, n_seqs);
        KVT__REALLOC(failed, n_seqs);
        KVT__REALLOC(run, n_seqs);
#undef KVT__REALLOC
        st->cap_n = n_seqs;
    }
    const size_t part_floats = 2u * (size_t)G + (size_t)G * D;
    if (task_total > SIZE_MAX / sizeof(float) / part_floats) {
        rc = kvt__err(KVT_EOVERFLOW, "step: %llu decode tasks overflow",
                      (unsigned long long)task_total);
        goto out_reset;
    }
    if ((rc = kvt__grow((void **)&st->sel_pages, &st->cap_sel, sel_total, sizeof(uint32_t),
                        "selection")))
        goto out_reset;
    size_t c1 = st->cap_tasks, c2 = st->cap_tasks, c3 = st->cap_tasks;
    if ((rc = kvt__grow((void **)&st->task_ih, &c1, task_total, sizeof(uint32_t), "tasks")) ||
        (rc = kvt__grow((void **)&st->task_first, &c2, task_total, sizeof(uint32_t), "tasks")) ||
        (rc = kvt__grow((void **)&st->task_count, &c3, task_total, sizeof(uint32_t), "tasks"))) {
        free(st->task_ih);
        free(st->task_first);
        free(st->task_count);
        st->task_ih = st->task_first = st->task_count = NULL;
        st->cap_tasks = 0;
        goto out_reset;
    }
    st->cap_tasks = c1 < c2 ? (c1 < c3 ? c1 : c3) : (c2 < c3 ? c2 : c3);
    if ((rc = kvt__grow((void **)&st->part, &st->cap_part, task_total * part_floats,
                        sizeof(float), "partial results")))
        goto out_reset;
    size_t dec = ((size_t)G * D + (size_t)G * P) * sizeof(float) +
                 KVT__CHUNK_PAGES * (sizeof(void *) + sizeof(uint32_t));
    size_t selb = o.selector && !dense ? kvt__sel_scratch_bytes(G, D, np_max) : 0;
    size_t tstride = ((dec > selb ? dec : selb) + 63u) & ~(size_t)63u;
    const uint32_t nt = pool->tp.n_threads;
    if ((rc = kvt__grow((void **)&st->tmem, &st->cap_tmem, (size_t)nt * tstride, 1,
                        "thread scratch")))
        goto out_reset;
    if (prof && (rc = kvt__grow((void **)&st->rec, &st->cap_rec, (size_t)np_max,
                                sizeof(uint32_t), "profiler records")))
        goto out_reset;
    if (tiered) {
        size_t p1 = st->cap_pm, p2 = st->cap_pm, p3 = st->cap_pm;
        if ((rc = kvt__grow((void **)&st->pm, &p1, pm_total, sizeof *st->pm, "promotions")) ||
            (rc = kvt__grow((void **)&st->pmdst, &p2, pm_total, sizeof *st->pmdst,
                            "promotions")) ||
            (rc = kvt__grow((void **)&st->pmres, &p3, pm_total, sizeof *st->pmres,
                            "promotions"))) {
            free(st->pm);
            free(st->pmdst);
            free(st->pmres);
            st->pm = NULL;
            st->pmdst = NULL;
            st->pmres = NULL;
            st->cap_pm = 0;
            goto out_reset;
        }
        st->cap_pm = p1;
        size_t e1 = st->cap_ev, e2 = st->cap_ev;
        if ((rc = kvt__grow(&st->ev, &e1, np_max, sizeof(kvt__evc), "eviction list")) ||
            (rc = kvt__grow((void **)&st->pml, &e2, np_max, sizeof(uint32_t), "eviction list"))) {
            free(st->ev);
            free(st->pml);
            st->ev = NULL;
            st->pml = NULL;
            st->cap_ev = 0;
            goto out_reset;
        }
        st->cap_ev = e1;
    }

    /* Everything is in place: fill the plan. */
    st->sel = o.selector;
    st->tiered = tiered;
    st->k = ak;
    st->sink = asink;
    st->local = alocal;
    st->interval = aiv;
    st->prof = prof;
    memset(st->recorded, 0, L);
    st->flags = o.flags;
    st->scale = o.scale > 0.0f ? o.scale : 1.0f / sqrtf((float)D);
    st->n = n_seqs;
    st->L = L;
    st->H = H;
    st->Hq = Hq;
    st->G = G;
    st->D = D;
    st->P = P;
    st->n_threads = nt;
    st->tstride = tstride;
    memcpy(st->ids, seqs, (size_t)n_seqs * sizeof *seqs);
    memcpy(st->seqs, ss, (size_t)n_seqs * sizeof *ss);
    memset(st->appended, 0, L);
    st->sel_layer = KVT__NO_LAYER;
    st->emptied_layer = KVT__NO_LAYER;
    for (uint32_t i = 0; i < n_seqs; i++) {
        kvt__seq *s = ss[i];
        for (uint32_t l = 0; l < L; l++) {
            st->expect[(size_t)i * L + l] = s->n_tokens[l];
            for (uint32_t h = 0; h < H; h++) {
                const size_t b = (size_t)l * H + h;
                st->due[(size_t)i * L * H + b] =
                    dense || kvt__head_due(pool, s, l, b, ak[b], aiv[b], tiered);
            }
        }
    }
    for (uint32_t i = 0; i < n_seqs; i++) {
        /* Warm-up's promotions still in flight make the sequence not ready. */
        st->wf[i] = tiered ? ss[i]->wfence : 0;
        st->wcode[i] = 0;
        st->fence[i] = 0;
        st->fpend[i] = 0;
        st->fcode[i] = 0;
        st->failed[i] = 0;
        st->pm_cnt[i] = 0;
        if (tiered)
            ss[i]->wfence = 0;
    }
    if (pool->cu && (rc = kvt__cuda_step_plan(st, o.stream)))
        goto out_free;
    st->open = true;
    pool->step_id++; /* dirty ranges start empty */
    pool->clock++; /* the step's stamp on the pages it selects */
    free(ss);
    free(sorted);
    *out = st;
    return 0;

out_reset:
    /* A failed grow leaves each array either intact with its old capacity
     * or NULL with capacity 0; the step itself stays (a finished handle
     * must keep answering KVT_ESTATE), closed. */
out_free:
    free(ss);
    free(sorted);
    return rc;
}

/* Checks a step and its sequences before a per-layer call. */
static int kvt__step_enter(const kvt_step *st, uint32_t layer)
{
    if (!st)
        return kvt__err(KVT_EINVAL, "step: must not be NULL");
    if (!st->open)
        return kvt__err(KVT_ESTATE, "step: already finished (a stale plan); call "
                        "kvt_step_plan for a new step");
    if (layer >= st->L)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, st->L);
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s;
        int rc = kvt__seq_lookup(st->pool, st->ids[i], &s);
        if (rc)
            return kvt__err(rc, "step: sequence %u (id 0x%llx) was released after the plan",
                            i, (unsigned long long)st->ids[i]);
        if (s->n_tokens[layer] != st->expect[(size_t)i * st->L + layer])
            return kvt__err(KVT_ESTATE, "step: sequence %u has %u tokens in layer %u, the "
                            "plan expects %u (appended outside the step: a stale plan)",
                            i, s->n_tokens[layer], layer,
                            st->expect[(size_t)i * st->L + layer]);
    }
    return 0;
}

KVT_API int kvt_step_finish(kvt_step *st)
{
    if (!st)
        return 0;
    if (!st->open)
        return kvt__err(KVT_ESTATE, "step: already finished");
    int rc = 0;
    if (st->tiered) {
        /* Nothing of the step may stay in flight (the moves write into the
         * step's buffers); then the pages that filled go out once. */
        for (uint32_t i = 0; i < st->n; i++) {
            kvt__settle(st, i, false);
            kvt__fail_reset(st, i);
        }
        rc = kvt__place_offload(st->pool, st->seqs, st->ids, st->n, UINT32_MAX, false);
    }
    if (st->pool->cu) {
        const int rc2 = kvt__cuda_step_finish(st);
        rc = rc ? rc : rc2;
    }
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i]; /* slots live as long as the pool */
        if (s->live && s->gen == (uint32_t)(st->ids[i] >> 32))
            s->steps++;
    }
    st->open = false;
    st->sel_layer = KVT__NO_LAYER;
    return rc;
}

KVT_API int kvt_step_ready(kvt_step *st, uint32_t seq_index, uint32_t *ready)
{
    if (!st)
        return kvt__err(KVT_EINVAL, "step: must not be NULL");
    if (!st->open)
        return kvt__err(KVT_ESTATE, "step: already finished (a stale plan)");
    if (seq_index >= st->n)
        return kvt__err(KVT_EINVAL, "seq_index: %u >= the plan's %u sequences", seq_index,
                        st->n);
    KVT__CHECK_NULL(ready);
    *ready = st->tiered ? !kvt__pending(st, seq_index) : 1u;
    return 0;
}

KVT_API int kvt_step_dirty(const kvt_step *st, uint32_t layer, uint32_t seq_index,
                           uint32_t kv_head, uint32_t *first_page, uint32_t *n_pages)
{
    if (!st)
        return kvt__err(KVT_EINVAL, "step: must not be NULL");
    if (!st->open)
        return kvt__err(KVT_ESTATE, "step: already finished (a stale plan)");
    if (layer >= st->L)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, st->L);
    if (seq_index >= st->n)
        return kvt__err(KVT_EINVAL, "seq_index: %u >= the plan's %u sequences", seq_index,
                        st->n);
    if (kv_head >= st->H)
        return kvt__err(KVT_EINVAL, "kv_head: %u >= n_kv_heads %u", kv_head, st->H);
    KVT__CHECK_NULL(first_page);
    KVT__CHECK_NULL(n_pages);
    const kvt__seq *s = st->seqs[seq_index];
    const size_t lh = kvt__lh(st->pool, layer, kv_head);
    if (s->dstamp && s->dstamp[lh] == st->pool->step_id) {
        *first_page = s->dlo[lh];
        *n_pages = s->dhi[lh] - s->dlo[lh] + 1u;
    } else {
        *first_page = 0;
        *n_pages = 0;
    }
    return 0;
}

KVT_API int kvt_append(kvt_step *st, uint32_t layer, const void *k, const void *v,
                       kvt_dtype src_dtype, uint64_t seq_stride)
{
    int rc = kvt__step_enter(st, layer);
    if (rc)
        return rc;
    KVT__CHECK_NULL(k);
    KVT__CHECK_NULL(v);
    kvt_pool *p = st->pool;
    const size_t src_elem = kvt_dtype_size(src_dtype);
    if (src_elem == 0)
        return kvt__err(KVT_EINVAL, "src_dtype: unknown dtype %u", src_dtype);
    const uint64_t dense = (uint64_t)st->H * st->D;
    if (seq_stride == 0)
        seq_stride = dense;
    if (seq_stride < dense)
        return kvt__err(KVT_EINVAL, "seq_stride: %llu is below n_kv_heads * head_dim = %llu",
                        (unsigned long long)seq_stride, (unsigned long long)dense);
    uint64_t span;
    if (!kvt__mul_u64(seq_stride, st->n, &span) || !kvt__mul_u64(span, src_elem, &span) ||
        span > SIZE_MAX / 2)
        return kvt__err(KVT_EOVERFLOW, "seq_stride: %u sequences x %llu elements overflow",
                        st->n, (unsigned long long)seq_stride);
    if (st->appended[layer])
        return kvt__err(KVT_ESTATE, "layer: %u was already appended in this step", layer);
    if (st->sel_layer == layer)
        return kvt__err(KVT_ESTATE, "layer: %u was already selected in this step; append "
                        "before kvt_step_select", layer);
    uint64_t need = 0;
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        const uint32_t t = s->n_tokens[layer];
        if (t >= s->max_tokens)
            return kvt__err(KVT_ERANGE, "step: sequence %u is at its limit of %u tokens", i,
                            s->max_tokens);
        if (kvt__pages_for(p, t + 1) > s->cap_pages)
            return kvt__err(KVT_EINTERNAL, "step: sequence %u's block table was not "
                            "reserved by the plan", i);
        if (t % st->P == 0)
            need += st->H;
    }
    if (need > p->tier[KVT_TIER_DEVICE].n_free)
        return kvt__err(KVT_ENOSPC, "device tier: %llu blocks needed for layer %u, %u free",
                        (unsigned long long)need, layer, p->tier[KVT_TIER_DEVICE].n_free);
    if (need > p->meta.n_free)
        return kvt__err(KVT_ENOSPC, "metadata store: %llu pages needed, %u free",
                        (unsigned long long)need, p->meta.n_free);
    if (p->cu) {
        /* CUDA: blocks from the host tables, one append kernel for the batch
         * on the step's stream (task_first holds each sequence's length). */
        uint32_t *cur = st->task_first;
        for (uint32_t i = 0; i < st->n; i++) {
            cur[i] = st->seqs[i]->n_tokens[layer];
            kvt__append_alloc(p, st->seqs[i], layer, 1);
        }
        rc = kvt__cuda_step_append(st, layer, k, v, src_dtype, seq_stride, cur);
        if (rc) { /* all or nothing: the new pages go back */
            for (uint32_t i = 0; i < st->n; i++)
                kvt__append_unalloc(p, st->seqs[i], layer, 1);
            return rc;
        }
        for (uint32_t i = 0; i < st->n; i++) {
            st->seqs[i]->n_tokens[layer]++;
            st->expect[(size_t)i * st->L + layer]++;
        }
        st->appended[layer] = 1;
        return 0;
    }
    for (uint32_t i = 0; i < st->n; i++) {
        const size_t off = (size_t)i * seq_stride * src_elem;
        kvt__append_checked(p, st->seqs[i], layer, (const uint8_t *)k + off,
                            (const uint8_t *)v + off, 1, src_dtype, dense);
        st->expect[(size_t)i * st->L + layer]++;
    }
    st->appended[layer] = 1;
    return 0;
}

/* ---- selection --------------------------------------------------------- */
static void kvt__sel_task(void *ctx, uint32_t ih, uint32_t thread)
{
    kvt_step *st = ctx;
    const kvt_pool *p = st->pool;
    const uint32_t i = ih / st->H, h = ih % st->H, layer = st->layer;
    kvt__seq *s = st->seqs[i];
    const uint32_t tokens = s->n_tokens[layer];
    const uint32_t np = kvt__pages_for(p, tokens);
    uint32_t *out = st->sel_pages + st->sel_off[ih];
    st->sel_rr[ih] = 0;
    if (st->flags & KVT_STEP_DENSE) {
        for (uint32_t j = 0; j < np; j++)
            out[j] = j;
        st->sel_cnt[ih] = np;
        return;
    }
    const size_t b = (size_t)layer * st->H + h;
    const kvt_selector *sel = st->sel;
    const uint32_t k = st->k[b], sink = st->sink[b], local = st->local[b];
    kvt__sel_scratch sc;
    kvt__sel_scratch_carve(&sc, st->tmem + (size_t)thread * st->tstride, st->G, st->D, np);
    const bool due = st->due[(size_t)i * st->L * st->H + b] != 0;
    /* The plan sized the store for this selector's largest K. */
    uint32_t *keep = s->topk && (k <= s->topk_cap || np <= s->topk_cap)
                         ? s->topk + b * s->topk_cap
                         : NULL;
    if (due && np) {
        kvt__sel_score(sel, p, s, layer, h, st->q + ((size_t)i * st->Hq + (size_t)h * st->G) * st->D,
                       np, &sc);
        uint32_t nk = 0;
        st->sel_cnt[ih] = kvt__sel_pick(np, tokens, st->P, k, sink, local, sc.vote, NULL, 0,
                                        &sc, out, keep, &nk);
        /* The score is the page's importance for the host cache's eviction
         * (lib/tier): the last word the selector had on it. */
        memcpy(s->imp + b * s->cap_pages, sc.vote, (size_t)np * sizeof *sc.vote);
        if (keep) {
            s->topk_n[b] = nk;
            s->topk_k[b] = k + 1u;
        } else if (s->topk) {
            s->topk_k[b] = 0; /* nothing kept: rerank next time */
        }
        st->sel_rr[ih] = 1;
    } else if ((uint64_t)k + sink + local >= np) {
        /* The budget covers every page (pages that filled since the last
         * rerank included): all of them, as a rescore would choose. */
        for (uint32_t j = 0; j < np; j++)
            out[j] = j;
        st->sel_cnt[ih] = np;
    } else {
        st->sel_cnt[ih] = kvt__sel_pick(np, tokens, st->P, k, sink, local, NULL, keep,
                                        keep ? s->topk_n[b] : 0, &sc, out, NULL, NULL);
    }
    for (uint32_t j = 0; j < st->sel_cnt[ih]; j++) /* recency, the eviction tie-break */
        s->use[b * s->cap_pages + out[j]] = p->clock;
}

/* Feeds the profiler the top-K part (the selection without the forced
 * sink, local and last pages) of every head reranked in `layer`, on the
 * calling thread, in (sequence, head) order. The plan reserved the
 * profiler's room, so nothing is allocated. */
static int kvt__step_record(kvt_step *st, uint32_t layer)
{
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        const uint32_t tokens = s->n_tokens[layer];
        const uint32_t np = kvt__pages_for(st->pool, tokens);
        for (uint32_t h = 0; h < st->H; h++) {
            const size_t ih = (size_t)i * st->H + h, b = (size_t)layer * st->H + h;
            if (!st->sel_rr[ih])
                continue;
            const uint32_t ns = st->sink[b] < np ? st->sink[b] : np;
            const uint32_t nl = st->local[b] < np ? st->local[b] : np;
            const uint32_t *sel = st->sel_pages + st->sel_off[ih];
            uint32_t nk = 0;
            for (uint32_t j = 0; j < st->sel_cnt[ih]; j++) {
                const uint32_t pg = sel[j];
                const bool forced = pg < ns || pg >= np - nl ||
                                    (pg == np - 1 && tokens % st->P != 0);
                if (!forced)
                    st->rec[nk++] = pg;
            }
            /* Every forced page is selected: candidates = np - forced. */
            const uint32_t n_cand = np - (st->sel_cnt[ih] - nk);
            int rc = kvt__profiler_add(st->prof, st->ids[i], layer, h, st->rec, nk, n_cand);
            if (rc) {
                char why[256];
                snprintf(why, sizeof why, "%s", kvt_last_error());
                return kvt__err(KVT_EINTERNAL, "step: recording into the profiler failed: %s",
                                why);
            }
        }
    }
    return 0;
}

/* After failed promotions of sequence i: the heads whose pages did not
 * arrive rescore at the next step (for warm-up's, which heads is not known:
 * all of them, and already in this step's later layers, whose reused
 * selections may name the missing pages). Clears the recorded outcomes. */
static void kvt__fail_reset(kvt_step *st, uint32_t i)
{
    kvt__seq *s = st->seqs[i];
    if (s->topk_k && st->fcode[i])
        for (uint32_t x = st->pm_off[i]; x < st->pm_off[i] + st->pm_cnt[i]; x++)
            if (st->pmres[x])
                s->topk_k[kvt__lh(st->pool, st->pm[x].layer, st->pm[x].kv_head)] = 0;
    if (st->wcode[i]) {
        if (s->topk_k)
            memset(s->topk_k, 0, (size_t)st->L * st->H * sizeof *s->topk_k);
        memset(st->due + (size_t)i * st->L * st->H, 1, (size_t)st->L * st->H);
    }
    st->fcode[i] = 0;
    st->wcode[i] = 0;
}

static bool kvt__pending(kvt_step *st, uint32_t i)
{
    kvt_mover *m = st->pool->mover;
    int code = 0;
    if (st->wf[i] && kvt__mover_fence_done(m, st->wf[i], &code)) {
        st->wf[i] = 0;
        st->wcode[i] = st->wcode[i] ? st->wcode[i] : code;
    }
    if (st->fpend[i] && kvt__mover_fence_done(m, st->fence[i], &code)) {
        st->fpend[i] = 0;
        st->fence[i] = 0;
        st->fcode[i] = code;
    }
    return st->wf[i] || st->fpend[i];
}

/* Waits until no page of sequence i is on its way to the device (warm-up's
 * and this layer's promotions), recording the outcomes; `count`: a decode
 * that waited (kvt_stats.paused_seqs). */
static void kvt__settle(kvt_step *st, uint32_t i, bool count)
{
    if (!kvt__pending(st, i))
        return;
    kvt_mover *m = st->pool->mover;
    if (st->wf[i]) {
        int code = kvt__mover_fence_wait(m, st->wf[i]);
        st->wcode[i] = st->wcode[i] ? st->wcode[i] : code;
        st->wf[i] = 0;
    }
    if (st->fpend[i]) {
        st->fcode[i] = kvt__mover_fence_wait(m, st->fence[i]);
        st->fpend[i] = 0;
        st->fence[i] = 0;
    }
    if (count)
        st->pool->pst.paused++;
}

/* The selection's residency stats, then the fused recycle of every due
 * stable head: evicted pages' device blocks go straight to promoted pages,
 * and each sequence's promotions leave as one urgent mover batch. */
static int kvt__recycle(kvt_step *st, uint32_t layer, const uint32_t *sel_pages)
{
    kvt_pool *p = st->pool;
    kvt__arena *dev = &p->tier[KVT_TIER_DEVICE];
    const uint32_t H = st->H, P = st->P;
    kvt__evc *ev = st->ev;
    uint32_t *pml = st->pml;
    size_t k = 0;
    int rc = 0;
    for (uint32_t i = 0; i < st->n && !rc; i++) {
        kvt__seq *s = st->seqs[i];
        if (st->fcode[i]) { /* an earlier layer's failure no decode reported */
            const int32_t w = st->wcode[i];
            st->wcode[i] = 0;
            kvt__fail_reset(st, i);
            st->wcode[i] = w;
        }
        if (st->wf[i]) {
            /* Warm-up's pages still arriving can be neither evicted nor
             * counted: a sequence that reranks a stable head now waits for
             * them here (kvt_step_ready told the engine it was not ready). */
            bool due = false;
            for (uint32_t h = 0; h < H && !due; h++)
                due = st->sel_rr[(size_t)i * H + h] && kvt__stable(p, kvt__lh(p, layer, h));
            if (due) {
                kvt__settle(st, i, true);
                if (st->wcode[i]) { /* it failed: every head rescores next step */
                    const int32_t w = st->wcode[i];
                    kvt__fail_reset(st, i);
                    st->wcode[i] = w; /* and the decode reports it */
                }
            }
        }
        st->pm_off[i] = (uint32_t)k;
        st->pm_cnt[i] = 0;
        const uint32_t tokens = s->n_tokens[layer], np = kvt__pages_for(p, tokens);
        for (uint32_t h = 0; h < H && !rc; h++) {
            const size_t lh = kvt__lh(p, layer, h), base = lh * s->cap_pages;
            const size_t ih = (size_t)i * H + h;
            if (st->sel_rr[ih])
                p->pst.reranked++;
            if (!kvt__stable(p, lh))
                continue;
            const uint32_t *sel = sel_pages + st->sel_off[ih];
            const uint32_t cnt = st->sel_cnt[ih];
            uint32_t hit = 0;
            for (uint32_t j = 0; j < cnt; j++)
                hit += (s->res[base + sel[j]] & KVT_RES_DEVICE) != 0;
            p->pst.sel_pages += cnt;
            p->pst.sel_resident += hit;
            if (!st->sel_rr[ih])
                continue; /* reuses its top-K pages, already on device */
            const uint32_t sink = p->pol->sink[lh], local = p->pol->local[lh];
            uint32_t npro = 0, nev = 0, stuck = 0, ntop = 0;
            for (uint32_t pg = 0, j = 0; pg < np; pg++) {
                const size_t e = base + pg;
                const bool selected = j < cnt && sel[j] == pg;
                j += selected;
                const bool forced = kvt__forced(pg, np, tokens, P, sink, local);
                uint8_t r = s->res[e];
                if (selected) {
                    ntop += !forced;
                    if (r & KVT__RES_INBOUND)
                        continue; /* on its way (warm-up); the decode waits for it */
                    if (!(r & KVT_RES_DEVICE) && (r & KVT__RES_BUSY)) {
                        /* Moving between other tiers: let it land first. */
                        kvt__mover_drain_seq(p->mover, s);
                        r = s->res[e];
                    }
                    if (!(r & KVT_RES_DEVICE))
                        pml[npro++] = pg;
                } else if ((r & KVT_RES_DEVICE) && !forced) {
                    if (!(r & KVT__RES_BUSY) && (r & (KVT_RES_HOST | KVT_RES_DISK)))
                        ev[nev++] = (kvt__evc){s->imp[e], pg};
                    else
                        stuck++;
                }
            }
            /* Lookahead eviction: up to K x window non-forced pages stay,
             * the evictable ones with the highest current scores. */
            const uint64_t kw = (uint64_t)st->k[lh] * p->pol->window[lh];
            const uint64_t used = (uint64_t)ntop + stuck;
            uint64_t room = kw > used ? kw - used : 0;
            uint32_t keep = 0;
            if (room && nev) {
                if (room >= nev) {
                    keep = nev;
                } else {
                    qsort(ev, nev, sizeof *ev, kvt__evc_desc);
                    keep = (uint32_t)room;
                }
            }
            const kvt__evc *evs = ev + keep;
            const uint32_t nevict = nev - keep;
            const uint32_t deficit = npro > nevict ? npro - nevict : 0;
            if (deficit > dev->n_free || k + npro > st->cap_pm) {
                rc = deficit > dev->n_free
                         ? kvt__err(KVT_ENOSPC, "device tier: sequence %u layer %u head %u "
                                    "promotes %u pages, %u blocks free after %u evictions",
                                    i, layer, h, npro, dev->n_free, nevict)
                         : kvt__err(KVT_EINTERNAL, "step: promotions exceed the %zu the plan "
                                    "sized", st->cap_pm);
                if (s->topk_k)
                    s->topk_k[lh] = 0;
                break;
            }
            for (uint32_t x = 0; x < npro; x++) {
                const uint32_t pg = pml[x];
                const uint8_t r = s->res[base + pg];
                uint32_t blk;
                if (x < nevict) { /* the evicted page's block, handed over in place */
                    const size_t ee = base + evs[x].page;
                    blk = s->dev_block[ee];
                    s->dev_block[ee] = 0;
                    s->res[ee] &= (uint8_t)~KVT_RES_DEVICE;
                    s->pages_in_tier[KVT_TIER_DEVICE]--;
                    p->pages_in_tier[KVT_TIER_DEVICE]--;
                    kvt__dirty(p, s, lh, evs[x].page);
                    p->pst.recycled++;
                    p->pst.evicted++;
                } else {
                    blk = kvt__arena_alloc(dev);
                }
                st->pm[k] = (kvt_move){st->ids[i], layer, h, pg,
                                       (r & KVT_RES_HOST) ? KVT_TIER_HOST : KVT_TIER_DISK,
                                       KVT_TIER_DEVICE, 0};
                st->pmdst[k] = blk;
                st->pmres[k] = 0;
                k++;
                kvt__dirty(p, s, lh, pg);
            }
            for (uint32_t x = npro; x < nevict; x++) {
                kvt__page_drop(p, s, base + evs[x].page, KVT_TIER_DEVICE);
                p->pst.evicted++;
            }
        }
        const uint32_t off = st->pm_off[i], cnt = (uint32_t)k - off;
        if (cnt && !rc) {
            kvt_fence f;
            rc = kvt__mover_submit(p->mover, st->pm + off, cnt, KVT_SUBMIT_URGENT,
                                   st->pmres + off, &f, st->pmdst + off,
                                   KVT__OPF_PROMOTE | KVT__OPF_HANDED | KVT__OPF_OWNED);
            if (rc) {
                k = off;
            } else {
                st->pm_cnt[i] = cnt;
                st->fence[i] = f;
                st->fpend[i] = 1;
                p->pst.promoted += cnt;
            }
        }
        if (rc) {
            /* Nothing of this sequence was submitted: its handed blocks go
             * back. It and the sequences not reached hold selections whose
             * pages are not all on device: their heads of this layer
             * rescore at the next step. */
            for (uint32_t x = off; x < off + cnt; x++)
                kvt__arena_free(dev, st->pmdst[x]);
            for (uint32_t j = i; j < st->n; j++)
                for (uint32_t h = 0; h < H && st->seqs[j]->topk_k; h++)
                    st->seqs[j]->topk_k[kvt__lh(p, layer, h)] = 0;
        }
    }
    if (rc)
        st->sel_layer = KVT__NO_LAYER;
    return rc;
}

/* Promotions of a layer whose decode never ran land before the next
 * selection. */
static void kvt__settle_orphans(kvt_step *st)
{
    for (uint32_t i = 0; i < st->n; i++)
        if (st->fpend[i]) {
            kvt__settle(st, i, false);
            const int32_t w = st->wcode[i]; /* warm-up's outcome stays for the decode */
            st->wcode[i] = 0;
            kvt__fail_reset(st, i);
            st->wcode[i] = w;
        }
}

static int kvt__select(kvt_step *st, uint32_t layer, const float *q)
{
    int rc = kvt__step_enter(st, layer);
    if (rc)
        return rc;
    const bool dense = (st->flags & KVT_STEP_DENSE) != 0;
    KVT__CHECK_NULL(q);
    if (st->pool->cu) {
        st->sel_layer = KVT__NO_LAYER;
        st->emptied_layer = KVT__NO_LAYER; /* the selection rewrites the items */
        if (st->tiered)
            kvt__settle_orphans(st);
        rc = kvt__cuda_step_select(st, layer, q);
        if (!rc && kvt__cuda_lower(st->pool)) {
            /* Lower tiers: the host places the pages, as on the CPU. */
            const uint32_t *sp = NULL;
            rc = kvt__cuda_step_fetch(st, layer, &sp);
            if (!rc && st->tiered)
                rc = kvt__recycle(st, layer, sp);
        }
        if (!rc)
            st->sel_layer = layer;
        return rc;
    }
    /* Offsets from each (sequence, head)'s bound; the plan sized sel_pages
     * for the largest length a sequence can reach in this step. */
    size_t off = 0;
    for (uint32_t i = 0; i < st->n; i++) {
        const uint32_t np = kvt__pages_for(st->pool, st->seqs[i]->n_tokens[layer]);
        for (uint32_t h = 0; h < st->H; h++) {
            const size_t b = (size_t)layer * st->H + h;
            st->sel_off[(size_t)i * st->H + h] = (uint32_t)off;
            off += dense ? np : kvt__sel_bound(np, st->k[b], st->sink[b], st->local[b]);
        }
    }
    if (off > st->cap_sel)
        return kvt__err(KVT_EINTERNAL, "step: selection needs %zu entries, the plan sized %zu",
                        off, st->cap_sel);
    if (st->tiered)
        kvt__settle_orphans(st);
    st->layer = layer;
    st->q = q;
    st->sel_layer = KVT__NO_LAYER;
    kvt__tp_run(&st->pool->tp, kvt__sel_task, st, st->n * st->H);
    st->sel_layer = layer;
    if (st->prof && !dense && !st->recorded[layer]) {
        st->recorded[layer] = 1;
        if ((rc = kvt__step_record(st, layer)))
            return rc;
    }
    if (st->tiered)
        return kvt__recycle(st, layer, st->sel_pages);
    return 0;
}

KVT_API int kvt_step_select(kvt_step *st, uint32_t layer, const float *q)
{
    return kvt__select(st, layer, q);
}

KVT_API int kvt_rerank_recycle(kvt_step *st, uint32_t layer, const float *q)
{
    return kvt__select(st, layer, q);
}

/* ---- sparse decode ------------------------------------------------------ */
static void kvt__merge(kvt_step *st, uint32_t ih)
{
    const uint32_t G = st->G, D = st->D, i = ih / st->H, h = ih % st->H;
    const size_t pf = 2u * (size_t)G + (size_t)G * D;
    const uint32_t t0 = st->task0[ih], nt = st->ntask[ih];
    float *out = st->out + ((size_t)i * st->Hq + (size_t)h * G) * D;
    float *lse = st->lse ? st->lse + (size_t)i * st->Hq + (size_t)h * G : NULL;
    for (uint32_t g = 0; g < G; g++) {
        float M = -INFINITY;
        for (uint32_t t = 0; t < nt; t++) {
            const float m = st->part[(t0 + t) * pf + g];
            M = m > M ? m : M;
        }
        float *o = out + (size_t)g * D;
        memset(o, 0, D * sizeof *o);
        float Lsum = 0.0f;
        if (M != -INFINITY) {
            for (uint32_t t = 0; t < nt; t++) {
                const float *pt = st->part + (t0 + t) * pf;
                if (pt[g] == -INFINITY)
                    continue;
                const float w = expf(pt[g] - M);
                Lsum += pt[G + g] * w;
                const float *acc = pt + 2u * G + (size_t)g * D;
                for (uint32_t d = 0; d < D; d++)
                    o[d] += acc[d] * w;
            }
        }
        if (Lsum > 0.0f) {
            const float inv = 1.0f / Lsum;
            for (uint32_t d = 0; d < D; d++)
                o[d] *= inv;
        }
        if (lse)
            lse[g] = Lsum > 0.0f ? M + logf(Lsum) : -INFINITY;
    }
}

static void kvt__dec_task(void *ctx, uint32_t t, uint32_t thread)
{
    kvt_step *st = ctx;
    const kvt_pool *p = st->pool;
    const uint32_t G = st->G, D = st->D, P = st->P;
    const uint32_t ih = st->task_ih[t], i = ih / st->H, h = ih % st->H;
    const kvt__seq *s = st->seqs[i];
    const uint32_t tokens = s->n_tokens[st->layer];
    uint8_t *mem = st->tmem + (size_t)thread * st->tstride;
    float *qs = (float *)mem;
    float *sbuf = qs + (size_t)G * D;
    const uint8_t **blocks = (const uint8_t **)(void *)(sbuf + (size_t)G * P);
    uint32_t *ntok = (uint32_t *)(void *)(blocks + KVT__CHUNK_PAGES);
    const float *q = st->q + ((size_t)i * st->Hq + (size_t)h * G) * D;
    for (size_t j = 0; j < (size_t)G * D; j++)
        qs[j] = q[j] * st->scale;

    const size_t pf = 2u * (size_t)G + (size_t)G * D;
    float *m = st->part + (size_t)t * pf, *l = m + G, *acc = l + G;
    for (uint32_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, (size_t)G * D * sizeof *acc);

    const uint32_t *sel = st->sel_pages + st->sel_off[ih] + st->task_first[t];
    const uint32_t n = st->task_count[t];
    const size_t base = kvt__lh(p, st->layer, h) * s->cap_pages;
    for (uint32_t j = 0; j < n; j++) {
        const uint32_t pg = sel[j];
        const uint32_t db = s->dev_block[base + pg], hb = s->host_block[base + pg];
        if (db)
            blocks[j] = kvt__arena_block(&p->tier[KVT_TIER_DEVICE], db);
        else if (hb) /* CPU backend: the host tier is readable in place */
            blocks[j] = kvt__arena_block(&p->tier[KVT_TIER_HOST], hb);
        else {
            atomic_store(&st->err, 1);
            blocks[j] = kvt__arena_block(&p->tier[KVT_TIER_DEVICE], 0); /* zeros */
        }
        const uint32_t left = tokens - pg * P;
        ntok[j] = left < P ? left : P;
    }
    const kvt__attn_shape sh = {G, D, P, p->g.dtype};
    p->kern->attn(&sh, qs, blocks, ntok, n, m, l, acc, sbuf);
    if (atomic_fetch_sub_explicit(&st->pending[ih], 1, memory_order_acq_rel) == 1)
        kvt__merge(st, ih);
}

/* Builds and runs the decode tasks of the sequences whose round[i] equals
 * `round` (every sequence when round is NULL). */
static int kvt__dec_round(kvt_step *st, const uint8_t *rnd, uint8_t round)
{
    const uint32_t G = st->G, D = st->D;
    size_t nt = 0;
    for (uint32_t ih = 0; ih < st->n * st->H; ih++) {
        const uint32_t i = ih / st->H, h = ih % st->H;
        if (rnd && rnd[i] != round)
            continue;
        const uint32_t cnt = st->sel_cnt[ih];
        const uint32_t k = (cnt + KVT__CHUNK_PAGES - 1) / KVT__CHUNK_PAGES;
        if (nt + k > st->cap_tasks)
            return kvt__err(KVT_EINTERNAL, "step: decode needs more than the %zu tasks the "
                            "plan sized", st->cap_tasks);
        st->task0[ih] = (uint32_t)nt;
        st->ntask[ih] = k;
        atomic_store_explicit(&st->pending[ih], k, memory_order_relaxed);
        for (uint32_t c = 0; c < k; c++, nt++) {
            st->task_ih[nt] = ih;
            st->task_first[nt] = c * KVT__CHUNK_PAGES;
            st->task_count[nt] = cnt - c * KVT__CHUNK_PAGES < KVT__CHUNK_PAGES
                                     ? cnt - c * KVT__CHUNK_PAGES
                                     : KVT__CHUNK_PAGES;
        }
        if (k == 0) { /* no tokens in this layer */
            memset(st->out + ((size_t)i * st->Hq + (size_t)h * G) * D, 0,
                   (size_t)G * D * sizeof *st->out);
            if (st->lse)
                for (uint32_t g = 0; g < G; g++)
                    st->lse[(size_t)i * st->Hq + (size_t)h * G + g] = -INFINITY;
        }
    }
    if (nt)
        kvt__tp_run(&st->pool->tp, kvt__dec_task, st, (uint32_t)nt);
    return 0;
}

/* The sequences of a failed promotion (round[i] == 2): their heads rescore
 * at the next step; returns the error that names the first. */
static int kvt__dec_failed(kvt_step *st, uint32_t layer, uint8_t *rnd)
{
    int first = 0;
    uint32_t bad = 0;
    for (uint32_t i = 0; i < st->n; i++) {
        if (rnd[i] != 2)
            continue;
        if (!first) {
            first = st->fcode[i] ? st->fcode[i] : st->wcode[i];
            bad = i;
        }
        kvt__fail_reset(st, i);
    }
    for (uint32_t i = 0; i < st->n; i++)
        rnd[i] = 0;
    if (!first)
        return 0;
    char why[256];
    snprintf(why, sizeof why, "%s", kvt_last_error());
    return kvt__err(first, "sparse decode: promoted pages of sequence %u, layer %u did not "
                    "load (%s); its output is zeros, its heads rescore at the next step", bad,
                    layer, why);
}

/* Decodes on CUDA that launched ready sequences before waiting for the
 * others' promotions (a test hook: the ready-first split ran). */
uint64_t kvt__cuda_ready_first;

/* The CUDA backend's decode. With lower tiers, ready first, as on the CPU:
 * round 0 places and launches the sequences whose promotions have landed
 * (and empties those whose promotions failed: zeros, -infinity); then
 * round 1 waits on the host for each other sequence's fence and places and
 * launches those, so their copies overlap round 0's kernels. Block lists
 * come from the host tables. */
static int kvt__cuda_decode(kvt_step *st, uint32_t layer, const float *q, float *out, float *lse)
{
    if (!kvt__cuda_lower(st->pool))
        return kvt__cuda_step_decode(st, layer, q, out, lse, NULL);
    uint8_t *rnd = st->failed, *run = st->run;
    bool late = false, ready = false, skipped = false;
    for (uint32_t i = 0; i < st->n; i++) {
        rnd[i] = !st->tiered ? 0 : kvt__pending(st, i) ? 1 : (st->fcode[i] || st->wcode[i]) ? 2 : 0;
        run[i] = rnd[i] == 1 ? 0 : rnd[i] == 0 ? 1 : 2;
        late = late || rnd[i] == 1;
        ready = ready || rnd[i] == 0;
    }
    uint32_t missing = 0, miss1 = 0;
    int rc = kvt__cuda_step_place(st, layer, run, &missing);
    if (!rc)
        rc = kvt__cuda_step_decode(st, layer, q, out, lse, run);
    if (!rc && late) {
        kvt__cuda_ready_first += ready; /* round 0 decoded some before the wait */
        for (uint32_t i = 0; i < st->n; i++) {
            run[i] = 0;
            if (rnd[i] != 1)
                continue;
            kvt__settle(st, i, true);
            rnd[i] = (st->fcode[i] || st->wcode[i]) ? 2 : 1;
            run[i] = rnd[i];
        }
        rc = kvt__cuda_step_place(st, layer, run, &miss1);
        if (!rc)
            rc = kvt__cuda_step_decode(st, layer, q, out, lse, run);
        missing += miss1;
    }
    for (uint32_t i = 0; i < st->n; i++)
        skipped = skipped || rnd[i] == 2;
    if (skipped) /* the emptied items stay empty: a new decode needs a new selection */
        st->emptied_layer = layer;
    /* Sequences still pending (an error stopped round 1) settle as orphans
     * before the next selection. */
    const int rf = kvt__dec_failed(st, layer, rnd);
    rc = rc ? rc : rf;
    if (!rc && missing)
        rc = kvt__err(KVT_ESTATE, "sparse decode: %u selected page%s of layer %u %s no copy "
                      "in the device tier (the CUDA backend decodes device pages only; fetch "
                      "them with kvt_mover_submit first); they read as zeros", missing,
                      missing == 1 ? "" : "s", layer, missing == 1 ? "has" : "have");
    return rc;
}

KVT_API int kvt_sparse_decode(kvt_step *st, uint32_t layer, const float *q, float *out,
                              float *lse)
{
    int rc = kvt__step_enter(st, layer);
    if (rc)
        return rc;
    KVT__CHECK_NULL(q);
    KVT__CHECK_NULL(out);
    if (st->sel_layer != layer)
        return kvt__err(KVT_ESTATE, "layer: %u has no selection in this step (call "
                        "kvt_step_select or kvt_attend for it first)", layer);
    if (st->pool->cu && st->emptied_layer == layer)
        return kvt__err(KVT_ESTATE, "layer: %u's decode emptied the sequences whose promotions "
                        "failed; select the layer again before decoding it again", layer);
    if (st->pool->cu)
        return kvt__cuda_decode(st, layer, q, out, lse);
    st->layer = layer;
    st->q = q;
    st->out = out;
    st->lse = lse;
    atomic_store(&st->err, 0);
    if (!st->tiered) {
        if ((rc = kvt__dec_round(st, NULL, 0)))
            return rc;
    } else {
        /* Round 0: sequences whose promotions have landed; round 1: the
         * others, each once its copies are in; round 2: failed copies. */
        uint8_t *rnd = st->failed;
        for (uint32_t i = 0; i < st->n; i++)
            rnd[i] = kvt__pending(st, i) ? 1 : (st->fcode[i] || st->wcode[i]) ? 2 : 0;
        if ((rc = kvt__dec_round(st, rnd, 0)))
            return rc;
        bool waited = false;
        for (uint32_t i = 0; i < st->n; i++)
            if (rnd[i] == 1) {
                kvt__settle(st, i, true);
                rnd[i] = (st->fcode[i] || st->wcode[i]) ? 2 : 1;
                waited = true;
            }
        if (waited && (rc = kvt__dec_round(st, rnd, 1)))
            return rc;
        /* The heads whose pages did not arrive rescore at the next step;
         * this layer's output of the sequence is not computed. */
        for (uint32_t i = 0; i < st->n; i++) {
            if (rnd[i] != 2)
                continue;
            memset(out + (size_t)i * st->Hq * st->D, 0,
                   (size_t)st->Hq * st->D * sizeof *out);
            if (lse)
                for (uint32_t g = 0; g < st->Hq; g++)
                    lse[(size_t)i * st->Hq + g] = -INFINITY;
        }
        if ((rc = kvt__dec_failed(st, layer, rnd)))
            return rc;
    }
    if (atomic_load(&st->err))
        return kvt__err(KVT_ESTATE, "sparse decode: a selected page of layer %u lives only on "
                        "disk; fetch it to the device or host tier (kvt_mover_submit) first",
                        layer);
    return 0;
}

KVT_API int kvt_attend(kvt_step *st, uint32_t layer, const float *q, float *out, float *lse)
{
    if (!st)
        return kvt__err(KVT_EINVAL, "step: must not be NULL");
    KVT__CHECK_NULL(q);
    KVT__CHECK_NULL(out);
    int rc = kvt_step_select(st, layer, q);
    if (rc)
        return rc;
    return kvt_sparse_decode(st, layer, q, out, lse);
}

KVT_API int kvt_step_selection(const kvt_step *st, uint32_t layer, uint32_t seq_index,
                               uint32_t kv_head, uint32_t *pages, uint32_t capacity,
                               uint32_t *n_pages, uint32_t *reranked)
{
    if (!st)
        return kvt__err(KVT_EINVAL, "step: must not be NULL");
    if (!st->open)
        return kvt__err(KVT_ESTATE, "step: already finished (a stale plan)");
    if (layer >= st->L)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, st->L);
    if (seq_index >= st->n)
        return kvt__err(KVT_EINVAL, "seq_index: %u >= the plan's %u sequences", seq_index,
                        st->n);
    if (kv_head >= st->H)
        return kvt__err(KVT_EINVAL, "kv_head: %u >= n_kv_heads %u", kv_head, st->H);
    KVT__CHECK_NULL(n_pages);
    if (st->sel_layer != layer)
        return kvt__err(KVT_ESTATE, "layer: %u has no selection in this step", layer);
    const size_t ih = (size_t)seq_index * st->H + kv_head;
    if (st->pool->cu) {
        if (capacity)
            KVT__CHECK_NULL(pages);
        int rc = kvt__cuda_step_selection(st, ih, pages, capacity, n_pages);
        if (!rc && reranked)
            *reranked = st->sel_rr[ih];
        return rc;
    }
    const uint32_t cnt = st->sel_cnt[ih];
    if (cnt > capacity)
        return kvt__err(KVT_ERANGE, "capacity: %u entries, the selection has %u", capacity,
                        cnt);
    if (capacity)
        KVT__CHECK_NULL(pages);
    if (cnt)
        memcpy(pages, st->sel_pages + st->sel_off[ih], cnt * sizeof *pages);
    *n_pages = cnt;
    if (reranked)
        *reranked = st->sel_rr[ih];
    return 0;
}
