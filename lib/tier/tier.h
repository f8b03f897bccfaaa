/* Internal interface of the tier mover and the disk tier (lib/tier). */
#ifndef KVTIER_TIER_H
#define KVTIER_TIER_H

#include "../core/store.h"
#include "../backend/backend.h"
#include "prefix.h"
#include "remote.h" /* the remote tier: rslot.c, rvalue.c, rclient.c */

/* ---- disk tier (disk.c) ----------------------------------------------------
 * One file, cut into page slots (a block rounded up to the 4 KiB O_DIRECT
 * unit), grouped into extents of E slots, grouped into segments of S
 * extents. A (layer, head) claims whole segments, and each (sequence, layer,
 * head) takes extents from its layer-head's segments, so the pages of one
 * (sequence, layer, head) lie in page order inside extents that are usually
 * neighbours on disk ("layer-head partitioning"). */
typedef struct kvt__disk {
    int fd;
    bool direct;           /* opened with O_DIRECT */
    bool keep;             /* file left in place on destroy */
    bool kept;             /* the pool was created: keep it from now on */
    char *path;
    uint64_t file_bytes;
    uint64_t block_bytes;  /* bytes of a page */
    uint64_t slot_bytes;   /* bytes a page takes on disk */
    uint32_t E, S;         /* extent pages, segment extents */
    uint32_t n_ext, n_seg;
    uint32_t n_lh;
    uint32_t *ext_next;    /* [n_ext] free-list links; UINT32_MAX ends */
    uint32_t *ext_lh;      /* [n_ext] layer-head whose segment holds it; UINT32_MAX = none */
    uint32_t *lh_head;     /* [n_lh] free extents of the layer-head */
    uint32_t *seg_stack;   /* free segments */
    uint32_t n_seg_free;
    uint32_t n_ext_free;   /* extents free (in layer-head lists and free segments) */
    uint32_t *crc;         /* [n_ext * E] CRC32C of the page in each slot */
    /* Slots belong to physical pages (shared pages have one): pslot[meta
     * slot] = the page's slot (UINT64_MAX = none), slot_used[slot] = 1 when
     * a page holds it. An extent lives while a sequence's extent table
     * names it or a page holds one of its slots: ext_ref counts both. */
    uint64_t *pslot;
    uint8_t *slot_used;
    uint32_t *ext_ref;
    uint32_t n_pslot;
    /* [n_lh] extent + 1 that cached pages spilled from the host tier fill
     * (lib/tier/pcache.c); holds a reference like a sequence's table. */
    uint32_t *spill;
} kvt__disk;

#define KVT__DIO_ALIGN 4096u

KVT__HIDDEN int kvt__disk_open(kvt_pool *p, const char *dir, uint64_t bytes,
                               const kvt_mover_opts *mo, kvt__disk **out);
KVT__HIDDEN void kvt__disk_close(kvt__disk *d);
/* Sizes the per-page slot table for the pool's n metadata slots. */
KVT__HIDDEN int kvt__disk_pages_init(kvt__disk *d, uint32_t n);
/* Frees the disk slot of physical page `meta` (its last holder let it go). */
KVT__HIDDEN void kvt__disk_page_free(kvt_pool *p, uint32_t meta);
/* Lets go of s's extents of (lh) for pages from `first_page` on (a
 * truncation; the pages themselves were let go first). */
KVT__HIDDEN void kvt__disk_trim_seq(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t first_page);
/* The disk slot of (s, lh, page), or UINT64_MAX when it has none. */
KVT__HIDDEN uint64_t kvt__disk_slot(const kvt_pool *p, const kvt__seq *s, size_t lh,
                                    uint32_t page);
/* As kvt__disk_slot, giving the page a slot when it has none: its place in
 * s's extent of its page group (a new extent when that place is taken, by
 * a page s let go that another sequence still holds); KVT_ENOSPC when the
 * file is full. */
KVT__HIDDEN int kvt__disk_slot_alloc(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page,
                                     uint64_t *slot);
/* A disk slot for physical page `meta` of layer-head lh that no sequence
 * holds (a cached page spilled from the host tier): the next free slot of
 * the layer-head's spill extent. KVT_ENOSPC when the file is full. */
KVT__HIDDEN int kvt__disk_spill_slot(kvt_pool *p, size_t lh, uint32_t meta, uint64_t *slot);
/* Synchronous write of one page (block_bytes at buf) to its slot, with its
 * CRC recorded. */
KVT__HIDDEN int kvt__disk_write_page(const kvt_pool *p, uint64_t slot, const void *buf);
/* Lets go of every extent in the sequence's extent table. */
KVT__HIDDEN void kvt__disk_free_seq(kvt_pool *p, kvt__seq *s);
/* Synchronous read of one page from its slot into buf (block_bytes, any
 * alignment), verified against its CRC. */
KVT__HIDDEN int kvt__disk_read_page(const kvt_pool *p, uint64_t slot, void *buf);
/* The same into tmp (KVT__DIO_ALIGN-aligned, slot_bytes), allocating
 * nothing and setting no error message (safe on the worker threads):
 * returns 0, KVT_EIO, KVT_ENOMEM or KVT_ECORRUPT; the block is tmp's
 * first block_bytes. */
KVT__HIDDEN int kvt__disk_read_into(const kvt_pool *p, uint64_t slot, void *tmp);
/* Copies the block of page (lh, page) of s, from the fastest tier that holds
 * it, into buf (block_bytes; host memory). A disk copy is checked against
 * its CRC (KVT_ECORRUPT, KVT_EIO). */
KVT__HIDDEN int kvt__page_read(const kvt_pool *p, const kvt__seq *s, size_t lh, uint32_t page,
                               uint8_t *buf);
/* Invariant walk of the extents (called by kvt_pool_check). */
KVT__HIDDEN int kvt__disk_check(const kvt_pool *p);
/* Grows s->tier.disk_ext to cover cap_pages pages per (layer, head). */
KVT__HIDDEN int kvt__disk_seq_reserve(kvt_pool *p, kvt__seq *s, uint32_t cap_pages);

/* ---- mover (mover.c, uring.c) ----------------------------------------------- */
enum { KVT__OP_NOP = 0, KVT__OP_COPY = 1, KVT__OP_WRITE = 2, KVT__OP_READ = 3 };

typedef struct kvt__op {
    struct kvt__op *next;      /* queue link */
    struct kvt__batch *batch;
    uint32_t idx;              /* position in the batch */
    uint32_t slot, page;       /* sequence slot, logical page */
    uint32_t lh;
    uint8_t from, to, flags, kind;
    uint8_t src_tier, dst_tier;
    uint8_t iflags;            /* KVT__OPF_* (placement's internal moves) */
    uint32_t src_blk;          /* memory block read by COPY / WRITE */
    uint32_t dst_blk;          /* memory block written by COPY / READ (reserved) */
    uint64_t dslot;            /* disk slot read or written */
    uint32_t crc;              /* WRITE: computed; READ: expected */
    int32_t status;
} kvt__op;

/* kvt__op.iflags */
#define KVT__OPF_CHAIN   (1u << 0) /* device -> host, then host -> disk in one move */
#define KVT__OPF_OFFLOAD (1u << 1) /* placement's copy-out: a failure rewinds the
                                      head's offload cursor */
#define KVT__OPF_PROMOTE (1u << 2) /* placement's promotion */
#define KVT__OPF_HANDED  (1u << 3) /* dst_blk was handed over by the caller: a
                                      refused submit leaves it to the caller */
#define KVT__OPF_DETACH  (1u << 4) /* nobody waits for the fence: the batch record
                                      is freed once every move is applied */
#define KVT__OPF_OWNED   (1u << 5) /* the library waits for the fence itself (step
                                      promotions, warm-up): a caller's wait or poll
                                      on KVT_FENCE_ALL leaves it to the library */

typedef struct kvt__batch {
    struct kvt__batch *next;   /* the mover's list of unreported batches */
    kvt_fence fence;
    uint32_t n, n_done;        /* n_done: applied (caller thread) */
    uint32_t n_fin;            /* finished by the threads (under mu) */
    int32_t first_err;
    bool urgent;
    bool detached;             /* KVT__OPF_DETACH */
    bool owned;                /* KVT__OPF_OWNED */
    int32_t *results;
    void *cu_ev;               /* the batch's device-side start (be->batch_mark) */
    char msg[192];             /* the first failure, in words */
    kvt__op ops[];
} kvt__batch;

/* A disk request after coalescing: adjacent slots in one I/O. */
typedef struct kvt__iou {
    kvt__op **ops;
    uint32_t n_ops;
    bool write;
    uint32_t buf;              /* staging buffer index */
    uint8_t *direct;           /* a read straight into its blocks: the first one
                                  (NULL: through the staging buffer) */
    uint32_t reg;              /* fixed-buffer index of `direct` */
    uint64_t off;
    uint32_t len, done;
    uint32_t retries;
    uint32_t fault;            /* KVT__FAULT_* to apply to this request */
} kvt__iou;

/* Fault injection (test builds, -DKVT_FAULT_INJECTION). */
#define KVT__FAULT_NONE   0u
#define KVT__FAULT_EIO    1u /* the request fails with -EIO */
#define KVT__FAULT_SHORT  2u /* the request returns half its bytes */
#define KVT__FAULT_FLIP   3u /* one byte of the data is flipped (read: after the
                                read; write: before it, so the disk holds it) */
#define KVT__FAULT_ENOSPC 4u /* the request fails with -ENOSPC */
#define KVT__FAULT_EAGAIN 5u /* the request fails with -EAGAIN (retried) */

typedef struct kvt__fault {
    uint32_t kind;
    uint64_t nth;              /* 1-based request count that fails; 0 = off */
    uint64_t count;
} kvt__fault;

/* ---- the host cache's eviction order (hostlru.c) --------------------------- */
#define KVT__HLRU_BITS 12u
#define KVT__HLRU_NB   (1u << KVT__HLRU_BITS) /* importance buckets; NB = parked */
#define KVT__HLRU_NIL  UINT32_MAX
#define KVT__HLRU_NONE UINT16_MAX            /* bk[]: not listed */
typedef struct kvt__hlru {
    uint32_t n;                              /* host blocks */
    uint32_t *prev, *next;                   /* [n] list links */
    uint32_t *fuse;                          /* [n] the page's use stamp when filed */
    uint16_t *bk;                            /* [n] bucket (NB: parked), or NONE */
    uint32_t head[KVT__HLRU_NB + 1], tail[KVT__HLRU_NB + 1];
    uint64_t bits[KVT__HLRU_NB / 64];        /* non-empty buckets */
    uint64_t sum;                            /* non-zero words of bits */
    uint32_t *pend;                          /* blocks to file at the next eviction */
    uint8_t *pmark;                          /* [n] 1 while in pend */
    uint32_t n_pend;
} kvt__hlru;
KVT__HIDDEN int kvt__hlru_init(kvt__hlru *l, uint32_t n);
KVT__HIDDEN void kvt__hlru_fini(kvt__hlru *l);
/* Importance to an order-preserving key (-0 as +0, NaN as +inf), and to
 * its bucket: the key's top 12 bits (1/8 octave). */
KVT__HIDDEN uint32_t kvt__hlru_key(float imp);
KVT__HIDDEN uint32_t kvt__hlru_bucket(float imp);
/* Files block b at the tail of its importance's bucket (moving it if listed). */
KVT__HIDDEN void kvt__hlru_file(kvt__hlru *l, uint32_t b, float imp, uint32_t use);
/* Files b in the parked list: listed, but never popped. */
KVT__HIDDEN void kvt__hlru_park(kvt__hlru *l, uint32_t b, uint32_t use);
KVT__HIDDEN void kvt__hlru_unlink(kvt__hlru *l, uint32_t b);
/* The head of the lowest non-empty bucket, or KVT__HLRU_NIL. */
KVT__HIDDEN uint32_t kvt__hlru_lowest(const kvt__hlru *l);

struct kvt_mover {
    kvt_pool *pool;
    kvt_mover_opts o;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, io_cv, done_cv;
    bool stop;
    bool wake;                          /* a batch finished: broadcast done_cv */
    bool sync_inited;
    /* Queues, under mu: [0] urgent, [1] normal. */
    kvt__op *cq_head[2], *cq_tail[2];  /* memcpy */
    kvt__op *iq_head[2], *iq_tail[2];  /* disk */
    kvt__op *done_head, *done_tail;    /* finished, not applied */
    uint64_t pending;                   /* ops queued or running */
    pthread_t *copy_th;
    uint32_t n_copy;
    bool io_started;
    pthread_t io_th;
    /* io_uring, used by the I/O thread only. */
    void *ring;                         /* struct io_uring */
    bool registered;
    uint8_t *stage;
    size_t stage_map;
    uint32_t stage_bytes;               /* bytes of one staging buffer */
    uint32_t n_units;
    kvt__iou *units;
    kvt__op **unit_ops;
    uint32_t *free_units;
    uint32_t n_free_units;
    kvt__iou **prep;                    /* [n_units] to (re)submit */
    kvt__iou **done_units;              /* [n_units] completed, not yet checked */
    void *io_cs;                        /* CUDA pools: the I/O thread's copier */
    bool stage_pinned;                  /* CUDA pools: stage registered with CUDA */
    /* Reads straight into host-memory arenas (uring.c): each arena's blocks
     * in chunks, registered as fixed buffers when a read first lands in
     * one. chunk_state: 0 not yet, 1 registered, 2 refused. */
    uint32_t reg_base[KVT_NUM_TIERS];   /* first fixed-buffer index; 0: none */
    uint32_t chunk_blocks[KVT_NUM_TIERS];
    uint8_t *chunk_state[KVT_NUM_TIERS];
    /* Caller-thread state. */
    kvt__batch *batches;
    kvt__batch **batches_tail;
    kvt_fence next_fence;
    uint64_t batches_in_flight, moves_in_flight;
    void *evict_scratch;
    kvt__hlru hlru;                     /* host blocks by eviction order */
    /* Counters (written under mu by the threads, or by the caller). */
    uint64_t disk_reads, disk_writes, disk_read_bytes, disk_write_bytes;
    uint64_t retries, short_io, io_errors, checksum_errors, evictions;
    kvt__fault fault_read, fault_write;
};

/* Pops the head of disk queue q (under mu). */
static inline kvt__op *kvt__q_pop_io(kvt_mover *m, int q)
{
    kvt__op *op = m->iq_head[q];
    m->iq_head[q] = op->next;
    if (!m->iq_head[q])
        m->iq_tail[q] = NULL;
    op->next = NULL;
    return op;
}

KVT__HIDDEN int kvt__mover_create(kvt_pool *p, const kvt_mover_opts *o);
/* kvt_mover_submit with placement's extras: dst_dev[i] (when dst_dev is not
 * NULL and the entry is not 0) is a device block the caller already took
 * for move i (an evicted page's block, handed over without the free list);
 * iflags (KVT__OPF_*) apply to every move of the batch. */
KVT__HIDDEN int kvt__mover_submit(kvt_mover *m, const kvt_move *moves, uint32_t n,
                                  uint32_t flags, int32_t *results, kvt_fence *fence,
                                  const uint32_t *dst_dev, uint8_t iflags);
/* ---- placement (place.c) ---------------------------------------------------
 * Copies out, once, the full pages of the stable heads of seqs[n] (in
 * `layer`, UINT32_MAX = all) that no other tier holds; waits when asked. */
KVT__HIDDEN int kvt__place_offload(kvt_pool *p, kvt__seq *const *seqs, const kvt_seq_id *ids,
                                   uint32_t n, uint32_t layer, bool wait);
/* After a prefill append to `layer` (the sequence had tokens_before):
 * offload and wait, then drop device copies stable heads do not keep. */
KVT__HIDDEN int kvt__place_after_append(kvt_pool *p, kvt__seq *s, kvt_seq_id id,
                                        uint32_t layer, uint32_t tokens_before);
/* Settles a sequence (release, warm-up): no move of its pages in flight
 * (the mover's threads write into its blocks), and a warm-up batch no step
 * consumed retired, its outcome dropped (its pages arrived or stayed where
 * they were; a step that needs them reranks). */
KVT__HIDDEN void kvt__place_settle(kvt_pool *p, kvt__seq *s);
/* A cut of s to n_tokens makes the last full pages before the cut local
 * (forced onto the device) for every stable head: with count, *count = the
 * pages that have no device copy; without, copies them to the device tier
 * and waits (KVT_ENOSPC, KVT_EIO, KVT_ECORRUPT from the moves). */
KVT__HIDDEN int kvt__place_forced_in(kvt_pool *p, kvt__seq *s, kvt_seq_id id, uint32_t n_tokens,
                                     uint64_t *count);
/* After a prefix attach: the pages of s that the placement keeps on device
 * (an unstable head's every page; a stable head's sink, local and last
 * pages) and that are not there: counted (count) or copied in and waited
 * for. */
KVT__HIDDEN int kvt__place_attach_in(kvt_pool *p, kvt__seq *s, kvt_seq_id id, uint64_t *count);
/* kvt_seq_warmup's work once its arguments and the pool's state are
 * checked (lib/api/warmup.c): settle the sequence, score every stable
 * head's pages over the observation queries, and place them. */
KVT__HIDDEN int kvt__place_warmup(kvt_pool *pool, kvt__seq *s, kvt_seq_id seq,
                                  const float *obs_queries, uint32_t n_obs);

/* ---- the per-step placement (recycle.c) ------------------------------------
 * An eviction candidate of one head: its score and page. */
typedef struct kvt__evc {
    float imp;
    uint32_t page;
} kvt__evc;
/* Whether head lh of `layer` of s reranks in this step (not dense), under
 * budget k and rerank interval iv: with no kept top-K set, at interval 1,
 * at the steps its interval and the sequence's phase pick, and in a tiered
 * pool (tiered) a stable head also when its reused selection names a page
 * off device. */
KVT__HIDDEN bool kvt__head_due(const kvt_pool *p, const kvt__seq *s, uint32_t layer, size_t lh,
                               uint32_t k, uint32_t iv, bool tiered);
/* Adds to *need the device blocks the reranks of s's due stable heads (at
 * budgets ak[L * H], intervals aiv[L * H]; a head the selection cache may
 * rescore, asim[lh] > -1, counts as due) may take beyond what they give
 * back, and to *pm the promotions they may issue. */
KVT__HIDDEN void kvt__place_promote_bound(const kvt_pool *p, const kvt__seq *s,
                                          const uint32_t *ak, const uint32_t *aiv,
                                          const float *asim, uint64_t *need, uint64_t *pm);
/* The fused recycle of stable head h of `layer` of s (sequence seq_index of
 * the step, id `id`) after a rerank selected the sorted pages sel[cnt] at
 * budget k: lookahead eviction keeps up to k x window non-forced pages, the
 * evictable ones with the highest scores; evicted pages' device blocks go
 * straight to the promoted pages, written as moves to pm[], their blocks to
 * pmdst[] and 0 to pmres[] (at most cap; the count in *n_pm), the other
 * evictions drop their device copies. ev and pml: scratch of the head's
 * page count. KVT_ENOSPC (the device tier cannot take the promotions) or
 * KVT_EINTERNAL (more than cap) change nothing. */
KVT__HIDDEN int kvt__place_recycle_head(kvt_pool *p, kvt__seq *s, kvt_seq_id id,
                                        uint32_t seq_index, uint32_t layer, uint32_t h,
                                        const uint32_t *sel, uint32_t cnt, uint32_t k,
                                        kvt__evc *ev, uint32_t *pml, kvt_move *pm,
                                        uint32_t *pmdst, int32_t *pmres, size_t cap,
                                        uint32_t *n_pm);

/* Queues page e's host block (when it has one that s owns) for filing in
 * the host cache's eviction lists: after a move of the page is applied, or
 * when a cached page is adopted. The queue is filed at the next eviction
 * in (bucket, last use, block) order, so the lists do not depend on the
 * order in which moves completed (mover_submit.c). */
KVT__HIDDEN void kvt__host_file(kvt_pool *p, kvt__seq *s, size_t e);
/* After a head's importances were rewritten (a selection, the warm-up):
 * queues its host copies whose importance fell below their listed bucket
 * (the lists would rank them too high; a rise is caught when popped).
 * Caller thread. */
KVT__HIDDEN void kvt__host_imp_changed(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t np);
/* Drops the copy of page e of s in `tier` (another copy exists). */
KVT__HIDDEN void kvt__page_drop(kvt_pool *p, kvt__seq *s, size_t e, uint32_t tier);
/* Whether another holder of the shared page (s, lh, page) needs its device
 * copy: the page is forced there, or (with `selections`) in its current
 * selection (recycle.c). False for a page only s holds. */
KVT__HIDDEN bool kvt__held_elsewhere(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page,
                                     bool selections);
/* Shared by mover.c and mover_submit.c: queues op at the tail of a
 * priority queue; applies the moves the workers finished (caller thread). */
KVT__HIDDEN void kvt__mover_q_push(kvt__op **head, kvt__op **tail, kvt__op *op);
KVT__HIDDEN void kvt__mover_apply_done(kvt_mover *m);
/* Applies finished moves without waiting. */
KVT__HIDDEN void kvt__mover_apply(kvt_mover *m);
/* 1 when the batch of `fence` is complete (its first error in *code,
 * reported once), 0 while in flight. */
KVT__HIDDEN int kvt__mover_fence_done(kvt_mover *m, kvt_fence fence, int *code);
/* Waits for the batch of `fence`; returns its first error (0 = none). */
KVT__HIDDEN int kvt__mover_fence_wait(kvt_mover *m, kvt_fence fence);
/* Waits for every queued move, stops the threads, frees everything. */
KVT__HIDDEN void kvt__mover_destroy(kvt_mover *m);
/* Waits until no move of the sequence is in flight, applying completions. */
KVT__HIDDEN void kvt__mover_drain_seq(kvt_mover *m, kvt__seq *s);
/* Waits until no move of page e of s (by any holder) is in flight. */
KVT__HIDDEN void kvt__mover_drain_page(kvt_mover *m, const kvt__seq *s, size_t e);
/* Marks blocks held by moves in flight (for kvt_pool_check): calls fn for
 * every reserved destination block. */
KVT__HIDDEN void kvt__mover_reserved(const kvt_mover *m,
                                     void (*fn)(void *ctx, uint32_t tier, uint32_t blk),
                                     void *ctx);
/* The I/O thread (uring.c). */
KVT__HIDDEN int kvt__uring_init(kvt_mover *m);
KVT__HIDDEN void kvt__uring_fini(kvt_mover *m);
KVT__HIDDEN void *kvt__uring_thread(void *arg);
/* Called by the threads, under mu: an op is finished. */
KVT__HIDDEN void kvt__op_finish_locked(kvt_mover *m, kvt__op *op, int32_t status,
                                       const char *fmt, ...) KVT__PRINTF(4, 5);

/* Broadcasts done_cv if a batch finished since the last call (under mu). */
KVT__HIDDEN void kvt__wake_locked(kvt_mover *m);

/* Validated options with defaults applied. */
KVT__HIDDEN int kvt__mover_opts_resolve(const kvt_mover_opts *in, kvt_mover_opts *out);

#ifdef KVT_FAULT_INJECTION
/* Test builds only: the nth disk read (write) request from now fails as
 * `kind` says. */
KVT__HIDDEN int kvt__mover_fault(kvt_mover *m, bool write, uint32_t kind, uint64_t nth);
#endif

#endif /* KVTIER_TIER_H */
