/* The CUDA backend of a build without nvcc (or with CUDA=0): the same
 * table, not built; its pool_init refuses, so no pool ever gets it and no
 * other entry is reached. */
#include "backend.h"

static int kvt__cuda_none_init(kvt_pool *p, const kvt_pool_opts *o)
{
    (void)p;
    (void)o;
    return kvt__err(KVT_ENOTSUP, "opts->backend: this build of libkvtier has no CUDA backend "
                    "(built without nvcc or with CUDA=0)");
}

const kvt__backend kvt__backend_cuda = {
    .version = KVT__BACKEND_V1,
    .name = "cuda",
    .built = false,
    .pool_init = kvt__cuda_none_init,
};
