/* Test helpers: a seeded RNG and reference conversions written from the
 * IEEE definitions (value tables and double arithmetic), independent of the
 * library's bit-twiddling code. */
#ifndef KVT_TESTUTIL_H
#define KVT_TESTUTIL_H

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvtier/kvtier.h"

/* ---- RNG (xorshift64*) --------------------------------------------------- */
typedef struct {
    uint64_t s;
} tu_rng;
static inline uint64_t tu_next(tu_rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545F4914F6CDD1Dull;
}
static inline uint32_t tu_below(tu_rng *r, uint32_t n)
{
    return (uint32_t)(tu_next(r) % n);
}
/* Uniform in [-1, 1). */
static inline float tu_unit(tu_rng *r)
{
    return (float)((double)(tu_next(r) >> 11) * 0x1p-52 - 1.0);
}

/* ---- f16 reference: value of every encoding by the definition ----------- */
static inline double tu_f16_value(uint16_t h)
{
    int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0)
        v = ldexp((double)m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexp(1024.0 + m, e - 25);
    return sign ? -v : v;
}
static inline double tu_bf16_value(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return (double)f;
}

/* Rounding of a real x to a 16-bit format by search over the format's
 * ordered finite values: mode 0 nearest-even, 1 toward -inf, 2 toward +inf. */
typedef double (*tu_value_fn)(uint16_t);

static inline int tu_cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    double v;
    uint16_t bits;
} tu_entry;

static inline int tu_cmp_entry(const void *a, const void *b)
{
    const tu_entry *x = a, *y = b;
    if (x->v != y->v)
        return (x->v > y->v) - (x->v < y->v);
    return (int)x->bits - (int)y->bits; /* -0 (0x8000) after +0 */
}

typedef struct {
    tu_entry *e; /* finite values, ascending, -0 dropped */
    size_t n;
    double max_finite;
    uint16_t pos_inf, neg_inf;
} tu_table;

static inline void tu_table_build(tu_table *t, tu_value_fn fn, uint16_t pos_inf)
{
    t->e = malloc(65536 * sizeof *t->e);
    t->n = 0;
    for (uint32_t b = 0; b < 65536; b++) {
        double v = fn((uint16_t)b);
        if (isnan(v) || isinf(v) || b == 0x8000)
            continue;
        t->e[t->n].v = v;
        t->e[t->n].bits = (uint16_t)b;
        t->n++;
    }
    qsort(t->e, t->n, sizeof *t->e, tu_cmp_entry);
    t->max_finite = t->e[t->n - 1].v;
    t->pos_inf = pos_inf;
    t->neg_inf = (uint16_t)(pos_inf | 0x8000);
}

static inline void tu_table_free(tu_table *t)
{
    free(t->e);
}

/* Returns the encoding of x rounded per mode (x finite, not NaN). The sign
 * of zero results follows x. */
static inline uint16_t tu_round(const tu_table *t, double x, int mode, int man_bits)
{
    /* Largest index with value <= x. */
    size_t lo = 0, hi = t->n;
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (t->e[mid].v <= x)
            lo = mid;
        else
            hi = mid;
    }
    double below_v, above_v;
    uint16_t below_b, above_b;
    int have_below = t->e[lo].v <= x, have_above;
    if (have_below) {
        below_v = t->e[lo].v;
        below_b = t->e[lo].bits;
        have_above = lo + 1 < t->n;
        above_v = have_above ? t->e[lo + 1].v : INFINITY;
        above_b = have_above ? t->e[lo + 1].bits : t->pos_inf;
    } else { /* x below the most negative finite */
        below_v = -INFINITY;
        below_b = t->neg_inf;
        above_v = t->e[0].v;
        above_b = t->e[0].bits;
    }
    uint16_t r;
    if (below_v == x) {
        r = below_b;
    } else if (mode == 1) {
        r = below_b;
    } else if (mode == 2) {
        r = above_b;
    } else {
        /* Nearest; past the largest finite value, overflow to infinity
         * happens from max + half an ulp on (IEEE). */
        double ulp_top = ldexp(1.0, (int)floor(log2(t->max_finite)) - man_bits);
        if (x >= t->max_finite + ulp_top / 2)
            return t->pos_inf;
        if (x <= -t->max_finite - ulp_top / 2)
            return t->neg_inf;
        if (isinf(below_v))
            return above_b;
        if (isinf(above_v))
            return below_b;
        double db = x - below_v, da = above_v - x;
        if (db < da)
            r = below_b;
        else if (da < db)
            r = above_b;
        else
            r = (below_b & 1) ? above_b : below_b;
    }
    /* Zero results carry the sign of x. */
    if ((r & 0x7fff) == 0)
        r = (uint16_t)(signbit(x) ? 0x8000 : 0);
    return r;
}

/* ---- pools ---------------------------------------------------------------- */
static inline kvt_pool_opts tu_opts(uint32_t L, uint32_t H, uint32_t Hq, uint32_t D, uint32_t P,
                                    kvt_dtype dt, uint64_t dev_blocks, uint64_t host_blocks)
{
    kvt_pool_opts o;
    kvt_pool_opts_init(&o);
    o.backend = KVT_BACKEND_CPU;
    o.geom.n_layers = L;
    o.geom.n_kv_heads = H;
    o.geom.n_q_heads = Hq;
    o.geom.head_dim = D;
    o.geom.page_tokens = P;
    o.geom.dtype = dt;
    uint64_t bb = 2ull * P * D * kvt_dtype_size(dt);
    o.device_bytes = dev_blocks * bb;
    o.host_bytes = host_blocks * bb;
    return o;
}

/* Asserts that a call failed with `code` and that kvt_last_error() names
 * `needle` (an argument or field name). */
/* The reference every attention test compares with: softmax attention in
 * double of G queries q[G][D] over n rows kd/vd[n][D] (values already
 * widened from the stored dtype), scale applied to q.k. Writes out[G][D],
 * lse[G] (-inf when n == 0), kappa[g] = max over rows of scale * sum |q.k|
 * terms (the condition of the scores, for the tolerance) and *vmax, the
 * largest |v|. */
static inline void tu_ref_attention(const float *q, uint32_t G, uint32_t D, const double *kd,
                                    const double *vd, uint32_t n, double scale, double *out,
                                    double *lse, double *kappa, double *vmax)
{
    *vmax = 0;
    for (size_t e = 0; e < (size_t)n * D; e++)
        *vmax = fabs(vd[e]) > *vmax ? fabs(vd[e]) : *vmax;
    double *sc = malloc((n + 1) * sizeof *sc);
    for (uint32_t g = 0; g < G; g++) {
        const float *qg = q + (size_t)g * D;
        double *o = out + (size_t)g * D, mx = -INFINITY, z = 0;
        kappa[g] = 0;
        for (uint32_t t = 0; t < n; t++) {
            double dot = 0, mag = 0;
            for (uint32_t d = 0; d < D; d++) {
                dot += (double)qg[d] * kd[(size_t)t * D + d];
                mag += fabs((double)qg[d] * kd[(size_t)t * D + d]);
            }
            sc[t] = scale * dot;
            mx = sc[t] > mx ? sc[t] : mx;
            kappa[g] = scale * mag > kappa[g] ? scale * mag : kappa[g];
        }
        for (uint32_t d = 0; d < D; d++)
            o[d] = 0;
        for (uint32_t t = 0; t < n; t++) {
            double w = exp(sc[t] - mx);
            z += w;
            for (uint32_t d = 0; d < D; d++)
                o[d] += w * vd[(size_t)t * D + d];
        }
        for (uint32_t d = 0; n && d < D; d++)
            o[d] /= z;
        lse[g] = n ? mx + log(z) : -INFINITY;
    }
    free(sc);
}

/* The forced pages of a head with T tokens in pages of P tokens: the
 * first `sink`, the last `local` and a partially filled last page. Marks
 * forced[0..np). */
static inline void tu_forced_pages(uint8_t *forced, uint32_t T, uint32_t P, uint32_t sink,
                                   uint32_t local)
{
    const uint32_t np = (T + P - 1) / P;
    memset(forced, 0, np ? np : 1);
    for (uint32_t i = 0; i < np && i < sink; i++)
        forced[i] = 1;
    /* A partial last page is always forced and does not count against
     * local: the local pages are the full ones before it. */
    const uint32_t partial = T % P != 0;
    for (uint32_t i = 0; i < np && i < local + partial; i++)
        forced[np - 1 - i] = 1;
}

/* A rescored selection sel[n] against the brute-force rule: sorted and in
 * range, every forced page, min(K, candidates) other pages, and no
 * unselected candidate scoring clearly above a selected one (ref[page] the
 * double-precision score, tol[page] its rounding bound). */
static inline void tu_check_selection(const uint32_t *sel, uint32_t n, uint32_t T, uint32_t P,
                                      uint32_t K, uint32_t sink, uint32_t local,
                                      const double *ref, const double *tol, const char *what)
{
    const uint32_t np = (T + P - 1) / P;
    uint8_t *forced = malloc(np + 1), *in = calloc(np + 1, 1);
    tu_forced_pages(forced, T, P, sink, local);
    for (uint32_t j = 0; j < n; j++) {
        if (sel[j] >= np || (j && sel[j] <= sel[j - 1]))
            fail_msg("%s: entry %u (page %u of %u) out of order or range", what, j, sel[j], np);
        in[sel[j]] = 1;
    }
    uint32_t nc = 0, ntop = 0;
    double lo = INFINITY, hi = -INFINITY;
    for (uint32_t pg = 0; pg < np; pg++) {
        if (forced[pg]) {
            if (!in[pg])
                fail_msg("%s: forced page %u missing", what, pg);
            continue;
        }
        nc++;
        if (in[pg]) {
            ntop++;
            lo = ref[pg] + tol[pg] < lo ? ref[pg] + tol[pg] : lo;
        } else {
            hi = ref[pg] - tol[pg] > hi ? ref[pg] - tol[pg] : hi;
        }
    }
    const uint32_t want = K < nc ? K : nc;
    if (ntop != want)
        fail_msg("%s: %u top-K pages, expected %u (K %u, %u candidates)", what, ntop, want, K,
                 nc);
    if (lo < hi)
        fail_msg("%s: unselected score %.9g above selected %.9g", what, hi, lo);
    free(forced);
    free(in);
}

#define TU_EXPECT_ERR(call, code, needle)                                                  \
    do {                                                                                   \
        kvt_clear_error();                                                                 \
        int tu_rc_ = (call);                                                               \
        if (tu_rc_ != (code))                                                              \
            fail_msg("%s returned %d (%s), expected %s; message: %s", #call, tu_rc_,       \
                     kvt_err_name(tu_rc_), #code, kvt_last_error());                       \
        if (strstr(kvt_last_error(), (needle)) == NULL)                                    \
            fail_msg("%s: message '%s' does not name '%s'", #call, kvt_last_error(),       \
                     (needle));                                                            \
    } while (0)

#define TU_OK(call)                                                                         \
    do {                                                                                   \
        int tu_rc_ = (call);                                                               \
        if (tu_rc_ != 0)                                                                   \
            fail_msg("%s returned %d (%s): %s", #call, tu_rc_, kvt_err_name(tu_rc_),      \
                     kvt_last_error());                                                    \
    } while (0)

#define TU_CHECK(pool) TU_OK(kvt_pool_check(pool))

#endif /* KVT_TESTUTIL_H */
