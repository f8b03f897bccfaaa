/* Geometry validation and derived sizes. */
#include "base.h"

KVT_API size_t kvt_dtype_size(kvt_dtype dtype)
{
    switch (dtype) {
    case KVT_DTYPE_F16:
    case KVT_DTYPE_BF16:
        return 2;
    case KVT_DTYPE_F32:
        return 4;
    default:
        return 0;
    }
}

const char *kvt__dtype_name(uint32_t dtype)
{
    switch (dtype) {
    case KVT_DTYPE_DEFAULT: return "default";
    case KVT_DTYPE_F16: return "f16";
    case KVT_DTYPE_BF16: return "bf16";
    case KVT_DTYPE_F32: return "f32";
    default: return "?";
    }
}

const char *kvt__backend_name(uint32_t backend)
{
    switch (backend) {
    case KVT_BACKEND_AUTO: return "auto";
    case KVT_BACKEND_CPU: return "cpu";
    case KVT_BACKEND_CUDA: return "cuda";
    default: return "?";
    }
}

int kvt__src_dtype_err(uint32_t src_dtype)
{
    return src_dtype == KVT_DTYPE_DEFAULT
               ? kvt__err(KVT_EINVAL, "src_dtype: default names no source type (it is for "
                          "options); pass f16, bf16 or f32")
               : kvt__err(KVT_EINVAL, "src_dtype: %u is not a dtype (f16, bf16 or f32)",
                          src_dtype);
}

int kvt__geometry_resolve(const kvt_geometry *g, kvt_geometry *out)
{
    kvt_geometry r = *g;
    if (r.page_tokens == 0)
        r.page_tokens = 16;
    if (r.dtype == KVT_DTYPE_DEFAULT)
        r.dtype = KVT_DTYPE_F16;
    if (r.n_q_heads == 0)
        r.n_q_heads = r.n_kv_heads;

    if (r.n_layers == 0 || r.n_layers > 4096)
        return kvt__err(KVT_EINVAL, "geom.n_layers: %u is outside 1..4096", r.n_layers);
    if (r.n_kv_heads == 0 || r.n_kv_heads > 4096)
        return kvt__err(KVT_EINVAL, "geom.n_kv_heads: %u is outside 1..4096", r.n_kv_heads);
    if (r.n_q_heads % r.n_kv_heads != 0 || r.n_q_heads / r.n_kv_heads > 256)
        return kvt__err(KVT_EINVAL,
                        "geom.n_q_heads: %u is not a multiple (at most 256x) of n_kv_heads %u",
                        r.n_q_heads, r.n_kv_heads);
    if (r.head_dim < 8 || r.head_dim > 1024 || r.head_dim % 8 != 0)
        return kvt__err(KVT_EINVAL, "geom.head_dim: %u is not a multiple of 8 in 8..1024",
                        r.head_dim);
    if (r.page_tokens < 8 || r.page_tokens > 256 || (r.page_tokens & (r.page_tokens - 1)))
        return kvt__err(KVT_EINVAL, "geom.page_tokens: %u is not a power of two in 8..256",
                        r.page_tokens);
    if (kvt_dtype_size(r.dtype) == 0)
        return kvt__err(KVT_EINVAL, "geom.dtype: %u is not a dtype (default, f16, bf16 or f32)",
                        r.dtype);
    if (r.reserved[0] || r.reserved[1])
        return kvt__err(KVT_EINVAL, "geom.reserved: must be zero");
    if (out)
        *out = r;
    return 0;
}

KVT_API int kvt_geometry_validate(const kvt_geometry *geom)
{
    KVT__CHECK_NULL(geom);
    return kvt__geometry_resolve(geom, NULL);
}

KVT_API int kvt_geometry_block_bytes(const kvt_geometry *geom, uint64_t *out)
{
    kvt_geometry r;
    KVT__CHECK_NULL(geom);
    KVT__CHECK_NULL(out);
    int rc = kvt__geometry_resolve(geom, &r);
    if (rc)
        return rc;
    /* Bounded by validation: 2 * 256 * 1024 * 4 fits easily. */
    *out = 2ull * r.page_tokens * r.head_dim * kvt_dtype_size(r.dtype);
    return 0;
}
