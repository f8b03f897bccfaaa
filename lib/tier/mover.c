/* The tier mover: batches of page moves, queued by priority, executed by
 * memcpy workers (device <-> host) and the io_uring thread (disk), and
 * applied to the pool's tables on the caller's thread. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tier.h"
#include "../policy/policy_int.h"

#define KVT__MOVER_OPTS_V1 32u
_Static_assert(sizeof(kvt_mover_opts) == KVT__MOVER_OPTS_V1, "mover opts v1");
#define KVT__MOVER_STATS_V1 176u
_Static_assert(offsetof(kvt_mover_stats, evictions) + 8 == KVT__MOVER_STATS_V1, "stats v1");
_Static_assert(sizeof(kvt_move) == 32, "kvt_move is 32 bytes");

static const char *const kvt__tier_name[KVT_NUM_TIERS] = {"device", "host", "disk"};

KVT_API int kvt_mover_opts_init(kvt_mover_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    opts->copy_threads = 1;
    opts->queue_depth = 64;
    opts->max_io_bytes = 128u << 10;
    opts->extent_pages = 64;
    opts->segment_extents = 16;
    opts->chunk_pages = 32;
    return 0;
}

int kvt__mover_opts_resolve(const kvt_mover_opts *in, kvt_mover_opts *o)
{
    kvt_mover_opts_init(o);
    if (!in)
        return 0;
    kvt_mover_opts c;
    int rc = kvt__opts_copy(&c, sizeof c, in, KVT__MOVER_OPTS_V1, "opts->mover");
    if (rc)
        return rc;
    const uint32_t known = KVT_MOVER_REQUIRE_DIRECT | KVT_MOVER_KEEP_DISK_FILE;
    if (c.flags & ~known)
        return kvt__err(KVT_EINVAL, "opts->mover->flags: unknown bits 0x%x", c.flags & ~known);
    o->flags = c.flags;
#define KVT__FIELD(f, lo, hi)                                                              \
    do {                                                                                   \
        if (c.f) {                                                                         \
            if (c.f < (lo) || c.f > (hi))                                                  \
                return kvt__err(KVT_EINVAL, "opts->mover->" #f ": %u is outside %u..%u",   \
                                c.f, (unsigned)(lo), (unsigned)(hi));                      \
            o->f = c.f;                                                                    \
        }                                                                                  \
    } while (0)
    KVT__FIELD(copy_threads, 1, 64);
    KVT__FIELD(queue_depth, 1, 4096);
    KVT__FIELD(max_io_bytes, 1, 64u << 20);
    KVT__FIELD(extent_pages, 1, 65536);
    KVT__FIELD(segment_extents, 1, 65536);
    KVT__FIELD(chunk_pages, 1, 1u << 20);
#undef KVT__FIELD
    return 0;
}

/* ---- copy workers ---------------------------------------------------------- */
static uint8_t *kvt__blk(kvt_pool *p, uint32_t tier, uint32_t id)
{
    return kvt__arena_block(&p->tier[tier], id);
}

void kvt__op_finish_locked(kvt_mover *m, kvt__op *op, int32_t status, const char *fmt, ...)
{
    op->status = status;
    if (status && fmt && op->batch->msg[0] == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(op->batch->msg, sizeof op->batch->msg, fmt, ap);
        va_end(ap);
    }
    op->next = NULL;
    if (m->done_tail)
        m->done_tail->next = op;
    else
        m->done_head = op;
    m->done_tail = op;
    m->pending--;
    /* Waiters wait for whole batches: wake them once per batch, not once
     * per page. */
    if (++op->batch->n_fin == op->batch->n || m->pending == 0)
        m->wake = true;
}

void kvt__wake_locked(kvt_mover *m)
{
    if (m->wake) {
        m->wake = false;
        pthread_cond_broadcast(&m->done_cv);
    }
}

static void kvt__batch_free(kvt__batch *b)
{
    if (b && b->cu_ev)
        kvt__cuda_mv_event_free(b->cu_ev);
    free(b);
}

static kvt__op *kvt__q_pop(kvt__op **head, kvt__op **tail)
{
    kvt__op *op = *head;
    if (op) {
        *head = op->next;
        if (!*head)
            *tail = NULL;
        op->next = NULL;
    }
    return op;
}

static void kvt__q_push(kvt__op **head, kvt__op **tail, kvt__op *op)
{
    op->next = NULL;
    if (*tail)
        (*tail)->next = op;
    else
        *head = op;
    *tail = op;
}

static void *kvt__copy_thread(void *arg)
{
    kvt_mover *m = arg;
    kvt_pool *p = m->pool;
    const uint32_t chunk = m->o.chunk_pages;
    kvt__op *mine[64];
    void *cs = NULL; /* CUDA copier of this thread, created at its first device copy */
    pthread_mutex_lock(&m->mu);
    for (;;) {
        while (!m->cq_head[0] && !m->cq_head[1] && !m->stop)
            pthread_cond_wait(&m->work_cv, &m->mu);
        if (!m->cq_head[0] && !m->cq_head[1])
            break; /* stop, and nothing left */
        /* At most a chunk at a time, urgent moves first: a large batch
         * never holds a worker for long while urgent moves wait. */
        uint32_t n = 0, cap = chunk < 64 ? chunk : 64;
        int q = m->cq_head[0] ? 0 : 1;
        while (n < cap && m->cq_head[q])
            mine[n++] = kvt__q_pop(&m->cq_head[q], &m->cq_tail[q]);
        pthread_mutex_unlock(&m->mu);
        /* CUDA pools: copies touching the device tier go through this
         * thread's low-priority stream, after their batch's event, issued
         * together (one launch of the zero-copy kernel for page-sized
         * transfers: the host tier is pinned and mapped) and complete when
         * the stream is. */
        int cerr = 0;
        bool queued = false;
        for (uint32_t i = 0; i < n; i++) {
            kvt__op *op = mine[i];
            void *dst = kvt__blk(p, op->dst_tier, op->dst_blk);
            const void *src = kvt__blk(p, op->src_tier, op->src_blk);
            if (!op->batch->cu_ev) {
                memcpy(dst, src, (size_t)p->block_bytes);
                continue;
            }
            if (!cerr && !cs)
                cerr = kvt__cuda_mv_stream(p, &cs);
            if (!cerr)
                cerr = kvt__cuda_mv_copy(p, cs, op->batch->cu_ev, dst, src, (size_t)p->block_bytes,
                                         true);
            queued = true;
        }
        if (queued) { /* even after an error: no copy may still be landing */
            const int e2 = kvt__cuda_mv_sync(p, cs);
            cerr = cerr ? cerr : e2;
        }
        char cmsg[160] = "";
        if (cerr)
            snprintf(cmsg, sizeof cmsg, "%s", kvt_last_error());
        pthread_mutex_lock(&m->mu);
        bool io = false;
        for (uint32_t i = 0; i < n; i++) {
            kvt__op *op = mine[i];
            if (cerr && op->batch->cu_ev) {
                kvt__op_finish_locked(m, op, cerr, "device copy: %s", cmsg);
                continue;
            }
            if (op->iflags & KVT__OPF_CHAIN) {
                /* Second hop: the host copy is written to the disk by the
                 * I/O thread; the move finishes when that write does. */
                op->kind = KVT__OP_WRITE;
                op->src_tier = KVT_TIER_HOST;
                op->src_blk = op->dst_blk;
                kvt__q_push(&m->iq_head[1], &m->iq_tail[1], op);
                io = true;
                continue;
            }
            kvt__op_finish_locked(m, op, 0, NULL);
        }
        if (io)
            pthread_cond_signal(&m->io_cv);
        kvt__wake_locked(m);
    }
    pthread_mutex_unlock(&m->mu);
    kvt__cuda_mv_stream_free(cs);
    return NULL;
}

/* ---- create / destroy ---------------------------------------------------- */
int kvt__mover_create(kvt_pool *p, const kvt_mover_opts *o)
{
    kvt_mover *m = calloc(1, sizeof *m);
    if (!m)
        return kvt__err(KVT_ENOMEM, "mover: cannot allocate its state");
    m->pool = p;
    m->o = *o;
    m->batches_tail = &m->batches;
    m->next_fence = 1;
    p->mover = m;
    /* Waits time out on the monotonic clock: a clock change does not
     * stretch or cut kvt_mover_wait's timeout. */
    pthread_condattr_t ca;
    bool ok = pthread_condattr_init(&ca) == 0;
    ok = ok && pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) == 0;
    if (!ok || pthread_mutex_init(&m->mu, NULL) || pthread_cond_init(&m->work_cv, NULL) ||
        pthread_cond_init(&m->io_cv, NULL) || pthread_cond_init(&m->done_cv, &ca))
        return kvt__err(KVT_ENOMEM, "mover: cannot initialise its locks");
    pthread_condattr_destroy(&ca);
    m->sync_inited = true;
    if (kvt__has_tier(p, KVT_TIER_HOST)) {
        size_t n = p->tier[KVT_TIER_HOST].n_blocks;
        m->evict_scratch = malloc(n * 16u);
        if (!m->evict_scratch)
            return kvt__err(KVT_ENOMEM, "mover: cannot allocate the eviction scratch");
    }
    m->copy_th = calloc(o->copy_threads, sizeof *m->copy_th);
    if (!m->copy_th)
        return kvt__err(KVT_ENOMEM, "mover: cannot allocate %u threads", o->copy_threads);
    for (uint32_t i = 0; i < o->copy_threads; i++) {
        int e = pthread_create(&m->copy_th[i], NULL, kvt__copy_thread, m);
        if (e)
            return kvt__err(KVT_ENOMEM, "mover: cannot start a copy thread: %s", strerror(e));
        m->n_copy++;
    }
    if (p->disk) {
        int rc = kvt__uring_init(m);
        if (rc)
            return rc;
        int e = pthread_create(&m->io_th, NULL, kvt__uring_thread, m);
        if (e)
            return kvt__err(KVT_ENOMEM, "mover: cannot start the I/O thread: %s", strerror(e));
        m->io_started = true;
    }
    return 0;
}

static void kvt__apply_done(kvt_mover *m);

void kvt__mover_destroy(kvt_mover *m)
{
    if (!m)
        return;
    if (m->sync_inited) {
        /* Destroy waits: every queued move runs to its end, so no thread
         * touches memory that is about to be unmapped. */
        pthread_mutex_lock(&m->mu);
        while (m->pending)
            pthread_cond_wait(&m->done_cv, &m->mu);
        m->stop = true;
        pthread_cond_broadcast(&m->work_cv);
        pthread_cond_broadcast(&m->io_cv);
        pthread_mutex_unlock(&m->mu);
    }
    for (uint32_t i = 0; i < m->n_copy; i++)
        pthread_join(m->copy_th[i], NULL);
    if (m->io_started)
        pthread_join(m->io_th, NULL);
    kvt__uring_fini(m);
    if (m->sync_inited) {
        kvt__apply_done(m); /* frees finished ops' reservations */
        pthread_mutex_destroy(&m->mu);
        pthread_cond_destroy(&m->work_cv);
        pthread_cond_destroy(&m->io_cv);
        pthread_cond_destroy(&m->done_cv);
    }
    for (kvt__batch *b = m->batches, *nx; b; b = nx) {
        nx = b->next;
        kvt__batch_free(b);
    }
    free(m->copy_th);
    free(m->evict_scratch);
    free(m);
}

KVT_API int kvt_pool_mover(kvt_pool *pool, kvt_mover **out)
{
    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(pool);
    *out = pool->mover;
    return 0;
}

/* ---- applying finished moves (caller thread) ------------------------------ */
static void kvt__count(kvt_pool *p, kvt__seq *s, uint32_t tier, int delta)
{
    p->pages_in_tier[tier] += (uint64_t)(int64_t)delta;
    s->pages_in_tier[tier] += (uint64_t)(int64_t)delta;
}

static void kvt__moved(kvt_pool *p, uint32_t dir)
{
    p->moved_bytes[dir] += p->block_bytes;
    p->moved_requests[dir]++;
}

/* Drops the copy of page e in `tier` (another copy exists). */
void kvt__page_drop(kvt_pool *p, kvt__seq *s, size_t e, uint32_t tier)
{
    if (!(s->res[e] & (1u << tier)))
        return;
    if (tier == KVT_TIER_DEVICE) {
        kvt__arena_free(&p->tier[KVT_TIER_DEVICE], s->dev_block[e]);
        s->dev_block[e] = 0;
        kvt__dirty(p, s, e / s->cap_pages, (uint32_t)(e % s->cap_pages));
    } else if (tier == KVT_TIER_HOST) {
        p->host_owner[s->host_block[e]].slot = UINT32_MAX;
        kvt__arena_free(&p->tier[KVT_TIER_HOST], s->host_block[e]);
        s->host_block[e] = 0;
    }
    s->res[e] &= (uint8_t)~(1u << tier);
    kvt__count(p, s, tier, -1);
}

static void kvt__apply_op(kvt_mover *m, kvt__op *op)
{
    kvt_pool *p = m->pool;
    kvt__seq *s = &p->seqs[op->slot];
    const size_t e = (size_t)op->lh * s->cap_pages + op->page;
    if (op->status == 0) {
        if (op->kind != KVT__OP_NOP) {
            switch (op->to) {
            case KVT_TIER_DEVICE:
                s->dev_block[e] = op->dst_blk;
                kvt__dirty(p, s, op->lh, op->page);
                break;
            case KVT_TIER_HOST:
                s->host_block[e] = op->dst_blk;
                p->host_owner[op->dst_blk] = (kvt__owner){op->slot, op->lh, op->page};
                break;
            default:
                p->disk->crc[op->dslot] = op->crc;
                break;
            }
            s->res[e] |= (uint8_t)(1u << op->to);
            kvt__count(p, s, op->to, +1);
            if (op->iflags & KVT__OPF_CHAIN) { /* the disk holds it too */
                p->disk->crc[op->dslot] = op->crc;
                s->res[e] |= KVT_RES_DISK;
                kvt__count(p, s, KVT_TIER_DISK, +1);
                kvt__moved(p, KVT_DIR_HOST_TO_DISK);
            }
            if (op->iflags & KVT__OPF_OFFLOAD)
                p->pst.offloaded++;
            /* Disk <-> device moves pass through host staging: both hops count. */
            if (op->from == KVT_TIER_DISK)
                kvt__moved(p, KVT_DIR_DISK_TO_HOST);
            if (op->to == KVT_TIER_DISK)
                kvt__moved(p, KVT_DIR_HOST_TO_DISK);
            if (op->from == KVT_TIER_DEVICE)
                kvt__moved(p, KVT_DIR_DEVICE_TO_HOST);
            if (op->to == KVT_TIER_DEVICE)
                kvt__moved(p, KVT_DIR_HOST_TO_DEVICE);
            if (op->to == KVT_TIER_HOST)
                s->use[e] = p->clock;
        }
        if (op->flags & KVT_MOVE_DROP_SOURCE)
            kvt__page_drop(p, s, e, op->from);
    } else {
        if (op->dst_blk)
            kvt__arena_free(&p->tier[op->dst_tier], op->dst_blk);
        /* A failed copy-out is tried again by the next offload pass. */
        if ((op->iflags & KVT__OPF_OFFLOAD) && s->off_next && op->page < s->off_next[op->lh])
            s->off_next[op->lh] = op->page;
    }
    op->dst_blk = 0;
    s->res[e] &= (uint8_t)~(KVT__RES_BUSY | KVT__RES_INBOUND);
    s->busy--;
    if (op->to == KVT_TIER_DEVICE)
        s->reloading--;
    m->moves_in_flight--;
    kvt__batch *b = op->batch;
    if (b->results)
        b->results[op->idx] = op->status;
    if (op->status && !b->first_err)
        b->first_err = op->status;
    if (++b->n_done == b->n) {
        m->batches_in_flight--;
        if (b->detached) { /* nobody will ask for it */
            kvt__batch **pp = &m->batches;
            while (*pp && *pp != b)
                pp = &(*pp)->next;
            if (*pp) {
                *pp = b->next;
                if (m->batches_tail == &b->next)
                    m->batches_tail = pp;
                kvt__batch_free(b);
            }
        }
    }
}

static void kvt__apply_done(kvt_mover *m)
{
    pthread_mutex_lock(&m->mu);
    kvt__op *list = m->done_head;
    m->done_head = m->done_tail = NULL;
    pthread_mutex_unlock(&m->mu);
    for (kvt__op *op = list, *nx; op; op = nx) {
        nx = op->next;
        kvt__apply_op(m, op);
    }
}

/* ---- host eviction ----------------------------------------------------------- */
typedef struct {
    float imp;
    uint32_t use;
    uint32_t blk;
    uint32_t pad;
} kvt__cand;

static int kvt__cand_cmp(const void *pa, const void *pb)
{
    const kvt__cand *a = pa, *b = pb;
    if (a->imp != b->imp)
        return a->imp < b->imp ? -1 : 1;
    if (a->use != b->use) /* older first; the clock may wrap, compare by distance */
        return (int32_t)(a->use - b->use) < 0 ? -1 : 1;
    return a->blk < b->blk ? -1 : a->blk > b->blk;
}

/* Moves the k smallest of c[0..n) to the front, in O(n) on average
 * (quickselect; candidates are distinct, block ids break every tie). */
static void kvt__cand_select(kvt__cand *c, size_t n, size_t k)
{
    if (k == 0 || k >= n)
        return;
    ptrdiff_t lo = 0, hi = (ptrdiff_t)n - 1, t = (ptrdiff_t)k - 1;
    while (lo < hi) {
        const kvt__cand piv = c[lo + (hi - lo) / 2];
        ptrdiff_t i = lo, j = hi;
        while (i <= j) {
            while (kvt__cand_cmp(&c[i], &piv) < 0)
                i++;
            while (kvt__cand_cmp(&c[j], &piv) > 0)
                j--;
            if (i <= j) {
                const kvt__cand tmp = c[i];
                c[i] = c[j];
                c[j] = tmp;
                i++;
                j--;
            }
        }
        if (t <= j)
            hi = j;
        else if (t >= i)
            lo = i;
        else
            break;
    }
}

/* Drops host copies that the disk also holds, lowest importance first (ties:
 * least recently used), until `want` blocks are free or nothing else can go. */
static void kvt__evict_host(kvt_mover *m, uint32_t want)
{
    kvt_pool *p = m->pool;
    kvt__arena *a = &p->tier[KVT_TIER_HOST];
    if (!p->disk || a->n_free >= want)
        return;
    /* Evict in batches (at least 1/16 of the tier) so the O(n) scan is
     * amortised over many fetches. */
    uint32_t need = want - a->n_free;
    uint32_t batch = (a->n_blocks - 1u) / 16u;
    if (batch < need)
        batch = need;
    kvt__cand *c = m->evict_scratch;
    size_t n = 0;
    for (uint32_t b = 1; b < a->n_blocks; b++) {
        const kvt__owner *o = &p->host_owner[b];
        if (o->slot == UINT32_MAX)
            continue;
        const kvt__seq *s = &p->seqs[o->slot];
        const size_t e = (size_t)o->lh * s->cap_pages + o->page;
        const uint8_t r = s->res[e];
        if ((r & KVT__RES_BUSY) || !(r & KVT_RES_DISK) || !(r & KVT_RES_HOST))
            continue;
        c[n++] = (kvt__cand){s->imp[e], s->use[e], b, 0};
    }
    if (batch > n)
        batch = (uint32_t)n;
    kvt__cand_select(c, n, batch);
    for (uint32_t i = 0; i < batch; i++) {
        const kvt__owner o = p->host_owner[c[i].blk];
        kvt__seq *s = &p->seqs[o.slot];
        kvt__page_drop(p, s, (size_t)o.lh * s->cap_pages + o.page, KVT_TIER_HOST);
        m->evictions++;
    }
}

/* ---- submit -------------------------------------------------------------- */
static int kvt__check_move(kvt_pool *p, const kvt_move *mv, uint32_t i, kvt__seq **out)
{
    kvt__seq *s;
    int rc = kvt__seq_lookup(p, mv->seq, &s);
    if (rc)
        return kvt__err(rc, "moves[%u].seq: %llu is not a live sequence of this pool", i,
                        (unsigned long long)mv->seq);
    if (mv->layer >= p->g.n_layers)
        return kvt__err(KVT_EINVAL, "moves[%u].layer: %u >= n_layers %u", i, mv->layer,
                        p->g.n_layers);
    if (mv->kv_head >= p->g.n_kv_heads)
        return kvt__err(KVT_EINVAL, "moves[%u].kv_head: %u >= n_kv_heads %u", i, mv->kv_head,
                        p->g.n_kv_heads);
    const uint32_t tokens = s->n_tokens[mv->layer];
    const uint32_t full = tokens / p->g.page_tokens;
    if (mv->page >= full)
        return kvt__err(KVT_EINVAL, "moves[%u].page: %u is %s (layer %u has %u tokens; only "
                        "full pages move)", i, mv->page,
                        mv->page < kvt__pages_for(p, tokens) ? "the partially filled last page"
                                                             : "past the last page",
                        mv->layer, tokens);
    if (mv->from >= KVT_NUM_TIERS || !kvt__has_tier(p, mv->from))
        return kvt__err(KVT_EINVAL, "moves[%u].from: %s", i,
                        mv->from >= KVT_NUM_TIERS ? "unknown tier" : "the pool has no such tier");
    if (mv->to >= KVT_NUM_TIERS || !kvt__has_tier(p, mv->to))
        return kvt__err(KVT_EINVAL, "moves[%u].to: %s", i,
                        mv->to >= KVT_NUM_TIERS ? "unknown tier" : "the pool has no such tier");
    if (mv->from == mv->to)
        return kvt__err(KVT_EINVAL, "moves[%u].to: equals from (%s)", i,
                        kvt__tier_name[mv->from]);
    if (mv->flags & ~KVT_MOVE_DROP_SOURCE)
        return kvt__err(KVT_EINVAL, "moves[%u].flags: unknown bits 0x%x", i,
                        mv->flags & ~KVT_MOVE_DROP_SOURCE);
    const size_t lh = kvt__lh(p, mv->layer, mv->kv_head), e = lh * s->cap_pages + mv->page;
    /* A pool with a policy keeps an unstable head's pages, and a stable
     * head's sink, local and last pages, on device (kvt_pool_check). */
    if (p->pol && mv->from == KVT_TIER_DEVICE && (mv->flags & KVT_MOVE_DROP_SOURCE)) {
        if (!kvt__stable(p, lh))
            return kvt__err(KVT_EINVAL, "moves[%u].flags: KVT_MOVE_DROP_SOURCE would drop the "
                            "device copy of page %u of layer %u head %u, an unstable head "
                            "(the pool's policy keeps its pages on device)", i, mv->page,
                            mv->layer, mv->kv_head);
        if (kvt__forced(mv->page, kvt__pages_for(p, tokens), tokens, p->g.page_tokens,
                        p->pol->sink[lh], p->pol->local[lh]))
            return kvt__err(KVT_EINVAL, "moves[%u].flags: KVT_MOVE_DROP_SOURCE would drop the "
                            "device copy of page %u of layer %u head %u, a sink or local page "
                            "(the pool's policy keeps them on device)", i, mv->page,
                            mv->layer, mv->kv_head);
    }
    if (s->res[e] & KVT__RES_BUSY)
        return kvt__err(KVT_EBUSY, "moves[%u]: page %u of layer %u head %u already has a move "
                        "in flight", i, mv->page, mv->layer, mv->kv_head);
    if (!(s->res[e] & (1u << mv->from)))
        return kvt__err(KVT_ESTATE, "moves[%u].from: page %u of layer %u head %u has no copy "
                        "in the %s tier", i, mv->page, mv->layer, mv->kv_head,
                        kvt__tier_name[mv->from]);
    *out = s;
    return 0;
}

static void kvt__unbusy(kvt_pool *p, kvt__batch *b, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        kvt__op *op = &b->ops[i];
        kvt__seq *s = &p->seqs[op->slot];
        s->res[(size_t)op->lh * s->cap_pages + op->page] &=
            (uint8_t)~(KVT__RES_BUSY | KVT__RES_INBOUND);
        s->busy--;
        if (op->to == KVT_TIER_DEVICE)
            s->reloading--;
        if (op->dst_blk && !(op->iflags & KVT__OPF_HANDED))
            kvt__arena_free(&p->tier[op->dst_tier], op->dst_blk);
        op->dst_blk = 0;
    }
}

static int kvt__op_cmp(const void *a, const void *b)
{
    const kvt__op *x = *(kvt__op *const *)a, *y = *(kvt__op *const *)b;
    return x->dslot < y->dslot ? -1 : x->dslot > y->dslot;
}

KVT_API int kvt_mover_submit(kvt_mover *m, const kvt_move *moves, uint32_t n, uint32_t flags,
                             int32_t *results, kvt_fence *fence)
{
    return kvt__mover_submit(m, moves, n, flags, results, fence, NULL, 0);
}

int kvt__mover_submit(kvt_mover *m, const kvt_move *moves, uint32_t n, uint32_t flags,
                      int32_t *results, kvt_fence *fence, const uint32_t *dst_dev,
                      uint8_t iflags)
{
    KVT__CHECK_NULL(fence);
    *fence = 0;
    if (!m)
        return kvt__err(KVT_EINVAL, "mover: must not be NULL");
    if (n)
        KVT__CHECK_NULL(moves);
    if (flags & ~KVT_SUBMIT_URGENT)
        return kvt__err(KVT_EINVAL, "flags: unknown bits 0x%x", flags & ~KVT_SUBMIT_URGENT);
    if (n > (1u << 26))
        return kvt__err(KVT_EINVAL, "n: %u moves in one batch; at most %u", n, 1u << 26);
    kvt_pool *p = m->pool;
    kvt__apply_done(m); /* frees what finished, so its room can be reused */

    kvt__batch *b = malloc(sizeof *b + (size_t)n * sizeof(kvt__op));
    if (!b)
        return kvt__err(KVT_ENOMEM, "kvt_mover_submit: cannot allocate a batch of %u moves", n);
    memset(b, 0, sizeof *b);
    b->n = n;
    b->results = results;
    b->urgent = (flags & KVT_SUBMIT_URGENT) != 0;
    b->detached = (iflags & KVT__OPF_DETACH) != 0;
    b->owned = (iflags & KVT__OPF_OWNED) != 0;

    /* Pass 1: check every move and mark its page busy (a page twice in one
     * batch is then KVT_EBUSY). Nothing changes if any move is refused. */
    uint32_t need_host = 0, need_dev = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvt__seq *s = NULL;
        int rc = kvt__check_move(p, &moves[i], i, &s);
        if (rc) {
            kvt__unbusy(p, b, i);
            free(b);
            return rc;
        }
        const kvt_move *mv = &moves[i];
        kvt__op *op = &b->ops[i];
        memset(op, 0, sizeof *op);
        op->batch = b;
        op->idx = i;
        op->slot = (uint32_t)(s - p->seqs);
        op->lh = (uint32_t)kvt__lh(p, mv->layer, mv->kv_head);
        op->page = mv->page;
        op->from = (uint8_t)mv->from;
        op->to = (uint8_t)mv->to;
        op->flags = (uint8_t)mv->flags;
        op->iflags = (uint8_t)(iflags & ~(KVT__OPF_HANDED | KVT__OPF_DETACH | KVT__OPF_OWNED));
        if (mv->to != KVT_TIER_HOST)
            op->iflags &= (uint8_t)~KVT__OPF_CHAIN;
        const size_t e = (size_t)op->lh * s->cap_pages + op->page;
        s->res[e] |= KVT__RES_BUSY;
        s->busy++;
        if (mv->to == KVT_TIER_DEVICE) {
            s->reloading++;
            s->res[e] |= KVT__RES_INBOUND;
        }
        if (s->res[e] & (1u << mv->to))
            op->kind = KVT__OP_NOP;
        else if (mv->from == KVT_TIER_DISK)
            op->kind = KVT__OP_READ;
        else if (mv->to == KVT_TIER_DISK)
            op->kind = KVT__OP_WRITE;
        else
            op->kind = KVT__OP_COPY;
        if (op->kind != KVT__OP_NOP) {
            need_host += mv->to == KVT_TIER_HOST;
            need_dev += mv->to == KVT_TIER_DEVICE && !(dst_dev && dst_dev[i]);
        }
        if (op->kind != KVT__OP_COPY || op->from != KVT_TIER_DEVICE || !p->disk)
            op->iflags &= (uint8_t)~KVT__OPF_CHAIN;
    }

    /* Pass 2: reserve destinations; the host tier first drops copies the
     * disk also holds when it is short. */
    int rc = 0;
    if (need_dev > p->tier[KVT_TIER_DEVICE].n_free)
        rc = kvt__err(KVT_ENOSPC, "device tier: the batch needs %u blocks, %u are free",
                      need_dev, p->tier[KVT_TIER_DEVICE].n_free);
    if (!rc && need_host) {
        kvt__evict_host(m, need_host);
        if (need_host > p->tier[KVT_TIER_HOST].n_free)
            rc = kvt__err(KVT_ENOSPC, "host tier: the batch needs %u blocks, %u are free and "
                          "no other host page has a complete disk copy to fall back on",
                          need_host, p->tier[KVT_TIER_HOST].n_free);
    }
    p->clock++;
    for (uint32_t i = 0; i < n && !rc; i++) {
        kvt__op *op = &b->ops[i];
        kvt__seq *s = &p->seqs[op->slot];
        const size_t e = (size_t)op->lh * s->cap_pages + op->page;
        if (op->kind == KVT__OP_NOP)
            continue;
        if (op->from == KVT_TIER_DEVICE) {
            op->src_tier = KVT_TIER_DEVICE;
            op->src_blk = s->dev_block[e];
        } else if (op->from == KVT_TIER_HOST) {
            op->src_tier = KVT_TIER_HOST;
            op->src_blk = s->host_block[e];
        } else {
            op->dslot = kvt__disk_slot(p, s, op->lh, op->page);
            op->crc = p->disk->crc[op->dslot];
        }
        if (op->to == KVT_TIER_DISK) {
            /* The extent table grows with the block tables (kvt__seq_reserve). */
            rc = kvt__disk_slot_alloc(p, s, op->lh, op->page, &op->dslot);
        } else if (op->to == KVT_TIER_DEVICE && dst_dev && dst_dev[i]) {
            op->dst_tier = KVT_TIER_DEVICE; /* handed over by the caller */
            op->dst_blk = dst_dev[i];
            op->iflags |= KVT__OPF_HANDED;
        } else {
            if (op->iflags & KVT__OPF_CHAIN)
                rc = kvt__disk_slot_alloc(p, s, op->lh, op->page, &op->dslot);
            if (rc)
                break;
            op->dst_tier = op->to;
            op->dst_blk = kvt__arena_alloc(&p->tier[op->to]);
            if (!op->dst_blk) /* counted above; cannot happen */
                rc = kvt__err(KVT_EINTERNAL, "%s tier: no block left after the count",
                              kvt__tier_name[op->to]);
        }
    }
    if (rc) {
        kvt__unbusy(p, b, n);
        free(b);
        return rc;
    }

    /* Queue: disk moves sorted by slot so neighbours coalesce. */
    kvt__op **io = NULL;
    uint32_t n_io = 0;
    for (uint32_t i = 0; i < n; i++)
        n_io += b->ops[i].kind == KVT__OP_READ || b->ops[i].kind == KVT__OP_WRITE;
    if (n_io > 1) {
        io = malloc((size_t)n_io * sizeof *io);
        if (!io) {
            kvt__unbusy(p, b, n);
            free(b);
            return kvt__err(KVT_ENOMEM, "kvt_mover_submit: cannot allocate the I/O order");
        }
    }
    /* CUDA pools: the moves that read or write device blocks start on the
     * GPU after the work queued so far (appends that wrote the pages,
     * decodes that read a block now handed over). */
    bool dev_io = false;
    for (uint32_t i = 0; i < n && p->cu && !dev_io; i++)
        dev_io = b->ops[i].kind != KVT__OP_NOP &&
                 (b->ops[i].from == KVT_TIER_DEVICE || b->ops[i].to == KVT_TIER_DEVICE);
    if (dev_io && (rc = kvt__cuda_mv_mark(p, &b->cu_ev))) {
        free(io);
        kvt__unbusy(p, b, n);
        free(b);
        return rc;
    }
    b->fence = m->next_fence++;
    *m->batches_tail = b;
    m->batches_tail = &b->next;
    if (n) {
        m->batches_in_flight++;
        m->moves_in_flight += n;
    }
    const int q = b->urgent ? 0 : 1;
    pthread_mutex_lock(&m->mu);
    uint32_t k = 0;
    bool copies = false, ios = false;
    for (uint32_t i = 0; i < n; i++) {
        kvt__op *op = &b->ops[i];
        m->pending++;
        switch (op->kind) {
        case KVT__OP_NOP:
            kvt__op_finish_locked(m, op, 0, NULL);
            break;
        case KVT__OP_COPY:
            kvt__q_push(&m->cq_head[q], &m->cq_tail[q], op);
            copies = true;
            break;
        default:
            if (io)
                io[k++] = op;
            else
                kvt__q_push(&m->iq_head[q], &m->iq_tail[q], op);
            ios = true;
            break;
        }
    }
    if (io) {
        qsort(io, k, sizeof *io, kvt__op_cmp);
        for (uint32_t i = 0; i < k; i++)
            kvt__q_push(&m->iq_head[q], &m->iq_tail[q], io[i]);
    }
    kvt__wake_locked(m);
    if (copies)
        pthread_cond_broadcast(&m->work_cv);
    if (ios)
        pthread_cond_signal(&m->io_cv);
    pthread_mutex_unlock(&m->mu);
    free(io);
    *fence = b->fence;
    return 0;
}

/* ---- poll / wait --------------------------------------------------------- */
/* 1 = the fence is complete: its outcome is reported (once) and the batch
 * record freed; 0 = still in flight. */
static int kvt__fence_state(kvt_mover *m, kvt_fence fence, int *code)
{
    *code = 0;
    char msg[sizeof m->batches->msg] = "";
    if (fence != KVT_FENCE_ALL) {
        kvt__batch **pp = &m->batches;
        while (*pp && (*pp)->fence != fence)
            pp = &(*pp)->next;
        kvt__batch *b = *pp;
        if (!b)
            return 1; /* completed and reported before */
        if (b->n_done < b->n)
            return 0;
        *code = b->first_err;
        memcpy(msg, b->msg, sizeof msg);
        *pp = b->next;
        if (m->batches_tail == &b->next)
            m->batches_tail = pp;
        kvt__batch_free(b);
    } else {
        for (kvt__batch *b = m->batches; b; b = b->next)
            if (b->n_done < b->n)
                return 0;
        /* Every batch is complete: report and free them, except those the
         * library itself waits on (a step's promotions, warm-up's), whose
         * outcome is the step's to report. */
        kvt__batch **pp = &m->batches;
        while (*pp) {
            kvt__batch *b = *pp;
            if (b->owned) {
                pp = &b->next;
                continue;
            }
            if (!*code && b->first_err) {
                *code = b->first_err;
                memcpy(msg, b->msg, sizeof msg);
            }
            *pp = b->next;
            kvt__batch_free(b);
        }
        m->batches_tail = pp;
    }
    if (*code)
        kvt__err(*code, "%s", msg[0] ? msg : "a move of the batch failed");
    return 1;
}

static int kvt__fence_check(kvt_mover *m, kvt_fence fence)
{
    if (fence == 0 || (fence != KVT_FENCE_ALL && fence >= m->next_fence))
        return kvt__err(KVT_EINVAL, "fence: %llu was never returned by kvt_mover_submit",
                        (unsigned long long)fence);
    return 0;
}

KVT_API int kvt_mover_poll(kvt_mover *m, kvt_fence fence)
{
    if (!m)
        return kvt__err(KVT_EINVAL, "mover: must not be NULL");
    int rc = kvt__fence_check(m, fence);
    if (rc)
        return rc;
    kvt__apply_done(m);
    int code;
    if (kvt__fence_state(m, fence, &code))
        return code;
    return KVT_EAGAIN;
}

KVT_API int kvt_mover_wait(kvt_mover *m, kvt_fence fence, uint64_t timeout_ns)
{
    if (!m)
        return kvt__err(KVT_EINVAL, "mover: must not be NULL");
    int rc = kvt__fence_check(m, fence);
    if (rc)
        return rc;
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    if (timeout_ns != UINT64_MAX) {
        uint64_t ns = (uint64_t)dl.tv_nsec + timeout_ns % 1000000000u;
        dl.tv_sec += (time_t)(timeout_ns / 1000000000u + ns / 1000000000u);
        dl.tv_nsec = (long)(ns % 1000000000u);
    }
    for (;;) {
        kvt__apply_done(m);
        int code;
        if (kvt__fence_state(m, fence, &code))
            return code;
        /* Still in flight: the batch (or, for FENCE_ALL, everything) has
         * pages not finished by the threads yet. */
        kvt__batch *b = NULL;
        if (fence != KVT_FENCE_ALL)
            for (b = m->batches; b && b->fence != fence; b = b->next)
                ;
        pthread_mutex_lock(&m->mu);
        int e = 0;
        while (e == 0 && (b ? b->n_fin < b->n : m->pending > 0)) {
            if (timeout_ns == UINT64_MAX)
                pthread_cond_wait(&m->done_cv, &m->mu);
            else
                e = pthread_cond_timedwait(&m->done_cv, &m->mu, &dl);
        }
        bool have = b ? b->n_fin == b->n : m->pending == 0;
        pthread_mutex_unlock(&m->mu);
        if (e == ETIMEDOUT && !have)
            return kvt__err(KVT_ETIMEDOUT, "fence %llu: still in flight after %llu ns",
                            (unsigned long long)fence, (unsigned long long)timeout_ns);
    }
}

void kvt__mover_apply(kvt_mover *m)
{
    if (m)
        kvt__apply_done(m);
}

int kvt__mover_fence_done(kvt_mover *m, kvt_fence fence, int *code)
{
    kvt__apply_done(m);
    return kvt__fence_state(m, fence, code);
}

int kvt__mover_fence_wait(kvt_mover *m, kvt_fence fence)
{
    int rc = kvt_mover_wait(m, fence, UINT64_MAX);
    return rc == KVT_ETIMEDOUT ? 0 : rc;
}

void kvt__mover_drain_seq(kvt_mover *m, kvt__seq *s)
{
    if (!m)
        return;
    kvt__apply_done(m);
    while (s->busy) {
        pthread_mutex_lock(&m->mu);
        while (!m->done_head)
            pthread_cond_wait(&m->done_cv, &m->mu);
        pthread_mutex_unlock(&m->mu);
        kvt__apply_done(m);
    }
}

void kvt__mover_reserved(const kvt_mover *m, void (*fn)(void *ctx, uint32_t tier, uint32_t blk),
                         void *ctx)
{
    if (!m)
        return;
    for (const kvt__batch *b = m->batches; b; b = b->next)
        for (uint32_t i = 0; i < b->n; i++) {
            const kvt__op *op = &b->ops[i];
            /* Applied ops gave their block to the table (or freed it) and
             * cleared dst_blk. */
            if (op->dst_blk)
                fn(ctx, op->dst_tier, op->dst_blk);
        }
}

/* ---- stats, path ---------------------------------------------------------- */
KVT_API int kvt_mover_stats_get(const kvt_mover *m, kvt_mover_stats *stats)
{
    kvt_mover_stats s;
    size_t fill;
    if (!m)
        return kvt__err(KVT_EINVAL, "mover: must not be NULL");
    KVT__CHECK_NULL(stats);
    int rc = kvt__out_struct(stats, sizeof s, KVT__MOVER_STATS_V1, "stats", &fill);
    if (rc)
        return rc;
    const kvt_pool *p = m->pool;
    memset(&s, 0, sizeof s);
    s.struct_size = stats->struct_size;
    s.disk_direct = p->disk && p->disk->direct;
    s.registered = m->registered;
    s.queue_depth = p->disk ? m->o.queue_depth : 0;
    s.disk_file_bytes = p->disk ? p->disk->file_bytes : 0;
    s.batches_in_flight = m->batches_in_flight;
    s.moves_in_flight = m->moves_in_flight;
    memcpy(s.moved_bytes, p->moved_bytes, sizeof s.moved_bytes);
    memcpy(s.moved_requests, p->moved_requests, sizeof s.moved_requests);
    pthread_mutex_lock((pthread_mutex_t *)&m->mu);
    s.disk_reads = m->disk_reads;
    s.disk_writes = m->disk_writes;
    s.disk_read_bytes = m->disk_read_bytes;
    s.disk_write_bytes = m->disk_write_bytes;
    s.retries = m->retries;
    s.short_io = m->short_io;
    s.io_errors = m->io_errors;
    s.checksum_errors = m->checksum_errors;
    pthread_mutex_unlock((pthread_mutex_t *)&m->mu);
    s.evictions = m->evictions;
    memcpy(stats, &s, fill);
    return 0;
}

KVT_API int kvt_pool_disk_path(const kvt_pool *pool, char *buf, size_t cap, size_t *len)
{
    KVT__CHECK_NULL(pool);
    if (!pool->disk)
        return kvt__err(KVT_ENOENT, "pool: has no disk tier");
    size_t n = strlen(pool->disk->path);
    if (len)
        *len = n;
    if (!buf || cap <= n)
        return kvt__err(KVT_ERANGE, "cap: %zu bytes; the path needs %zu", cap, n + 1);
    memcpy(buf, pool->disk->path, n + 1);
    return 0;
}
