/* The tiered-placement tests' helpers (placetest.h). */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "placetest.h"

/* ---- values -------------------------------------------------------------- */

uint16_t f16_moderate(tu_rng *r)
{
    uint16_t e = (uint16_t)(9 + tu_below(r, 8)), m = (uint16_t)tu_below(r, 1024);
    return (uint16_t)((tu_below(r, 2) << 15) | (e << 10) | m);
}

uint16_t f16_exact(double x)
{
    if (x == 0)
        return 0;
    uint16_t sign = x < 0 ? 0x8000 : 0;
    int e;
    double m = frexp(fabs(x), &e); /* |x| = m * 2^e, m in [0.5, 1) */
    int E = e - 1 + 15;
    double f = (2 * m - 1) * 1024;
    assert_true(E >= 1 && E <= 30 && f == floor(f));
    uint16_t h = (uint16_t)(sign | (E << 10) | (uint16_t)f);
    assert_true(tu_f16_value(h) == x);
    return h;
}

uint32_t pages_of(uint32_t T)
{
    return (T + PAGE_TOKENS - 1) / PAGE_TOKENS;
}

/* ---- the fixture --------------------------------------------------------- */

pheads ph_uniform(uint32_t k, uint32_t w, uint32_t sink, uint32_t local, uint32_t iv)
{
    pheads ph;
    for (uint32_t b = 0; b < NLH; b++) {
        ph.cls[b] = KVT_HEAD_STABLE;
        ph.k[b] = k;
        ph.w[b] = w;
        ph.sink[b] = sink;
        ph.local[b] = local;
        ph.iv[b] = iv;
    }
    return ph;
}

void ph_unstable(pheads *ph, uint32_t layer, uint32_t head)
{
    ph->cls[layer * N_KV_HEADS + head] = KVT_HEAD_UNSTABLE;
    ph->iv[layer * N_KV_HEADS + head] = 1;
}

kvt_geometry pgeom(void)
{
    return (kvt_geometry){N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, {0, 0}};
}

kvt_policy *policy_of(const pheads *ph)
{
    kvt_geometry g = pgeom();
    kvt_policy_heads hd = {sizeof hd, NLH, ph->cls, ph->k, ph->w, ph->sink, ph->local, ph->iv, NULL};
    /* The interval alone: these tests' model reranks on the schedule (the
     * selection cache has its own tests, tests/test_select.c). */
    kvt_policy_opts o;
    kvt_policy_opts_init(&o);
    o.rerank_similarity = -1.0f;
    kvt_policy *pol;
    TU_OK(kvt_policy_create_heads(&g, &o, &hd, &pol));
    return pol;
}

kvt_selector *selector_of(void)
{
    kvt_geometry g = pgeom();
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT; /* MINMAX, SUM */
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, &so, &sel));
    return sel;
}

kvt_pool_opts pfx_opts(pfx *f, uint64_t dev, uint64_t host, uint64_t disk_bytes)
{
    TU_OK(kvt_mover_opts_init(&f->mo));
    f->mo.extent_pages = 4;
    f->mo.segment_extents = 2;
    f->mo.max_io_bytes = 8192;
    kvt_pool_opts o =
        tu_opts(N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, dev, host);
    o.policy = f->pol;
    o.selector = f->sel;
    o.n_threads = 2;
    o.mover = &f->mo;
    if (disk_bytes) {
        o.disk_dir = g_dir;
        o.disk_bytes = disk_bytes;
    }
    return o;
}

pfx *pfx_new(const pheads *ph, uint64_t seed)
{
    pfx *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->ph = *ph;
    f->g = pgeom();
    f->pol = policy_of(ph);
    f->sel = selector_of();
    f->r = (tu_rng){seed};
    return f;
}

pfx *pfx_open(const pheads *ph, uint64_t dev, uint64_t host, uint64_t disk_bytes, uint64_t seed)
{
    pfx *f = pfx_new(ph, seed);
    kvt_pool_opts o = pfx_opts(f, dev, host, disk_bytes);
    TU_OK(kvt_pool_create(&o, &f->p));
    f->m = mover_of(f->p);
    f->disk = disk_bytes != 0;
    return f;
}

void pfx_close(pfx *f)
{
    if (f->p)
        TU_CHECK(f->p);
    kvt_pool_destroy(f->p);
    for (uint32_t i = 0; i < f->ns; i++)
        tseq_free(&f->t[i]);
    kvt_policy_destroy(f->pol);
    kvt_selector_destroy(f->sel);
    free(f);
}

bool is_stable(const pfx *f, uint32_t lh)
{
    return f->ph.cls[lh] == KVT_HEAD_STABLE;
}

int wait_all(pfx *f)
{
    return kvt_mover_wait(f->m, KVT_FENCE_ALL, UINT64_MAX);
}

kvt_stats pstats(const kvt_pool *p)
{
    kvt_stats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    TU_OK(kvt_pool_stats_get(p, &s));
    return s;
}

uint16_t design_key(const pfx *f, uint32_t i, uint32_t lh, uint32_t tok, uint32_t d)
{
    const uint32_t pg = tok / PAGE_TOKENS;
    if (d == 0)
        return f16_exact(f->s[i][lh][pg]);
    return d == 1 + pg % (HEAD_DIM - 1) ? 0x3c00 /* 1.0 */ : 0;
}

void pfx_prefill(pfx *f, uint32_t i, uint32_t n)
{
    tseq *t = &f->t[i];
    assert_true(t->n + n <= MAXTOK);
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        uint16_t *k = t->k[l] + (size_t)t->n * N_KV_HEADS * HEAD_DIM;
        uint16_t *v = t->v[l] + (size_t)t->n * N_KV_HEADS * HEAD_DIM;
        for (uint32_t tk = 0; tk < n; tk++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++)
                for (uint32_t d = 0; d < HEAD_DIM; d++) {
                    size_t e = ((size_t)tk * N_KV_HEADS + h) * HEAD_DIM + d;
                    k[e] = f->designed[i] ? design_key(f, i, l * N_KV_HEADS + h, t->n + tk, d)
                                          : f16_moderate(&f->r);
                    v[e] = f16_moderate(&f->r);
                }
        TU_OK(kvt_seq_append(f->p, t->id, l, k, v, n, KVT_DTYPE_F16, 0));
    }
    t->n += n;
}

uint32_t pfx_add(pfx *f, uint32_t n, int keys)
{
    const bool designed = keys != KEYS_RANDOM;
    assert_true(f->ns < MAXS);
    const uint32_t i = f->ns++;
    tseq_init(&f->t[i]);
    TU_OK(kvt_seq_create(f->p, NULL, &f->t[i].id));
    f->designed[i] = designed;
    f->warm_pending[i] = false;
    memset(f->ntopk[i], 0, sizeof f->ntopk[i]);
    if (designed) {
        const uint32_t np = pages_of(n);
        assert_true(np < 128 && np < HEAD_DIM - 1);
        for (uint32_t lh = 0; lh < NLH; lh++) {
            uint32_t perm[128];
            for (uint32_t j = 0; j < np; j++)
                perm[j] = j;
            for (uint32_t j = np; j > 1; j--) {
                uint32_t x = tu_below(&f->r, j), tmp = perm[j - 1];
                perm[j - 1] = perm[x];
                perm[x] = tmp;
            }
            for (uint32_t j = 0; j < np; j++)
                f->s[i][lh][j] = keys == KEYS_FLAT ? 0.25 : (perm[j] + 1) / 128.0 + lh / 512.0;
        }
    }
    pfx_prefill(f, i, n);
    return i;
}

void pfx_release(pfx *f, uint32_t i)
{
    TU_OK(kvt_seq_release(f->p, f->t[i].id));
    tseq_free(&f->t[i]);
    for (uint32_t j = i; j + 1 < f->ns; j++) {
        f->t[j] = f->t[j + 1];
        f->designed[j] = f->designed[j + 1];
        f->warm_pending[j] = f->warm_pending[j + 1];
        memcpy(f->topk[j], f->topk[j + 1], sizeof f->topk[j]);
        memcpy(f->ntopk[j], f->ntopk[j + 1], sizeof f->ntopk[j]);
        memcpy(f->s[j], f->s[j + 1], sizeof f->s[j]);
    }
    f->ns--;
}

uint32_t pfx_fork(pfx *f, uint32_t src)
{
    assert_true(f->ns < MAXS);
    const uint32_t i = f->ns++;
    tseq_init(&f->t[i]);
    TU_OK(kvt_seq_fork(f->p, f->t[src].id, NULL, &f->t[i].id));
    f->t[i].n = f->t[src].n;
    for (int l = 0; l < N_LAYERS; l++) {
        memcpy(f->t[i].k[l], f->t[src].k[l], (size_t)f->t[src].n * N_KV_HEADS * HEAD_DIM * 2);
        memcpy(f->t[i].v[l], f->t[src].v[l], (size_t)f->t[src].n * N_KV_HEADS * HEAD_DIM * 2);
    }
    f->designed[i] = f->designed[src];
    f->warm_pending[i] = false;
    memcpy(f->topk[i], f->topk[src], sizeof f->topk[i]);
    memcpy(f->ntopk[i], f->ntopk[src], sizeof f->ntopk[i]);
    memcpy(f->s[i], f->s[src], sizeof f->s[i]);
    return i;
}

void pfx_truncate(pfx *f, uint32_t i, uint32_t n)
{
    TU_OK(kvt_seq_truncate(f->p, f->t[i].id, n));
    f->t[i].n = n;
}

void table(const pfx *f, uint32_t i, uint32_t l, uint32_t h, uint32_t np, uint32_t *blk,
           uint8_t *res)
{
    if (np)
        TU_OK(kvt_seq_block_table_get(f->p, f->t[i].id, l, h, 0, np, blk, NULL, res));
}

uint32_t seq_len(const pfx *f, uint32_t i, uint32_t l)
{
    uint32_t T;
    TU_OK(kvt_seq_length_get(f->p, f->t[i].id, l, &T));
    return T;
}

/* ---- references ---------------------------------------------------------- */

void forced_pages(uint8_t *forced, uint32_t T, uint32_t sink, uint32_t local)
{
    tu_forced_pages(forced, T, PAGE_TOKENS, sink, local);
}

void ref_scores(const pfx *f, uint32_t i, uint32_t l, uint32_t h, uint32_t np, const float *q,
                double *ref, double *tol)
{
    float mn[HEAD_DIM], mx[HEAD_DIM];
    for (uint32_t pg = 0; pg < np; pg++) {
        TU_OK(kvt_seq_page_meta_get(f->p, f->t[i].id, l, h, pg, mn, mx, NULL));
        double sum = 0, mag = 0;
        for (uint32_t g = 0; g < GQA_GROUP; g++)
            for (uint32_t d = 0; d < HEAD_DIM; d++) {
                double qd = q[(size_t)g * HEAD_DIM + d];
                double t = qd * mn[d] > qd * mx[d] ? qd * mn[d] : qd * mx[d];
                sum += t;
                mag += fabs(t);
            }
        ref[pg] = sum;
        if (tol)
            tol[pg] = 1e-4 * fabs(sum) + 1e-5 * mag;
    }
}

void top_n(const double *score, const uint8_t *forced, uint32_t np, uint32_t n, uint8_t *chosen)
{
    memset(chosen, 0, np ? np : 1);
    for (uint32_t c = 0; c < n; c++) {
        int best = -1;
        for (uint32_t pg = 0; pg < np; pg++)
            if (!forced[pg] && !chosen[pg] && (best < 0 || score[pg] > score[best]))
                best = (int)pg;
        if (best < 0)
            break;
        chosen[best] = 1;
    }
}

void ref_attn(const pfx *f, uint32_t i, uint32_t l, uint32_t h, uint32_t T, const uint32_t *pages,
              uint32_t np, const float *q, double *out, double *lse, double *kappa, double *vmax)
{
    const tseq *t = &f->t[i];
    const double scale = 1.0 / sqrt((double)HEAD_DIM);
    double *kd = malloc(((size_t)np * PAGE_TOKENS * HEAD_DIM + 1) * sizeof *kd);
    double *vd = malloc(((size_t)np * PAGE_TOKENS * HEAD_DIM + 1) * sizeof *vd);
    uint32_t n = 0;
    for (uint32_t j = 0; j < np; j++) {
        assert_true(pages[j] * PAGE_TOKENS < T);
        const uint32_t t0 = pages[j] * PAGE_TOKENS;
        const uint32_t cnt = T - t0 < PAGE_TOKENS ? T - t0 : PAGE_TOKENS;
        for (uint32_t tk = t0; tk < t0 + cnt; tk++, n++)
            for (uint32_t d = 0; d < HEAD_DIM; d++) {
                size_t e = ((size_t)tk * N_KV_HEADS + h) * HEAD_DIM + d;
                kd[(size_t)n * HEAD_DIM + d] = tu_f16_value(t->k[l][e]);
                vd[(size_t)n * HEAD_DIM + d] = tu_f16_value(t->v[l][e]);
            }
    }
    tu_ref_attention(q, GQA_GROUP, HEAD_DIM, kd, vd, n, scale, out, lse, kappa, vmax);
    free(kd);
    free(vd);
}

void check_rows(const float *out, const float *lse, const double *ref, const double *ref_lse,
                const double *kappa, double vmax, const char *what)
{
    for (uint32_t g = 0; g < GQA_GROUP; g++) {
        const float *o = out + (size_t)g * HEAD_DIM;
        const double *rf = ref + (size_t)g * HEAD_DIM;
        double err = 0, norm = 0;
        for (uint32_t d = 0; d < HEAD_DIM; d++) {
            double e = fabs((double)o[d] - rf[d]);
            if (!(e <= err))
                err = e;
            norm = fabs(rf[d]) > norm ? fabs(rf[d]) : norm;
        }
        const double serr = 8.0 * 0x1p-24 * sqrt((double)HEAD_DIM) * kappa[g];
        const double tol = 1e-4 * (norm > 1e-2 ? norm : 1e-2) + serr * vmax;
        if (!(err <= tol))
            fail_msg("%s q head %u: max |out - ref| %.3g, max |ref| %.3g, tolerance %.3g", what,
                     g, err, norm, tol);
        if (!(fabs((double)lse[g] - ref_lse[g]) <= 1e-5 * (1 + fabs(ref_lse[g])) + serr))
            fail_msg("%s q head %u: lse %.9g, reference %.9g", what, g, (double)lse[g],
                     ref_lse[g]);
    }
}

/* ---- one decode step ----------------------------------------------------- */

const float *q_of(const float *q, uint32_t i, uint32_t h)
{
    return q + ((size_t)i * HQ + (size_t)h * GQA_GROUP) * HEAD_DIM;
}

void pfx_step(pfx *f, const step_args *a, step_res *res)
{
    static uint32_t plan_blk[MAXS][NLH][MAXPG], plan_np[MAXS][NLH];
    static uint32_t blk_b[MAXS][N_KV_HEADS][MAXPG], blk_a[MAXS][N_KV_HEADS][MAXPG];
    static uint8_t res_b[MAXS][N_KV_HEADS][MAXPG], res_a[MAXS][N_KV_HEADS][MAXPG];
    static uint32_t sel[MAXS][N_KV_HEADS][MAXPG], nsel[MAXS][N_KV_HEADS];
    static double sc[MAXS][N_KV_HEADS][MAXPG], tl[MAXS][N_KV_HEADS][MAXPG];
    static float q[MAXS * HQ * HEAD_DIM], out[MAXS * HQ * HEAD_DIM], lse[MAXS * HQ];
    static uint16_t kn[MAXS * N_KV_HEADS * HEAD_DIM], vn[MAXS * N_KV_HEADS * HEAD_DIM];
    const uint32_t ns = f->ns;
    kvt_seq_id ids[MAXS];
    memset(res, 0, sizeof *res);
    for (uint32_t i = 0; i < ns; i++)
        ids[i] = f->t[i].id;
    if (a->wait_before) {
        TU_OK(wait_all(f));
        memset(f->warm_pending, 0, sizeof f->warm_pending);
    }

    kvt_step_opts so = KVT_STEP_OPTS_INIT; /* the pool's selector and policy */
    kvt_step *st;
    TU_OK(kvt_step_plan(f->p, ids, ns, &so, &st));
    for (uint32_t i = 0; i < ns; i++)
        for (uint32_t l = 0; l < N_LAYERS; l++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                plan_np[i][l * N_KV_HEADS + h] = pages_of(seq_len(f, i, l));
                table(f, i, l, h, plan_np[i][l * N_KV_HEADS + h], plan_blk[i][l * N_KV_HEADS + h],
                      NULL);
            }
    if (a->after_plan)
        a->after_plan(f, st);
    if (a->wait_after_plan) {
        TU_OK(wait_all(f));
        memset(f->warm_pending, 0, sizeof f->warm_pending);
        for (uint32_t i = 0; i < ns; i++) {
            uint32_t ready = 9;
            TU_OK(kvt_step_ready_get(st, i, &ready));
            if (ready != 1)
                fail_msg("seq %u not ready after every move was waited for", i);
        }
    }

    for (uint32_t l = 0; l < N_LAYERS; l++) {
        /* One new token per sequence, kept as the reference. */
        for (uint32_t i = 0; i < ns; i++)
            for (uint32_t e = 0; e < N_KV_HEADS * HEAD_DIM; e++) {
                kn[i * N_KV_HEADS * HEAD_DIM + e] = f16_moderate(&f->r);
                vn[i * N_KV_HEADS * HEAD_DIM + e] = f16_moderate(&f->r);
                const size_t at = (size_t)f->t[i].n * N_KV_HEADS * HEAD_DIM + e;
                f->t[i].k[l][at] = kn[i * N_KV_HEADS * HEAD_DIM + e];
                f->t[i].v[l][at] = vn[i * N_KV_HEADS * HEAD_DIM + e];
            }
        TU_OK(kvt_step_append(st, l, kn, vn, KVT_DTYPE_F16, 0));
        if (a->make_q)
            a->make_q(f, l, q);
        else
            for (uint32_t e = 0; e < ns * HQ * HEAD_DIM; e++)
                q[e] = 2.0f * tu_unit(&f->r);
        /* The device tier before the rerank, and the reference scores. */
        for (uint32_t i = 0; i < ns; i++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                const uint32_t T = seq_len(f, i, l), np = pages_of(T);
                assert_int_equal(T, f->t[i].n + 1);
                table(f, i, l, h, np, blk_b[i][h], res_b[i][h]);
                ref_scores(f, i, l, h, np, q_of(q, i, h), sc[i][h], tl[i][h]);
            }
        const kvt_stats sa = pstats(f->p);
        if (a->before_rerank)
            a->before_rerank(f, l);
        TU_OK(kvt_step_select(st, l, q));
        for (uint32_t i = 0; i < ns; i++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                uint32_t rr = 9;
                TU_OK(kvt_step_selection_get(st, l, i, h, sel[i][h], MAXPG, &nsel[i][h], &rr));
                assert_true(rr <= 1);
                res->reranked[i][l * N_KV_HEADS + h] = (uint8_t)rr;
            }
        /* Ready: nothing of the layer is still on its way, so every selected
         * page must be on device already. A sequence that is ready now and
         * had no warm-up copy in flight at the rerank never has to wait:
         * may_pause bounds paused_seqs. (A sequence whose warm-up copies
         * were in flight may wait for them in the rerank and again in the
         * decode; the library counts both.) */
        uint32_t not_ready = 0, may_pause = 0;
        for (uint32_t i = 0; i < ns && !a->faulty; i++) {
            uint32_t ready = 9;
            TU_OK(kvt_step_ready_get(st, i, &ready));
            assert_true(ready <= 1);
            not_ready += !ready;
            may_pause += !ready + f->warm_pending[i];
            if (a->wait_after_rerank && !ready) {
                TU_OK(wait_all(f));
                TU_OK(kvt_step_ready_get(st, i, &ready));
                if (ready != 1)
                    fail_msg("layer %u seq %u not ready after every move was waited for", l, i);
                not_ready--;
                may_pause--;
            }
            for (uint32_t h = 0; ready && h < N_KV_HEADS; h++) {
                uint8_t rs[MAXPG];
                table(f, i, l, h, pages_of(f->t[i].n + 1), NULL, rs);
                for (uint32_t j = 0; j < nsel[i][h]; j++)
                    if (!(rs[sel[i][h][j]] & KVT_RES_DEVICE))
                        fail_msg("layer %u seq %u head %u: ready, but selected page %u is "
                                 "not on device (residency %#x)", l, i, h, sel[i][h][j],
                                 rs[sel[i][h][j]]);
            }
        }
        res->not_ready += not_ready;
        for (size_t e = 0; e < (size_t)ns * HQ * HEAD_DIM; e++)
            out[e] = NAN;
        const int rc = kvt_step_decode(st, l, q, out, lse);
        res->rc[l] = rc;
        if (rc && !(a->faulty && (rc == KVT_EIO || rc == KVT_ECORRUPT)))
            fail_msg("layer %u: kvt_step_decode returned %d (%s): %s", l, rc,
                     kvt_err_name(rc), kvt_last_error());
        const kvt_stats sb = pstats(f->p);

        /* Failed sequences: every row zero, lse -infinity. */
        for (uint32_t i = 0; i < ns; i++) {
            bool inf = true;
            for (uint32_t j = 0; j < HQ; j++)
                inf &= isinf(lse[i * HQ + j]) && lse[i * HQ + j] < 0;
            if (!inf)
                continue;
            if (!rc)
                fail_msg("layer %u seq %u: lse -inf but the decode succeeded", l, i);
            res->failed[l] |= 1u << i;
            for (size_t e = 0; e < (size_t)HQ * HEAD_DIM; e++)
                if (out[(size_t)i * HQ * HEAD_DIM + e] != 0.0f)
                    fail_msg("layer %u seq %u failed: out[%zu] = %g, not 0", l, i, e,
                             (double)out[(size_t)i * HQ * HEAD_DIM + e]);
        }
        if (rc && !res->failed[l])
            fail_msg("layer %u: decode returned %s but no sequence came back zeroed", l,
                     kvt_err_name(rc));

        uint64_t want_sel = 0, want_res = 0, want_rr = 0;
        uint32_t ev_sum = 0, pr_sum = 0, rc_sum = 0;
        for (uint32_t i = 0; i < ns; i++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                const uint32_t lh = l * N_KV_HEADS + h, T = f->t[i].n + 1, np = pages_of(T);
                const uint32_t K = f->ph.k[lh], W = f->ph.w[lh];
                const uint32_t *sp = sel[i][h], n = nsel[i][h];
                const bool stable = is_stable(f, lh), failed = (res->failed[l] >> i) & 1;
                const bool rr = res->reranked[i][lh];
                char what[128];
                snprintf(what, sizeof what, "layer %u seq %u head %u (%s, T %u, %s)", l, i, h,
                         stable ? "stable" : "unstable", T, rr ? "rescored" : "reused");
                uint8_t forced[MAXPG], in[MAXPG] = {0};
                forced_pages(forced, T, f->ph.sink[lh], f->ph.local[lh]);
                for (uint32_t j = 0; j < n; j++)
                    in[sp[j]] = 1;
                table(f, i, l, h, np, blk_a[i][h], res_a[i][h]);
                const uint8_t *rb = res_b[i][h], *ra = res_a[i][h];

                /* The selection. */
                if (rr) {
                    tu_check_selection(sp, n, T, PAGE_TOKENS, K, f->ph.sink[lh], f->ph.local[lh],
                                       sc[i][h], tl[i][h], what);
                    f->ntopk[i][lh] = 0;
                    for (uint32_t j = 0; j < n; j++)
                        if (!forced[sp[j]])
                            f->topk[i][lh][f->ntopk[i][lh]++] = sp[j];
                } else {
                    if (!stable)
                        fail_msg("%s: an unstable head must rerank every step", what);
                    uint8_t want[MAXPG];
                    memcpy(want, forced, np);
                    for (uint32_t j = 0; j < f->ntopk[i][lh]; j++)
                        want[f->topk[i][lh][j]] = 1;
                    /* A budget that covers every page selects every page
                     * (pages that filled since the rerank included), as a
                     * rescore would. */
                    if ((uint64_t)K + f->ph.sink[lh] + f->ph.local[lh] >= np)
                        memset(want, 1, np);
                    uint32_t nw = 0;
                    for (uint32_t pg = 0; pg < np; pg++)
                        if (want[pg]) {
                            if (nw >= n || sp[nw] != pg) {
                                char got[256];
                                size_t at = 0;
                                for (uint32_t j = 0; j < n && at + 12 < sizeof got; j++)
                                    at += (size_t)snprintf(got + at, sizeof got - at, " %u",
                                                           sp[j]);
                                fail_msg("%s: page %u (last top-K or forced) expected at "
                                         "entry %u; selected:%s", what, pg, nw, got);
                            }
                            nw++;
                        }
                    if (n != nw)
                        fail_msg("%s: %u pages selected, expected %u", what, n, nw);
                }
                want_rr += rr;

                /* After the decode every selected page is on device, and the
                 * output is attention over exactly those pages. */
                if (failed) {
                    for (uint32_t j = 0; j < n; j++)
                        if (!(ra[sp[j]] & KVT_RES_DEVICE))
                            res->fail_head[i][lh] = 1;
                } else {
                    for (uint32_t j = 0; j < n; j++)
                        if (!(ra[sp[j]] & KVT_RES_DEVICE))
                            fail_msg("%s: selected page %u not on device after the decode "
                                     "(residency %#x)", what, sp[j], ra[sp[j]]);
                    double ref[GQA_GROUP * HEAD_DIM], rl[GQA_GROUP], kap[GQA_GROUP], vmax;
                    ref_attn(f, i, l, h, T, sp, n, q_of(q, i, h), ref, rl, kap, &vmax);
                    const size_t ob = (size_t)i * HQ + (size_t)h * GQA_GROUP;
                    check_rows(out + ob * HEAD_DIM, lse + ob, ref, rl, kap, vmax, what);
                }

                /* Placement. */
                if (!stable) {
                    for (uint32_t pg = 0; pg < np; pg++)
                        if (ra[pg] != KVT_RES_DEVICE)
                            fail_msg("%s: page %u residency %#x, an unstable head keeps "
                                     "every page on device only", what, pg, ra[pg]);
                    continue;
                }
                uint32_t ev = 0, pr = 0, reused = 0, dev_nf = 0;
                for (uint32_t pg = 0; pg < np; pg++) {
                    const bool was = rb[pg] & KVT_RES_DEVICE, is = ra[pg] & KVT_RES_DEVICE;
                    dev_nf += is && !forced[pg];
                    if (in[pg]) {
                        want_sel++;
                        want_res += was;
                        pr += !was;
                    }
                    if (was && !is) {
                        ev++;
                        if (in[pg] || forced[pg])
                            fail_msg("%s: page %u evicted but %s", what, pg,
                                     in[pg] ? "selected" : "forced");
                        if (!(rb[pg] & (KVT_RES_HOST | KVT_RES_DISK)))
                            fail_msg("%s: page %u evicted without a copy elsewhere "
                                     "(residency before %#x)", what, pg, rb[pg]);
                    }
                    /* (A warm-up copy may land behind the test's back.) */
                    if (!was && is && !in[pg] && a->exact_stats)
                        fail_msg("%s: page %u came to the device unselected", what, pg);
                }
                if (!rr && (ev || pr) && a->exact_stats)
                    fail_msg("%s: not due, yet %u evicted, %u promoted", what, ev, pr);
                /* Recycling: promoted pages take the evicted pages' blocks. */
                for (uint32_t pg = 0; pg < np && !failed && a->exact_stats; pg++) {
                    if (!in[pg] || (rb[pg] & KVT_RES_DEVICE))
                        continue;
                    for (uint32_t e = 0; e < np; e++)
                        if ((rb[e] & KVT_RES_DEVICE) && !(ra[e] & KVT_RES_DEVICE) &&
                            blk_b[i][h][e] == blk_a[i][h][pg]) {
                            reused++;
                            break;
                        }
                }
                if (!failed && a->exact_stats && reused != (ev < pr ? ev : pr))
                    fail_msg("%s: %u evicted, %u promoted, but %u promoted pages took an "
                             "evicted page's block", what, ev, pr, reused);
                ev_sum += ev;
                pr_sum += pr;
                rc_sum += ev < pr ? ev : pr;

                /* Lookahead eviction, exact when nothing was in flight at the
                 * rerank and every unforced device page had another copy. */
                if (a->wait_before && rr && !failed) {
                    uint32_t n_snf = 0, n_e = 0, n_ne = 0, kept = 0;
                    double lo = INFINITY, hi = -INFINITY;
                    for (uint32_t pg = 0; pg < np; pg++) {
                        if (forced[pg])
                            continue;
                        if (in[pg]) {
                            n_snf++;
                        } else if (rb[pg] & KVT_RES_DEVICE) {
                            if (!(rb[pg] & (KVT_RES_HOST | KVT_RES_DISK))) {
                                n_ne++;
                                continue;
                            }
                            n_e++;
                            const double s = sc[i][h][pg], t = tl[i][h][pg];
                            if (ra[pg] & KVT_RES_DEVICE) {
                                kept++;
                                lo = s + t < lo ? s + t : lo;
                            } else {
                                hi = s - t > hi ? s - t : hi;
                            }
                        }
                    }
                    if (!n_ne) {
                        const uint32_t room = K * W > n_snf ? K * W - n_snf : 0;
                        const uint32_t want_kept = n_e < room ? n_e : room;
                        if (kept != want_kept)
                            fail_msg("%s: %u evictable pages, %u kept on device, expected %u "
                                     "(K %u x window %u, %u selected)", what, n_e, kept,
                                     want_kept, K, W, n_snf);
                        if (lo < hi)
                            fail_msg("%s: an evicted page scored %.9g, above a kept one "
                                     "(%.9g)", what, hi, lo);
                        if (dev_nf > K * W)
                            fail_msg("%s: %u unforced pages on device, above K %u x "
                                     "window %u", what, dev_nf, K, W);
                    }
                }
            }
        res->evicted += ev_sum;
        res->promoted += pr_sum;
        res->recycled += rc_sum;

        /* The counters. */
        assert_true(sb.sel_pages >= sa.sel_pages && sb.sel_resident >= sa.sel_resident &&
                    sb.promoted_pages >= sa.promoted_pages && sb.paused_seqs >= sa.paused_seqs &&
                    sb.recycled_blocks >= sa.recycled_blocks &&
                    sb.evicted_pages >= sa.evicted_pages &&
                    sb.reranked_heads >= sa.reranked_heads);
        if (!a->faulty && sb.paused_seqs - sa.paused_seqs > may_pause)
            fail_msg("layer %u: paused_seqs grew by %llu, but only %u of %u sequences could "
                     "have waited (%u not ready after the rerank)", l,
                     (unsigned long long)(sb.paused_seqs - sa.paused_seqs), may_pause, ns,
                     not_ready);
        memset(f->warm_pending, 0, sizeof f->warm_pending); /* the step took them */
        if (a->exact_stats && !a->faulty) {
#define PT_DELTA(field, want)                                                              \
    do {                                                                                   \
        if (sb.field - sa.field != (uint64_t)(want))                                       \
            fail_msg("layer %u: kvt_stats." #field " grew by %llu, expected %llu", l,      \
                     (unsigned long long)(sb.field - sa.field), (unsigned long long)(want)); \
    } while (0)
            PT_DELTA(sel_pages, want_sel);
            PT_DELTA(sel_resident, want_res);
            PT_DELTA(promoted_pages, pr_sum);
            PT_DELTA(evicted_pages, ev_sum);
            PT_DELTA(recycled_blocks, rc_sum);
            PT_DELTA(reranked_heads, want_rr);
            PT_DELTA(moved_requests[KVT_DIR_HOST_TO_DEVICE], pr_sum);
#undef PT_DELTA
        }
    }

    /* Dirty ranges: every device entry that differs from the plan's lies in
     * the reported range; nothing changed = an empty range. */
    for (uint32_t i = 0; i < ns; i++)
        for (uint32_t l = 0; l < N_LAYERS; l++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                const uint32_t lh = l * N_KV_HEADS + h, np = pages_of(f->t[i].n + 1);
                uint32_t now[MAXPG], first = 7777, n = 7777;
                table(f, i, l, h, np, now, NULL);
                TU_OK(kvt_step_dirty_get(st, l, i, h, &first, &n));
                uint32_t changed = 0;
                for (uint32_t pg = 0; pg < np; pg++) {
                    const uint32_t was = pg < plan_np[i][lh] ? plan_blk[i][lh][pg] : 0;
                    if (now[pg] == was)
                        continue;
                    changed++;
                    if (pg < first || pg - first >= n)
                        fail_msg("layer %u seq %u head %u: entry %u changed (%u -> %u) outside "
                                 "the dirty range [%u, %u)", l, i, h, pg, was, now[pg], first,
                                 first + n);
                }
                if (changed) {
                    res->dirty_heads++;
                } else {
                    res->clean_heads++;
                    if (n != 0 && !a->faulty)
                        fail_msg("layer %u seq %u head %u: nothing changed, dirty range "
                                 "[%u, +%u)", l, i, h, first, n);
                }
            }
    if (a->before_finish)
        a->before_finish(f);
    TU_OK(kvt_step_finish(st));
    for (uint32_t i = 0; i < ns; i++)
        f->t[i].n++;
    TU_CHECK(f->p);
}

/* ---- placement at rest --------------------------------------------------- */

void check_device_count(const pfx *f)
{
    /* Distinct device blocks: a page forks share is one page. */
    kvt_stats s = pstats(f->p);
    uint8_t *seen = calloc(s.tier[KVT_TIER_DEVICE].blocks_total + 1, 1);
    uint64_t n = 0;
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t l = 0; l < N_LAYERS; l++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                uint8_t rs[MAXPG];
                uint32_t blk[MAXPG];
                const uint32_t np = pages_of(f->t[i].n);
                table(f, i, l, h, np, blk, rs);
                for (uint32_t pg = 0; pg < np; pg++) {
                    if (!(rs[pg] & KVT_RES_DEVICE))
                        continue;
                    assert_true(blk[pg] > 0 && blk[pg] <= s.tier[KVT_TIER_DEVICE].blocks_total);
                    n += !seen[blk[pg]];
                    seen[blk[pg]] = 1;
                }
            }
    free(seen);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].pages, n);
}

uint64_t check_offloaded(const pfx *f, uint8_t want, bool any)
{
    uint64_t full = 0;
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t l = 0; l < N_LAYERS; l++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                const uint32_t lh = l * N_KV_HEADS + h, T = f->t[i].n, np = pages_of(T);
                uint8_t rs[MAXPG];
                table(f, i, l, h, np, NULL, rs);
                for (uint32_t pg = 0; pg < np; pg++) {
                    if (!is_stable(f, lh)) {
                        if (rs[pg] != KVT_RES_DEVICE)
                            fail_msg("seq %u layer %u head %u (unstable) page %u: residency "
                                     "%#x", i, l, h, pg, rs[pg]);
                    } else if ((pg + 1) * PAGE_TOKENS <= T) {
                        full++;
                        if (any ? !(rs[pg] & want) : (rs[pg] & want) != want)
                            fail_msg("seq %u layer %u head %u page %u (full, stable): residency "
                                     "%#x, expected %#x in it", i, l, h, pg, rs[pg], want);
                    } else if (rs[pg] != KVT_RES_DEVICE) {
                        fail_msg("seq %u layer %u head %u page %u (partial): residency %#x", i,
                                 l, h, pg, rs[pg]);
                    }
                }
            }
    kvt_stats s = pstats(f->p);
    if (s.offloaded_pages - f->off_base != full)
        fail_msg("offloaded_pages %llu (%llu before of released sequences), but %llu full "
                 "pages of stable heads", (unsigned long long)s.offloaded_pages,
                 (unsigned long long)f->off_base, (unsigned long long)full);
    check_device_count(f);
    return full;
}

void verify_all(const pfx *f)
{
    for (uint32_t i = 0; i < f->ns; i++)
        tseq_verify(f->p, &f->t[i]);
}
