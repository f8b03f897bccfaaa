// CUDA backend glue. In this release it is compiled whenever nvcc exists so
// the CUDA toolchain path stays exercised, but it has no kernels yet: a
// pool asking for the CUDA backend gets KVT_ENOTSUP with a message.
#include "kvtier/common.h"

#define KVT__HIDDEN __attribute__((visibility("hidden")))

extern "C" {
KVT__HIDDEN int kvt__err(int code, const char *fmt, ...);

KVT__HIDDEN int kvt__cuda_pool_init(int32_t device)
{
    return kvt__err(KVT_ENOTSUP,
                    "opts->backend: the CUDA backend (device %d) is compiled in but has no "
                    "kernels in this release; use KVT_BACKEND_CPU",
                    (int)device);
}

KVT__HIDDEN bool kvt__cuda_built(void)
{
    return true;
}
}
