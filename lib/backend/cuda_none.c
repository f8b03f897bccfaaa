/* The CUDA glue of a build without nvcc (or with CUDA=0). */
#include "../core/internal.h"

int kvt__cuda_pool_init(int32_t device)
{
    (void)device;
    return kvt__err(KVT_ENOTSUP, "opts->backend: this build of libkvtier has no CUDA backend "
                    "(built without nvcc or with CUDA=0)");
}

bool kvt__cuda_built(void)
{
    return false;
}
