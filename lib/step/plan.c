/* The per-step plan: kvt_step_plan, kvt_step_finish, kvt_step_ready,
 * kvt_step_dirty (the per-layer calls are layer.c and decode.c).
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

#include "../core/internal.h"
#include "../policy/policy_int.h"
#include "../tier/tier.h"
#include "step_int.h"

#define KVT__STEP_OPTS_V1 24u
_Static_assert(offsetof(kvt_step_opts, reserved) + 4 == KVT__STEP_OPTS_V1, "step opts v1");
/* V2 (still 0.1.0): policy and profiler appended; V1 callers stay accepted. */
#define KVT__STEP_OPTS_V2 (KVT__STEP_OPTS_V1 + 2u * sizeof(void *))
_Static_assert(offsetof(kvt_step_opts, policy) == 24 && offsetof(kvt_step_opts, profiler) ==
               24 + sizeof(void *), "step opts v2 layout");
/* V3 (still 0.1.0): stream appended. */
#define KVT__STEP_OPTS_V3 (KVT__STEP_OPTS_V2 + sizeof(void *))
_Static_assert(offsetof(kvt_step_opts, stream) == KVT__STEP_OPTS_V2, "step opts v3 layout");
_Static_assert(sizeof(kvt_step_opts) == KVT__STEP_OPTS_V3, "step opts v3 size");
#define KVT__KNOWN_STEP_FLAGS (KVT_STEP_DENSE)



void kvt__step_free(struct kvt_step *st)
{
    if (!st)
        return;
    free(st->ids);
    free(st->seqs);
    free(st->expect);
    free(st->due);
    free(st->appended);
    free(st->recorded);
    free(st->rec);
    free(st->sel_off);
    free(st->sel_cnt);
    free(st->sel_rr);
    free(st->task0);
    free(st->ntask);
    free((void *)st->pending);
    free(st->sel_pages);
    free(st->task_ih);
    free(st->task_first);
    free(st->task_count);
    free(st->part);
    free(st->tmem);
    free(st->fence);
    free(st->fcode);
    free(st->fpend);
    free(st->wf);
    free(st->wcode);
    free(st->pm_off);
    free(st->pm_cnt);
    free(st->pm);
    free(st->pmdst);
    free(st->pmres);
    free(st->ev);
    free(st->pml);
    free(st->failed);
    free(st->run);
    free(st);
}


bool kvt__step_is_open(const struct kvt_step *st)
{
    return st && st->open;
}

KVT_API int kvt_step_opts_init(kvt_step_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    return 0;
}

/* Grows *p to hold n elements of size sz (contents not kept). */
static int kvt__grow(void **p, size_t *cap, size_t n, size_t sz, const char *what)
{
    if (n <= *cap && *p)
        return 0;
    if (n > SIZE_MAX / sz)
        return kvt__err(KVT_EOVERFLOW, "step: %s of %zu entries overflow", what, n);
    void *q = malloc(n * sz != 0 ? n * sz : 1);
    if (!q)
        return kvt__err(KVT_ENOMEM, "step: cannot allocate %s (%zu bytes)", what, n * sz);
    free(*p);
    *p = q;
    *cap = n;
    return 0;
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
    KVT__CHECK_NULL(out);
    *out = NULL;
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
    if (dense && pool->pol && pool->cu)
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
    if (prof && pool->cu)
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
        sorted[i] = seqs[i];
    }
    qsort(sorted, n_seqs, sizeof *sorted, cmp_u64);
    for (uint32_t i = 1; i < n_seqs; i++)
        if (sorted[i] == sorted[i - 1]) {
            rc = kvt__err(KVT_EINVAL, "seqs: id 0x%llx appears twice",
                          (unsigned long long)sorted[i]);
            goto out_free;
        }

    /* Room for one more token per sequence and layer: blocks now, table
     * capacity reserved so that kvt_append never allocates. */
    uint64_t need = 0, need_pm = 0, sel_total = 0, task_total = 0, pm_total = 0;
    if (tiered)
        kvt__mover_apply(pool->mover); /* finished moves free their blocks first */
    uint32_t np_max = 1;
    uint32_t kmax = 0, smax = 0, lmax = 0, imax = 1;
    const uint32_t *ak = NULL, *asink = NULL, *alocal = NULL, *aiv = NULL;
    if (o.selector) {
        ak = pol ? pol->k : o.selector->k;
        asink = pol ? pol->sink : o.selector->sink;
        alocal = pol ? pol->local : o.selector->local;
        aiv = pol ? pol->interval : o.selector->interval;
        const size_t nb = (size_t)L * H;
        for (size_t b = 0; b < nb; b++) {
            kmax = ak[b] > kmax ? ak[b] : kmax;
            smax = asink[b] > smax ? asink[b] : smax;
            lmax = alocal[b] > lmax ? alocal[b] : lmax;
            imax = aiv[b] > imax ? aiv[b] : imax;
        }
    }
    for (uint32_t i = 0; i < n_seqs; i++) {
        kvt__seq *s = ss[i];
        uint32_t tmax = 0;
        for (uint32_t l = 0; l < L; l++) {
            const uint32_t t = s->n_tokens[l];
            tmax = t > tmax ? t : tmax;
            if (t % P == 0)
                need += H;
        }
        if (tmax >= s->max_tokens) {
            rc = kvt__err(KVT_ERANGE, "seqs[%u]: the sequence holds %u tokens, its limit "
                          "(max_tokens %u); it cannot take the step's token", i, tmax,
                          s->max_tokens);
            goto out_free;
        }
        const uint32_t t1 = tmax + 1;
        const uint32_t np = kvt__pages_for(pool, t1);
        rc = kvt__seq_reserve(pool, s, np);
        if (rc)
            goto out_free;
        if (!dense && (imax > 1 || s->topk || tiered)) {
            rc = kvt__seq_topk_reserve(pool, s, kmax < s->cap_pages ? kmax : s->cap_pages);
            if (rc)
                goto out_free;
        }
        if (prof && (rc = kvt__profiler_reserve(prof, seqs[i], kmax < np ? kmax : np)))
            goto out_free;
        np_max = np > np_max ? np : np_max;
        if (tiered)
            kvt__place_promote_bound(pool, s, ak, aiv, &need_pm, &pm_total);
        const uint32_t b = dense ? np : kvt__sel_bound(np, kmax, smax, lmax);
        sel_total += (uint64_t)b * H;
        task_total += (uint64_t)((b + KVT__CHUNK_PAGES - 1) / KVT__CHUNK_PAGES) * H;
    }
    if (tiered && need + need_pm > pool->tier[KVT_TIER_DEVICE].n_free) {
        /* Short: pages whose copy-out is still in flight cannot be evicted
         * yet and count against the step. Let them land and count again. */
        need_pm = 0;
        uint64_t pm2 = 0;
        for (uint32_t i = 0; i < n_seqs; i++)
            kvt__mover_drain_seq(pool->mover, ss[i]);
        for (uint32_t i = 0; i < n_seqs; i++)
            kvt__place_promote_bound(pool, ss[i], ak, aiv, &need_pm, &pm2);
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
    if (!pool->step) {
        pool->step = calloc(1, sizeof *pool->step);
        if (!pool->step) {
            rc = kvt__err(KVT_ENOMEM, "kvt_step_plan: cannot allocate the step");
            goto out_free;
        }
        pool->step->pool = pool;
        pool->step->appended = calloc(L, 1);
        pool->step->recorded = calloc(L, 1);
        if (!pool->step->appended || !pool->step->recorded) {
            free(pool->step->appended);
            free(pool->step->recorded);
            free(pool->step);
            pool->step = NULL;
            rc = kvt__err(KVT_ENOMEM, "kvt_step_plan: cannot allocate the step");
            goto out_free;
        }
    }
    kvt_step *st = pool->step;
    const size_t nh = (size_t)n_seqs * H, nlh = (size_t)n_seqs * L * H;
    if (n_seqs > st->cap_n) {
        size_t c = 0;
        st->cap_n = 0; /* until every per-sequence array has grown */
        void *p;
#define KVT__REALLOC(field, count)                                                         \
    do {                                                                                   \
        c = 0;                                                                             \
        p = st->field;                                                                     \
        st->field = NULL;                                                                  \
        free(p);                                                                           \
        rc = kvt__grow((void **)&st->field, &c, (count), sizeof *st->field, #field);       \
        if (rc)                                                                            \
            goto out_reset;                                                                \
    } while (0)
        KVT__REALLOC(ids, n_seqs);
        KVT__REALLOC(seqs, n_seqs);
        KVT__REALLOC(expect, (size_t)n_seqs * L);
        KVT__REALLOC(due, nlh);
        KVT__REALLOC(sel_off, nh);
        KVT__REALLOC(sel_cnt, nh);
        KVT__REALLOC(sel_rr, nh);
        KVT__REALLOC(task0, nh);
        KVT__REALLOC(ntask, nh);
        KVT__REALLOC(pending, nh);
        KVT__REALLOC(fence, n_seqs);
        KVT__REALLOC(fcode, n_seqs);
        KVT__REALLOC(fpend, n_seqs);
        KVT__REALLOC(wf, n_seqs);
        KVT__REALLOC(wcode, n_seqs);
        KVT__REALLOC(pm_off, n_seqs);
        KVT__REALLOC(pm_cnt, n_seqs);
        KVT__REALLOC(failed, n_seqs);
        KVT__REALLOC(run, n_seqs);
#undef KVT__REALLOC
        st->cap_n = n_seqs;
    }
    const size_t part_floats = 2u * (size_t)G + (size_t)G * D;
    if (task_total > SIZE_MAX / sizeof(float) / part_floats) {
        rc = kvt__err(KVT_EOVERFLOW, "step: %llu decode tasks overflow",
                      (unsigned long long)task_total);
        goto out_reset;
    }
    if ((rc = kvt__grow((void **)&st->sel_pages, &st->cap_sel, sel_total, sizeof(uint32_t),
                        "selection")))
        goto out_reset;
    size_t c1 = st->cap_tasks, c2 = st->cap_tasks, c3 = st->cap_tasks;
    if ((rc = kvt__grow((void **)&st->task_ih, &c1, task_total, sizeof(uint32_t), "tasks")) ||
        (rc = kvt__grow((void **)&st->task_first, &c2, task_total, sizeof(uint32_t), "tasks")) ||
        (rc = kvt__grow((void **)&st->task_count, &c3, task_total, sizeof(uint32_t), "tasks"))) {
        free(st->task_ih);
        free(st->task_first);
        free(st->task_count);
        st->task_ih = st->task_first = st->task_count = NULL;
        st->cap_tasks = 0;
        goto out_reset;
    }
    st->cap_tasks = c1 < c2 ? (c1 < c3 ? c1 : c3) : (c2 < c3 ? c2 : c3);
    if ((rc = kvt__grow((void **)&st->part, &st->cap_part, task_total * part_floats,
                        sizeof(float), "partial results")))
        goto out_reset;
    size_t dec = ((size_t)G * D + (size_t)G * P) * sizeof(float) +
                 KVT__CHUNK_PAGES * (sizeof(void *) + sizeof(uint32_t));
    size_t selb = o.selector && !dense ? kvt__sel_scratch_bytes(G, D, np_max) : 0;
    size_t tstride = ((dec > selb ? dec : selb) + 63u) & ~(size_t)63u;
    const uint32_t nt = pool->tp.n_threads;
    if ((rc = kvt__grow((void **)&st->tmem, &st->cap_tmem, (size_t)nt * tstride, 1,
                        "thread scratch")))
        goto out_reset;
    if (prof && (rc = kvt__grow((void **)&st->rec, &st->cap_rec, (size_t)np_max,
                                sizeof(uint32_t), "profiler records")))
        goto out_reset;
    if (tiered) {
        size_t p1 = st->cap_pm, p2 = st->cap_pm, p3 = st->cap_pm;
        if ((rc = kvt__grow((void **)&st->pm, &p1, pm_total, sizeof *st->pm, "promotions")) ||
            (rc = kvt__grow((void **)&st->pmdst, &p2, pm_total, sizeof *st->pmdst,
                            "promotions")) ||
            (rc = kvt__grow((void **)&st->pmres, &p3, pm_total, sizeof *st->pmres,
                            "promotions"))) {
            free(st->pm);
            free(st->pmdst);
            free(st->pmres);
            st->pm = NULL;
            st->pmdst = NULL;
            st->pmres = NULL;
            st->cap_pm = 0;
            goto out_reset;
        }
        st->cap_pm = p1;
        size_t e1 = st->cap_ev, e2 = st->cap_ev;
        if ((rc = kvt__grow(&st->ev, &e1, np_max, sizeof(kvt__evc), "eviction list")) ||
            (rc = kvt__grow((void **)&st->pml, &e2, np_max, sizeof(uint32_t), "eviction list"))) {
            free(st->ev);
            free(st->pml);
            st->ev = NULL;
            st->pml = NULL;
            st->cap_ev = 0;
            goto out_reset;
        }
        st->cap_ev = e1;
    }

    /* Everything is in place: fill the plan. */
    st->sel = o.selector;
    st->tiered = tiered;
    st->k = ak;
    st->sink = asink;
    st->local = alocal;
    st->interval = aiv;
    st->prof = prof;
    memset(st->recorded, 0, L);
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
    memcpy(st->ids, seqs, (size_t)n_seqs * sizeof *seqs);
    memcpy(st->seqs, ss, (size_t)n_seqs * sizeof *ss);
    memset(st->appended, 0, L);
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
        st->wf[i] = tiered ? ss[i]->wfence : 0;
        st->wcode[i] = 0;
        st->fence[i] = 0;
        st->fpend[i] = 0;
        st->fcode[i] = 0;
        st->failed[i] = 0;
        st->pm_cnt[i] = 0;
        if (tiered)
            ss[i]->wfence = 0;
    }
    if (pool->cu && (rc = kvt__cuda_step_plan(st, o.stream)))
        goto out_free;
    st->open = true;
    pool->step_id++; /* dirty ranges start empty */
    pool->clock++; /* the step's stamp on the pages it selects */
    free(ss);
    free(sorted);
    *out = st;
    return 0;

out_reset:
    /* A failed grow leaves each array either intact with its old capacity
     * or NULL with capacity 0; the step itself stays (a finished handle
     * must keep answering KVT_ESTATE), closed. */
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

KVT_API int kvt_step_finish(kvt_step *st)
{
    if (!st)
        return 0;
    if (!st->open)
        return kvt__err(KVT_ESTATE, "step: already finished");
    int rc = 0;
    if (st->tiered) {
        /* Nothing of the step may stay in flight (the moves write into the
         * step's buffers); then the pages that filled go out once. */
        for (uint32_t i = 0; i < st->n; i++) {
            kvt__settle(st, i, false);
            kvt__fail_reset(st, i);
        }
        rc = kvt__place_offload(st->pool, st->seqs, st->ids, st->n, UINT32_MAX, false);
    }
    if (st->pool->cu) {
        const int rc2 = kvt__cuda_step_finish(st);
        rc = rc ? rc : rc2;
    }
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i]; /* slots live as long as the pool */
        if (s->live && s->gen == (uint32_t)(st->ids[i] >> 32))
            s->steps++;
    }
    st->open = false;
    st->sel_layer = KVT__NO_LAYER;
    return rc;
}

KVT_API int kvt_step_ready(kvt_step *st, uint32_t seq_index, uint32_t *ready)
{
    int rc = kvt__step_args(st, KVT__ANY, seq_index, KVT__ANY);
    if (rc)
        return rc;
    KVT__CHECK_NULL(ready);
    *ready = st->tiered ? !kvt__pending(st, seq_index) : 1u;
    return 0;
}

KVT_API int kvt_step_dirty(const kvt_step *st, uint32_t layer, uint32_t seq_index,
                           uint32_t kv_head, uint32_t *first_page, uint32_t *n_pages)
{
    int rc = kvt__step_args(st, layer, seq_index, kv_head);
    if (rc)
        return rc;
    KVT__CHECK_NULL(first_page);
    KVT__CHECK_NULL(n_pages);
    const kvt__seq *s = st->seqs[seq_index];
    const size_t lh = kvt__lh(st->pool, layer, kv_head);
    if (s->dstamp && s->dstamp[lh] == st->pool->step_id) {
        *first_page = s->dlo[lh];
        *n_pages = s->dhi[lh] - s->dlo[lh] + 1u;
    } else {
        *first_page = 0;
        *n_pages = 0;
    }
    return 0;
}
