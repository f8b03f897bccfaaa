/* The mover's I/O thread: disk moves through io_uring with registered
 * staging buffers and a registered file, adjacent slots coalesced into one
 * request, short transfers continued, -EAGAIN/-EINTR retried, every read
 * checked against the page's CRC32C before its bytes are used. */
#include <errno.h>
#include <stdio.h>
#include <liburing.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <stdint.h>

#include "tier.h"

#define KVT__MAX_RETRIES 64u

/* Reads straight into blocks: which arenas (host memory of the pool's own
 * mapping: the host tier, a CPU pool's device tier; not a CUDA device
 * arena), in chunks of at least 2 MiB and at most 4096 chunks an arena
 * (the kernel's table holds 16384 buffers). Returns the table size. */
static uint32_t kvt__direct_plan(kvt_mover *m)
{
    kvt_pool *p = m->pool;
    uint32_t n_tab = m->n_units;
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++) {
        const kvt__arena *a = &p->tier[t];
        if (t == KVT_TIER_DISK || !a->base || a->ext || a->n_blocks < 2)
            continue;
        uint32_t cb = (uint32_t)(((2u << 20) + a->block_bytes - 1u) / a->block_bytes);
        if (cb < (a->n_blocks + 4095u) / 4096u)
            cb = (a->n_blocks + 4095u) / 4096u;
        const uint32_t nc = (a->n_blocks + cb - 1u) / cb;
        if (!(m->chunk_state[t] = calloc(nc, 1)))
            continue; /* that arena's reads go through staging */
        m->chunk_blocks[t] = cb;
        m->reg_base[t] = n_tab;
        n_tab += nc;
    }
    return n_tab;
}

static void kvt__direct_unplan(kvt_mover *m)
{
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++) {
        free(m->chunk_state[t]);
        m->chunk_state[t] = NULL;
        m->reg_base[t] = m->chunk_blocks[t] = 0;
    }
}

int kvt__uring_init(kvt_mover *m)
{
    const kvt__disk *d = m->pool->disk;
    uint64_t per = m->o.max_io_bytes / d->slot_bytes;
    if (per == 0)
        per = 1;
    if (per * d->slot_bytes > UINT32_MAX / 2)
        per = (UINT32_MAX / 2) / d->slot_bytes;
    m->stage_bytes = (uint32_t)(per * d->slot_bytes);
    /* Twice the queue depth: qd requests in flight while the thread checks
     * and copies up to qd completed ones, so the disk never waits for the
     * CRC pass. */
    m->n_units = 2u * m->o.queue_depth;
    m->stage_map = (size_t)m->n_units * m->stage_bytes;
    /* 2 MiB aligned, on huge pages where THP allows: a 128 KiB request is
     * one physically contiguous segment instead of up to 32 (which halves
     * the bandwidth of some disks). */
    const size_t huge = (size_t)2 << 20;
    uint8_t *raw = mmap(NULL, m->stage_map + huge, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        m->stage_map = 0;
        return kvt__err(KVT_ENOMEM, "mover: cannot map %zu bytes of staging buffers",
                        (size_t)m->n_units * m->stage_bytes);
    }
    uint8_t *st = (uint8_t *)(((uintptr_t)raw + huge - 1u) & ~(uintptr_t)(huge - 1u));
    if (st > raw)
        munmap(raw, (size_t)(st - raw));
    if (raw + huge > st)
        munmap(st + m->stage_map, (size_t)(raw + huge - st));
    (void)madvise(st, m->stage_map, MADV_HUGEPAGE); /* a hint */
    m->stage = st;
    /* CUDA pools: pinned for the GPU too, so staging <-> device copies are
     * DMA that does not block the I/O thread (unpinned they still work). */
    if (m->pool->be->host_pin &&
        !(m->stage_pinned = m->pool->be->host_pin(m->pool, st, m->stage_map) == 0))
        kvt_clear_error();
    m->units = calloc(m->n_units, sizeof *m->units);
    m->unit_ops = calloc((size_t)m->n_units * per, sizeof *m->unit_ops);
    m->free_units = malloc((size_t)m->n_units * sizeof *m->free_units);
    m->prep = malloc((size_t)m->n_units * sizeof *m->prep);
    m->done_units = malloc((size_t)m->n_units * sizeof *m->done_units);
    struct io_uring *ring = calloc(1, sizeof *ring);
    if (!m->units || !m->unit_ops || !m->free_units || !m->prep || !m->done_units || !ring) {
        free(ring);
        return kvt__err(KVT_ENOMEM, "mover: cannot allocate %u I/O slots", m->n_units);
    }
    for (uint32_t i = 0; i < m->n_units; i++) {
        m->units[i].ops = m->unit_ops + (size_t)i * per;
        m->units[i].buf = i;
        m->free_units[m->n_free_units++] = m->n_units - 1u - i;
    }
    int e = io_uring_queue_init(m->o.queue_depth, ring, 0);
    if (e < 0) {
        free(ring);
        return kvt__err(KVT_ENOTSUP, "opts->disk_dir: io_uring is not available (%s); the disk "
                        "tier needs it", strerror(-e));
    }
    m->ring = ring;
    /* Registered buffers and file spare the kernel a page-table walk and a
     * file lookup per request; without them (RLIMIT_MEMLOCK, old kernels)
     * the same requests run unregistered. The table is sparse where the
     * kernel allows: staging first, then a slot per chunk of each arena
     * in host memory, filled when a read first lands there (so an arena
     * is pinned only where it is used). */
    struct iovec *iov = malloc((size_t)m->n_units * sizeof *iov);
    bool ok = iov != NULL;
    for (uint32_t i = 0; ok && i < m->n_units; i++) {
        iov[i].iov_base = m->stage + (size_t)i * m->stage_bytes;
        iov[i].iov_len = m->stage_bytes;
    }
    uint32_t n_tab = m->n_units;
    if (ok && d->slot_bytes == d->block_bytes)
        n_tab = kvt__direct_plan(m);
    bool sparse = false;
    if (ok && n_tab > m->n_units && io_uring_register_buffers_sparse(ring, n_tab) == 0) {
        sparse = io_uring_register_buffers_update_tag(ring, 0, iov, NULL, m->n_units) ==
                 (int)m->n_units;
        if (!sparse)
            io_uring_unregister_buffers(ring);
    }
    if (!sparse)
        kvt__direct_unplan(m);
    if (ok && !sparse && io_uring_register_buffers(ring, iov, m->n_units) < 0)
        ok = false;
    if (ok && io_uring_register_files(ring, &d->fd, 1) < 0) {
        io_uring_unregister_buffers(ring);
        kvt__direct_unplan(m);
        ok = false;
    }
    free(iov);
    m->registered = ok;
    return 0;
}

void kvt__uring_fini(kvt_mover *m)
{
    if (m->ring) {
        io_uring_queue_exit(m->ring); /* unregisters buffers and files too */
        free(m->ring);
        m->ring = NULL;
    }
    kvt__direct_unplan(m);
    if (m->stage && m->stage_pinned)
        m->pool->be->host_unpin(m->pool, m->stage);
    m->stage_pinned = false;
    if (m->stage)
        munmap(m->stage, m->stage_map);
    m->stage = NULL;
    free(m->units);
    free(m->unit_ops);
    free(m->free_units);
    free(m->prep);
    free(m->done_units);
    m->done_units = NULL;
    m->units = NULL;
    m->unit_ops = NULL;
    m->free_units = NULL;
    m->prep = NULL;
}

static uint8_t *kvt__unit_buf(const kvt_mover *m, const kvt__iou *u)
{
    return u->direct ? u->direct : m->stage + (size_t)u->buf * m->stage_bytes;
}

/* A read lands straight in its destination blocks (no staging copy) when
 * a disk slot is exactly a block (so O_DIRECT's alignment holds in the
 * arena), the blocks are consecutive in one chunk of an arena in host
 * memory (a coalesced request is one contiguous fixed buffer) and that
 * chunk is registered - here, on first use; a chunk the kernel refuses
 * (RLIMIT_MEMLOCK) sends its reads through staging. Unregistered direct
 * reads were measured slower than staging (a page-table walk and page
 * pins per request). Sets u->direct and u->reg. I/O thread only. */
static void kvt__direct_dst(kvt_mover *m, kvt__iou *u)
{
    const kvt_pool *p = m->pool;
    const kvt__op *op = u->ops[0];
    const uint32_t t = op->dst_tier;
    u->direct = NULL;
    if (u->write || t >= KVT_NUM_TIERS || !m->chunk_state[t])
        return;
    const uint32_t cb = m->chunk_blocks[t], c = op->dst_blk / cb;
    if ((op->dst_blk + u->n_ops - 1u) / cb != c)
        return;
    for (uint32_t i = 1; i < u->n_ops; i++)
        if (u->ops[i]->dst_tier != t || u->ops[i]->dst_blk != op->dst_blk + i)
            return;
    uint8_t *st = &m->chunk_state[t][c];
    const kvt__arena *a = &p->tier[t];
    if (*st == 0) {
        const size_t bb = a->block_bytes, first = (size_t)c * cb;
        const size_t nb = first + cb <= a->n_blocks ? cb : a->n_blocks - first;
        struct iovec iov = {kvt__arena_block(a, (uint32_t)first), nb * bb};
        *st = io_uring_register_buffers_update_tag(m->ring, m->reg_base[t] + c, &iov, NULL,
                                                   1) == 1 ? 1 : 2;
    }
    if (*st != 1)
        return;
    u->direct = kvt__arena_block(a, op->dst_blk);
    u->reg = m->reg_base[t] + c;
}

/* Which fault, if any, the next request of this kind draws. */
static uint32_t kvt__fault_draw(kvt_mover *m, bool write)
{
#ifdef KVT_FAULT_INJECTION
    kvt__fault *f = write ? &m->fault_write : &m->fault_read;
    pthread_mutex_lock(&m->mu);
    uint32_t k = KVT__FAULT_NONE;
    if (f->nth && ++f->count == f->nth) {
        k = f->kind;
        f->nth = 0;
    }
    pthread_mutex_unlock(&m->mu);
    return k;
#else
    (void)m;
    (void)write;
    return KVT__FAULT_NONE;
#endif
}

#ifdef KVT_FAULT_INJECTION
int kvt__mover_fault(kvt_mover *m, bool write, uint32_t kind, uint64_t nth)
{
    pthread_mutex_lock(&m->mu);
    kvt__fault *f = write ? &m->fault_write : &m->fault_read;
    f->kind = kind;
    f->nth = nth;
    f->count = 0;
    pthread_mutex_unlock(&m->mu);
    return 0;
}
#endif

/* Whether op's block in `tier` is host memory that a memcpy reaches (not a
 * CUDA pool's device block). */
static bool kvt__host_mem(const kvt__op *op, uint32_t tier)
{
    return tier != KVT_TIER_DEVICE || !op->batch->cu_ev;
}

/* A copy between a staging buffer and a block: through the I/O thread's
 * CUDA copier when the block is in a CUDA pool's device tier (after the
 * batch's event; the backend's copier_sync issues and completes it; the kernel
 * serves it when the staging is pinned), else memcpy. */
static int kvt__stage_copy(kvt_mover *m, const kvt__op *op, uint32_t tier, void *dst,
                           const void *src, bool *queued)
{
    const kvt_pool *p = m->pool;
    if (kvt__host_mem(op, tier)) {
        memcpy(dst, src, p->disk->block_bytes);
        return 0;
    }
    int rc = m->io_cs ? 0 : p->be->copier_open(p, &m->io_cs);
    if (!rc)
        rc = p->be->copy(p, m->io_cs, op->batch->cu_ev, dst, src, p->disk->block_bytes,
                         m->stage_pinned);
    *queued = true;
    return rc;
}

/* Fills a write's staging buffer from the source blocks and records each
 * page's CRC, computed on the bytes that go to disk. Returns a CUDA error
 * (the request is not written). */
static int kvt__stage_write(kvt_mover *m, kvt__iou *u)
{
    const kvt_pool *p = m->pool;
    const kvt__disk *d = p->disk;
    uint8_t *buf = kvt__unit_buf(m, u);
    bool queued = false;
    int rc = 0;
    /* Host-memory sources are copied and checksummed in one pass; a CUDA
     * device block is copied by the copier, then checksummed here. */
    for (uint32_t i = 0; i < u->n_ops && !rc; i++) {
        kvt__op *op = u->ops[i];
        uint8_t *dst = buf + (size_t)i * d->slot_bytes;
        const uint8_t *src = kvt__arena_block(&p->tier[op->src_tier], op->src_blk);
        if (kvt__host_mem(op, op->src_tier))
            op->crc = kvt__crc32c_copy(dst, src, d->block_bytes);
        else
            rc = kvt__stage_copy(m, op, op->src_tier, dst, src, &queued);
    }
    if (queued) { /* even after an error: nothing may still be landing */
        const int e2 = p->be->copier_sync(p, m->io_cs);
        rc = rc ? rc : e2;
    }
    if (rc)
        return rc;
    for (uint32_t i = 0; i < u->n_ops; i++) {
        kvt__op *op = u->ops[i];
        uint8_t *dst = buf + (size_t)i * d->slot_bytes;
        if (d->slot_bytes > d->block_bytes)
            memset(dst + d->block_bytes, 0, d->slot_bytes - d->block_bytes);
        if (!kvt__host_mem(op, op->src_tier))
            op->crc = kvt__crc32c(0, dst, d->block_bytes);
    }
    if (u->fault == KVT__FAULT_FLIP) {
        buf[d->block_bytes / 3] ^= 0x5a; /* media corruption after the CRC */
        u->fault = KVT__FAULT_NONE;
    }
    return 0;
}

static void kvt__prep(kvt_mover *m, kvt__iou *u)
{
    struct io_uring *ring = m->ring;
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    uint8_t *buf = kvt__unit_buf(m, u) + u->done;
    const unsigned len = u->len - u->done;
    const uint64_t off = u->off + u->done;
    if (u->direct) {
        io_uring_prep_read_fixed(sqe, 0, buf, len, off, (int)u->reg);
        sqe->flags |= IOSQE_FIXED_FILE;
    } else if (m->registered) {
        if (u->write)
            io_uring_prep_write_fixed(sqe, 0, buf, len, off, (int)u->buf);
        else
            io_uring_prep_read_fixed(sqe, 0, buf, len, off, (int)u->buf);
        sqe->flags |= IOSQE_FIXED_FILE;
    } else {
        const int fd = m->pool->disk->fd;
        if (u->write)
            io_uring_prep_write(sqe, fd, buf, len, off);
        else
            io_uring_prep_read(sqe, fd, buf, len, off);
    }
    io_uring_sqe_set_data(sqe, u);
}

static void kvt__fail_msg(kvt_mover *m, kvt__op *op, const kvt__iou *u, int32_t code, int err)
{
    kvt__op_finish_locked(m, op, code, "disk %s of slot %llu (%u pages at offset %llu): %s",
                          u->write ? "write" : "read", (unsigned long long)op->dslot, u->n_ops,
                          (unsigned long long)u->off,
                          err ? strerror(err) : "unexpected end of file");
}

/* Completes a request: pages verified and copied (reads), results queued. */
static void kvt__unit_done(kvt_mover *m, kvt__iou *u, int32_t code, int err)
{
    const kvt_pool *p = m->pool;
    const kvt__disk *d = p->disk;
    int32_t st[64];
    uint8_t *buf = kvt__unit_buf(m, u);
    /* Verify outside the lock; pages are independent. */
    bool queued = false;
    int cerr = 0;
    char cmsg[160] = "";
    for (uint32_t i = 0; i < u->n_ops && !code; i++) {
        kvt__op *op = u->ops[i];
        int32_t s = 0;
        if (!u->write) {
            const uint8_t *src = buf + (size_t)i * d->slot_bytes;
            uint8_t *dst = kvt__arena_block(&p->tier[op->dst_tier], op->dst_blk);
            if (!u->direct && kvt__host_mem(op, op->dst_tier)) {
                /* Copied and checked in one pass over the staging buffer;
                 * on a mismatch the block is freed unused. */
                if (kvt__crc32c_copy(dst, src, d->block_bytes) != op->crc)
                    s = KVT_ECORRUPT;
            } else if (kvt__crc32c(0, src, d->block_bytes) != op->crc) {
                s = KVT_ECORRUPT;
            } else if (!cerr && !u->direct) {
                cerr = kvt__stage_copy(m, op, op->dst_tier, dst, src, &queued);
            }
        }
        if (i < 64)
            st[i] = s;
        else
            op->status = s;
    }
    if (queued) { /* the staging buffer and the blocks are reused once it is done */
        const int e2 = p->be->copier_sync(p, m->io_cs);
        cerr = cerr ? cerr : e2;
    }
    if (cerr)
        snprintf(cmsg, sizeof cmsg, "%s", kvt_last_error());
    pthread_mutex_lock(&m->mu);
    if (u->write) {
        m->disk_writes++;
        m->disk_write_bytes += u->done;
    } else {
        m->disk_reads++;
        m->disk_read_bytes += u->done;
    }
    for (uint32_t i = 0; i < u->n_ops; i++) {
        kvt__op *op = u->ops[i];
        if (code) {
            m->io_errors++;
            kvt__fail_msg(m, op, u, code, err);
            continue;
        }
        int32_t s = i < 64 ? st[i] : op->status;
        if (cerr && s == 0 && !u->write) {
            kvt__op_finish_locked(m, op, cerr, "disk read of slot %llu: the copy to the device "
                                  "failed: %s", (unsigned long long)op->dslot, cmsg);
        } else if (s == KVT_ECORRUPT) {
            m->checksum_errors++;
            kvt__op_finish_locked(m, op, s, "disk read of slot %llu: CRC32C mismatch (the "
                                  "page's data is not used)", (unsigned long long)op->dslot);
        } else {
            kvt__op_finish_locked(m, op, 0, NULL);
        }
    }
    m->free_units[m->n_free_units++] = u->buf;
    kvt__wake_locked(m);
    pthread_mutex_unlock(&m->mu);
}

/* A write whose staging copy from the device failed: its moves fail, the
 * disk is not touched. */
static void kvt__stage_fail(kvt_mover *m, kvt__iou *u)
{
    char msg[160];
    snprintf(msg, sizeof msg, "%s", kvt_last_error());
    pthread_mutex_lock(&m->mu);
    for (uint32_t i = 0; i < u->n_ops; i++)
        kvt__op_finish_locked(m, u->ops[i], KVT_EIO, "disk write of slot %llu: the copy from "
                              "the device failed: %s", (unsigned long long)u->ops[i]->dslot, msg);
    m->free_units[m->n_free_units++] = u->buf;
    kvt__wake_locked(m);
    pthread_mutex_unlock(&m->mu);
}

/* The I/O thread's state between its passes. */
typedef struct kvt__iot {
    uint32_t inflight, n_prep, n_done, d0;
} kvt__iot;

/* Reaps every completion the ring holds (no wait): finished requests to
 * the done list, short and retried ones back to prep, failures finished. */
static void kvt__reap(kvt_mover *m, kvt__iot *t)
{
    struct io_uring *ring = m->ring;
    const kvt__disk *d = m->pool->disk;
    kvt__iou **done = m->done_units;
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(ring, head, cqe)
    {
        kvt__iou *u = io_uring_cqe_get_data(cqe);
        int res = cqe->res;
        seen++;
        t->inflight--;
        switch (u->fault) {
        case KVT__FAULT_EIO:
            res = -EIO;
            break;
        case KVT__FAULT_ENOSPC:
            res = -ENOSPC;
            break;
        case KVT__FAULT_EAGAIN:
            res = -EAGAIN;
            break;
        case KVT__FAULT_SHORT:
            if (res > 0 && ((unsigned)res / 2u) / KVT__DIO_ALIGN > 0)
                res = (int)(((unsigned)res / 2u) / KVT__DIO_ALIGN * KVT__DIO_ALIGN);
            break;
        case KVT__FAULT_FLIP:
            if (!u->write && res > 0)
                kvt__unit_buf(m, u)[d->block_bytes / 2] ^= 0xa5;
            break;
        default:
            break;
        }
        u->fault = KVT__FAULT_NONE;
        if (res == -EAGAIN || res == -EINTR) {
            if (++u->retries > KVT__MAX_RETRIES) {
                kvt__unit_done(m, u, KVT_EIO, -res);
            } else {
                pthread_mutex_lock(&m->mu);
                m->retries++;
                pthread_mutex_unlock(&m->mu);
                m->prep[t->n_prep++] = u;
            }
        } else if (res < 0) {
            kvt__unit_done(m, u, res == -ENOSPC ? KVT_ENOSPC : KVT_EIO, -res);
        } else if (res == 0) {
            kvt__unit_done(m, u, KVT_EIO, 0); /* end of file inside the disk file */
        } else {
            u->done += (uint32_t)res;
            if (u->done < u->len) {
                pthread_mutex_lock(&m->mu);
                m->short_io++;
                pthread_mutex_unlock(&m->mu);
                m->prep[t->n_prep++] = u;
            } else {
                done[t->n_done++] = u;
            }
        }
    }
    io_uring_cq_advance(ring, seen);
}

/* Completed requests are checked (and copied) at most this many bytes at a
 * time between two looks at the ring, so requests that finish meanwhile
 * are replaced at once and the disk's queue stays full (checking a whole
 * queue's worth at once left it short by a tenth at 128 KiB requests). */
#define KVT__CHECK_BYTES (256u << 10)

void *kvt__uring_thread(void *arg)
{
    kvt_mover *m = arg;
    struct io_uring *ring = m->ring;
    const kvt__disk *d = m->pool->disk;
    const uint32_t max_ops = m->stage_bytes / (uint32_t)d->slot_bytes;
    const uint32_t qd = m->o.queue_depth;
    kvt__iot t = {0, 0, 0, 0};
    uint32_t n_fail = 0;
    kvt__iou **done = m->done_units;

    pthread_mutex_lock(&m->mu);
    for (;;) {
        /* Take queued moves (urgent first), coalescing adjacent slots of
         * the same kind into one request up to the staging size. */
        while (m->n_free_units && t.inflight + t.n_prep < qd &&
               (m->iq_head[0] || m->iq_head[1])) {
            const int q = m->iq_head[0] ? 0 : 1;
            kvt__iou *u = &m->units[m->free_units[--m->n_free_units]];
            kvt__op *op = kvt__q_pop_io(m, q);
            u->ops[0] = op;
            u->n_ops = 1;
            u->write = op->kind == KVT__OP_WRITE;
            while (u->n_ops < max_ops && m->iq_head[q] && m->iq_head[q]->kind == op->kind &&
                   m->iq_head[q]->dslot == u->ops[u->n_ops - 1]->dslot + 1)
                u->ops[u->n_ops++] = kvt__q_pop_io(m, q);
            u->off = op->dslot * d->slot_bytes;
            u->len = u->n_ops * (uint32_t)d->slot_bytes;
            u->done = 0;
            u->retries = 0;
            u->fault = KVT__FAULT_NONE;
            u->direct = NULL;
            m->prep[t.n_prep++] = u;
        }
        if (!t.n_prep && !t.inflight && t.d0 == t.n_done) {
            if (m->stop)
                break;
            pthread_cond_wait(&m->io_cv, &m->mu);
            continue;
        }
        pthread_mutex_unlock(&m->mu);

        for (uint32_t i = 0; i < t.n_prep; i++) {
            kvt__iou *u = m->prep[i];
            if (u->done == 0 && u->retries == 0) {
                u->fault = kvt__fault_draw(m, u->write);
                if (m->registered)
                    kvt__direct_dst(m, u);
                if (u->write && kvt__stage_write(m, u)) {
                    kvt__stage_fail(m, u);
                    n_fail++;
                    continue;
                }
            }
            kvt__prep(m, u);
        }
        t.inflight += t.n_prep - n_fail;
        t.n_prep = n_fail = 0;
        int e;
        if (t.d0 < t.n_done) {
            /* The refills are on their way first; then a share of the
             * completed reads is checked and copied while the disk works,
             * and the ring is looked at again. */
            if (t.inflight) {
                do
                    e = io_uring_submit(ring);
                while (e == -EINTR);
                (void)e; /* a broken ring shows in a wait below */
            }
            uint64_t bytes = 0;
            while (t.d0 < t.n_done && bytes < KVT__CHECK_BYTES) {
                bytes += done[t.d0]->len;
                kvt__unit_done(m, done[t.d0++], 0, 0);
            }
            if (t.d0 == t.n_done) {
                t.d0 = t.n_done = 0;
            } else if (t.inflight) {
                /* Keep the list from the start: each unit is in it once. */
                memmove(done, done + t.d0, (t.n_done - t.d0) * sizeof *done);
                t.n_done -= t.d0;
                t.d0 = 0;
                kvt__reap(m, &t);
            }
            pthread_mutex_lock(&m->mu);
            continue;
        }
        if (!t.inflight) { /* every prepared write failed its staging copy */
            pthread_mutex_lock(&m->mu);
            continue;
        }
        do
            e = io_uring_submit_and_wait(ring, 1);
        while (e == -EINTR);
        if (e < 0) {
            /* The ring itself failed: nothing more can be submitted or
             * reaped reliably. Wait for what is in flight, then fail. */
            struct io_uring_cqe *cqe;
            while (t.inflight && io_uring_wait_cqe(ring, &cqe) == 0) {
                kvt__iou *u = io_uring_cqe_get_data(cqe);
                io_uring_cqe_seen(ring, cqe);
                t.inflight--;
                kvt__unit_done(m, u, KVT_EIO, -e);
            }
            t.inflight = 0;
        }
        kvt__reap(m, &t);
        pthread_mutex_lock(&m->mu);
    }
    pthread_mutex_unlock(&m->mu);
    if (m->io_cs)
        m->pool->be->copier_close(m->io_cs);
    m->io_cs = NULL;
    return NULL;
}
