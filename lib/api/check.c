/* kvt_pool_check: an independent walk over everything the pool keeps, so
 * that tests can prove the invariants after every operation. */
#include <stdlib.h>
#include <string.h>

#include "../core/store.h"
#include "../backend/backend.h"
#include "../policy/policy_int.h"
#include "../tier/tier.h"

static const char *const names[KVT_NUM_TIERS] = {"device tier", "host tier", "disk tier"};

typedef struct {
    uint8_t *owned; /* per block: 1 = referenced by a page, 2 = on the free list */
} kvt__mark;

static int kvt__mark_init(kvt__mark *m, const kvt__arena *a)
{
    m->owned = calloc(a->n_blocks ? a->n_blocks : 1u, 1);
    return m->owned ? 0 : kvt__err(KVT_ENOMEM, "kvt_pool_check: cannot allocate a bitmap");
}

/* Free ids: the never-used range [bump, n) plus the stack of freed ids,
 * which must lie in 1..bump-1 without duplicates. */
static int kvt__check_free(const kvt__arena *a, kvt__mark *m, const char *name)
{
    if (a->bump < 1 || a->bump > a->n_blocks ||
        a->n_free != a->n_stack + (a->n_blocks - a->bump))
        return kvt__err(KVT_EINTERNAL, "%s: free count %u does not match bump %u and %u "
                        "freed ids (of %u blocks)", name, a->n_free, a->bump, a->n_stack,
                        a->n_blocks);
    for (uint32_t i = 0; i < a->n_stack; i++) {
        uint32_t id = a->stack[i];
        if (id == 0 || id >= a->bump)
            return kvt__err(KVT_EINTERNAL, "%s: free list holds block %u (bump %u)", name, id,
                            a->bump);
        if (m->owned[id])
            return kvt__err(KVT_EINTERNAL, "%s: block %u is on the free list twice", name, id);
        m->owned[id] = 2;
    }
    for (uint32_t id = a->bump; id < a->n_blocks; id++)
        m->owned[id] = 2;
    return 0;
}

static int kvt__claim(const kvt__arena *a, kvt__mark *m, uint32_t id, const char *name,
                      uint32_t si, uint32_t l, uint32_t h, uint32_t pg)
{
    if (id == 0 || id >= a->n_blocks)
        return kvt__err(KVT_EINTERNAL, "%s: seq slot %u layer %u head %u page %u points at "
                        "block %u (of %u)", name, si, l, h, pg, id, a->n_blocks);
    if (m->owned[id] == 2)
        return kvt__err(KVT_EINTERNAL, "%s: block %u of seq slot %u layer %u head %u page %u "
                        "is also on the free list", name, id, si, l, h, pg);
    if (m->owned[id] == 1)
        return kvt__err(KVT_EINTERNAL, "%s: block %u is used by two pages (one is seq slot "
                        "%u layer %u head %u page %u)", name, id, si, l, h, pg);
    m->owned[id] = 1;
    return 0;
}

static int kvt__check_accounted(const kvt__arena *a, const kvt__mark *m, const char *name)
{
    for (uint32_t id = 1; id < a->n_blocks; id++)
        if (!m->owned[id])
            return kvt__err(KVT_EINTERNAL, "%s: block %u is neither free nor used (leaked)",
                            name, id);
    return 0;
}

static int kvt__null_block_zero(const kvt_pool *p, const kvt__arena *a, const char *name)
{
    const uint8_t *b = kvt__arena_block(a, 0);
    uint8_t *copy = NULL;
    if (a->ext) { /* CUDA device memory */
        if (!(copy = malloc(a->block_bytes)))
            return kvt__err(KVT_ENOMEM, "%s: cannot allocate a block buffer", name);
        int rc = p->be->read(p, copy, b, a->block_bytes);
        if (rc) {
            free(copy);
            return rc;
        }
        b = copy;
    }
    for (uint64_t i = 0; i < a->block_bytes; i++)
        if (b[i]) {
            free(copy);
            return kvt__err(KVT_EINTERNAL, "%s: the null block was written (byte %llu)", name,
                            (unsigned long long)i);
        }
    free(copy);
    return 0;
}

/* The holders of page (layer l, head h, page pg) of slot si: each names
 * the same blocks, metadata slot and residency, there are as many as the
 * page's reference count, and a shared page is full in each. *canon: si
 * is the holder of the lowest slot (the one that claims the blocks). */
static int kvt__check_holders(const kvt_pool *p, const kvt__seq *s, uint32_t si, uint32_t l,
                              uint32_t h, uint32_t pg, bool *canon)
{
    const size_t lh = kvt__lh(p, l, h), e = lh * s->cap_pages + pg;
    const uint32_t m = s->meta_slot[e];
    uint32_t n = 0;
    *canon = true;
    for (const kvt__seq *t = s;;) {
        const size_t et = lh * t->cap_pages + pg;
        const uint32_t ti = (uint32_t)(t - p->seqs);
        if (++n > p->max_seqs || !t->live || pg >= t->cap_pages)
            return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: its holders' "
                            "ring is broken at slot %u", si, l, h, pg, ti);
        if (t->meta_slot[et] != m || t->dev_block[et] != s->dev_block[e] ||
            t->host_block[et] != s->host_block[e] || t->res[et] != s->res[e])
            return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: holder slot "
                            "%u sees another page", si, l, h, pg, ti);
        if (n > 1 && (pg + 1u) * p->g.page_tokens > t->n_tokens[l])
            return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: shared with "
                            "slot %u but not full there", si, l, h, pg, ti);
        *canon = *canon && ti >= si;
        const uint32_t v = t->share[et];
        if (!v)
            break;
        if (v > p->max_seqs)
            return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: holder link "
                            "%u out of range", si, l, h, pg, v);
        t = &p->seqs[v - 1u];
        if (t == s)
            break;
    }
    if (n == 1 && s->share[e])
        return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: shared with "
                        "itself only", si, l, h, pg);
    if (p->pg_ref[m] != n)
        return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: reference count "
                        "%u, %u tables hold the page", si, l, h, pg, p->pg_ref[m], n);
    return 0;
}

static int kvt__check_seq(const kvt_pool *p, uint32_t si, kvt__mark *marks, kvt__mark *meta,
                          uint64_t *pages_in_tier, uint64_t *busy_pages)
{
    const kvt__seq *s = &p->seqs[si];
    uint64_t mine[KVT_NUM_TIERS] = {0, 0, 0};
    uint32_t busy = 0;
    int rc;
    for (uint32_t l = 0; l < p->g.n_layers; l++) {
        if (s->n_tokens[l] > s->max_tokens)
            return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u: %u tokens above its limit %u",
                            si, l, s->n_tokens[l], s->max_tokens);
        uint32_t n_pages = kvt__pages_for(p, s->n_tokens[l]);
        if (n_pages > s->cap_pages)
            return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u: %u pages, table holds %u", si,
                            l, n_pages, s->cap_pages);
        for (uint32_t h = 0; h < p->g.n_kv_heads; h++) {
            size_t base = kvt__lh(p, l, h) * s->cap_pages;
            for (uint32_t pg = 0; pg < s->cap_pages; pg++) {
                size_t e = base + pg;
                uint8_t r = s->res[e];
                if (pg >= n_pages) {
                    /* Past the layer's end every entry must still be empty. */
                    if (r || s->dev_block[e] || s->host_block[e] || s->meta_slot[e] ||
                        s->share[e])
                        return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u: entry "
                                        "%u past the last page %u is not empty", si, l, h, pg,
                                        n_pages);
                    continue;
                }
                if ((r & (KVT_RES_DEVICE | KVT_RES_HOST | KVT_RES_DISK)) == 0)
                    return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u is "
                                    "in no tier (data lost)", si, l, h, pg);
                if (r & ~(KVT__RES_TIERS | KVT__RES_BUSY | KVT__RES_INBOUND | KVT__RES_NONFINITE) ||
                    ((r & KVT__RES_INBOUND) && !(r & KVT__RES_BUSY)))
                    return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: "
                                    "unknown residency bits 0x%x", si, l, h, pg, r);
                /* A shared page: every holder's view the same, the ring as
                 * long as the count; its blocks are claimed (and counted in
                 * the pool) once, by the holder of the lowest slot. */
                bool canon = true;
                if ((rc = kvt__check_holders(p, s, si, l, h, pg, &canon)))
                    return rc;
                {
                    const uint32_t hv = p->pg_hold[s->meta_slot[e]];
                    const kvt__seq *hs = hv && hv <= p->max_seqs ? &p->seqs[hv - 1u] : NULL;
                    if (!hs || !hs->live || hs->cap_pages <= pg ||
                        hs->meta_slot[kvt__lh(p, l, h) * hs->cap_pages + pg] != s->meta_slot[e])
                        return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: "
                                        "the page's recorded holder (%u) does not hold it",
                                        si, l, h, pg, hv);
                }
                busy += canon && (r & KVT__RES_BUSY);
                /* Tiered placement: an unstable head keeps every page on
                 * device, a stable head at least its forced pages. */
                if (p->pol && !(r & KVT_RES_DEVICE)) {
                    const size_t lh = kvt__lh(p, l, h);
                    if (!kvt__stable(p, lh))
                        return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: "
                                        "an unstable head's page is off device", si, l, h, pg);
                    if (kvt__forced(pg, n_pages, s->n_tokens[l], p->g.page_tokens,
                                    p->pol->sink[lh], p->pol->local[lh]))
                        return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: "
                                        "a sink, local or last page is off device", si, l, h,
                                        pg);
                }
                for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
                    if (r & (1u << t)) {
                        if (!kvt__has_tier(p, t))
                            return kvt__err(KVT_EINTERNAL, "seq slot %u page %u claims the "
                                            "%s, which the pool does not have", si, pg,
                                            names[t]);
                        mine[t]++;
                        pages_in_tier[t] += canon;
                    }
                if (!canon)
                    continue;
                if (r & KVT_RES_DEVICE) {
                    rc = kvt__claim(&p->tier[KVT_TIER_DEVICE], &marks[KVT_TIER_DEVICE],
                                    s->dev_block[e], names[0], si, l, h, pg);
                    if (rc)
                        return rc;
                } else if (s->dev_block[e] != 0) {
                    return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: "
                                    "off device but its table entry is block %u, not null",
                                    si, l, h, pg, s->dev_block[e]);
                }
                if (r & KVT_RES_HOST) {
                    rc = kvt__claim(&p->tier[KVT_TIER_HOST], &marks[KVT_TIER_HOST],
                                    s->host_block[e], names[1], si, l, h, pg);
                    if (rc)
                        return rc;
                    const kvt__owner *o = &p->host_owner[s->host_block[e]];
                    bool held = false;
                    KVT__HOLDERS((kvt_pool *)p, (kvt__seq *)s, kvt__lh(p, l, h), pg, t)
                        held |= (uint32_t)(t - p->seqs) == o->slot;
                    if (!held || o->lh != kvt__lh(p, l, h) || o->page != pg)
                        return kvt__err(KVT_EINTERNAL, "host tier: block %u of seq slot %u "
                                        "layer %u head %u page %u names another owner",
                                        s->host_block[e], si, l, h, pg);
                } else if (s->host_block[e] != 0) {
                    return kvt__err(KVT_EINTERNAL, "seq slot %u layer %u head %u page %u: "
                                    "not in host but has host block %u", si, l, h, pg,
                                    s->host_block[e]);
                }
                rc = kvt__claim(&p->meta, meta, s->meta_slot[e], "metadata store", si, l, h, pg);
                if (rc)
                    return rc;
            }
        }
    }
    *busy_pages += busy;
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++) {
        if (mine[t] != s->pages_in_tier[t])
            return kvt__err(KVT_EINTERNAL, "seq slot %u: counts %llu pages in the %s, tables "
                            "hold %llu", si, (unsigned long long)s->pages_in_tier[t], names[t],
                            (unsigned long long)mine[t]);
    }
    return 0;
}

/* Blocks reserved by moves in flight belong to no table yet. */
typedef struct {
    const kvt_pool *p;
    kvt__mark *marks;
    int rc;
} kvt__resv_ctx;

static void kvt__resv_mark(void *ctx, uint32_t tier, uint32_t blk)
{
    kvt__resv_ctx *c = ctx;
    if (c->rc)
        return;
    if (tier >= KVT_TIER_DISK || blk == 0 || blk >= c->p->tier[tier].n_blocks ||
        c->marks[tier].owned[blk])
        c->rc = kvt__err(KVT_EINTERNAL, "%s: block %u reserved by a move in flight is also "
                         "free or used", names[tier < KVT_NUM_TIERS ? tier : 0], blk);
    else
        c->marks[tier].owned[blk] = 1;
}

/* Blocks and metadata slots of cached pages no sequence holds. */
typedef struct {
    const kvt_pool *p;
    kvt__mark *marks, *meta;
    int rc;
} kvt__pfx_ctx;

static void kvt__pfx_mark(void *ctx, uint32_t tier, uint32_t blk)
{
    kvt__pfx_ctx *c = ctx;
    if (c->rc)
        return;
    if (tier == KVT_NUM_TIERS)
        c->rc = kvt__claim(&c->p->meta, c->meta, blk, "metadata store (prefix cache)",
                           UINT32_MAX, 0, 0, 0);
    else
        c->rc = kvt__claim(&c->p->tier[tier], &c->marks[tier], blk, names[tier], UINT32_MAX,
                           0, 0, 0);
}

KVT_API int kvt_pool_check(const kvt_pool *pool)
{
    KVT__CHECK_NULL(pool);
    kvt__mark marks[KVT_NUM_TIERS] = {{NULL}, {NULL}, {NULL}}, meta = {NULL};
    uint64_t pages[KVT_NUM_TIERS] = {0, 0, 0};
    int rc = 0;

    for (uint32_t t = 0; t < KVT_TIER_DISK && !rc; t++) /* the disk: kvt__disk_check */
        if (kvt__has_tier(pool, t)) {
            rc = kvt__mark_init(&marks[t], &pool->tier[t]);
            if (!rc)
                rc = kvt__check_free(&pool->tier[t], &marks[t], names[t]);
            if (!rc)
                rc = kvt__null_block_zero(pool, &pool->tier[t], names[t]);
        }
    if (!rc)
        rc = kvt__mark_init(&meta, &pool->meta);
    if (!rc)
        rc = kvt__check_free(&pool->meta, &meta, "metadata store");

    /* Sequence slots: the free stack and the live flags must partition them. */
    uint32_t live = 0;
    uint64_t busy_pages = 0, busy_moves = 0; /* pages marked in flight, moves counted */
    uint8_t *slot_free = rc ? NULL : calloc(pool->max_seqs, 1);
    if (!rc && !slot_free)
        rc = kvt__err(KVT_ENOMEM, "kvt_pool_check: cannot allocate a bitmap");
    for (uint32_t i = 0; !rc && i < pool->n_free_seq; i++) {
        uint32_t si = pool->free_seq[i];
        if (si >= pool->max_seqs || slot_free[si] || pool->seqs[si].live)
            rc = kvt__err(KVT_EINTERNAL, "sequence free list: bad or live slot %u", si);
        else
            slot_free[si] = 1;
    }
    for (uint32_t si = 0; !rc && si < pool->max_seqs; si++) {
        if (!pool->seqs[si].live) {
            if (!slot_free[si])
                rc = kvt__err(KVT_EINTERNAL, "sequence slot %u is neither live nor free", si);
            continue;
        }
        live++;
        rc = kvt__check_seq(pool, si, marks, &meta, pages, &busy_pages);
        busy_moves += pool->seqs[si].tier.busy;
    }
    if (!rc && busy_pages != busy_moves)
        rc = kvt__err(KVT_EINTERNAL, "sequences count %llu moves in flight, tables mark %llu "
                      "pages", (unsigned long long)busy_moves, (unsigned long long)busy_pages);
    if (!rc) { /* the prefix cache's pages no sequence holds */
        kvt__pfx_ctx c = {pool, marks, &meta, 0};
        rc = kvt__pfx_check(pool, kvt__pfx_mark, &c, pages);
        rc = rc ? rc : c.rc;
    }
    if (!rc) {
        kvt__resv_ctx c = {pool, marks, 0};
        kvt__mover_reserved(pool->mover, kvt__resv_mark, &c);
        rc = c.rc;
    }
    /* Host blocks nobody owns must say so. */
    for (uint32_t b = 1; !rc && kvt__has_tier(pool, KVT_TIER_HOST) &&
                         b < pool->tier[KVT_TIER_HOST].n_blocks; b++)
        if (marks[KVT_TIER_HOST].owned[b] != 1 && pool->host_owner[b].slot != UINT32_MAX)
            rc = kvt__err(KVT_EINTERNAL, "host tier: block %u is not a page's but names seq "
                          "slot %u as its owner", b, pool->host_owner[b].slot);
    if (!rc)
        rc = kvt__disk_check(pool);
    if (!rc && live != pool->n_live)
        rc = kvt__err(KVT_EINTERNAL, "pool counts %u live sequences, slots hold %u",
                      pool->n_live, live);
    for (uint32_t t = 0; t < KVT_NUM_TIERS && !rc; t++) {
        if (t != KVT_TIER_DISK && kvt__has_tier(pool, t))
            rc = kvt__check_accounted(&pool->tier[t], &marks[t], names[t]);
        if (!rc && pages[t] != pool->pages_in_tier[t])
            rc = kvt__err(KVT_EINTERNAL, "%s: pool counts %llu pages, sequences hold %llu",
                          names[t], (unsigned long long)pool->pages_in_tier[t],
                          (unsigned long long)pages[t]);
    }
    if (!rc)
        rc = kvt__check_accounted(&pool->meta, &meta, "metadata store");
    if (!rc && pool->be->check) /* the backend's copies of the tables match the host's */
        rc = pool->be->check(pool);

    free(slot_free);
    free(meta.owned);
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
        free(marks[t].owned);
    return rc;
}
