/* Tiered placement by head class (FlexiCache, KVDRIVE): sizing a pool for a
 * target context, copying stable heads' full pages out of the device tier
 * once, trimming device copies after a prefill append, and the
 * importance-guided warm-up. The per-step rerank/recycle lives with the
 * step (lib/attn/step.c).
 *
 * Everything here runs on the caller's thread and changes the tables only
 * through the mover's rules: a device copy is dropped only when another
 * tier holds a complete copy and no move of the page is in flight. */
#include <stdlib.h>
#include <string.h>

#include "tier.h"
#include "../select/select_int.h"
#include "../policy/policy_int.h"

/* ---- sizing -------------------------------------------------------------- */
KVT_API int kvt_pool_sizing_get(const kvt_pool_opts *opts, kvt_pool_sizing *out)
{
    KVT__CHECK_NULL(opts);
    KVT__CHECK_NULL(out);
    size_t fill;
    int rc = kvt__out_struct(out, sizeof *out, sizeof *out, "out", &fill);
    if (rc)
        return rc;
    kvt_pool_opts o;
    rc = kvt__opts_copy(&o, sizeof o, opts, sizeof(kvt_pool_opts), "opts");
    if (rc)
        return rc;
    kvt_geometry g;
    if ((rc = kvt__geometry_resolve(&o.geom, &g)))
        return rc;
    if (o.policy && (rc = kvt__geometry_same(&o.policy->g, &g, "opts->policy", "the policy",
                                             "the pool")))
        return rc;
    if (o.target_tokens == 0)
        return kvt__err(KVT_EINVAL, "opts->target_tokens: must be set (the context length "
                        "to size for)");
    if (o.target_tokens > KVT_MAX_SEQ_TOKENS_LIMIT)
        return kvt__err(KVT_EINVAL, "opts->target_tokens: %llu is above the limit %u",
                        (unsigned long long)o.target_tokens, KVT_MAX_SEQ_TOKENS_LIMIT);
    const uint64_t S = o.target_seqs ? o.target_seqs : 1u;
    const uint64_t P = g.page_tokens, T = o.target_tokens, np = (T + P - 1) / P;
    const uint64_t elem = kvt_dtype_size(g.dtype);
    const uint64_t block = 2u * P * g.head_dim * elem, meta = 3u * g.head_dim * elem;
    const uint64_t nlh = (uint64_t)g.n_layers * g.n_kv_heads;
    uint64_t dev = 0, stable = 0;
    for (uint64_t b = 0; b < nlh; b++) {
        const kvt_policy *pol = o.policy;
        if (!pol || pol->cls[b] != KVT_HEAD_STABLE) {
            dev += np;
            continue;
        }
        stable++;
        /* sink + local + the last page, the window, and the pages that
         * leave the local window between two reranks (plus the step's own
         * new page). */
        uint64_t keep = (uint64_t)pol->sink[b] + pol->local[b] + 1u +
                        (uint64_t)pol->k[b] * pol->window[b] + (pol->interval[b] + P - 1) / P + 1u;
        dev += keep < np ? keep : np;
    }
    kvt_pool_sizing r;
    memset(&r, 0, sizeof r);
    r.struct_size = out->struct_size;
    /* S <= 2^32, nlh <= 2^32 heads and np <= 2^30 pages: the page counts
     * may pass 2^64 only through S * nlh * np; check every product. */
    uint64_t hp, dn;
    if (!kvt__mul_u64(S, dev, &r.device_pages) || !kvt__mul_u64(S, nlh, &hp) ||
        !kvt__mul_u64(hp, np, &r.dense_pages) || !kvt__mul_u64(r.dense_pages + 1u, block, &dn) ||
        !kvt__mul_u64(r.dense_pages, meta, &r.meta_bytes) ||
        !kvt__mul_u64(S * stable, T / P, &r.host_bytes) ||
        !kvt__mul_u64(r.host_bytes + 1u, block, &r.host_bytes))
        return kvt__err(KVT_EOVERFLOW, "opts->target_seqs: %llu sequences of %llu tokens "
                        "overflow 64-bit byte counts", (unsigned long long)S,
                        (unsigned long long)T);
    r.dense_bytes = dn;
    r.device_bytes = (r.device_pages + 1u) * block; /* <= dense_bytes */
    memcpy(out, &r, fill);
    return 0;
}

/* ---- offload once --------------------------------------------------------- */
typedef struct {
    kvt_move *mv;
    uint32_t n, cap;
} kvt__mvbuf;

static int kvt__mv_push(kvt__mvbuf *b, const kvt_move *m)
{
    if (b->n == b->cap) {
        uint32_t c = b->cap ? b->cap * 2u : 64u;
        kvt_move *q = realloc(b->mv, (size_t)c * sizeof *q);
        if (!q)
            return kvt__err(KVT_ENOMEM, "placement: cannot grow a move list to %u moves", c);
        b->mv = q;
        b->cap = c;
    }
    b->mv[b->n++] = *m;
    return 0;
}

/* Adds the copy-out of every full page of s's stable heads in `layer`
 * (UINT32_MAX: all layers) that no other tier holds yet. Pages with a move
 * in flight are left for a later pass (the cursor stops at the first). */
static int kvt__offload_collect(kvt_pool *p, kvt__seq *s, kvt_seq_id id, uint32_t layer,
                                kvt__mvbuf *b)
{
    const uint32_t H = p->g.n_kv_heads, P = p->g.page_tokens;
    const uint32_t l0 = layer == UINT32_MAX ? 0 : layer;
    const uint32_t l1 = layer == UINT32_MAX ? p->g.n_layers : layer + 1u;
    for (uint32_t l = l0; l < l1; l++) {
        const uint32_t full = s->n_tokens[l] / P;
        for (uint32_t h = 0; h < H; h++) {
            const size_t lh = kvt__lh(p, l, h);
            if (!kvt__stable(p, lh))
                continue;
            uint32_t next = full;
            for (uint32_t pg = s->tier.off_next[lh]; pg < full; pg++) {
                const uint8_t r = s->res[lh * s->cap_pages + pg];
                if (r & (KVT_RES_HOST | KVT_RES_DISK))
                    continue;
                /* A shared page goes out once, by the first holder that
                 * names it; the others look again in a later pass. */
                if ((r & KVT__RES_BUSY) || !(r & KVT_RES_DEVICE) ||
                    !kvt__page_claim(p, s, lh * s->cap_pages + pg)) {
                    next = next < pg ? next : pg;
                    continue;
                }
                kvt_move m = {id, l, h, pg, KVT_TIER_DEVICE, KVT_TIER_HOST, 0};
                int rc = kvt__mv_push(b, &m);
                if (rc)
                    return rc;
            }
            s->tier.off_next[lh] = next;
        }
    }
    return 0;
}

/* Puts the offload cursors back to the pages of moves not submitted. */
static void kvt__offload_rewind(kvt_pool *p, const kvt__mvbuf *b)
{
    for (uint32_t i = 0; i < b->n; i++) {
        kvt__seq *s;
        if (kvt__seq_lookup(p, b->mv[i].seq, &s) == 0) {
            const size_t lh = kvt__lh(p, b->mv[i].layer, b->mv[i].kv_head);
            if (b->mv[i].page < s->tier.off_next[lh])
                s->tier.off_next[lh] = b->mv[i].page;
        }
    }
}

/* Submits a copy-out batch: device -> host (and on to the disk when the
 * pool has one); when the host cannot take it, device -> disk alone. On
 * refusal the heads' cursors go back so a later pass tries again. */
static int kvt__offload_submit(kvt_pool *p, kvt__mvbuf *b, bool detach, kvt_fence *fence)
{
    *fence = 0;
    if (b->n == 0)
        return 0;
    const uint8_t f = (uint8_t)(KVT__OPF_OFFLOAD | (detach ? KVT__OPF_DETACH : 0));
    int rc = kvt__mover_submit(p->mover, b->mv, b->n, 0, NULL, fence, NULL,
                               (uint8_t)(f | KVT__OPF_CHAIN));
    if (rc == KVT_ENOSPC && p->disk) {
        /* The host is full: the disk alone; the disk is full: the host alone. */
        for (uint32_t i = 0; i < b->n; i++)
            b->mv[i].to = KVT_TIER_DISK;
        rc = kvt__mover_submit(p->mover, b->mv, b->n, 0, NULL, fence, NULL, f);
        if (rc == KVT_ENOSPC) {
            for (uint32_t i = 0; i < b->n; i++)
                b->mv[i].to = KVT_TIER_HOST;
            rc = kvt__mover_submit(p->mover, b->mv, b->n, 0, NULL, fence, NULL, f);
        }
    }
    if (rc)
        kvt__offload_rewind(p, b);
    return rc;
}

int kvt__place_offload(kvt_pool *p, kvt__seq *const *seqs, const kvt_seq_id *ids, uint32_t n,
                       uint32_t layer, bool wait)
{
    if (!p->pol)
        return 0;
    kvt__mover_apply(p->mover);
    kvt__mvbuf b = {0};
    int rc = 0;
    kvt__page_claim_round(p);
    for (uint32_t i = 0; i < n && !rc; i++) {
        kvt__seq *s;
        if (kvt__seq_lookup(p, ids[i], &s) != 0 || s != seqs[i])
            continue; /* released since */
        rc = kvt__offload_collect(p, s, ids[i], layer, &b);
    }
    kvt_fence f = 0;
    if (rc)
        kvt__offload_rewind(p, &b); /* what was collected was not submitted */
    else
        rc = kvt__offload_submit(p, &b, !wait, &f);
    free(b.mv);
    if (!rc && wait && f)
        rc = kvt__mover_fence_wait(p->mover, f);
    return rc;
}

/* Whether page pg is in the sorted list a[n]. */
static bool kvt__in_sorted(const uint32_t *a, uint32_t n, uint32_t pg)
{
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (a[mid] < pg)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && a[lo] == pg;
}

/* Drops device copies of stable heads' pages in [from, np) of `layer` that
 * are not forced, not in the head's top-K set, complete in another tier and
 * idle. */
static void kvt__trim(kvt_pool *p, kvt__seq *s, uint32_t layer, const uint32_t *from)
{
    const uint32_t H = p->g.n_kv_heads, P = p->g.page_tokens;
    const uint32_t tokens = s->n_tokens[layer], np = kvt__pages_for(p, tokens);
    for (uint32_t h = 0; h < H; h++) {
        const size_t lh = kvt__lh(p, layer, h);
        if (!kvt__stable(p, lh))
            continue;
        const uint32_t sink = p->pol->sink[lh], local = p->pol->local[lh];
        const uint32_t *topk = NULL;
        uint32_t ntop = 0;
        if (s->sel.topk && s->sel.topk_k[lh]) {
            topk = s->sel.topk + lh * s->sel.topk_cap;
            ntop = s->sel.topk_n[lh];
        }
        for (uint32_t pg = from[h]; pg < np; pg++) {
            const size_t e = lh * s->cap_pages + pg;
            const uint8_t r = s->res[e];
            if (!(r & KVT_RES_DEVICE) || (r & KVT__RES_BUSY) ||
                !(r & (KVT_RES_HOST | KVT_RES_DISK)))
                continue;
            if (kvt__forced(pg, np, tokens, P, sink, local) || kvt__in_sorted(topk, ntop, pg) ||
                kvt__held_elsewhere(p, s, lh, pg, true))
                continue;
            kvt__page_drop(p, s, e, KVT_TIER_DEVICE);
            p->pst.evicted++;
        }
    }
}

int kvt__place_after_append(kvt_pool *p, kvt__seq *s, kvt_seq_id id, uint32_t layer,
                            uint32_t tokens_before)
{
    const uint32_t H = p->g.n_kv_heads;
    uint32_t *from = calloc(H, sizeof *from);
    if (!from)
        return kvt__err(KVT_ENOMEM, "kvt_seq_append: cannot allocate %u cursors", H);
    const uint32_t npb = kvt__pages_for(p, tokens_before);
    for (uint32_t h = 0; h < H; h++) {
        const size_t lh = kvt__lh(p, layer, h);
        if (!kvt__stable(p, lh))
            continue;
        /* Pages offloaded now, and those that were local or last before. */
        const uint32_t keep = p->pol->local[lh] + 1u;
        uint32_t f = npb > keep ? npb - keep : 0;
        from[h] = s->tier.off_next[lh] < f ? s->tier.off_next[lh] : f;
    }
    kvt__seq *one[1] = {s};
    int rc = kvt__place_offload(p, one, &id, 1, layer, true);
    kvt__trim(p, s, layer, from);
    free(from);
    return rc;
}

/* ---- warm-up ---------------------------------------------------------------- */
typedef struct {
    float imp;
    uint32_t lh, page;
} kvt__rank;

static int kvt__rank_desc(const void *a, const void *b)
{
    const kvt__rank *x = a, *y = b;
    if (x->imp != y->imp)
        return x->imp > y->imp ? -1 : 1;
    if (x->lh != y->lh)
        return x->lh < y->lh ? -1 : 1;
    return x->page < y->page ? -1 : x->page > y->page;
}

/* With a disk tier: the host keeps the sequence's most important pages.
 * The room is what is free plus what the sequence's own disk-backed host
 * copies take; the copies that fall outside are dropped, and the pages
 * inside that only the disk holds are read in (normal priority). */
static int kvt__warm_host(kvt_pool *p, kvt__seq *s, kvt_seq_id id)
{
    const uint32_t L = p->g.n_layers, H = p->g.n_kv_heads, P = p->g.page_tokens;
    size_t n = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++)
            if (kvt__stable(p, kvt__lh(p, l, h)))
                n += s->n_tokens[l] / P;
    if (n == 0)
        return 0;
    kvt__rank *rk = malloc(n * sizeof *rk);
    if (!rk)
        return kvt__err(KVT_ENOMEM, "kvt_seq_warmup: cannot rank %zu pages", n);
    size_t k = 0, room = p->tier[KVT_TIER_HOST].n_free;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++) {
            const size_t lh = kvt__lh(p, l, h);
            if (!kvt__stable(p, lh))
                continue;
            for (uint32_t pg = 0; pg < s->n_tokens[l] / P; pg++) {
                const size_t e = lh * s->cap_pages + pg;
                rk[k++] = (kvt__rank){s->tier.imp[e], (uint32_t)lh, pg};
                const uint8_t r = s->res[e];
                if ((r & KVT_RES_HOST) && (r & KVT_RES_DISK) && !(r & KVT__RES_BUSY))
                    room++;
            }
        }
    qsort(rk, n, sizeof *rk, kvt__rank_desc);
    kvt__mvbuf b = {0};
    int rc = 0;
    size_t taken = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const size_t e = (size_t)rk[i].lh * s->cap_pages + rk[i].page;
        const uint8_t r = s->res[e];
        const bool in = taken < room;
        if (r & KVT__RES_BUSY)
            continue;
        if (in) {
            if ((r & KVT_RES_HOST) || (r & KVT_RES_DISK)) {
                taken++;
                if (!(r & KVT_RES_HOST)) {
                    kvt_move m = {id, rk[i].lh / H, rk[i].lh % H, rk[i].page, KVT_TIER_DISK,
                                  KVT_TIER_HOST, 0};
                    rc = kvt__mv_push(&b, &m);
                }
            }
        } else if ((r & KVT_RES_HOST) && (r & KVT_RES_DISK)) {
            kvt__page_drop(p, s, e, KVT_TIER_HOST);
        }
    }
    free(rk);
    kvt_fence f;
    if (!rc && b.n) /* nobody waits for these reads: detached */
        rc = kvt__mover_submit(p->mover, b.mv, b.n, 0, NULL, &f, NULL, KVT__OPF_DETACH);
    free(b.mv);
    return rc;
}

/* The pages of s to bring on device: a cut to n_tokens (attach false: the
 * stable heads' pages it makes forced) or an attach of n_tokens (every
 * page an unstable head has, a stable head's forced pages). */
static int kvt__place_in(kvt_pool *p, kvt__seq *s, kvt_seq_id id, uint32_t n_tokens,
                         bool attach, uint64_t *count)
{
    const uint32_t P = p->g.page_tokens, np = kvt__pages_for(p, n_tokens), full = n_tokens / P;
    kvt__mvbuf b = {0};
    uint64_t n = 0;
    int rc = 0;
    for (uint32_t l = 0; p->pol && l < p->g.n_layers && !rc; l++) {
        if (!attach && s->n_tokens[l] == n_tokens)
            continue;
        for (uint32_t h = 0; h < p->g.n_kv_heads && !rc; h++) {
            const size_t lh = kvt__lh(p, l, h);
            const bool stable = kvt__stable(p, lh);
            if (!stable && !attach)
                continue; /* an unstable head's pages never leave the device */
            for (uint32_t pg = 0; pg < full && !rc; pg++) {
                if (stable &&
                    !kvt__forced(pg, np, n_tokens, P, p->pol->sink[lh], p->pol->local[lh]))
                    continue;
                const size_t e = lh * s->cap_pages + pg;
                if (!count || attach) /* another holder's move (an attach counts after it) */
                    kvt__mover_drain_page(p->mover, s, e);
                if (s->res[e] & (KVT_RES_DEVICE | KVT__RES_INBOUND))
                    continue;
                n++;
                if (!count) {
                    kvt_move m = {id, l, h, pg,
                                  (s->res[e] & KVT_RES_HOST) ? KVT_TIER_HOST : KVT_TIER_DISK,
                                  KVT_TIER_DEVICE, 0};
                    rc = kvt__mv_push(&b, &m);
                }
            }
        }
    }
    if (count) {
        *count = n;
        return 0;
    }
    if (!rc && b.n) {
        kvt_fence f;
        rc = kvt__mover_submit(p->mover, b.mv, b.n, KVT_SUBMIT_URGENT, NULL, &f, NULL,
                               KVT__OPF_PROMOTE);
        if (!rc) {
            p->pst.promoted += b.n;
            rc = kvt__mover_fence_wait(p->mover, f);
        }
    }
    free(b.mv);
    return rc;
}

int kvt__place_forced_in(kvt_pool *p, kvt__seq *s, kvt_seq_id id, uint32_t n_tokens,
                         uint64_t *count)
{
    return kvt__place_in(p, s, id, n_tokens, false, count);
}

int kvt__place_attach_in(kvt_pool *p, kvt__seq *s, kvt_seq_id id, uint64_t *count)
{
    return kvt__place_in(p, s, id, s->n_tokens[0], true, count);
}

void kvt__place_settle(kvt_pool *p, kvt__seq *s)
{
    kvt__mover_drain_seq(p->mover, s);
    /* Moves of shared pages that other holders submitted. */
    for (uint32_t l = 0; p->mover && l < p->g.n_layers; l++)
        for (uint32_t h = 0; h < p->g.n_kv_heads; h++) {
            const size_t base = kvt__lh(p, l, h) * s->cap_pages;
            for (uint32_t pg = 0; pg < kvt__pages_for(p, s->n_tokens[l]); pg++)
                if (s->res[base + pg] & KVT__RES_BUSY)
                    kvt__mover_drain_page(p->mover, s, base + pg);
        }
    if (s->tier.wfence) { /* an earlier warm-up's batch no step consumed */
        int code = 0;
        kvt__mover_fence_done(p->mover, s->tier.wfence, &code);
        s->tier.wfence = 0;
        kvt_clear_error();
    }
}

int kvt__place_warmup(kvt_pool *pool, kvt__seq *s, kvt_seq_id seq, const float *obs_queries,
                      uint32_t n_obs)
{
    int rc;
    const kvt_policy *pol = pool->pol;
    const uint32_t L = pool->g.n_layers, H = pool->g.n_kv_heads, P = pool->g.page_tokens;
    const uint32_t Hq = pool->g.n_q_heads, G = Hq / H, D = pool->g.head_dim;

    /* Settle: no move of the sequence in flight, every full stable page out once. */
    kvt__place_settle(pool, s);
    kvt__seq *one[1] = {s};
    if ((rc = kvt__place_offload(pool, one, &seq, 1, UINT32_MAX, true)))
        return rc;

    uint32_t np_max = 1, kmax = 0;
    for (uint32_t l = 0; l < L; l++) {
        const uint32_t np = kvt__pages_for(pool, s->n_tokens[l]);
        np_max = np > np_max ? np : np_max;
    }
    for (size_t b = 0; b < (size_t)L * H; b++)
        kmax = pol->k[b] > kmax ? pol->k[b] : kmax;
    if ((rc = kvt__seq_topk_reserve(pool, s, kmax < s->cap_pages ? kmax : s->cap_pages)))
        return rc;
    const size_t scb = kvt__sel_scratch_bytes(G, D, np_max);
    const size_t nimp = (size_t)L * H * np_max;
    uint8_t *mem = malloc(scb + nimp * sizeof(float) + (size_t)np_max * 2u * sizeof(uint32_t));
    kvt__mvbuf b = {0};
    if (!mem)
        return kvt__err(KVT_ENOMEM, "kvt_seq_warmup: cannot allocate scratch for %u pages",
                        np_max);
    kvt__sel_scratch sc;
    kvt__sel_scratch_carve(&sc, mem, G, D, np_max);
    float *imp_all = (float *)(void *)(mem + scb); /* [L * H][np_max] */
    uint32_t *set = (uint32_t *)(void *)(imp_all + nimp);
    uint32_t *tmp = set + np_max;

    /* Every stable head's importance: on the GPU for a CUDA pool (the
     * metadata is there; the many queries make it a matrix product). */
    if (pool->be->warm_imp) {
        rc = pool->be->warm_imp(pool, s, obs_queries, n_obs, imp_all, np_max);
    } else {
        /* Key-reading scores (TOKEN, ORACLE) would read every stable head's
         * keys once per observed query: the warm-up scores by their MINMAX
         * bound instead (SOFTVOTE for the oracle), as the CUDA warm-up. */
        kvt_selector wsel = *pool->sel;
        if (wsel.method >= KVT_SCORE_TOKEN) {
            if (wsel.method == KVT_SCORE_ORACLE)
                wsel.vote = KVT_VOTE_SOFTVOTE;
            wsel.method = KVT_SCORE_MINMAX;
        }
        for (uint32_t l = 0; l < L; l++) {
            const uint32_t np = kvt__pages_for(pool, s->n_tokens[l]);
            for (uint32_t h = 0; h < H && np; h++) {
                const size_t lh = kvt__lh(pool, l, h);
                if (!kvt__stable(pool, lh))
                    continue;
                float *imp = imp_all + lh * np_max;
                memset(imp, 0, (size_t)np * sizeof *imp);
                for (uint32_t o = 0; o < n_obs; o++) {
                    const float *q = obs_queries + (((size_t)l * n_obs + o) * Hq + (size_t)h * G) * D;
                    kvt__sel_score(&wsel, pool, s, l, h, q, 1, 0, np, &sc);
                    for (uint32_t j = 0; j < np; j++)
                        imp[j] += sc.vote[j];
                }
            }
        }
    }

    /* Pass 1: the device set of every stable head; count
     * what leaves and what arrives. */
    uint64_t n_drop = 0, n_prom = 0;
    for (int pass = 0; pass < 2 && !rc; pass++) {
        for (uint32_t l = 0; l < L && !rc; l++) {
            const uint32_t tokens = s->n_tokens[l], np = kvt__pages_for(pool, tokens);
            for (uint32_t h = 0; h < H && !rc && np; h++) {
                const size_t lh = kvt__lh(pool, l, h);
                if (!kvt__stable(pool, lh))
                    continue;
                const uint32_t K = pol->k[lh], W = pol->window[lh];
                const uint32_t sink = pol->sink[lh], local = pol->local[lh];
                const float *imp = imp_all + lh * np_max;
                const uint64_t kw64 = (uint64_t)K * W;
                const uint32_t kw = kw64 < np ? (uint32_t)kw64 : np;
                const uint32_t nset = kvt__sel_pick(np, tokens, P, kw, sink, local, imp, NULL, 0,
                                                    &sc, set, NULL, NULL);
                for (uint32_t pg = 0; pg < np; pg++) {
                    const size_t e = lh * s->cap_pages + pg;
                    const uint8_t r = s->res[e];
                    const bool want = kvt__in_sorted(set, nset, pg);
                    if (want && !(r & KVT_RES_DEVICE)) {
                        if (pass == 0) {
                            n_prom++;
                        } else {
                            kvt_move m = {seq, l, h, pg,
                                          (r & KVT_RES_HOST) ? KVT_TIER_HOST : KVT_TIER_DISK,
                                          KVT_TIER_DEVICE, 0};
                            rc = kvt__mv_push(&b, &m);
                        }
                    } else if (!want && (r & KVT_RES_DEVICE) && !(r & KVT__RES_BUSY) &&
                               (r & (KVT_RES_HOST | KVT_RES_DISK)) &&
                               !kvt__held_elsewhere(pool, s, lh, pg, true)) {
                        if (pass == 0) {
                            n_drop++;
                        } else {
                            kvt__page_drop(pool, s, e, KVT_TIER_DEVICE);
                            pool->pst.evicted++;
                        }
                    }
                }
                if (pass == 1) {
                    /* The importance orders the host cache, and its top K
                     * pages are the head's first selection. */
                    memcpy(s->tier.imp + lh * s->cap_pages, imp, (size_t)np * sizeof *imp);
                    kvt__host_imp_changed(pool, s, lh, np);
                    uint32_t nk = 0;
                    const uint32_t kk = K < s->sel.topk_cap ? K : s->sel.topk_cap;
                    kvt__sel_pick(np, tokens, P, kk, sink, local, imp, NULL, 0, &sc, tmp,
                                  s->sel.topk + lh * s->sel.topk_cap, &nk);
                    s->sel.topk_n[lh] = nk;
                    s->sel.topk_k[lh] = K + 1u;
                    /* The selection cache's reference: the group mean of
                     * the last observed query, the one next to the first
                     * step's. */
                    kvt__sel_qmean(obs_queries + (((size_t)l * n_obs + n_obs - 1u) * Hq +
                                                  (size_t)h * G) * D,
                                   G, 1, 0, D, s->sel.qref + lh * D);
                }
            }
        }
        if (pass == 0 && n_prom > (uint64_t)pool->tier[KVT_TIER_DEVICE].n_free + n_drop)
            kvt__pfx_make_room(pool, KVT_TIER_DEVICE, n_prom - n_drop);
        if (pass == 0 && n_prom > (uint64_t)pool->tier[KVT_TIER_DEVICE].n_free + n_drop)
            rc = kvt__err(KVT_ENOSPC, "device tier: warm-up places %llu pages, %u blocks are "
                          "free and %llu leave", (unsigned long long)n_prom,
                          pool->tier[KVT_TIER_DEVICE].n_free, (unsigned long long)n_drop);
    }
    free(mem);
    /* CUDA: the steps reuse the top-K sets from the GPU's copy. Without
     * them the first steps rerank; the placement goes on. */
    if (!rc && pool->be->warm_topk && pool->be->warm_topk(pool, s)) {
        for (size_t lh = 0; lh < (size_t)L * H; lh++)
            if (kvt__stable(pool, lh))
                s->sel.topk_k[lh] = 0;
        kvt_clear_error();
    }
    /* Promotions first: their pages are then busy and the host pass below
     * leaves their host copies alone. */
    if (!rc && b.n) {
        kvt_fence f;
        rc = kvt__mover_submit(pool->mover, b.mv, b.n, KVT_SUBMIT_URGENT, NULL, &f, NULL,
                               KVT__OPF_PROMOTE | KVT__OPF_OWNED);
        if (!rc) {
            s->tier.wfence = f;
            pool->pst.promoted += b.n;
        }
    }
    free(b.mv);
    if (!rc && pool->disk)
        rc = kvt__warm_host(pool, s, seq);
    return rc;
}
