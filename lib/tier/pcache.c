/* The prefix cache's pages that no sequence holds: detached from their last
 * holder, adopted by a sequence that attaches them, kept in LRU order of
 * entries, reclaimed tier by tier under pressure or a cap (a device copy
 * first when another tier holds the page, else spilled to the host tier; a
 * host copy next, spilled to the disk tier; then the page), and dropped by
 * salt or all at once. The index itself is prefix.c. */
#include <stdio.h>
#include <string.h>

#include "tier.h"

void kvt__pfx_lru_unlink(kvt__pfx *x, uint32_t i)
{
    kvt__pent *e = &x->e[i];
    if (!e->in_lru)
        return;
    if (e->lru_prev)
        x->e[e->lru_prev - 1u].lru_next = e->lru_next;
    else
        x->lru_head = e->lru_next;
    if (e->lru_next)
        x->e[e->lru_next - 1u].lru_prev = e->lru_prev;
    else
        x->lru_tail = e->lru_prev;
    e->lru_prev = e->lru_next = 0;
    e->in_lru = 0;
}

void kvt__pfx_lru_push(kvt__pfx *x, uint32_t i)
{
    kvt__pfx_lru_unlink(x, i);
    kvt__pent *e = &x->e[i];
    e->lru_prev = 0;
    e->lru_next = x->lru_head;
    if (x->lru_head)
        x->e[x->lru_head - 1u].lru_prev = i + 1u;
    else
        x->lru_tail = i + 1u;
    x->lru_head = i + 1u;
    e->in_lru = 1;
}

/* Drops the copy in tier t of unheld page k (entry k / LH, head k % LH). */
static void kvt__pfx_drop_copy(kvt_pool *p, uint32_t k, uint32_t t)
{
    kvt__pfx *x = p->pfx;
    if (t == KVT_TIER_DEVICE) {
        kvt__arena_free(&p->tier[KVT_TIER_DEVICE], x->dev[k]);
        x->dev[k] = 0;
    } else if (t == KVT_TIER_HOST) {
        p->host_owner[x->host[k]].slot = UINT32_MAX;
        kvt__arena_free(&p->tier[KVT_TIER_HOST], x->host[k]);
        x->host[k] = 0;
    } else {
        kvt__disk_page_free(p, x->meta[k]);
    }
    x->res[k] &= (uint8_t)~(1u << t);
    p->pages_in_tier[t]--;
    x->cached[t]--;
    x->e[k / x->LH].cnt[t]--;
}

static void kvt__pfx_gain_copy(kvt_pool *p, uint32_t k, uint32_t t)
{
    kvt__pfx *x = p->pfx;
    x->res[k] |= (uint8_t)(1u << t);
    p->pages_in_tier[t]++;
    x->cached[t]++;
    x->e[k / x->LH].cnt[t]++;
}

uint64_t kvt__pfx_entry_free(kvt_pool *p, uint32_t i)
{
    kvt__pfx *x = p->pfx;
    kvt__pent *e = &x->e[i];
    uint64_t freed = 0;
    for (uint32_t lh = 0; lh < x->LH; lh++) {
        const uint32_t k = i * x->LH + lh, m = x->meta[k];
        x->pg_key[m] = 0;
        if (p->pg_hold[m])
            continue; /* the holders keep it, unindexed */
        for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
            if (x->res[k] & (1u << t))
                kvt__pfx_drop_copy(p, k, t);
        kvt__disk_page_free(p, m); /* (a slot kept without a disk copy) */
        x->res[k] = 0;
        p->pg_ref[m] = 0;
        kvt__arena_free(&p->meta, m);
        freed++;
    }
    for (uint32_t *v = &x->bucket[e->key & x->mask]; *v; v = &x->e[*v - 1u].next)
        if (*v == i + 1u) {
            *v = e->next;
            break;
        }
    kvt__pfx_lru_unlink(x, i);
    x->keyed -= x->LH;
    x->epoch++; /* sequences naming it recheck (and key their own pages) */
    e->live = 0;
    e->gen++;
    e->n_held = 0;
    e->next = x->free_head;
    x->free_head = i + 1u;
    return freed;
}

uint32_t kvt__pfx_entry_new(kvt_pool *p)
{
    kvt__pfx *x = p->pfx;
    if (!x->free_head && x->lru_tail)
        x->reclaimed += kvt__pfx_entry_free(p, x->lru_tail - 1u);
    if (!x->free_head)
        return UINT32_MAX;
    const uint32_t i = x->free_head - 1u;
    x->free_head = x->e[i].next;
    x->e[i].next = 0;
    memset(x->e[i].cnt, 0, sizeof x->e[i].cnt);
    return i;
}

void kvt__pfx_adopt(kvt_pool *p, kvt__seq *s, uint32_t i, size_t lh, uint32_t page)
{
    kvt__pfx *x = p->pfx;
    const uint32_t k = i * x->LH + (uint32_t)lh, m = x->meta[k];
    if (p->pg_hold[m]) { /* held: s joins its holders */
        kvt__page_share(p, &p->seqs[p->pg_hold[m] - 1u], s, lh, page);
        return;
    }
    kvt__pent *e = &x->e[i];
    kvt__pfx_lru_unlink(x, i);
    e->n_held++;
    const size_t ev = lh * s->cap_pages + page;
    s->dev_block[ev] = x->dev[k];
    s->host_block[ev] = x->host[k];
    s->meta_slot[ev] = m;
    s->res[ev] = x->res[k];
    s->share[ev] = 0;
    p->pg_ref[m] = 1;
    p->pg_hold[m] = (uint32_t)(s - p->seqs) + 1u;
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
        if (x->res[k] & (1u << t)) {
            s->pages_in_tier[t]++;
            x->cached[t]--;
            e->cnt[t]--;
        }
    if (x->res[k] & KVT_RES_HOST) {
        p->host_owner[x->host[k]] = (kvt__owner){(uint32_t)(s - p->seqs), (uint32_t)lh, page};
        kvt__host_file(p, s, ev); /* a sequence's page again: the host cache may drop it */
    }
    x->dev[k] = x->host[k] = 0;
    x->res[k] = 0;
    kvt__dirty(p, s, lh, page);
}

static bool kvt__pfx_reclaim(kvt_pool *p, uint32_t t);

/* Keeps every tier's copies of unheld pages within its cap. */
static void kvt__pfx_caps(kvt_pool *p)
{
    kvt__pfx *x = p->pfx;
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
        while (x->cached[t] > x->cap[t] && kvt__pfx_reclaim(p, t)) {
        }
}

void kvt__pfx_detach(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page)
{
    kvt__pfx *x = p->pfx;
    const size_t ev = lh * s->cap_pages + page;
    const uint32_t m = s->meta_slot[ev], k = x->pg_key[m] - 1u, i = k / x->LH;
    kvt__pent *e = &x->e[i];
    const uint8_t r = s->res[ev];
    x->dev[k] = (r & KVT_RES_DEVICE) ? s->dev_block[ev] : 0;
    x->host[k] = (r & KVT_RES_HOST) ? s->host_block[ev] : 0;
    x->res[k] = r & (KVT__RES_TIERS | KVT__RES_NONFINITE);
    if (r & KVT_RES_HOST)
        p->host_owner[x->host[k]] = (kvt__owner){KVT__OWNER_PFX, k, 0};
    if (!(r & KVT_RES_DISK)) /* a slot a failed or dropping move left: not a copy */
        kvt__disk_page_free(p, m);
    p->pg_ref[m] = 0;
    p->pg_hold[m] = 0;
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
        if (r & (1u << t)) {
            s->pages_in_tier[t]--;
            x->cached[t]++;
            e->cnt[t]++;
        }
    s->dev_block[ev] = s->host_block[ev] = s->meta_slot[ev] = 0;
    s->res[ev] = 0;
    if (--e->n_held == 0) {
        kvt__pfx_lru_push(x, i);
        kvt__pfx_caps(p);
    }
}

/* Copies unheld page k's device copy into a new host block. */
static int kvt__pfx_spill_host(kvt_pool *p, uint32_t k)
{
    kvt__pfx *x = p->pfx;
    const uint32_t blk = kvt__arena_alloc(&p->tier[KVT_TIER_HOST]);
    if (!blk)
        return KVT_ENOSPC;
    void *dst = kvt__arena_block(&p->tier[KVT_TIER_HOST], blk);
    const void *src = kvt__arena_block(&p->tier[KVT_TIER_DEVICE], x->dev[k]);
    int rc = 0;
    if (p->be_caps & KVT__BE_DEVICE_REMOTE)
        rc = p->be->read(p, dst, src, p->block_bytes);
    else
        memcpy(dst, src, p->block_bytes);
    if (rc) {
        kvt__arena_free(&p->tier[KVT_TIER_HOST], blk);
        return rc;
    }
    x->host[k] = blk;
    p->host_owner[blk] = (kvt__owner){KVT__OWNER_PFX, k, 0};
    kvt__pfx_gain_copy(p, k, KVT_TIER_HOST);
    return 0;
}

/* Writes unheld page k's host copy to a disk slot. */
static int kvt__pfx_spill_disk(kvt_pool *p, uint32_t k)
{
    kvt__pfx *x = p->pfx;
    uint64_t slot = p->disk->pslot[x->meta[k]];
    int rc = slot != UINT64_MAX ? 0 : kvt__disk_spill_slot(p, k % x->LH, x->meta[k], &slot);
    if (!rc)
        rc = kvt__disk_write_page(p, slot,
                                  kvt__arena_block(&p->tier[KVT_TIER_HOST], x->host[k]));
    if (rc) {
        kvt__disk_page_free(p, x->meta[k]);
        return rc;
    }
    kvt__pfx_gain_copy(p, k, KVT_TIER_DISK);
    return 0;
}

/* Frees room in tier t (KVT_NUM_TIERS: the metadata store) from the least
 * recently used unheld entry that has copies there; false when none has. */
static bool kvt__pfx_reclaim(kvt_pool *p, uint32_t t)
{
    kvt__pfx *x = p->pfx;
    uint32_t i = UINT32_MAX;
    for (uint32_t v = x->lru_tail; v && i == UINT32_MAX; v = x->e[v - 1u].lru_prev)
        if ((t == KVT_NUM_TIERS || x->e[v - 1u].cnt[t]) && v != x->pin)
            i = v - 1u;
    if (i == UINT32_MAX)
        return false;
    const uint8_t others = (uint8_t)(KVT__RES_TIERS & ~(1u << (t % KVT_NUM_TIERS)));
    const bool host_room = t == KVT_TIER_DEVICE && kvt__has_tier(p, KVT_TIER_HOST) &&
                           x->cached[KVT_TIER_HOST] + x->LH <= x->cap[KVT_TIER_HOST] &&
                           p->tier[KVT_TIER_HOST].n_free >= x->LH;
    /* A backend whose decode reads device copies only (CUDA) in a pool
     * without placement to bring pages back: a device copy goes with its
     * page (an attached page must be readable where it is). */
    bool whole = t == KVT_NUM_TIERS ||
                 (t == KVT_TIER_DEVICE && !p->pol && (p->be_caps & KVT__BE_DEVICE_REMOTE));
    const uint32_t pin = x->pin;
    x->pin = i + 1u; /* a spill's disk slot may reclaim other entries' */
    for (uint32_t lh = 0; lh < x->LH && !whole; lh++) {
        const uint32_t k = i * x->LH + lh;
        if (!(x->res[k] & (1u << t)))
            continue;
        if (!(x->res[k] & others)) { /* the only copy: move it down, or give up the page */
            int rc = KVT_ENOSPC;
            char keep[512]; /* the caller's message (a failed spill's is not news) */
            snprintf(keep, sizeof keep, "%s", kvt_last_error());
            if (t == KVT_TIER_DEVICE && host_room)
                rc = kvt__pfx_spill_host(p, k);
            else if (t == KVT_TIER_HOST && p->disk)
                rc = kvt__pfx_spill_disk(p, k);
            if (rc) {
                kvt__err(0, "%s", keep);
                whole = true;
                break;
            }
        }
        kvt__pfx_drop_copy(p, k, t);
    }
    x->pin = pin;
    if (whole)
        x->reclaimed += kvt__pfx_entry_free(p, i);
    return true;
}

void kvt__pfx_make_room(kvt_pool *p, uint32_t tier, uint64_t need)
{
    if (!p->pfx)
        return;
    const kvt__arena *a = tier == KVT_NUM_TIERS ? &p->meta : &p->tier[tier];
    while (a->n_free < need && kvt__pfx_reclaim(p, tier)) {
    }
}

bool kvt__pfx_disk_room(kvt_pool *p)
{
    return p->pfx && kvt__pfx_reclaim(p, KVT_TIER_DISK);
}

uint64_t kvt__pfx_drop(kvt_pool *p, bool all, uint64_t salt)
{
    kvt__pfx *x = p->pfx;
    uint64_t n = 0;
    if (!x)
        return 0;
    for (uint32_t i = 0; i < x->n_ent; i++)
        if (x->e[i].live && (all || x->e[i].salt == salt)) {
            x->dropped += kvt__pfx_entry_free(p, i);
            n += x->LH;
        }
    /* The live sequences of the salt are not keyed again (a tenant leaving
     * must not come back through its running requests). */
    for (uint32_t si = 0; si < p->max_seqs; si++)
        if (p->seqs[si].live && (all || p->seqs[si].pfx.salt == salt))
            p->seqs[si].pfx.dropped = true;
    x->epoch++;
    return n;
}

static int kvt__pfx_bad(uint32_t i, uint32_t lh, const char *what)
{
    return kvt__err(KVT_EINTERNAL, "prefix cache: entry %u head %u: %s", i, lh, what);
}

int kvt__pfx_check(const kvt_pool *p, void (*mark)(void *, uint32_t, uint32_t), void *ctx,
                   uint64_t pages[KVT_NUM_TIERS])
{
    const kvt__pfx *x = p->pfx;
    if (!x)
        return 0;
    uint64_t cached[KVT_NUM_TIERS] = {0, 0, 0}, keyed = 0, n_lru = 0, n_live = 0;
    for (uint32_t i = 0; i < x->n_ent; i++) {
        const kvt__pent *e = &x->e[i];
        if (!e->live)
            continue;
        n_live++;
        keyed += x->LH;
        /* The key follows from the parent's and the ids. */
        uint64_t pkey = 0;
        bool orphan = false; /* its parent is gone: unreachable until reclaimed */
        if (e->page) {
            orphan = !kvt__pfx_valid(x, e->parent);
            if (!orphan && x->e[(uint32_t)e->parent - 1u].page + 1u != e->page)
                return kvt__pfx_bad(i, 0, "its parent is not the previous page");
            pkey = orphan ? 0 : x->e[(uint32_t)e->parent - 1u].key;
        }
        if (!orphan && kvt__pfx_key(x, pkey, x->ids + (size_t)i * x->P, e->salt) != e->key)
            return kvt__pfx_bad(i, 0, "its key is not the hash of its parent's key and ids");
        uint32_t found = 0;
        for (uint32_t v = x->bucket[e->key & x->mask]; v; v = x->e[v - 1u].next)
            found += v == i + 1u;
        if (found != 1)
            return kvt__pfx_bad(i, 0, "not once in its hash chain");
        uint32_t held = 0, cnt[KVT_NUM_TIERS] = {0, 0, 0};
        for (uint32_t lh = 0; lh < x->LH; lh++) {
            const uint32_t k = i * x->LH + lh, m = x->meta[k];
            if (!m || m >= p->meta.n_blocks || x->pg_key[m] != k + 1u)
                return kvt__pfx_bad(i, lh, "its page does not name it back");
            if (p->pg_hold[m]) {
                held++;
                const kvt__seq *s = &p->seqs[p->pg_hold[m] - 1u];
                const size_t ev = (size_t)lh * s->cap_pages + e->page;
                if (!s->live || e->page >= s->cap_pages || s->meta_slot[ev] != m)
                    return kvt__pfx_bad(i, lh, "its holder does not hold its page");
                if (s->pfx.n_ids >= (e->page + 1u) * x->P &&
                    memcmp(s->pfx.ids + (size_t)e->page * x->P, x->ids + (size_t)i * x->P,
                           x->P * sizeof *x->ids))
                    return kvt__pfx_bad(i, lh, "its holder's token ids differ from its own");
                continue;
            }
            const uint8_t r = x->res[k];
            if (!(r & KVT__RES_TIERS) || p->pg_ref[m])
                return kvt__pfx_bad(i, lh, "an unheld page in no tier, or counted held");
            if (r & KVT_RES_DEVICE)
                mark(ctx, KVT_TIER_DEVICE, x->dev[k]);
            else if (x->dev[k])
                return kvt__pfx_bad(i, lh, "off device with a device block");
            if (r & KVT_RES_HOST) {
                mark(ctx, KVT_TIER_HOST, x->host[k]);
                const kvt__owner *o = &p->host_owner[x->host[k]];
                if (o->slot != KVT__OWNER_PFX || o->lh != k)
                    return kvt__pfx_bad(i, lh, "its host block names another owner");
            } else if (x->host[k]) {
                return kvt__pfx_bad(i, lh, "not in host with a host block");
            }
            if ((r & KVT_RES_DISK) && (!p->disk || p->disk->pslot[m] == UINT64_MAX))
                return kvt__pfx_bad(i, lh, "on disk without a slot");
            mark(ctx, KVT_NUM_TIERS, m);
            for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
                if (r & (1u << t)) {
                    cnt[t]++;
                    pages[t]++;
                }
        }
        if (held != e->n_held || (held == 0) != (e->in_lru != 0))
            return kvt__pfx_bad(i, 0, "its held count or LRU membership is wrong");
        for (uint32_t t = 0; t < KVT_NUM_TIERS; t++) {
            if (cnt[t] != e->cnt[t])
                return kvt__pfx_bad(i, 0, "its per-tier copy counts are wrong");
            cached[t] += cnt[t];
        }
    }
    for (uint32_t v = x->lru_head; v; v = x->e[v - 1u].lru_next) {
        if (!x->e[v - 1u].live || !x->e[v - 1u].in_lru || ++n_lru > n_live)
            return kvt__err(KVT_EINTERNAL, "prefix cache: the LRU list names entry %u", v - 1u);
    }
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
        if (cached[t] != x->cached[t])
            return kvt__err(KVT_EINTERNAL, "prefix cache: counts %llu cached copies in tier "
                            "%u, entries hold %llu", (unsigned long long)x->cached[t], t,
                            (unsigned long long)cached[t]);
    if (keyed != x->keyed)
        return kvt__err(KVT_EINTERNAL, "prefix cache: counts %llu indexed pages, entries hold "
                        "%llu", (unsigned long long)x->keyed, (unsigned long long)keyed);
    uint64_t named = 0;
    for (uint32_t m = 0; m < p->meta.n_blocks; m++)
        named += x->pg_key[m] != 0;
    if (named != keyed)
        return kvt__err(KVT_EINTERNAL, "prefix cache: %llu pages name an entry, entries hold "
                        "%llu", (unsigned long long)named, (unsigned long long)keyed);
    return 0;
}
