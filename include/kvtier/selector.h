/* libkvtier - the page selector: which pages of a (sequence, layer, KV head)
 * matter for the current queries.
 *
 * Scoring methods (the raw score of a page for one query row q):
 *   KVT_SCORE_MINMAX  Quest's upper bound of q.k over the page, from the
 *                     metadata store: sum_d max(q_d * kmin_d, q_d * kmax_d)
 *   KVT_SCORE_MEAN    q . (mean key of the page), a landmark score.
 *   KVT_SCORE_TOKEN   TokenSelect's token-level criticality: the largest
 *                     exact q.k over the page's stored tokens. It reads the
 *                     page's keys (half the bytes attention reads) where
 *                     the backend can address them: the device tier, and on
 *                     the CPU backend also the host tier; a page whose keys
 *                     are elsewhere (only on disk, or on their way to the
 *                     device) is scored by its MINMAX bound, which is never
 *                     below the exact value.
 *   KVT_SCORE_ORACLE  for measurement only (as slow as dense attention):
 *                     the page's attention mass. Its raw score is
 *                     (1 / c) ln sum_t exp(c q.k_t) over the page's tokens,
 *                     c = vote_scale, and its vote is always SOFTVOTE, so a
 *                     page's vote is the softmax mass (over every stored
 *                     token, at scale c) of its tokens, summed over the
 *                     group's query heads: the top-K by vote is the page set
 *                     of largest true attention mass. With vote_scale equal
 *                     to the step's scale (both default to 1/sqrt(head_dim))
 *                     that is the decode's own softmax. Keys it cannot
 *                     address (as TOKEN) count as the MINMAX bound plus
 *                     ln(tokens) / c, an upper bound.
 * A page holding a NaN or infinite key scores +infinity with TOKEN and
 * ORACLE on the CPU backend, as an opened MINMAX box does. kvt_seq_warmup,
 * which scores every page once per observed query, scores TOKEN and ORACLE
 * selectors by the MINMAX bound (SOFTVOTE for ORACLE).
 * The query heads of one KV head (a GQA group) vote:
 *   KVT_VOTE_SUM       sum of the heads' raw scores
 *   KVT_VOTE_MAX       maximum of the heads' raw scores
 *   KVT_VOTE_SOFTVOTE  each head's scores (times vote_scale) turned into a
 *                      softmax over the pages, then summed.
 * Always selected, outside the top-K budget: the first sink_pages pages, a
 * partially filled last page and the local_pages full pages before it (the
 * last local_pages pages when the last page is full). The remaining
 * pages compete for top_k_pages places; equal scores are broken by the lower
 * page index, and a NaN score (an unbounded box) counts as +infinity. When
 * no more than top_k_pages pages compete, every page is selected.
 *
 * Thread safety: the setters must not run concurrently with any other use
 * of the selector; every other call only reads it, so one configured
 * selector may serve many threads and pools at once.
 */
#ifndef KVTIER_SELECTOR_H
#define KVTIER_SELECTOR_H

#include "kvtier/common.h"
#include "kvtier/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_selector kvt_selector; /* opaque */

typedef uint32_t kvt_score_method;
#define KVT_SCORE_MINMAX 0u
#define KVT_SCORE_MEAN   1u
#define KVT_SCORE_TOKEN  2u
#define KVT_SCORE_ORACLE 3u

typedef uint32_t kvt_vote;
#define KVT_VOTE_SUM      0u
#define KVT_VOTE_MAX      1u
#define KVT_VOTE_SOFTVOTE 2u

/* "Every layer" / "every KV head" in the budget setters. */
#define KVT_ALL 0xffffffffu

/* Largest top_k_pages, sink_pages or local_pages value (2^26 pages). */
#define KVT_SELECT_MAX_PAGES (1u << 26)

typedef struct kvt_selector_opts {
    uint32_t struct_size;     /* sizeof(kvt_selector_opts) */
    kvt_score_method method;  /* KVT_SCORE_*; default MINMAX */
    kvt_vote vote;            /* KVT_VOTE_*; default SUM */
    uint32_t top_k_pages;     /* K of every (layer, head) at creation; default 64 */
    uint32_t sink_pages;      /* default 1 */
    uint32_t local_pages;     /* default 1 */
    uint32_t rerank_interval; /* steps between reranks of a head in a step
                                 plan; default 1 (every step) */
    float vote_scale;         /* SOFTVOTE: scores are multiplied by this
                                 before the softmax; 0 = 1/sqrt(head_dim) */
    /* Appended after the first layout (a struct_size of 32 reads it as
     * KVT_RERANK_SIMILARITY_DEFAULT). */
    float rerank_similarity;  /* the selection cache: between the reranks
                                 rerank_interval sets, a head is rescored
                                 as soon as the cosine similarity of its
                                 query (the mean of its group's query rows)
                                 to the query of its last rerank falls
                                 below this, -1 .. 1; -1 = never (the
                                 interval alone). Default
                                 KVT_RERANK_SIMILARITY_DEFAULT */
    uint32_t reserved;        /* must be zero */
} kvt_selector_opts;

/* The selection cache's default threshold (kvt_selector_opts and
 * kvt_policy_opts.rerank_similarity), chosen by measurement
 * (examples/bench/RESULTS.md, "Selection"). */
#define KVT_RERANK_SIMILARITY_DEFAULT 0.8f

#define KVT_SELECTOR_OPTS_INIT { (uint32_t)sizeof(kvt_selector_opts), 0u, 0u, 64u, 1u, 1u, 1u, 0.0f, KVT_RERANK_SIMILARITY_DEFAULT, 0u }
KVT_API int kvt_selector_opts_init(kvt_selector_opts *opts);

/* Creates a selector for one model geometry (the pools it serves must have
 * the same n_layers, n_kv_heads, n_q_heads, head_dim and page_tokens).
 * opts may be NULL for the defaults. */
KVT_API int kvt_selector_create(const kvt_geometry *geom, const kvt_selector_opts *opts,
                                kvt_selector **out);
/* Accepts NULL. */
KVT_API void kvt_selector_destroy(kvt_selector *sel);

/* Sets the budget of one (layer, kv_head); KVT_ALL as layer or kv_head sets
 * every layer or head. Each value is at most KVT_SELECT_MAX_PAGES. */
KVT_API int kvt_selector_budget_set(kvt_selector *sel, uint32_t layer, uint32_t kv_head,
                                    uint32_t top_k_pages, uint32_t sink_pages,
                                    uint32_t local_pages);
/* Reads the budget of one (layer, kv_head); any output may be NULL. */
KVT_API int kvt_selector_budget_get(const kvt_selector *sel, uint32_t layer, uint32_t kv_head,
                                    uint32_t *top_k_pages, uint32_t *sink_pages,
                                    uint32_t *local_pages);
/* Sets how many steps apart a step plan reranks (layer, kv_head): 1 = every
 * step; between reranks the plan reuses the last top-K pages (sink, local
 * and last pages still follow the sequence). KVT_ALL as above. */
KVT_API int kvt_selector_rerank_interval_set(kvt_selector *sel, uint32_t layer,
                                             uint32_t kv_head, uint32_t interval);
/* Sets the selection cache's threshold of (layer, kv_head) (see
 * kvt_selector_opts.rerank_similarity): -1 .. 1, KVT_EINVAL otherwise (NaN
 * included). KVT_ALL as above. The CPU backend decides in kvt_step_select;
 * the CUDA backend, whose queries stay on the device, reranks on the
 * interval alone. */
KVT_API int kvt_selector_rerank_similarity_set(kvt_selector *sel, uint32_t layer,
                                               uint32_t kv_head, float threshold);

/* Scores every page of (seq, layer, kv_head) against the queries of the
 * KV head's query heads and selects pages as described above.
 *   queries   [group][head_dim] f32, group = n_q_heads / n_kv_heads (the
 *             query heads kv_head * group .. kv_head * group + group - 1)
 *   pages     receives the selected page indexes in increasing order; it
 *             holds `capacity` entries (KVT_ERANGE names the count needed
 *             when it is too small)
 *   n_selected  receives the count
 *   scores    optional, receives the voted score of every page
 *             ([n_pages] where n_pages = ceil(tokens / page_tokens))
 * A sequence with no tokens in the layer selects nothing. This standalone
 * call allocates scratch; the per-step calls (kvtier/step.h) do not. */
KVT_API int kvt_selector_select(const kvt_selector *sel, const kvt_pool *pool, kvt_seq_id seq,
                                uint32_t layer, uint32_t kv_head, const float *queries,
                                uint32_t *pages, uint32_t capacity, uint32_t *n_selected,
                                float *scores);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_SELECTOR_H */
