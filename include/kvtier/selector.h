/* libkvtier - the page selector: which pages of a (sequence, layer, KV head)
 * matter for the current queries.
 *
 * Pages are scored from the metadata store only (never the K/V bytes):
 *   KVT_SCORE_MINMAX  Quest's upper bound of q.k over the page:
 *                     sum_d max(q_d * kmin_d, q_d * kmax_d)
 *   KVT_SCORE_MEAN    q . (mean key of the page), a landmark score.
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
} kvt_selector_opts;

#define KVT_SELECTOR_OPTS_INIT { (uint32_t)sizeof(kvt_selector_opts), 0u, 0u, 64u, 1u, 1u, 1u, 0.0f }
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
