/* The per-step plan: kvt_step_plan, kvt_step_finish, kvt_step_ready_get,
 * kvt_step_dirty_get (the per-layer calls are layer.c and decode.c).
 *
 * kvt_step_plan checks the sequences, reserves block-table room, decides
 * which heads rerank, and sizes every buffer the per-layer calls use; those
 * calls then only run kernels over the pool's worker threads. The pool owns
 * one step workspace, reused by every plan, so a finished step handle stays
 * valid memory and reports KVT_ESTATE instead of being a dangling pointer. */
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
#include "step.h"
#include "step_int.h"

/* The first released layout (0.1), pinned: smaller struct_size values are
 * rejected, fields appended later read as zero for it. */
#define KVT__STEP_OPTS_V1 (8u + 4u * sizeof(void *) + 8u)
_Static_assert(offsetof(kvt_step_opts, reserved) + 4 == KVT__STEP_OPTS_V1 &&
               offsetof(kvt_step_opts, n_new) == KVT__STEP_OPTS_V1 &&
               offsetof(kvt_step_opts, token_ids) == KVT__STEP_OPTS_V1 + sizeof(void *) + 8u,
               "step opts v1, then n_new, n_rows, max_new, then token_ids");
#define KVT__KNOWN_STEP_FLAGS (KVT_STEP_DENSE)



void kvt__step_free(struct kvt_step *st)
{
    if (!st)
        return;
    free(st->wksp);
    free(st->appended);
    free(st->recorded);
    free(st->counted);
    free(st);
}


/* The next handle of the pool's ring (allocated on first use), holding the
 * workspace from now on. */
static int kvt__step_next(kvt_pool *pool, kvt_step **out)
{
    const uint32_t ring = (uint32_t)(sizeof pool->step_ring / sizeof pool->step_ring[0]);
    const uint32_t slot = pool->step_next % ring;
    kvt_step *st = pool->step_ring[slot];
    if (!st) {
        st = calloc(1, sizeof *st);
        if (st) {
            st->pool = pool;
            st->appended = calloc(pool->g.n_layers, 1);
            st->recorded = calloc(pool->g.n_layers, 1);
            st->counted = calloc(pool->g.n_layers, 1);
        }
        if (!st || !st->appended || !st->recorded || !st->counted) {
            kvt__step_free(st);
            return kvt__err(KVT_ENOMEM, "kvt_step_plan: cannot allocate the step");
        }
        pool->step_ring[slot] = st;
    }
    kvt_step *prev = pool->step;
    if (prev && prev != st) { /* the workspace moves; the old handle keeps none */
        free(st->wksp);
        st->wksp = prev->wksp;
        st->wksp_bytes = prev->wksp_bytes;
        prev->wksp = NULL;
        prev->wksp_bytes = 0;
    }
    pool->step = st;
    pool->step_next = (slot + 1u) % ring;
    *out = st;
    return 0;
}

bool kvt__step_is_open(const struct kvt_step *st)
{
    return st && st->open;
}

bool kvt__step_has_seq(const struct kvt_step *st, const kvt__seq *s)
{
    if (!st || !st->open)
        return false;
    for (uint32_t i = 0; i < st->n; i++)
        if (st->seqs[i] == s)
            return true;
    return false;
}

KVT_API int kvt_step_opts_init(kvt_step_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    return 0;
}

/* The step's per-plan arrays, carved from one allocation (zstd's cwksp is
 * the model): kvt__step_carve runs once with no memory to size it, then
 * again over the workspace to set the pointers. A new per-step array is one
 * line there. Each array starts on a cache line. */
typedef struct {
    uint8_t *base; /* NULL: only count */
    size_t used;
    bool overflow;
} kvt__wk;

static void *kvt__wk_take(kvt__wk *w, uint64_t n, size_t sz)
{
    const size_t off = (w->used + 63u) & ~(size_t)63u;
    if (off < w->used || n > (SIZE_MAX - off) / sz) {
        w->overflow = true;
        return NULL;
    }
    w->used = off + (size_t)n * sz;
    return w->base && !w->overflow ? w->base + off : NULL;
}

size_t kvt__step_carve(kvt_step *st, const kvt__step_sizes *z, void *base)
{
    kvt__wk w = {base, 0, false};
#define KVT__TAKE(field, count) st->field = kvt__wk_take(&w, (count), sizeof *st->field)
    KVT__TAKE(ids, z->n);
    KVT__TAKE(seqs, z->n);
    KVT__TAKE(nnew, z->n);
    KVT__TAKE(row0, z->n);
    KVT__TAKE(tok, z->rows);
    KVT__TAKE(expect, z->nl);
    KVT__TAKE(due, z->nlh);
    KVT__TAKE(sel_off, z->nh);
    KVT__TAKE(sel_cnt, z->nh);
    KVT__TAKE(sel_rr, z->nh);
    KVT__TAKE(sim_rr, z->nh);
    KVT__TAKE(raw, z->raw);
    KVT__TAKE(raw_off, z->raw ? z->nh : 0);
    KVT__TAKE(stask, 3u * z->stask);
    KVT__TAKE(task0, z->nh);
    KVT__TAKE(ntask, z->nh);
    KVT__TAKE(pending, z->nh);
    KVT__TAKE(fence, z->n);
    KVT__TAKE(fcode, z->n);
    KVT__TAKE(fpend, z->n);
    KVT__TAKE(wf, z->n);
    KVT__TAKE(wcode, z->n);
    KVT__TAKE(pm_off, z->n);
    KVT__TAKE(pm_cnt, z->n);
    KVT__TAKE(failed, z->n);
    KVT__TAKE(run, z->n);
    KVT__TAKE(sel_pages, z->sel);
    KVT__TAKE(task_ih, z->tasks);
    KVT__TAKE(task_first, z->tasks);
    KVT__TAKE(task_count, z->tasks);
    KVT__TAKE(task_part, z->tasks);
    KVT__TAKE(part, z->part);
    KVT__TAKE(tmem, z->tmem);
    KVT__TAKE(rec, z->rec);
    KVT__TAKE(pm, z->pm);
    KVT__TAKE(pmdst, z->pm);
    KVT__TAKE(pmres, z->pm);
    KVT__TAKE(pml, z->ev);
    st->ev = kvt__wk_take(&w, z->ev, sizeof(kvt__evc));
#undef KVT__TAKE
    return w.overflow ? SIZE_MAX : w.used;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}


KVT_API int kvt_step_plan(kvt_pool *pool, const kvt_seq_id *seqs, uint32_t n_seqs,
                          const kvt_step_opts *opts, kvt_step **out)
{
    kvt_step_opts o;
    int rc;
    KVT__CHECK_NULL(out); /* *out is written on success only */
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(seqs);
    if (opts) {
        rc = kvt__opts_copy(&o, sizeof o, opts, KVT__STEP_OPTS_V1, "opts");
        if (rc)
            return rc;
    } else {
        kvt_step_opts_init(&o);
    }
    if (n_seqs == 0)
        return kvt__err(KVT_EINVAL, "n_seqs: must be at least 1");
    if (n_seqs > pool->max_seqs)
        return kvt__err(KVT_EINVAL, "n_seqs: %u is above the pool's max_seqs %u", n_seqs,
                        pool->max_seqs);
    if (o.flags & ~KVT__KNOWN_STEP_FLAGS)
        return kvt__err(KVT_EINVAL, "opts->flags: unknown bits 0x%x",
                        o.flags & ~KVT__KNOWN_STEP_FLAGS);
    if (o.reserved)
        return kvt__err(KVT_EINVAL, "opts->reserved: must be zero");
    uint32_t rmax = 1;
    if ((rc = kvt__plan_new_tokens(pool, &o, n_seqs, &rmax)))
        return rc;
    if (!(o.scale >= 0.0f) || isinf(o.scale))
        return kvt__err(KVT_EINVAL, "opts->scale: %g is not a finite value >= 0",
                        (double)o.scale);
    const bool dense = (o.flags & KVT_STEP_DENSE) != 0;
    if (!o.selector && !dense)
        o.selector = pool->sel;
    if (!dense && !o.selector)
        return kvt__err(KVT_EINVAL, "opts->selector: NULL needs flags KVT_STEP_DENSE (or a "
                        "pool with a selector)");
    if (pool->pol && !dense) {
        if (o.policy && o.policy != pool->pol)
            return kvt__err(KVT_EINVAL, "opts->policy: a tiered pool places pages by its own "
                            "policy; pass NULL or the pool's");
        o.policy = pool->pol;
    }
    const bool tiered = pool->pol && !dense;
    if (dense && pool->pol && (pool->be_caps & KVT__BE_NO_DENSE_TIERED))
        return kvt__err(KVT_ENOTSUP, "opts->flags: KVT_STEP_DENSE on a tiered CUDA pool (its "
                        "decode reads device pages only, and stable heads keep most pages "
                        "off the device)");
    if (o.selector) {
        rc = kvt__selector_match(o.selector, pool);
        if (rc)
            return rc;
    }
    /* A dense step selects every page: a policy or profiler has no part in it. */
    const kvt_policy *pol = dense ? NULL : o.policy;
    kvt_profiler *prof = dense ? NULL : o.profiler;
    if (pol && (rc = kvt__geometry_same(&pol->g, &pool->g, "opts->policy", "the policy",
                                        "the pool")))
        return rc;
    if (prof && (rc = kvt__geometry_same(kvt__profiler_geometry(prof), &pool->g,
                                         "opts->profiler", "the profiler", "the pool")))
        return rc;
    if (prof && (pool->be_caps & KVT__BE_NO_PROFILER))
        return kvt__err(KVT_ENOTSUP, "opts->profiler: the CUDA backend does not feed a "
                        "profiler in this release (profile on the CPU backend)");
    if (pool->step && pool->step->open)
        return kvt__err(KVT_ESTATE, "pool: a step is still open (call kvt_step_finish)");

    const uint32_t L = pool->g.n_layers, H = pool->g.n_kv_heads, P = pool->g.page_tokens;
    const uint32_t Hq = pool->g.n_q_heads, G = Hq / H, D = pool->g.head_dim;

    /* Sequences: live and distinct. */
    kvt__seq **ss = malloc((size_t)n_seqs * sizeof *ss);
    uint64_t *sorted = malloc((size_t)n_seqs * sizeof *sorted);
    if (!ss || !sorted) {
        free(ss);
        free(sorted);
        return kvt__err(KVT_ENOMEM, "kvt_step_plan: cannot allocate for %u sequences", n_seqs);
    }
    for (uint32_t i = 0; i < n_seqs; i++) {
        rc = kvt__seq_lookup(pool, seqs[i], &ss[i]);
        if (rc) {
            kvt__err(rc, "seqs[%u]: id 0x%llx names no live sequence of this pool", i,
                     (unsigned long long)seqs[i]);
            goto out_free;
        }
        if (ss[i]->tier.rfetch) {
            char what[64];
            snprintf(what, sizeof what, "seqs[%u]", i);
            rc = kvt__seq_loading_err(ss[i], what);
            goto out_free;
        }
        sorted[i] = seqs[i];
    }
    qsort(sorted, n_seqs, sizeof *sorted, cmp_u64);
    for (uint32_t i = 1; i < n_seqs; i++)
        if (sorted[i] == sorted[i - 1]) {
            rc = kvt__err(KVT_EINVAL, "seqs: id 0x%llx appears twice",
                          (unsigned long long)sorted[i]);
            goto out_free;
        }
    if (o.token_ids && (rc = kvt__plan_token_ids(&o, n_seqs, ss)))
        goto out_free;

    /* Room for the step's tokens of every sequence and layer: blocks now,
     * table capacity reserved so that kvt_step_append never allocates. */
    uint64_t need = 0, need_pm = 0, sel_total = 0, task_total = 0, pm_total = 0;
    if (tiered)
        kvt__mover_apply(pool->mover); /* finished moves free their blocks first */
    uint32_t np_max = 1;
    uint32_t kmax = 0, smax = 0, lmax = 0, imax = 1;
    const uint32_t *ak = NULL, *asink = NULL, *alocal = NULL, *aiv = NULL;
    const float *asim = NULL;
    if (o.selector) {
        ak = pol ? pol->k : o.selector->k;
        asink = pol ? pol->sink : o.selector->sink;
        alocal = pol ? pol->local : o.selector->local;
        aiv = pol ? pol->interval : o.selector->interval;
        asim = pol ? pol->sim : o.selector->sim;
        const size_t nb = (size_t)L * H;
        for (size_t b = 0; b < nb; b++) {
            kmax = ak[b] > kmax ? ak[b] : kmax;
            smax = asink[b] > smax ? asink[b] : smax;
            lmax = alocal[b] > lmax ? alocal[b] : lmax;
            imax = aiv[b] > imax ? aiv[b] : imax;
        }
    }
    /* The selection cache decides on the host (CPU backend) only. */
    const float *host_sim = pool->be_caps & KVT__BE_NO_HOST_SELECT ? NULL : asim;
    uint64_t part_total = 0; /* floats of the decode tasks' partial results */
    /* The score pass of a key-reading method (select.c): raw scores and
     * chunk tasks of one-token sequences' heads. */
    const bool keys = !dense && o.selector && o.selector->method >= KVT_SCORE_TOKEN &&
                      !(pool->be_caps & KVT__BE_NO_HOST_SELECT);
    uint64_t raw_total = 0, stask_total = 0;
    const size_t lpart = 2u + (size_t)D; /* per query row: m, l and the output row */
    for (uint32_t i = 0; i < n_seqs; i++) {
        kvt__seq *s = ss[i];
        const uint32_t nn = o.n_new ? o.n_new[i] : 1u;
        uint32_t tmax = 0;
        for (uint32_t l = 0; l < L; l++) {
            const uint32_t t = s->n_tokens[l];
            tmax = t > tmax ? t : tmax;
            if ((uint64_t)t + nn <= s->max_tokens)
                need += (uint64_t)H * (kvt__pages_for(pool, t + nn) - kvt__pages_for(pool, t));
        }
        if ((uint64_t)tmax + nn > s->max_tokens) {
            rc = kvt__err(KVT_ERANGE, "seqs[%u]: the sequence holds %u tokens of its limit "
                          "(max_tokens %u); it cannot take the step's %u token%s", i, tmax,
                          s->max_tokens, nn, nn == 1 ? "" : "s");
            goto out_free;
        }
        const uint32_t t1 = tmax + nn;
        const uint32_t np = kvt__pages_for(pool, t1);
        rc = kvt__seq_reserve(pool, s, np);
        if (rc)
            goto out_free;
        if (!dense && (imax > 1 || s->sel.topk || tiered)) {
            rc = kvt__seq_topk_reserve(pool, s, kmax < s->cap_pages ? kmax : s->cap_pages);
            if (rc)
                goto out_free;
        }
        if (prof && (rc = kvt__profiler_reserve(prof, seqs[i], kmax < np ? kmax : np)))
            goto out_free;
        np_max = np > np_max ? np : np_max;
        if (tiered)
            kvt__place_promote_bound(pool, s, ak, aiv, host_sim, &need_pm, &pm_total);
        /* The new tokens' pages are forced too: at most nn / P + 2 of them. */
        const uint32_t lnew = nn > 1 ? lmax + (nn + P - 1) / P + 1u : lmax;
        if (tiered && nn > 1) {
            /* In a step that selects without appending, those pages are old
             * ones a stable head may have moved out: room to promote them
             * (their blocks come from the recycle's evictions or its own
             * KVT_ENOSPC check). */
            const uint32_t f = lnew - lmax < np ? lnew - lmax : np;
            for (size_t b = 0; b < (size_t)L * H; b++)
                pm_total += kvt__stable(pool, b) ? f : 0u;
        }
        if (keys && nn == 1 && np > KVT__SCORE_CHUNK) {
            raw_total += (uint64_t)H * G * np;
            stask_total += (uint64_t)H * ((np + KVT__SCORE_CHUNK - 1) / KVT__SCORE_CHUNK);
        }
        const uint32_t b = dense ? np : kvt__sel_bound(np, kmax, smax, lnew);
        const uint32_t tp = kvt__task_pages(nn, G);
        const uint64_t tasks = (uint64_t)((b + tp - 1) / tp) * H;
        sel_total += (uint64_t)b * H;
        task_total += tasks;
        part_total += tasks * nn * G * lpart;
    }
    kvt__pfx_make_room(pool, KVT_TIER_DEVICE, need + need_pm); /* cached, unheld pages */
    kvt__pfx_make_room(pool, KVT_NUM_TIERS, need);
    if (tiered && need + need_pm > pool->tier[KVT_TIER_DEVICE].n_free) {
        /* Short: pages whose copy-out is still in flight cannot be evicted
         * yet and count against the step. Let them land and count again. */
        need_pm = 0;
        uint64_t pm2 = 0;
        for (uint32_t i = 0; i < n_seqs; i++)
            kvt__mover_drain_seq(pool->mover, ss[i]);
        for (uint32_t i = 0; i < n_seqs; i++)
            kvt__place_promote_bound(pool, ss[i], ak, aiv, host_sim, &need_pm, &pm2);
    }
    if (need + need_pm > pool->tier[KVT_TIER_DEVICE].n_free) {
        rc = kvt__err(KVT_ENOSPC, "device tier: the step's appends%s need up to %llu blocks, "
                      "%u free", tiered ? " and promotions" : "",
                      (unsigned long long)(need + need_pm), pool->tier[KVT_TIER_DEVICE].n_free);
        goto out_free;
    }
    if (need > pool->meta.n_free) {
        rc = kvt__err(KVT_ENOSPC, "metadata store: the step's appends need up to %llu pages, "
                      "%u free", (unsigned long long)need, pool->meta.n_free);
        goto out_free;
    }

    /* The workspace. */
    if (!pool->tp.inited) {
        rc = kvt__tp_init(&pool->tp, pool->n_threads);
        if (rc) {
            kvt__tp_fini(&pool->tp);
            goto out_free;
        }
    }
    kvt_step *st = NULL;
    if ((rc = kvt__step_next(pool, &st)))
        goto out_free;
    /* A decode task's scratch: its query rows and their scores of a page,
     * the rows' causal limits, and the chunk's block pointers and counts. */
    const size_t RG = (size_t)rmax * G;
    size_t dec = (RG * D + RG * P + (rmax > 1 ? 2u * (size_t)P * D : 0u)) * sizeof(float) +
                 (RG + 1) * sizeof(uint32_t) +
                 (size_t)kvt__task_pages(rmax, G) * (sizeof(void *) + 2 * sizeof(uint32_t));
    size_t selb = o.selector && !dense ? kvt__sel_scratch_bytes((uint32_t)RG, D, np_max) : 0;
    size_t tstride = ((dec > selb ? dec : selb) + 63u) & ~(size_t)63u;
    /* A disk tier: a bounce block for pages a decode reads from disk. */
    const size_t bounce_off = pool->disk && !(pool->be_caps & KVT__BE_DEVICE_REMOTE) ? tstride : 0;
    if (bounce_off)
        tstride += (size_t)pool->disk->slot_bytes + KVT__DIO_ALIGN;
    const uint32_t nt = pool->tp.n_threads;
    const uint64_t part_n = part_total;
    const kvt__step_sizes z = {
        .n = n_seqs,
        .nl = (uint64_t)n_seqs * L,
        .nh = (uint64_t)n_seqs * H,
        .nlh = (uint64_t)n_seqs * L * H,
        .sel = sel_total,
        .tasks = task_total,
        .part = part_n,
        .tmem = (uint64_t)nt * tstride,
        .rec = prof ? np_max : 0,
        .pm = tiered ? pm_total : 0,
        .ev = tiered ? np_max : 0,
        .rows = o.token_ids ? (o.n_new ? o.n_rows : n_seqs) : 0,
        .raw = raw_total,
        .stask = stask_total,
    };
    kvt_step sizing;
    const size_t bytes = kvt__step_carve(&sizing, &z, NULL);
    if (bytes == SIZE_MAX) {
        rc = kvt__err(KVT_EOVERFLOW, "step: the workspace of %u sequences (%llu selected "
                      "pages, %llu decode tasks) overflows", n_seqs,
                      (unsigned long long)sel_total, (unsigned long long)task_total);
        goto out_free;
    }
    if (bytes > st->wksp_bytes) {
        free(st->wksp);
        st->wksp_bytes = 0;
        st->wksp = malloc(bytes);
        if (!st->wksp) {
            rc = kvt__err(KVT_ENOMEM, "step: cannot allocate the workspace (%zu bytes)",
                          bytes);
            goto out_free;
        }
        st->wksp_bytes = bytes;
    }
    kvt__step_carve(st, &z, st->wksp);
    if (!z.raw)
        st->raw = NULL; /* no score pass */
    st->cap_sel = (size_t)z.sel;
    st->cap_tasks = (size_t)z.tasks;
    st->cap_part = (size_t)z.part;
    st->cap_pm = (size_t)z.pm;

    /* Everything is in place: fill the plan. */
    st->sel = o.selector;
    st->tiered = tiered;
    st->k = ak;
    st->sink = asink;
    st->local = alocal;
    st->interval = aiv;
    st->sim = asim;
    st->prof = prof;
    memset(st->recorded, 0, L);
    memset(st->counted, 0, L);
    st->flags = o.flags;
    st->scale = o.scale > 0.0f ? o.scale : 1.0f / sqrtf((float)D);
    st->n = n_seqs;
    st->L = L;
    st->H = H;
    st->Hq = Hq;
    st->G = G;
    st->D = D;
    st->P = P;
    st->n_threads = nt;
    st->tstride = tstride;
    st->bounce_off = bounce_off;
    memcpy(st->ids, seqs, (size_t)n_seqs * sizeof *seqs);
    memcpy(st->seqs, ss, (size_t)n_seqs * sizeof *ss);
    st->rows = 0;
    st->rmax = rmax;
    for (uint32_t i = 0; i < n_seqs; i++) {
        st->nnew[i] = o.n_new ? o.n_new[i] : 1u;
        st->row0[i] = st->rows;
        st->rows += st->nnew[i];
    }
    st->has_tok = o.token_ids != NULL;
    if (o.token_ids)
        memcpy(st->tok, o.token_ids, (size_t)st->rows * sizeof *st->tok);
    memset(st->appended, 0, L);
    st->n_appended = 0;
    st->read_only = false;
    st->sel_layer = KVT__NO_LAYER;
    st->emptied_layer = KVT__NO_LAYER;
    for (uint32_t i = 0; i < n_seqs; i++) {
        kvt__seq *s = ss[i];
        for (uint32_t l = 0; l < L; l++) {
            st->expect[(size_t)i * L + l] = s->n_tokens[l];
            for (uint32_t h = 0; h < H; h++) {
                const size_t b = (size_t)l * H + h;
                st->due[(size_t)i * L * H + b] =
                    dense || kvt__head_due(pool, s, l, b, ak[b], aiv[b], tiered);
            }
        }
    }
    for (uint32_t i = 0; i < n_seqs; i++) {
        /* Warm-up's promotions still in flight make the sequence not ready. */
        st->wf[i] = tiered ? ss[i]->tier.wfence : 0;
        st->wcode[i] = 0;
        st->fence[i] = 0;
        st->fpend[i] = 0;
        st->fcode[i] = 0;
        st->failed[i] = 0;
        st->pm_cnt[i] = 0;
        if (tiered)
            ss[i]->tier.wfence = 0;
    }
    if (pool->be->step_plan && (rc = pool->be->step_plan(st, o.stream)))
        goto out_free;
    st->open = true;
    pool->step_id++; /* dirty ranges start empty */
    pool->clock++; /* the step's stamp on the pages it selects */
    free(ss);
    free(sorted);
    *out = st;
    return 0;

    /* On failure the step itself stays (a finished handle must keep
     * answering KVT_ESTATE), closed. */
out_free:
    free(ss);
    free(sorted);
    return rc;
}

int kvt__step_args(const kvt_step *st, uint32_t layer, uint32_t seq_index, uint32_t kv_head)
{
    if (!st)
        return kvt__err(KVT_EINVAL, "step: must not be NULL");
    if (!st->open)
        return kvt__err(KVT_ESTATE, "step: already finished (a stale plan); call "
                        "kvt_step_plan for a new step");
    if (layer != KVT__ANY && layer >= st->L)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, st->L);
    if (seq_index != KVT__ANY && seq_index >= st->n)
        return kvt__err(KVT_EINVAL, "seq_index: %u >= the plan's %u sequences", seq_index,
                        st->n);
    if (kv_head != KVT__ANY && kv_head >= st->H)
        return kvt__err(KVT_EINVAL, "kv_head: %u >= n_kv_heads %u", kv_head, st->H);
    return 0;
}

int kvt__step_enter(const kvt_step *st, uint32_t layer)
{
    int rc = kvt__step_args(st, layer, KVT__ANY, KVT__ANY);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s;
        rc = kvt__seq_lookup(st->pool, st->ids[i], &s);
        if (rc)
            return kvt__err(rc, "step: sequence %u (id 0x%llx) was released after the plan",
                            i, (unsigned long long)st->ids[i]);
        if (s->n_tokens[layer] != st->expect[(size_t)i * st->L + layer])
            return kvt__err(KVT_ESTATE, "step: sequence %u has %u tokens in layer %u, the "
                            "plan expects %u (appended outside the step: a stale plan)",
                            i, s->n_tokens[layer], layer,
                            st->expect[(size_t)i * st->L + layer]);
    }
    return 0;
}

/* A step finishes with every layer appended or none: one that appended
 * some layers only gets those appends taken back (kvt__append_pop, or the
 * backend's seq_pop where the host cannot read the device tier) and
 * KVT_ESTATE naming the layers it missed. */
static int kvt__step_unappend(kvt_step *st)
{
    uint32_t done = 0;
    for (uint32_t l = 0; l < st->L; l++)
        done += st->appended[l] != 0;
    if (done == 0 || done == st->L)
        return 0;
    char miss[160];
    size_t at = 0;
    for (uint32_t l = 0; l < st->L && at + 16 < sizeof miss; l++)
        if (!st->appended[l])
            at += (size_t)snprintf(miss + at, sizeof miss - at, "%s%u", at ? " " : "", l);
    if (at + 16 >= sizeof miss)
        snprintf(miss + at, sizeof miss - at, " ...");
    kvt_pool *p = st->pool;
    int rc = 0;
    for (uint32_t i = 0; i < st->n && !rc; i++) {
        kvt__seq *s = st->seqs[i];
        if (!s->live || s->gen != (uint32_t)(st->ids[i] >> 32))
            continue;
        if (st->tiered)
            kvt__settle(st, i, false);
        for (uint32_t l = 0; l < st->L && !rc; l++)
            for (uint32_t j = 0; st->appended[l] && j < st->nnew[i] && !rc; j++) {
                /* The sequence's n_new tokens, last first. */
                if (p->be->seq_pop)
                    rc = p->be->seq_pop(p, s, l);
                else
                    kvt__append_pop(p, s, l);
                if (!rc)
                    st->expect[(size_t)i * st->L + l]--;
            }
    }
    if (rc) /* the backend could not reach its device: the message says why */
        return rc;
    memset(st->appended, 0, st->L);
    st->n_appended = 0;
    return kvt__err(KVT_ESTATE, "step: %u of %u layers were appended, not layer%s %s; the "
                    "appends made were taken back", done, st->L, st->L - done > 1 ? "s" : "",
                    miss);
}

KVT_API int kvt_step_finish(kvt_step *st)
{
    if (!st)
        return 0;
    if (!st->open)
        return kvt__err(KVT_ESTATE, "step: already finished");
    int rc = kvt__step_unappend(st);
    if (st->tiered) {
        /* Nothing of the step may stay in flight (the moves write into the
         * step's buffers); then the pages that filled go out once. */
        for (uint32_t i = 0; i < st->n; i++) {
            kvt__settle(st, i, false);
            kvt__fail_reset(st, i);
        }
        const int rc1 = kvt__place_offload(st->pool, st->seqs, st->ids, st->n, UINT32_MAX, false);
        rc = rc ? rc : rc1;
    }
    if (st->pool->pol && !st->tiered && st->n_appended == st->L)
        kvt__step_chunk_offload(st);
    if ((st->has_tok || st->pool->pfx) && st->n_appended == st->L)
        kvt__step_token_ids(st); /* the rows' ids: keys for the prefix cache */
    if (st->pool->be->step_finish) {
        const int rc2 = st->pool->be->step_finish(st);
        rc = rc ? rc : rc2;
    }
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i]; /* slots live as long as the pool */
        if (s->live && s->gen == (uint32_t)(st->ids[i] >> 32))
            s->sel.steps++;
    }
    st->open = false;
    st->sel_layer = KVT__NO_LAYER;
    return rc;
}

KVT_API int kvt_step_ready_get(kvt_step *st, uint32_t seq_index, uint32_t *ready)
{
    int rc = kvt__step_args(st, KVT__ANY, seq_index, KVT__ANY);
    if (rc)
        return rc;
    KVT__CHECK_NULL(ready);
    *ready = st->tiered ? !kvt__pending(st, seq_index) : 1u;
    return 0;
}

KVT_API int kvt_step_dirty_get(const kvt_step *st, uint32_t layer, uint32_t seq_index,
                               uint32_t kv_head, uint32_t *first_page, uint32_t *n_pages)
{
    int rc = kvt__step_args(st, layer, seq_index, kv_head);
    if (rc)
        return rc;
    KVT__CHECK_NULL(first_page);
    KVT__CHECK_NULL(n_pages);
    const kvt__seq *s = st->seqs[seq_index];
    const size_t lh = kvt__lh(st->pool, layer, kv_head);
    if (s->tier.dstamp && s->tier.dstamp[lh] == st->pool->step_id) {
        *first_page = s->tier.dlo[lh];
        *n_pages = s->tier.dhi[lh] - s->tier.dlo[lh] + 1u;
    } else {
        *first_page = 0;
        *n_pages = 0;
    }
    return 0;
}
