/* libkvtier - error codes, element types, backends and the model geometry.
 *
 * Every public type here is FFI-friendly: fixed-width integers, enums as
 * uint32_t typedefs with explicit constants, no bitfields.
 */
#ifndef KVTIER_COMMON_H
#define KVTIER_COMMON_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#  define KVT_API
#elif defined(__GNUC__) || defined(__clang__)
#  define KVT_API __attribute__((visibility("default")))
#else
#  define KVT_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Error codes ------------------------------------------------------
 * Functions return 0 on success and one of these negative codes on
 * failure. The values are pinned: they never change once released. */
#define KVT_OK          0
#define KVT_EINVAL     (-1)  /* an argument is invalid (the message names it) */
#define KVT_ENOMEM     (-2)  /* a host allocation failed */
#define KVT_ENOSPC     (-3)  /* a tier has no free block left */
#define KVT_ENOTSUP    (-4)  /* this build or backend cannot serve the call */
#define KVT_EIO        (-5)  /* an I/O operation failed */
#define KVT_ECORRUPT   (-6)  /* a checksum or format check failed */
#define KVT_ENOENT     (-7)  /* no such object (e.g. a released sequence) */
#define KVT_ERANGE     (-8)  /* a value lies outside the allowed range */
#define KVT_EOVERFLOW  (-9)  /* a size computation would overflow */
#define KVT_ESTATE     (-10) /* the call is not valid in the current state */
#define KVT_EBUSY      (-11) /* the object is in use */
#define KVT_ETIMEDOUT  (-12) /* a wait ran past its timeout */
#define KVT_EAGAIN     (-13) /* not ready yet; try again */
#define KVT_EINTERNAL  (-14) /* an internal invariant is violated (a bug) */

/* Static description of a code ("invalid argument"); never NULL. */
KVT_API const char *kvt_strerror(int code);
/* Symbolic name of a code ("KVT_EINVAL"); "KVT_E?" for unknown codes. */
KVT_API const char *kvt_err_name(int code);
/* Detail message of the last failed call on the calling thread, naming
 * the argument and the bad value. "" when no call has failed. The text
 * stays valid until the next kvtier call on this thread. */
KVT_API const char *kvt_last_error(void);
/* Resets kvt_last_error() of the calling thread to "". */
KVT_API void kvt_clear_error(void);

/* ---- Element types ---------------------------------------------------- */
typedef uint32_t kvt_dtype;
#define KVT_DTYPE_DEFAULT 0u /* in options: the default (f16) */
#define KVT_DTYPE_F16     1u /* IEEE 754 binary16 */
#define KVT_DTYPE_BF16    2u /* bfloat16 */
#define KVT_DTYPE_F32     3u /* IEEE 754 binary32 */

/* Bytes per element of a dtype; 0 for an unknown dtype. */
KVT_API size_t kvt_dtype_size(kvt_dtype dtype);

/* ---- Backends --------------------------------------------------------- */
typedef uint32_t kvt_backend;
#define KVT_BACKEND_AUTO 0u /* the CPU for now: CUDA only once validated on a GPU */
#define KVT_BACKEND_CPU  1u
#define KVT_BACKEND_CUDA 2u

/* Features compiled into the loaded library (bits of kvt_build_features). */
#define KVT_FEATURE_CUDA    (1u << 0) /* the CUDA backend was compiled in */
#define KVT_FEATURE_NUMA    (1u << 1) /* host tier placed with libnuma */
#define KVT_FEATURE_URING   (1u << 2) /* io_uring disk tier (mover) */
#define KVT_FEATURE_REMOTE  (1u << 3) /* the remote tier (hiredis; kvtier/remote.h) */
KVT_API uint32_t kvt_build_features(void);

/* ---- Tiers ------------------------------------------------------------ */
typedef uint32_t kvt_tier;
#define KVT_TIER_DEVICE 0u
#define KVT_TIER_HOST   1u
#define KVT_TIER_DISK   2u
#define KVT_NUM_TIERS   3u

/* Residency bits of a page: in which tiers a byte-exact copy lives. */
#define KVT_RES_DEVICE (1u << KVT_TIER_DEVICE)
#define KVT_RES_HOST   (1u << KVT_TIER_HOST)
#define KVT_RES_DISK   (1u << KVT_TIER_DISK)

/* ---- Geometry ----------------------------------------------------------
 * The shape of one model's KV cache. One physical block holds one page of
 * one (layer, KV head): K[page_tokens][head_dim] followed by
 * V[page_tokens][head_dim], in `dtype`. */
typedef struct kvt_geometry {
    uint32_t n_layers;    /* 1..4096 */
    uint32_t n_kv_heads;  /* 1..4096 */
    uint32_t n_q_heads;   /* multiple of n_kv_heads, at most 256x (GQA);
                             0 = n_kv_heads */
    uint32_t head_dim;    /* multiple of 8, 8..1024 */
    uint32_t page_tokens; /* power of two, 8..256; 0 = 16 */
    kvt_dtype dtype;      /* storage type; KVT_DTYPE_DEFAULT = f16 */
    uint32_t reserved[2]; /* must be zero */
} kvt_geometry;

/* Checks a geometry as kvt_pool_create() would (defaults applied to a
 * copy). Returns 0, or KVT_EINVAL naming the field. */
KVT_API int kvt_geometry_validate(const kvt_geometry *geom);
/* Bytes of one physical block (2 * page_tokens * head_dim * dtype size)
 * of a valid geometry, stored in *out. */
KVT_API int kvt_geometry_block_bytes(const kvt_geometry *geom, uint64_t *out);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_COMMON_H */
