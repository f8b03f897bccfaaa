/* libkvtier - the per-step plan and the per-layer kernels: append,
 * selection, sparse flash-decode.
 *
 * Plan once per step, run per layer:
 *
 *   kvt_step_plan(pool, seqs, n, &opts, &step);   // allocation happens here
 *   for each layer:
 *       kvt_step_append(step, layer, k, v, dtype, 0);   // n_new[i] tokens of sequence i
 *       kvt_step_attend(step, layer, q, out, lse);      // = kvt_step_select + kvt_step_decode
 *   kvt_step_finish(step);
 *
 * The per-layer calls do no memory allocation. Work is split over the pool's
 * worker threads (kvt_pool_opts.n_threads) by (sequence, KV head, chunk of
 * pages); the chunking depends only on the pages selected, so results do not
 * depend on the thread count.
 *
 * Layouts (f32): queries q and outputs out are [rows][n_q_heads][head_dim],
 * lse is [rows][n_q_heads]; query head j belongs to KV head j / (n_q_heads /
 * n_kv_heads). A step has one row per new token: sequence i of the plan
 * owns rows row0(i) .. row0(i) + n_new[i] - 1, where row0(i) is the sum of
 * n_new of the sequences before it (with kvt_step_opts.n_new NULL every
 * sequence has one token, and rows = n_seqs). Query j of sequence i is the
 * token at position T - n_new[i] + j of the layer, T the tokens the layer
 * holds at the decode: it attends causally, to every token up to and
 * including its own (the new tokens after it are masked), so a dense step
 * of several tokens (speculative verification, a chunk of prefill) gives
 * the rows a token-by-token dense decode would (a sparse one attends over
 * one selection shared by the sequence's tokens).
 *
 * CUDA backend (kvt_pool_opts.backend = KVT_BACKEND_CUDA): q, k, v, out and
 * lse MUST be device pointers (or pinned host memory mapped for the
 * device); plain host memory faults the kernel. The per-layer calls
 * enqueue kernels on kvt_step_opts.stream and return without waiting, so
 * the engine orders its own kernels after them on that stream.
 * kvt_step_plan may wait: for the previous step's kernels (before reusing
 * their buffers) and, when a sequence's block table grew, for the device
 * (the table is uploaded whole). kvt_step_selection_get waits for the step's
 * work (it returns host data). The calls make the pool's device
 * (kvt_pool_opts.cuda_device) current on the calling thread.
 *
 * Thread safety: a step belongs to its pool; a pool has at most one open
 * step, and the pool, its sequences and the step are used by one thread at a
 * time (the library's own worker threads excepted).
 */
#ifndef KVTIER_STEP_H
#define KVTIER_STEP_H

#include "kvtier/common.h"
#include "kvtier/policy.h"
#include "kvtier/pool.h"
#include "kvtier/selector.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_step kvt_step; /* opaque; owned by its pool */

/* kvt_step_opts.flags */
#define KVT_STEP_DENSE (1u << 0) /* select every page: dense attention through
                                    the same kernel (no selector needed) */


typedef struct kvt_step_opts {
    uint32_t struct_size;        /* sizeof(kvt_step_opts) */
    uint32_t flags;              /* KVT_STEP_* */
    const kvt_selector *selector; /* required unless KVT_STEP_DENSE or the
                                    pool has one (kvt_pool_opts.selector,
                                    used when this is NULL); must match the
                                    pool's geometry and outlive the step */
    const kvt_policy *policy;    /* per-head top-K, sink, local pages and
                                    rerank interval in place of the
                                    selector's (which still scores and
                                    votes); same geometry as the pool;
                                    must outlive the step. NULL = none (a
                                    tiered pool: its own policy, and no
                                    other is accepted) */
    kvt_profiler *profiler;      /* when set, kvt_step_select feeds it the
                                    top-K set of every head it reranks
                                    (extra work on the calling thread);
                                    same geometry as the pool. NULL = none */
    void *stream;                /* the engine's stream (a cudaStream_t) that
                                    every kernel of the step is ordered on
                                    (CUDA backend; the per-layer calls then
                                    return without waiting and never use
                                    the default stream). NULL on the CUDA
                                    backend: the pool's own stream, and each
                                    per-layer call waits for its kernels.
                                    The CPU backend runs the kernels on the
                                    calling thread and the pool's workers,
                                    in call order, and ignores it */
    float scale;                 /* softmax scale; 0 = 1/sqrt(head_dim) */
    uint32_t reserved;           /* must be zero */
    /* Appended after the first layout (a struct_size of 48 reads these as
     * zero: one token per sequence). */
    const uint32_t *n_new;       /* [n_seqs] tokens sequence i appends and
                                    queries in this step, each 1 ..
                                    max_new; copied at the plan. NULL = one
                                    token each */
    uint32_t n_rows;             /* with n_new: the rows (tokens) the step's
                                    k, v, q, out and lse arrays hold, which
                                    must equal the sum of n_new (the plan
                                    checks it). 0 without n_new */
    uint32_t max_new;            /* the largest n_new[i] this plan accepts
                                    (1 .. KVT_STEP_MAX_NEW); 0 =
                                    KVT_STEP_MAX_NEW */
    /* Appended after n_new (a struct_size of 64 reads it as zero). */
    const uint32_t *token_ids;   /* the token id of every row (n_rows, or one
                                    per sequence without n_new), in the
                                    rows' order; copied at the plan and
                                    recorded as the sequences' ids
                                    (kvt_seq_tokens_set) when the step has
                                    appended every layer, which keys the
                                    pages they fill for the prefix cache.
                                    NULL = none */
    uint32_t n_token_ids;        /* entries of token_ids: must equal the rows */
    uint32_t reserved2;          /* must be zero */
} kvt_step_opts;

/* The most tokens one sequence may carry in a step (kvt_step_opts.max_new). */
#define KVT_STEP_MAX_NEW 8192u

#define KVT_STEP_OPTS_INIT { (uint32_t)sizeof(kvt_step_opts), 0u, NULL, NULL, NULL, NULL, 0.0f, 0u, NULL, 0u, 0u, NULL, 0u, 0u }
KVT_API int kvt_step_opts_init(kvt_step_opts *opts);

/* Plans one decode step over n_seqs distinct live sequences: checks them
 * (KVT_ERANGE for one whose n_new tokens would pass its max_tokens; KVT_EINVAL
 * naming opts->n_new[i] for a count of 0 or above max_new, opts->n_rows
 * when it is not their sum or is set without n_new, opts->max_new above
 * KVT_STEP_MAX_NEW; KVT_ENOTSUP naming opts->n_new for several tokens in a
 * step that is not KVT_STEP_DENSE on the CUDA backend), reserves block-table room
 * and checks that the device tier and metadata store can take the step's
 * tokens of every sequence in every layer (KVT_ENOSPC otherwise, so the
 * engine can preempt before the step; the blocks are checked, not set
 * aside), sizes all scratch, and decides which (sequence, layer, head)
 * rerank this step. The pool keeps the step's memory for the next plan.
 * KVT_ESTATE if a step of this pool is still open. *out is written on
 * success only (a failed plan leaves the caller's handle alone). Handles
 * are used in turn from a ring of 16, so a finished step's handle stays
 * KVT_ESTATE for at least the next 15 plans. */
KVT_API int kvt_step_plan(kvt_pool *pool, const kvt_seq_id *seqs, uint32_t n_seqs,
                          const kvt_step_opts *opts, kvt_step **out);

/* Closes the step: every later call with it returns KVT_ESTATE. Advances
 * each sequence's step counter (the rerank schedule). Accepts NULL. A step
 * appends every layer or none: one that appended some layers only is
 * closed with KVT_ESTATE naming the others, and its appends are taken
 * back. */
KVT_API int kvt_step_finish(kvt_step *step);

/* Appends the step's tokens to `layer` (n_new[i] of sequence i, as
 * kvt_seq_append, on the calling thread): k and v hold, for step row r (see
 * Layouts above; with one token per sequence, r is the sequence's index),
 * n_kv_heads rows of head_dim elements starting at element r * seq_stride
 * (0 = n_kv_heads * head_dim). In a tiered pool, the full pages of a
 * sequence with several tokens in a KVT_STEP_DENSE step (a chunk of
 * prefill) are copied out as kvt_seq_append's are, by kvt_step_finish
 * (which waits for the copies; a failed copy-out leaves the pages on
 * device for the next pass), so the plan needs device room for the chunk's
 * pages of every layer.
 * Once per layer and step, before that
 * layer's kvt_step_select (KVT_ESTATE otherwise, and in a step that
 * selected a layer before any append: that step appends nothing); the
 * first append of a step needs every sequence's layers at one length;
 * all-or-nothing over the sequences. */
KVT_API int kvt_step_append(kvt_step *step, uint32_t layer, const void *k, const void *v,
                            kvt_dtype src_dtype, uint64_t seq_stride);

/* Selects the pages of `layer` for every (sequence, KV head): heads due for
 * a rerank are scored and reselected, the others reuse their last top-K
 * pages. With several tokens, one selection per (sequence, KV head) serves
 * all of them: every query row of the sequence votes (the selector's vote
 * taken over n_new x G query heads), and the pages holding the new tokens
 * are always selected. A KVT_STEP_DENSE step selects every page. Once the step has
 * appended a layer, a layer not yet appended is KVT_ESTATE.
 *
 * In a tiered pool (kvt_pool_opts.policy) this is the fused rerank/recycle:
 * after selecting, in one pass per (sequence, stable head), pages resident
 * on device but no longer selected are evicted (only pages another tier
 * holds; with a window above 1 the lowest-scoring first, so up to
 * top_k_pages x window stay cached) and pages selected but not on device are
 * promoted: each evicted page's device block is handed to a promoted page
 * directly, and the copies (host -> device, or disk -> device through the
 * staging buffers) go to the mover as one urgent batch per sequence. The
 * block-table entries this changes are recorded as the step's dirty ranges
 * (kvt_step_dirty_get). KVT_ENOSPC if the device tier cannot take a
 * sequence's promoted pages: the sequences placed before it keep their
 * placement, that sequence and the ones after it are not placed and rescore
 * their heads at their next step. */
KVT_API int kvt_step_select(kvt_step *step, uint32_t layer, const float *q);

/* *ready = 1 when no page of sequence seq_index of the plan is on its way to
 * the device tier (promotions of the latest kvt_step_select, or of
 * kvt_seq_warmup), else 0. Right after kvt_step_plan it tells the engine
 * which sequences are still reloading, so it can leave them out of the
 * batch (finish the step and plan again); kvt_step_decode decodes the
 * ready sequences first and waits only for the others. Applies finished
 * moves; never waits. */
KVT_API int kvt_step_ready_get(kvt_step *step, uint32_t seq_index, uint32_t *ready);

/* The range of device block-table entries of (layer, sequence seq_index,
 * kv_head) changed since the step was planned: appends, recycling,
 * promotions landing and evictions. *first_page and *n_pages (0: nothing
 * changed) bound every changed entry. A backend that mirrors the tables
 * (CUDA) copies only these ranges. */
KVT_API int kvt_step_dirty_get(const kvt_step *step, uint32_t layer, uint32_t seq_index,
                               uint32_t kv_head, uint32_t *first_page, uint32_t *n_pages);

/* Attention of every query head over the pages kvt_step_select chose for
 * `layer`. A step keeps one selection, the latest: KVT_ESTATE unless the
 * latest kvt_step_select of this step was for `layer`. The result is
 * exact over those pages: softmax with a running maximum, f32
 * accumulation. out receives the normalised output; lse, when not NULL,
 * the natural log of the softmax denominator (of scale * q.k), so the
 * engine can merge with other attention parts. A sequence with no tokens
 * in the layer gets zeros and lse -infinity. In a tiered pool, sequences
 * whose promoted pages are in flight are decoded last, each once its copies
 * have landed (the others do not wait); a failed copy (KVT_EIO,
 * KVT_ECORRUPT) is returned after every other sequence is decoded, with the
 * failing sequence's output zeroed and its lse -infinity; its heads rescore
 * at the next step, so it decodes again once the fault clears. On the CPU
 * backend a selected page that lives only on the disk tier is read from it
 * (CRC-checked); a failed read returns its error with the rows of the
 * sequences that needed disk reads zeroed, lse -infinity. */
KVT_API int kvt_step_decode(kvt_step *step, uint32_t layer, const float *q, float *out,
                            float *lse);

/* kvt_step_select followed by kvt_step_decode. */
KVT_API int kvt_step_attend(kvt_step *step, uint32_t layer, const float *q, float *out, float *lse);

/* Copies the pages selected for (layer, sequence seq_index of the plan,
 * kv_head) by the latest kvt_step_select of this step (KVT_ESTATE if that
 * was for another layer), in increasing order. pages may be NULL only
 * when capacity is 0.
 * *reranked (may be NULL) tells whether the head was rescored this step. */
KVT_API int kvt_step_selection_get(const kvt_step *step, uint32_t layer, uint32_t seq_index,
                                   uint32_t kv_head, uint32_t *pages, uint32_t capacity,
                                   uint32_t *n_pages, uint32_t *reranked);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_STEP_H */
