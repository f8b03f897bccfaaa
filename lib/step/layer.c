/* The per-layer calls before the attention: kvt_step_append (the step's
 * tokens of every sequence), the selection (score, vote, top-K, or reuse) with the
 * tiered pools' fused recycle and its promotions' fences, and
 * kvt_step_selection_get. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/store.h"
#include "../select/select_int.h"
#include "../backend/backend.h"
#include "../policy/policy_int.h"
#include "../tier/tier.h"
#include "step_int.h"


KVT_API int kvt_step_append(kvt_step *st, uint32_t layer, const void *k, const void *v,
                            kvt_dtype src_dtype, uint64_t seq_stride)
{
    int rc = kvt__step_enter(st, layer);
    if (rc)
        return rc;
    KVT__CHECK_NULL(k);
    KVT__CHECK_NULL(v);
    kvt_pool *p = st->pool;
    const size_t src_elem = kvt_dtype_size(src_dtype);
    if (src_elem == 0)
        return kvt__src_dtype_err(src_dtype);
    const uint64_t dense = (uint64_t)st->H * st->D;
    if (seq_stride == 0)
        seq_stride = dense;
    if (seq_stride < dense)
        return kvt__err(KVT_EINVAL, "seq_stride: %llu is below n_kv_heads * head_dim = %llu",
                        (unsigned long long)seq_stride, (unsigned long long)dense);
    uint64_t span;
    if (!kvt__mul_u64(seq_stride, st->rows, &span) || !kvt__mul_u64(span, src_elem, &span) ||
        span > SIZE_MAX / 2)
        return kvt__err(KVT_EOVERFLOW, "seq_stride: %u rows x %llu elements overflow",
                        st->rows, (unsigned long long)seq_stride);
    {
        const size_t ext = (size_t)(((uint64_t)(st->rows - 1) * seq_stride + dense) * src_elem);
        if ((rc = kvt__not_in_pool(p, k, ext, "k")) || (rc = kvt__not_in_pool(p, v, ext, "v")))
            return rc;
    }
    if (st->read_only)
        return kvt__err(KVT_ESTATE, "step: it selected a layer before any kvt_step_append, so "
                        "it appends nothing (a step appends each layer before selecting it)");
    if (st->n_appended == 0) { /* the first append: the layers start level */
        for (uint32_t i = 0; i < st->n; i++) {
            const kvt__seq *s = st->seqs[i];
            for (uint32_t l = 1; l < st->L; l++)
                if (s->n_tokens[l] != s->n_tokens[0])
                    return kvt__err(KVT_ESTATE, "step: sequence %u's layers hold different "
                                    "lengths (layer 0 %u tokens, layer %u %u); append the "
                                    "missing tokens with kvt_seq_append before a step "
                                    "appends", i, s->n_tokens[0], l, s->n_tokens[l]);
        }
    }
    if (st->appended[layer])
        return kvt__err(KVT_ESTATE, "layer: %u was already appended in this step", layer);
    if (st->sel_layer == layer)
        return kvt__err(KVT_ESTATE, "layer: %u was already selected in this step; append "
                        "before kvt_step_select", layer);
    uint64_t need = 0;
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        const uint32_t t = s->n_tokens[layer], nn = st->nnew[i];
        if ((uint64_t)t + nn > s->max_tokens)
            return kvt__err(KVT_ERANGE, "step: sequence %u's %u token%s pass its limit of %u "
                            "tokens (%u held)", i, nn, nn == 1 ? "" : "s", s->max_tokens, t);
        if (kvt__pages_for(p, t + nn) > s->cap_pages)
            return kvt__err(KVT_EINTERNAL, "step: sequence %u's block table was not "
                            "reserved by the plan", i);
        need += (uint64_t)st->H * (kvt__pages_for(p, t + nn) - kvt__pages_for(p, t));
    }
    if (need > p->tier[KVT_TIER_DEVICE].n_free)
        return kvt__err(KVT_ENOSPC, "device tier: %llu blocks needed for layer %u, %u free",
                        (unsigned long long)need, layer, p->tier[KVT_TIER_DEVICE].n_free);
    if (need > p->meta.n_free)
        return kvt__err(KVT_ENOSPC, "metadata store: %llu pages needed, %u free",
                        (unsigned long long)need, p->meta.n_free);
    if (p->be->step_append) {
        /* A backend's append (CUDA): blocks from the host tables, one append
         * kernel for the batch on the step's stream (task_first holds each
         * sequence's length). */
        uint32_t *cur = st->task_first;
        for (uint32_t i = 0; i < st->n; i++) {
            cur[i] = st->seqs[i]->n_tokens[layer];
            kvt__append_alloc(p, st->seqs[i], layer, st->nnew[i]);
        }
        rc = p->be->step_append(st, layer, k, v, src_dtype, seq_stride, cur);
        if (rc) { /* all or nothing: the new pages go back */
            for (uint32_t i = 0; i < st->n; i++)
                kvt__append_unalloc(p, st->seqs[i], layer, st->nnew[i]);
            return rc;
        }
        for (uint32_t i = 0; i < st->n; i++) {
            st->seqs[i]->n_tokens[layer] += st->nnew[i];
            st->expect[(size_t)i * st->L + layer] += st->nnew[i];
        }
        st->appended[layer] = 1;
        st->n_appended++;
        return 0;
    }
    for (uint32_t i = 0; i < st->n; i++) {
        const size_t off = (size_t)st->row0[i] * seq_stride * src_elem;
        kvt__append_checked(p, st->seqs[i], layer, (const uint8_t *)k + off,
                            (const uint8_t *)v + off, st->nnew[i], src_dtype, seq_stride);
        st->expect[(size_t)i * st->L + layer] += st->nnew[i];
    }
    st->appended[layer] = 1;
    st->n_appended++;
    return 0;
}

/* ---- selection --------------------------------------------------------- */
/* After failed promotions of sequence i: the heads whose pages did not
 * arrive rescore at the next step (for warm-up's, which heads is not known:
 * all of them, and already in this step's later layers, whose reused
 * selections may name the missing pages). Clears the recorded outcomes. */
void kvt__fail_reset(kvt_step *st, uint32_t i)
{
    kvt__seq *s = st->seqs[i];
    if (s->sel.topk_k && st->fcode[i])
        for (uint32_t x = st->pm_off[i]; x < st->pm_off[i] + st->pm_cnt[i]; x++)
            if (st->pmres[x])
                s->sel.topk_k[kvt__lh(st->pool, st->pm[x].layer, st->pm[x].kv_head)] = 0;
    if (st->wcode[i]) {
        if (s->sel.topk_k)
            memset(s->sel.topk_k, 0, (size_t)st->L * st->H * sizeof *s->sel.topk_k);
        memset(st->due + (size_t)i * st->L * st->H, 1, (size_t)st->L * st->H);
    }
    st->fcode[i] = 0;
    st->wcode[i] = 0;
}

bool kvt__pending(kvt_step *st, uint32_t i)
{
    kvt_mover *m = st->pool->mover;
    int code = 0;
    if (st->wf[i] && kvt__mover_fence_done(m, st->wf[i], &code)) {
        st->wf[i] = 0;
        st->wcode[i] = st->wcode[i] ? st->wcode[i] : code;
    }
    if (st->fpend[i] && kvt__mover_fence_done(m, st->fence[i], &code)) {
        st->fpend[i] = 0;
        st->fence[i] = 0;
        st->fcode[i] = code;
    }
    return st->wf[i] || st->fpend[i];
}

/* Waits until no page of sequence i is on its way to the device (warm-up's
 * and this layer's promotions), recording the outcomes; `count`: a decode
 * that waited (kvt_stats.paused_seqs). */
void kvt__settle(kvt_step *st, uint32_t i, bool count)
{
    if (!kvt__pending(st, i))
        return;
    kvt_mover *m = st->pool->mover;
    if (st->wf[i]) {
        int code = kvt__mover_fence_wait(m, st->wf[i]);
        st->wcode[i] = st->wcode[i] ? st->wcode[i] : code;
        st->wf[i] = 0;
    }
    if (st->fpend[i]) {
        st->fcode[i] = kvt__mover_fence_wait(m, st->fence[i]);
        st->fpend[i] = 0;
        st->fence[i] = 0;
    }
    if (count)
        st->pool->pst.paused++;
}

/* The selection's residency stats, then the fused recycle of every due
 * stable head: evicted pages' device blocks go straight to promoted pages,
 * and each sequence's promotions leave as one urgent mover batch. */
static int kvt__recycle(kvt_step *st, uint32_t layer, const uint32_t *sel_pages)
{
    kvt_pool *p = st->pool;
    kvt__arena *dev = &p->tier[KVT_TIER_DEVICE];
    const uint32_t H = st->H;
    size_t k = 0;
    int rc = 0;
    for (uint32_t i = 0; i < st->n && !rc; i++) {
        kvt__seq *s = st->seqs[i];
        if (st->fcode[i]) { /* an earlier layer's failure no decode reported */
            const int32_t w = st->wcode[i];
            st->wcode[i] = 0;
            kvt__fail_reset(st, i);
            st->wcode[i] = w;
        }
        if (st->wf[i]) {
            /* Warm-up's pages still arriving can be neither evicted nor
             * counted: a sequence that reranks a stable head now waits for
             * them here (kvt_step_ready_get told the engine it was not ready). */
            bool due = false;
            for (uint32_t h = 0; h < H && !due; h++)
                due = st->sel_rr[(size_t)i * H + h] && kvt__stable(p, kvt__lh(p, layer, h));
            if (due) {
                kvt__settle(st, i, true);
                if (st->wcode[i]) { /* it failed: every head rescores next step */
                    const int32_t w = st->wcode[i];
                    kvt__fail_reset(st, i);
                    st->wcode[i] = w; /* and the decode reports it */
                }
            }
        }
        st->pm_off[i] = (uint32_t)k;
        st->pm_cnt[i] = 0;
        for (uint32_t h = 0; h < H && !rc; h++) {
            const size_t lh = kvt__lh(p, layer, h), base = lh * s->cap_pages;
            const size_t ih = (size_t)i * H + h;
            if (!kvt__stable(p, lh))
                continue;
            const uint32_t *sel = sel_pages + st->sel_off[ih];
            const uint32_t cnt = st->sel_cnt[ih];
            uint32_t hit = 0;
            for (uint32_t j = 0; j < cnt; j++)
                hit += (s->res[base + sel[j]] & KVT_RES_DEVICE) != 0;
            p->pst.sel_pages += cnt;
            p->pst.sel_resident += hit;
            if (!st->sel_rr[ih])
                continue; /* reuses its top-K pages, already on device */
            uint32_t npro = 0;
            rc = kvt__place_recycle_head(p, s, st->ids[i], i, layer, h, sel, cnt, st->k[lh],
                                         st->ev, st->pml, st->pm + k, st->pmdst + k,
                                         st->pmres + k, st->cap_pm - k, &npro);
            if (rc) {
                if (s->sel.topk_k)
                    s->sel.topk_k[lh] = 0;
                break;
            }
            k += npro;
        }
        const uint32_t off = st->pm_off[i], cnt = (uint32_t)k - off;
        if (cnt && !rc) {
            kvt_fence f;
            rc = kvt__mover_submit(p->mover, st->pm + off, cnt, KVT_SUBMIT_URGENT,
                                   st->pmres + off, &f, st->pmdst + off,
                                   KVT__OPF_PROMOTE | KVT__OPF_HANDED | KVT__OPF_OWNED);
            if (rc) {
                k = off;
            } else {
                st->pm_cnt[i] = cnt;
                st->fence[i] = f;
                st->fpend[i] = 1;
                p->pst.promoted += cnt;
            }
        }
        if (rc) {
            /* Nothing of this sequence was submitted: its handed blocks go
             * back. It and the sequences not reached hold selections whose
             * pages are not all on device: their heads of this layer
             * rescore at the next step. */
            for (uint32_t x = off; x < off + cnt; x++)
                kvt__arena_free(dev, st->pmdst[x]);
            for (uint32_t j = i; j < st->n; j++)
                for (uint32_t h = 0; h < H && st->seqs[j]->sel.topk_k; h++)
                    st->seqs[j]->sel.topk_k[kvt__lh(p, layer, h)] = 0;
        }
    }
    if (rc)
        st->sel_layer = KVT__NO_LAYER;
    return rc;
}

/* Promotions of a layer whose decode never ran land before the next
 * selection. */
static void kvt__settle_orphans(kvt_step *st)
{
    for (uint32_t i = 0; i < st->n; i++)
        if (st->fpend[i]) {
            kvt__settle(st, i, false);
            const int32_t w = st->wcode[i]; /* warm-up's outcome stays for the decode */
            st->wcode[i] = 0;
            kvt__fail_reset(st, i);
            st->wcode[i] = w;
        }
}

int kvt__select(kvt_step *st, uint32_t layer, const float *q)
{
    int rc = kvt__step_enter(st, layer);
    if (rc)
        return rc;
    const bool dense = (st->flags & KVT_STEP_DENSE) != 0;
    KVT__CHECK_NULL(q);
    if (st->n_appended && !st->appended[layer])
        return kvt__err(KVT_ESTATE, "layer: %u was not appended in this step yet (a step "
                        "that appends appends each layer before selecting it)", layer);
    if (!st->n_appended)
        st->read_only = true;
    const kvt__backend *be = st->pool->be;
    if (be->step_select) {
        st->sel_layer = KVT__NO_LAYER;
        st->emptied_layer = KVT__NO_LAYER; /* the selection rewrites the items */
        if (st->tiered)
            kvt__settle_orphans(st);
        memset(st->sim_rr, 0, (size_t)st->n * st->H); /* the interval alone there */
        rc = be->step_select(st, layer, q);
        if (!rc)
            kvt__select_count(st, layer);
        if (!rc && kvt__lower_on_host(st->pool)) {
            /* Lower tiers: the host places the pages, as on the CPU (the
             * fetch brings the votes, the pages' importance, to the host). */
            const uint32_t *sp = NULL;
            rc = be->step_fetch(st, layer, &sp);
            if (!rc)
                kvt__select_imp(st, layer);
            if (!rc && st->tiered)
                rc = kvt__recycle(st, layer, sp);
        }
        if (!rc)
            st->sel_layer = layer;
        return rc;
    }
    /* Offsets from each (sequence, head)'s bound; the plan sized sel_pages
     * for the largest length a sequence can reach in this step. */
    size_t off = 0;
    for (uint32_t i = 0; i < st->n; i++) {
        const uint32_t tokens = st->seqs[i]->n_tokens[layer];
        const uint32_t np = kvt__pages_for(st->pool, tokens);
        for (uint32_t h = 0; h < st->H; h++) {
            const size_t b = (size_t)layer * st->H + h;
            st->sel_off[(size_t)i * st->H + h] = (uint32_t)off;
            off += dense ? np
                         : kvt__sel_bound(np, st->k[b], st->sink[b],
                                          kvt__step_local(st->local[b], tokens, st->nnew[i],
                                                          st->P));
        }
    }
    if (off > st->cap_sel)
        return kvt__err(KVT_EINTERNAL, "step: selection needs %zu entries, the plan sized %zu",
                        off, st->cap_sel);
    if (st->tiered)
        kvt__settle_orphans(st);
    st->layer = layer;
    st->q = q;
    st->sel_layer = KVT__NO_LAYER;
    kvt__select_heads(st);
    kvt__select_count(st, layer);
    kvt__select_imp(st, layer);
    st->sel_layer = layer;
    if (st->prof && !dense && !st->recorded[layer]) {
        st->recorded[layer] = 1;
        if ((rc = kvt__select_record(st, layer)))
            return rc;
    }
    if (st->tiered)
        return kvt__recycle(st, layer, st->sel_pages);
    return 0;
}

KVT_API int kvt_step_select(kvt_step *st, uint32_t layer, const float *q)
{
    return kvt__select(st, layer, q);
}

KVT_API int kvt_step_selection_get(const kvt_step *st, uint32_t layer, uint32_t seq_index,
                                   uint32_t kv_head, uint32_t *pages, uint32_t capacity,
                                   uint32_t *n_pages, uint32_t *reranked)
{
    int rc = kvt__step_args(st, layer, seq_index, kv_head);
    if (rc)
        return rc;
    KVT__CHECK_NULL(n_pages);
    if (st->sel_layer != layer)
        return kvt__err(KVT_ESTATE, "layer: %u has no selection in this step", layer);
    const size_t ih = (size_t)seq_index * st->H + kv_head;
    if (st->pool->be->step_selection) {
        if (capacity)
            KVT__CHECK_NULL(pages);
        rc = st->pool->be->step_selection(st, ih, pages, capacity, n_pages);
        if (!rc && reranked)
            *reranked = st->sel_rr[ih];
        return rc;
    }
    const uint32_t cnt = st->sel_cnt[ih];
    if (cnt > capacity)
        return kvt__err(KVT_ERANGE, "capacity: %u entries, the selection has %u", capacity,
                        cnt);
    if (capacity)
        KVT__CHECK_NULL(pages);
    if (cnt)
        memcpy(pages, st->sel_pages + st->sel_off[ih], cnt * sizeof *pages);
    *n_pages = cnt;
    if (reranked)
        *reranked = st->sel_rr[ih];
    return 0;
}
