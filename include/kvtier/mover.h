/* libkvtier - the tier mover: asynchronous page moves between the device,
 * host and disk tiers of a pool.
 *
 * Every pool owns one mover (kvt_pool_mover_get); its options come with the
 * pool's (kvt_pool_opts.mover). A batch of moves is submitted at once and
 * named by a fence; kvt_mover_poll and kvt_mover_wait tell when it is done
 * and apply its results to the pool's block tables.
 *
 *   kvt_move mv[2] = {{seq, layer, head, page, KVT_TIER_DEVICE, KVT_TIER_HOST,
 *                      KVT_MOVE_DROP_SOURCE}, ...};
 *   kvt_fence f;
 *   kvt_mover_submit(mover, mv, 2, 0, results, &f);
 *   ... other work: the copies run on the mover's threads ...
 *   kvt_mover_wait(mover, f, UINT64_MAX);
 *
 * The data moves on the mover's own threads (memcpy workers for device <->
 * host, one io_uring thread for the disk); the pool's tables change only on
 * the caller's thread, inside kvt_mover_submit, kvt_mover_poll and
 * kvt_mover_wait (and kvt_seq_release, which waits for the moves of the
 * sequence it releases). So the pool stays single-threaded from the
 * caller's point of view: the mover is used by the thread that uses its pool.
 *
 * Nothing is lost: a page leaves a tier (KVT_MOVE_DROP_SOURCE) only once its
 * copy in the destination is complete - for the disk, written in full and
 * its CRC32C recorded. Every disk read is checked against that CRC; a
 * mismatch fails that page's move with KVT_ECORRUPT and its data is not
 * used.
 */
#ifndef KVTIER_MOVER_H
#define KVTIER_MOVER_H

#include "kvtier/common.h"
#include "kvtier/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_mover kvt_mover; /* opaque; owned by its pool */

/* kvt_mover_opts.flags */
#define KVT_MOVER_REQUIRE_DIRECT (1u << 0) /* fail pool creation (KVT_ENOTSUP) when
                                              the disk directory's filesystem refuses
                                              O_DIRECT, instead of falling back to
                                              buffered I/O */
#define KVT_MOVER_KEEP_DISK_FILE (1u << 1) /* keep the disk file after the pool is
                                              destroyed (for inspection; it cannot
                                              be reopened). Default: the file is
                                              unlinked as soon as it is open */

typedef struct kvt_mover_opts {
    uint32_t struct_size;   /* sizeof(kvt_mover_opts) */
    uint32_t flags;         /* KVT_MOVER_* */
    uint32_t copy_threads;  /* device <-> host memcpy workers, 1..64; 0 = 1 */
    uint32_t queue_depth;   /* disk requests in flight, 1..4096; 0 = 64 */
    uint32_t max_io_bytes;  /* largest disk request after coalescing adjacent
                               pages; 0 = 128 KiB; at least one page */
    uint32_t extent_pages;  /* pages per disk extent, 1..65536; 0 = 64 */
    uint32_t segment_extents; /* extents per layer-head segment, 1..65536;
                                 0 = 16 */
    uint32_t chunk_pages;   /* pages a copy worker takes at once from the
                               low-priority queue before it looks at the
                               high one again; 0 = 32 */
} kvt_mover_opts;

#define KVT_MOVER_OPTS_INIT { (uint32_t)sizeof(kvt_mover_opts), 0, 0, 0, 0, 0, 0, 0 }

/* Fills *opts with the defaults, written out. */
KVT_API int kvt_mover_opts_init(kvt_mover_opts *opts);

/* The pool's mover; valid until kvt_pool_destroy. */
KVT_API int kvt_pool_mover_get(kvt_pool *pool, kvt_mover **out);

/* One page move. The page is (seq, layer, kv_head, page); it must be full
 * (the partially filled last page of a (layer, head) never moves) and have
 * a copy in `from`. Moves go between any two tiers the pool has: device <->
 * host is a memcpy; device or host -> disk writes from that block; disk ->
 * host or device reads through the mover's staging buffers. When `to`
 * already holds the page the copy is skipped (only the drop happens). */
typedef struct kvt_move {
    kvt_seq_id seq;
    uint32_t layer;
    uint32_t kv_head;
    uint32_t page;     /* logical page index */
    kvt_tier from;
    kvt_tier to;
    uint32_t flags;    /* KVT_MOVE_DROP_SOURCE */
} kvt_move;

/* kvt_move.flags */
#define KVT_MOVE_DROP_SOURCE (1u << 0) /* release the copy in `from` once the copy
                                          in `to` is complete */

/* kvt_mover_submit flags */
#define KVT_SUBMIT_URGENT (1u << 0) /* the high-priority queues: ahead of every
                                       queued low-priority move */

/* A batch's completion fence: increasing, never 0. */
typedef uint64_t kvt_fence;
#define KVT_FENCE_ALL UINT64_MAX /* in poll/wait: every batch submitted so far */

/* Submits n moves as one batch and stores its fence in *fence. Every move is
 * checked first (KVT_EINVAL naming moves[i] and the field, KVT_ENOENT for a
 * released sequence, KVT_EBUSY when another move of the page is in flight,
 * KVT_ENOSPC when a destination tier has no room: the host tier first drops
 * copies that the disk also holds, lowest importance first); on any error
 * nothing is submitted. results, when not NULL, receives one code per move
 * (0, KVT_EIO, KVT_ENOSPC, KVT_ECORRUPT) when the batch completes; it must
 * stay valid until kvt_mover_poll or kvt_mover_wait has reported the fence.
 * n == 0 gives an already complete fence. */
KVT_API int kvt_mover_submit(kvt_mover *mover, const kvt_move *moves, uint32_t n,
                             uint32_t flags, int32_t *results, kvt_fence *fence);

/* Applies every completed move to the pool; returns 0 when the batch of
 * `fence` is complete and every move in it succeeded, the first failing
 * move's code when it completed with errors (reported once: later calls on
 * the same fence return 0), KVT_EAGAIN while it is in flight. */
KVT_API int kvt_mover_poll(kvt_mover *mover, kvt_fence fence);

/* As kvt_mover_poll, but waits up to timeout_ns nanoseconds (UINT64_MAX:
 * no limit) for the batch; KVT_ETIMEDOUT when it is still in flight. */
KVT_API int kvt_mover_wait(kvt_mover *mover, kvt_fence fence, uint64_t timeout_ns);

typedef struct kvt_mover_stats {
    uint32_t struct_size;     /* set by the caller */
    uint32_t disk_direct;     /* 1: the disk file is open with O_DIRECT */
    uint32_t registered;      /* 1: io_uring uses registered buffers and file */
    uint32_t queue_depth;
    uint64_t disk_file_bytes; /* size of the preallocated disk file */
    uint64_t batches_in_flight;
    uint64_t moves_in_flight;
    uint64_t moved_bytes[KVT_NUM_DIRS];    /* as kvt_stats: disk <-> device moves
                                              count in both hops through host */
    uint64_t moved_requests[KVT_NUM_DIRS];
    uint64_t disk_reads;      /* io_uring read requests (after coalescing) */
    uint64_t disk_writes;
    uint64_t disk_read_bytes;
    uint64_t disk_write_bytes;
    uint64_t retries;         /* -EAGAIN / -EINTR resubmissions */
    uint64_t short_io;        /* short reads/writes continued */
    uint64_t io_errors;       /* pages failed with KVT_EIO or KVT_ENOSPC */
    uint64_t checksum_errors; /* pages failed with KVT_ECORRUPT */
    uint64_t evictions;       /* host copies dropped to make room */
} kvt_mover_stats;

/* Fills the first stats->struct_size bytes of *stats. */
KVT_API int kvt_mover_stats_get(const kvt_mover *mover, kvt_mover_stats *stats);

/* Copies the disk file's path (NUL-terminated) into buf of cap bytes and
 * stores the length without the NUL in *len (when len is not NULL).
 * KVT_ENOENT when the pool has no disk tier; KVT_ERANGE (with *len set)
 * when cap is too small. */
KVT_API int kvt_pool_disk_path_get(const kvt_pool *pool, char *buf, size_t cap, size_t *len);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_MOVER_H */
