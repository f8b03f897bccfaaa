/* Helpers of the tiered-placement tests (test_place, test_place_faults): a
 * tiered pool (a policy and a selector in the pool options) over tiertest.h's
 * geometry with two query heads per KV head, sequences whose K/V the test
 * keeps (f16 bit patterns, the reference), and one decode step driven through
 * kvt_step_plan / kvt_step_append / kvt_step_select / kvt_step_decode /
 * kvt_step_finish with every per-layer result checked against independent
 * references:
 *   - the output against a double-precision attention over exactly the pages
 *     kvt_step_selection_get reports, from the kept K/V;
 *   - a rescored selection against the MINMAX/SUM scores recomputed in
 *     double from kvt_seq_page_meta_get, a reused one against the head's last
 *     top-K set plus today's forced pages;
 *   - the device tier against the placement rules (block tables and
 *     residency before and after the rerank): selected pages are on device
 *     after the decode, evicted pages were neither selected nor forced and
 *     have another copy, promoted pages take evicted pages' blocks, and -
 *     when every move had finished before the plan - exactly the
 *     highest-scoring evictable pages stay (lookahead eviction);
 *   - the placement counters of kvt_stats against what the tables show;
 *   - kvt_step_dirty_get against the device tables snapshotted at the plan.
 * The pool passes kvt_pool_check after every step.
 *
 * The code is tests/placetest.c, compiled with tests/tiertest.c into every
 * test binary that includes this header, with that test's flags. */
#ifndef KVT_PLACETEST_H
#define KVT_PLACETEST_H

#include "tiertest.h"

#define HQ (2 * N_KV_HEADS)     /* query heads: GQA groups of two */
#define GQA_GROUP (HQ / N_KV_HEADS) /* query heads per KV head */
#define NLH (N_LAYERS * N_KV_HEADS) /* (layer, kv head) pairs, index layer * N_KV_HEADS + head */
#define MAXS 6
#define MAXPG (MAXTOK / PAGE_TOKENS)

/* ---- values ------------------------------------------------------------------ */

/* A random f16 of moderate magnitude (2^-6 .. 4, either sign), so that the
 * attention reference's tolerance stays meaningful. */
uint16_t f16_moderate(tu_rng *r);

/* The f16 encoding of x, which must be exactly representable (a normal
 * number or zero); checked against testutil's value table. */
uint16_t f16_exact(double x);

/* Pages of T tokens (the last one partial when T is not a multiple of
 * PAGE_TOKENS). */
uint32_t pages_of(uint32_t T);

/* ---- the fixture ---------------------------------------------------------------- */

/* Per-head policy values, [layer * N_KV_HEADS + head]. */
typedef struct {
    uint32_t cls[NLH], k[NLH], w[NLH], sink[NLH], local[NLH], iv[NLH];
} pheads;

/* Every head stable with these values; unstable heads (set afterwards)
 * take interval 1. */
pheads ph_uniform(uint32_t k, uint32_t w, uint32_t sink, uint32_t local, uint32_t iv);

/* Makes (layer, head) unstable, interval 1. */
void ph_unstable(pheads *ph, uint32_t layer, uint32_t head);

typedef struct {
    kvt_pool *p;
    kvt_mover *m;
    kvt_policy *pol;
    kvt_selector *sel;
    kvt_geometry g;
    kvt_mover_opts mo;
    pheads ph;
    bool disk;
    uint32_t ns;
    tseq t[MAXS];
    tu_rng r;
    /* The last top-K set (selection minus forced pages) of every head. */
    uint32_t topk[MAXS][NLH][MAXPG], ntopk[MAXS][NLH];
    /* Designed keys (design_key): page pg of a designed sequence has, in
     * every token, key dim 0 = s[..][pg], dim 1 + pg = 1, the rest 0. */
    bool designed[MAXS];
    double s[MAXS][NLH][MAXPG];
    /* Warm-up copies of the sequence may still be in flight (set by the
     * test after kvt_seq_warmup; cleared once the test knows they landed:
     * it waited for every move, or kvt_step_ready_get said 1, or a step ran). */
    bool warm_pending[MAXS];
    /* offloaded_pages of sequences already released. */
    uint64_t off_base;
} pfx;

/* The placement tests' geometry: tiertest.h's, HQ query heads, f16. */
kvt_geometry pgeom(void);

/* A policy from per-head values and a MINMAX/SUM selector. */
kvt_policy *policy_of(const pheads *ph);

kvt_selector *selector_of(void);

/* Pool options of a tiered pool (device and host in blocks; disk_bytes 0 =
 * no disk tier). One page per disk request, so fault counts name pages. */
kvt_pool_opts pfx_opts(pfx *f, uint64_t dev, uint64_t host, uint64_t disk_bytes);

/* A fixture with its policy (from ph), selector and generator, but no pool
 * yet (the test creates it, from pfx_opts). */
pfx *pfx_new(const pheads *ph, uint64_t seed);

/* pfx_new and a pool of pfx_opts(f, dev, host, disk_bytes), with its mover. */
pfx *pfx_open(const pheads *ph, uint64_t dev, uint64_t host, uint64_t disk_bytes, uint64_t seed);

/* kvt_pool_check (when there is a pool), then frees everything. */
void pfx_close(pfx *f);

/* Whether (layer, head) lh is a stable head. */
bool is_stable(const pfx *f, uint32_t lh);

/* Waits for every move; the code the wait returns must be 0 unless a fault
 * was injected. */
int wait_all(pfx *f);

/* The pool's kvt_stats. */
kvt_stats pstats(const kvt_pool *p);

/* Key of token tok, (layer, head) lh, dim d of a designed sequence. */
uint16_t design_key(const pfx *f, uint32_t i, uint32_t lh, uint32_t tok, uint32_t d);

/* Appends n tokens to every layer of sequence i through kvt_seq_append (the
 * prefill): designed keys when the sequence is designed, else random. */
void pfx_prefill(pfx *f, uint32_t i, uint32_t n);

/* A new sequence with n prefilled tokens. Designed: page pg of head lh gets
 * score weight s = (perm(pg) + 1) / 128 + lh / 512 (distinct over the
 * sequence, exact in f16); flat: every page the same weight 1/4 (ties
 * everywhere). */
#define KEYS_RANDOM 0
#define KEYS_DESIGNED 1
#define KEYS_FLAT 2
uint32_t pfx_add(pfx *f, uint32_t n, int keys);

/* A fork of sequence src (kvt_seq_fork): the kept K/V, the design and the
 * last top-K sets copied; returns its index. */
uint32_t pfx_fork(pfx *f, uint32_t src);
/* kvt_seq_truncate of sequence i to n tokens. */
void pfx_truncate(pfx *f, uint32_t i, uint32_t n);
/* Releases sequence i; the later ones move down one index. */
void pfx_release(pfx *f, uint32_t i);

/* Device blocks and residency of pages [0, np) of (seq i, layer, head). */
void table(const pfx *f, uint32_t i, uint32_t l, uint32_t h, uint32_t np, uint32_t *blk,
           uint8_t *res);

/* The pool's length of sequence i in layer l. */
uint32_t seq_len(const pfx *f, uint32_t i, uint32_t l);

/* ---- references ------------------------------------------------------------------- */

/* Marks the forced pages of a head with T tokens: sink, local, partial last. */
void forced_pages(uint8_t *forced, uint32_t T, uint32_t sink, uint32_t local);

/* Reference MINMAX/SUM scores of pages [0, np) for the GQA_GROUP queries
 * q[GQA_GROUP][HEAD_DIM], in double from the page metadata, with a per-page
 * rounding allowance. */
void ref_scores(const pfx *f, uint32_t i, uint32_t l, uint32_t h, uint32_t np, const float *q,
                double *ref, double *tol);

/* Marks in `chosen` the n non-forced pages of highest score (ties: lower
 * page index first). */
void top_n(const double *score, const uint8_t *forced, uint32_t np, uint32_t n, uint8_t *chosen);

/* Double-precision attention of q[GQA_GROUP][HEAD_DIM] over the tokens of
 * `pages` of (seq i, layer, head) with T tokens, from the kept K/V:
 * out[GQA_GROUP][HEAD_DIM], lse[GQA_GROUP], the score magnitude
 * kappa[GQA_GROUP] and max |v| (test_step.c's reference). */
void ref_attn(const pfx *f, uint32_t i, uint32_t l, uint32_t h, uint32_t T, const uint32_t *pages,
              uint32_t np, const float *q, double *out, double *lse, double *kappa, double *vmax);

/* The library's out[GQA_GROUP][HEAD_DIM] / lse[GQA_GROUP] against the
 * reference (tolerance as in test_step.c / test_decode.c). */
void check_rows(const float *out, const float *lse, const double *ref, const double *ref_lse,
                const double *kappa, double vmax, const char *what);

/* ---- one decode step ------------------------------------------------------------------ */

typedef struct {
    bool wait_before;     /* wait for every move before the plan: the
                             lookahead eviction model is checked exactly */
    bool wait_after_plan; /* wait for every move after the plan: every
                             sequence must then be ready */
    bool wait_after_rerank; /* ... and after each rerank: no decode pauses */
    bool exact_stats;     /* no warm-up copy can land behind the test's back:
                             the placement counters are checked exactly */
    bool faulty;          /* a fault is armed: a decode may fail */
    /* The queries of `layer`, [ns][HQ][HEAD_DIM]; NULL = random in [-2, 2). */
    void (*make_q)(pfx *f, uint32_t layer, float *q);
    /* Called after the plan, before each layer's kvt_step_select, and
     * before kvt_step_finish. */
    void (*after_plan)(pfx *f, kvt_step *st);
    void (*before_rerank)(pfx *f, uint32_t layer);
    void (*before_finish)(pfx *f);
} step_args;

typedef struct {
    int rc[N_LAYERS];             /* kvt_step_decode's code */
    uint32_t failed[N_LAYERS];    /* bit i: sequence i came back zeroed */
    uint8_t fail_head[MAXS][NLH]; /* selected pages missing after a failed decode */
    uint8_t reranked[MAXS][NLH];
    uint32_t evicted, promoted, recycled, not_ready;
    uint32_t dirty_heads, clean_heads; /* heads whose device table changed / did not */
} step_res;

/* The GQA_GROUP queries of (sequence i, kv head h) in q[ns][HQ][HEAD_DIM]. */
const float *q_of(const float *q, uint32_t i, uint32_t h);

/* One decode step of every live sequence of f, checked as this header's
 * first comment says; res gets what happened. */
void pfx_step(pfx *f, const step_args *a, step_res *res);

/* ---- placement at rest ------------------------------------------------------------ */

/* Distinct pages with a device copy (a shared page once), over every live
 * sequence: the device tier's page count. */
void check_device_count(const pfx *f);

/* With every move finished: each full page of a stable head was offloaded
 * (its residency has every bit of `want`, or, with `any`, one of them),
 * unstable heads' pages are on device only, partial pages never left the
 * device, and offloaded_pages counts the stable full pages. Returns that
 * count. */
uint64_t check_offloaded(const pfx *f, uint8_t want, bool any);

/* Reads every sequence back and compares with the kept copy. */
void verify_all(const pfx *f);

#endif /* KVT_PLACETEST_H */
