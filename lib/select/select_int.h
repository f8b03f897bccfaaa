/* The selector's internals (selector.c): its per-head budgets, the
 * scratch of one selection, scoring with votes, and the selection rule. */
#ifndef KVTIER_SELECT_INT_H
#define KVTIER_SELECT_INT_H

#include "../core/store.h"

/* ---- selector (lib/select) ----------------------------------------------- */
struct kvt_selector {
    kvt_geometry g;
    kvt_score_method method;
    kvt_vote vote;
    float vote_scale;
    uint32_t *k, *sink, *local, *interval; /* [L * H] */
    float *sim; /* [L * H] the selection cache's thresholds (-1 = off) */
};

/* Scratch of one selection: G * np + np floats, np uint64 keys and np bytes,
 * 3 * G * D floats of query rows, and for the key-reading methods (TOKEN,
 * ORACLE) np block pointers and token counts and the kernel's scratch. */
typedef struct kvt__sel_scratch {
    float *S;       /* [G][np] raw scores */
    float *vote;    /* [np] */
    uint64_t *key;  /* [np] the picks' (vote, page) keys */
    uint8_t *mark;  /* [np] */
    float *qa, *qb; /* [G][D] each */
    float *qc;      /* [G][D] the query rows, contiguous (TOKEN, ORACLE) */
    const uint8_t **blk; /* [np] a page's block where its keys are read, or NULL */
    uint32_t *ntok; /* [np] its tokens */
    float *tbuf;    /* [KVT__TS_SCRATCH(G)] */
} kvt__sel_scratch;
KVT__HIDDEN size_t kvt__sel_scratch_bytes(uint32_t G, uint32_t D, uint32_t np);
KVT__HIDDEN void kvt__sel_scratch_carve(kvt__sel_scratch *sc, void *mem, uint32_t G, uint32_t D,
                                        uint32_t np);
/* Checks that sel fits the pool's geometry (KVT_EINVAL naming the field). */
KVT__HIDDEN int kvt__selector_match(const kvt_selector *sel, const kvt_pool *p);
/* The three parts of kvt__sel_score, for a caller that splits a head's
 * pages over threads (each with its own scratch): the query rows into the
 * scratch (qa, qb; qc for TOKEN and ORACLE); the raw scores of pages
 * [pg0, pg1) of np, rows G apart by np, into S (per page, so any split
 * gives the same values); their vote into v[np] (S is changed: SOFTVOTE
 * scales it in place). */
KVT__HIDDEN void kvt__sel_prep(const kvt_selector *sel, const kvt_pool *p, const float *q,
                               uint32_t nq, size_t qstride, kvt__sel_scratch *sc);
KVT__HIDDEN void kvt__sel_raw(const kvt_selector *sel, const kvt_pool *p, const kvt__seq *s,
                              uint32_t layer, uint32_t head, uint32_t G, uint32_t pg0,
                              uint32_t pg1, uint32_t np, float *S, kvt__sel_scratch *sc);
KVT__HIDDEN void kvt__sel_vote(const kvt_selector *sel, const kvt_pool *p, float *S, uint32_t G,
                               uint32_t np, float *v);
/* out[D] = the mean of the nn x G query rows of one (sequence, KV head),
 * token j's G rows at q + j * qstride: the query the selection cache
 * compares (lib/step/select.c, the warm-up's reference). */
KVT__HIDDEN void kvt__sel_qmean(const float *q, uint32_t G, uint32_t nn, size_t qstride,
                                uint32_t D, float *out);
/* Voted scores of the np pages of (s, layer, head) into sc->vote: every
 * query head of nq tokens votes (token j's G heads at q + j * qstride; the
 * scratch carved for nq x G rows). */
KVT__HIDDEN void kvt__sel_score(const kvt_selector *sel, const kvt_pool *p, const kvt__seq *s,
                                uint32_t layer, uint32_t head, const float *q, uint32_t nq,
                                size_t qstride, uint32_t np, kvt__sel_scratch *sc);
/* The selection rule over np pages of a sequence with `tokens` tokens:
 * sink, local and a partial last page forced, then the top k of the rest
 * by (vote desc, index asc). Writes the sorted selection to out (returns its
 * count) and, when topk is not NULL, the top-k part alone to topk (sorted)
 * with its count in *n_topk. With vote == NULL, reuse_topk[n_reuse] stands
 * in for the top-k part. */
KVT__HIDDEN uint32_t kvt__sel_pick(uint32_t np, uint32_t tokens, uint32_t P, uint32_t k,
                                   uint32_t sink, uint32_t local, const float *vote,
                                   const uint32_t *reuse_topk, uint32_t n_reuse,
                                   kvt__sel_scratch *sc, uint32_t *out, uint32_t *topk,
                                   uint32_t *n_topk);
/* Upper bound of kvt__sel_pick's count. */
static inline uint32_t kvt__sel_bound(uint32_t np, uint32_t k, uint32_t sink, uint32_t local)
{
    uint64_t b = (uint64_t)k + sink + local + 1u;
    return b < np ? (uint32_t)b : np;
}

#endif /* KVTIER_SELECT_INT_H */
