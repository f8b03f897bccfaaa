/* kvt_seq_fork and kvt_seq_truncate: sequences that share pages, and
 * cutting a sequence back. The holders' ring and the reference counts are
 * the page store's (lib/core/share.c); this file frees a page when its
 * last holder lets it go, copies the partially filled last pages a fork
 * or a truncation must own, and keeps the per-sequence state (selection,
 * offload progress, disk extents) consistent with the new lengths. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_int.h"
#include "../backend/backend.h"
#include "../step/step.h"
#include "../tier/tier.h"

int kvt__seq_edit_ok(const kvt_pool *p, const kvt__seq *s, const char *what)
{
    int rc = kvt__seq_loading_err(s, what);
    if (rc)
        return rc;
    if (kvt__step_has_seq(p->step, s))
        return kvt__err(KVT_ESTATE, "%s: the open step includes the sequence; call it before "
                        "kvt_step_plan or after kvt_step_finish", what);
    return 0;
}

/* Copies n bytes of host memory into pool memory at dst (the device tier or
 * the metadata store: backend memory on a remote backend). */
static int kvt__pool_write(const kvt_pool *p, void *dst, const void *src, size_t n)
{
    if (p->be_caps & KVT__BE_DEVICE_REMOTE)
        return p->be->write(p, dst, src, n);
    memcpy(dst, src, n);
    return 0;
}

int kvt__meta_get(const kvt_pool *p, uint32_t m, uint8_t *rec)
{
    const size_t row = kvt__meta_row(p);
    if (!(p->be_caps & KVT__BE_DEVICE_REMOTE)) {
        memcpy(rec, kvt__meta_mm(p, m), 2 * row);
        memcpy(rec + 2 * row, kvt__meta_mean(p, m), row);
        return 0;
    }
    int rc = p->be->read(p, rec, kvt__meta_mm(p, m), 2 * row);
    return rc ? rc : p->be->read(p, rec + 2 * row, kvt__meta_mean(p, m), row);
}

int kvt__meta_put(const kvt_pool *p, uint32_t m, const uint8_t *rec)
{
    const size_t row = kvt__meta_row(p);
    int rc = kvt__pool_write(p, kvt__meta_mm(p, m), rec, 2 * row);
    return rc ? rc : kvt__pool_write(p, kvt__meta_mean(p, m), rec + 2 * row, row);
}

void kvt__page_letgo(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page)
{
    const size_t e = lh * s->cap_pages + page;
    if (!s->meta_slot[e])
        return; /* an empty entry: nothing to let go */
    if (!kvt__page_unshare(p, s, lh, page))
        return; /* other sequences hold it: s's view is cleared */
    if (kvt__pfx_indexed(p, s->meta_slot[e])) {
        kvt__pfx_detach(p, s, lh, page); /* cached: it outlives its last holder */
        return;
    }
    const uint8_t r = s->res[e];
    if (r & KVT_RES_DEVICE)
        kvt__arena_free(&p->tier[KVT_TIER_DEVICE], s->dev_block[e]);
    if (r & KVT_RES_HOST) {
        p->host_owner[s->host_block[e]].slot = UINT32_MAX;
        kvt__arena_free(&p->tier[KVT_TIER_HOST], s->host_block[e]);
    }
    kvt__disk_page_free(p, s->meta_slot[e]);
    p->pg_ref[s->meta_slot[e]] = 0;
    p->pg_hold[s->meta_slot[e]] = 0;
    kvt__arena_free(&p->meta, s->meta_slot[e]);
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
        if (r & (1u << t)) {
            p->pages_in_tier[t]--;
            s->pages_in_tier[t]--;
        }
    s->dev_block[e] = 0;
    s->host_block[e] = 0;
    s->meta_slot[e] = 0;
    s->res[e] = 0;
}

/* A fresh private copy of page (lh, page) in the device tier: a new device
 * block (and, when `new_meta`, a new metadata slot holding the old one's
 * bytes) with the page's rows. The view still names the old page; the
 * caller installs the copy. Blocks were counted free by the caller. */
static int kvt__page_copy(kvt_pool *p, const kvt__seq *s, size_t lh, uint32_t page,
                          uint32_t *blk, uint32_t *meta, bool new_meta)
{
    const size_t e = lh * s->cap_pages + page;
    /* Through host memory: the page may come from any tier, and on a remote
     * backend go into its memory. */
    uint8_t *buf = malloc(p->block_bytes + p->meta_bytes);
    if (!buf)
        return kvt__err(KVT_ENOMEM, "cannot allocate a page buffer");
    *blk = kvt__arena_alloc(&p->tier[KVT_TIER_DEVICE]);
    *meta = new_meta ? kvt__arena_alloc(&p->meta) : s->meta_slot[e];
    if (!*blk || !*meta) { /* counted free by the caller: cannot happen */
        if (*blk)
            kvt__arena_free(&p->tier[KVT_TIER_DEVICE], *blk);
        if (new_meta && *meta)
            kvt__arena_free(&p->meta, *meta);
        *blk = 0;
        free(buf);
        return kvt__err(KVT_ENOSPC, "no device block or metadata slot left for a page copy");
    }
    int rc = kvt__page_read(p, s, lh, page, buf);
    if (!rc)
        rc = kvt__pool_write(p, kvt__arena_block(&p->tier[KVT_TIER_DEVICE], *blk), buf,
                             p->block_bytes);
    if (!rc && new_meta)
        rc = kvt__meta_get(p, s->meta_slot[e], buf + p->block_bytes);
    if (!rc && new_meta)
        rc = kvt__meta_put(p, *meta, buf + p->block_bytes);
    free(buf);
    if (rc) {
        kvt__arena_free(&p->tier[KVT_TIER_DEVICE], *blk);
        if (new_meta)
            kvt__arena_free(&p->meta, *meta);
        *blk = 0;
    }
    return rc;
}

KVT_API int kvt_seq_fork(kvt_pool *pool, kvt_seq_id src, const kvt_seq_opts *opts,
                         kvt_seq_id *out)
{
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(out);
    *out = KVT_SEQ_NONE;
    kvt__seq *s;
    int rc = kvt__seq_lookup(pool, src, &s);
    if (rc)
        return rc;
    if ((rc = kvt__seq_edit_ok(pool, s, "kvt_seq_fork")))
        return rc;
    kvt_seq_opts o;
    if (opts) {
        if ((rc = kvt__opts_copy(&o, sizeof o, opts, KVT__SEQ_OPTS_V1, "opts")))
            return rc;
    } else {
        kvt_seq_opts_init(&o);
    }
    const uint32_t L = pool->g.n_layers, H = pool->g.n_kv_heads, D = pool->g.head_dim;
    const uint32_t P = pool->g.page_tokens;
    uint32_t longest = 0, partial = 0;
    for (uint32_t l = 0; l < L; l++) {
        longest = s->n_tokens[l] > longest ? s->n_tokens[l] : longest;
        partial += (s->n_tokens[l] % P) != 0;
    }
    if (!o.max_tokens)
        o.max_tokens = s->max_tokens;
    if (o.prefix || o.n_prefix)
        return kvt__err(KVT_EINVAL, "opts->prefix: a fork starts with its parent's tokens "
                        "(set prefix NULL and n_prefix 0)");
    if (!o.salt) /* 0 (NULL opts, an older layout): the parent's */
        o.salt = s->pfx.salt;
    if (o.salt != s->pfx.salt)
        return kvt__err(KVT_EINVAL, "opts->salt: 0x%llx, but the sequence forked has salt "
                        "0x%llx (a fork shares its parent's keyed pages; 0 = the parent's)",
                        (unsigned long long)o.salt, (unsigned long long)s->pfx.salt);
    if (o.max_tokens < longest)
        return kvt__err(KVT_EINVAL, "opts->max_tokens: %u is below the %u tokens of the "
                        "sequence forked", o.max_tokens, longest);
    /* Room for the copied last pages, before anything changes. */
    const uint64_t need = (uint64_t)partial * H;
    kvt__pfx_make_room(pool, KVT_TIER_DEVICE, need);
    kvt__pfx_make_room(pool, KVT_NUM_TIERS, need);
    if (pool->tier[KVT_TIER_DEVICE].n_free < need || pool->meta.n_free < need)
        return kvt__err(KVT_ENOSPC, "kvt_seq_fork: the copied last pages need %llu device "
                        "blocks and metadata slots; %u and %u are free",
                        (unsigned long long)need, pool->tier[KVT_TIER_DEVICE].n_free,
                        pool->meta.n_free);
    /* The open pages' copies first (they may fail on a remote backend),
     * kept in cp[lh] = (block, metadata slot); then the sharing, which
     * cannot fail. */
    uint32_t *cp = calloc((size_t)L * H * 2u, sizeof *cp);
    if (!cp)
        return kvt__err(KVT_ENOMEM, "kvt_seq_fork: cannot allocate %u entries", L * H);
    for (uint32_t l = 0; l < L && !rc; l++)
        for (uint32_t h = 0; h < H && !rc && s->n_tokens[l] % P; h++) {
            const size_t lh = kvt__lh(pool, l, h);
            rc = kvt__page_copy(pool, s, lh, s->n_tokens[l] / P, &cp[2 * lh], &cp[2 * lh + 1],
                                true);
        }
    kvt_seq_id id = KVT_SEQ_NONE;
    kvt__seq *c = NULL;
    if (!rc && !(rc = kvt_seq_create(pool, &o, &id))) {
        c = &pool->seqs[kvt__seq_id_slot(id)];
        if ((rc = kvt__seq_reserve(pool, c, kvt__pages_for(pool, longest))) ||
            (s->sel.topk && (rc = kvt__seq_topk_reserve(pool, c, s->sel.topk_cap))))
            kvt_seq_release(pool, id); /* nothing of it yet */
    }
    if (rc) {
        for (size_t b = 0; b < (size_t)L * H; b++)
            if (cp[2 * b]) {
                kvt__arena_free(&pool->tier[KVT_TIER_DEVICE], cp[2 * b]);
                kvt__arena_free(&pool->meta, cp[2 * b + 1]);
            }
        free(cp);
        return rc;
    }
    for (uint32_t l = 0; l < L; l++) {
        const uint32_t n = s->n_tokens[l], full = n / P;
        for (uint32_t h = 0; h < H; h++) {
            const size_t lh = kvt__lh(pool, l, h);
            for (uint32_t pg = 0; pg < full; pg++) {
                kvt__page_share(pool, s, c, lh, pg);
                c->tier.imp[lh * c->cap_pages + pg] = s->tier.imp[lh * s->cap_pages + pg];
                c->tier.use[lh * c->cap_pages + pg] = s->tier.use[lh * s->cap_pages + pg];
            }
            if (n % P) { /* the open page: the private copy */
                const size_t e = lh * c->cap_pages + full;
                c->dev_block[e] = cp[2 * lh];
                c->meta_slot[e] = cp[2 * lh + 1];
                c->res[e] = (uint8_t)(KVT_RES_DEVICE |
                                      (s->res[lh * s->cap_pages + full] & KVT__RES_NONFINITE));
                pool->pg_ref[c->meta_slot[e]] = 1;
                pool->pg_hold[c->meta_slot[e]] = (uint32_t)(c - pool->seqs) + 1u;
                c->pages_in_tier[KVT_TIER_DEVICE]++;
                pool->pages_in_tier[KVT_TIER_DEVICE]++;
                kvt__dirty(pool, c, lh, full);
            }
            c->tier.off_next[lh] = s->tier.off_next[lh] < full ? s->tier.off_next[lh] : full;
        }
        c->n_tokens[l] = n;
    }
    free(cp);
    memcpy(c->acc, s->acc, (size_t)L * H * 3u * D * sizeof *c->acc);
    if (s->sel.topk) { /* the parent's selection: the child's first step need not rerank */
        for (size_t b = 0; b < (size_t)L * H; b++)
            memcpy(c->sel.topk + b * c->sel.topk_cap, s->sel.topk + b * s->sel.topk_cap,
                   s->sel.topk_n[b] * sizeof *c->sel.topk);
        memcpy(c->sel.topk_n, s->sel.topk_n, (size_t)L * H * sizeof *c->sel.topk_n);
        memcpy(c->sel.topk_k, s->sel.topk_k, (size_t)L * H * sizeof *c->sel.topk_k);
        memcpy(c->sel.qref, s->sel.qref, (size_t)L * H * D * sizeof *c->sel.qref);
    }
    c->sel.steps = s->sel.steps;
    if ((rc = kvt__pfx_seq_fork(pool, s, c)) ||
        (pool->be->seq_fork && (rc = pool->be->seq_fork(pool, s, c)))) {
        kvt_seq_release(pool, id);
        return rc;
    }
    *out = id;
    return 0;
}

/* Whether the kept selection of (s, lh) names a page at or past np. */
static bool kvt__topk_past(const kvt__seq *s, size_t lh, uint32_t np)
{
    if (!s->sel.topk || !s->sel.topk_k[lh])
        return false;
    const uint32_t *k = s->sel.topk + lh * s->sel.topk_cap;
    for (uint32_t i = 0; i < s->sel.topk_n[lh]; i++)
        if (k[i] >= np)
            return true;
    return false;
}

KVT_API int kvt_seq_truncate(kvt_pool *pool, kvt_seq_id seq, uint32_t n_tokens)
{
    KVT__CHECK_NULL(pool);
    kvt__seq *s;
    int rc = kvt__seq_lookup(pool, seq, &s);
    if (rc)
        return rc;
    if ((rc = kvt__seq_edit_ok(pool, s, "kvt_seq_truncate")))
        return rc;
    const uint32_t L = pool->g.n_layers, H = pool->g.n_kv_heads, D = pool->g.head_dim;
    const uint32_t P = pool->g.page_tokens, q = n_tokens / P, rows = n_tokens % P;
    for (uint32_t l = 0; l < L; l++)
        if (n_tokens > s->n_tokens[l])
            return kvt__err(KVT_ERANGE, "n_tokens: %u is past the %u tokens of layer %u",
                            n_tokens, s->n_tokens[l], l);
    /* No move of its pages in flight: the pages it lets go and the kept
     * last page stay still. */
    kvt__place_settle(pool, s);
    uint64_t need_dev = 0, need_meta = 0;
    for (uint32_t l = 0; l < L && rows; l++) {
        if (s->n_tokens[l] == n_tokens)
            continue;
        for (uint32_t h = 0; h < H; h++) {
            const size_t lh = kvt__lh(pool, l, h), e = lh * s->cap_pages + q;
            kvt__mover_drain_page(pool->mover, s, e);
            const bool shared = kvt__page_shared(s, e) || kvt__pfx_indexed(pool, s->meta_slot[e]);
            need_dev += shared || !(s->res[e] & KVT_RES_DEVICE);
            need_meta += shared;
        }
    }
    /* Tiered pools: the pages the cut makes local come back to the device. */
    uint64_t need_local = 0;
    kvt__place_forced_in(pool, s, seq, n_tokens, &need_local);
    kvt__pfx_make_room(pool, KVT_TIER_DEVICE, need_dev + need_local);
    kvt__pfx_make_room(pool, KVT_NUM_TIERS, need_meta);
    if (pool->tier[KVT_TIER_DEVICE].n_free < need_dev + need_local ||
        pool->meta.n_free < need_meta)
        return kvt__err(KVT_ENOSPC, "kvt_seq_truncate: the kept last pages need %llu device "
                        "blocks and %llu metadata slots, the pages that become local %llu "
                        "device blocks; %u and %u are free", (unsigned long long)need_dev,
                        (unsigned long long)need_meta, (unsigned long long)need_local,
                        pool->tier[KVT_TIER_DEVICE].n_free, pool->meta.n_free);
    if (need_local && (rc = kvt__place_forced_in(pool, s, seq, n_tokens, NULL)))
        return rc; /* (copies to the device only: the sequence is as it was) */
    /* The copies first, so that a failed read changes nothing. */
    uint32_t *cp = need_dev ? calloc((size_t)L * H * 2u, sizeof *cp) : NULL;
    if (need_dev && !cp)
        return kvt__err(KVT_ENOMEM, "kvt_seq_truncate: cannot allocate %u entries", L * H);
    for (uint32_t l = 0; l < L && need_dev; l++) {
        if (s->n_tokens[l] == n_tokens)
            continue;
        for (uint32_t h = 0; h < H && !rc; h++) {
            const size_t lh = kvt__lh(pool, l, h), e = lh * s->cap_pages + q;
            const bool shared = kvt__page_shared(s, e) || kvt__pfx_indexed(pool, s->meta_slot[e]);
            if (shared || !(s->res[e] & KVT_RES_DEVICE))
                rc = kvt__page_copy(pool, s, lh, q, &cp[2 * lh], &cp[2 * lh + 1], shared);
        }
        if (rc) {
            for (size_t b = 0; b < (size_t)L * H; b++) {
                if (cp[2 * b])
                    kvt__arena_free(&pool->tier[KVT_TIER_DEVICE], cp[2 * b]);
                const size_t e = b * s->cap_pages + q;
                if (cp[2 * b] && cp[2 * b + 1] != s->meta_slot[e])
                    kvt__arena_free(&pool->meta, cp[2 * b + 1]);
            }
            free(cp);
            return rc;
        }
    }
    const uint32_t np = kvt__pages_for(pool, n_tokens);
    for (uint32_t l = 0; l < L; l++) {
        const uint32_t cur = s->n_tokens[l];
        if (cur == n_tokens)
            continue;
        for (uint32_t h = 0; h < H; h++) {
            const size_t lh = kvt__lh(pool, l, h), e = lh * s->cap_pages + q;
            /* Last page first: cached pages join the prefix cache's LRU
             * list deepest first (as a release's). */
            for (uint32_t pg = kvt__pages_for(pool, cur); pg-- > np;) {
                kvt__page_letgo(pool, s, lh, pg);
                s->tier.imp[lh * s->cap_pages + pg] = 0;
                s->tier.use[lh * s->cap_pages + pg] = 0;
            }
            if (rows) { /* the kept last page is open again: private, on the device */
                if (cp && cp[2 * lh]) {
                    const uint32_t blk = cp[2 * lh], meta = cp[2 * lh + 1];
                    if (meta != s->meta_slot[e]) { /* shared or indexed: a new page */
                        const uint8_t nf = s->res[e] & KVT__RES_NONFINITE;
                        kvt__page_letgo(pool, s, lh, q); /* (an indexed page stays cached) */
                        s->meta_slot[e] = meta;
                        s->res[e] = nf;
                        pool->pg_ref[meta] = 1;
                        pool->pg_hold[meta] = (uint32_t)(s - pool->seqs) + 1u;
                    }
                    s->dev_block[e] = blk;
                    s->res[e] |= KVT_RES_DEVICE;
                    s->pages_in_tier[KVT_TIER_DEVICE]++;
                    pool->pages_in_tier[KVT_TIER_DEVICE]++;
                }
                /* Its copies elsewhere would go stale with the next append
                 * (the page is private now: the drops touch s alone). */
                kvt__page_drop(pool, s, e, KVT_TIER_HOST);
                kvt__page_drop(pool, s, e, KVT_TIER_DISK);
                kvt__disk_page_free(pool, s->meta_slot[e]);
                kvt__dirty(pool, s, lh, q);
                /* The metadata, exactly as appending the kept rows made it. */
                if (pool->be->page_rebuild) {
                    /* A GPU fault here is reported once the cut is done
                     * (the page's old metadata, that of all its rows, still
                     * bounds the kept ones; the accumulators may not). */
                    const int r2 = pool->be->page_rebuild(pool, s, lh, q, rows);
                    rc = rc ? rc : r2;
                } else {
                    const bool bad = kvt__page_rebuild(
                        pool, kvt__arena_block(&pool->tier[KVT_TIER_DEVICE], s->dev_block[e]),
                        rows, s->acc + lh * 3u * D, kvt__meta_mm(pool, s->meta_slot[e]),
                        kvt__meta_mean(pool, s->meta_slot[e]));
                    s->res[e] = (uint8_t)((s->res[e] & ~KVT__RES_NONFINITE) |
                                          (bad ? KVT__RES_NONFINITE : 0));
                }
            }
            if (kvt__topk_past(s, lh, np))
                s->sel.topk_k[lh] = 0; /* it named a dropped page: rerank */
            if (s->tier.off_next[lh] > q)
                s->tier.off_next[lh] = q;
            kvt__disk_trim_seq(pool, s, lh, np);
        }
        s->n_tokens[l] = n_tokens;
    }
    free(cp);
    kvt__pfx_seq_cut(pool, s, n_tokens);
    if (rc) {
        char why[256]; /* (the message buffer is the one kvt__err writes) */
        snprintf(why, sizeof why, "%s", kvt_last_error());
        return kvt__err(rc, "kvt_seq_truncate: cut to %u tokens, but a kept page's metadata "
                        "could not be rebuilt (%s): release the sequence", n_tokens, why);
    }
    return 0;
}
