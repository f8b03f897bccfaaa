/* The CUDA backend of a pool (built when nvcc exists): the device tier and
 * the metadata store in GPU memory, the per-layer calls as the kernels of
 * cuda/ on the step's stream.
 *
 * The planner stays on the host: it allocates blocks in the host-side
 * tables as on the CPU backend; the GPU holds a copy of each sequence's
 * device and metadata tables (in one table heap, so a kernel reaches every
 * sequence's table from one pointer), updated by the uploads of whole
 * tables when a sequence's table grows and otherwise by the entries each
 * append adds, synced by the UVA table kernel from pinned staging. A step's
 * per-layer calls only fill pinned item arrays (one slice per layer, so the
 * host never rewrites what a queued upload will read), queue their upload to
 * device copies on the step's stream and launch; nothing
 * waits for the GPU except the calls that return data to the host
 * (kvt_step_selection_get, kvt_seq_read_kv, kvt_seq_page_meta_get, kvt_pool_check)
 * and a prefill kvt_seq_append, which returns once its kernel has read the
 * caller's rows. The next plan waits for the previous step's event before
 * reusing the pinned arrays.
 *
 * Pools with a host tier (pinned: the NUMA-placed arena registered with
 * CUDA, mapped) and a disk tier keep the placement on the host too: the
 * selection of each layer comes back to the host (one wait on the step's
 * stream), the host's placement (lib/tier/place.c, the step's fused
 * recycle) decides promotions and evictions as on the CPU backend, and the
 * tier mover copies pages between the tiers on its own low-priority
 * streams, each batch after an event recorded when it was submitted. The
 * decode goes ready first (lib/attn/step.c): the sequences whose
 * promotions have landed are launched, then each other one waits on the
 * host for its fence and those are launched; the block list a launch reads
 * is built from the host tables and uploaded,
 * and the table entries the host changed reach the GPU copy as dirty
 * ranges (the UVA table kernel). kvt_seq_warmup scores on the GPU
 * (cuda/warm.cu: one batched SGEMM per layer, cuBLAS when it loads) and
 * places on the host. The profiler is refused with KVT_ENOTSUP. */
#include "cuda_int.h"


uint32_t kvt__cup_slot(const kvt_pool *p, const kvt__seq *s)
{
    return (uint32_t)(s - p->seqs);
}

void kvt__cup_pin_free(void **h)
{
    kvt__cu_host_free(*h);
    *h = NULL;
}

void kvt__cup_dev_free(void **d)
{
    kvt__cu_free(*d);
    *d = NULL;
}

/* Everything queued on the pool's and the step's streams has finished. */
int kvt__cup_quiesce(struct kvt__cuda *c)
{
    int rc = kvt__cu_stream_sync(c->stream);
    if (!rc && c->sst && c->sst != c->stream)
        rc = kvt__cu_stream_sync(c->sst);
    if (!rc && c->done_pending) {
        rc = kvt__cu_event_sync(c->done);
        c->done_pending = rc != 0;
    }
    return rc;
}

/* Orders the pool's stream after the last finished step's work (which may
 * still run on the engine's stream) on the GPU, without a host wait: for
 * work between steps that writes what that step's kernels read - blocks a
 * release has freed since, the tables, a sequence's open page. */
int kvt__cup_after_step(struct kvt__cuda *c)
{
    return !c->sst && c->done_pending ? kvt__cu_stream_wait_event(c->stream, c->done) : 0;
}

int kvt__cuda_pool_init(kvt_pool *p, const kvt_pool_opts *o)
{
    const char *why = "";
    const int n = kvt__cu_device_count(&why);
    if (n <= 0)
        return kvt__err(KVT_ENOTSUP, "opts->backend: KVT_BACKEND_CUDA needs a usable CUDA "
                        "device: %s", why);
    if (o->cuda_device < 0 || o->cuda_device >= n)
        return kvt__err(KVT_EINVAL, "opts->cuda_device: %d, the machine has %d CUDA device%s",
                        (int)o->cuda_device, n, n == 1 ? "" : "s");
    /* The geometry's own limits today; kept so a wider geometry cannot
     * reach kernels that were not written for it. */
    const uint32_t D = p->g.head_dim, P = p->g.page_tokens;
    if (D % 8 || D > 1024 || P < 8 || P > 256 || (P & (P - 1)))
        return kvt__err(KVT_ENOTSUP, "opts->geom: the CUDA kernels need head_dim a multiple "
                        "of 8 up to 1024 and page_tokens a power of two in 8..256 (have %u, %u)",
                        D, P);
    /* kvt__cu_attn serves G 1..64 and head_dim up to 256. */
    if (D > 256 || p->g.n_q_heads / p->g.n_kv_heads > 64)
        return kvt__err(KVT_ENOTSUP, "opts->geom: the CUDA decode kernel needs head_dim up to "
                        "256 and at most 64 query heads per KV head (have %u, %u)", D,
                        p->g.n_q_heads / p->g.n_kv_heads);
    struct kvt__cuda *c = calloc(1, sizeof *c);
    if (!c)
        return kvt__err(KVT_ENOMEM, "kvt_pool_create: cannot allocate the CUDA state");
    p->cu = c;
    c->device = o->cuda_device;
    c->LH = p->g.n_layers * p->g.n_kv_heads;
    if (!(c->selected = calloc(p->g.n_layers, 1)))
        return kvt__err(KVT_ENOMEM, "kvt_pool_create: cannot allocate the CUDA state");
    int rc = kvt__cu_set_device(c->device);
    /* The default (least) priority: this stream runs prefill appends, which
     * must not outrank the engine's decode stream. */
    if (!rc)
        rc = kvt__cu_stream_create(&c->stream, 1);
    if (!rc)
        rc = kvt__cu_event_create(&c->done);
    if (!rc)
        rc = kvt__cu_event_create(&c->g_fl.ev);
    if (!rc)
        rc = kvt__cu_event_create(&c->g_cl.ev);
    if (!rc)
        rc = kvt__cu_host_alloc((void **)&c->h_zero, 16);
    if (!rc)
        memset(c->h_zero, 0, 16);
    c->lower = kvt__has_tier(p, KVT_TIER_HOST) || p->disk;
    c->uva_direct = kvt__cu_host_ptr_direct(c->device) != 0;
    /* The host tier keeps its NUMA placement (libnuma mapped it) and is
     * pinned and mapped in place: the mover's copies are DMA, and kernels
     * may read it through UVA. */
    const kvt__arena *ht = &p->tier[KVT_TIER_HOST];
    if (!rc && ht->base) {
        if ((rc = kvt__cu_host_register(ht->base, ht->map_bytes)))
            return kvt__err(rc, "opts->host_bytes: cannot pin the host tier's %zu bytes for "
                            "the GPU (%s)", ht->map_bytes, kvt_last_error());
        c->host_reg = true;
    }
    const kvt__arena *dv = &p->tier[KVT_TIER_DEVICE];
    if (!rc)
        rc = kvt__cu_malloc((void **)&c->d_dev, (size_t)dv->n_blocks * dv->block_bytes);
    if (!rc)
        rc = kvt__cu_malloc((void **)&c->d_meta, (size_t)p->meta.n_blocks * p->meta.block_bytes);
    /* The null blocks read as zeros (kvt_pool_check verifies it). */
    if (!rc)
        rc = kvt__cu_memset_sync(c->d_dev, 0, dv->block_bytes, c->stream);
    p->meta.base = c->d_meta; /* (the null slot in both planes, below) */
    if (!rc)
        rc = kvt__cu_memset_sync(kvt__meta_mm(p, 0), 0, 2 * kvt__meta_row(p), c->stream);
    if (!rc)
        rc = kvt__cu_memset_sync(kvt__meta_mean(p, 0), 0, kvt__meta_row(p), c->stream);
    if (rc)
        return rc; /* kvt_pool_destroy releases what exists */
    p->tier[KVT_TIER_DEVICE].base = c->d_dev;
    return 0;
}

void kvt__cuda_pool_fini(kvt_pool *p)
{
    struct kvt__cuda *c = p->cu;
    if (!c)
        return;
    (void)kvt__cu_set_device(c->device);
    (void)kvt__cup_quiesce(c);
    void **d[] = {(void **)&c->d_dev, (void **)&c->d_meta, (void **)&c->d_tab,
                  (void **)&c->d_mtab, (void **)&c->d_acc, (void **)&c->d_saved,
                  (void **)&c->d_nsaved, (void **)&c->d_vote, (void **)&c->d_sel,
                  (void **)&c->d_topk, (void **)&c->d_blocks, (void **)&c->d_ntok,
                  (void **)&c->d_nsel, (void **)&c->d_ntopk, &c->d_work, (void **)&c->d_app,
                  (void **)&c->d_sc, (void **)&c->d_tk, (void **)&c->d_sf, (void **)&c->d_at,
                  (void **)&c->d_wslot, (void **)&c->d_wq, (void **)&c->d_wimp, &c->d_wwork};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        kvt__cup_dev_free(d[i]);
    void **h[] = {(void **)&c->h_app, (void **)&c->h_sc, (void **)&c->h_tk, (void **)&c->h_sf,
                  (void **)&c->h_at, (void **)&c->h_sdev, (void **)&c->h_smeta,
                  (void **)&c->h_rg, (void **)&c->h_papp, (void **)&c->h_sel,
                  (void **)&c->h_blk, (void **)&c->h_nsel, (void **)&c->h_vote,
                  (void **)&c->h_cl, (void **)&c->h_zero, (void **)&c->h_fl,
                  (void **)&c->h_flr, (void **)&c->h_wslot, (void **)&c->h_wq,
                  (void **)&c->h_wimp};
    for (size_t i = 0; i < sizeof h / sizeof h[0]; i++)
        kvt__cup_pin_free(h[i]);
    kvt__cu_blas_destroy(c->blas);
    if (c->host_reg) /* before kvt_pool_destroy unmaps the arena */
        kvt__cu_host_unregister(p->tier[KVT_TIER_HOST].base);
    kvt__cu_event_destroy(c->g_fl.ev);
    kvt__cu_event_destroy(c->g_cl.ev);
    kvt__cu_event_destroy(c->done);
    kvt__cu_stream_destroy(c->stream);
    free(c->selected);
    p->tier[KVT_TIER_DEVICE].base = NULL;
    p->meta.base = NULL;
    free(c);
    p->cu = NULL;
}

int kvt__cuda_read(const kvt_pool *p, void *dst, const void *dev_src, size_t n)
{
    struct kvt__cuda *c = p->cu;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cup_quiesce(c);
    return rc ? rc : kvt__cu_copy_sync(dst, dev_src, n, c->stream);
}

int kvt__cuda_check(const kvt_pool *p)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t H = p->g.n_kv_heads;
    uint32_t *tab = NULL, *mtab = NULL;
    size_t cap = 0;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cup_after_step(c);
    /* What the host changed since the last use goes up first (after the
     * open step's work, on its stream; after a finished step's). */
    for (uint32_t si = 0; !rc && si < p->max_seqs; si++) {
        kvt__seq *s = &p->seqs[si];
        if (s->live)
            rc = kvt__cup_tab_flush(p, &s, 1, 0, p->g.n_layers, c->sst ? c->sst : c->stream);
    }
    if (!rc)
        rc = kvt__cup_quiesce(c);
    for (uint32_t si = 0; !rc && si < p->max_seqs; si++) {
        const kvt__seq *s = &p->seqs[si];
        if (!s->live || !s->be.cu_cap || s->be.cu_cap != s->cap_pages)
            continue; /* not placed: uploaded whole at its next use */
        const size_t n = (size_t)c->LH * s->cap_pages;
        if (n > cap) {
            free(tab);
            free(mtab);
            tab = malloc(n * sizeof *tab);
            mtab = malloc(n * sizeof *mtab);
            cap = n;
            if (!tab || !mtab) {
                rc = kvt__err(KVT_ENOMEM, "kvt_pool_check: cannot allocate a table copy");
                break;
            }
        }
        if (s->be.cu_off + n > c->tab_cap) {
            rc = kvt__err(KVT_EINTERNAL, "CUDA table heap: sequence slot %u lies past its "
                          "end", si);
            break;
        }
        if ((rc = kvt__cu_copy_sync(tab, c->d_tab + s->be.cu_off, n * sizeof *tab, c->stream)) ||
            (rc = kvt__cu_copy_sync(mtab, c->d_mtab + s->be.cu_off, n * sizeof *mtab, c->stream)))
            break;
        for (uint32_t lh = 0; !rc && lh < c->LH; lh++) {
            const uint32_t np = kvt__pages_for(p, s->n_tokens[lh / H]);
            for (uint32_t pg = 0; pg < np; pg++) {
                const size_t e = (size_t)lh * s->cap_pages + pg;
                if (tab[e] != s->dev_block[e] || mtab[e] != s->meta_slot[e]) {
                    rc = kvt__err(KVT_EINTERNAL, "CUDA table copy: slot %u layer %u head %u "
                                  "page %u holds block %u slot %u, the host table %u and %u",
                                  si, lh / H, lh % H, pg, tab[e], mtab[e], s->dev_block[e],
                                  s->meta_slot[e]);
                    break;
                }
            }
        }
    }
    free(tab);
    free(mtab);
    return rc;
}

/* ---- per-sequence device state ------------------------------------------ */

/* Grows a device buffer to `bytes`, keeping the first `keep` bytes (the
 * streams are quiet). */
int kvt__cup_dev_grow(void **d, size_t keep, size_t bytes, void *stream)
{
    void *n;
    int rc = kvt__cu_malloc(&n, bytes);
    if (rc)
        return rc;
    if (keep && (rc = kvt__cu_copy_sync(n, *d, keep, stream))) {
        kvt__cu_free(n);
        return rc;
    }
    kvt__cu_free(*d);
    *d = n;
    return 0;
}

/* Uploads a sequence's whole tables to its place in the heap. */
static int kvt__tab_upload(kvt_pool *p, kvt__seq *s)
{
    struct kvt__cuda *c = p->cu;
    const size_t n = (size_t)c->LH * s->cap_pages * sizeof(uint32_t);
    for (uint32_t lh = 0; lh < c->LH; lh++) { /* nothing left to flush */
        s->be.cu_lo[lh] = UINT32_MAX;
        s->be.cu_hi[lh] = 0;
    }
    int rc = kvt__cu_copy_sync(c->d_tab + s->be.cu_off, s->dev_block, n, c->stream);
    return rc ? rc : kvt__cu_copy_sync(c->d_mtab + s->be.cu_off, s->meta_slot, n, c->stream);
}

/* Makes the GPU copy of s's tables current for its capacity: a sequence
 * whose table grew (or is new) takes a fresh place in the heap; a full heap
 * is rebuilt, packed, from the host tables of every live sequence. */
int kvt__cup_tab_place(kvt_pool *p, kvt__seq *s)
{
    struct kvt__cuda *c = p->cu;
    if (s->be.cu_cap == s->cap_pages && s->be.cu_cap)
        return 0;
    if (!s->be.cu_lo) { /* from now on kvt__dirty records what the copy misses */
        s->be.cu_lo = malloc((size_t)c->LH * sizeof *s->be.cu_lo);
        s->be.cu_hi = malloc((size_t)c->LH * sizeof *s->be.cu_hi);
        if (!s->be.cu_lo || !s->be.cu_hi) {
            free(s->be.cu_lo);
            free(s->be.cu_hi);
            s->be.cu_lo = s->be.cu_hi = NULL;
            return kvt__err(KVT_ENOMEM, "CUDA backend: cannot allocate a sequence's dirty "
                            "ranges");
        }
    }
    const uint64_t need = (uint64_t)c->LH * s->cap_pages;
    int rc;
    if (c->tab_used + need > c->tab_cap) {
        uint64_t live = need;
        for (uint32_t i = 0; i < p->max_seqs; i++)
            if (p->seqs[i].live && &p->seqs[i] != s && p->seqs[i].be.cu_cap)
                live += (uint64_t)c->LH * p->seqs[i].cap_pages; /* re-placed at cap_pages */
        /* Half free after the rebuild; stale regions do not make it grow. */
        uint64_t cap = c->tab_cap > live * 2 ? c->tab_cap : live * 2;
        if (cap < 4096)
            cap = 4096;
        if ((rc = kvt__cup_quiesce(c)))
            return rc;
        kvt__cup_dev_free((void **)&c->d_tab);
        kvt__cup_dev_free((void **)&c->d_mtab);
        c->tab_cap = c->tab_used = 0;
        if ((rc = kvt__cu_malloc((void **)&c->d_tab, cap * sizeof(uint32_t))) ||
            (rc = kvt__cu_malloc((void **)&c->d_mtab, cap * sizeof(uint32_t)))) {
            for (uint32_t i = 0; i < p->max_seqs; i++)
                p->seqs[i].be.cu_cap = 0;
            return rc;
        }
        c->tab_cap = cap;
        for (uint32_t i = 0; i < p->max_seqs; i++) {
            kvt__seq *o = &p->seqs[i];
            if (!o->live || o == s || !o->be.cu_cap)
                continue;
            o->be.cu_off = c->tab_used;
            c->tab_used += (uint64_t)c->LH * o->cap_pages;
            o->be.cu_cap = o->cap_pages;
            if ((rc = kvt__tab_upload(p, o))) {
                for (uint32_t j = 0; j < p->max_seqs; j++)
                    p->seqs[j].be.cu_cap = 0; /* every copy is now suspect */
                return rc;
            }
        }
    } else if ((rc = kvt__cup_quiesce(c))) { /* queued kernels may read the old place */
        return rc;
    }
    s->be.cu_off = c->tab_used;
    c->tab_used += need;
    s->be.cu_cap = s->cap_pages;
    if ((rc = kvt__tab_upload(p, s)))
        s->be.cu_cap = 0;
    return rc;
}


/* Waits until the guarded buffers may be written again. */
int kvt__cup_guard_wait(kvt__guard *g)
{
    if (!g->pending)
        return 0;
    int rc = kvt__cu_event_sync(g->ev);
    g->pending = rc != 0;
    return rc;
}

/* The work just queued on `stream` reads the guarded buffers. */
int kvt__cup_guard_set(kvt__guard *g, void *stream)
{
    const int rc = kvt__cu_event_record(g->ev, stream);
    g->pending = rc == 0;
    if (rc) /* nothing tells when it ends: wait for it, report the failure */
        (void)kvt__cu_stream_sync(stream);
    return rc;
}

/* Queues on `stream` the sync of the device-table entries the host changed
 * (kvt__dirty) in layers [l0, l1) of seqs[n] to their GPU copies, by the
 * UVA table kernel from pinned staging. Sequences whose copy is not placed
 * are uploaded whole at their next use. */
int kvt__cup_tab_flush(const kvt_pool *p, kvt__seq *const *seqs, uint32_t n, uint32_t l0,
                       uint32_t l1, void *stream)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t H = p->g.n_kv_heads;
    size_t ne = 0, nr = 0;
    for (uint32_t i = 0; i < n; i++) {
        const kvt__seq *s = seqs[i];
        if (!s->be.cu_lo || s->be.cu_cap != s->cap_pages || !s->be.cu_cap)
            continue;
        for (size_t lh = (size_t)l0 * H; lh < (size_t)l1 * H; lh++)
            if (s->be.cu_lo[lh] <= s->be.cu_hi[lh]) {
                ne += s->be.cu_hi[lh] - s->be.cu_lo[lh] + 1u;
                nr++;
            }
    }
    if (!nr)
        return 0;
    int rc = kvt__cup_guard_wait(&c->g_fl);
    if (rc)
        return rc;
    if (ne > c->cap_fl) {
        c->cap_fl = 0;
        if ((rc = kvt__cup_pin_grow((void **)&c->h_fl, ne * 2, sizeof *c->h_fl)))
            return rc;
        c->cap_fl = ne * 2;
    }
    if (nr > c->cap_flr) {
        c->cap_flr = 0;
        if ((rc = kvt__cup_pin_grow((void **)&c->h_flr, nr * 2, sizeof *c->h_flr)))
            return rc;
        c->cap_flr = nr * 2;
    }
    size_t e = 0, r = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvt__seq *s = seqs[i];
        if (!s->be.cu_lo || s->be.cu_cap != s->cap_pages || !s->be.cu_cap)
            continue;
        for (size_t lh = (size_t)l0 * H; lh < (size_t)l1 * H; lh++) {
            const uint32_t lo = s->be.cu_lo[lh], hi = s->be.cu_hi[lh];
            if (lo > hi)
                continue;
            const size_t at = lh * s->cap_pages + lo;
            memcpy(c->h_fl + e, s->dev_block + at, (size_t)(hi - lo + 1u) * sizeof *c->h_fl);
            c->h_flr[r++] = (kvt__cu_range){e, s->be.cu_off + at, hi - lo + 1u, 0};
            e += hi - lo + 1u;
            s->be.cu_lo[lh] = UINT32_MAX;
            s->be.cu_hi[lh] = 0;
        }
    }
    rc = kvt__cu_table_sync(c->h_fl, c->d_tab, c->h_flr, (uint32_t)nr, stream);
    if (!rc)
        rc = kvt__cup_guard_set(&c->g_fl, stream);
    if (rc) /* the copies are suspect: upload them whole at their next use */
        for (uint32_t i = 0; i < n; i++)
            seqs[i]->be.cu_cap = 0;
    return rc;
}

/* Accumulators and saved top-K sets for slots up to s's, and K up to kmax. */
int kvt__cup_slot_state(kvt_pool *p, kvt__seq *s, uint32_t kmax)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t slot = kvt__cup_slot(p, s), D = p->g.head_dim;
    int rc;
    if (slot >= c->acc_slots) {
        uint32_t n = c->acc_slots ? c->acc_slots : 8;
        while (n <= slot)
            n *= 2;
        if (n > p->max_seqs)
            n = p->max_seqs;
        const size_t per = (size_t)c->LH * 3 * D * sizeof(float);
        if ((rc = kvt__cup_quiesce(c)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_acc, per * c->acc_slots, per * n, c->stream)))
            return rc;
        c->acc_slots = n;
    }
    if (kmax > c->kcap || slot >= c->saved_slots) {
        const uint32_t kcap = kmax > c->kcap ? kmax : c->kcap;
        uint32_t n = c->saved_slots ? c->saved_slots : 8;
        while (n <= slot)
            n *= 2;
        if (n > p->max_seqs)
            n = p->max_seqs;
        if ((rc = kvt__cup_quiesce(c)))
            return rc;
        const size_t rows = (size_t)c->saved_slots * c->LH;
        if (kcap == c->kcap) {
            rc = kvt__cup_dev_grow((void **)&c->d_saved, rows * kcap * 4,
                               (size_t)n * c->LH * (kcap ? kcap : 1) * 4, c->stream);
        } else {
            /* A larger K: every saved set keeps its pages at the new stride
             * (the CPU backend keeps them too; only heads whose K changed
             * rerank). */
            uint32_t *nw;
            kvt__cu_copy *list = rows && c->kcap ? malloc(rows * sizeof *list) : NULL;
            if (rows && c->kcap && !list)
                return kvt__err(KVT_ENOMEM, "CUDA backend: cannot allocate a copy list");
            rc = kvt__cu_malloc((void **)&nw, (size_t)n * c->LH * kcap * 4);
            for (size_t r = 0; !rc && list && r < rows; r++)
                list[r] = (kvt__cu_copy){(uint64_t)(uintptr_t)(c->d_saved + r * c->kcap),
                                         (uint64_t)(uintptr_t)(nw + r * kcap),
                                         (uint64_t)c->kcap * 4};
            if (!rc && list)
                rc = kvt__cu_copy_memcpy(list, (uint32_t)rows, c->stream);
            if (!rc && list)
                rc = kvt__cu_stream_sync(c->stream);
            free(list);
            if (rc) {
                kvt__cu_free(nw);
                return rc;
            }
            kvt__cu_free(c->d_saved);
            c->d_saved = nw;
        }
        if (rc || (rc = kvt__cup_dev_grow((void **)&c->d_nsaved, rows * 4, (size_t)n * c->LH * 4,
                                      c->stream)))
            return rc;
        c->saved_slots = n;
        c->kcap = kcap;
    }
    return 0;
}

/* Grows a pinned array to n elements of sz bytes (contents dropped). */
int kvt__cup_pin_grow(void **h, size_t n, size_t sz)
{
    kvt__cup_pin_free(h);
    if (n > SIZE_MAX / sz)
        return kvt__err(KVT_EOVERFLOW, "CUDA backend: %zu items overflow", n);
    return kvt__cu_host_alloc(h, n * sz);
}

int kvt__cuda_seq_append(kvt_pool *p, kvt__seq *s, uint32_t layer, const void *k,
                         const void *v, uint32_t n, uint32_t cur, kvt_dtype src_dtype,
                         uint64_t token_stride)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t H = p->g.n_kv_heads, D = p->g.head_dim, P = p->g.page_tokens;
    int rc = kvt__cu_set_device(c->device);
    /* An open step's queued appends may touch this sequence's open page:
     * they go first (the pool's stream does not order with the step's). */
    if (!rc && c->sst)
        rc = kvt__cu_stream_sync(c->sst);
    /* A finished step's kernels may still run on the engine's stream:
     * they read blocks a release has since freed (which this append may
     * take) and append to the page this one extends. */
    if (!rc)
        rc = kvt__cup_after_step(c);
    if (!rc)
        rc = kvt__cup_slot_state(p, s, 0);
    if (rc)
        return rc;
    if (s->be.cu_cap != s->cap_pages || !s->be.cu_cap) {
        if ((rc = kvt__cup_tab_place(p, s))) /* uploads the new entries too */
            return rc;
    } else {
        /* Only the entries of the pages this append opened (the pool's
         * stream is idle: the last prefill waited for its kernel). */
        const uint32_t p0 = cur / P + (cur % P != 0), p1 = (cur + n + P - 1) / P;
        for (uint32_t h = 0; h < H && p1 > p0; h++) {
            const size_t e = kvt__lh(p, layer, h) * s->cap_pages + p0;
            const size_t bytes = (size_t)(p1 - p0) * sizeof(uint32_t);
            if ((rc = kvt__cu_copy_sync(c->d_tab + s->be.cu_off + e, s->dev_block + e, bytes,
                                        c->stream)) ||
                (rc = kvt__cu_copy_sync(c->d_mtab + s->be.cu_off + e, s->meta_slot + e, bytes,
                                        c->stream)))
                return rc;
        }
    }
    if ((rc = kvt__cup_tab_flush(p, &s, 1, layer, layer + 1u, c->stream)))
        return rc;
    if (H > c->cap_papp) {
        if ((rc = kvt__cup_quiesce(c)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_papp, H, sizeof *c->h_papp)))
            return rc;
        c->cap_papp = H;
    } else if ((rc = kvt__cu_stream_sync(c->stream))) { /* the last prefill's items */
        return rc;
    }
    const uint32_t slot = kvt__cup_slot(p, s);
    for (uint32_t h = 0; h < H; h++) {
        const size_t lh = kvt__lh(p, layer, h);
        c->h_papp[h] = (kvt__cu_append_item){(uint64_t)h * D, token_stride,
                                             s->be.cu_off + lh * s->cap_pages,
                                             ((uint64_t)slot * c->LH + lh) * 3u * D, cur, n};
    }
    kvt__cu_append_args a = {
        .d_items = c->h_papp, .n_items = H, .D = D, .P = P, .dtype = p->g.dtype,
        .src_dtype = src_dtype, .d_k = k, .d_v = v, .d_dev_table = c->d_tab,
        .d_meta_table = c->d_mtab, .d_dev_base = c->d_dev, .block_bytes = p->block_bytes,
        .d_meta_base = c->d_meta, .meta_bytes = p->meta_bytes, .meta_slots = p->meta.n_blocks,
        .d_acc = c->d_acc, .max_tokens = n};
    rc = kvt__cu_append(&a, c->stream);
    if (!rc)
        rc = kvt__cu_stream_sync(c->stream); /* k and v are the caller's again */
    return rc;
}

/* The table's append: the blocks come from the host tables, the bytes are
 * the kernel's (which waits, so k and v may be reused on return); all or
 * nothing, the new pages go back on failure. */
static int kvt__cup_seq_append(kvt_pool *p, kvt__seq *s, uint32_t layer, const void *k,
                               const void *v, uint32_t n, kvt_dtype src_dtype,
                               uint64_t token_stride)
{
    const uint32_t cur = s->n_tokens[layer];
    kvt__append_alloc(p, s, layer, n);
    const int rc = kvt__cuda_seq_append(p, s, layer, k, v, n, cur, src_dtype, token_stride);
    if (rc) {
        kvt__append_unalloc(p, s, layer, n);
        return rc;
    }
    s->n_tokens[layer] = cur + n;
    return 0;
}

const kvt__backend kvt__backend_cuda = {
    .version = KVT__BACKEND_V1,
    .name = "cuda",
    .built = true,
    .caps = KVT__BE_DEVICE_REMOTE | KVT__BE_NO_PROFILER | KVT__BE_NO_DENSE_TIERED |
            KVT__BE_NO_HOST_SELECT | KVT__BE_NO_MULTI_SPARSE,
    .pool_init = kvt__cuda_pool_init,
    .pool_fini = kvt__cuda_pool_fini,
    .check = kvt__cuda_check,
    .read = kvt__cuda_read,
    .write = kvt__cuda_write,
    .seq_fork = kvt__cuda_seq_fork,
    .page_rebuild = kvt__cuda_page_rebuild,
    .scratch = kvt__cuda_scratch,
    .scratch_free = kvt__cuda_scratch_free,
    .seq_append = kvt__cup_seq_append,
    .step_plan = kvt__cuda_step_plan,
    .seq_pop = kvt__cuda_seq_pop,
    .step_append = kvt__cuda_step_append,
    .step_select = kvt__cuda_step_select,
    .step_fetch = kvt__cuda_step_fetch,
    .step_place = kvt__cuda_step_place,
    .step_decode = kvt__cuda_step_decode,
    .step_selection = kvt__cuda_step_selection,
    .step_finish = kvt__cuda_step_finish,
    .batch_mark = kvt__cuda_mv_mark,
    .event_free = kvt__cuda_mv_event_free,
    .copier_open = kvt__cuda_mv_stream,
    .copier_close = kvt__cuda_mv_stream_free,
    .copy = kvt__cuda_mv_copy,
    .copier_sync = kvt__cuda_mv_sync,
    .host_pin = kvt__cuda_host_pin,
    .host_unpin = kvt__cuda_host_unpin,
    .warm_imp = kvt__cuda_warm_imp,
    .warm_topk = kvt__cuda_warm_topk,
};
