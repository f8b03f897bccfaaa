/* The per-step placement of tiered pools, a step's part of it that needs
 * no step state: whether a head reranks now (kvt__head_due), the device
 * blocks and moves a step's reranks may take (kvt__place_promote_bound),
 * and the fused recycle of one reranked stable head
 * (kvt__place_recycle_head). The step (lib/step) orders them per layer and
 * tracks the promotions' fences. */
#include <stdlib.h>
#include <string.h>

#include "tier.h"
#include "../policy/policy_int.h"


bool kvt__held_elsewhere(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page, bool selections)
{
    if (!kvt__page_shared(s, lh * s->cap_pages + page) || !p->pol)
        return false;
    const uint32_t layer = (uint32_t)(lh / p->g.n_kv_heads);
    KVT__HOLDERS(p, s, lh, page, t)
    {
        if (t == s)
            continue;
        const uint32_t tokens = t->n_tokens[layer];
        if (kvt__forced(page, kvt__pages_for(p, tokens), tokens, p->g.page_tokens,
                        p->pol->sink[lh], p->pol->local[lh]))
            return true;
        if (selections && t->sel.topk && t->sel.topk_k[lh]) {
            const uint32_t *k = t->sel.topk + lh * t->sel.topk_cap;
            for (uint32_t i = 0; i < t->sel.topk_n[lh]; i++)
                if (k[i] == page)
                    return true;
        }
    }
    return false;
}

/* Highest score first; among equal scores the lower page. */
static int kvt__evc_desc(const void *a, const void *b)
{
    const kvt__evc *x = a, *y = b;
    if (x->imp != y->imp)
        return x->imp > y->imp ? -1 : 1;
    return x->page < y->page ? -1 : x->page > y->page;
}

/* Tiered pools: whether the selection a stable head of `layer` makes when it
 * does not rerank - every page when its budget covers them all, else the
 * forced pages and its kept top-K set - names a page with no device copy
 * and none arriving. A prefill's trim or an engine's explicit move may have
 * dropped one since the head's last rerank; such a head reranks, so that
 * kvt_step_select promotes the page (decode reads device copies; the
 * CUDA backend's reads no other tier). Reads sink + local + K entries, or
 * the pages when the budget covers them all (at most sink + local + K). */
static bool kvt__reuse_off_device(const kvt_pool *p, const kvt__seq *s, uint32_t layer,
                                  size_t lh, uint32_t k)
{
    const uint32_t tokens = s->n_tokens[layer], np = kvt__pages_for(p, tokens);
    const uint32_t sink = p->pol->sink[lh], local = p->pol->local[lh];
    const uint8_t *res = s->res + lh * s->cap_pages;
    /* (A shared page arriving may be another holder's move, which this
     * sequence's decode does not wait for: it counts as away, so the head
     * reranks and its recycle lands it.) */
    const bool shares = s->share != NULL;
    const uint8_t here = KVT_RES_DEVICE | KVT__RES_INBOUND;
    const bool all = (uint64_t)k + sink + local >= np;
    uint32_t lo, hi; /* the forced pages: [0, lo) and [hi, np) */
    kvt__forced_span(np, tokens, p->g.page_tokens, sink, local, &lo, &hi);
#define KVT__AWAY(pg)                                                                      \
    (!(res[pg] & here) ||                                                                  \
     (!(res[pg] & KVT_RES_DEVICE) && shares && s->share[lh * s->cap_pages + (pg)]))
    const uint32_t s_end = all ? np : lo;
    for (uint32_t pg = 0; pg < s_end; pg++)
        if (KVT__AWAY(pg))
            return true;
    if (all)
        return false;
    for (uint32_t pg = hi > lo ? hi : lo; pg < np; pg++)
        if (KVT__AWAY(pg))
            return true;
    if (s->sel.topk && s->sel.topk_k[lh]) {
        const uint32_t *t = s->sel.topk + lh * s->sel.topk_cap;
        for (uint32_t j = 0; j < s->sel.topk_n[lh]; j++)
            if (t[j] < np && KVT__AWAY(t[j]))
                return true;
    }
#undef KVT__AWAY
    return false;
}

/* Whether head lh of `layer` of s reranks in this step (not dense): with no
 * kept top-K set (topk_k holds K + 1 of the kept pages, 0 = none), at
 * interval 1, or at the steps its interval and the sequence's phase pick;
 * in a tiered pool a stable head also when its reused selection names a
 * page off device. */
bool kvt__head_due(const kvt_pool *p, const kvt__seq *s, uint32_t layer, size_t lh,
                          uint32_t k, uint32_t iv, bool tiered)
{
    return !s->sel.topk || iv <= 1 || s->sel.topk_k[lh] != k + 1u ||
           (s->sel.steps + s->sel.phase) % iv == 0 ||
           (tiered && kvt__stable(p, lh) && kvt__reuse_off_device(p, s, layer, lh, k));
}

/* Adds to *need the device blocks the rerank/recycle of s's due stable
 * heads may take beyond the blocks they give back, and to *pm the moves it
 * may issue. After a rerank a head keeps its forced pages, at most K x
 * window others, and the pages it cannot evict (no complete copy elsewhere
 * or a move in flight); one more page may leave the local window with the
 * step's token and not be evictable yet (the new page itself is counted
 * with the appends). */
void kvt__place_promote_bound(const kvt_pool *p, const kvt__seq *s, const uint32_t *ak,
                               const uint32_t *aiv, const float *asim, uint64_t *need,
                               uint64_t *pm)
{
    const uint32_t L = p->g.n_layers, H = p->g.n_kv_heads, P = p->g.page_tokens;
    for (uint32_t l = 0; l < L; l++) {
        const uint32_t tokens = s->n_tokens[l], np = kvt__pages_for(p, tokens);
        for (uint32_t h = 0; h < H; h++) {
            const size_t lh = kvt__lh(p, l, h);
            if (!kvt__stable(p, lh))
                continue;
            /* Room for every stable head's promotions, due or not: a failed
             * warm-up makes all of a sequence's heads rescore mid-step. */
            *pm += ak[lh] < np + 1u ? ak[lh] : np + 1u;
            if (!kvt__head_due(p, s, l, lh, ak[lh], aiv[lh], true) &&
                !(asim && asim[lh] > -1.0f))
                continue;
            const uint32_t sink = p->pol->sink[lh], local = p->pol->local[lh];
            uint64_t dev = 0, stuck = 0, forced = 0;
            for (uint32_t pg = 0; pg < np; pg++) {
                const uint8_t r = s->res[lh * s->cap_pages + pg];
                const bool f = kvt__forced(pg, np, tokens, P, sink, local);
                forced += f;
                if (!(r & (KVT_RES_DEVICE | KVT__RES_INBOUND)))
                    continue;
                dev++;
                /* Pages arriving count as resident (the recycle waits for
                 * them), not as stuck. */
                if (!f && !(r & KVT__RES_INBOUND) &&
                    ((r & KVT__RES_BUSY) || !(r & (KVT_RES_HOST | KVT_RES_DISK))))
                    stuck++;
            }
            uint64_t kw = (uint64_t)ak[lh] * p->pol->window[lh];
            kw = kw < np ? kw : np; /* a budget above the context keeps every page */
            uint64_t after = forced + 1u + kw + stuck;
            after = after < np + 1u ? after : np + 1u;
            if (after > dev)
                *need += after - dev;
        }
    }
}

int kvt__place_recycle_head(kvt_pool *p, kvt__seq *s, kvt_seq_id id, uint32_t seq_index,
                            uint32_t layer, uint32_t h, const uint32_t *sel, uint32_t cnt,
                            uint32_t k, kvt__evc *ev, uint32_t *pml, kvt_move *pm,
                            uint32_t *pmdst, int32_t *pmres, size_t cap, uint32_t *n_pm)
{
    kvt__arena *dev = &p->tier[KVT_TIER_DEVICE];
    const uint32_t P = p->g.page_tokens;
    const size_t lh = kvt__lh(p, layer, h), base = lh * s->cap_pages;
    const uint32_t tokens = s->n_tokens[layer], np = kvt__pages_for(p, tokens);
    *n_pm = 0;
    const uint32_t sink = p->pol->sink[lh], local = p->pol->local[lh];
    uint32_t npro = 0, nev = 0, stuck = 0, ntop = 0;
    for (uint32_t pg = 0, j = 0; pg < np; pg++) {
        const size_t e = base + pg;
        const bool selected = j < cnt && sel[j] == pg;
        j += selected;
        const bool forced = kvt__forced(pg, np, tokens, P, sink, local);
        uint8_t r = s->res[e];
        if (selected) {
            ntop += !forced;
            if ((r & KVT__RES_INBOUND) && kvt__page_shared(s, e)) {
                /* On its way for this or another holder: the decode waits
                 * only for this sequence's own fences, so land it now. */
                kvt__mover_drain_page(p->mover, s, e);
                r = s->res[e];
            }
            if (r & KVT__RES_INBOUND)
                continue; /* on its way (warm-up); the decode waits for it */
            if (!(r & KVT_RES_DEVICE) && (r & KVT__RES_BUSY)) {
                /* Moving between other tiers (for this sequence or another
                 * holder of the page): let it land first. */
                kvt__mover_drain_page(p->mover, s, e);
                r = s->res[e];
            }
            if (!(r & KVT_RES_DEVICE))
                pml[npro++] = pg;
        } else if ((r & KVT_RES_DEVICE) && !forced) {
            if (!(r & KVT__RES_BUSY) && (r & (KVT_RES_HOST | KVT_RES_DISK)) &&
                !kvt__held_elsewhere(p, s, lh, pg, true))
                ev[nev++] = (kvt__evc){s->tier.imp[e], pg};
            else
                stuck++;
        }
    }
    /* Lookahead eviction: up to K x window non-forced pages stay,
     * the evictable ones with the highest current scores. */
    const uint64_t kw = (uint64_t)k * p->pol->window[lh];
    const uint64_t used = (uint64_t)ntop + stuck;
    uint64_t room = kw > used ? kw - used : 0;
    uint32_t keep = 0;
    if (room && nev) {
        if (room >= nev) {
            keep = nev;
        } else {
            qsort(ev, nev, sizeof *ev, kvt__evc_desc);
            keep = (uint32_t)room;
        }
    }
    const kvt__evc *evs = ev + keep;
    const uint32_t nevict = nev - keep;
    const uint32_t deficit = npro > nevict ? npro - nevict : 0;
    kvt__pfx_make_room(p, KVT_TIER_DEVICE, deficit);
    if (deficit > dev->n_free)
        return kvt__err(KVT_ENOSPC, "device tier: sequence %u layer %u head %u promotes %u "
                        "pages, %u blocks free after %u evictions", seq_index, layer, h, npro,
                        dev->n_free, nevict);
    if (npro > cap)
        return kvt__err(KVT_EINTERNAL, "step: promotions exceed the %zu the plan sized", cap);
    for (uint32_t x = 0; x < npro; x++) {
        const uint32_t pg = pml[x];
        const uint8_t r = s->res[base + pg];
        uint32_t blk;
        if (x < nevict) { /* the evicted page's block, handed over in place */
            const size_t ee = base + evs[x].page;
            blk = s->dev_block[ee];
            kvt__page_dev(p, s, lh, evs[x].page, 0);
            kvt__page_res(p, s, lh, evs[x].page, KVT_RES_DEVICE, 0);
            kvt__page_count(p, s, lh, evs[x].page, KVT_TIER_DEVICE, -1);
            p->pst.recycled++;
            p->pst.evicted++;
        } else {
            blk = kvt__arena_alloc(dev);
        }
        pm[x] = (kvt_move){id, layer, h, pg, (r & KVT_RES_HOST) ? KVT_TIER_HOST : KVT_TIER_DISK,
                           KVT_TIER_DEVICE, 0};
        pmdst[x] = blk;
        pmres[x] = 0;
        kvt__dirty(p, s, lh, pg);
    }
    for (uint32_t x = npro; x < nevict; x++) {
        kvt__page_drop(p, s, base + evs[x].page, KVT_TIER_DEVICE);
        p->pst.evicted++;
    }
    *n_pm = npro;
    return 0;
}
