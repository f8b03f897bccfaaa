/* libkvtier - version numbers (the single place they are defined). */
#ifndef KVTIER_VERSION_H
#define KVTIER_VERSION_H

#include "kvtier/common.h"

#define KVT_VERSION_MAJOR 0
#define KVT_VERSION_MINOR 1
#define KVT_VERSION_PATCH 0
/* MAJOR*10000 + MINOR*100 + PATCH, comparable with < and >. */
#define KVT_VERSION_NUMBER \
    (KVT_VERSION_MAJOR * 10000 + KVT_VERSION_MINOR * 100 + KVT_VERSION_PATCH)

#ifdef __cplusplus
extern "C" {
#endif

/* Version of the library actually loaded (may differ from the header's). */
KVT_API uint32_t kvt_version(void);
/* "MAJOR.MINOR.PATCH" of the loaded library; static storage, never NULL. */
KVT_API const char *kvt_version_string(void);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_VERSION_H */
