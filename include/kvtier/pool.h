/* libkvtier - the KV pool: tier memory, sequences, block tables, append.
 *
 * Thread safety: a kvt_pool and its sequences are used by one thread at a
 * time (the caller serialises); distinct pools are independent.
 */
#ifndef KVTIER_POOL_H
#define KVTIER_POOL_H

#include "kvtier/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_pool kvt_pool; /* opaque */

/* A sequence is named by an id, not a pointer, so that using a released
 * sequence is detected (KVT_ENOENT) instead of touching freed memory. */
typedef uint64_t kvt_seq_id;
#define KVT_SEQ_NONE ((kvt_seq_id)0)

/* Where the host arena lives (kvt_pool_opts.host_numa). */
typedef uint32_t kvt_numa_policy;
#define KVT_NUMA_LOCAL      0u /* the calling thread's node */
#define KVT_NUMA_NODE       1u /* node host_numa_node */
#define KVT_NUMA_INTERLEAVE 2u /* pages interleaved over all nodes */

/* kvt_pool_opts.flags */
#define KVT_POOL_HUGEPAGES (1u << 0) /* madvise(MADV_HUGEPAGE) the host arena
                                        (the CPU backend's device arena and the
                                        metadata store always ask for them) */
#define KVT_POOL_PREFIX_CACHE (1u << 1) /* the prefix cache (kvtier/prefix.h):
                                           full pages whose token ids are known
                                           are indexed by content and outlive
                                           their sequences until reclaimed */

/* Limits of the options. */
#define KVT_MAX_SEQS_DEFAULT       1024u
#define KVT_MAX_SEQ_TOKENS_DEFAULT (1u << 20)
#define KVT_MAX_SEQS_LIMIT         (1u << 20)
#define KVT_MAX_SEQ_TOKENS_LIMIT   (1u << 30)

typedef struct kvt_pool_opts {
    uint32_t struct_size;        /* sizeof(kvt_pool_opts) */
    kvt_backend backend;         /* KVT_BACKEND_* */
    kvt_geometry geom;           /* the model's KV shape (required) */
    uint64_t device_bytes;       /* device tier capacity (required); rounded
                                    down to whole blocks, block 0 of which
                                    is the null block */
    uint64_t host_bytes;         /* host tier capacity; 0 = no host tier,
                                    else at least two blocks */
    uint64_t disk_bytes;         /* disk tier capacity; 0 = no disk tier. One
                                    file, preallocated, rounded down to whole
                                    layer-head segments (kvtier/mover.h) */
    const char *disk_dir;        /* existing writable directory for the disk
                                    tier's file */
    kvt_numa_policy host_numa;   /* KVT_NUMA_* */
    int32_t host_numa_node;      /* node for KVT_NUMA_NODE */
    uint32_t max_seqs;           /* live sequences at once; 0 = default */
    uint32_t max_seq_tokens;     /* default per-sequence limit; 0 = default */
    uint32_t n_threads;          /* worker threads, <= 1024; 0 = online CPUs */
    uint32_t flags;              /* KVT_POOL_* */
    int32_t cuda_device;         /* device ordinal for the CUDA backend */
    uint32_t target_seqs;        /* with target_tokens: the sequences the
                                    device tier is sized for; 0 = 1 */
    const struct kvt_mover_opts *mover; /* tier mover options; NULL = defaults
                                           (kvtier/mover.h) */
    const struct kvt_policy *policy;  /* tiered placement by head class
                                         (kvtier/policy.h); requires a host
                                         tier; must outlive the pool. NULL =
                                         no placement: pages stay where they
                                         are put */
    const struct kvt_selector *selector; /* scores pages for kvt_seq_warmup and
                                            for steps that name no selector;
                                            must outlive the pool. NULL = none */
    uint64_t target_tokens;      /* with device_bytes 0: size the device tier
                                    for target_seqs sequences of
                                    target_tokens tokens, under the policy
                                    (none: every page on device), as
                                    kvt_pool_sizing_get computes it */
    /* Appended after the first layout (a struct_size of 136 reads it as
     * zero). */
    uint64_t prefix_cache_bytes[KVT_NUM_TIERS]; /* with KVT_POOL_PREFIX_CACHE:
                                    the most bytes of each tier (device,
                                    host, disk) that cached pages no
                                    sequence holds may keep; 0 = no cap but
                                    the tier's size (less than a block:
                                    none kept there) */
    /* Appended after the second layout (a struct_size of 160 reads it as
     * NULL). */
    const struct kvt_remote_opts *remote; /* with KVT_POOL_PREFIX_CACHE: the
                                    remote tier (kvtier/remote.h), copied
                                    at creation; NULL = none */
} kvt_pool_opts;

/* Positional form for C; C++ code should call kvt_pool_opts_init(). */
#define KVT_POOL_OPTS_INIT { (uint32_t)sizeof(kvt_pool_opts), 0, {0, 0, 0, 0, 0, 0, {0, 0}}, \
                             0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, {0, 0, 0}, NULL }

/* Fills *opts with the defaults, written out (page_tokens 16, f16, the
 * sequence limits); n_layers, n_kv_heads, head_dim and device_bytes stay 0
 * and must be set by the caller. Returns KVT_EINVAL if opts is NULL. */
KVT_API int kvt_pool_opts_init(kvt_pool_opts *opts);

/* What a pool needs for its targets (output: struct_size set by the caller). */
typedef struct kvt_pool_sizing {
    uint32_t struct_size;       /* sizeof(kvt_pool_sizing) */
    uint32_t reserved;          /* set to zero */
    uint64_t device_bytes;      /* device tier for target_seqs sequences of
                                   target_tokens tokens under the policy:
                                   unstable heads' every page, stable heads'
                                   sink, local, last, top-K x window pages and
                                   the pages a rerank interval adds, plus the
                                   null block */
    uint64_t dense_bytes;       /* the device tier without placement (every
                                   page of every head), plus the null block */
    uint64_t host_bytes;        /* a host tier holding every page stable heads
                                   offload (no disk tier), plus the null block */
    uint64_t meta_bytes;        /* the metadata the pages use (device tier,
                                   beside the blocks; the same with or
                                   without placement). The store reserves
                                   address space for a slot per block of
                                   every tier (kvt_stats.meta_bytes_total)
                                   but only used slots take memory */
    uint64_t device_pages;      /* blocks of device_bytes, null block excluded */
    uint64_t dense_pages;       /* blocks of dense_bytes, null block excluded */
} kvt_pool_sizing;

/* Computes the sizes for opts->target_tokens and opts->target_seqs (0 = 1)
 * under opts->policy (NULL: every page on device) and opts->geom. Needs no
 * pool; reads only those fields (the geometry, the policy's geometry and
 * target_tokens, 1..KVT_MAX_SEQ_TOKENS_LIMIT, are checked). */
KVT_API int kvt_pool_sizing_get(const kvt_pool_opts *opts, kvt_pool_sizing *out);

/* Creates a pool. Allocates the device tier (a DRAM arena on the CPU
 * backend), the host tier (libnuma arena) and the metadata store. */
KVT_API int kvt_pool_create(const kvt_pool_opts *opts, kvt_pool **out);
/* Releases every sequence and all memory. Accepts NULL. */
KVT_API void kvt_pool_destroy(kvt_pool *pool);
/* The pool's geometry with defaults resolved. */
KVT_API int kvt_pool_geometry_get(const kvt_pool *pool, kvt_geometry *out);

/* Per-tier occupancy. */
typedef struct kvt_tier_stats {
    uint64_t blocks_total; /* usable blocks (the null block excluded) */
    uint64_t blocks_used;
    uint64_t blocks_free;
    uint64_t bytes_total;  /* blocks_total * block_bytes */
    uint64_t bytes_used;
    uint64_t pages;        /* pages that have a copy in this tier */
} kvt_tier_stats;

/* Directions of page movement (kvt_stats.moved_*). */
#define KVT_DIR_DEVICE_TO_HOST 0u
#define KVT_DIR_HOST_TO_DEVICE 1u
#define KVT_DIR_HOST_TO_DISK   2u
#define KVT_DIR_DISK_TO_HOST   3u
#define KVT_NUM_DIRS           4u

typedef struct kvt_stats {
    uint32_t struct_size;       /* set by the caller */
    kvt_backend backend;        /* the backend in use */
    uint64_t block_bytes;       /* bytes of one block */
    uint64_t meta_bytes_total;  /* metadata store (device tier) */
    uint64_t meta_pages_total;  /* pages the metadata store can describe */
    uint64_t meta_pages_used;
    uint64_t n_seqs;            /* live sequences */
    uint64_t n_tokens;          /* sum of live sequences' lengths */
    kvt_tier_stats tier[KVT_NUM_TIERS];
    uint64_t moved_bytes[KVT_NUM_DIRS];
    uint64_t moved_requests[KVT_NUM_DIRS];
    /* Tiered placement counters, cumulative since the pool was created. */
    uint64_t sel_pages;         /* pages stable heads' selections held,
                                   summed over every selection of every step */
    uint64_t sel_resident;      /* ... of which were in the device tier
                                   before the selection (the hit rate is
                                   sel_resident / sel_pages) */
    uint64_t promoted_pages;    /* copies to the device tier issued by
                                   rerank/recycle and warm-up */
    uint64_t recycled_blocks;   /* ... of which reused an evicted page's
                                   device block in place */
    uint64_t evicted_pages;     /* device copies of stable heads released
                                   (another tier holds the page) */
    uint64_t offloaded_pages;   /* full pages copied out of the device tier
                                   once, when they filled */
    uint64_t reranked_heads;    /* (sequence, layer, head) rescored (every
                                   pool, not only tiered ones) */
    uint64_t paused_seqs;       /* (sequence, layer) decodes that waited for
                                   promoted pages */
    /* Prefix cache (kvtier/prefix.h), appended after the first layout (a
     * struct_size of 328 leaves them out). A physical page is one (layer,
     * KV head) page. Counters are cumulative since the pool was created. */
    uint64_t prefix_lookups;    /* kvt_seq_create calls with a prefix */
    uint64_t prefix_hit_tokens; /* prefix tokens attached from the cache */
    uint64_t prefix_miss_tokens; /* prefix tokens asked for and not attached */
    uint64_t prefix_hit_pages;  /* physical pages attached */
    uint64_t prefix_keyed_pages; /* physical pages in the index now (held
                                    by sequences or cached) */
    uint64_t prefix_cached_pages[KVT_NUM_TIERS]; /* copies, per tier, of
                                    cached pages no sequence holds (now) */
    uint64_t prefix_reclaimed_pages; /* cached physical pages freed to make
                                    room or to keep a tier under its cap */
    uint64_t prefix_dropped_pages; /* ... freed by kvt_prefix_drop(_all) */
    /* The remote tier (kvtier/remote.h), appended after the second layout
     * (a struct_size of 408 leaves them out); zero without one. A value is
     * one page position: its page in every (layer, KV head). */
    uint64_t remote_fetches;    /* kvt_seq_create calls that asked it */
    uint64_t remote_fetch_ns;   /* their time from the ask to the last answer */
    uint64_t remote_hit_values; /* values landed in sequences */
    uint64_t remote_miss_values; /* values asked for and not landed (absent,
                                   past a miss, a fault, failed checks) */
    uint64_t remote_get_bytes;  /* bytes of values received */
    uint64_t remote_put_values; /* values written */
    uint64_t remote_put_bytes;
    uint64_t remote_put_dropped; /* values not written: queue full, a fault */
    uint64_t remote_errors;     /* faults: refused or lost connections,
                                   timeouts, AUTH, error replies */
    uint64_t remote_corrupt;    /* values that failed their checks */
    uint64_t remote_redirects;  /* MOVED and ASK replies followed */
    uint64_t remote_queue_bytes; /* values waiting to be written (now) */
    /* Selection, appended after the third layout (a struct_size of 504
     * leaves them out); cumulative, every backend. */
    uint64_t head_selections;   /* (sequence, layer, KV head) selections of
                                   steps that are not KVT_STEP_DENSE */
    uint64_t similarity_reranks; /* ... rescored before their interval
                                   because the query drifted (the selection
                                   cache, kvt_selector_opts.rerank_similarity;
                                   counted in reranked_heads too) */
} kvt_stats;

/* Fills the first stats->struct_size bytes of *stats. */
KVT_API int kvt_pool_stats_get(const kvt_pool *pool, kvt_stats *stats);

/* *isa = the instruction set the pool's CPU kernels use: "avx512", "avx2" or
 * "portable" (a static string). Chosen at pool creation from cpuid; the
 * environment variable KVTIER_SIMD=avx512|avx2|portable caps it (for tests
 * and benchmarks). */
KVT_API int kvt_pool_kernel_isa_get(const kvt_pool *pool, const char **isa);

/* Verifies every internal invariant: block tables, free lists, residency,
 * metadata slots, counters, and that each page of each live sequence is
 * present in at least one tier. Returns 0 or KVT_EINTERNAL (the message
 * says what is wrong). Costs O(pool size); meant for tests and debugging. */
KVT_API int kvt_pool_check(const kvt_pool *pool);

/* ---- Sequences -------------------------------------------------------- */
typedef struct kvt_seq_opts {
    uint32_t struct_size;  /* sizeof(kvt_seq_opts) */
    uint32_t max_tokens;   /* token limit; 0 = the pool's max_seq_tokens */
    uint64_t user_data;    /* opaque, reported by kvt_seq_info */
    /* Appended after the first layout (a struct_size of 16 reads these as
     * zero): the prefix cache (kvtier/prefix.h). */
    uint64_t salt;         /* separates models, adapters and tenants: pages
                              are only ever matched under the salt they were
                              keyed with; 0 = the default salt */
    const uint32_t *prefix; /* [n_prefix] token ids the sequence starts with
                               (kvt_seq_create: the longest cached prefix of
                               whole pages is attached; the ids become the
                               sequence's, as kvt_seq_tokens_set). NULL = none */
    uint32_t n_prefix;     /* ids in prefix; at most max_tokens */
    uint32_t reserved;     /* must be zero */
} kvt_seq_opts;

#define KVT_SEQ_OPTS_INIT { (uint32_t)sizeof(kvt_seq_opts), 0, 0, 0, NULL, 0, 0 }
KVT_API int kvt_seq_opts_init(kvt_seq_opts *opts);

/* Creates a sequence; opts may be NULL for the defaults. With
 * opts->prefix, a pool with KVT_POOL_PREFIX_CACHE attaches the longest run
 * of whole cached pages that matches the prefix under opts->salt (the
 * sequence starts that many tokens long: kvt_seq_info_get's n_tokens and
 * prefix_tokens; the engine prefills the rest); without the cache nothing
 * is attached. Attaching is bookkeeping: the pages stay in whichever tier
 * holds them (a tiered pool brings the ones its placement needs on device
 * first; when the device tier cannot take them, nothing is attached). */
KVT_API int kvt_seq_create(kvt_pool *pool, const kvt_seq_opts *opts, kvt_seq_id *out);
/* Frees every page of the sequence in every tier (a page another sequence
 * holds stays theirs; one the prefix cache indexes stays cached). The id
 * becomes invalid. */
KVT_API int kvt_seq_release(kvt_pool *pool, kvt_seq_id seq);

/* Appends n_tokens tokens of one layer: k and v hold, for each token,
 * n_kv_heads rows of head_dim elements of type src_dtype; token t of head
 * h starts at element t * token_stride + h * head_dim (token_stride 0 =
 * n_kv_heads * head_dim, i.e. dense). Values are converted to the pool's
 * dtype (round to nearest even) and the per-page key metadata is updated.
 * n_tokens == 1 is the decode append; larger counts are prefill.
 * All-or-nothing: on failure nothing of the call is stored. On the CUDA
 * backend k and v are device pointers (or mapped pinned host memory) whose
 * contents must be complete when the call is made (it runs on the pool's
 * own stream, which does not order with the engine's), and the call
 * returns once the GPU has stored the rows (a failed kernel launch is
 * KVT_EIO, with the new pages released). */
KVT_API int kvt_seq_append(kvt_pool *pool, kvt_seq_id seq, uint32_t layer,
                           const void *k, const void *v, uint32_t n_tokens,
                           kvt_dtype src_dtype, uint64_t token_stride);

typedef struct kvt_seq_info {
    uint32_t struct_size;       /* set by the caller */
    uint32_t max_tokens;
    uint32_t n_tokens;          /* tokens present in every layer */
    uint32_t n_tokens_max;      /* tokens of the most advanced layer */
    uint64_t user_data;
    uint64_t pages;             /* pages over all layers and KV heads */
    uint64_t pages_in_tier[KVT_NUM_TIERS];
    /* Appended after the first layout (struct_size 56). */
    uint32_t prefix_tokens;     /* tokens attached from the prefix cache at
                                   creation */
    uint32_t token_ids;         /* positions whose token ids are known */
    uint64_t salt;              /* the salt the sequence was created with */
    /* Appended after the second layout (struct_size 72). */
    uint32_t remote_tokens;     /* of prefix_tokens, landed from the remote
                                   tier (kvtier/remote.h) */
    uint32_t remote_loading;    /* 1 while remote pages are awaited
                                   (kvt_seq_prefix_wait) */
} kvt_seq_info;
KVT_API int kvt_seq_info_get(const kvt_pool *pool, kvt_seq_id seq, kvt_seq_info *info);

/* Tokens appended to one layer of the sequence. */
KVT_API int kvt_seq_length_get(const kvt_pool *pool, kvt_seq_id seq, uint32_t layer,
                               uint32_t *n_tokens);

/* Importance-guided warm-up after prefill (tiered pools: a policy and a
 * selector in the pool options). obs_queries holds the queries of the last
 * n_obs prompt tokens, f32, [n_layers][n_obs][n_q_heads][head_dim]. Every
 * full page of a stable head is copied out of the device tier (to the host,
 * and to the disk when there is one) if it is not already; then each page
 * is scored by the pool's selector, the scores summed over the n_obs
 * queries, and the pages are placed by that importance: per stable head its
 * sink, local and last pages and the top_k_pages x window best stay in (or
 * are copied to) the device tier, the others leave it; when the host tier is
 * a cache over the disk, the sequence's most important pages are the ones
 * it keeps there. The importance also seeds each head's first selection
 * (its top_k_pages best), so the first step need not rescore. Copies to the
 * device tier run asynchronously: the sequence is not ready
 * (kvt_step_ready_get) until they land. KVT_ESTATE while a step is open. */
KVT_API int kvt_seq_warmup(kvt_pool *pool, kvt_seq_id seq, const float *obs_queries,
                           uint32_t n_obs);

/* Copies n_pages entries of the block table of (seq, layer, kv_head),
 * starting at logical page first_page: the device block of each page
 * (0 = the null block: not on device), its host block (0 = none) and its
 * residency bits (KVT_RES_*). Any output pointer may be NULL. */
KVT_API int kvt_seq_block_table_get(const kvt_pool *pool, kvt_seq_id seq, uint32_t layer,
                                    uint32_t kv_head, uint32_t first_page, uint32_t n_pages,
                                    uint32_t *device_blocks, uint32_t *host_blocks,
                                    uint8_t *residency);

/* Copies the stored K and V rows of tokens [first_token, first_token +
 * n_tokens) of (seq, layer, kv_head), in the pool's dtype, as
 * [n_tokens][head_dim] each, from whichever tier holds them. k_out or
 * v_out may be NULL. */
KVT_API int kvt_seq_read_kv(const kvt_pool *pool, kvt_seq_id seq, uint32_t layer,
                            uint32_t kv_head, uint32_t first_token, uint32_t n_tokens,
                            void *k_out, void *v_out);

/* The key metadata of one page, widened to f32: per-dimension minimum
 * (stored rounded toward -inf), maximum (rounded toward +inf) and mean
 * (f32 sum / count, stored rounded to nearest) of the page's keys. A NaN
 * key makes its dimension's box [-inf, +inf], so the box always contains
 * every stored key. Each output holds head_dim floats; any may be NULL. */
KVT_API int kvt_seq_page_meta_get(const kvt_pool *pool, kvt_seq_id seq, uint32_t layer,
                                  uint32_t kv_head, uint32_t page,
                                  float *kmin, float *kmax, float *kmean);

/* ---- Sharing, truncation, persistence ---------------------------------
 * Pages are reference-counted: a fork shares every full page of the parent
 * (in every tier, with one copy of each), and a page is freed when the last
 * sequence holding it lets it go. None of these calls may run while a step
 * that includes the sequence is open (KVT_ESTATE). */

/* A new sequence that shares every full page of src in every layer and KV
 * head (and src's token ids and salt; opts->salt 0 or src's, opts->prefix
 * NULL); the partially filled last page of each (layer, head) is copied into
 * a fresh device block (appending to a shared page never happens: pages are
 * shared only once full). The child inherits src's lengths, page metadata
 * and selection state (so its first step need not rerank). opts may be
 * NULL: max_tokens 0 = src's limit (it may not be below src's length),
 * user_data 0. KVT_ENOSPC, with nothing changed, when the device tier or
 * metadata store has no room for the copied last pages or no sequence slot
 * is free. Releasing either sequence leaves the other whole. */
KVT_API int kvt_seq_fork(kvt_pool *pool, kvt_seq_id src, const kvt_seq_opts *opts,
                         kvt_seq_id *out);

/* Keeps the first n_tokens tokens of every layer and drops the rest: pages
 * past the cut lose this sequence's reference; a kept, now partially
 * filled last page is made private (copied first if it is shared, brought
 * to the device tier if it was not there, its host and disk copies
 * dropped) and its metadata recomputed exactly from the kept rows. Heads
 * whose selection named a dropped page rerank at their next step.
 * KVT_ERANGE when a layer holds fewer than n_tokens tokens; KVT_ENOSPC
 * (nothing changed) when the device tier has no block for the kept page. */
KVT_API int kvt_seq_truncate(kvt_pool *pool, kvt_seq_id seq, uint32_t n_tokens);

/* Stream callbacks of kvt_seq_save / kvt_seq_restore. write: stores len
 * bytes, returns the bytes it took (1..len; the library calls again for
 * the rest) or a negative value on error. read: fills up to len bytes,
 * returns the bytes it gave (0 = end of stream) or a negative value. */
typedef int64_t (*kvt_write_fn)(void *ctx, const void *buf, size_t len);
typedef int64_t (*kvt_read_fn)(void *ctx, void *buf, size_t len);

/* Writes one sequence (every layer, every page from whichever tier holds
 * it, and its page metadata) as a stream in the format of kvtier-seq(5):
 * versioned, self-describing, CRC32C per page. A callback error is
 * KVT_EIO. The sequence is not changed. */
KVT_API int kvt_seq_save(const kvt_pool *pool, kvt_seq_id seq, kvt_write_fn write, void *ctx);

/* Reads a stream written by kvt_seq_save into a new sequence of this pool
 * (same geometry, dtype and page size; KVT_EINVAL naming the field that
 * differs). The rows are appended into the device tier (as a prefill) and
 * each page's metadata is checked against the saved one. A truncated or
 * corrupted stream is KVT_ECORRUPT, a read error KVT_EIO; on any error
 * nothing of the stream is left in the pool. opts as kvt_seq_create's
 * (max_tokens 0 = the saved sequence's limit, capped by the pool's). */
KVT_API int kvt_seq_restore(kvt_pool *pool, const kvt_seq_opts *opts, kvt_read_fn read,
                            void *ctx, kvt_seq_id *out);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_POOL_H */
