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

static void kvt__batch_free(const kvt_mover *m, kvt__batch *b)
{
    if (b && b->cu_ev)
        m->pool->be->event_free(b->cu_ev);
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

void kvt__mover_q_push(kvt__op **head, kvt__op **tail, kvt__op *op)
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
                cerr = p->be->copier_open(p, &cs);
            if (!cerr)
                cerr = p->be->copy(p, cs, op->batch->cu_ev, dst, src, (size_t)p->block_bytes, true);
            queued = true;
        }
        if (queued) { /* even after an error: no copy may still be landing */
            const int e2 = p->be->copier_sync(p, cs);
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
                kvt__mover_q_push(&m->iq_head[1], &m->iq_tail[1], op);
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
    if (cs)
        p->be->copier_close(cs);
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
        if (p->disk) {
            int rc = kvt__hlru_init(&m->hlru, (uint32_t)n);
            if (rc)
                return rc;
        }
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
        kvt__mover_apply_done(m); /* frees finished ops' reservations */
        pthread_mutex_destroy(&m->mu);
        pthread_cond_destroy(&m->work_cv);
        pthread_cond_destroy(&m->io_cv);
        pthread_cond_destroy(&m->done_cv);
    }
    for (kvt__batch *b = m->batches, *nx; b; b = nx) {
        nx = b->next;
        kvt__batch_free(m, b);
    }
    free(m->copy_th);
    free(m->evict_scratch);
    kvt__hlru_fini(&m->hlru);
    free(m);
}

KVT_API int kvt_pool_mover_get(kvt_pool *pool, kvt_mover **out)
{
    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(pool);
    *out = pool->mover;
    return 0;
}

/* ---- applying finished moves (caller thread) ------------------------------ */
static void kvt__moved(kvt_pool *p, uint32_t dir)
{
    p->moved_bytes[dir] += p->block_bytes;
    p->moved_requests[dir]++;
}

/* Drops the copy of page e in `tier` (another copy exists), in the view of
 * every sequence that holds the page. */
void kvt__page_drop(kvt_pool *p, kvt__seq *s, size_t e, uint32_t tier)
{
    if (!(s->res[e] & (1u << tier)))
        return;
    const size_t lh = e / s->cap_pages;
    const uint32_t page = (uint32_t)(e % s->cap_pages);
    if (tier == KVT_TIER_DEVICE) {
        kvt__arena_free(&p->tier[KVT_TIER_DEVICE], s->dev_block[e]);
        kvt__page_dev(p, s, lh, page, 0);
    } else if (tier == KVT_TIER_HOST) {
        if (p->mover && p->mover->hlru.n)
            kvt__hlru_unlink(&p->mover->hlru, s->host_block[e]);
        p->host_owner[s->host_block[e]].slot = UINT32_MAX;
        kvt__arena_free(&p->tier[KVT_TIER_HOST], s->host_block[e]);
        kvt__page_host(p, s, lh, page, 0);
    }
    kvt__page_res(p, s, lh, page, (uint8_t)(1u << tier), 0);
    kvt__page_count(p, s, lh, page, tier, -1);
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
                kvt__page_dev(p, s, op->lh, op->page, op->dst_blk);
                break;
            case KVT_TIER_HOST:
                kvt__page_host(p, s, op->lh, op->page, op->dst_blk);
                p->host_owner[op->dst_blk] = (kvt__owner){op->slot, op->lh, op->page};
                break;
            default:
                p->disk->crc[op->dslot] = op->crc;
                break;
            }
            kvt__page_res(p, s, op->lh, op->page, 0, (uint8_t)(1u << op->to));
            kvt__page_count(p, s, op->lh, op->page, op->to, +1);
            if (op->iflags & KVT__OPF_CHAIN) { /* the disk holds it too */
                p->disk->crc[op->dslot] = op->crc;
                kvt__page_res(p, s, op->lh, op->page, 0, KVT_RES_DISK);
                kvt__page_count(p, s, op->lh, op->page, KVT_TIER_DISK, +1);
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
                s->tier.use[e] = p->clock;
        }
        if (op->flags & KVT_MOVE_DROP_SOURCE)
            kvt__page_drop(p, s, e, op->from);
    } else {
        if (op->dst_blk)
            kvt__arena_free(&p->tier[op->dst_tier], op->dst_blk);
        /* A failed copy-out is tried again by the next offload pass. */
        if ((op->iflags & KVT__OPF_OFFLOAD) && s->tier.off_next && op->page < s->tier.off_next[op->lh])
            s->tier.off_next[op->lh] = op->page;
    }
    op->dst_blk = 0;
    kvt__page_res(p, s, op->lh, op->page, KVT__RES_BUSY | KVT__RES_INBOUND, 0);
    s->tier.busy--;
    kvt__host_file(p, s, e); /* a new host copy, a new disk copy, or no longer busy */
    if (op->to == KVT_TIER_DEVICE)
        s->tier.reloading--;
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
                kvt__batch_free(m, b);
            }
        }
    }
}

void kvt__mover_apply_done(kvt_mover *m)
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
        kvt__batch_free(m, b);
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
            kvt__batch_free(m, b);
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
    kvt__mover_apply_done(m);
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
        kvt__mover_apply_done(m);
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
        kvt__mover_apply_done(m);
}

int kvt__mover_fence_done(kvt_mover *m, kvt_fence fence, int *code)
{
    kvt__mover_apply_done(m);
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
    kvt__mover_apply_done(m);
    while (s->tier.busy) {
        pthread_mutex_lock(&m->mu);
        while (!m->done_head)
            pthread_cond_wait(&m->done_cv, &m->mu);
        pthread_mutex_unlock(&m->mu);
        kvt__mover_apply_done(m);
    }
}

void kvt__mover_drain_page(kvt_mover *m, const kvt__seq *s, size_t e)
{
    if (!m)
        return;
    kvt__mover_apply_done(m);
    while (s->res[e] & KVT__RES_BUSY) {
        pthread_mutex_lock(&m->mu);
        while (!m->done_head)
            pthread_cond_wait(&m->done_cv, &m->mu);
        pthread_mutex_unlock(&m->mu);
        kvt__mover_apply_done(m);
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

KVT_API int kvt_pool_disk_path_get(const kvt_pool *pool, char *buf, size_t cap, size_t *len)
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
