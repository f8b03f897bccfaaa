/* Version of the loaded library and the features it was built with. */
#include "internal.h"

#define KVT__STR2(x) #x
#define KVT__STR(x) KVT__STR2(x)

KVT_API uint32_t kvt_version(void)
{
    return KVT_VERSION_NUMBER;
}

KVT_API const char *kvt_version_string(void)
{
    return KVT__STR(KVT_VERSION_MAJOR) "." KVT__STR(KVT_VERSION_MINOR) "." KVT__STR(
        KVT_VERSION_PATCH);
}

KVT_API uint32_t kvt_build_features(void)
{
    uint32_t f = KVT_FEATURE_NUMA;
    if (kvt__cuda_built())
        f |= KVT_FEATURE_CUDA;
    f |= KVT_FEATURE_URING; /* the disk tier's I/O (lib/tier/uring.c) */
    return f;
}
