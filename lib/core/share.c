/* Shared pages: the holders of a physical page (a ring through the share
 * tables of the sequences that hold it, always at the same layer, head and
 * page index), its reference count, and the writers that keep every
 * holder's view of the page equal. */
#include <string.h>

#include "store.h"

void kvt__page_res(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page, uint8_t clear,
                   uint8_t set)
{
    KVT__HOLDERS(p, s, lh, page, t)
    {
        uint8_t *r = &t->res[lh * t->cap_pages + page];
        *r = (uint8_t)((*r & ~clear) | set);
    }
}

void kvt__page_dev(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page, uint32_t blk)
{
    KVT__HOLDERS(p, s, lh, page, t)
    {
        t->dev_block[lh * t->cap_pages + page] = blk;
        kvt__dirty(p, t, lh, page);
    }
}

void kvt__page_host(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page, uint32_t blk)
{
    KVT__HOLDERS(p, s, lh, page, t)
        t->host_block[lh * t->cap_pages + page] = blk;
}

void kvt__page_count(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page, uint32_t tier,
                     int delta)
{
    p->pages_in_tier[tier] += (uint64_t)(int64_t)delta;
    KVT__HOLDERS(p, s, lh, page, t)
        t->pages_in_tier[tier] += (uint64_t)(int64_t)delta;
}

void kvt__page_share(kvt_pool *p, kvt__seq *s, kvt__seq *t, size_t lh, uint32_t page)
{
    const size_t es = lh * s->cap_pages + page, et = lh * t->cap_pages + page;
    t->dev_block[et] = s->dev_block[es];
    t->host_block[et] = s->host_block[es];
    t->meta_slot[et] = s->meta_slot[es];
    t->res[et] = s->res[es];
    for (uint32_t x = 0; x < KVT_NUM_TIERS; x++)
        if (s->res[es] & (1u << x))
            t->pages_in_tier[x]++;
    /* t goes into the ring right after s. */
    const uint32_t next = s->share[es] ? s->share[es] : (uint32_t)(s - p->seqs) + 1u;
    t->share[et] = next;
    s->share[es] = (uint32_t)(t - p->seqs) + 1u;
    p->pg_ref[s->meta_slot[es]]++;
    kvt__dirty(p, t, lh, page);
}

void kvt__page_claim_round(kvt_pool *p)
{
    if (++p->mark_round == 0) { /* wrapped: no mark may look current */
        memset(p->pg_mark, 0, (size_t)p->meta.n_blocks * sizeof *p->pg_mark);
        p->mark_round = 1;
    }
}

bool kvt__page_claim(kvt_pool *p, const kvt__seq *s, size_t e)
{
    if (!kvt__page_shared(s, e))
        return true;
    uint32_t *m = &p->pg_mark[s->meta_slot[e]];
    if (*m == p->mark_round)
        return false;
    *m = p->mark_round;
    return true;
}

bool kvt__page_unshare(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page)
{
    const size_t e = lh * s->cap_pages + page;
    const uint32_t me = (uint32_t)(s - p->seqs) + 1u;
    if (!s->share || !s->share[e])
        return true;
    /* Find the holder before s in the ring and link it past s. */
    kvt__seq *prev = s;
    for (kvt__seq *t = kvt__share_nx(p, s, lh, page); t != s; t = kvt__share_nx(p, t, lh, page))
        prev = t;
    uint32_t *link = &prev->share[lh * prev->cap_pages + page];
    *link = s->share[e]; /* it named s; now s's successor */
    if (*link == (uint32_t)(prev - p->seqs) + 1u)
        *link = 0; /* prev is the last holder: alone again */
    p->pg_ref[s->meta_slot[e]]--;
    if (p->pg_hold[s->meta_slot[e]] == me)
        p->pg_hold[s->meta_slot[e]] = (uint32_t)(prev - p->seqs) + 1u;
    /* A host block's owner must stay a holder (the host cache's eviction
     * reaches the page through it). */
    if ((s->res[e] & KVT_RES_HOST) && p->host_owner &&
        p->host_owner[s->host_block[e]].slot == me - 1u)
        p->host_owner[s->host_block[e]].slot = (uint32_t)(prev - p->seqs);
    for (uint32_t x = 0; x < KVT_NUM_TIERS; x++)
        if (s->res[e] & (1u << x))
            s->pages_in_tier[x]--;
    s->share[e] = 0;
    s->dev_block[e] = 0;
    s->host_block[e] = 0;
    s->meta_slot[e] = 0;
    s->res[e] = 0;
    return false;
}
