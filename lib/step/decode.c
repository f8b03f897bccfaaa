/* The attention of a step's layer: kvt_step_decode (split into
 * fixed-size page chunks over the worker threads, then a log-sum-exp merge;
 * a tiered pool decodes the sequences whose promotions landed first) and
 * kvt_step_attend (select, then decode). */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/store.h"
#include "../attn/kernels.h"
#include "../backend/backend.h"
#include "../policy/policy_int.h"
#include "../tier/tier.h"
#include "step_int.h"

/* ---- sparse decode ------------------------------------------------------ */
/* The part of task t: m [R], l [R], acc [R][D] for the R = n_new x G query
 * rows of its (sequence, KV head). */
static inline float *kvt__part(const kvt_step *st, uint32_t t)
{
    return st->part + st->task_part[t];
}

static void kvt__merge(kvt_step *st, uint32_t ih)
{
    const uint32_t G = st->G, D = st->D, i = ih / st->H, h = ih % st->H;
    const uint32_t R = st->nnew[i] * G;
    const uint32_t t0 = st->task0[ih], nt = st->ntask[ih];
    for (uint32_t x = 0; x < R; x++) {
        /* Row x: token x / G of the sequence, query head h * G + x % G. */
        const size_t row = (size_t)st->row0[i] + x / G, qh = (size_t)h * G + x % G;
        float *o = st->out + (row * st->Hq + qh) * D;
        float *lse = st->lse ? st->lse + row * st->Hq + qh : NULL;
        const uint32_t g = x;
        float M = -INFINITY;
        bool nan = false;
        for (uint32_t t = 0; t < nt; t++) {
            const float *pt = kvt__part(st, t0 + t);
            M = pt[g] > M ? pt[g] : M;
            nan = nan || isnan(pt[R + g]);
        }
        if (nan) { /* a non-finite query or key (kvt__dec_task): no defined attention */
            for (uint32_t d = 0; d < D; d++)
                o[d] = NAN;
            if (lse)
                *lse = NAN;
            continue;
        }
        memset(o, 0, D * sizeof *o);
        float Lsum = 0.0f;
        if (M != -INFINITY) {
            for (uint32_t t = 0; t < nt; t++) {
                const float *pt = kvt__part(st, t0 + t);
                if (pt[g] == -INFINITY)
                    continue;
                const float w = expf(pt[g] - M);
                Lsum += pt[R + g] * w;
                const float *acc = pt + 2u * R + (size_t)g * D;
                for (uint32_t d = 0; d < D; d++)
                    o[d] += acc[d] * w;
            }
        }
        if (Lsum > 0.0f) {
            const float inv = 1.0f / Lsum;
            for (uint32_t d = 0; d < D; d++)
                o[d] *= inv;
        }
        if (lse)
            *lse = Lsum > 0.0f ? M + logf(Lsum) : -INFINITY;
    }
}

static void kvt__dec_task(void *ctx, uint32_t t, uint32_t thread)
{
    kvt_step *st = ctx;
    const kvt_pool *p = st->pool;
    const uint32_t G = st->G, D = st->D, P = st->P;
    const uint32_t ih = st->task_ih[t], i = ih / st->H, h = ih % st->H;
    const kvt__seq *s = st->seqs[i];
    const uint32_t tokens = s->n_tokens[st->layer];
    const uint32_t nn = st->nnew[i], R = nn * G; /* query rows: token-major */
    uint8_t *mem = st->tmem + (size_t)thread * st->tstride;
    float *qs = (float *)mem;
    float *sbuf = qs + (size_t)R * D;
    /* The kernel's scratch: scores [R][P], with several tokens then the
     * block widened to f32 [2][P][D]. */
    uint32_t *lim = (uint32_t *)(void *)(sbuf + (size_t)R * P +
                                          (st->rmax > 1 ? 2u * (size_t)P * D : 0u));
    const uint8_t **blocks = (const uint8_t **)(void *)(lim + ((R + 1u) & ~1u));
    const uint32_t n = st->task_count[t];
    uint32_t *ntok = (uint32_t *)(void *)(blocks + n);
    uint32_t *pos = ntok + n;
    bool qfin = true;
    for (uint32_t j = 0; j < nn; j++) {
        const float *q = st->q + (((size_t)st->row0[i] + j) * st->Hq + (size_t)h * G) * D;
        float *qj = qs + (size_t)j * G * D;
        for (size_t e = 0; e < (size_t)G * D; e++) {
            qj[e] = q[e] * st->scale;
            qfin = qfin && isfinite(q[e]);
        }
        /* Token j of the step is at position tokens - nn + j: it sees the
         * tokens before it and itself. */
        for (uint32_t g = 0; g < G; g++)
            lim[j * G + g] = tokens + j + 1u > nn ? tokens + j + 1u - nn : 0u;
    }

    float *m = kvt__part(st, t), *l = m + R, *acc = l + R;
    for (uint32_t g = 0; g < R; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, (size_t)R * D * sizeof *acc);

    const uint32_t *sel = st->sel_pages + st->sel_off[ih] + st->task_first[t];
    const size_t base = kvt__lh(p, st->layer, h) * s->cap_pages;
    /* The first position of a page holding a NaN or infinite key (flagged
     * at append); a row that sees it has no defined attention. */
    uint32_t badpos = UINT32_MAX;
    /* A page on the disk tier only is read into the thread's bounce block
     * (a dense step over offloaded pages); NULL marks it below. */
    uint8_t *bounce = st->bounce_off ? (uint8_t *)(((uintptr_t)(mem + st->bounce_off) +
                                                    KVT__DIO_ALIGN - 1) &
                                                   ~(uintptr_t)(KVT__DIO_ALIGN - 1))
                                     : NULL;
    for (uint32_t j = 0; j < n; j++) {
        const uint32_t pg = sel[j];
        const uint32_t db = s->dev_block[base + pg], hb = s->host_block[base + pg];
        if ((s->res[base + pg] & KVT__RES_NONFINITE) && pg * P < badpos)
            badpos = pg * P;
        if (db)
            blocks[j] = kvt__arena_block(&p->tier[KVT_TIER_DEVICE], db);
        else if (hb) /* CPU backend: the host tier is readable in place */
            blocks[j] = kvt__arena_block(&p->tier[KVT_TIER_HOST], hb);
        else if (bounce && (s->res[base + pg] & KVT_RES_DISK))
            blocks[j] = NULL;
        else {
            int z = 0; /* a page no tier holds: 1, unless an error came first */
            atomic_compare_exchange_strong(&st->err, &z, 1);
            __atomic_store_n(&st->run[i], 1, __ATOMIC_RELAXED);
            blocks[j] = kvt__arena_block(&p->tier[KVT_TIER_DEVICE], 0); /* zeros */
        }
        const uint32_t left = tokens - pg * P;
        ntok[j] = left < P ? left : P;
        pos[j] = pg * P;
    }
    const kvt__attn_shape sh = {R, D, P, p->g.dtype};
    /* One token: its row sees every stored token (the mask would not cut). */
    const uint32_t *lm = nn > 1 ? lim : NULL;
    uint32_t j0 = 0;
    for (uint32_t j = 0; j <= n; j++) {
        if (j < n && blocks[j])
            continue;
        if (j > j0) /* the run of in-memory pages before j */
            p->kern->attn(&sh, qs, blocks + j0, ntok + j0, pos + j0, lm, j - j0, m, l, acc, sbuf);
        if (j < n) { /* page j from disk, in its place in the order */
            const int rc = kvt__disk_read_into(p, kvt__disk_slot(p, s, base / s->cap_pages,
                                                                 sel[j]), bounce);
            if (rc) { /* an I/O error wins over a missing page */
                int cur = atomic_load(&st->err);
                while ((cur == 0 || cur == 1) &&
                       !atomic_compare_exchange_weak(&st->err, &cur, rc))
                    ;
                __atomic_store_n(&st->run[i], 1, __ATOMIC_RELAXED);
            } else {
                const uint8_t *b1 = bounce;
                p->kern->attn(&sh, qs, &b1, ntok + j, pos + j, lm, 1, m, l, acc, sbuf);
            }
        }
        j0 = j + 1;
    }
    /* A non-finite query element (that head) or key (every head of the
     * group) has no defined attention: the part says so with l = NaN, and
     * the merge turns the head's output and lse NaN, never the zeros and
     * -inf that mean "no tokens", never a silently dropped token. */
    for (uint32_t g = 0; !(qfin && badpos == UINT32_MAX) && g < R; g++) {
        /* A causal row is bad only if it sees the flagged page. */
        bool bad = badpos != UINT32_MAX && (!lm || lim[g] > badpos);
        const float *q = st->q + (((size_t)st->row0[i] + g / G) * st->Hq + (size_t)h * G +
                                  g % G) * D;
        for (uint32_t d = 0; !bad && d < D; d++)
            bad = !isfinite(q[d]);
        if (bad)
            l[g] = NAN;
    }
    if (atomic_fetch_sub_explicit(&st->pending[ih], 1, memory_order_acq_rel) == 1)
        kvt__merge(st, ih);
}

/* Sequence i's rows of a decode that did not run: zeros, lse -infinity. */
static void kvt__dec_empty(const kvt_step *st, uint32_t i, float *out, float *lse)
{
    const size_t r0 = st->row0[i], nr = st->nnew[i];
    memset(out + r0 * st->Hq * st->D, 0, nr * st->Hq * st->D * sizeof *out);
    if (lse)
        for (size_t g = 0; g < nr * st->Hq; g++)
            lse[r0 * st->Hq + g] = -INFINITY;
}

/* Builds and runs the decode tasks of the sequences whose round[i] equals
 * `round` (every sequence when round is NULL). */
static int kvt__dec_round(kvt_step *st, const uint8_t *rnd, uint8_t round)
{
    const uint32_t G = st->G, D = st->D;
    size_t nt = 0;
    uint64_t pu = 0; /* floats of the part buffer handed out */
    for (uint32_t ih = 0; ih < st->n * st->H; ih++) {
        const uint32_t i = ih / st->H, h = ih % st->H;
        if (rnd && rnd[i] != round)
            continue;
        const uint32_t R = st->nnew[i] * G, tp = kvt__task_pages(st->nnew[i], G);
        const uint64_t pf = (uint64_t)R * (2u + D);
        const uint32_t cnt = st->sel_cnt[ih];
        const uint32_t k = (cnt + tp - 1) / tp;
        if (nt + k > st->cap_tasks || pu + k * pf > st->cap_part)
            return kvt__err(KVT_EINTERNAL, "step: decode needs more than the %zu tasks (%zu "
                            "floats of results) the plan sized", st->cap_tasks, st->cap_part);
        st->task0[ih] = (uint32_t)nt;
        st->ntask[ih] = k;
        atomic_store_explicit(&st->pending[ih], k, memory_order_relaxed);
        for (uint32_t c = 0; c < k; c++, nt++) {
            st->task_ih[nt] = ih;
            st->task_first[nt] = c * tp;
            st->task_count[nt] = cnt - c * tp < tp ? cnt - c * tp : tp;
            st->task_part[nt] = pu;
            pu += pf;
        }
        if (k == 0) /* no tokens in this layer */
            for (uint32_t j = 0; j < st->nnew[i]; j++) {
                const size_t row = (size_t)st->row0[i] + j;
                memset(st->out + (row * st->Hq + (size_t)h * G) * D, 0,
                       (size_t)G * D * sizeof *st->out);
                if (st->lse)
                    for (uint32_t g = 0; g < G; g++)
                        st->lse[row * st->Hq + (size_t)h * G + g] = -INFINITY;
            }
    }
    if (nt)
        kvt__tp_run(&st->pool->tp, kvt__dec_task, st, (uint32_t)nt);
    return 0;
}

/* The sequences of a failed promotion (round[i] == 2): their heads rescore
 * at the next step; returns the error that names the first. */
static int kvt__dec_failed(kvt_step *st, uint32_t layer, uint8_t *rnd)
{
    int first = 0;
    uint32_t bad = 0;
    for (uint32_t i = 0; i < st->n; i++) {
        if (rnd[i] != 2)
            continue;
        if (!first) {
            first = st->fcode[i] ? st->fcode[i] : st->wcode[i];
            bad = i;
        }
        kvt__fail_reset(st, i);
    }
    for (uint32_t i = 0; i < st->n; i++)
        rnd[i] = 0;
    if (!first)
        return 0;
    char why[256];
    snprintf(why, sizeof why, "%s", kvt_last_error());
    return kvt__err(first, "sparse decode: promoted pages of sequence %u, layer %u did not "
                    "load (%s); its output is zeros, its heads rescore at the next step", bad,
                    layer, why);
}

#ifdef KVT_TEST_HOOKS
/* Decodes on CUDA that launched ready sequences before waiting for the
 * others' promotions (a test hook: the ready-first split ran). */
uint64_t kvt__cuda_ready_first;
#endif

/* A backend's decode (CUDA). With lower tiers, ready first, as on the CPU:
 * round 0 places and launches the sequences whose promotions have landed
 * (and empties those whose promotions failed: zeros, -infinity); then
 * round 1 waits on the host for each other sequence's fence and places and
 * launches those, so their copies overlap round 0's kernels. Block lists
 * come from the host tables. */
static int kvt__be_decode(kvt_step *st, uint32_t layer, const float *q, float *out, float *lse)
{
    const kvt__backend *be = st->pool->be;
    if (!kvt__lower_on_host(st->pool))
        return be->step_decode(st, layer, q, out, lse, NULL);
    uint8_t *rnd = st->failed, *run = st->run;
    bool late = false, ready = false, skipped = false;
    for (uint32_t i = 0; i < st->n; i++) {
        rnd[i] = !st->tiered ? 0 : kvt__pending(st, i) ? 1 : (st->fcode[i] || st->wcode[i]) ? 2 : 0;
        run[i] = rnd[i] == 1 ? 0 : rnd[i] == 0 ? 1 : 2;
        late = late || rnd[i] == 1;
        ready = ready || rnd[i] == 0;
    }
    uint32_t missing = 0, miss1 = 0;
    int rc = be->step_place(st, layer, run, &missing);
    if (!rc)
        rc = be->step_decode(st, layer, q, out, lse, run);
    if (!rc && late) {
        KVT__HOOK(kvt__cuda_ready_first += ready); /* round 0 decoded some before the wait */
        for (uint32_t i = 0; i < st->n; i++) {
            run[i] = 0;
            if (rnd[i] != 1)
                continue;
            kvt__settle(st, i, true);
            rnd[i] = (st->fcode[i] || st->wcode[i]) ? 2 : 1;
            run[i] = rnd[i];
        }
        rc = be->step_place(st, layer, run, &miss1);
        if (!rc)
            rc = be->step_decode(st, layer, q, out, lse, run);
        missing += miss1;
    }
    for (uint32_t i = 0; i < st->n; i++)
        skipped = skipped || rnd[i] == 2;
    if (skipped) /* the emptied items stay empty: a new decode needs a new selection */
        st->emptied_layer = layer;
    /* Sequences still pending (an error stopped round 1) settle as orphans
     * before the next selection. */
    const int rf = kvt__dec_failed(st, layer, rnd);
    rc = rc ? rc : rf;
    if (!rc && missing)
        rc = kvt__err(KVT_ESTATE, "sparse decode: %u selected page%s of layer %u %s no copy "
                      "in the device tier (the CUDA backend decodes device pages only; fetch "
                      "them with kvt_mover_submit first); they read as zeros", missing,
                      missing == 1 ? "" : "s", layer, missing == 1 ? "has" : "have");
    return rc;
}

/* q, out and lse of a decode may not share memory: the kernels read q
 * while they write out and lse. */
static int kvt__io_disjoint(const kvt_step *st, const float *q, const float *out,
                            const float *lse)
{
    const size_t rows = (size_t)st->rows * st->Hq;
    const size_t nq = rows * st->D * sizeof(float), nl = lse ? rows * sizeof(float) : 0;
    if (kvt__overlap(q, nq, out, nq))
        return kvt__err(KVT_EINVAL, "out: overlaps q (%zu bytes each); the decode reads q "
                        "while it writes out", nq);
    if (kvt__overlap(lse, nl, q, nq))
        return kvt__err(KVT_EINVAL, "lse: overlaps q");
    if (kvt__overlap(lse, nl, out, nq))
        return kvt__err(KVT_EINVAL, "lse: overlaps out");
    return 0;
}

KVT_API int kvt_step_decode(kvt_step *st, uint32_t layer, const float *q, float *out,
                            float *lse)
{
    int rc = kvt__step_enter(st, layer);
    if (rc)
        return rc;
    KVT__CHECK_NULL(q);
    KVT__CHECK_NULL(out);
    if ((rc = kvt__io_disjoint(st, q, out, lse)))
        return rc;
    if (st->sel_layer != layer)
        return kvt__err(KVT_ESTATE, "layer: %u has no selection in this step (call "
                        "kvt_step_select or kvt_step_attend for it first)", layer);
    if (st->pool->be->step_decode && st->emptied_layer == layer)
        return kvt__err(KVT_ESTATE, "layer: %u's decode emptied the sequences whose promotions "
                        "failed; select the layer again before decoding it again", layer);
    if (st->pool->be->step_decode)
        return kvt__be_decode(st, layer, q, out, lse);
    st->layer = layer;
    st->q = q;
    st->out = out;
    st->lse = lse;
    atomic_store(&st->err, 0);
    memset(st->run, 0, st->n); /* the sequences a task could not read a page of */
    if (!st->tiered) {
        if ((rc = kvt__dec_round(st, NULL, 0)))
            return rc;
    } else {
        /* Round 0: sequences whose promotions have landed; round 1: the
         * others, each once its copies are in; round 2: failed copies. */
        uint8_t *rnd = st->failed;
        for (uint32_t i = 0; i < st->n; i++)
            rnd[i] = kvt__pending(st, i) ? 1 : (st->fcode[i] || st->wcode[i]) ? 2 : 0;
        if ((rc = kvt__dec_round(st, rnd, 0)))
            return rc;
        bool waited = false;
        for (uint32_t i = 0; i < st->n; i++)
            if (rnd[i] == 1) {
                kvt__settle(st, i, true);
                rnd[i] = (st->fcode[i] || st->wcode[i]) ? 2 : 1;
                waited = true;
            }
        if (waited && (rc = kvt__dec_round(st, rnd, 1)))
            return rc;
        /* The heads whose pages did not arrive rescore at the next step;
         * this layer's output of the sequence is not computed. */
        for (uint32_t i = 0; i < st->n; i++) {
            if (rnd[i] != 2)
                continue;
            kvt__dec_empty(st, i, out, lse);
        }
        if ((rc = kvt__dec_failed(st, layer, rnd)))
            return rc;
    }
    const int derr = atomic_load(&st->err);
    if (derr) {
        /* A sequence with a selected page on disk only (that could not be
         * read): its output is not the attention; zeros and lse -infinity,
         * as after a failed copy. */
        uint32_t bad = 0;
        for (uint32_t i = 0; i < st->n; i++) {
            /* The tasks marked the sequences with a page they could not
             * read (in no readable tier, or a failed disk read). */
            if (!__atomic_load_n(&st->run[i], __ATOMIC_RELAXED))
                continue;
            bad++;
            kvt__dec_empty(st, i, out, lse);
        }
        if (derr < 0)
            return kvt__err(derr, "sparse decode: reading a page of layer %u from the disk tier "
                            "failed (%s; %u sequence%s read from disk: output zeros, lse "
                            "-infinity)", layer, derr == KVT_ECORRUPT ? "checksum mismatch" :
                            kvt_err_name(derr), bad, bad == 1 ? "" : "s");
        return kvt__err(KVT_ESTATE, "sparse decode: a selected page of layer %u is in no tier "
                        "the decode can read (%u sequence%s: output zeros, lse -infinity); "
                        "fetch it to the device or host tier (kvt_mover_submit) first", layer,
                        bad, bad == 1 ? "" : "s");
    }
    return 0;
}

KVT_API int kvt_step_attend(kvt_step *st, uint32_t layer, const float *q, float *out, float *lse)
{
    if (!st)
        return kvt__err(KVT_EINVAL, "step: must not be NULL");
    KVT__CHECK_NULL(q);
    KVT__CHECK_NULL(out);
    int rc = st->open ? kvt__io_disjoint(st, q, out, lse) : 0;
    if (rc)
        return rc;
    rc = kvt_step_select(st, layer, q);
    if (rc)
        return rc;
    return kvt_step_decode(st, layer, q, out, lse);
}
