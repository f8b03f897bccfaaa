/* CPU feature detection from cpuid/xgetbv, for run-time SIMD dispatch. The
 * OS must also save the wider registers (XCR0), or the instructions fault. */
#include "base.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t kvt__xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static uint32_t kvt__cpu_detect(void)
{
    unsigned a, b, c, d;
    uint32_t f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    const int osxsave = (c >> 27) & 1;
    if (!osxsave)
        return 0;
    const uint64_t xcr0 = kvt__xgetbv0();
    const int ymm_ok = (xcr0 & 0x6) == 0x6;   /* SSE + AVX state */
    const int zmm_ok = (xcr0 & 0xe6) == 0xe6; /* + opmask, ZMM_Hi256, Hi16_ZMM */
    if (ymm_ok && ((c >> 28) & 1)) {
        f |= KVT__CPU_AVX;
        if ((c >> 29) & 1)
            f |= KVT__CPU_F16C;
        if ((c >> 12) & 1)
            f |= KVT__CPU_FMA;
    }
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if (ymm_ok && ((b >> 5) & 1))
            f |= KVT__CPU_AVX2;
        if (zmm_ok && ((b >> 16) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1)) /* F+BW+VL */
            f |= KVT__CPU_AVX512;
    }
    return f;
}
#else
static uint32_t kvt__cpu_detect(void)
{
    return 0;
}
#endif

uint32_t kvt__cpu_features(void)
{
    /* Every thread computes the same value, so the race is benign; the
     * atomic keeps it well defined. */
    static _Atomic uint32_t cached = 0x80000000u;
    uint32_t f = cached;
    if (f & 0x80000000u) {
        f = kvt__cpu_detect();
        cached = f;
    }
    return f;
}
