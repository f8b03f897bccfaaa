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
 * (kvt_step_selection, kvt_seq_read_kv, kvt_seq_page_meta, kvt_pool_check)
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
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/internal.h"
#include "../step/step_int.h"
#include "../../cuda/kvt_cuda.h"

/* An event recorded after the last GPU work that read a pinned buffer. */
typedef struct kvt__guard {
    void *ev;
    bool pending;
} kvt__guard;

struct kvt__cuda {
    int device;
    bool uva_direct;       /* kernels may use registered host addresses as is */
    void *stream;          /* the pool's own stream (prefill; steps without one) */
    void *done;            /* recorded when a step finishes */
    bool done_pending;
    void *sst;             /* the open step's stream */
    bool sync_calls;       /* the step named no stream: each call waits */
    uint8_t *selected;     /* [n_layers] selected in the open step */
    uint8_t *d_dev, *d_meta;
    uint32_t LH;
    /* The table heap: GPU copies of the sequences' tables. */
    uint32_t *d_tab, *d_mtab;
    uint64_t tab_cap, tab_used;
    /* Per sequence slot: open-page accumulators [LH][3][D] and saved top-K
     * sets [LH][kcap] with their counts [LH]. */
    float *d_acc;
    uint32_t acc_slots;
    uint32_t *d_saved, *d_nsaved;
    uint32_t saved_slots, kcap;
    /* Step scratch: pinned item arrays, one slice of cap_items per layer. */
    size_t cap_items;
    kvt__cu_append_item *h_app;
    kvt__cu_score_item *h_sc;
    kvt__cu_topk_item *h_tk;
    kvt__cu_sf_item *h_sf;
    kvt__cu_attn_item *h_at;
    /* ... and their device copies, uploaded on the step's stream before the
     * launches, so kernels read items from device memory, not over PCIe. */
    kvt__cu_append_item *d_app;
    kvt__cu_score_item *d_sc;
    kvt__cu_topk_item *d_tk;
    kvt__cu_sf_item *d_sf;
    kvt__cu_attn_item *d_at;
    uint32_t *h_sdev, *h_smeta; /* new table entries */
    kvt__cu_range *h_rg;
    size_t cap_pages;      /* entries of the device selection buffers */
    float *d_vote;
    uint32_t *d_sel, *d_topk, *d_blocks, *d_ntok, *d_nsel, *d_ntopk;
    size_t cap_work;
    void *d_work;
    uint32_t np_max;       /* the plan's page bound (sizes the decode split) */
    uint32_t at_sp;        /* the decode's pages per split for the plan's batch */
    /* Prefill items. */
    kvt__cu_append_item *h_papp;
    size_t cap_papp;
    /* Pools with a host or disk tier ("lower" tiers). */
    bool lower;
    bool host_reg;         /* the host arena is registered (pinned, mapped) */
    size_t cap_hp, cap_hi; /* pages / items of the buffers below */
    uint32_t *h_sel, *h_blk; /* the selection back on the host; the block list (first
                                the top-K parts back on the host) */
    uint32_t *h_nsel;      /* [2 * items]: selection counts, top-K part counts */
    float *h_vote;
    kvt__cu_copy *h_cl;    /* [3 * items + 2] copy lists */
    uint32_t *h_zero;      /* a pinned 0 (emptied decode items) */
    /* Dirty-range staging of the table flush. */
    uint32_t *h_fl;
    kvt__cu_range *h_flr;
    size_t cap_fl, cap_flr;
    /* Pinned buffers written again only once the work that read them is
     * done: the flush staging, and the copy lists with the block list. */
    kvt__guard g_fl, g_cl;
    /* kvt_seq_warmup: the cuBLAS handle (on the pool's stream; NULL when
     * libcublas did not load: the fallback kernel) and the scratch. */
    void *blas;
    bool blas_tried;
    uint32_t *h_wslot, *d_wslot;
    float *h_wq, *d_wq, *h_wimp, *d_wimp;
    size_t cap_wslot, cap_wq, cap_wimp; /* elements of the pinned arrays */
    size_t cap_wslot_d, cap_wq_d, cap_wimp_d, cap_wwork; /* bytes of the device ones */
    void *d_wwork;
};

static int kvt__tab_flush(const kvt_pool *p, kvt__seq *const *seqs, uint32_t n, uint32_t l0,
                          uint32_t l1, void *stream);

static uint32_t kvt__slot(const kvt_pool *p, const kvt__seq *s)
{
    return (uint32_t)(s - p->seqs);
}

static void kvt__pin_free(void **h)
{
    kvt__cu_host_free(*h);
    *h = NULL;
}

static void kvt__dev_free(void **d)
{
    kvt__cu_free(*d);
    *d = NULL;
}

/* Everything queued on the pool's and the step's streams has finished. */
static int kvt__quiesce(struct kvt__cuda *c)
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
static int kvt__after_step(struct kvt__cuda *c)
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
    if (!rc)
        rc = kvt__cu_memset_sync(c->d_meta, 0, p->meta.block_bytes, c->stream);
    if (rc)
        return rc; /* kvt_pool_destroy releases what exists */
    p->tier[KVT_TIER_DEVICE].base = c->d_dev;
    p->meta.base = c->d_meta;
    return 0;
}

void kvt__cuda_pool_fini(kvt_pool *p)
{
    struct kvt__cuda *c = p->cu;
    if (!c)
        return;
    (void)kvt__cu_set_device(c->device);
    (void)kvt__quiesce(c);
    void **d[] = {(void **)&c->d_dev, (void **)&c->d_meta, (void **)&c->d_tab,
                  (void **)&c->d_mtab, (void **)&c->d_acc, (void **)&c->d_saved,
                  (void **)&c->d_nsaved, (void **)&c->d_vote, (void **)&c->d_sel,
                  (void **)&c->d_topk, (void **)&c->d_blocks, (void **)&c->d_ntok,
                  (void **)&c->d_nsel, (void **)&c->d_ntopk, &c->d_work, (void **)&c->d_app,
                  (void **)&c->d_sc, (void **)&c->d_tk, (void **)&c->d_sf, (void **)&c->d_at,
                  (void **)&c->d_wslot, (void **)&c->d_wq, (void **)&c->d_wimp, &c->d_wwork};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        kvt__dev_free(d[i]);
    void **h[] = {(void **)&c->h_app, (void **)&c->h_sc, (void **)&c->h_tk, (void **)&c->h_sf,
                  (void **)&c->h_at, (void **)&c->h_sdev, (void **)&c->h_smeta,
                  (void **)&c->h_rg, (void **)&c->h_papp, (void **)&c->h_sel,
                  (void **)&c->h_blk, (void **)&c->h_nsel, (void **)&c->h_vote,
                  (void **)&c->h_cl, (void **)&c->h_zero, (void **)&c->h_fl,
                  (void **)&c->h_flr, (void **)&c->h_wslot, (void **)&c->h_wq,
                  (void **)&c->h_wimp};
    for (size_t i = 0; i < sizeof h / sizeof h[0]; i++)
        kvt__pin_free(h[i]);
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
        rc = kvt__quiesce(c);
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
        rc = kvt__after_step(c);
    /* What the host changed since the last use goes up first (after the
     * open step's work, on its stream; after a finished step's). */
    for (uint32_t si = 0; !rc && si < p->max_seqs; si++) {
        kvt__seq *s = &p->seqs[si];
        if (s->live)
            rc = kvt__tab_flush(p, &s, 1, 0, p->g.n_layers, c->sst ? c->sst : c->stream);
    }
    if (!rc)
        rc = kvt__quiesce(c);
    for (uint32_t si = 0; !rc && si < p->max_seqs; si++) {
        const kvt__seq *s = &p->seqs[si];
        if (!s->live || !s->cu_cap || s->cu_cap != s->cap_pages)
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
        if (s->cu_off + n > c->tab_cap) {
            rc = kvt__err(KVT_EINTERNAL, "CUDA table heap: sequence slot %u lies past its "
                          "end", si);
            break;
        }
        if ((rc = kvt__cu_copy_sync(tab, c->d_tab + s->cu_off, n * sizeof *tab, c->stream)) ||
            (rc = kvt__cu_copy_sync(mtab, c->d_mtab + s->cu_off, n * sizeof *mtab, c->stream)))
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
static int kvt__dev_grow(void **d, size_t keep, size_t bytes, void *stream)
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
        s->cu_lo[lh] = UINT32_MAX;
        s->cu_hi[lh] = 0;
    }
    int rc = kvt__cu_copy_sync(c->d_tab + s->cu_off, s->dev_block, n, c->stream);
    return rc ? rc : kvt__cu_copy_sync(c->d_mtab + s->cu_off, s->meta_slot, n, c->stream);
}

/* Makes the GPU copy of s's tables current for its capacity: a sequence
 * whose table grew (or is new) takes a fresh place in the heap; a full heap
 * is rebuilt, packed, from the host tables of every live sequence. */
static int kvt__tab_place(kvt_pool *p, kvt__seq *s)
{
    struct kvt__cuda *c = p->cu;
    if (s->cu_cap == s->cap_pages && s->cu_cap)
        return 0;
    if (!s->cu_lo) { /* from now on kvt__dirty records what the copy misses */
        s->cu_lo = malloc((size_t)c->LH * sizeof *s->cu_lo);
        s->cu_hi = malloc((size_t)c->LH * sizeof *s->cu_hi);
        if (!s->cu_lo || !s->cu_hi) {
            free(s->cu_lo);
            free(s->cu_hi);
            s->cu_lo = s->cu_hi = NULL;
            return kvt__err(KVT_ENOMEM, "CUDA backend: cannot allocate a sequence's dirty "
                            "ranges");
        }
    }
    const uint64_t need = (uint64_t)c->LH * s->cap_pages;
    int rc;
    if (c->tab_used + need > c->tab_cap) {
        uint64_t live = need;
        for (uint32_t i = 0; i < p->max_seqs; i++)
            if (p->seqs[i].live && &p->seqs[i] != s && p->seqs[i].cu_cap)
                live += (uint64_t)c->LH * p->seqs[i].cap_pages; /* re-placed at cap_pages */
        /* Half free after the rebuild; stale regions do not make it grow. */
        uint64_t cap = c->tab_cap > live * 2 ? c->tab_cap : live * 2;
        if (cap < 4096)
            cap = 4096;
        if ((rc = kvt__quiesce(c)))
            return rc;
        kvt__dev_free((void **)&c->d_tab);
        kvt__dev_free((void **)&c->d_mtab);
        c->tab_cap = c->tab_used = 0;
        if ((rc = kvt__cu_malloc((void **)&c->d_tab, cap * sizeof(uint32_t))) ||
            (rc = kvt__cu_malloc((void **)&c->d_mtab, cap * sizeof(uint32_t)))) {
            for (uint32_t i = 0; i < p->max_seqs; i++)
                p->seqs[i].cu_cap = 0;
            return rc;
        }
        c->tab_cap = cap;
        for (uint32_t i = 0; i < p->max_seqs; i++) {
            kvt__seq *o = &p->seqs[i];
            if (!o->live || o == s || !o->cu_cap)
                continue;
            o->cu_off = c->tab_used;
            c->tab_used += (uint64_t)c->LH * o->cap_pages;
            o->cu_cap = o->cap_pages;
            if ((rc = kvt__tab_upload(p, o))) {
                for (uint32_t j = 0; j < p->max_seqs; j++)
                    p->seqs[j].cu_cap = 0; /* every copy is now suspect */
                return rc;
            }
        }
    } else if ((rc = kvt__quiesce(c))) { /* queued kernels may read the old place */
        return rc;
    }
    s->cu_off = c->tab_used;
    c->tab_used += need;
    s->cu_cap = s->cap_pages;
    if ((rc = kvt__tab_upload(p, s)))
        s->cu_cap = 0;
    return rc;
}

/* Grows a pinned array to n elements of sz bytes (contents dropped). */
static int kvt__pin_grow(void **h, size_t n, size_t sz);

/* Waits until the guarded buffers may be written again. */
static int kvt__guard_wait(kvt__guard *g)
{
    if (!g->pending)
        return 0;
    int rc = kvt__cu_event_sync(g->ev);
    g->pending = rc != 0;
    return rc;
}

/* The work just queued on `stream` reads the guarded buffers. */
static int kvt__guard_set(kvt__guard *g, void *stream)
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
static int kvt__tab_flush(const kvt_pool *p, kvt__seq *const *seqs, uint32_t n, uint32_t l0,
                          uint32_t l1, void *stream)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t H = p->g.n_kv_heads;
    size_t ne = 0, nr = 0;
    for (uint32_t i = 0; i < n; i++) {
        const kvt__seq *s = seqs[i];
        if (!s->cu_lo || s->cu_cap != s->cap_pages || !s->cu_cap)
            continue;
        for (size_t lh = (size_t)l0 * H; lh < (size_t)l1 * H; lh++)
            if (s->cu_lo[lh] <= s->cu_hi[lh]) {
                ne += s->cu_hi[lh] - s->cu_lo[lh] + 1u;
                nr++;
            }
    }
    if (!nr)
        return 0;
    int rc = kvt__guard_wait(&c->g_fl);
    if (rc)
        return rc;
    if (ne > c->cap_fl) {
        c->cap_fl = 0;
        if ((rc = kvt__pin_grow((void **)&c->h_fl, ne * 2, sizeof *c->h_fl)))
            return rc;
        c->cap_fl = ne * 2;
    }
    if (nr > c->cap_flr) {
        c->cap_flr = 0;
        if ((rc = kvt__pin_grow((void **)&c->h_flr, nr * 2, sizeof *c->h_flr)))
            return rc;
        c->cap_flr = nr * 2;
    }
    size_t e = 0, r = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvt__seq *s = seqs[i];
        if (!s->cu_lo || s->cu_cap != s->cap_pages || !s->cu_cap)
            continue;
        for (size_t lh = (size_t)l0 * H; lh < (size_t)l1 * H; lh++) {
            const uint32_t lo = s->cu_lo[lh], hi = s->cu_hi[lh];
            if (lo > hi)
                continue;
            const size_t at = lh * s->cap_pages + lo;
            memcpy(c->h_fl + e, s->dev_block + at, (size_t)(hi - lo + 1u) * sizeof *c->h_fl);
            c->h_flr[r++] = (kvt__cu_range){e, s->cu_off + at, hi - lo + 1u, 0};
            e += hi - lo + 1u;
            s->cu_lo[lh] = UINT32_MAX;
            s->cu_hi[lh] = 0;
        }
    }
    rc = kvt__cu_table_sync(c->h_fl, c->d_tab, c->h_flr, (uint32_t)nr, stream);
    if (!rc)
        rc = kvt__guard_set(&c->g_fl, stream);
    if (rc) /* the copies are suspect: upload them whole at their next use */
        for (uint32_t i = 0; i < n; i++)
            seqs[i]->cu_cap = 0;
    return rc;
}

/* Accumulators and saved top-K sets for slots up to s's, and K up to kmax. */
static int kvt__slot_state(kvt_pool *p, kvt__seq *s, uint32_t kmax)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t slot = kvt__slot(p, s), D = p->g.head_dim;
    int rc;
    if (slot >= c->acc_slots) {
        uint32_t n = c->acc_slots ? c->acc_slots : 8;
        while (n <= slot)
            n *= 2;
        if (n > p->max_seqs)
            n = p->max_seqs;
        const size_t per = (size_t)c->LH * 3 * D * sizeof(float);
        if ((rc = kvt__quiesce(c)) ||
            (rc = kvt__dev_grow((void **)&c->d_acc, per * c->acc_slots, per * n, c->stream)))
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
        if ((rc = kvt__quiesce(c)))
            return rc;
        const size_t rows = (size_t)c->saved_slots * c->LH;
        if (kcap == c->kcap) {
            rc = kvt__dev_grow((void **)&c->d_saved, rows * kcap * 4,
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
        if (rc || (rc = kvt__dev_grow((void **)&c->d_nsaved, rows * 4, (size_t)n * c->LH * 4,
                                      c->stream)))
            return rc;
        c->saved_slots = n;
        c->kcap = kcap;
    }
    return 0;
}

/* Grows a pinned array to n elements of sz bytes (contents dropped). */
static int kvt__pin_grow(void **h, size_t n, size_t sz)
{
    kvt__pin_free(h);
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
        rc = kvt__after_step(c);
    if (!rc)
        rc = kvt__slot_state(p, s, 0);
    if (rc)
        return rc;
    if (s->cu_cap != s->cap_pages || !s->cu_cap) {
        if ((rc = kvt__tab_place(p, s))) /* uploads the new entries too */
            return rc;
    } else {
        /* Only the entries of the pages this append opened (the pool's
         * stream is idle: the last prefill waited for its kernel). */
        const uint32_t p0 = cur / P + (cur % P != 0), p1 = (cur + n + P - 1) / P;
        for (uint32_t h = 0; h < H && p1 > p0; h++) {
            const size_t e = kvt__lh(p, layer, h) * s->cap_pages + p0;
            const size_t bytes = (size_t)(p1 - p0) * sizeof(uint32_t);
            if ((rc = kvt__cu_copy_sync(c->d_tab + s->cu_off + e, s->dev_block + e, bytes,
                                        c->stream)) ||
                (rc = kvt__cu_copy_sync(c->d_mtab + s->cu_off + e, s->meta_slot + e, bytes,
                                        c->stream)))
                return rc;
        }
    }
    if ((rc = kvt__tab_flush(p, &s, 1, layer, layer + 1u, c->stream)))
        return rc;
    if (H > c->cap_papp) {
        if ((rc = kvt__quiesce(c)) ||
            (rc = kvt__pin_grow((void **)&c->h_papp, H, sizeof *c->h_papp)))
            return rc;
        c->cap_papp = H;
    } else if ((rc = kvt__cu_stream_sync(c->stream))) { /* the last prefill's items */
        return rc;
    }
    const uint32_t slot = kvt__slot(p, s);
    for (uint32_t h = 0; h < H; h++) {
        const size_t lh = kvt__lh(p, layer, h);
        c->h_papp[h] = (kvt__cu_append_item){(uint64_t)h * D, token_stride,
                                             s->cu_off + lh * s->cap_pages,
                                             ((uint64_t)slot * c->LH + lh) * 3u * D, cur, n};
    }
    kvt__cu_append_args a = {c->h_papp, H, D, P, p->g.dtype, src_dtype, k, v, c->d_tab,
                             c->d_mtab, c->d_dev, p->block_bytes, c->d_meta, p->meta_bytes,
                             c->d_acc, n};
    rc = kvt__cu_append(&a, c->stream);
    if (!rc)
        rc = kvt__cu_stream_sync(c->stream); /* k and v are the caller's again */
    return rc;
}

/* ---- steps --------------------------------------------------------------- */

/* Queues the upload of n items from a pinned slice to its device copy. */
static int kvt__items_up(void *d, const void *h, size_t bytes, void *stream)
{
    const kvt__cu_copy cp = {(uint64_t)(uintptr_t)h, (uint64_t)(uintptr_t)d, bytes};
    return bytes ? kvt__cu_copy_memcpy(&cp, 1, stream) : 0;
}

int kvt__cuda_step_plan(kvt_step *st, void *stream)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t L = st->L, H = st->H, P = st->P;
    int rc = kvt__cu_set_device(c->device);
    if (rc)
        return rc;
    if (c->done_pending) { /* the last step's kernels read the pinned arrays */
        if ((rc = kvt__cu_event_sync(c->done)))
            return rc;
        c->done_pending = false;
    }
    uint32_t kmax = 0;
    if (st->k)
        for (size_t b = 0; b < (size_t)L * H; b++)
            kmax = st->k[b] > kmax ? st->k[b] : kmax;
    uint64_t pages = 0;
    uint32_t np_max = 1;
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i];
        if ((rc = kvt__slot_state(p, s, kmax)) || (rc = kvt__tab_place(p, s)))
            return rc;
        uint32_t tmax = 0;
        for (uint32_t l = 0; l < L; l++)
            tmax = s->n_tokens[l] > tmax ? s->n_tokens[l] : tmax;
        const uint32_t np = kvt__pages_for(p, tmax + 1);
        np_max = np > np_max ? np : np_max;
        pages += (uint64_t)np * H;
    }
    const size_t items = (size_t)st->n * H;
    if (items > c->cap_items) {
        const size_t li = (size_t)L * items;
        c->cap_items = 0;
        if ((rc = kvt__pin_grow((void **)&c->h_app, li, sizeof *c->h_app)) ||
            (rc = kvt__pin_grow((void **)&c->h_sc, li, sizeof *c->h_sc)) ||
            (rc = kvt__pin_grow((void **)&c->h_tk, li, sizeof *c->h_tk)) ||
            (rc = kvt__pin_grow((void **)&c->h_sf, li, sizeof *c->h_sf)) ||
            (rc = kvt__pin_grow((void **)&c->h_at, li, sizeof *c->h_at)) ||
            (rc = kvt__dev_grow((void **)&c->d_app, 0, li * sizeof *c->d_app, NULL)) ||
            (rc = kvt__dev_grow((void **)&c->d_sc, 0, li * sizeof *c->d_sc, NULL)) ||
            (rc = kvt__dev_grow((void **)&c->d_tk, 0, li * sizeof *c->d_tk, NULL)) ||
            (rc = kvt__dev_grow((void **)&c->d_sf, 0, li * sizeof *c->d_sf, NULL)) ||
            (rc = kvt__dev_grow((void **)&c->d_at, 0, li * sizeof *c->d_at, NULL)) ||
            (rc = kvt__pin_grow((void **)&c->h_sdev, li, sizeof *c->h_sdev)) ||
            (rc = kvt__pin_grow((void **)&c->h_smeta, li, sizeof *c->h_smeta)) ||
            (rc = kvt__pin_grow((void **)&c->h_rg, li, sizeof *c->h_rg)) ||
            (rc = kvt__dev_grow((void **)&c->d_nsel, 0, items * 4, NULL)) ||
            (rc = kvt__dev_grow((void **)&c->d_ntopk, 0, items * 4, NULL)))
            return rc;
        c->cap_items = items;
    }
    if (pages > c->cap_pages) {
        c->cap_pages = 0;
        if ((rc = kvt__quiesce(c)) ||
            (rc = kvt__dev_grow((void **)&c->d_vote, 0, pages * sizeof(float), NULL)) ||
            (rc = kvt__dev_grow((void **)&c->d_sel, 0, pages * 4, NULL)) ||
            (rc = kvt__dev_grow((void **)&c->d_topk, 0, pages * 4, NULL)) ||
            (rc = kvt__dev_grow((void **)&c->d_blocks, 0, pages * 4, NULL)) ||
            (rc = kvt__dev_grow((void **)&c->d_ntok, 0, pages * 4, NULL)))
            return rc;
        c->cap_pages = pages;
    }
    /* The decode's arguments as kvt__cuda_step_decode passes them (the
     * engine's pointers are not known yet: placeholders). */
    kvt__cu_attn_args a = {c->d_at, (uint32_t)items, st->G, st->D, P, p->g.dtype, st->scale,
                           np_max, 0, (const float *)c->d_dev, (float *)c->d_dev, NULL,
                           c->d_blocks, c->d_ntok, c->d_dev, p->block_bytes, NULL};
    const size_t work = kvt__cu_attn_workspace_bytes(&a);
    /* Every launch of the step's decode splits as this one would, so a
     * launch over part of the batch (ready-first) fits the workspace. */
    const uint32_t at_sp = kvt__cu_attn_split_pages(&a);
    if (work > c->cap_work) {
        if ((rc = kvt__quiesce(c)) || (rc = kvt__dev_grow(&c->d_work, 0, work, NULL)))
            return rc;
        c->cap_work = work;
    }
    if (c->lower && (items > c->cap_hi || pages > c->cap_hp)) {
        /* The selection's way back to the host and the block list. */
        if ((rc = kvt__guard_wait(&c->g_cl)))
            return rc;
        const size_t hi = items > c->cap_hi ? items : c->cap_hi;
        const size_t hp = pages > c->cap_hp ? pages : c->cap_hp;
        c->cap_hi = c->cap_hp = 0;
        if ((rc = kvt__pin_grow((void **)&c->h_sel, hp, sizeof *c->h_sel)) ||
            (rc = kvt__pin_grow((void **)&c->h_blk, hp, sizeof *c->h_blk)) ||
            (rc = kvt__pin_grow((void **)&c->h_vote, hp, sizeof *c->h_vote)) ||
            (rc = kvt__pin_grow((void **)&c->h_nsel, 2 * hi, sizeof *c->h_nsel)) ||
            (rc = kvt__pin_grow((void **)&c->h_cl, 3 * hi + 2, sizeof *c->h_cl)))
            return rc;
        c->cap_hi = hi;
        c->cap_hp = hp;
    }
    /* Table entries the host changed between steps (moves applied,
     * evictions) reach the GPU copies before the step's first kernel. */
    if ((rc = kvt__tab_flush(p, st->seqs, st->n, 0, L, stream ? stream : c->stream)))
        return rc;
    c->np_max = np_max;
    c->at_sp = at_sp;
    c->sst = stream ? stream : c->stream; /* the step's work goes there from now */
    c->sync_calls = stream == NULL;
    memset(c->selected, 0, L);
    return 0;
}

int kvt__cuda_step_append(kvt_step *st, uint32_t layer, const void *k, const void *v,
                          kvt_dtype src_dtype, uint64_t seq_stride, const uint32_t *cur)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H, D = st->D, P = st->P;
    const size_t L0 = (size_t)layer * c->cap_items;
    kvt__cu_append_item *it = c->h_app + L0;
    uint32_t *sdev = c->h_sdev + L0, *smeta = c->h_smeta + L0;
    kvt__cu_range *rg = c->h_rg + L0;
    uint32_t nr = 0;
    int rc = kvt__cu_set_device(c->device);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        const uint32_t slot = kvt__slot(p, s), pg = cur[i] / P;
        for (uint32_t h = 0; h < H; h++) {
            const size_t lh = kvt__lh(p, layer, h), e = lh * s->cap_pages + pg;
            if (cur[i] % P == 0) { /* the token opens a page: its entries go up */
                sdev[nr] = s->dev_block[e];
                smeta[nr] = s->meta_slot[e];
                rg[nr] = (kvt__cu_range){nr, s->cu_off + e, 1, 0};
                nr++;
            }
            it[(size_t)i * H + h] = (kvt__cu_append_item){
                (uint64_t)i * seq_stride + (uint64_t)h * D, 0, s->cu_off + lh * s->cap_pages,
                ((uint64_t)slot * c->LH + lh) * 3u * D, cur[i], 1};
        }
    }
    if (nr && ((rc = kvt__cu_table_sync(sdev, c->d_tab, rg, nr, c->sst)) ||
               (rc = kvt__cu_table_sync(smeta, c->d_mtab, rg, nr, c->sst))))
        return rc;
    kvt__cu_append_item *dit = c->d_app + L0;
    if ((rc = kvt__items_up(dit, it, (size_t)st->n * H * sizeof *it, c->sst)))
        return rc;
    kvt__cu_append_args a = {dit, st->n * H, D, P, p->g.dtype, src_dtype, k, v, c->d_tab,
                             c->d_mtab, c->d_dev, p->block_bytes, c->d_meta, p->meta_bytes,
                             c->d_acc, 1};
    rc = kvt__cu_append(&a, c->sst);
    if (!rc && c->sync_calls) /* no engine stream to order with: finish here */
        rc = kvt__cu_stream_sync(c->sst);
    return rc;
}

int kvt__cuda_step_select(kvt_step *st, uint32_t layer, const float *q)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H, G = st->G, D = st->D, P = st->P;
    const bool dense = (st->flags & KVT_STEP_DENSE) != 0;
    const size_t L0 = (size_t)layer * c->cap_items;
    kvt__cu_score_item *sc = c->h_sc + L0;
    kvt__cu_topk_item *tk = c->h_tk + L0;
    kvt__cu_sf_item *sf = c->h_sf + L0;
    kvt__cu_attn_item *at = c->h_at + L0;
    int rc = kvt__cu_set_device(c->device);
    /* A layer selected again in the same step: its pinned items may still
     * be read by the queued work of the first selection. */
    if (!rc && c->selected[layer])
        rc = kvt__cu_stream_sync(c->sst);
    if (rc)
        return rc;
    uint64_t off = 0;
    uint32_t n_rr = 0, np_max = 1;
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i];
        const uint32_t slot = kvt__slot(p, s), tokens = s->n_tokens[layer];
        const uint32_t np = kvt__pages_for(p, tokens);
        np_max = np > np_max ? np : np_max;
        for (uint32_t h = 0; h < H; h++) {
            const size_t ih = (size_t)i * H + h, lh = kvt__lh(p, layer, h);
            const uint32_t k = dense ? 0 : st->k[lh], sink = dense ? 0 : st->sink[lh];
            const uint32_t local = dense ? 0 : st->local[lh];
            const bool due = st->due[(size_t)i * st->L * H + lh] != 0;
            uint32_t mode;
            /* The rule of the CPU backend's kvt__sel_task. */
            if (dense || (!(due && np) && (uint64_t)k + sink + local >= np))
                mode = KVT__CU_SF_ALL;
            else
                mode = due ? KVT__CU_SF_RERANK : KVT__CU_SF_REUSE;
            st->sel_rr[ih] = mode == KVT__CU_SF_RERANK;
            st->sel_off[ih] = (uint32_t)off;
            const uint32_t scored = mode == KVT__CU_SF_RERANK ? np : 0;
            n_rr += scored != 0;
            sc[ih] = (kvt__cu_score_item){((uint64_t)i * st->Hq + (uint64_t)h * G) * D,
                                          s->cu_off + lh * s->cap_pages, off, scored, 0};
            tk[ih] = (kvt__cu_topk_item){off, off, scored, tokens, k, sink, local, 0};
            sf[ih] = (kvt__cu_sf_item){off,
                                       ((uint64_t)slot * c->LH + lh) * c->kcap,
                                       s->cu_off + lh * s->cap_pages,
                                       (uint32_t)(slot * c->LH + lh), mode, np, tokens, sink,
                                       local};
            at[ih] = (kvt__cu_attn_item){((uint64_t)i * st->Hq + (uint64_t)h * G) * D,
                                         ((uint64_t)i * st->Hq + (uint64_t)h * G) * D,
                                         (uint64_t)i * st->Hq + (uint64_t)h * G, off, 0, 0};
            off += np ? np : 1;
        }
    }
    if (off > c->cap_pages)
        return kvt__err(KVT_EINTERNAL, "step: selection needs %llu entries, the plan sized %zu",
                        (unsigned long long)off, c->cap_pages);
    const uint32_t items = st->n * H;
    if ((n_rr && (rc = kvt__items_up(c->d_sc + L0, sc, items * sizeof *sc, c->sst))) ||
        (rc = kvt__items_up(c->d_tk + L0, tk, items * sizeof *tk, c->sst)) ||
        (rc = kvt__items_up(c->d_sf + L0, sf, items * sizeof *sf, c->sst)) ||
        (rc = kvt__items_up(c->d_at + L0, at, items * sizeof *at, c->sst)))
        return rc;
    if (n_rr) {
        kvt__cu_score_args sa = {c->d_sc + L0, items, G, D, p->g.dtype, st->sel->method, st->sel->vote,
                                 st->sel->vote_scale, np_max, q, c->d_mtab, c->d_meta,
                                 p->meta_bytes, c->d_vote};
        if ((rc = kvt__cu_score(&sa, c->sst)))
            return rc;
    }
    kvt__cu_topk_args ta = {c->d_tk + L0, items, P, np_max, c->d_vote, c->d_sel, c->d_nsel, c->d_topk,
                            c->d_ntopk};
    if ((rc = kvt__cu_topk(&ta, c->sst)))
        return rc;
    kvt__cu_sf_args fa = {c->d_sf + L0, items, P, np_max, c->kcap, c->d_sel, c->d_nsel,
                          c->d_topk, c->d_ntopk, c->d_saved, c->d_nsaved, c->d_tab, c->d_blocks,
                          c->d_ntok, c->d_at + L0};
    rc = kvt__cu_sel_finish(&fa, c->sst);
    /* The saved set is this K's once the finish is queued; a failed launch
     * may have left it half written: rerank next time. */
    for (uint32_t i = 0; i < st->n; i++)
        for (uint32_t h = 0; h < H && st->seqs[i]->topk; h++)
            if (st->sel_rr[(size_t)i * H + h])
                st->seqs[i]->topk_k[kvt__lh(p, layer, h)] =
                    rc ? 0u : st->k[kvt__lh(p, layer, h)] + 1u;
    if (!rc)
        c->selected[layer] = 1;
    if (!rc && c->sync_calls)
        rc = kvt__cu_stream_sync(c->sst);
    return rc;
}

int kvt__cuda_step_decode(kvt_step *st, uint32_t layer, const float *q, float *out, float *lse,
                          const uint8_t *run)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H;
    kvt__cu_attn_item *d_at = c->d_at + (size_t)layer * c->cap_items;
    int rc = kvt__cu_set_device(c->device);
    if (rc)
        return rc;
    /* Sequences emptied (run 2): their items' page counts (written by the
     * selection's finish on the GPU) become 0, which the kernel answers
     * with zeros and -infinity. */
    for (uint32_t i = 0; run && i < st->n && !rc; i++) {
        if (run[i] != 2)
            continue;
        for (uint32_t h = 0; h < H && !rc; h++) {
            kvt__cu_attn_item *it = d_at + (size_t)i * H + h;
            const kvt__cu_copy cp = {(uint64_t)(uintptr_t)c->h_zero,
                                     (uint64_t)(uintptr_t)&it->n_pages, sizeof it->n_pages};
            rc = kvt__cu_copy_memcpy(&cp, 1, c->sst);
        }
    }
    /* One launch per run of consecutive sequences in the call (the items
     * of sequence i are [i * H, (i + 1) * H)); every launch splits pages
     * as the whole batch would (c->at_sp), within the plan's workspace. */
    for (uint32_t i0 = 0; i0 < st->n && !rc;) {
        if (run && !run[i0]) {
            i0++;
            continue;
        }
        uint32_t i1 = i0 + 1;
        while (i1 < st->n && (!run || run[i1]))
            i1++;
        kvt__cu_attn_args a = {d_at + (size_t)i0 * H, (i1 - i0) * H, st->G, st->D, st->P,
                               p->g.dtype, st->scale, c->np_max, c->at_sp, q, out, lse,
                               c->d_blocks, c->d_ntok, c->d_dev, p->block_bytes, c->d_work};
        rc = kvt__cu_attn(&a, c->sst);
        i0 = i1;
    }
    if (!rc && c->sync_calls)
        rc = kvt__cu_stream_sync(c->sst);
    return rc;
}

int kvt__cuda_step_selection(const kvt_step *st, size_t ih, uint32_t *pages, uint32_t capacity,
                             uint32_t *n_pages)
{
    struct kvt__cuda *c = st->pool->cu;
    uint32_t n;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cu_stream_sync(c->sst);
    if (!rc)
        rc = kvt__cu_copy_sync(&n, c->d_nsel + ih, sizeof n, c->sst);
    if (rc)
        return rc;
    if (n == UINT32_MAX)
        return kvt__err(KVT_EINTERNAL, "step: the saved top-K set outgrew its store");
    if (n > capacity)
        return kvt__err(KVT_ERANGE, "capacity: %u entries, the selection has %u", capacity, n);
    if (n && (rc = kvt__cu_copy_sync(pages, c->d_sel + st->sel_off[ih], n * sizeof *pages,
                                     c->sst)))
        return rc;
    *n_pages = n;
    return 0;
}

int kvt__cuda_step_finish(kvt_step *st)
{
    struct kvt__cuda *c = st->pool->cu;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cu_event_record(c->done, c->sst);
    c->done_pending = rc == 0;
    if (rc) /* nothing tells when the step's kernels end: wait for them */
        (void)kvt__quiesce(c);
    c->sst = NULL; /* `done` covers its work; the engine may destroy the stream */
    return rc;
}

/* ---- pools with lower tiers: placement on the host ------------------------ */

int kvt__cuda_step_fetch(kvt_step *st, uint32_t layer, const uint32_t **sel)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H;
    const bool dense = (st->flags & KVT_STEP_DENSE) != 0;
    const size_t items = (size_t)st->n * H;
    int rc = kvt__cu_set_device(c->device);
    if (rc)
        return rc;
    if (items > c->cap_hi)
        return kvt__err(KVT_EINTERNAL, "step: %zu selections, the plan sized %zu", items,
                        c->cap_hi);
    if ((rc = kvt__guard_wait(&c->g_cl))) /* the last block list went up */
        return rc;
    /* One copy kernel brings back, per (sequence, head), the selection's
     * bound of entries and, for reranked heads, the votes and the top-K
     * part, plus the counts. */
    uint32_t nc = 0;
    c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)c->d_nsel,
                                   (uint64_t)(uintptr_t)c->h_nsel, items * sizeof(uint32_t)};
    c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)c->d_ntopk,
                                   (uint64_t)(uintptr_t)(c->h_nsel + items),
                                   items * sizeof(uint32_t)};
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        const uint32_t np = kvt__pages_for(p, s->n_tokens[layer]);
        for (uint32_t h = 0; h < H; h++) {
            const size_t ih = (size_t)i * H + h, lh = kvt__lh(p, layer, h);
            const uint32_t off = st->sel_off[ih];
            const uint32_t b = dense ? np : kvt__sel_bound(np, st->k[lh], st->sink[lh], st->local[lh]);
            if (off + (uint64_t)(np ? np : 1) > c->cap_hp)
                return kvt__err(KVT_EINTERNAL, "step: selection entries past the %zu the plan "
                                "sized", c->cap_hp);
            if (b)
                c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)(c->d_sel + off),
                                               (uint64_t)(uintptr_t)(c->h_sel + off),
                                               (uint64_t)b * 4u};
            if (st->sel_rr[ih] && np) {
                const uint32_t kk = st->k[lh] < np ? st->k[lh] : np;
                c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)(c->d_vote + off),
                                               (uint64_t)(uintptr_t)(c->h_vote + off),
                                               (uint64_t)np * 4u};
                if (kk)
                    c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)(c->d_topk + off),
                                                   (uint64_t)(uintptr_t)(c->h_blk + off),
                                                   (uint64_t)kk * 4u};
            }
        }
    }
    if ((rc = kvt__cu_copy_kernel(c->h_cl, nc, 0, 0, c->sst)) ||
        (rc = kvt__cu_stream_sync(c->sst))) /* the host decides what moves */
        return rc;
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i];
        const uint32_t np = kvt__pages_for(p, s->n_tokens[layer]);
        for (uint32_t h = 0; h < H; h++) {
            const size_t ih = (size_t)i * H + h, lh = kvt__lh(p, layer, h);
            const uint32_t n = c->h_nsel[ih];
            if (n == UINT32_MAX)
                return kvt__err(KVT_EINTERNAL, "step: the saved top-K set outgrew its store");
            const uint32_t b = dense ? np : kvt__sel_bound(np, st->k[lh], st->sink[lh], st->local[lh]);
            if (n > b)
                return kvt__err(KVT_EINTERNAL, "step: sequence %u head %u selected %u pages, "
                                "more than the bound %u", i, h, n, b);
            st->sel_cnt[ih] = n;
            /* The votes are the pages' importance (the host cache's
             * eviction order and lookahead eviction), as on the CPU. */
            if (!st->sel_rr[ih] || !np)
                continue;
            memcpy(s->imp + lh * s->cap_pages, c->h_vote + st->sel_off[ih],
                   (size_t)np * sizeof(float));
            /* The host keeps the top-K part too, as the CPU backend does:
             * the trim after a prefill keeps those pages on device. */
            const uint32_t k = st->k[lh], nk = c->h_nsel[items + ih];
            if (s->topk && (k <= s->topk_cap || np <= s->topk_cap) && nk <= s->topk_cap) {
                memcpy(s->topk + lh * s->topk_cap, c->h_blk + st->sel_off[ih],
                       (size_t)nk * sizeof(uint32_t));
                s->topk_n[lh] = nk;
            } else if (s->topk) {
                s->topk_k[lh] = 0; /* the GPU's set is kept; the host's is not */
            }
        }
    }
    *sel = c->h_sel;
    return 0;
}

int kvt__cuda_step_place(kvt_step *st, uint32_t layer, const uint8_t *run, uint32_t *missing)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__tab_flush(p, st->seqs, st->n, layer, layer + 1u, c->sst);
    if (!rc)
        rc = kvt__guard_wait(&c->g_cl);
    if (rc)
        return rc;
    uint32_t miss = 0, nc = 0;
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        if (run && run[i] != 1)
            continue;
        for (uint32_t h = 0; h < H; h++) {
            const size_t ih = (size_t)i * H + h;
            const size_t base = kvt__lh(p, layer, h) * s->cap_pages;
            const uint32_t off = st->sel_off[ih], n = st->sel_cnt[ih];
            for (uint32_t j = 0; j < n; j++) {
                const uint32_t blk = s->dev_block[base + c->h_sel[off + j]];
                miss += blk == 0; /* block 0 is the zeroed null block */
                c->h_blk[off + j] = blk;
            }
            if (n)
                c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)(c->h_blk + off),
                                               (uint64_t)(uintptr_t)(c->d_blocks + off),
                                               (uint64_t)n * 4u};
        }
    }
    if (nc && ((rc = kvt__cu_copy_kernel(c->h_cl, nc, 0, 0, c->sst)) ||
               (rc = kvt__guard_set(&c->g_cl, c->sst))))
        return rc;
    *missing = miss;
    return rc;
}

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

size_t kvt__cuda_copy_kernel_max = KVT__CU_COPY_KERNEL_MAX;

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
    rc = kvt__after_step(c);
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
uint32_t kvt__cuda_mv_delay_us;
uint32_t kvt__cuda_mv_fail_rounds;

int kvt__cuda_mv_sync(const kvt_pool *p, void *h)
{
    kvt__cu_mv *m = h;
    if (!m) /* the copier could not be made: its error is reported already */
        return 0;
    uint32_t fail = m->to_dev ? __atomic_load_n(&kvt__cuda_mv_fail_rounds, __ATOMIC_RELAXED) : 0;
    while (fail && !__atomic_compare_exchange_n(&kvt__cuda_mv_fail_rounds, &fail, fail - 1u,
                                                false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        ;
    if (fail && !m->err)
        m->err = kvt__err(KVT_EIO, "device copy: a round of %u copies failed (test hook)", m->n);
    m->to_dev = false;
    const uint32_t us = __atomic_load_n(&kvt__cuda_mv_delay_us, __ATOMIC_RELAXED);
    if (us && m->n) {
        const struct timespec ts = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000L};
        (void)nanosleep(&ts, NULL);
    }
    const bool direct = p->cu->uva_direct;
    uint32_t nk = 0;
    int rc = m->err;
    for (uint32_t i = 0; i < m->n; i++) { /* kernel copies to the front */
        kvt__cu_copy c = m->list[i];
        if (direct && !(c.bytes >> 63) && c.bytes <= kvt__cuda_copy_kernel_max) {
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

bool kvt__cuda_pin_refuse;

int kvt__cuda_host_pin(const kvt_pool *p, void *h, size_t bytes)
{
    if (kvt__cuda_pin_refuse)
        return kvt__err(KVT_EIO, "cudaHostRegister: refused by the test hook");
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
    int rc = kvt__pin_grow(h, n, sz);
    *cap = rc ? 0 : n;
    return rc;
}

static int kvt__warm_dev(void **d, size_t *cap, size_t bytes)
{
    if (bytes <= *cap)
        return 0;
    int rc = kvt__dev_grow(d, 0, bytes, NULL);
    *cap = rc ? 0 : bytes;
    return rc;
}

/* Bytes of raw scores one call of kvt__cu_warm may hold (the queries are
 * split into calls below this). */
size_t kvt__cuda_warm_budget = (size_t)64 << 20;

int kvt__cuda_warm_imp(kvt_pool *p, kvt__seq *s, const float *obs, uint32_t n_obs, float *imp,
                       size_t stride)
{
    struct kvt__cuda *c = p->cu;
    const kvt_selector *sel = p->sel;
    const uint32_t L = p->g.n_layers, H = p->g.n_kv_heads, Hq = p->g.n_q_heads;
    const uint32_t G = Hq / H, D = p->g.head_dim;
    const uint32_t W = sel->method == KVT_SCORE_MINMAX ? 2u * D : D;
    int rc = kvt__cu_set_device(c->device);
    if (!rc) /* the prefills' and the last step's work, before any scratch is reused */
        rc = kvt__quiesce(c);
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
        uint64_t oc64 = kvt__cuda_warm_budget / per_obs;
        if (!c->blas && oc64 > 65535ull * 16u / G)
            oc64 = 65535ull * 16u / G;
        const uint32_t oc = oc64 < 1 ? 1u : (oc64 > n_obs ? n_obs : (uint32_t)oc64);
        kvt__cu_warm_args a = {
            .n_heads = nh, .n_pages = np, .n_obs = oc, .G = G, .D = D, .dtype = p->g.dtype,
            .method = sel->method, .vote = sel->vote, .vote_scale = sel->vote_scale,
            .d_meta_base = c->d_meta, .meta_bytes = p->meta.block_bytes, .blas = c->blas};
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
        if ((rc = kvt__items_up(c->d_wslot, c->h_wslot, nslot * sizeof(uint32_t), c->stream)) ||
            (rc = kvt__items_up(c->d_wimp, c->h_wimp, nslot * sizeof(float), c->stream)))
            break;
        for (uint32_t o0 = 0; o0 < n_obs && !rc; o0 += oc) {
            a.n_obs = n_obs - o0 < oc ? n_obs - o0 : oc;
            /* Rows [head][o * G + g][W]: [qa | qb] or q, formed as the CPU does. */
            float *dst = c->h_wq;
            for (uint32_t x = 0; x < nh; x++)
                for (uint32_t o = 0; o < a.n_obs; o++) {
                    const float *q = obs + (((size_t)l * n_obs + o0 + o) * Hq + (size_t)hs[x] * G) * D;
                    for (uint32_t g = 0; g < G; g++, q += D, dst += W) {
                        if (sel->method != KVT_SCORE_MINMAX) {
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
            if (!(rc = kvt__items_up(c->d_wq, c->h_wq, qb, c->stream)) &&
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
    const uint32_t LH = c->LH, slot = kvt__slot(p, s);
    uint32_t kmax = 1, n = 0;
    for (uint32_t lh = 0; lh < LH; lh++)
        if (s->topk_k[lh] && kvt__stable(p, lh)) {
            kmax = s->topk_k[lh] - 1u > kmax ? s->topk_k[lh] - 1u : kmax;
            n++;
        }
    int rc = kvt__cu_set_device(c->device);
    if (!rc && n)
        rc = kvt__slot_state(p, s, kmax);
    if (!rc && n) /* the warm-up's own work is done; earlier steps' too */
        rc = kvt__quiesce(c);
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
        if (!s->topk_k[lh] || !kvt__stable(p, lh))
            continue;
        const uint32_t nk = s->topk_n[lh] < kcap ? s->topk_n[lh] : kcap;
        const size_t row = (size_t)slot * LH + lh;
        memcpy(pg + (size_t)m * kcap, s->topk + (size_t)lh * s->topk_cap, (size_t)nk * 4u);
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
