/* libkvtier - the head-stability policy and the profiler that builds it.
 *
 * A kvt_policy describes every (layer, KV head) of a model: its class
 * (STABLE or UNSTABLE), its top-K page budget, its window multiplier, its
 * sink and local pages, its rerank interval and its selection cache's
 * similarity threshold (kvt_selector_opts.rerank_similarity). It is
 * immutable once built,
 * so one policy may serve any number of pools and threads at once. A step
 * plan given a policy (kvt_step_opts.policy) reranks each head every
 * `rerank_interval` steps with the policy's budget.
 *
 * A kvt_profiler is fed, step by step, the top-K page sets the selector chose
 * for each (layer, head) of one or more sequences ("streams"). It computes
 * FlexiCache's random-corrected overlap and temporal-stability score, ranks
 * heads by how often their stability falls in the bottom fraction of a
 * window, measures how many page reloads a larger device window would save
 * (KVDRIVE), and builds a policy: the least stable heads UNSTABLE, a window
 * per stable head from a multiple-choice knapsack under a page budget.
 *
 * Policies are saved to and loaded from a versioned binary profile file,
 * documented in kvtier-profile(5).
 *
 * Thread safety: a policy is immutable; every call that takes a const
 * kvt_policy * may run concurrently with any other. A profiler is used by
 * one thread at a time for kvt_profiler_record (and steps that record into
 * it); its getters only read it.
 */
#ifndef KVTIER_POLICY_H
#define KVTIER_POLICY_H

#include "kvtier/common.h"
#include "kvtier/selector.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_policy kvt_policy;     /* opaque, immutable */
typedef struct kvt_profiler kvt_profiler; /* opaque */

/* Head classes. */
typedef uint32_t kvt_head_class;
#define KVT_HEAD_STABLE   0u /* top-K (x window) pages on device, reranked every interval */
#define KVT_HEAD_UNSTABLE 1u /* every page on device, reranked every step */

/* Largest window multiplier of a head. */
#define KVT_POLICY_MAX_WINDOW 64u
/* Window multipliers the profiler measures and chooses from: 1..4. */
#define KVT_PROFILER_WINDOWS 4u

typedef struct kvt_policy_opts {
    uint32_t struct_size;          /* sizeof(kvt_policy_opts) */
    kvt_head_class default_class;  /* class of every head not given; default STABLE */
    uint32_t top_k_pages;          /* pages by score per head; default 64 */
    uint32_t window;               /* window multiplier, 1..KVT_POLICY_MAX_WINDOW;
                                      default 1 (just the top-K pages) */
    uint32_t sink_pages;           /* default 1 */
    uint32_t local_pages;          /* default 1 */
    uint32_t stable_interval;      /* rerank interval of stable heads; default 16 */
    uint32_t unstable_interval;    /* rerank interval of unstable heads; default 1 */
    /* Appended after the first layout (a struct_size of 32 reads it as
     * KVT_RERANK_SIMILARITY_DEFAULT). */
    float rerank_similarity;       /* the selection cache (see
                                      kvt_selector_opts.rerank_similarity):
                                      between its interval's reranks a head
                                      is rescored once its query's cosine
                                      similarity to the query of its last
                                      rerank falls below this; -1 .. 1, -1 =
                                      the interval alone. Default
                                      KVT_RERANK_SIMILARITY_DEFAULT */
    uint32_t reserved;             /* must be zero */
} kvt_policy_opts;

#define KVT_POLICY_OPTS_INIT { (uint32_t)sizeof(kvt_policy_opts), 0u, 64u, 1u, 1u, 1u, 16u, 1u, KVT_RERANK_SIMILARITY_DEFAULT, 0u }
KVT_API int kvt_policy_opts_init(kvt_policy_opts *opts);

/* Per-head values for kvt_policy_create_heads: each array holds n_heads
 * entries, head (layer, kv_head) at index layer * n_kv_heads + kv_head; a
 * NULL array takes the value from the options (a NULL rerank_interval:
 * stable_interval or unstable_interval by the head's class). */
typedef struct kvt_policy_heads {
    uint32_t struct_size;                /* sizeof(kvt_policy_heads) */
    uint32_t n_heads;                    /* must be n_layers * n_kv_heads */
    const kvt_head_class *head_class;
    const uint32_t *top_k_pages;
    const uint32_t *window;
    const uint32_t *sink_pages;
    const uint32_t *local_pages;
    const uint32_t *rerank_interval;
    /* Appended after the first layout (a struct_size of 56, on LP64,
     * reads it as NULL): the selection cache's threshold of each head
     * (NULL: the options' rerank_similarity). */
    const float *rerank_similarity;
} kvt_policy_heads;

/* A policy in which every head has the options' values (opts may be NULL
 * for the defaults: every head stable, interval 16). */
KVT_API int kvt_policy_create(const kvt_geometry *geom, const kvt_policy_opts *opts,
                              kvt_policy **out);
/* A policy from per-head arrays; opts (may be NULL) fills what heads
 * leaves NULL. */
KVT_API int kvt_policy_create_heads(const kvt_geometry *geom, const kvt_policy_opts *opts,
                                    const kvt_policy_heads *heads, kvt_policy **out);
/* Accepts NULL. */
KVT_API void kvt_policy_destroy(kvt_policy *pol);

/* One head's record (output: struct_size set by the caller). */
typedef struct kvt_policy_head_info {
    uint32_t struct_size;      /* sizeof(kvt_policy_head_info) */
    kvt_head_class head_class;
    uint32_t top_k_pages;
    uint32_t window;           /* a tiered pool keeps up to top_k_pages x
                                  window pages on device (lookahead
                                  eviction); the step selects top_k_pages */
    uint32_t sink_pages;
    uint32_t local_pages;
    uint32_t rerank_interval;
    float rerank_similarity;   /* the selection cache's threshold (-1 = off) */
} kvt_policy_head_info;

KVT_API int kvt_policy_head_get(const kvt_policy *pol, uint32_t layer, uint32_t kv_head,
                                kvt_policy_head_info *info);
/* The policy's geometry (defaults resolved). */
KVT_API int kvt_policy_geometry_get(const kvt_policy *pol, kvt_geometry *out);
/* Number of heads of class head_class. */
KVT_API int kvt_policy_count_get(const kvt_policy *pol, kvt_head_class head_class,
                                 uint32_t *n_heads);
/* KV pages one sequence of ctx_tokens tokens keeps on the device under the
 * policy, summed over all (layer, head): every page of an unstable head;
 * sink, local, a partial last page and top_k_pages * window pages by score
 * of a stable head. *total_pages (may be NULL) receives all of its pages. */
KVT_API int kvt_policy_device_pages_get(const kvt_policy *pol, uint64_t ctx_tokens,
                                        uint64_t *device_pages, uint64_t *total_pages);
/* A readable summary (heads per class, budgets, device memory at
 * ctx_tokens tokens per sequence when ctx_tokens > 0) as NUL-terminated
 * text, snprintf style: at most cap bytes are written (buf may be NULL when
 * cap is 0) and *needed (may be NULL) receives the full length without the
 * NUL. */
KVT_API int kvt_policy_describe(const kvt_policy *pol, uint64_t ctx_tokens, char *buf,
                                size_t cap, size_t *needed);

/* ---- profile files (format: kvtier-profile(5)) ----------------------------- */
/* Serialises the policy into buf: *needed receives the file size; when
 * buf is NULL and cap 0 only the size is reported, otherwise cap below it
 * is KVT_ERANGE. */
KVT_API int kvt_policy_save_buffer(const kvt_policy *pol, void *buf, size_t cap,
                                   size_t *needed);
/* Parses a profile. expect (may be NULL) is the geometry the caller needs:
 * a profile of another geometry is KVT_EINVAL. A damaged profile (bad
 * magic, truncated, checksum, bad field) is KVT_ECORRUPT; a newer format
 * version is KVT_EINVAL. */
KVT_API int kvt_policy_load_buffer(const void *data, size_t size, const kvt_geometry *expect,
                                   kvt_policy **out);
/* The same through a file: written to a temporary file beside path, synced
 * and renamed over path. */
KVT_API int kvt_policy_save(const kvt_policy *pol, const char *path);
KVT_API int kvt_policy_load(const char *path, const kvt_geometry *expect, kvt_policy **out);

/* ---- the profiler ------------------------------------------------------- */
typedef struct kvt_profiler_opts {
    uint32_t struct_size;      /* sizeof(kvt_profiler_opts) */
    uint32_t window_steps;     /* W, steps per stability window, 2..65536; default 16 */
    double unstable_fraction;  /* share of heads made UNSTABLE, 0..1; default 0.25 */
    double bottom_fraction;    /* share of heads counted as "bottom" in each
                                  window, 0..1; default 0.25 (a quartile) */
    uint32_t max_streams;      /* streams (sequences) at most, 1..1048576;
                                  default 1024 */
    uint32_t reserved;         /* must be zero */
} kvt_profiler_opts;

#define KVT_PROFILER_OPTS_INIT { (uint32_t)sizeof(kvt_profiler_opts), 16u, 0.25, 0.25, 1024u, 0u }
KVT_API int kvt_profiler_opts_init(kvt_profiler_opts *opts);

KVT_API int kvt_profiler_create(const kvt_geometry *geom, const kvt_profiler_opts *opts,
                                kvt_profiler **out);
/* Accepts NULL. */
KVT_API void kvt_profiler_destroy(kvt_profiler *prof);

/* Records the next step's top-K set of (stream, layer, kv_head): pages,
 * strictly increasing, are the n_pages pages chosen by score (sink, local
 * and last pages left out) out of n_candidates pages that competed. The
 * k-th call for a (stream, layer, kv_head) is its step k. */
KVT_API int kvt_profiler_record(kvt_profiler *prof, uint64_t stream, uint32_t layer,
                                uint32_t kv_head, const uint32_t *pages, uint32_t n_pages,
                                uint32_t n_candidates);

/* What the profiler measured for one head (output: struct_size set by the
 * caller). */
typedef struct kvt_profiler_head_stats {
    uint32_t struct_size;    /* sizeof(kvt_profiler_head_stats) */
    uint32_t k_max;          /* largest set recorded */
    uint64_t records;        /* sets recorded, over all streams */
    uint64_t windows;        /* complete windows (TS values), over all streams */
    uint64_t ranked_windows; /* (stream, window) pairs complete for every head */
    uint64_t bottom;         /* ... of which this head was in the bottom fraction */
    double mean_ts;          /* mean TS over its complete windows (0 if none) */
    double instability;      /* bottom / ranked_windows (0 if none) */
    uint64_t demand;         /* pages of its sets that had an earlier set in the stream */
    uint64_t benefit[KVT_PROFILER_WINDOWS]; /* of those, pages found among the
                                               w * K most recently selected
                                               pages, w = 1..4 */
} kvt_profiler_head_stats;

KVT_API int kvt_profiler_head_get(const kvt_profiler *prof, uint32_t layer, uint32_t kv_head,
                                  kvt_profiler_head_stats *stats);

/* Builds a policy: the round(unstable_fraction * heads) heads of highest
 * instability become UNSTABLE, the others STABLE; budgets and intervals
 * come from base (may be NULL for the defaults). device_page_budget > 0
 * chooses a window 1..4 for each stable head, maximising the summed
 * benefit with sum(window * top_k_pages) over stable heads <= the budget;
 * 0 gives every head base->window. */
KVT_API int kvt_profiler_build_policy(const kvt_profiler *prof, const kvt_policy_opts *base,
                                      uint64_t device_page_budget, kvt_policy **out);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_POLICY_H */
