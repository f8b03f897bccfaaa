/* The selection of one layer on the host (kvt_step_select's work on the
 * CPU backend), in three passes over the pool's workers:
 *   decide  which (sequence, KV head) rescore: the plan's schedule, then the
 *           selection cache (the group's mean query against the one of the
 *           head's last rerank);
 *   score   the heads that rescore with a key-reading method (TOKEN,
 *           ORACLE) and one query token: their raw scores, page chunks of
 *           KVT__SCORE_CHUNK as tasks, so that a few long heads spread over
 *           every thread (a raw score is per page: the split never changes
 *           it);
 *   pick    per (sequence, head): scores (unless the score pass made them),
 *           the vote and the top-K, or the reuse of the kept set.
 * Then the profiler's records and the counters. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/store.h"
#include "../select/select_int.h"
#include "../policy/policy_int.h"
#include "step_int.h"
#include "../tier/tier.h"

/* cos(a, b) (double sums); 1 when both are zero, 0 when one is; NaN with a
 * non-finite element (the caller reranks on anything but >= threshold). */
static float kvt__cosine(const float *a, const float *b, uint32_t D)
{
    double ab = 0.0, aa = 0.0, bb = 0.0;
    for (uint32_t d = 0; d < D; d++) {
        ab += (double)a[d] * b[d];
        aa += (double)a[d] * a[d];
        bb += (double)b[d] * b[d];
    }
    if (aa == 0.0 || bb == 0.0)
        return aa == bb ? 1.0f : 0.0f;
    return (float)(ab / sqrt(aa * bb));
}

/* The kept top-K set of (s, head b), or NULL (the plan sized the store for
 * this step's largest K). */
static uint32_t *kvt__keep(const kvt__seq *s, size_t b, uint32_t k, uint32_t np)
{
    return s->sel.topk && (k <= s->sel.topk_cap || np <= s->sel.topk_cap)
               ? s->sel.topk + b * s->sel.topk_cap
               : NULL;
}

static const float *kvt__qrows(const kvt_step *st, uint32_t i, uint32_t h)
{
    return st->q + ((size_t)st->row0[i] * st->Hq + (size_t)h * st->G) * st->D;
}

/* Pass 1: sel_rr[ih] = 1 when (sequence i, head h) rescores now: due by the
 * plan, or its query drifted below the head's threshold (sim_rr); the
 * reference query follows every rescore. */
static void kvt__decide_task(void *ctx, uint32_t ih, uint32_t thread)
{
    kvt_step *st = ctx;
    const uint32_t i = ih / st->H, h = ih % st->H, layer = st->layer;
    kvt__seq *s = st->seqs[i];
    const uint32_t np = kvt__pages_for(st->pool, s->n_tokens[layer]), nn = st->nnew[i];
    const size_t b = (size_t)layer * st->H + h;
    st->sel_rr[ih] = 0;
    st->sim_rr[ih] = 0;
    if (!np)
        return;
    bool due = st->due[(size_t)i * st->L * st->H + b] != 0;
    /* The reference follows every rescore of a head with a kept set, cache
     * on or off (a later plan may turn it on). */
    float *qref = kvt__keep(s, b, st->k[b], np) && s->sel.qref ? s->sel.qref + b * st->D
                                                                 : NULL;
    /* Drift matters only where the kept set is reused: not when the budget
     * covers every page (the pick takes them all without scores). */
    const bool test = qref && !due && st->sim[b] > -1.0f &&
                      (uint64_t)st->k[b] + st->sink[b] +
                              kvt__step_local(st->local[b], s->n_tokens[layer], nn, st->P) <
                          np;
    if (test || (qref && due)) {
        float *qm = (float *)(void *)(st->tmem + (size_t)thread * st->tstride);
        kvt__sel_qmean(kvt__qrows(st, i, h), st->G, nn, (size_t)st->Hq * st->D, st->D, qm);
        if (test && !(kvt__cosine(qm, qref, st->D) >= st->sim[b])) {
            due = true;
            st->sim_rr[ih] = 1;
        }
        if (due)
            memcpy(qref, qm, (size_t)st->D * sizeof *qref);
    }
    st->sel_rr[ih] = due;
}

/* Whether (i, h)'s rescore goes through the score pass: a key-reading
 * method, one query token (the raw scores of many rows would not fit the
 * plan's buffer) and more than one chunk of pages. */
static bool kvt__split(const kvt_step *st, uint32_t i, uint32_t np)
{
    return st->raw && st->nnew[i] == 1 && np > KVT__SCORE_CHUNK;
}

/* Pass 2: raw scores of one chunk of pages of a head (tasks in st->stask). */
static void kvt__score_task(void *ctx, uint32_t t, uint32_t thread)
{
    kvt_step *st = ctx;
    const uint32_t ih = st->stask[3 * (size_t)t], pg0 = st->stask[3 * (size_t)t + 1];
    const uint32_t pg1 = st->stask[3 * (size_t)t + 2];
    const uint32_t i = ih / st->H, h = ih % st->H, layer = st->layer;
    const kvt__seq *s = st->seqs[i];
    const uint32_t np = kvt__pages_for(st->pool, s->n_tokens[layer]);
    kvt__sel_scratch sc;
    kvt__sel_scratch_carve(&sc, st->tmem + (size_t)thread * st->tstride, st->G, st->D, np);
    kvt__sel_prep(st->sel, st->pool, kvt__qrows(st, i, h), 1, 0, &sc);
    kvt__sel_raw(st->sel, st->pool, s, layer, h, st->G, pg0, pg1, np,
                 st->raw + st->raw_off[ih], &sc);
}

/* Pass 3: the selection of (sequence, head). */
static void kvt__pick_task(void *ctx, uint32_t ih, uint32_t thread)
{
    kvt_step *st = ctx;
    const kvt_pool *p = st->pool;
    const uint32_t i = ih / st->H, h = ih % st->H, layer = st->layer;
    kvt__seq *s = st->seqs[i];
    const uint32_t tokens = s->n_tokens[layer], nn = st->nnew[i];
    const uint32_t np = kvt__pages_for(p, tokens);
    uint32_t *out = st->sel_pages + st->sel_off[ih];
    if (st->flags & KVT_STEP_DENSE) {
        for (uint32_t j = 0; j < np; j++)
            out[j] = j;
        st->sel_cnt[ih] = np;
        return;
    }
    const size_t b = (size_t)layer * st->H + h;
    const uint32_t k = st->k[b], sink = st->sink[b];
    const uint32_t local = kvt__step_local(st->local[b], tokens, nn, st->P);
    kvt__sel_scratch sc;
    kvt__sel_scratch_carve(&sc, st->tmem + (size_t)thread * st->tstride, st->G * nn, st->D, np);
    uint32_t *keep = kvt__keep(s, b, k, np);
    if (st->sel_rr[ih]) {
        if (kvt__split(st, i, np)) /* the score pass made the raw scores */
            kvt__sel_vote(st->sel, p, st->raw + st->raw_off[ih], st->G, np, sc.vote);
        else
            kvt__sel_score(st->sel, p, s, layer, h, kvt__qrows(st, i, h), nn,
                           (size_t)st->Hq * st->D, np, &sc);
        uint32_t nk = 0;
        st->sel_cnt[ih] = kvt__sel_pick(np, tokens, st->P, k, sink, local, sc.vote, NULL, 0,
                                        &sc, out, keep, &nk);
        /* The score is the page's importance for the host cache's eviction
         * (lib/tier): the last word the selector had on it. */
        memcpy(s->tier.imp + b * s->cap_pages, sc.vote, (size_t)np * sizeof *sc.vote);
        if (keep) {
            s->sel.topk_n[b] = nk;
            s->sel.topk_k[b] = k + 1u;
        } else if (s->sel.topk) {
            s->sel.topk_k[b] = 0; /* nothing kept: rerank next time */
        }
    } else if ((uint64_t)k + sink + local >= np) {
        /* The budget covers every page (pages that filled since the last
         * rerank included): all of them, as a rescore would choose. */
        for (uint32_t j = 0; j < np; j++)
            out[j] = j;
        st->sel_cnt[ih] = np;
    } else {
        st->sel_cnt[ih] = kvt__sel_pick(np, tokens, st->P, k, sink, local, NULL, keep,
                                        keep ? s->sel.topk_n[b] : 0, &sc, out, NULL, NULL);
    }
    for (uint32_t j = 0; j < st->sel_cnt[ih]; j++) /* recency, the eviction tie-break */
        s->tier.use[b * s->cap_pages + out[j]] = p->clock;
}

void kvt__select_heads(kvt_step *st)
{
    const uint32_t nh = st->n * st->H;
    if (st->flags & KVT_STEP_DENSE) {
        memset(st->sel_rr, 0, nh);
        memset(st->sim_rr, 0, nh);
        kvt__tp_run(&st->pool->tp, kvt__pick_task, st, nh);
        return;
    }
    /* A mean and a dot product per head: a few heads are decided here,
     * without waking the workers for them. */
    if ((uint64_t)nh * st->G * st->D <= 65536u)
        for (uint32_t ih = 0; ih < nh; ih++)
            kvt__decide_task(st, ih, 0);
    else
        kvt__tp_run(&st->pool->tp, kvt__decide_task, st, nh);
    if (st->raw) {
        uint64_t off = 0;
        uint32_t nt = 0;
        for (uint32_t ih = 0; ih < nh; ih++) {
            const uint32_t i = ih / st->H;
            const uint32_t np = kvt__pages_for(st->pool, st->seqs[i]->n_tokens[st->layer]);
            if (!st->sel_rr[ih] || !kvt__split(st, i, np))
                continue;
            st->raw_off[ih] = off;
            off += (uint64_t)st->G * np;
            for (uint32_t pg = 0; pg < np; pg += KVT__SCORE_CHUNK) {
                st->stask[3 * (size_t)nt] = ih;
                st->stask[3 * (size_t)nt + 1] = pg;
                st->stask[3 * (size_t)nt + 2] = np - pg < KVT__SCORE_CHUNK ? np
                                                                            : pg + KVT__SCORE_CHUNK;
                nt++;
            }
        }
        /* The plan sized both for every sequence's longest layer. */
        if (nt)
            kvt__tp_run(&st->pool->tp, kvt__score_task, st, nt);
    }
    kvt__tp_run(&st->pool->tp, kvt__pick_task, st, nh);
}

void kvt__select_imp(kvt_step *st, uint32_t layer)
{
    if (!st->pool->disk)
        return;
    for (uint32_t ih = 0; ih < st->n * st->H; ih++)
        if (st->sel_rr[ih]) {
            kvt__seq *s = st->seqs[ih / st->H];
            kvt__host_imp_changed(st->pool, s, kvt__lh(st->pool, layer, ih % st->H),
                                  kvt__pages_for(st->pool, s->n_tokens[layer]));
        }
}

int kvt__select_record(kvt_step *st, uint32_t layer)
{
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        const uint32_t tokens = s->n_tokens[layer];
        const uint32_t np = kvt__pages_for(st->pool, tokens);
        for (uint32_t h = 0; h < st->H; h++) {
            const size_t ih = (size_t)i * st->H + h, b = (size_t)layer * st->H + h;
            if (!st->sel_rr[ih])
                continue;
            const uint32_t *sel = st->sel_pages + st->sel_off[ih];
            uint32_t nk = 0;
            const uint32_t local = kvt__step_local(st->local[b], tokens, st->nnew[i], st->P);
            for (uint32_t j = 0; j < st->sel_cnt[ih]; j++)
                if (!kvt__forced(sel[j], np, tokens, st->P, st->sink[b], local))
                    st->rec[nk++] = sel[j];
            /* Every forced page is selected: candidates = np - forced. */
            const uint32_t n_cand = np - (st->sel_cnt[ih] - nk);
            int rc = kvt__profiler_add(st->prof, st->ids[i], layer, h, st->rec, nk, n_cand);
            if (rc) {
                char why[256];
                snprintf(why, sizeof why, "%s", kvt_last_error());
                return kvt__err(KVT_EINTERNAL, "step: recording into the profiler failed: %s",
                                why);
            }
        }
    }
    return 0;
}

void kvt__select_count(kvt_step *st, uint32_t layer)
{
    /* A layer selected again in the step counts once: its first selection. */
    if ((st->flags & KVT_STEP_DENSE) || st->counted[layer])
        return;
    st->counted[layer] = 1;
    kvt_pool *p = st->pool;
    const size_t n = (size_t)st->n * st->H;
    p->pst.sel_heads += n;
    for (size_t ih = 0; ih < n; ih++) {
        p->pst.reranked += st->sel_rr[ih];
        p->pst.sim_reranked += st->sim_rr[ih];
    }
}
