/* The CPU kernels, written once over a small vector abstraction and
 * compiled three times: AVX-512 (KVT__ISA 2), AVX2+FMA+F16C (1) and
 * portable C (0). Included by kern_{avx512,avx2,portable}.c, each of which
 * defines KVT__ISA and KVT__KERN_NAME.
 *
 * Attention over a page (one block: K[P][D] then V[P][D]):
 *   K pass: scores of up to 4 query heads against 4 tokens at a time, so a
 *           key row is converted once per pass and the query rows come
 *           from L1; the 4x4 dot products are reduced together.
 *   softmax: running maximum per query head; the accumulator is rescaled
 *           only when the maximum moves.
 *   V pass: the accumulators of up to 4 query heads for a tile of head_dim
 *           stay in registers while the page's value rows stream through.
 * Every K/V byte is read from memory once per GQA group. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if KVT__ISA > 0
#include <immintrin.h>
#endif

#define KVT__INLINE static inline __attribute__((always_inline))
/* The register tiles below are small arrays indexed by constant-bound
 * loops; they stay in registers only when those loops are unrolled. */
#define KVT__UNROLL _Pragma("GCC unroll 16")
/* Software prefetches go to L2 (locality 1): a block's rows are read once
 * per pass, and requests into L1 evict the query rows and the scores the
 * passes keep there (measured, kvtier-bench attn --quick: locality 3 -> 1
 * took sparse decode from 0.61 to 0.58 ms per layer). The decode asks for
 * the block two ahead unless it continues a run of back-to-back blocks
 * (kvt__in_run): on 2026-11-27 prefetching every block took dense from 8.8
 * to 6.7 ms, on 2026-11-28 (a quieter VM) skipping runs took it from 6.2
 * to 4.4-4.9 ms with sparse unchanged; both in alternating runs. */
#define KVT__PF_LOC 1
#define KVT__PF_DIST 2u   /* blocks ahead (attention, token scores) */
#define KVT__SCORE_PF 16u /* metadata slots ahead (bound scores) */
KVT__INLINE void kvt__pf(const uint8_t *p, size_t bytes)
{
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch(p + off, 0, KVT__PF_LOC);
}
/* Whether b[0..KVT__PF_DIST] lie back to back in memory (blocks of `bb`
 * bytes): a stream the hardware prefetchers already follow, where software
 * prefetches only cost instructions (dense decode 6.2 -> 4.9 ms a layer,
 * kvtier-bench attn --quick, 2026-11-28). */
KVT__INLINE bool kvt__in_run(const uint8_t *const *b, size_t bb)
{
    for (uint32_t j = 0; j < KVT__PF_DIST; j++)
        if (b[j + 1] != b[j] + bb)
            return false;
    return true;
}

#if KVT__ISA == 2
typedef __m512 vf;
#define VW 16u
#define GBK 4u /* query heads per K-pass block */
#define NVT 4u /* vectors per V-pass tile */
KVT__INLINE __mmask16 v_mask(uint32_t n)
{
    return (__mmask16)((1u << n) - 1u);
}
KVT__INLINE vf v_zero(void) { return _mm512_setzero_ps(); }
KVT__INLINE vf v_set1(float x) { return _mm512_set1_ps(x); }
KVT__INLINE vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
KVT__INLINE vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
KVT__INLINE vf v_ldf(const float *p, uint32_t n)
{
    return n >= VW ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(v_mask(n), p);
}
KVT__INLINE void v_stf(float *p, vf a, uint32_t n)
{
    if (n >= VW)
        _mm512_storeu_ps(p, a);
    else
        _mm512_mask_storeu_ps(p, v_mask(n), a);
}
KVT__INLINE vf v_ldh(const uint16_t *p, uint32_t n)
{
    __m256i h = n >= VW ? _mm256_loadu_si256((const __m256i *)p)
                        : _mm256_maskz_loadu_epi16(v_mask(n), p);
    return _mm512_cvtph_ps(h);
}
KVT__INLINE vf v_ldb(const uint16_t *p, uint32_t n)
{
    __m256i h = n >= VW ? _mm256_loadu_si256((const __m256i *)p)
                        : _mm256_maskz_loadu_epi16(v_mask(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
KVT__INLINE float v_hsum(vf a) { return _mm512_reduce_add_ps(a); }
/* out[i] = sum of the lanes of vector i. */
KVT__INLINE void v_hsum4(vf a, vf b, vf c, vf d, float *out)
{
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    /* Each 128-bit lane now holds partial sums (a, b, c, d). */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out, r);
}
KVT__INLINE vf v_exp(vf x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
    vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    vf y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
KVT__INLINE float v_hmax(vf a) { return _mm512_reduce_max_ps(a); }
KVT__INLINE vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }

#elif KVT__ISA == 1
typedef __m256 vf;
#define VW 8u
#define GBK 2u
#define NVT 2u
/* head_dim is a multiple of 8, so AVX2 rows never have a partial vector. */
KVT__INLINE vf v_zero(void) { return _mm256_setzero_ps(); }
KVT__INLINE vf v_set1(float x) { return _mm256_set1_ps(x); }
KVT__INLINE vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
KVT__INLINE vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
KVT__INLINE vf v_ldf(const float *p, uint32_t n) { (void)n; return _mm256_loadu_ps(p); }
KVT__INLINE void v_stf(float *p, vf a, uint32_t n) { (void)n; _mm256_storeu_ps(p, a); }
KVT__INLINE vf v_ldh(const uint16_t *p, uint32_t n)
{
    (void)n;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
KVT__INLINE vf v_ldb(const uint16_t *p, uint32_t n)
{
    (void)n;
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
KVT__INLINE float v_hsum(vf a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
KVT__INLINE void v_hsum4(vf a, vf b, vf c, vf d, float *out)
{
    __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    __m256 abcd = _mm256_add_ps(
        _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))),
        _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
    _mm_storeu_ps(out, r);
}
KVT__INLINE vf v_exp(vf x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
    vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    vf y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
KVT__INLINE vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
KVT__INLINE float v_hmax(vf a)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#else /* portable: one-lane "vectors" */
typedef float vf;
#define VW 1u
#define GBK 4u
#define NVT 4u
KVT__INLINE vf v_zero(void) { return 0.0f; }
KVT__INLINE vf v_set1(float x) { return x; }
KVT__INLINE vf v_fma(vf a, vf b, vf c) { return a * b + c; }
KVT__INLINE vf v_mul(vf a, vf b) { return a * b; }
KVT__INLINE vf v_ldf(const float *p, uint32_t n) { (void)n; return *p; }
KVT__INLINE void v_stf(float *p, vf a, uint32_t n) { (void)n; *p = a; }
KVT__INLINE vf v_ldh(const uint16_t *p, uint32_t n) { (void)n; return kvt__f16_to_f32(*p); }
KVT__INLINE vf v_ldb(const uint16_t *p, uint32_t n) { (void)n; return kvt__bf16_to_f32(*p); }
KVT__INLINE float v_hsum(vf a) { return a; }
KVT__INLINE void v_hsum4(vf a, vf b, vf c, vf d, float *out)
{
    out[0] = a;
    out[1] = b;
    out[2] = c;
    out[3] = d;
}
KVT__INLINE vf v_exp(vf x) { return expf(x); }
KVT__INLINE vf v_max(vf a, vf b) { return a > b ? a : b; }
KVT__INLINE float v_hmax(vf a) { return a; }
#endif

/* Loads up to VW elements of a row of dtype dt at element offset i. */
KVT__INLINE vf v_ld(kvt_dtype dt, const uint8_t *row, uint32_t i, uint32_t n)
{
    if (dt == KVT_DTYPE_F32)
        return v_ldf((const float *)row + i, n);
    if (dt == KVT_DTYPE_F16)
        return v_ldh((const uint16_t *)row + i, n);
    return v_ldb((const uint16_t *)row + i, n);
}

KVT__INLINE uint32_t kvt__min_u32(uint32_t a, uint32_t b)
{
    return a < b ? a : b;
}

/* ---- exp and sum --------------------------------------------------------- */
/* x[i] = exp(x[i] - sub) for i < n; returns the sum. */
static float kvt__expsum(float *x, uint32_t n, float sub)
{
    vf s = v_zero(), m = v_set1(sub);
    uint32_t i = 0;
#if KVT__ISA == 2
    for (; i < n; i += VW) {
        uint32_t k = kvt__min_u32(VW, n - i);
        vf e = v_exp(_mm512_sub_ps(v_ldf(x + i, k), m));
        e = k < VW ? _mm512_maskz_mov_ps(v_mask(k), e) : e;
        v_stf(x + i, e, k);
        s = _mm512_add_ps(s, e);
    }
    return v_hsum(s);
#elif KVT__ISA == 1
    for (; i + VW <= n; i += VW) {
        vf e = v_exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
        _mm256_storeu_ps(x + i, e);
        s = _mm256_add_ps(s, e);
    }
    float t = v_hsum(s);
    for (; i < n; i++) {
        x[i] = expf(x[i] - sub);
        t += x[i];
    }
    return t;
#else
    (void)m;
    float t = s;
    for (; i < n; i++) {
        x[i] = expf(x[i] - sub);
        t += x[i];
    }
    return t;
#endif
}

static float kvt__rowmax(const float *x, uint32_t n)
{
    float mx = -INFINITY;
    uint32_t i = 0;
#if KVT__ISA > 0
    if (n >= VW) {
        vf m = v_ldf(x, VW);
        for (i = VW; i + VW <= n; i += VW)
            m = v_max(m, v_ldf(x + i, VW));
        mx = v_hmax(m);
    }
#endif
    for (; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    return mx;
}

/* ---- K pass -------------------------------------------------------------- */
/* s[g * P + t] = q_g . k_t for g < GB query heads (q rows D apart) and the
 * first nt tokens of the page's key rows K. */
KVT__INLINE void kvt__kdot(kvt_dtype dt, uint32_t GB, const float *q, const uint8_t *K,
                           uint32_t D, uint32_t nt, float *s, uint32_t P)
{
    const size_t row = (size_t)D * (dt == KVT_DTYPE_F32 ? 4u : 2u);
    uint32_t t = 0;
    for (; t + 4 <= nt; t += 4) {
        vf a[4][GBK];
        KVT__UNROLL
        for (uint32_t j = 0; j < 4; j++)
            KVT__UNROLL
            for (uint32_t g = 0; g < GB; g++)
                a[j][g] = v_zero();
        for (uint32_t d = 0; d < D; d += VW) {
            const uint32_t n = kvt__min_u32(VW, D - d);
            vf k0 = v_ld(dt, K + (t + 0) * row, d, n);
            vf k1 = v_ld(dt, K + (t + 1) * row, d, n);
            vf k2 = v_ld(dt, K + (t + 2) * row, d, n);
            vf k3 = v_ld(dt, K + (t + 3) * row, d, n);
            KVT__UNROLL
            for (uint32_t g = 0; g < GB; g++) {
                vf qq = v_ldf(q + (size_t)g * D + d, n);
                a[0][g] = v_fma(qq, k0, a[0][g]);
                a[1][g] = v_fma(qq, k1, a[1][g]);
                a[2][g] = v_fma(qq, k2, a[2][g]);
                a[3][g] = v_fma(qq, k3, a[3][g]);
            }
        }
        KVT__UNROLL
        for (uint32_t g = 0; g < GB; g++)
            v_hsum4(a[0][g], a[1][g], a[2][g], a[3][g], s + (size_t)g * P + t);
    }
    for (; t < nt; t++) {
        vf a[GBK];
        KVT__UNROLL
        for (uint32_t g = 0; g < GB; g++)
            a[g] = v_zero();
        for (uint32_t d = 0; d < D; d += VW) {
            const uint32_t n = kvt__min_u32(VW, D - d);
            vf k0 = v_ld(dt, K + t * row, d, n);
            KVT__UNROLL
            for (uint32_t g = 0; g < GB; g++)
                a[g] = v_fma(v_ldf(q + (size_t)g * D + d, n), k0, a[g]);
        }
        KVT__UNROLL
        for (uint32_t g = 0; g < GB; g++)
            s[(size_t)g * P + t] = v_hsum(a[g]);
    }
}

/* ---- V pass -------------------------------------------------------------- */
/* acc_g += sum_t p[g * P + t] * v_t for g < GB. */
KVT__INLINE void kvt__vacc(kvt_dtype dt, uint32_t GB, const float *p, const uint8_t *V,
                           uint32_t D, uint32_t nt, float *acc, uint32_t P)
{
    const size_t row = (size_t)D * (dt == KVT_DTYPE_F32 ? 4u : 2u);
    uint32_t d = 0;
    for (; d + NVT * VW <= D; d += NVT * VW) {
        vf a[GBK][NVT];
        KVT__UNROLL
        for (uint32_t g = 0; g < GB; g++)
            KVT__UNROLL
            for (uint32_t j = 0; j < NVT; j++)
                a[g][j] = v_ldf(acc + (size_t)g * D + d + j * VW, VW);
        for (uint32_t t = 0; t < nt; t++) {
            vf v[NVT];
            KVT__UNROLL
            for (uint32_t j = 0; j < NVT; j++)
                v[j] = v_ld(dt, V + t * row, d + j * VW, VW);
            KVT__UNROLL
            for (uint32_t g = 0; g < GB; g++) {
                vf w = v_set1(p[(size_t)g * P + t]);
                KVT__UNROLL
                for (uint32_t j = 0; j < NVT; j++)
                    a[g][j] = v_fma(w, v[j], a[g][j]);
            }
        }
        KVT__UNROLL
        for (uint32_t g = 0; g < GB; g++)
            KVT__UNROLL
            for (uint32_t j = 0; j < NVT; j++)
                v_stf(acc + (size_t)g * D + d + j * VW, a[g][j], VW);
    }
    for (; d < D; d += VW) {
        const uint32_t n = kvt__min_u32(VW, D - d);
        vf a[GBK];
        KVT__UNROLL
        for (uint32_t g = 0; g < GB; g++)
            a[g] = v_ldf(acc + (size_t)g * D + d, n);
        for (uint32_t t = 0; t < nt; t++) {
            vf v0 = v_ld(dt, V + t * row, d, n);
            KVT__UNROLL
            for (uint32_t g = 0; g < GB; g++)
                a[g] = v_fma(v_set1(p[(size_t)g * P + t]), v0, a[g]);
        }
        KVT__UNROLL
        for (uint32_t g = 0; g < GB; g++)
            v_stf(acc + (size_t)g * D + d, a[g], n);
    }
}

/* dst[t * D + d] = row t of the block's rows src (dtype dt) as f32, t < nt. */
KVT__INLINE void kvt__widen(kvt_dtype dt, const uint8_t *src, float *dst, uint32_t nt,
                            uint32_t D)
{
    const size_t row = (size_t)D * (dt == KVT_DTYPE_F32 ? 4u : 2u);
    for (uint32_t t = 0; t < nt; t++)
        for (uint32_t d = 0; d < D; d += VW) {
            const uint32_t n = kvt__min_u32(VW, D - d);
            v_stf(dst + (size_t)t * D + d, v_ld(dt, src + t * row, d, n), n);
        }
}

/* ---- attention over a run of pages ---------------------------------------- */
KVT__INLINE void kvt__attn_dt(kvt_dtype dt, const kvt__attn_shape *sh, const float *q,
                              const uint8_t *const *blocks, const uint32_t *ntok,
                              const uint32_t *pos, const uint32_t *lim, uint32_t n, float *m,
                              float *l, float *acc, float *sbuf)
{
    const uint32_t G = sh->G, D = sh->D, P = sh->P;
    const size_t row = (size_t)D * (dt == KVT_DTYPE_F32 ? 4u : 2u);
    /* Many query rows (a step of several tokens): a half-precision block is
     * widened once into f32 scratch after the scores, instead of once per
     * block of GBK rows in each pass. */
    const bool wide = lim && dt != KVT_DTYPE_F32 && G > GBK;
    float *kwide = sbuf + (size_t)G * P, *vwide = kwide + (size_t)P * D;
    /* Block i + KVT__PF_DIST is requested while block i is computed: its K
     * rows before this block's K pass, its V rows before the V pass (the
     * first blocks up front), unless it ends a run of back-to-back blocks
     * that the hardware prefetchers already stream. */
    for (uint32_t i = 0; i < n && i < KVT__PF_DIST; i++)
        kvt__pf(blocks[i], 2 * (size_t)P * row);
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *K = blocks[i], *V = blocks[i] + (size_t)P * row;
        const uint32_t nt = ntok[i];
        const uint8_t *nb = i + KVT__PF_DIST < n ? blocks[i + KVT__PF_DIST] : NULL;
        if (nb && kvt__in_run(blocks + i, 2 * (size_t)P * row))
            nb = NULL;
        if (nb)
            kvt__pf(nb, (size_t)P * row);
        uint32_t g = 0;
        if (wide) {
            kvt__widen(dt, K, kwide, nt, D);
            for (; g + GBK <= G; g += GBK)
                kvt__kdot(KVT_DTYPE_F32, GBK, q + (size_t)g * D, (const uint8_t *)kwide, D, nt,
                          sbuf + (size_t)g * P, P);
        } else {
            for (; g + GBK <= G; g += GBK)
                kvt__kdot(dt, GBK, q + (size_t)g * D, K, D, nt, sbuf + (size_t)g * P, P);
        }
        for (; g < G; g++)
            kvt__kdot(dt, 1, q + (size_t)g * D, K, D, nt, sbuf + (size_t)g * P, P);
        for (g = 0; g < G; g++) {
            float *sg = sbuf + (size_t)g * P;
            /* Causal rows see the block's tokens before their limit only;
             * the others weigh zero in the V pass. */
            uint32_t vis = nt;
            if (lim)
                vis = lim[g] <= pos[i] ? 0 : kvt__min_u32(nt, lim[g] - pos[i]);
            if (vis < nt)
                memset(sg + vis, 0, (nt - vis) * sizeof *sg);
            const float mx = vis ? kvt__rowmax(sg, vis) : -INFINITY;
            const float mnew = mx > m[g] ? mx : m[g];
            if (mnew == -INFINITY) { /* every score so far is -inf */
                memset(sg, 0, vis * sizeof *sg);
                continue;
            }
            const float alpha = m[g] == mnew ? 1.0f : m[g] == -INFINITY ? 0.0f : expf(m[g] - mnew);
            const float sum = kvt__expsum(sg, vis, mnew);
            l[g] = l[g] * alpha + sum;
            if (alpha != 1.0f) {
                float *ag = acc + (size_t)g * D;
                for (uint32_t d = 0; d < D; d++)
                    ag[d] *= alpha;
            }
            m[g] = mnew;
        }
        if (nb)
            kvt__pf(nb + (size_t)P * row, (size_t)P * row);
        g = 0;
        if (wide) {
            kvt__widen(dt, V, vwide, nt, D);
            for (; g + GBK <= G; g += GBK)
                kvt__vacc(KVT_DTYPE_F32, GBK, sbuf + (size_t)g * P, (const uint8_t *)vwide, D, nt,
                          acc + (size_t)g * D, P);
        } else {
            for (; g + GBK <= G; g += GBK)
                kvt__vacc(dt, GBK, sbuf + (size_t)g * P, V, D, nt, acc + (size_t)g * D, P);
        }
        for (; g < G; g++)
            kvt__vacc(dt, 1, sbuf + (size_t)g * P, V, D, nt, acc + (size_t)g * D, P);
    }
}

static void kvt__attn(const kvt__attn_shape *sh, const float *q, const uint8_t *const *blocks,
                      const uint32_t *ntok, const uint32_t *pos, const uint32_t *lim,
                      uint32_t n, float *m, float *l, float *acc, float *sbuf)
{
    /* Each dtype twice: without a mask (one query token, the decode's
     * path, compiled as before masks existed) and with one. */
    switch (sh->dtype + (lim ? 8 : 0)) {
    case KVT_DTYPE_F16:
        kvt__attn_dt(KVT_DTYPE_F16, sh, q, blocks, ntok, NULL, NULL, n, m, l, acc, sbuf);
        break;
    case KVT_DTYPE_BF16:
        kvt__attn_dt(KVT_DTYPE_BF16, sh, q, blocks, ntok, NULL, NULL, n, m, l, acc, sbuf);
        break;
    case KVT_DTYPE_F32:
        kvt__attn_dt(KVT_DTYPE_F32, sh, q, blocks, ntok, NULL, NULL, n, m, l, acc, sbuf);
        break;
    case KVT_DTYPE_F16 + 8:
        kvt__attn_dt(KVT_DTYPE_F16, sh, q, blocks, ntok, pos, lim, n, m, l, acc, sbuf);
        break;
    case KVT_DTYPE_BF16 + 8:
        kvt__attn_dt(KVT_DTYPE_BF16, sh, q, blocks, ntok, pos, lim, n, m, l, acc, sbuf);
        break;
    default:
        kvt__attn_dt(KVT_DTYPE_F32, sh, q, blocks, ntok, pos, lim, n, m, l, acc, sbuf);
        break;
    }
}

/* ---- page scoring from the keys (KVT_SCORE_TOKEN, KVT_SCORE_ORACLE) -------- */
/* S[g * stride + i] = max_t q_g.k_t over the ntok[i] tokens of block i (c
 * == 0), or (1 / c) ln sum_t exp(c q_g.k_t) (c > 0). The K rows only: a
 * page's tokens in runs of KVT__TS_TOK, their dot products with every
 * query row from kvt__kdot (the decode's K pass). */
KVT__INLINE void kvt__tscore_dt(kvt_dtype dt, const kvt__attn_shape *sh, const float *q,
                                const uint8_t *const *blocks, const uint32_t *ntok, uint32_t n,
                                float c, float *S, size_t stride, float *sbuf)
{
    const uint32_t G = sh->G, D = sh->D, P = sh->P;
    const size_t row = (size_t)D * (dt == KVT_DTYPE_F32 ? 4u : 2u);
    float *mx = sbuf + (size_t)G * KVT__TS_TOK, *sum = mx + G;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *K = blocks[i];
        const uint32_t nt = ntok[i];
        /* The keys of the page KVT__PF_DIST ahead (the first ones up front),
         * as in the decode. */
        if (i == 0)
            for (uint32_t j = 0; j < n && j < KVT__PF_DIST; j++)
                kvt__pf(blocks[j], (size_t)P * row);
        if (i + KVT__PF_DIST < n)
            kvt__pf(blocks[i + KVT__PF_DIST], (size_t)P * row);
        for (uint32_t g = 0; g < G; g++) {
            mx[g] = -INFINITY;
            sum[g] = 0.0f;
        }
        for (uint32_t t0 = 0; t0 < nt; t0 += KVT__TS_TOK) {
            const uint32_t m = kvt__min_u32(KVT__TS_TOK, nt - t0);
            const uint8_t *Kt = K + (size_t)t0 * row;
            uint32_t g = 0;
            for (; g + GBK <= G; g += GBK)
                kvt__kdot(dt, GBK, q + (size_t)g * D, Kt, D, m, sbuf + (size_t)g * KVT__TS_TOK,
                          KVT__TS_TOK);
            for (; g < G; g++)
                kvt__kdot(dt, 1, q + (size_t)g * D, Kt, D, m, sbuf + (size_t)g * KVT__TS_TOK,
                          KVT__TS_TOK);
            for (g = 0; g < G; g++) {
                float *x = sbuf + (size_t)g * KVT__TS_TOK;
                if (c == 0.0f) {
                    const float r = kvt__rowmax(x, m);
                    mx[g] = r > mx[g] ? r : mx[g];
                    continue;
                }
                for (uint32_t t = 0; t < m; t++)
                    x[t] *= c;
                const float r = kvt__rowmax(x, m), mnew = r > mx[g] ? r : mx[g];
                if (mnew == -INFINITY || mnew == INFINITY) {
                    mx[g] = mnew;
                    continue;
                }
                sum[g] = (mx[g] == -INFINITY ? 0.0f : sum[g] * expf(mx[g] - mnew)) +
                         kvt__expsum(x, m, mnew);
                mx[g] = mnew;
            }
        }
        for (uint32_t g = 0; g < G; g++)
            S[(size_t)g * stride + i] =
                c == 0.0f || !isfinite(mx[g]) ? mx[g] / (c == 0.0f ? 1.0f : c)
                                              : (mx[g] + logf(sum[g])) / c;
    }
}

static void kvt__tscore(const kvt__attn_shape *sh, const float *q, const uint8_t *const *blocks,
                        const uint32_t *ntok, uint32_t n, float c, float *S, size_t stride,
                        float *sbuf)
{
    switch (sh->dtype) {
    case KVT_DTYPE_F16:
        kvt__tscore_dt(KVT_DTYPE_F16, sh, q, blocks, ntok, n, c, S, stride, sbuf);
        break;
    case KVT_DTYPE_BF16:
        kvt__tscore_dt(KVT_DTYPE_BF16, sh, q, blocks, ntok, n, c, S, stride, sbuf);
        break;
    default:
        kvt__tscore_dt(KVT_DTYPE_F32, sh, q, blocks, ntok, n, c, S, stride, sbuf);
        break;
    }
}

/* ---- page scoring from the metadata store ---------------------------------- */
/* MINMAX: qa = max(q, 0), qb = min(q, 0); the bound is qa.kmax + qb.kmin
 * (= sum_d max(q_d kmin_d, q_d kmax_d)). MEAN: qa = q against the mean row.
 * S[g * stride + i] for page i of n. NB pages are scored together so that
 * each query row loaded from L1 serves NB pages. */
#if KVT__ISA == 1
#define NBP 2u
#else
#define NBP 4u
#endif
KVT__INLINE void kvt__score_blk(kvt_dtype dt, uint32_t method, uint32_t nb, uint32_t G,
                                uint32_t D, size_t row, const float *qa, const float *qb,
                                const uint8_t *const *mb, float *S, size_t stride, uint32_t i)
{
    for (uint32_t g = 0; g < G; g += 4) {
        const uint32_t gb = kvt__min_u32(4, G - g);
        vf a[NBP][4];
        KVT__UNROLL
        for (uint32_t j = 0; j < NBP; j++)
            KVT__UNROLL
            for (uint32_t k = 0; k < 4; k++)
                a[j][k] = v_zero();
        for (uint32_t d = 0; d < D; d += VW) {
            const uint32_t nn = kvt__min_u32(VW, D - d);
            if (method == KVT_SCORE_MINMAX) {
                vf lo[NBP], hi[NBP];
                KVT__UNROLL
                for (uint32_t j = 0; j < NBP; j++) {
                    lo[j] = j < nb ? v_ld(dt, mb[j], d, nn) : v_zero();
                    hi[j] = j < nb ? v_ld(dt, mb[j] + row, d, nn) : v_zero();
                }
                KVT__UNROLL
                for (uint32_t k = 0; k < 4; k++) {
                    if (k >= gb)
                        break;
                    vf qp = v_ldf(qa + (size_t)(g + k) * D + d, nn);
                    vf qn = v_ldf(qb + (size_t)(g + k) * D + d, nn);
                    KVT__UNROLL
                    for (uint32_t j = 0; j < NBP; j++)
                        a[j][k] = v_fma(qp, hi[j], v_fma(qn, lo[j], a[j][k]));
                }
            } else {
                vf mean[NBP];
                KVT__UNROLL
                for (uint32_t j = 0; j < NBP; j++)
                    mean[j] = j < nb ? v_ld(dt, mb[j], d, nn) : v_zero();
                KVT__UNROLL
                for (uint32_t k = 0; k < 4; k++) {
                    if (k >= gb)
                        break;
                    vf qq = v_ldf(qa + (size_t)(g + k) * D + d, nn);
                    KVT__UNROLL
                    for (uint32_t j = 0; j < NBP; j++)
                        a[j][k] = v_fma(qq, mean[j], a[j][k]);
                }
            }
        }
        KVT__UNROLL
        for (uint32_t j = 0; j < NBP; j++) {
            if (j >= nb)
                break;
            float r[4];
            v_hsum4(a[j][0], a[j][1], a[j][2], a[j][3], r);
            for (uint32_t k = 0; k < gb; k++)
                S[(size_t)(g + k) * stride + i + j] = r[k];
        }
    }
}

KVT__INLINE void kvt__score_dt(kvt_dtype dt, uint32_t method, const kvt__attn_shape *sh,
                               const float *qa, const float *qb, const uint8_t *plane,
                               uint64_t slot_bytes, const uint32_t *slots, uint32_t n,
                               float *S, size_t stride)
{
    const uint32_t G = sh->G, D = sh->D;
    const size_t row = (size_t)D * (dt == KVT_DTYPE_F32 ? 4u : 2u);
    /* The rows the method reads: min and max, or the mean. */
    const size_t pf_len = method == KVT_SCORE_MINMAX ? 2 * row : row;
    /* Slots are scattered over the store: the pages KVT__SCORE_PF ahead
     * are requested into L2 while these are scored (a cold slot costs
     * about twice a warm one's time otherwise). */
    for (uint32_t j = 0; j < KVT__SCORE_PF && j < n; j++)
        kvt__pf(plane + (size_t)slots[j] * slot_bytes, pf_len);
    for (uint32_t i = 0; i < n; i += NBP) {
        const uint32_t nb = kvt__min_u32(NBP, n - i);
        for (uint32_t j = i + KVT__SCORE_PF; j < i + KVT__SCORE_PF + nb && j < n; j++)
            kvt__pf(plane + (size_t)slots[j] * slot_bytes, pf_len);
        const uint8_t *mb[NBP];
        for (uint32_t j = 0; j < NBP; j++)
            mb[j] = plane + (size_t)slots[j < nb ? i + j : i] * slot_bytes;
        if (nb == NBP)
            kvt__score_blk(dt, method, NBP, G, D, row, qa, qb, mb, S, stride, i);
        else
            kvt__score_blk(dt, method, nb, G, D, row, qa, qb, mb, S, stride, i);
    }
}

static void kvt__score(const kvt__attn_shape *sh, uint32_t method, const float *qa,
                       const float *qb, const uint8_t *plane, uint64_t slot_bytes,
                       const uint32_t *slots, uint32_t n, float *S, size_t stride)
{
    switch (sh->dtype) {
    case KVT_DTYPE_F16:
        kvt__score_dt(KVT_DTYPE_F16, method, sh, qa, qb, plane, slot_bytes, slots, n, S,
                      stride);
        break;
    case KVT_DTYPE_BF16:
        kvt__score_dt(KVT_DTYPE_BF16, method, sh, qa, qb, plane, slot_bytes, slots, n, S,
                      stride);
        break;
    default:
        kvt__score_dt(KVT_DTYPE_F32, method, sh, qa, qb, plane, slot_bytes, slots, n, S,
                      stride);
        break;
    }
}

const kvt__kernels KVT__KERN_NAME = {
    .name = KVT__KERN_STR,
    .attn = kvt__attn,
    .score = kvt__score,
    .tscore = kvt__tscore,
    .expsum = kvt__expsum,
};
