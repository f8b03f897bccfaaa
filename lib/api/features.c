/* kvt_build_features: what this build of the library can serve (the
 * backends and tiers it was built with). */
#include "../core/store.h"
#include "../backend/backend.h"
#include "../tier/tier.h"

KVT_API uint32_t kvt_build_features(void)
{
    uint32_t f = KVT_FEATURE_NUMA;
    if (kvt__backend_cuda.built)
        f |= KVT_FEATURE_CUDA;
    f |= KVT_FEATURE_URING; /* the disk tier's I/O (lib/tier/uring.c) */
    if (kvt__rclient_built)
        f |= KVT_FEATURE_REMOTE;
    return f;
}
