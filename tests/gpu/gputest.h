/* Shared by the CUDA kernel tests (tests/gpu): the skip without a device. */
#ifndef KVT_GPUTEST_H
#define KVT_GPUTEST_H

#include <stdio.h>
#include <stdlib.h>

#include "kvt_cuda.h"

/* In main(): exit 77 (skipped) when no CUDA device is usable. */
#define GPU_SKIP_WITHOUT_DEVICE()                                            \
    do {                                                                     \
        const char *why_ = "";                                               \
        if (kvt__cu_device_count(&why_) <= 0) {                              \
            printf("skipped: no CUDA device (%s)\n", why_);                  \
            return 77;                                                       \
        }                                                                    \
    } while (0)

/* A kvt__cu_* or public call that must succeed (cmocka). */
#define CU_OK(call)                                                                   \
    do {                                                                              \
        int rc_ = (call);                                                             \
        if (rc_ != 0)                                                                 \
            fail_msg("%s failed: %d (%s)", #call, rc_, kvt_last_error());             \
    } while (0)

/* KVT_GPU_REDUCED=N (2..64) in the environment: the shape and configuration
 * tables run only every Nth case (case c runs when c % N == 0), so the
 * compute-sanitizer stages of examples/bench/gpu-session.sh, whose cost grows
 * with the kernel launches, finish in about a minute. Unset: every case.
 * Pick N prime to the tables' dimensions so the kept cases still mix them. */
static inline int gpu_case_kept(size_t c)
{
    const char *e = getenv("KVT_GPU_REDUCED");
    long n = e ? strtol(e, NULL, 10) : 1;
    if (n < 2 || n > 64)
        n = 1;
    return c % (size_t)n == 0;
}

#endif /* KVT_GPUTEST_H */
