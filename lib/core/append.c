/* Paged append, the page store's writing half: K/V rows of one layer go
 * into the last page of each KV head (new pages from the device tier as
 * pages fill), and the per-page key metadata (min, max, mean) follows every
 * append. The public kvt_seq_append is lib/api/append.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "store.h"

/* Writes the metadata of a page from its f32 accumulators: min rounded
 * toward -inf, max toward +inf (so q.k bounds stay bounds), and the mean
 * (f32 sum / count, a landmark rather than a bound) rounded to nearest. */
static void kvt__meta_store(const kvt_pool *p, uint8_t *mm, uint8_t *mean, const float *acc,
                            uint32_t count, float *tmp)
{
    const uint32_t D = p->g.head_dim;
    const size_t row = (size_t)D * p->elem;
    kvt__store_f32(mm, p->g.dtype, acc, D, KVT__RD);
    kvt__store_f32(mm + row, p->g.dtype, acc + D, D, KVT__RU);
    for (uint32_t d = 0; d < D; d++)
        tmp[d] = acc[2 * D + d] / (float)count;
    kvt__store_f32(mean, p->g.dtype, tmp, D, KVT__RN);
}

int kvt__not_in_pool(const kvt_pool *p, const void *ptr, size_t bytes, const char *what)
{
    static const char *const names[KVT_NUM_TIERS] = {"device", "host", "disk"};
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++) {
        const kvt__arena *a = &p->tier[t];
        if (a->base && kvt__overlap(ptr, bytes, a->base, (size_t)a->block_bytes * a->n_blocks))
            return kvt__err(KVT_EINVAL, "%s: lies in the pool's own %s tier, which the append "
                            "writes; pass a copy", what, names[t]);
    }
    const kvt__arena *m = &p->meta;
    if (m->base && kvt__overlap(ptr, bytes, m->base, (size_t)m->block_bytes * m->n_blocks))
        return kvt__err(KVT_EINVAL, "%s: lies in the pool's metadata store", what);
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
            pool->pg_ref[s->meta_slot[base + pg]] = 1;
            pool->pg_hold[s->meta_slot[base + pg]] = (uint32_t)(s - pool->seqs) + 1u;
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
            pool->pg_ref[s->meta_slot[base + pg]] = 0;
            pool->pg_hold[s->meta_slot[base + pg]] = 0;
            s->dev_block[base + pg] = 0;
            s->meta_slot[base + pg] = 0;
            s->res[base + pg] = 0;
        }
    }
    const uint64_t added = pages_after - pages_before;
    s->pages_in_tier[KVT_TIER_DEVICE] -= added * H;
    pool->pages_in_tier[KVT_TIER_DEVICE] -= added * H;
}

/* Folds one key row into a page's accumulators (a NaN key opens the box to
 * [-inf, +inf] so that it still contains every stored key: scores become
 * unbounded, never silently wrong). */
static bool kvt__acc_add(float *acc, const float *kf, uint32_t D)
{
    bool bad = false;
    for (uint32_t d = 0; d < D; d++) {
        const float x = kf[d];
        const float lo = x == x ? x : -INFINITY, hi = x == x ? x : INFINITY;
        acc[d] = lo < acc[d] ? lo : acc[d];
        acc[D + d] = hi > acc[D + d] ? hi : acc[D + d];
        acc[2 * D + d] += x;
        bad |= !isfinite(x);
    }
    return bad; /* the key has a NaN or infinite element */
}

static void kvt__acc_reset(float *acc, uint32_t D)
{
    for (uint32_t d = 0; d < D; d++) {
        acc[d] = INFINITY;
        acc[D + d] = -INFINITY;
        acc[2 * D + d] = 0.0f;
    }
}

bool kvt__page_rebuild(const kvt_pool *p, const uint8_t *krows, uint32_t count, float *acc,
                       uint8_t *mm, uint8_t *mean)
{
    const uint32_t D = p->g.head_dim, P = p->g.page_tokens;
    const size_t row = (size_t)D * p->elem;
    float *kf = p->scratch, *tmp = p->scratch + (size_t)P * D;
    kvt__acc_reset(acc, D);
    bool bad = false;
    for (uint32_t t = 0; t < count; t++) {
        kvt__load_f32(kf, krows + (size_t)t * row, p->g.dtype, D);
        bad |= kvt__acc_add(acc, kf, D);
    }
    kvt__meta_store(p, mm, mean, acc, count, tmp);
    return bad;
}

void kvt__append_pop(kvt_pool *pool, kvt__seq *s, uint32_t layer)
{
    const uint32_t H = pool->g.n_kv_heads, D = pool->g.head_dim, P = pool->g.page_tokens;
    const uint32_t n = s->n_tokens[layer];
    if (n == 0)
        return;
    const uint32_t pos = n - 1, pg = pos / P, slot = pos % P;
    s->n_tokens[layer] = pos;
    if (slot == 0) { /* the token opened its page */
        kvt__append_unalloc(pool, s, layer, 1);
        return;
    }
    for (uint32_t h = 0; h < H; h++) {
        const size_t lh = kvt__lh(pool, layer, h), e = lh * s->cap_pages + pg;
        const uint8_t *blk = kvt__arena_block(&pool->tier[KVT_TIER_DEVICE], s->dev_block[e]);
        const bool bad = kvt__page_rebuild(pool, blk, slot, s->acc + lh * 3u * D,
                                           kvt__meta_mm(pool, s->meta_slot[e]),
                                           kvt__meta_mean(pool, s->meta_slot[e]));
        s->res[e] = (uint8_t)((s->res[e] & ~KVT__RES_NONFINITE) | (bad ? KVT__RES_NONFINITE : 0));
    }
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
                /* The metadata describes the keys as stored, so that it can
                 * be rebuilt from them exactly (kvt_seq_truncate, restore). */
                kvt__load_f32(kf, kd, pool->g.dtype, D);
            }
            if (slot == 0)
                kvt__acc_reset(acc, D);
            if (kvt__acc_add(acc, kf, D))
                s->res[base + pg] |= KVT__RES_NONFINITE;
            if (slot == P - 1 || t == n_tokens - 1)
                kvt__meta_store(pool, kvt__meta_mm(pool, s->meta_slot[base + pg]),
                                kvt__meta_mean(pool, s->meta_slot[base + pg]), acc, slot + 1,
                                tmp);
        }
    }
    s->n_tokens[layer] = end;
}
