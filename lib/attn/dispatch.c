/* Run-time choice of the CPU kernels. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

const kvt__kernels *kvt__kernels_select(void)
{
    const uint32_t f = kvt__cpu_features();
    const uint32_t avx2 = KVT__CPU_AVX | KVT__CPU_AVX2 | KVT__CPU_FMA | KVT__CPU_F16C;
    int best = 0;
    if ((f & avx2) == avx2)
        best = (f & KVT__CPU_AVX512) ? 2 : 1;
    /* KVTIER_SIMD caps the choice (tests run every path; benchmarks compare). */
    const char *cap = getenv("KVTIER_SIMD");
    if (cap && *cap) {
        int c = !strcmp(cap, "portable") ? 0 : !strcmp(cap, "avx2") ? 1 : 2;
        best = c < best ? c : best;
    }
    return best == 2 ? &kvt__kern_avx512 : best == 1 ? &kvt__kern_avx2 : &kvt__kern_portable;
}
