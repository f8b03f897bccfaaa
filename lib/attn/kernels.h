/* The CPU attention and scoring kernels (kern_*.c, one source compiled per
 * ISA) and their run-time choice (dispatch.c). */
#ifndef KVTIER_ATTN_KERNELS_H
#define KVTIER_ATTN_KERNELS_H

#include "../core/base.h"

/* ---- CPU kernels (lib/attn/kern_*.c) ------------------------------------- */
typedef struct kvt__attn_shape {
    uint32_t G, D, P; /* query heads per KV head, head_dim, page_tokens */
    kvt_dtype dtype;  /* storage dtype */
} kvt__attn_shape;
/* Tokens of a page kvt__kernels.tscore scores at a time, and its scratch. */
#define KVT__TS_TOK 16u
#define KVT__TS_SCRATCH(G) ((size_t)(G) * (KVT__TS_TOK + 2u))
typedef struct kvt__kernels {
    const char *name;
    /* Online-softmax attention of G prescaled queries q [G][D] over n
     * blocks (ntok[i] valid tokens each). Updates the running maximum m[G],
     * denominator l[G] and unnormalised output acc[G][D]; sbuf holds
     * [G][P] floats of scratch (then 2 * P * D more when lim is set: the
     * block widened to f32 for many rows). With lim (causal rows; NULL: none), row g
     * sees only the tokens at positions below lim[g], block i's first token
     * being at position pos[i]. (G here is any number of query rows: a
     * step of several tokens passes n_new x G.) */
    void (*attn)(const kvt__attn_shape *sh, const float *q, const uint8_t *const *blocks,
                 const uint32_t *ntok, const uint32_t *pos, const uint32_t *lim, uint32_t n,
                 float *m, float *l, float *acc, float *sbuf);
    /* Scores n pages (metadata slots) for G queries into S[g * stride + i]:
     * MINMAX with qa = max(q, 0), qb = min(q, 0), over the plane of min and
     * max rows (slot s's min row at plane + s * slot_bytes, its max row
     * right after); MEAN with qa = q, over the plane of mean rows (slot s's
     * at plane + s * slot_bytes). */
    void (*score)(const kvt__attn_shape *sh, uint32_t method, const float *qa,
                  const float *qb, const uint8_t *plane, uint64_t slot_bytes,
                  const uint32_t *slots, uint32_t n, float *S, size_t stride);
    /* Scores n pages from their keys for G queries q [G][D] into
     * S[g * stride + i]: block i's first ntok[i] key rows (K of a block,
     * K[P][D] then V[P][D]) give max_t q_g.k_t when c == 0 (KVT_SCORE_TOKEN),
     * (1 / c) ln sum_t exp(c q_g.k_t) when c > 0 (KVT_SCORE_ORACLE). sbuf
     * holds KVT__TS_SCRATCH(G) floats. */
    void (*tscore)(const kvt__attn_shape *sh, const float *q, const uint8_t *const *blocks,
                   const uint32_t *ntok, uint32_t n, float c, float *S, size_t stride,
                   float *sbuf);
    /* x[i] = exp(x[i] - sub); returns the sum. */
    float (*expsum)(float *x, uint32_t n, float sub);
} kvt__kernels;
KVT__HIDDEN extern const kvt__kernels kvt__kern_portable, kvt__kern_avx2, kvt__kern_avx512;
/* The best kernels this CPU runs, capped by KVTIER_SIMD when set. */
KVT__HIDDEN const kvt__kernels *kvt__kernels_select(void);

#endif /* KVTIER_ATTN_KERNELS_H */
