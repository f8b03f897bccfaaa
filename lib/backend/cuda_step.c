/* The CUDA backend's per-layer calls (see cuda_pool.c for the design): the
 * plan's item arrays and the append, selection, decode, selection readback
 * and finish of a step on its stream, and for pools with lower tiers the
 * selection brought back to the host and the placed block lists. */
#include "cuda_int.h"
#include "../select/select_int.h"

/* ---- steps --------------------------------------------------------------- */

/* The most device memory a step reserves for the raw scores of a TOKEN /
 * ORACLE SOFTVOTE (n_items * np_max * G floats; larger batches read the
 * keys twice instead). */
#define KVT__CUP_SCORE_WORK_MAX ((size_t)256 << 20)

/* Queues the upload of n items from a pinned slice to its device copy. */
int kvt__cup_items_up(void *d, const void *h, size_t bytes, void *stream)
{
    const kvt__cu_copy cp = {(uint64_t)(uintptr_t)h, (uint64_t)(uintptr_t)d, bytes};
    return bytes ? kvt__cu_copy_memcpy(&cp, 1, stream) : 0;
}

int kvt__cuda_step_plan(kvt_step *st, void *stream)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t L = st->L, H = st->H, P = st->P;
    int rc = kvt__cu_set_device(c->device);
    if (rc)
        return rc;
    if (c->done_pending) { /* the last step's kernels read the pinned arrays */
        if ((rc = kvt__cu_event_sync(c->done)))
            return rc;
        c->done_pending = false;
    }
    uint32_t kmax = 0;
    if (st->k)
        for (size_t b = 0; b < (size_t)L * H; b++)
            kmax = st->k[b] > kmax ? st->k[b] : kmax;
    uint64_t pages = 0;
    uint32_t np_max = 1;
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i];
        if ((rc = kvt__cup_slot_state(p, s, kmax)) || (rc = kvt__cup_tab_place(p, s)))
            return rc;
        uint32_t tmax = 0;
        for (uint32_t l = 0; l < L; l++)
            tmax = s->n_tokens[l] > tmax ? s->n_tokens[l] : tmax;
        const uint32_t np = kvt__pages_for(p, tmax + st->nnew[i]);
        np_max = np > np_max ? np : np_max;
        pages += (uint64_t)np * H;
    }
    /* Per layer: an item per (sequence, head); with several tokens per
     * sequence (kvt__cuda_step_select) also an attention item per (token,
     * head), and room for every page the appends open. */
    const size_t items = (size_t)(st->rows == st->n ? st->n : st->rows + st->n) * H;
    if (items > c->cap_items) {
        const size_t li = (size_t)L * items;
        c->cap_items = 0;
        if ((rc = kvt__cup_pin_grow((void **)&c->h_app, li, sizeof *c->h_app)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_sc, li, sizeof *c->h_sc)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_tk, li, sizeof *c->h_tk)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_sf, li, sizeof *c->h_sf)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_at, li, sizeof *c->h_at)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_app, 0, li * sizeof *c->d_app, NULL)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_sc, 0, li * sizeof *c->d_sc, NULL)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_tk, 0, li * sizeof *c->d_tk, NULL)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_sf, 0, li * sizeof *c->d_sf, NULL)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_at, 0, li * sizeof *c->d_at, NULL)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_sdev, li, sizeof *c->h_sdev)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_smeta, li, sizeof *c->h_smeta)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_rg, li, sizeof *c->h_rg)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_nsel, 0, items * 4, NULL)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_ntopk, 0, items * 4, NULL)))
            return rc;
        c->cap_items = items;
    }
    if (pages > c->cap_pages) {
        c->cap_pages = 0;
        if ((rc = kvt__cup_quiesce(c)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_vote, 0, pages * sizeof(float), NULL)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_sel, 0, pages * 4, NULL)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_topk, 0, pages * 4, NULL)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_blocks, 0, pages * 4, NULL)) ||
            (rc = kvt__cup_dev_grow((void **)&c->d_ntok, 0, pages * 4, NULL)))
            return rc;
        c->cap_pages = pages;
    }
    /* The decode's arguments as kvt__cuda_step_decode passes them (the
     * engine's pointers are not known yet: placeholders). */
    kvt__cu_attn_args a = {c->d_at, (uint32_t)items, st->G, st->D, P, p->g.dtype, st->scale,
                           np_max, 0, (const float *)c->d_dev, (float *)c->d_dev, NULL,
                           c->d_blocks, c->d_ntok, c->d_dev, p->block_bytes, NULL};
    size_t work = kvt__cu_attn_workspace_bytes(&a);
    if (st->sel && !(st->flags & KVT_STEP_DENSE)) {
        /* The decode's workspace also holds the raw scores between the
         * passes of a TOKEN / ORACLE SOFTVOTE (kvt__cuda_step_select; the
         * score runs before the decode on the step's stream), up to
         * KVT__CUP_SCORE_WORK_MAX: above it the scoring reads the keys
         * twice instead. */
        const kvt__cu_score_args sa = {
            .n_items = st->n * H, .G = st->G, .D = st->D, .dtype = p->g.dtype,
            .method = st->sel->method, .vote = st->sel->vote, .vote_scale = st->sel->vote_scale,
            .max_pages = np_max, .meta_bytes = p->meta_bytes, .meta_slots = p->meta.n_blocks};
        const size_t sw = kvt__cu_score_workspace_bytes(&sa);
        if (sw > work && sw <= KVT__CUP_SCORE_WORK_MAX)
            work = sw;
    }
    /* Every launch of the step's decode splits as this one would, so a
     * launch over part of the batch (ready-first) fits the workspace. */
    const uint32_t at_sp = kvt__cu_attn_split_pages(&a);
    if (work > c->cap_work) {
        if ((rc = kvt__cup_quiesce(c)) || (rc = kvt__cup_dev_grow(&c->d_work, 0, work, NULL)))
            return rc;
        c->cap_work = work;
    }
    if (c->lower && (items > c->cap_hi || pages > c->cap_hp)) {
        /* The selection's way back to the host and the block list. */
        if ((rc = kvt__cup_guard_wait(&c->g_cl)))
            return rc;
        const size_t hi = items > c->cap_hi ? items : c->cap_hi;
        const size_t hp = pages > c->cap_hp ? pages : c->cap_hp;
        c->cap_hi = c->cap_hp = 0;
        if ((rc = kvt__cup_pin_grow((void **)&c->h_sel, hp, sizeof *c->h_sel)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_blk, hp, sizeof *c->h_blk)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_vote, hp, sizeof *c->h_vote)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_nsel, 2 * hi, sizeof *c->h_nsel)) ||
            (rc = kvt__cup_pin_grow((void **)&c->h_cl, 3 * hi + 2, sizeof *c->h_cl)))
            return rc;
        c->cap_hi = hi;
        c->cap_hp = hp;
    }
    /* Table entries the host changed between steps (moves applied,
     * evictions) reach the GPU copies before the step's first kernel. */
    if ((rc = kvt__cup_tab_flush(p, st->seqs, st->n, 0, L, stream ? stream : c->stream)))
        return rc;
    c->np_max = np_max;
    c->at_sp = at_sp;
    c->sst = stream ? stream : c->stream; /* the step's work goes there from now */
    c->sync_calls = stream == NULL;
    memset(c->selected, 0, L);
    return 0;
}

int kvt__cuda_seq_pop(kvt_pool *p, kvt__seq *s, uint32_t layer)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t H = p->g.n_kv_heads, P = p->g.page_tokens;
    const uint32_t n = s->n_tokens[layer];
    if (n == 0)
        return 0;
    int rc = kvt__cu_set_device(c->device);
    if (!rc) /* the step's appends (and everything before them) have landed */
        rc = kvt__cu_stream_sync(c->sst ? c->sst : c->stream);
    if (rc)
        return rc;
    const uint32_t pos = n - 1, pg = pos / P, slot = pos % P;
    if (slot == 0) { /* the token opened its page: the entries go back */
        s->n_tokens[layer] = pos;
        kvt__append_unalloc(p, s, layer, 1);
        return 0;
    }
    /* The page's metadata and accumulators from the rows still stored
     * (cuda_share.c, as a truncation does). */
    for (uint32_t h = 0; h < H && !rc; h++)
        rc = kvt__cuda_page_rebuild(p, s, kvt__lh(p, layer, h), pg, slot);
    if (!rc)
        s->n_tokens[layer] = pos;
    return rc;
}

int kvt__cuda_step_append(kvt_step *st, uint32_t layer, const void *k, const void *v,
                          kvt_dtype src_dtype, uint64_t seq_stride, const uint32_t *cur)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H, D = st->D, P = st->P;
    const size_t L0 = (size_t)layer * c->cap_items;
    kvt__cu_append_item *it = c->h_app + L0;
    uint32_t *sdev = c->h_sdev + L0, *smeta = c->h_smeta + L0;
    kvt__cu_range *rg = c->h_rg + L0;
    uint32_t nr = 0;
    int rc = kvt__cu_set_device(c->device);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        const uint32_t slot = kvt__cup_slot(p, s), nn = st->nnew[i];
        /* The pages the tokens open: from the first page boundary at or
         * after cur[i] to the page of the last token. */
        const uint32_t pg0 = (cur[i] + P - 1) / P, pg1 = (cur[i] + nn - 1) / P;
        for (uint32_t h = 0; h < H; h++) {
            const size_t lh = kvt__lh(p, layer, h);
            for (uint32_t pg = pg0; pg <= pg1; pg++) { /* their entries go up */
                const size_t e = lh * s->cap_pages + pg;
                sdev[nr] = s->dev_block[e];
                smeta[nr] = s->meta_slot[e];
                rg[nr] = (kvt__cu_range){nr, s->be.cu_off + e, 1, 0};
                nr++;
            }
            it[(size_t)i * H + h] = (kvt__cu_append_item){
                (uint64_t)st->row0[i] * seq_stride + (uint64_t)h * D, seq_stride,
                s->be.cu_off + lh * s->cap_pages, ((uint64_t)slot * c->LH + lh) * 3u * D,
                cur[i], nn};
        }
    }
    if (nr && ((rc = kvt__cu_table_sync(sdev, c->d_tab, rg, nr, c->sst)) ||
               (rc = kvt__cu_table_sync(smeta, c->d_mtab, rg, nr, c->sst))))
        return rc;
    kvt__cu_append_item *dit = c->d_app + L0;
    if ((rc = kvt__cup_items_up(dit, it, (size_t)st->n * H * sizeof *it, c->sst)))
        return rc;
    kvt__cu_append_args a = {
        .d_items = dit, .n_items = st->n * H, .D = D, .P = P, .dtype = p->g.dtype,
        .src_dtype = src_dtype, .d_k = k, .d_v = v, .d_dev_table = c->d_tab,
        .d_meta_table = c->d_mtab, .d_dev_base = c->d_dev, .block_bytes = p->block_bytes,
        .d_meta_base = c->d_meta, .meta_bytes = p->meta_bytes, .meta_slots = p->meta.n_blocks,
        .d_acc = c->d_acc, .max_tokens = st->rmax};
    rc = kvt__cu_append(&a, c->sst);
    if (!rc && c->sync_calls) /* no engine stream to order with: finish here */
        rc = kvt__cu_stream_sync(c->sst);
    return rc;
}

int kvt__cuda_step_select(kvt_step *st, uint32_t layer, const float *q)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H, G = st->G, D = st->D, P = st->P;
    const bool dense = (st->flags & KVT_STEP_DENSE) != 0;
    const size_t L0 = (size_t)layer * c->cap_items;
    kvt__cu_score_item *sc = c->h_sc + L0;
    kvt__cu_topk_item *tk = c->h_tk + L0;
    kvt__cu_sf_item *sf = c->h_sf + L0;
    /* Several tokens per sequence (dense steps): the attention items are per
     * (token, head), built here with each token's causal cut; the finish
     * writes its page counts to the (sequence, head) items after them. */
    const bool multi = st->rows != st->n;
    kvt__cu_attn_item *atk = c->h_at + L0;
    kvt__cu_attn_item *at = multi ? atk + (size_t)st->rows * H : atk;
    int rc = kvt__cu_set_device(c->device);
    /* A layer selected again in the same step: its pinned items may still
     * be read by the queued work of the first selection. */
    if (!rc && c->selected[layer])
        rc = kvt__cu_stream_sync(c->sst);
    if (rc)
        return rc;
    uint64_t off = 0;
    uint32_t n_rr = 0, np_max = 1;
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i];
        const uint32_t slot = kvt__cup_slot(p, s), tokens = s->n_tokens[layer];
        const uint32_t np = kvt__pages_for(p, tokens);
        np_max = np > np_max ? np : np_max;
        for (uint32_t h = 0; h < H; h++) {
            const size_t ih = (size_t)i * H + h, lh = kvt__lh(p, layer, h);
            const uint32_t k = dense ? 0 : st->k[lh], sink = dense ? 0 : st->sink[lh];
            const uint32_t local = dense ? 0 : st->local[lh];
            const bool due = st->due[(size_t)i * st->L * H + lh] != 0;
            uint32_t mode;
            /* The rule of the CPU backend's kvt__sel_task. */
            if (dense || (!(due && np) && (uint64_t)k + sink + local >= np))
                mode = KVT__CU_SF_ALL;
            else
                mode = due ? KVT__CU_SF_RERANK : KVT__CU_SF_REUSE;
            st->sel_rr[ih] = mode == KVT__CU_SF_RERANK;
            st->sel_off[ih] = (uint32_t)off;
            const uint32_t scored = mode == KVT__CU_SF_RERANK ? np : 0;
            n_rr += scored != 0;
            /* table_off indexes the device table (TOKEN, ORACLE) and the
             * metadata table alike: the table heap holds both at one offset. */
            sc[ih] = (kvt__cu_score_item){((uint64_t)i * st->Hq + (uint64_t)h * G) * D,
                                          s->be.cu_off + lh * s->cap_pages, off, scored, tokens};
            tk[ih] = (kvt__cu_topk_item){off, off, scored, tokens, k, sink, local, 0};
            sf[ih] = (kvt__cu_sf_item){off,
                                       ((uint64_t)slot * c->LH + lh) * c->kcap,
                                       s->be.cu_off + lh * s->cap_pages,
                                       (uint32_t)(slot * c->LH + lh), mode, np, tokens, sink,
                                       local};
            at[ih] = (kvt__cu_attn_item){((uint64_t)i * st->Hq + (uint64_t)h * G) * D,
                                         ((uint64_t)i * st->Hq + (uint64_t)h * G) * D,
                                         (uint64_t)i * st->Hq + (uint64_t)h * G, off, 0, 0};
            for (uint32_t j = 0; multi && j < st->nnew[i]; j++) {
                /* Token j sees positions < lim: pages 0 .. pl, the last cut. */
                const uint64_t row = (uint64_t)st->row0[i] + j;
                const uint32_t nn = st->nnew[i];
                const uint32_t lim = tokens + j + 1u > nn ? tokens + j + 1u - nn : 0u;
                const uint32_t pl = lim ? (lim - 1u) / P : 0u;
                atk[row * H + h] = (kvt__cu_attn_item){(row * st->Hq + (uint64_t)h * G) * D,
                                                       (row * st->Hq + (uint64_t)h * G) * D,
                                                       row * st->Hq + (uint64_t)h * G, off,
                                                       lim ? pl + 1u : 0u, lim - pl * P};
            }
            off += np ? np : 1;
        }
    }
    if (off > c->cap_pages)
        return kvt__err(KVT_EINTERNAL, "step: selection needs %llu entries, the plan sized %zu",
                        (unsigned long long)off, c->cap_pages);
    const uint32_t items = st->n * H;
    if ((n_rr && (rc = kvt__cup_items_up(c->d_sc + L0, sc, items * sizeof *sc, c->sst))) ||
        (rc = kvt__cup_items_up(c->d_tk + L0, tk, items * sizeof *tk, c->sst)) ||
        (rc = kvt__cup_items_up(c->d_sf + L0, sf, items * sizeof *sf, c->sst)) ||
        (rc = kvt__cup_items_up(c->d_at + L0, atk,
                                (multi ? (size_t)st->rows * H + items : items) * sizeof *at,
                                c->sst)))
        return rc;
    if (n_rr) {
        kvt__cu_score_args sa = {
            .d_items = c->d_sc + L0, .n_items = items, .G = G, .D = D, .dtype = p->g.dtype,
            .method = st->sel->method, .vote = st->sel->vote, .vote_scale = st->sel->vote_scale,
            .max_pages = np_max, .d_q = q, .d_meta_table = c->d_mtab, .d_meta_base = c->d_meta,
            .meta_bytes = p->meta_bytes, .meta_slots = p->meta.n_blocks, .d_vote = c->d_vote};
        /* TOKEN and ORACLE read the keys of the pages the device table
         * names. The host tables name a device block only once its bytes
         * are there (a move to the device sets it when its copy has landed:
         * a page only on host or disk, or KVT__RES_INBOUND, has 0), but the
         * GPU copy of the table syncs at the plan and at each layer's
         * placement: this layer's entries changed since (moves applied by
         * the mover) go up first, so no freed and reused block is read. */
        const size_t ws = kvt__cu_score_workspace_bytes(&sa);
        const kvt__cu_score_keys ka = {c->d_tab, c->d_dev, p->block_bytes, P, 0,
                                       ws && ws <= c->cap_work ? (float *)c->d_work : NULL};
        const bool keys = st->sel->method == KVT_SCORE_TOKEN || st->sel->method == KVT_SCORE_ORACLE;
        if (keys && c->lower &&
            (rc = kvt__cup_tab_flush(p, st->seqs, st->n, layer, layer + 1u, c->sst)))
            return rc;
        if ((rc = kvt__cu_score_ex(&sa, keys ? &ka : NULL, c->sst)))
            return rc;
    }
    kvt__cu_topk_args ta = {c->d_tk + L0, items, P, np_max, c->d_vote, c->d_sel, c->d_nsel, c->d_topk,
                            c->d_ntopk};
    if ((rc = kvt__cu_topk(&ta, c->sst)))
        return rc;
    kvt__cu_sf_args fa = {c->d_sf + L0, items, P, np_max, c->kcap, c->d_sel, c->d_nsel,
                          c->d_topk, c->d_ntopk, c->d_saved, c->d_nsaved, c->d_tab, c->d_blocks,
                          c->d_ntok, c->d_at + L0 + (multi ? (size_t)st->rows * H : 0)};
    rc = kvt__cu_sel_finish(&fa, c->sst);
    /* The saved set is this K's once the finish is queued; a failed launch
     * may have left it half written: rerank next time. */
    for (uint32_t i = 0; i < st->n; i++)
        for (uint32_t h = 0; h < H && st->seqs[i]->sel.topk; h++)
            if (st->sel_rr[(size_t)i * H + h])
                st->seqs[i]->sel.topk_k[kvt__lh(p, layer, h)] =
                    rc ? 0u : st->k[kvt__lh(p, layer, h)] + 1u;
    if (!rc)
        c->selected[layer] = 1;
    if (!rc && c->sync_calls)
        rc = kvt__cu_stream_sync(c->sst);
    return rc;
}

int kvt__cuda_step_decode(kvt_step *st, uint32_t layer, const float *q, float *out, float *lse,
                          const uint8_t *run)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H;
    kvt__cu_attn_item *d_at = c->d_at + (size_t)layer * c->cap_items;
    int rc = kvt__cu_set_device(c->device);
    if (rc)
        return rc;
    /* Sequences emptied (run 2): their items' page counts (written by the
     * selection's finish on the GPU) become 0, which the kernel answers
     * with zeros and -infinity. */
    for (uint32_t i = 0; run && i < st->n && !rc; i++) {
        if (run[i] != 2)
            continue;
        for (uint32_t h = 0; h < st->nnew[i] * H && !rc; h++) {
            kvt__cu_attn_item *it = d_at + (size_t)st->row0[i] * H + h;
            const kvt__cu_copy cp = {(uint64_t)(uintptr_t)c->h_zero,
                                     (uint64_t)(uintptr_t)&it->n_pages, sizeof it->n_pages};
            rc = kvt__cu_copy_memcpy(&cp, 1, c->sst);
        }
    }
    /* One launch per run of consecutive sequences in the call (the items
     * of sequence i are [row0 * H, (row0 + n_new) * H), row0 its first
     * row); every launch splits pages as the whole batch would (c->at_sp),
     * within the plan's workspace. */
    for (uint32_t i0 = 0; i0 < st->n && !rc;) {
        if (run && !run[i0]) {
            i0++;
            continue;
        }
        uint32_t i1 = i0 + 1;
        while (i1 < st->n && (!run || run[i1]))
            i1++;
        const uint32_t r0 = st->row0[i0], r1 = st->row0[i1 - 1] + st->nnew[i1 - 1];
        kvt__cu_attn_args a = {d_at + (size_t)r0 * H, (r1 - r0) * H, st->G, st->D, st->P,
                               p->g.dtype, st->scale, c->np_max, c->at_sp, q, out, lse,
                               c->d_blocks, c->d_ntok, c->d_dev, p->block_bytes, c->d_work};
        rc = kvt__cu_attn(&a, c->sst);
        i0 = i1;
    }
    if (!rc && c->sync_calls)
        rc = kvt__cu_stream_sync(c->sst);
    return rc;
}

int kvt__cuda_step_selection(const kvt_step *st, size_t ih, uint32_t *pages, uint32_t capacity,
                             uint32_t *n_pages)
{
    struct kvt__cuda *c = st->pool->cu;
    uint32_t n;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cu_stream_sync(c->sst);
    if (!rc)
        rc = kvt__cu_copy_sync(&n, c->d_nsel + ih, sizeof n, c->sst);
    if (rc)
        return rc;
    if (n == UINT32_MAX)
        return kvt__err(KVT_EINTERNAL, "step: the saved top-K set outgrew its store");
    if (n > capacity)
        return kvt__err(KVT_ERANGE, "capacity: %u entries, the selection has %u", capacity, n);
    if (n && (rc = kvt__cu_copy_sync(pages, c->d_sel + st->sel_off[ih], n * sizeof *pages,
                                     c->sst)))
        return rc;
    *n_pages = n;
    return 0;
}

int kvt__cuda_step_finish(kvt_step *st)
{
    struct kvt__cuda *c = st->pool->cu;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cu_event_record(c->done, c->sst);
    c->done_pending = rc == 0;
    if (rc) /* nothing tells when the step's kernels end: wait for them */
        (void)kvt__cup_quiesce(c);
    c->sst = NULL; /* `done` covers its work; the engine may destroy the stream */
    return rc;
}

/* ---- pools with lower tiers: placement on the host ------------------------ */

int kvt__cuda_step_fetch(kvt_step *st, uint32_t layer, const uint32_t **sel)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H;
    const bool dense = (st->flags & KVT_STEP_DENSE) != 0;
    const size_t items = (size_t)st->n * H;
    int rc = kvt__cu_set_device(c->device);
    if (rc)
        return rc;
    if (items > c->cap_hi)
        return kvt__err(KVT_EINTERNAL, "step: %zu selections, the plan sized %zu", items,
                        c->cap_hi);
    if ((rc = kvt__cup_guard_wait(&c->g_cl))) /* the last block list went up */
        return rc;
    /* One copy kernel brings back, per (sequence, head), the selection's
     * bound of entries and, for reranked heads, the votes and the top-K
     * part, plus the counts. */
    uint32_t nc = 0;
    c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)c->d_nsel,
                                   (uint64_t)(uintptr_t)c->h_nsel, items * sizeof(uint32_t)};
    c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)c->d_ntopk,
                                   (uint64_t)(uintptr_t)(c->h_nsel + items),
                                   items * sizeof(uint32_t)};
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        const uint32_t np = kvt__pages_for(p, s->n_tokens[layer]);
        for (uint32_t h = 0; h < H; h++) {
            const size_t ih = (size_t)i * H + h, lh = kvt__lh(p, layer, h);
            const uint32_t off = st->sel_off[ih];
            const uint32_t b = dense ? np : kvt__sel_bound(np, st->k[lh], st->sink[lh], st->local[lh]);
            if (off + (uint64_t)(np ? np : 1) > c->cap_hp)
                return kvt__err(KVT_EINTERNAL, "step: selection entries past the %zu the plan "
                                "sized", c->cap_hp);
            if (b)
                c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)(c->d_sel + off),
                                               (uint64_t)(uintptr_t)(c->h_sel + off),
                                               (uint64_t)b * 4u};
            if (st->sel_rr[ih] && np) {
                const uint32_t kk = st->k[lh] < np ? st->k[lh] : np;
                c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)(c->d_vote + off),
                                               (uint64_t)(uintptr_t)(c->h_vote + off),
                                               (uint64_t)np * 4u};
                if (kk)
                    c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)(c->d_topk + off),
                                                   (uint64_t)(uintptr_t)(c->h_blk + off),
                                                   (uint64_t)kk * 4u};
            }
        }
    }
    if ((rc = kvt__cu_copy_kernel(c->h_cl, nc, 0, 0, c->sst)) ||
        (rc = kvt__cu_stream_sync(c->sst))) /* the host decides what moves */
        return rc;
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i];
        const uint32_t np = kvt__pages_for(p, s->n_tokens[layer]);
        for (uint32_t h = 0; h < H; h++) {
            const size_t ih = (size_t)i * H + h, lh = kvt__lh(p, layer, h);
            const uint32_t n = c->h_nsel[ih];
            if (n == UINT32_MAX)
                return kvt__err(KVT_EINTERNAL, "step: the saved top-K set outgrew its store");
            const uint32_t b = dense ? np : kvt__sel_bound(np, st->k[lh], st->sink[lh], st->local[lh]);
            if (n > b)
                return kvt__err(KVT_EINTERNAL, "step: sequence %u head %u selected %u pages, "
                                "more than the bound %u", i, h, n, b);
            st->sel_cnt[ih] = n;
            /* The selected pages' recency, the host cache's eviction order
             * after importance, as on the CPU (lib/step/select.c). */
            for (uint32_t j = 0; j < n; j++)
                s->tier.use[lh * s->cap_pages + c->h_sel[st->sel_off[ih] + j]] = p->clock;
            /* The votes are the pages' importance (the host cache's
             * eviction order and lookahead eviction), as on the CPU. */
            if (!st->sel_rr[ih] || !np)
                continue;
            memcpy(s->tier.imp + lh * s->cap_pages, c->h_vote + st->sel_off[ih],
                   (size_t)np * sizeof(float));
            /* The host keeps the top-K part too, as the CPU backend does:
             * the trim after a prefill keeps those pages on device. */
            const uint32_t k = st->k[lh], nk = c->h_nsel[items + ih];
            if (s->sel.topk && (k <= s->sel.topk_cap || np <= s->sel.topk_cap) && nk <= s->sel.topk_cap) {
                memcpy(s->sel.topk + lh * s->sel.topk_cap, c->h_blk + st->sel_off[ih],
                       (size_t)nk * sizeof(uint32_t));
                s->sel.topk_n[lh] = nk;
            } else if (s->sel.topk) {
                s->sel.topk_k[lh] = 0; /* the GPU's set is kept; the host's is not */
            }
        }
    }
    *sel = c->h_sel;
    return 0;
}

int kvt__cuda_step_place(kvt_step *st, uint32_t layer, const uint8_t *run, uint32_t *missing)
{
    kvt_pool *p = st->pool;
    struct kvt__cuda *c = p->cu;
    const uint32_t H = st->H;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cup_tab_flush(p, st->seqs, st->n, layer, layer + 1u, c->sst);
    if (!rc)
        rc = kvt__cup_guard_wait(&c->g_cl);
    if (rc)
        return rc;
    uint32_t miss = 0, nc = 0;
    for (uint32_t i = 0; i < st->n; i++) {
        const kvt__seq *s = st->seqs[i];
        if (run && run[i] != 1)
            continue;
        for (uint32_t h = 0; h < H; h++) {
            const size_t ih = (size_t)i * H + h;
            const size_t base = kvt__lh(p, layer, h) * s->cap_pages;
            const uint32_t off = st->sel_off[ih], n = st->sel_cnt[ih];
            for (uint32_t j = 0; j < n; j++) {
                const uint32_t blk = s->dev_block[base + c->h_sel[off + j]];
                miss += blk == 0; /* block 0 is the zeroed null block */
                c->h_blk[off + j] = blk;
            }
            if (n)
                c->h_cl[nc++] = (kvt__cu_copy){(uint64_t)(uintptr_t)(c->h_blk + off),
                                               (uint64_t)(uintptr_t)(c->d_blocks + off),
                                               (uint64_t)n * 4u};
        }
    }
    if (nc && ((rc = kvt__cu_copy_kernel(c->h_cl, nc, 0, 0, c->sst)) ||
               (rc = kvt__cup_guard_set(&c->g_cl, c->sst))))
        return rc;
    *missing = miss;
    return rc;
}
