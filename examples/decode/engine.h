/* kvtier-decode: the engine's use of libkvtier - one KV cache (a pool and
 * the sequence in it), the prefill that fills it and the decode step that
 * attends through it. Split from main.c so tests can drive the same code. */
#ifndef KVTD_ENGINE_H
#define KVTD_ENGINE_H

#include <stdint.h>

#include <kvtier/kvtier.h>

#include "model.h"

/* Seconds on the monotonic clock. */
double now_s(void);
/* The index of the largest of x[0..n) (the first of equal ones): greedy
 * sampling. */
uint32_t argmax(const float *x, uint32_t n);

/* The options a cache needs (from the command line). */
typedef struct engine_opts {
    uint32_t budget;     /* tokens each head attends (top-K pages x page size) */
    uint32_t threads;    /* worker threads; 0 = online CPUs */
    const char *policy;  /* profile file, or NULL for the built-in policy */
    const char *disk;    /* disk tier directory, or NULL */
    uint32_t samples;    /* sequences forked from the prompt's (1 = none) */
    uint32_t gen;        /* tokens each generates */
    int resume;          /* the cache is restored: every page lands on the device */
    uint32_t chunk;      /* prefill chunk (tokens per kvtier step); 0 = the engine's GEMM */
    int prefix_cache;    /* the pool keeps full pages for later requests (KVT_POOL_PREFIX_CACHE) */
    const kvt_remote_opts *remote; /* the remote tier (with the prefix cache), or NULL */
    /* The tiered cache's selection (--selector, --interval, --rerank-sim): */
    uint32_t method;     /* KVT_SCORE_*; TOKEN votes by SOFTVOTE, as TokenSelect */
    uint32_t interval;   /* stable heads' rerank interval; 0 = the policy's (16) */
    float rerank_sim;    /* the selection cache's threshold; NaN = the default */
} engine_opts;

/* ---- one KV cache: a pool and the sequence in it ----------------------------------- */
typedef struct kvcache {
    int tiered;
    kvt_pool *pool;
    kvt_seq_id seq;
    kvt_policy *pol;
    kvt_selector *sel;
    kvt_pool_sizing sz;
    double t_decode;      /* seconds in the decode forward */
    double t_prefill_kv;  /* seconds in kvt_seq_append + warm-up */
    double t_append, t_select, t_attend; /* decode: kvt_step_append, rerank, sparse decode */
    double t_plan;        /* decode: kvt_step_plan + kvt_step_finish */
    /* The attention mass the selection kept (selmass.c): measured at the
     * decode steps for which mass_due is set, outside the timers. */
    int mass_due;
    double mass_sum;      /* sum over measured (layer, query head) */
    uint64_t mass_n;
} kvcache;

/* Creates the pool (tiered: policy, selector, host tier sized for every
 * page, or 25% of it with a disk tier) and one sequence, for ctx tokens.
 * Exits with the library's message on failure. */
void kv_open(kvcache *kc, const model *m, const engine_opts *o, int tiered, uint32_t ctx);
/* Adds to kc->mass_sum / mass_n, for every query head of `layer` of the
 * step's one sequence, the share of its softmax (over every stored token,
 * double precision, at 1/sqrt(head_dim)) that falls on the pages the
 * step selected for its KV head (selmass.c). q: the layer's queries. */
void selmass_layer(kvcache *kc, kvt_step *st, uint32_t layer, const float *q, const model_cfg *c);
void kv_close(kvcache *kc);

typedef struct work {
    float *x, *xb, *q, *k, *v, *att, *h1, *h3, *logits;
    uint32_t rows; /* tokens a step through these buffers may carry */
} work;

/* Decode scratch for a model of configuration c: one row, or `rows`. */
void work_init(work *w, const model_cfg *c);
void work_init_rows(work *w, const model_cfg *c, uint32_t rows);
void work_free(work *w);

/* Prefill of tokens[0..T) into every cache of kc[nkc]: layer-major, every
 * product a GEMM, the prompt's own causal attention over chunks of queries
 * (nthreads threads). logits receives the last position's logits; obs, when
 * not NULL, the queries of the last n_obs tokens [L][n_obs][H][hd] (for
 * kvt_seq_warmup). show: a progress bar on stderr. */
void engine_prefill(const model *m, const int32_t *tokens, uint32_t T, kvcache *kc, int nkc,
                    float *logits, float *obs, uint32_t n_obs, int show, uint32_t nthreads);
/* One decode token at position pos through cache kc; logits to w->logits. */
void engine_decode(const model *m, kvcache *kc, int32_t tok, uint32_t pos, work *w);
/* n tokens (n <= w->rows) at positions pos .. pos + n - 1 through cache kc
 * as one kvtier step of n new tokens (dense: KVT_STEP_DENSE), every
 * product a GEMM over the rows. Logits: of every row to w->logits
 * [n][vocab] when all_logits, else of the last row. obs (may be NULL)
 * receives the queries of the tokens at positions obs_from ..
 * obs_from + n_obs - 1 that this step carries, [L][n_obs][H][hd]. */
void engine_step(const model *m, kvcache *kc, const int32_t *toks, uint32_t n, uint32_t pos,
                 int dense, int all_logits, work *w, float *obs, uint32_t n_obs,
                 uint32_t obs_from);
/* Prefill of tokens[0..T) through kvtier's own attention: dense steps of
 * `chunk` new tokens each (kvt_step_opts.n_new), which attend to every
 * cached page from whichever tier holds it; the same outputs as
 * engine_prefill. Time in kc->t_prefill_kv. */
void engine_prefill_chunked(const model *m, const int32_t *tokens, uint32_t T, kvcache *kc,
                            int nkc, uint32_t chunk, float *logits, float *obs, uint32_t n_obs,
                            int show);
/* The same for positions [from, T) of one cache (from < T), whose first
 * `from` positions it holds already (a prefix cache, a remote tier). */
void engine_prefill_rest(const model *m, const int32_t *tokens, uint32_t from, uint32_t T,
                         kvcache *kc, uint32_t chunk, float *logits, float *obs, uint32_t n_obs);

#endif /* KVTD_ENGINE_H */
