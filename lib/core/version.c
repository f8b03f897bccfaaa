/* Version of the loaded library (its features: lib/api/features.c). */
#include "base.h"

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
