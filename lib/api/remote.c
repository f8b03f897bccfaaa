/* The remote tier's public calls and its part in the pool's lifecycle:
 * opening it with the pool, asking it for a new sequence's prefix past the
 * local match (kvt_seq_create), landing what arrived (kvt_seq_prefix_wait),
 * flushing the write-behind queue. The client is lib/tier/rclient.c; the
 * writes start in lib/tier/prefix.c, where pages are keyed. */
#include <stdlib.h>
#include <string.h>

#include "api_int.h"
#include "../tier/tier.h"

/* Size of the first released kvt_remote_opts. */
#define KVT__REMOTE_OPTS_V1 96u
_Static_assert(sizeof(kvt_remote_opts) == KVT__REMOTE_OPTS_V1, "remote opts v1");
#define KVT__REMOTE_FLAGS (KVT_REMOTE_NO_PUT | KVT_REMOTE_NO_GET)
/* Pages landed per append (the rows of every head, for each layer in turn). */
#define KVT__LAND_PAGES 16u

KVT_API int kvt_remote_opts_init(kvt_remote_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    return 0;
}

int kvt__remote_open(kvt_pool *p, const kvt_pool_opts *o)
{
    if (!o->remote)
        return 0;
    kvt_remote_opts r;
    int rc = kvt__opts_copy(&r, sizeof r, o->remote, KVT__REMOTE_OPTS_V1, "opts->remote");
    if (rc)
        return rc;
    if (!p->pfx)
        return kvt__err(KVT_EINVAL, "opts->remote: the remote tier holds the prefix cache's "
                        "pages; set KVT_POOL_PREFIX_CACHE in opts->flags");
    if (r.flags & ~KVT__REMOTE_FLAGS)
        return kvt__err(KVT_EINVAL, "opts->remote->flags: unknown bits 0x%x",
                        r.flags & ~KVT__REMOTE_FLAGS);
    if (!r.endpoints)
        return kvt__err(KVT_EINVAL, "opts->remote->endpoints: must not be NULL");
    if (!r.fingerprint || !*r.fingerprint)
        return kvt__err(KVT_EINVAL, "opts->remote->fingerprint: must name the model (a "
                        "weights hash or revision): values of other models must never match");
    if (r.n_connections > 64)
        return kvt__err(KVT_EINVAL, "opts->remote->n_connections: %u is above 64",
                        r.n_connections);
    if (r.pipeline > 4096)
        return kvt__err(KVT_EINVAL, "opts->remote->pipeline: %u is above 4096", r.pipeline);
    kvt__rgeom g;
    if ((rc = kvt__rgeom_init(&g, p->g.n_layers, p->g.n_kv_heads, p->g.head_dim,
                              p->g.page_tokens, (uint32_t)p->g.dtype, (uint32_t)p->elem,
                              p->block_bytes, r.fingerprint, r.key_prefix)))
        return rc;
    return kvt__rclient_create(&p->remote, &r, &g);
}

void kvt__remote_close(kvt_pool *p)
{
    if (!p->remote)
        return;
    for (uint32_t i = 0; p->seqs && i < p->max_seqs; i++)
        kvt__remote_cancel(p, &p->seqs[i]);
    kvt__rclient_destroy(p->remote);
    p->remote = NULL;
}

void kvt__remote_cancel(kvt_pool *p, kvt__seq *s)
{
    if (!s->tier.rfetch)
        return;
    kvt__rfetch_account(s->tier.rfetch, 0);
    kvt__rfetch_free(s->tier.rfetch);
    s->tier.rfetch = NULL;
    (void)p;
}

void kvt__remote_fetch(kvt_pool *p, kvt__seq *s)
{
    const struct kvt__seq_pfx *f = &s->pfx;
    if (!p->remote || (kvt__rclient_flags(p->remote) & KVT_REMOTE_NO_GET) || f->dropped)
        return;
    const uint32_t P = p->g.page_tokens, m = f->matched / P, full = f->n_ids / P;
    if (m >= full)
        return;
    const kvt__rgeom *g = kvt__rclient_geom(p->remote);
    kvt__rkey parent = kvt__rkey_seed(g);
    if (m) { /* the last attached page's entry knows its key */
        const kvt__pfx *x = p->pfx;
        if (!kvt__pfx_valid(x, f->ent[m - 1u]))
            return;
        parent = x->e[(uint32_t)f->ent[m - 1u] - 1u].rk;
    }
    kvt__rfetch *rf;
    if (kvt__rfetch_start(p->remote, m, full - m, f->ids + (size_t)m * P, f->salt, parent, &rf))
        return; /* (out of memory: a miss, like any fault) */
    s->tier.rfetch = rf;
}

/* Appends the leading valid values of s's fetch after its local match,
 * KVT__LAND_PAGES pages at a time, each layer in turn; the pages are keyed
 * by the appends (their ids are s's since creation) and not written back.
 * A failed append ends the landing at the last whole chunk. */
static int kvt__remote_land(kvt_pool *p, kvt__seq *s, kvt_seq_id id)
{
    int lost = 0;
    kvt__rfetch *rf = s->tier.rfetch;
    s->tier.rfetch = NULL; /* from here on the sequence is not loading */
    struct kvt__seq_pfx *f = &s->pfx;
    const kvt__rgeom *g = kvt__rclient_geom(p->remote);
    const uint32_t P = p->g.page_tokens, H = p->g.n_kv_heads, L = p->g.n_layers;
    const uint32_t base = f->matched / P, h = kvt__rfetch_hits(rf);
    const size_t row = (size_t)p->g.head_dim * p->elem, chunk = (size_t)KVT__LAND_PAGES * P;
    uint8_t *kb = h ? malloc(chunk * H * row) : NULL, *vb = h ? malloc(chunk * H * row) : NULL;
    kvt__rows_stage stage = {0};
    uint32_t landed = 0;
    int rc = h && (!kb || !vb) ? kvt__err(KVT_ENOMEM, "cannot allocate the landing buffers") : 0;
    f->rhave = base + h;
    for (uint32_t c0 = 0, cnt; c0 < h && !rc; c0 += cnt) {
        cnt = h - c0 < KVT__LAND_PAGES ? h - c0 : KVT__LAND_PAGES;
        /* Room for the chunk in every layer first (as if no page left the
         * device tier), so that no append fails halfway through it; a
         * smaller chunk when the room is short. */
        const uint64_t lh = (uint64_t)L * H;
        kvt__pfx_make_room(p, KVT_TIER_DEVICE, cnt * lh);
        kvt__pfx_make_room(p, KVT_NUM_TIERS, cnt * lh);
        uint64_t room = p->tier[KVT_TIER_DEVICE].n_free;
        room = p->meta.n_free < room ? p->meta.n_free : room;
        cnt = room / lh < cnt ? (uint32_t)(room / lh) : cnt;
        if (!cnt) {
            rc = kvt__err(KVT_ENOSPC, "the device tier or the metadata store has no room for "
                          "a page in every layer and KV head");
            break;
        }
        for (uint32_t l = 0; l < L && !rc; l++) {
            for (uint32_t i = 0; i < cnt; i++) {
                uint8_t *val = (uint8_t *)kvt__rfetch_value(rf, c0 + i);
                for (uint32_t hh = 0; hh < H; hh++) {
                    const uint8_t *blk = kvt__rvalue_block(g, val, (size_t)l * H + hh);
                    for (uint32_t t = 0; t < P; t++) {
                        const size_t at = (((size_t)i * P + t) * H + hh) * row;
                        memcpy(kb + at, blk + (size_t)t * row, row);
                        memcpy(vb + at, blk + (size_t)(P + t) * row, row);
                    }
                }
            }
            rc = kvt__append_host_rows(p, id, l, kb, vb, cnt * P, &stage);
        }
        if (!rc)
            landed += cnt;
    }
    if (rc) {
        kvt__rclient_log(p->remote, "kvtier remote: %u of %u values landed; the rest is a "
                         "miss: %s", landed, h, kvt_last_error());
        /* Layers of the failed chunk that were appended go again; the
         * prompt's ids past the cut stay the sequence's. */
        const uint32_t cut = (base + landed) * P, n_ids = f->n_ids;
        uint32_t *ids = malloc((size_t)n_ids * sizeof *ids);
        if (ids)
            memcpy(ids, f->ids, (size_t)n_ids * sizeof *ids);
        int rt = 0;
        for (uint32_t l = 0; l < L && !rt; l++)
            rt = s->n_tokens[l] != cut;
        if (rt && (rt = kvt_seq_truncate(p, id, cut))) /* (layers of differing lengths) */
            kvt__rclient_log(p->remote, "kvtier remote: the landing could not be undone: %s",
                             kvt_last_error());
        if (!rt && ids && n_ids > cut)
            kvt__pfx_ids_set(p, s, cut, ids + cut, n_ids - cut, "ids");
        free(ids);
        kvt_clear_error();
        lost = rt;
    }
    kvt__rows_stage_fini(p, &stage);
    free(kb);
    free(vb);
    f->rhave = base + landed;
    f->matched = (base + landed) * P;
    f->rtokens = landed * P;
    kvt__pfx *x = p->pfx;
    x->hit_tokens += (uint64_t)landed * P;
    x->miss_tokens -= (uint64_t)landed * P;
    x->hit_pages += (uint64_t)landed * L * H;
    kvt__rfetch_account(rf, landed);
    kvt__rfetch_free(rf);
    return lost ? kvt__err(KVT_ENOSPC, "seq: a failed landing left its layers at different "
                           "lengths (release the sequence)") : 0;
}

KVT_API int kvt_seq_prefix_wait(kvt_pool *pool, kvt_seq_id seq, uint32_t timeout_ms,
                                uint32_t *prefix_tokens)
{
    KVT__CHECK_NULL(pool);
    kvt__seq *s;
    int rc = kvt__seq_lookup(pool, seq, &s);
    if (rc)
        return rc;
    if (s->tier.rfetch) {
        if (kvt__rfetch_wait(s->tier.rfetch, timeout_ms))
            return kvt__err(KVT_EAGAIN, "seq: its remote pages are still on their way after "
                            "%u ms", timeout_ms);
        if ((rc = kvt__remote_land(pool, s, seq)))
            return rc;
    }
    if (prefix_tokens)
        *prefix_tokens = s->pfx.matched;
    return 0;
}

KVT_API int kvt_seq_remote_push(kvt_pool *pool, kvt_seq_id seq, uint32_t *n_values)
{
    KVT__CHECK_NULL(pool);
    if (n_values)
        *n_values = 0;
    kvt__seq *s;
    int rc = kvt__seq_lookup(pool, seq, &s);
    if (rc)
        return rc;
    if (!pool->remote)
        return kvt__err(KVT_ENOTSUP, "pool: has no remote tier (kvt_pool_opts.remote)");
    if ((rc = kvt__seq_edit_ok(pool, s, "kvt_seq_remote_push")))
        return rc;
    const uint32_t n = kvt__pfx_remote_push(pool, s);
    if (n_values)
        *n_values = n;
    return 0;
}

KVT_API int kvt_remote_flush(kvt_pool *pool, uint32_t timeout_ms)
{
    KVT__CHECK_NULL(pool);
    if (!pool->remote)
        return kvt__err(KVT_ENOTSUP, "pool: has no remote tier (kvt_pool_opts.remote)");
    return kvt__rclient_flush(pool->remote, timeout_ms);
}
