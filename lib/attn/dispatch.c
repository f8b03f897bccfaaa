/* Run-time choice of the CPU kernels. */
#include <stdatomic.h>
#include <stdio.h>
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
        const int c = !strcmp(cap, "portable") ? 0 : !strcmp(cap, "avx2") ? 1
                      : !strcmp(cap, "avx512")   ? 2 : -1;
        if (c < 0) { /* said once per process: a typo would otherwise go unseen */
            static atomic_flag said = ATOMIC_FLAG_INIT;
            if (!atomic_flag_test_and_set(&said))
                fprintf(stderr, "libkvtier: KVTIER_SIMD=%.32s is not portable, avx2 or avx512; "
                        "ignored\n", cap);
        } else {
            best = c < best ? c : best;
        }
    }
    return best == 2 ? &kvt__kern_avx512 : best == 1 ? &kvt__kern_avx2 : &kvt__kern_portable;
}
