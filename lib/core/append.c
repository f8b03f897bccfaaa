/* Paged append: K/V rows of one layer go into the last page of each KV
 * head (new pages from the device tier as pages fill), and the per-page key
 * metadata (min, max, mean) follows every append. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "../tier/tier.h"

/* Grows the sequence's tables so every (layer, head) holds `pages` entries.
 * All-or-nothing: on failure the old tables are untouched. */
int kvt__seq_reserve(kvt_pool *p, kvt__seq *s, uint32_t pages)
{
    if (pages <= s->cap_pages)
        return 0;
    uint32_t limit = kvt__pages_for(p, s->max_tokens);
    uint64_t cap = s->cap_pages ? (uint64_t)s->cap_pages * 2u : 16u;
    if (cap < pages)
        cap = pages;
    if (cap > limit)
        cap = limit;
    size_t lh = (size_t)p->g.n_layers * p->g.n_kv_heads;
    uint64_t n;
    if (!kvt__mul_u64(lh, cap, &n) || n > SIZE_MAX / sizeof(uint32_t))
        return kvt__err(KVT_EOVERFLOW, "block table: %zu heads x %llu pages overflow", lh,
                        (unsigned long long)cap);
    uint32_t *dev = calloc((size_t)n, sizeof *dev);
    uint32_t *host = calloc((size_t)n, sizeof *host);
    uint32_t *meta = calloc((size_t)n, sizeof *meta);
    uint8_t *res = calloc((size_t)n, 1);
    float *imp = calloc((size_t)n, sizeof *imp);
    uint32_t *use = calloc((size_t)n, sizeof *use);
    int rc = (dev && host && meta && res && imp && use) ? kvt__disk_seq_reserve(p, s, (uint32_t)cap)
                                                        : KVT_ENOMEM;
    if (rc) {
        free(dev);
        free(host);
        free(meta);
        free(res);
        free(imp);
        free(use);
        if (rc != KVT_ENOMEM)
            return rc;
        return kvt__err(KVT_ENOMEM, "block table: cannot grow to %llu pages per head",
                        (unsigned long long)cap);
    }
    for (size_t i = 0; i < lh && s->cap_pages; i++) {
        size_t from = i * s->cap_pages, to = i * (size_t)cap;
        memcpy(dev + to, s->dev_block + from, s->cap_pages * sizeof *dev);
        memcpy(host + to, s->host_block + from, s->cap_pages * sizeof *host);
        memcpy(meta + to, s->meta_slot + from, s->cap_pages * sizeof *meta);
        memcpy(res + to, s->res + from, s->cap_pages);
        memcpy(imp + to, s->imp + from, s->cap_pages * sizeof *imp);
        memcpy(use + to, s->use + from, s->cap_pages * sizeof *use);
    }
    free(s->dev_block);
    free(s->host_block);
    free(s->meta_slot);
    free(s->res);
    free(s->imp);
    free(s->use);
    s->dev_block = dev;
    s->host_block = host;
    s->meta_slot = meta;
    s->res = res;
    s->imp = imp;
    s->use = use;
    s->cap_pages = (uint32_t)cap;
    return 0;
}

/* Writes the metadata of a page from its f32 accumulators: min rounded
 * toward -inf, max toward +inf (so q.k bounds stay bounds), and the mean
 * (f32 sum / count, a landmark rather than a bound) rounded to nearest. */
static void kvt__meta_store(const kvt_pool *p, uint8_t *m, const float *acc, uint32_t count,
                            float *tmp)
{
    const uint32_t D = p->g.head_dim;
    const size_t row = (size_t)D * p->elem;
    kvt__store_f32(m, p->g.dtype, acc, D, KVT__RD);
    kvt__store_f32(m + row, p->g.dtype, acc + D, D, KVT__RU);
    for (uint32_t d = 0; d < D; d++)
        tmp[d] = acc[2 * D + d] / (float)count;
    kvt__store_f32(m + 2 * row, p->g.dtype, tmp, D, KVT__RN);
}

KVT_API int kvt_seq_append(kvt_pool *pool, kvt_seq_id seq, uint32_t layer, const void *k,
                           const void *v, uint32_t n_tokens, kvt_dtype src_dtype,
                           uint64_t token_stride)
{
    kvt__seq *s;
    KVT__CHECK_NULL(pool);
    int rc = kvt__seq_lookup(pool, seq, &s);
    if (rc)
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
        return kvt__err(KVT_EINVAL, "src_dtype: unknown dtype %u", src_dtype);
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

    const uint32_t cur = s->n_tokens[layer];
    if (n_tokens > s->max_tokens - cur)
        return kvt__err(KVT_ERANGE, "n_tokens: %u more tokens pass the sequence's limit "
                        "(%u of %u used in layer %u)", n_tokens, cur, s->max_tokens, layer);
    const uint32_t end = cur + n_tokens;
    const uint32_t pages_before = kvt__pages_for(pool, cur);
    const uint32_t pages_after = kvt__pages_for(pool, end);
    const uint64_t need = (uint64_t)(pages_after - pages_before) * H;
    kvt__arena *dev = &pool->tier[KVT_TIER_DEVICE];
    if (need > dev->n_free)
        return kvt__err(KVT_ENOSPC, "device tier: %llu blocks needed for layer %u, %u free",
                        (unsigned long long)need, layer, dev->n_free);
    if (need > pool->meta.n_free)
        return kvt__err(KVT_ENOSPC, "metadata store: %llu pages needed, %u free",
                        (unsigned long long)need, pool->meta.n_free);
    rc = kvt__seq_reserve(pool, s, pages_after);
    if (rc)
        return rc;

    if (pool->cu) {
        /* CUDA: the blocks come from the host tables, the bytes are the
         * kernel's (which waits, so k and v may be reused on return). */
        kvt__append_alloc(pool, s, layer, n_tokens);
        rc = kvt__cuda_seq_append(pool, s, layer, k, v, n_tokens, cur, src_dtype, token_stride);
        if (rc) { /* all or nothing: the new pages go back */
            kvt__append_unalloc(pool, s, layer, n_tokens);
            return rc;
        }
        s->n_tokens[layer] = end;
    } else {
        kvt__append_checked(pool, s, layer, k, v, n_tokens, src_dtype, token_stride);
    }
    if (pool->pol) {
        /* Tiered pool: stable heads' full pages go out once, now, and their
         * device copies leave unless forced or selected. A failed copy-out
         * keeps the page on device; the next pass tries again. */
        kvt__place_after_append(pool, s, seq, layer, cur);
        kvt_clear_error();
    }
    return 0;
}

void kvt__append_alloc(kvt_pool *pool, kvt__seq *s, uint32_t layer, uint32_t n_tokens)
{
    const uint32_t H = pool->g.n_kv_heads;
    const uint32_t cur = s->n_tokens[layer];
    const uint32_t pages_before = kvt__pages_for(pool, cur);
    const uint32_t pages_after = kvt__pages_for(pool, cur + n_tokens);
    kvt__arena *dev = &pool->tier[KVT_TIER_DEVICE];
    for (uint32_t h = 0; h < H; h++) {
        size_t base = kvt__lh(pool, layer, h) * s->cap_pages;
        for (uint32_t pg = pages_before; pg < pages_after; pg++) {
            s->dev_block[base + pg] = kvt__arena_alloc(dev);
            s->meta_slot[base + pg] = kvt__arena_alloc(&pool->meta);
            s->host_block[base + pg] = 0;
            s->res[base + pg] = KVT_RES_DEVICE;
            kvt__dirty(pool, s, kvt__lh(pool, layer, h), pg);
        }
    }
    const uint64_t added = pages_after - pages_before;
    s->pages_in_tier[KVT_TIER_DEVICE] += added * H;
    pool->pages_in_tier[KVT_TIER_DEVICE] += added * H;
}

void kvt__append_unalloc(kvt_pool *pool, kvt__seq *s, uint32_t layer, uint32_t n_tokens)
{
    const uint32_t H = pool->g.n_kv_heads;
    const uint32_t cur = s->n_tokens[layer];
    const uint32_t pages_before = kvt__pages_for(pool, cur);
    const uint32_t pages_after = kvt__pages_for(pool, cur + n_tokens);
    for (uint32_t h = 0; h < H; h++) {
        size_t base = kvt__lh(pool, layer, h) * s->cap_pages;
        for (uint32_t pg = pages_before; pg < pages_after; pg++) {
            kvt__arena_free(&pool->tier[KVT_TIER_DEVICE], s->dev_block[base + pg]);
            kvt__arena_free(&pool->meta, s->meta_slot[base + pg]);
            s->dev_block[base + pg] = 0;
            s->meta_slot[base + pg] = 0;
            s->res[base + pg] = 0;
        }
    }
    const uint64_t added = pages_after - pages_before;
    s->pages_in_tier[KVT_TIER_DEVICE] -= added * H;
    pool->pages_in_tier[KVT_TIER_DEVICE] -= added * H;
}

/* Everything is checked and the blocks exist: allocate the new pages, then
 * fill them. Cannot fail. */
void kvt__append_checked(kvt_pool *pool, kvt__seq *s, uint32_t layer, const void *k,
                         const void *v, uint32_t n_tokens, kvt_dtype src_dtype,
                         uint64_t token_stride)
{
    const uint32_t H = pool->g.n_kv_heads, D = pool->g.head_dim, P = pool->g.page_tokens;
    const size_t src_elem = kvt_dtype_size(src_dtype);
    const uint32_t cur = s->n_tokens[layer];
    const uint32_t end = cur + n_tokens;
    kvt__arena *dev = &pool->tier[KVT_TIER_DEVICE];
    kvt__append_alloc(pool, s, layer, n_tokens);

    const size_t row = (size_t)D * pool->elem;
    const bool same = src_dtype == pool->g.dtype;
    float *kf = pool->scratch;                /* one key row in f32 */
    float *tmp = pool->scratch + (size_t)P * D; /* [D] */
    for (uint32_t h = 0; h < H; h++) {
        const size_t lh = kvt__lh(pool, layer, h);
        const size_t base = lh * s->cap_pages;
        float *acc = s->acc + lh * 3u * D; /* min, max, sum of the open page */
        for (uint32_t t = 0; t < n_tokens; t++) {
            const uint32_t pos = cur + t, pg = pos / P, slot = pos % P;
            uint8_t *blk = kvt__arena_block(dev, s->dev_block[base + pg]);
            const size_t off = ((size_t)t * token_stride + (size_t)h * D) * src_elem;
            const uint8_t *ks = (const uint8_t *)k + off;
            const uint8_t *vs = (const uint8_t *)v + off;
            uint8_t *kd = blk + (size_t)slot * row, *vd = blk + (size_t)(P + slot) * row;
            kvt__load_f32(kf, ks, src_dtype, D);
            if (same) {
                memcpy(kd, ks, row);
                memcpy(vd, vs, row);
            } else {
                kvt__store_f32(kd, pool->g.dtype, kf, D, KVT__RN);
                kvt__load_f32(tmp, vs, src_dtype, D);
                kvt__store_f32(vd, pool->g.dtype, tmp, D, KVT__RN);
            }
            if (slot == 0) {
                for (uint32_t d = 0; d < D; d++) {
                    acc[d] = INFINITY;
                    acc[D + d] = -INFINITY;
                    acc[2 * D + d] = 0.0f;
                }
            }
            for (uint32_t d = 0; d < D; d++) {
                float x = kf[d];
                /* A NaN key opens the box to [-inf, +inf] so that it still
                 * contains every stored key (scores become unbounded, never
                 * silently wrong). */
                float lo = x == x ? x : -INFINITY, hi = x == x ? x : INFINITY;
                acc[d] = lo < acc[d] ? lo : acc[d];
                acc[D + d] = hi > acc[D + d] ? hi : acc[D + d];
                acc[2 * D + d] += x;
            }
            if (slot == P - 1 || t == n_tokens - 1)
                kvt__meta_store(pool,
                                kvt__arena_block(&pool->meta, s->meta_slot[base + pg]), acc,
                                slot + 1, tmp);
        }
    }
    s->n_tokens[layer] = end;
}
