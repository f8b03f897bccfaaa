/* kvt_seq_append: the public bulk append (prefill and between-step
 * decode), which checks every argument, then writes through the page store
 * (lib/core/append.c) or the CUDA backend, and lets a tiered pool's
 * placement react to the new pages. */
#include <stdlib.h>

#include "api_int.h"
#include "../backend/backend.h"
#include "../tier/tier.h"

KVT_API int kvt_seq_append(kvt_pool *pool, kvt_seq_id seq, uint32_t layer, const void *k,
                           const void *v, uint32_t n_tokens, kvt_dtype src_dtype,
                           uint64_t token_stride)
{
    kvt__seq *s;
    KVT__CHECK_NULL(pool);
    int rc = kvt__seq_lookup(pool, seq, &s);
    if (rc || (rc = kvt__seq_loading_err(s, "kvt_seq_append")))
        return rc;
    KVT__CHECK_NULL(k);
    KVT__CHECK_NULL(v);
    const uint32_t H = pool->g.n_kv_heads, D = pool->g.head_dim;
    if (layer >= pool->g.n_layers)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, pool->g.n_layers);
    if (n_tokens == 0)
        return kvt__err(KVT_EINVAL, "n_tokens: must be at least 1");
    const size_t src_elem = kvt_dtype_size(src_dtype);
    if (src_elem == 0)
        return kvt__src_dtype_err(src_dtype);
    const uint64_t dense = (uint64_t)H * D;
    if (token_stride == 0)
        token_stride = dense;
    if (token_stride < dense)
        return kvt__err(KVT_EINVAL, "token_stride: %llu is below n_kv_heads * head_dim = %llu",
                        (unsigned long long)token_stride, (unsigned long long)dense);
    uint64_t span;
    if (!kvt__mul_u64(token_stride, n_tokens, &span) || !kvt__mul_u64(span, src_elem, &span) ||
        span > SIZE_MAX / 2)
        return kvt__err(KVT_EOVERFLOW, "n_tokens, token_stride: %u tokens x %llu elements "
                        "overflow", n_tokens, (unsigned long long)token_stride);
    if (n_tokens) { /* the bytes read: the last token's rows end the span */
        const size_t ext = (size_t)(((uint64_t)(n_tokens - 1) * token_stride + dense) * src_elem);
        if ((rc = kvt__not_in_pool(pool, k, ext, "k")) ||
            (rc = kvt__not_in_pool(pool, v, ext, "v")))
            return rc;
    }

    const uint32_t cur = s->n_tokens[layer];
    if (n_tokens > s->max_tokens - cur)
        return kvt__err(KVT_ERANGE, "n_tokens: %u more tokens pass the sequence's limit "
                        "(%u of %u used in layer %u)", n_tokens, cur, s->max_tokens, layer);
    const uint32_t end = cur + n_tokens;
    const uint32_t pages_before = kvt__pages_for(pool, cur);
    const uint32_t pages_after = kvt__pages_for(pool, end);
    const uint64_t need = (uint64_t)(pages_after - pages_before) * H;
    kvt__arena *dev = &pool->tier[KVT_TIER_DEVICE];
    kvt__pfx_make_room(pool, KVT_TIER_DEVICE, need); /* cached pages no sequence holds */
    kvt__pfx_make_room(pool, KVT_NUM_TIERS, need);
    if (need > dev->n_free)
        return kvt__err(KVT_ENOSPC, "device tier: %llu blocks needed for layer %u, %u free",
                        (unsigned long long)need, layer, dev->n_free);
    if (need > pool->meta.n_free)
        return kvt__err(KVT_ENOSPC, "metadata store: %llu pages needed, %u free",
                        (unsigned long long)need, pool->meta.n_free);
    rc = kvt__seq_reserve(pool, s, pages_after);
    if (rc)
        return rc;

    if ((rc = pool->be->seq_append(pool, s, layer, k, v, n_tokens, src_dtype, token_stride)))
        return rc;
    if (pool->pol) {
        /* Tiered pool: stable heads' full pages go out once, now, and their
         * device copies leave unless forced or selected. A failed copy-out
         * keeps the page on device; the next pass tries again. */
        kvt__place_after_append(pool, s, seq, layer, cur);
        kvt_clear_error();
    }
    kvt__pfx_register(pool, s); /* pages every layer now holds full, ids known */
    return 0;
}


int kvt__append_host_rows(kvt_pool *pool, kvt_seq_id id, uint32_t layer, const void *k,
                          const void *v, uint32_t n, kvt__rows_stage *st)
{
    if (!(pool->be_caps & KVT__BE_DEVICE_REMOTE) || !pool->be->scratch)
        return kvt_seq_append(pool, id, layer, k, v, n, pool->g.dtype, 0);
    const size_t nb = (size_t)n * pool->g.n_kv_heads * pool->g.head_dim * pool->elem;
    int rc;
    if (nb > st->cap) { /* the rows go to the backend's memory first */
        kvt__rows_stage_fini(pool, st);
        if ((rc = pool->be->scratch(pool, nb, &st->k)) ||
            (rc = pool->be->scratch(pool, nb, &st->v)))
            return rc;
        st->cap = nb;
    }
    if ((rc = pool->be->write(pool, st->k, k, nb)) || (rc = pool->be->write(pool, st->v, v, nb)))
        return rc;
    return kvt_seq_append(pool, id, layer, st->k, st->v, n, pool->g.dtype, 0);
}

void kvt__rows_stage_fini(kvt_pool *pool, kvt__rows_stage *st)
{
    if (st->k)
        pool->be->scratch_free(pool, st->k);
    if (st->v)
        pool->be->scratch_free(pool, st->v);
    st->k = st->v = NULL;
    st->cap = 0;
}
