/* Shared by the CUDA kernel tests (tests/gpu): the skip without a device. */
#ifndef KVT_GPUTEST_H
#define KVT_GPUTEST_H

#include <stdio.h>

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

#endif /* KVT_GPUTEST_H */
