/* The public sequence calls: create and release (which wire the page
 * store, the mover and the disk tier), and the read-side accessors. The
 * storage itself (ids, lookup, tables) is lib/core/seq.c. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_int.h"
#include "../backend/backend.h"
#include "../tier/tier.h"

/* Sizes of the first released layouts (0.1): pinned, never sizeof of the
 * current struct, so that appending a field keeps old callers working. */
#define KVT__SEQ_INFO_V1 56u
_Static_assert(offsetof(kvt_seq_opts, user_data) + 8 == KVT__SEQ_OPTS_V1, "seq opts v1");
_Static_assert(offsetof(kvt_seq_info, pages_in_tier) + 8 * KVT_NUM_TIERS == KVT__SEQ_INFO_V1,
               "seq info v1");

KVT_API int kvt_seq_opts_init(kvt_seq_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    return 0;
}

KVT_API int kvt_seq_create(kvt_pool *pool, const kvt_seq_opts *opts, kvt_seq_id *out)
{
    kvt_seq_opts o;
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(out);
    *out = KVT_SEQ_NONE;
    if (opts) {
        int rc = kvt__opts_copy(&o, sizeof o, opts, KVT__SEQ_OPTS_V1, "opts");
        if (rc)
            return rc;
    } else {
        kvt_seq_opts_init(&o);
    }
    uint32_t max_tokens = o.max_tokens ? o.max_tokens : pool->max_seq_tokens;
    if (max_tokens > pool->max_seq_tokens)
        return kvt__err(KVT_EINVAL, "opts->max_tokens: %u is above the pool's max_seq_tokens %u",
                        o.max_tokens, pool->max_seq_tokens);
    if (o.reserved)
        return kvt__err(KVT_EINVAL, "opts->reserved: must be zero (is %u)", o.reserved);
    if (o.n_prefix && !o.prefix)
        return kvt__err(KVT_EINVAL, "opts->prefix: NULL with n_prefix %u", o.n_prefix);
    if (o.n_prefix > max_tokens)
        return kvt__err(KVT_EINVAL, "opts->n_prefix: %u ids are more than the sequence's "
                        "max_tokens %u", o.n_prefix, max_tokens);
    if (pool->n_free_seq == 0)
        return kvt__err(KVT_ENOSPC, "kvt_seq_create: all %u sequence slots are live "
                        "(pool max_seqs)", pool->max_seqs);

    uint32_t slot = pool->free_seq[pool->n_free_seq - 1];
    kvt__seq *s = &pool->seqs[slot];
    size_t lh = (size_t)pool->g.n_layers * pool->g.n_kv_heads;
    s->n_tokens = calloc(pool->g.n_layers, sizeof *s->n_tokens);
    s->acc = malloc(lh * 3u * pool->g.head_dim * sizeof(float));
    s->tier.off_next = calloc(lh, sizeof *s->tier.off_next);
    s->tier.dlo = calloc(lh, sizeof *s->tier.dlo);
    s->tier.dhi = calloc(lh, sizeof *s->tier.dhi);
    s->tier.dstamp = calloc(lh, sizeof *s->tier.dstamp);
    if (!s->n_tokens || !s->acc || !s->tier.off_next || !s->tier.dlo || !s->tier.dhi || !s->tier.dstamp) {
        kvt__seq_fini(s);
        return kvt__err(KVT_ENOMEM, "kvt_seq_create: cannot allocate the sequence state");
    }
    pool->n_free_seq--;
    s->gen++;
    if (s->gen == 0) /* id 0 stays KVT_SEQ_NONE even after 2^32 reuses */
        s->gen = 1;
    s->live = true;
    /* Rerank phase: the one with the fewest live sequences, so that about
     * 1/interval of the live sequences rerank a stable head at any step
     * (exactly balanced for intervals dividing 16), whichever slots they
     * occupy and in whatever order they came and went. */
    uint32_t best = pool->phase_next % KVT__PHASES;
    for (uint32_t j = 1; j < KVT__PHASES; j++) {
        uint32_t c = (pool->phase_next + j) % KVT__PHASES;
        if (pool->phase_live[c] < pool->phase_live[best])
            best = c;
    }
    s->sel.phase = best;
    pool->phase_live[best]++;
    pool->phase_next = best + 1u;
    s->max_tokens = max_tokens;
    s->user_data = o.user_data;
    s->pfx.salt = o.salt;
    pool->n_live++;
    const kvt_seq_id id = kvt__seq_id_make(pool, slot, s->gen);
    if (o.n_prefix) { /* the longest cached prefix, then the rest of its ids */
        uint32_t matched;
        int rc = kvt__pfx_attach(pool, s, id, o.prefix, o.n_prefix, true, &matched);
        if (rc == KVT_ENOSPC) {
            /* A tiered pool cannot bring the attached pages' forced ones in:
             * the request goes on without the cache (as if it had missed). */
            kvt_seq_release(pool, id);
            rc = kvt_seq_create(pool, &(kvt_seq_opts){.struct_size = sizeof(kvt_seq_opts),
                                                      .max_tokens = max_tokens,
                                                      .user_data = o.user_data,
                                                      .salt = o.salt},
                                out);
            if (!rc && (rc = kvt__pfx_attach(pool, &pool->seqs[kvt__seq_id_slot(*out)], *out,
                                             o.prefix, o.n_prefix, false, &matched))) {
                kvt_seq_release(pool, *out);
                *out = KVT_SEQ_NONE;
            }
            return rc;
        }
        if (rc) {
            char why[256]; /* (the message buffer is the one kvt__err writes) */
            snprintf(why, sizeof why, "%s", kvt_last_error());
            kvt_seq_release(pool, id); /* what it attached goes back to the cache */
            return kvt__err(rc, "%s", why);
        }
    }
    kvt__remote_fetch(pool, s); /* the pages past the local match (pools with a remote tier) */
    *out = id;
    return 0;
}

static void kvt__seq_free_pages(kvt_pool *p, kvt__seq *s)
{
    for (uint32_t l = 0; l < p->g.n_layers; l++) {
        uint32_t n_pages = kvt__pages_for(p, s->n_tokens[l]);
        /* Last page first: cached pages join the prefix cache's LRU list
         * deepest first, so a prefix is reclaimed after its extensions. */
        for (uint32_t h = 0; h < p->g.n_kv_heads; h++)
            for (uint32_t pg = n_pages; pg-- > 0;)
                kvt__page_letgo(p, s, kvt__lh(p, l, h), pg);
        s->n_tokens[l] = 0;
    }
    kvt__disk_free_seq(p, s);
    memset(s->pages_in_tier, 0, sizeof s->pages_in_tier);
}

/* A sequence of phase p leaves. If another phase now has two or more live
 * sequences more than p, one of them moves to p (its next stable rerank
 * comes earlier or later once), so departures do not leave the survivors
 * bunched on one phase. O(max_seqs), at release only. */
static void kvt__phase_leave(kvt_pool *pool, uint32_t p)
{
    pool->phase_live[p]--;
    uint32_t q = p;
    for (uint32_t c = 0; c < KVT__PHASES; c++)
        if (pool->phase_live[c] > pool->phase_live[q])
            q = c;
    if (pool->phase_live[q] < pool->phase_live[p] + 2u)
        return;
    for (uint32_t i = 0; i < pool->max_seqs; i++) {
        kvt__seq *o = &pool->seqs[i];
        if (o->live && o->sel.phase == q) {
            o->sel.phase = p;
            pool->phase_live[q]--;
            pool->phase_live[p]++;
            return;
        }
    }
}

KVT_API int kvt_seq_release(kvt_pool *pool, kvt_seq_id seq)
{
    kvt__seq *s;
    KVT__CHECK_NULL(pool);
    int rc = kvt__seq_lookup(pool, seq, &s);
    if (rc)
        return rc;
    /* Moves of its pages may be in flight: let them finish first, so no
     * thread writes into blocks that are about to be reused. */
    kvt__place_settle(pool, s);
    kvt__remote_cancel(pool, s); /* remote pages it still awaits: not any more */
    kvt__seq_free_pages(pool, s);
    kvt__phase_leave(pool, s->sel.phase);
    kvt__seq_fini(s);
    pool->free_seq[pool->n_free_seq++] = kvt__seq_id_slot(seq);
    pool->n_live--;
    return 0;
}

/* Common argument checks of the read-side accessors. */
static int kvt__seq_lh(const kvt_pool *pool, kvt_seq_id seq, uint32_t layer, uint32_t kv_head,
                       kvt__seq **s)
{
    int rc = kvt__seq_lookup(pool, seq, s);
    if (rc)
        return rc;
    if (layer >= pool->g.n_layers)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, pool->g.n_layers);
    if (kv_head >= pool->g.n_kv_heads)
        return kvt__err(KVT_EINVAL, "kv_head: %u >= n_kv_heads %u", kv_head,
                        pool->g.n_kv_heads);
    return 0;
}

KVT_API int kvt_seq_info_get(const kvt_pool *pool, kvt_seq_id seq, kvt_seq_info *info)
{
    kvt__seq *s;
    kvt_seq_info r;
    size_t fill;
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(info);
    int rc = kvt__out_struct(info, sizeof r, KVT__SEQ_INFO_V1, "info", &fill);
    if (rc)
        return rc;
    rc = kvt__seq_lookup(pool, seq, &s);
    if (rc)
        return rc;
    memset(&r, 0, sizeof r);
    r.struct_size = info->struct_size;
    r.max_tokens = s->max_tokens;
    r.user_data = s->user_data;
    r.n_tokens = UINT32_MAX;
    for (uint32_t l = 0; l < pool->g.n_layers; l++) {
        uint32_t n = s->n_tokens[l];
        r.n_tokens = n < r.n_tokens ? n : r.n_tokens;
        r.n_tokens_max = n > r.n_tokens_max ? n : r.n_tokens_max;
        r.pages += (uint64_t)kvt__pages_for(pool, n) * pool->g.n_kv_heads;
    }
    memcpy(r.pages_in_tier, s->pages_in_tier, sizeof r.pages_in_tier);
    r.prefix_tokens = s->pfx.matched;
    r.token_ids = s->pfx.n_ids;
    r.salt = s->pfx.salt;
    r.remote_tokens = s->pfx.rtokens;
    r.remote_loading = s->tier.rfetch != NULL;
    memcpy(info, &r, fill);
    return 0;
}

KVT_API int kvt_seq_length_get(const kvt_pool *pool, kvt_seq_id seq, uint32_t layer,
                               uint32_t *n_tokens)
{
    kvt__seq *s;
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(n_tokens);
    int rc = kvt__seq_lh(pool, seq, layer, 0, &s);
    if (rc)
        return rc;
    *n_tokens = s->n_tokens[layer];
    return 0;
}

KVT_API int kvt_seq_block_table_get(const kvt_pool *pool, kvt_seq_id seq, uint32_t layer,
                                    uint32_t kv_head, uint32_t first_page, uint32_t n_pages,
                                    uint32_t *device_blocks, uint32_t *host_blocks,
                                    uint8_t *residency)
{
    kvt__seq *s;
    KVT__CHECK_NULL(pool);
    int rc = kvt__seq_lh(pool, seq, layer, kv_head, &s);
    if (rc)
        return rc;
    uint32_t have = kvt__pages_for(pool, s->n_tokens[layer]);
    if (first_page > have || n_pages > have - first_page)
        return kvt__err(KVT_ERANGE, "first_page, n_pages: pages %u..%llu asked, layer %u "
                        "has %u", first_page, (unsigned long long)first_page + n_pages,
                        layer, have);
    size_t base = kvt__lh(pool, layer, kv_head) * s->cap_pages + first_page;
    if (device_blocks && n_pages)
        memcpy(device_blocks, s->dev_block + base, n_pages * sizeof *device_blocks);
    if (host_blocks && n_pages)
        memcpy(host_blocks, s->host_block + base, n_pages * sizeof *host_blocks);
    for (uint32_t i = 0; residency && i < n_pages; i++)
        residency[i] = s->res[base + i] & KVT__RES_TIERS; /* never the internal busy bit */
    return 0;
}

KVT_API int kvt_seq_read_kv(const kvt_pool *pool, kvt_seq_id seq, uint32_t layer,
                            uint32_t kv_head, uint32_t first_token, uint32_t n_tokens,
                            void *k_out, void *v_out)
{
    kvt__seq *s;
    KVT__CHECK_NULL(pool);
    int rc = kvt__seq_lh(pool, seq, layer, kv_head, &s);
    if (rc)
        return rc;
    uint32_t have = s->n_tokens[layer];
    if (first_token > have || n_tokens > have - first_token)
        return kvt__err(KVT_ERANGE, "first_token, n_tokens: tokens %u..%llu asked, layer %u "
                        "has %u", first_token, (unsigned long long)first_token + n_tokens,
                        layer, have);
    const uint32_t P = pool->g.page_tokens;
    const size_t row = (size_t)pool->g.head_dim * pool->elem;
    const size_t lh = kvt__lh(pool, layer, kv_head);
    const size_t base = lh * s->cap_pages;
    uint8_t *bounce = NULL;
    uint32_t bounce_page = UINT32_MAX;
    for (uint32_t t = 0; t < n_tokens; t++) {
        const uint32_t pos = first_token + t, pg = pos / P;
        const uint8_t r = s->res[base + pg];
        const uint8_t *blk;
        if ((r & KVT_RES_DEVICE) && !(pool->be_caps & KVT__BE_DEVICE_REMOTE))
            blk = kvt__arena_block(&pool->tier[KVT_TIER_DEVICE], s->dev_block[base + pg]);
        else if (!(r & KVT_RES_DEVICE) && (r & KVT_RES_HOST))
            blk = kvt__arena_block(&pool->tier[KVT_TIER_HOST], s->host_block[base + pg]);
        else { /* GPU memory or only on disk: bring the page over */
            if (!bounce && !(bounce = malloc(pool->block_bytes)))
                return kvt__err(KVT_ENOMEM, "kvt_seq_read_kv: cannot allocate a page buffer");
            if (bounce_page != pg && (rc = kvt__page_read(pool, s, lh, pg, bounce))) {
                free(bounce);
                return rc;
            }
            bounce_page = pg;
            blk = bounce;
        }
        if (k_out)
            memcpy((uint8_t *)k_out + (size_t)t * row, blk + (size_t)(pos % P) * row, row);
        if (v_out)
            memcpy((uint8_t *)v_out + (size_t)t * row, blk + (size_t)(P + pos % P) * row, row);
    }
    free(bounce);
    return 0;
}

KVT_API int kvt_seq_page_meta_get(const kvt_pool *pool, kvt_seq_id seq, uint32_t layer,
                                  uint32_t kv_head, uint32_t page, float *kmin, float *kmax,
                                  float *kmean)
{
    kvt__seq *s;
    KVT__CHECK_NULL(pool);
    int rc = kvt__seq_lh(pool, seq, layer, kv_head, &s);
    if (rc)
        return rc;
    uint32_t have = kvt__pages_for(pool, s->n_tokens[layer]);
    if (page >= have)
        return kvt__err(KVT_ERANGE, "page: %u >= the %u pages of layer %u", page, have, layer);
    const uint32_t D = pool->g.head_dim;
    const size_t row = (size_t)D * pool->elem;
    uint8_t *m = malloc(pool->meta_bytes);
    if (!m)
        return kvt__err(KVT_ENOMEM, "kvt_seq_page_meta_get: cannot allocate a buffer");
    if ((rc = kvt__meta_get(pool, s->meta_slot[kvt__lh(pool, layer, kv_head) * s->cap_pages +
                                                page], m))) {
        free(m);
        return rc;
    }
    if (kmin)
        kvt__load_f32(kmin, m, pool->g.dtype, D);
    if (kmax)
        kvt__load_f32(kmax, m + row, pool->g.dtype, D);
    if (kmean)
        kvt__load_f32(kmean, m + 2 * row, pool->g.dtype, D);
    free(m);
    return 0;
}
