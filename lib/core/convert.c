/* Element conversion between f32 and the storage types, with the rounding
 * mode chosen per use: data rounds to nearest even; page metadata rounds
 * min toward -inf and max toward +inf so score bounds stay true bounds. */
#include <math.h>
#include <string.h>

#include "base.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KVT__HAVE_X86 1
#endif

static inline uint32_t kvt__bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float kvt__from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float kvt__f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in f32 */
        float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    if (exp == 31)
        return kvt__from_bits(sign | 0x7f800000u | (man << 13));
    return kvt__from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

float kvt__bf16_to_f32(uint16_t h)
{
    return kvt__from_bits((uint32_t)h << 16);
}

/* Round to nearest even by integer arithmetic on the f32 encoding: the
 * exponent is rebiased and the dropped 13 mantissa bits rounded in one add
 * (carries into the exponent are what rounding up to the next binade
 * means). Subnormal results go through an f32 add whose own rounding to
 * nearest even lands exactly on the f16 subnormal grid. */
static uint16_t kvt__f16_rn(float f)
{
    uint32_t x = kvt__bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) /* inf or NaN (kept quiet) */
        return (uint16_t)(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (x >= 0x477ff000u) /* >= 65520: rounds past the largest finite f16 */
        return (uint16_t)(sign | 0x7c00u);
    if (x < 0x38800000u) { /* below 2^-14: f16 subnormal or zero */
        float g = kvt__from_bits(x) + 0.5f; /* ulp(0.5) = 2^-24 = f16's quantum */
        return (uint16_t)(sign | (kvt__bits(g) - 0x3f000000u));
    }
    x += 0xc8000fffu + ((x >> 13) & 1u); /* exponent - 112, round half to even */
    return (uint16_t)(sign | (x >> 13));
}

/* The f16 neighbour of h one step toward -inf. */
static uint16_t kvt__f16_step_down(uint16_t h)
{
    if (h == 0x0000u)
        return 0x8001u;
    return (h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
}

static uint16_t kvt__f16_step_up(uint16_t h)
{
    if (h == 0x8000u)
        return 0x0001u;
    return (h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
}

uint16_t kvt__f32_to_f16(float f, kvt__round mode)
{
    uint16_t h = kvt__f16_rn(f);
    if (mode == KVT__RN || isnan(f))
        return h;
    /* Directed rounding = nearest, then one step if it went the wrong way. */
    float back = kvt__f16_to_f32(h);
    if (mode == KVT__RD && back > f)
        h = kvt__f16_step_down(h);
    else if (mode == KVT__RU && back < f)
        h = kvt__f16_step_up(h);
    /* A zero result keeps the sign of f (the reference semantics of IEEE). */
    if ((h & 0x7fffu) == 0)
        h = (uint16_t)(signbit(f) ? 0x8000u : 0u);
    return h;
}

uint16_t kvt__f32_to_bf16(float f, kvt__round mode)
{
    uint32_t u = kvt__bits(f);
    if (isnan(f))
        return (uint16_t)((u >> 16) | 0x0040u); /* keep it a (quiet) NaN */
    uint32_t sign = u & 0x80000000u;
    uint32_t lost = u & 0xffffu;
    uint32_t t = u >> 16; /* truncation = rounding toward zero */
    if (mode == KVT__RN) {
        uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
        return (uint16_t)(r >> 16);
    }
    int up = (mode == KVT__RU && !sign) || (mode == KVT__RD && sign);
    if (up && lost != 0 && (u & 0x7fffffffu) < 0x7f800000u)
        t += 1; /* magnitude up; 0x7f7f + 1 becomes infinity as it should */
    return (uint16_t)t;
}

#ifdef KVT__HAVE_X86
/* Hardware conversion (F16C), round to nearest even, where the CPU has it. */
__attribute__((target("avx,f16c"))) static void kvt__f16_load_f16c(float *dst,
                                                                   const uint16_t *src,
                                                                   size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i,
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = kvt__f16_to_f32(src[i]);
}

/* The rounding immediate of vcvtps2ph selects nearest, down or up. */
#define KVT__F16C_STORE(name, imm)                                                          \
    __attribute__((target("avx,f16c"))) static void name(uint16_t *dst, const float *src,   \
                                                         size_t n, kvt__round mode)        \
    {                                                                                      \
        size_t i = 0;                                                                      \
        for (; i + 8 <= n; i += 8)                                                         \
            _mm_storeu_si128((__m128i *)(dst + i),                                         \
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), (imm)));            \
        for (; i < n; i++)                                                                 \
            dst[i] = kvt__f32_to_f16(src[i], mode);                                        \
    }
KVT__F16C_STORE(kvt__f16_store_rn, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
KVT__F16C_STORE(kvt__f16_store_rd, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
KVT__F16C_STORE(kvt__f16_store_ru, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC)

static int kvt__has_f16c(void)
{
    const uint32_t need = KVT__CPU_AVX | KVT__CPU_F16C;
    return (kvt__cpu_features() & need) == need;
}
#endif

void kvt__load_f32(float *dst, const void *src, kvt_dtype src_dtype, size_t n)
{
    switch (src_dtype) {
    case KVT_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        return;
    case KVT_DTYPE_F16: {
        const uint16_t *s = src;
#ifdef KVT__HAVE_X86
        if (kvt__has_f16c()) {
            kvt__f16_load_f16c(dst, s, n);
            return;
        }
#endif
        for (size_t i = 0; i < n; i++)
            dst[i] = kvt__f16_to_f32(s[i]);
        return;
    }
    case KVT_DTYPE_BF16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = kvt__bf16_to_f32(s[i]);
        return;
    }
    default:
        return;
    }
}

void kvt__store_f32(void *dst, kvt_dtype dst_dtype, const float *src, size_t n,
                    kvt__round mode)
{
    switch (dst_dtype) {
    case KVT_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        return;
    case KVT_DTYPE_F16: {
        uint16_t *d = dst;
#ifdef KVT__HAVE_X86
        if (kvt__has_f16c()) {
            if (mode == KVT__RN)
                kvt__f16_store_rn(d, src, n, mode);
            else if (mode == KVT__RD)
                kvt__f16_store_rd(d, src, n, mode);
            else
                kvt__f16_store_ru(d, src, n, mode);
            return;
        }
#endif
        for (size_t i = 0; i < n; i++)
            d[i] = kvt__f32_to_f16(src[i], mode);
        return;
    }
    case KVT_DTYPE_BF16: {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = kvt__f32_to_bf16(src[i], mode);
        return;
    }
    default:
        return;
    }
}
