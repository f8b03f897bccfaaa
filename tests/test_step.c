/* The step plan's lifecycle: kvt_step_plan / kvt_step_append / kvt_step_attend /
 * kvt_step_finish over several steps and layers, checked against a second
 * pool filled with kvt_seq_append (byte-exact K/V and metadata) and against
 * a double-precision attention reference that includes the new token; the
 * rerank schedule; and bad input, after which the pool passes its checker
 * and holds exactly what it held before. */
#include "testutil.h"

static uint32_t pages_of(uint32_t t, uint32_t P)
{
    return (t + P - 1) / P;
}

static double elem_value(const void *buf, kvt_dtype dt, size_t i)
{
    if (dt == KVT_DTYPE_F32)
        return (double)((const float *)buf)[i];
    uint16_t h = ((const uint16_t *)buf)[i];
    return dt == KVT_DTYPE_F16 ? tu_f16_value(h) : tu_bf16_value(h);
}

/* A random finite value of dtype dt, magnitude up to about `scale`. */
static void rand_elem(void *buf, kvt_dtype dt, size_t i, tu_rng *r, double scale)
{
    if (dt == KVT_DTYPE_F32) {
        ((float *)buf)[i] = (float)(scale * tu_unit(r));
    } else if (dt == KVT_DTYPE_F16) {
        /* sign, exponent 2^-6 .. 2^1, random mantissa */
        uint16_t e = (uint16_t)(9 + tu_below(r, 8)), m = (uint16_t)tu_below(r, 1024);
        ((uint16_t *)buf)[i] = (uint16_t)((tu_below(r, 2) << 15) | (e << 10) | m);
    } else {
        uint16_t e = (uint16_t)(121 + tu_below(r, 8)), m = (uint16_t)tu_below(r, 128);
        ((uint16_t *)buf)[i] = (uint16_t)((tu_below(r, 2) << 15) | (e << 7) | m);
    }
}

typedef struct {
    uint32_t L, H, G, D, P;
    kvt_dtype dt;
} shape;

/* Double-precision attention of q[G][D] over the tokens of `pages` of
 * (seq, layer, kvh), from the stored K/V; writes out[G][D], lse[G] and the
 * score magnitude kappa[G] (scale * max_t sum_d |q_d k_td|) and max |v|. */
static void ref_attn(const kvt_pool *p, kvt_seq_id seq, uint32_t layer, uint32_t kvh,
                     const shape *s, uint32_t T, const uint32_t *pages, uint32_t np,
                     const float *q, double scale, double *out, double *lse, double *kappa,
                     double *vmax)
{
    const uint32_t D = s->D, P = s->P, G = s->G;
    const size_t es = kvt_dtype_size(s->dt);
    uint8_t *kb = malloc((size_t)P * D * es), *vb = malloc((size_t)P * D * es);
    double *kd = malloc(((size_t)np * P * D + 1) * sizeof *kd);
    double *vd = malloc(((size_t)np * P * D + 1) * sizeof *vd);
    uint32_t n = 0;
    for (uint32_t j = 0; j < np; j++) {
        assert_true(pages[j] * P < T);
        const uint32_t t0 = pages[j] * P, cnt = T - t0 < P ? T - t0 : P;
        TU_OK(kvt_seq_read_kv(p, seq, layer, kvh, t0, cnt, kb, vb));
        for (size_t e = 0; e < (size_t)cnt * D; e++) {
            kd[(size_t)n * D + e] = elem_value(kb, s->dt, e);
            vd[(size_t)n * D + e] = elem_value(vb, s->dt, e);
        }
        n += cnt;
    }
    tu_ref_attention(q, G, D, kd, vd, n, scale, out, lse, kappa, vmax);
    free(kb);
    free(vb);
    free(kd);
    free(vd);
}

/* The library's out[G][D] / lse[G] against the reference (see
 * test_decode.c for the tolerance's reasoning). */
static void check_rows(const float *out, const float *lse, const double *ref,
                       const double *ref_lse, const double *kappa, double vmax, uint32_t G,
                       uint32_t D, const char *what)
{
    for (uint32_t g = 0; g < G; g++) {
        const float *o = out + (size_t)g * D;
        const double *rf = ref + (size_t)g * D;
        if (isinf(ref_lse[g])) {
            for (uint32_t d = 0; d < D; d++)
                if (o[d] != 0.0f)
                    fail_msg("%s head %u: empty layer, out[%u] = %g", what, g, d, (double)o[d]);
            if (!(isinf(lse[g]) && lse[g] < 0))
                fail_msg("%s head %u: empty layer, lse %g", what, g, (double)lse[g]);
            continue;
        }
        double err = 0, norm = 0;
        for (uint32_t d = 0; d < D; d++) {
            double e = fabs((double)o[d] - rf[d]);
            if (!(e <= err))
                err = e;
            norm = fabs(rf[d]) > norm ? fabs(rf[d]) : norm;
        }
        const double serr = 8.0 * 0x1p-24 * sqrt((double)D) * kappa[g];
        const double tol = 1e-4 * (norm > 1e-2 ? norm : 1e-2) + serr * vmax;
        if (!(err <= tol))
            fail_msg("%s head %u: max |out - ref| %.3g, max |ref| %.3g, tolerance %.3g", what,
                     g, err, norm, tol);
        if (!(fabs((double)lse[g] - ref_lse[g]) <= 1e-5 * (1 + fabs(ref_lse[g])) + serr))
            fail_msg("%s head %u: lse %.9g, reference %.9g", what, g, (double)lse[g],
                     ref_lse[g]);
    }
}

/* Reference MINMAX/SUM scores (double) and per-page rounding allowances. */
static void ref_minmax_sum(const kvt_pool *p, kvt_seq_id seq, uint32_t layer, uint32_t kvh,
                           const shape *s, uint32_t np, const float *q, double *ref, double *tol)
{
    float *mn = malloc(s->D * sizeof *mn), *mx = malloc(s->D * sizeof *mx);
    for (uint32_t pg = 0; pg < np; pg++) {
        TU_OK(kvt_seq_page_meta_get(p, seq, layer, kvh, pg, mn, mx, NULL));
        double sum = 0, mag = 0;
        for (uint32_t g = 0; g < s->G; g++)
            for (uint32_t d = 0; d < s->D; d++) {
                double qd = q[(size_t)g * s->D + d];
                double t = qd * mn[d] > qd * mx[d] ? qd * mn[d] : qd * mx[d];
                sum += t;
                mag += fabs(t);
            }
        ref[pg] = sum;
        tol[pg] = 1e-4 * fabs(sum) + 1e-5 * mag;
    }
    free(mn);
    free(mx);
}



/* ---- the step loop vs kvt_seq_append ----------------------------------------- */

enum { NS = 3 };

static void compare_pools(const kvt_pool *a, const kvt_pool *b, const kvt_seq_id *ia,
                          const kvt_seq_id *ib, uint32_t n, const shape *s)
{
    const size_t es = kvt_dtype_size(s->dt);
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t l = 0; l < s->L; l++) {
            uint32_t ta, tb;
            TU_OK(kvt_seq_length_get(a, ia[i], l, &ta));
            TU_OK(kvt_seq_length_get(b, ib[i], l, &tb));
            assert_int_equal(ta, tb);
            if (!ta)
                continue;
            uint8_t *ka = malloc((size_t)ta * s->D * es), *va = malloc((size_t)ta * s->D * es);
            uint8_t *kb = malloc((size_t)ta * s->D * es), *vb = malloc((size_t)ta * s->D * es);
            float m1[3][256], m2[3][256];
            for (uint32_t h = 0; h < s->H; h++) {
                TU_OK(kvt_seq_read_kv(a, ia[i], l, h, 0, ta, ka, va));
                TU_OK(kvt_seq_read_kv(b, ib[i], l, h, 0, ta, kb, vb));
                if (memcmp(ka, kb, (size_t)ta * s->D * es) || memcmp(va, vb, (size_t)ta * s->D * es))
                    fail_msg("seq %u layer %u head %u: K/V differ from kvt_seq_append's", i, l,
                             h);
                for (uint32_t pg = 0; pg < pages_of(ta, s->P); pg++) {
                    TU_OK(kvt_seq_page_meta_get(a, ia[i], l, h, pg, m1[0], m1[1], m1[2]));
                    TU_OK(kvt_seq_page_meta_get(b, ib[i], l, h, pg, m2[0], m2[1], m2[2]));
                    for (int w = 0; w < 3; w++)
                        if (memcmp(m1[w], m2[w], s->D * sizeof(float)))
                            fail_msg("seq %u layer %u head %u page %u: metadata %d differs", i,
                                     l, h, pg, w);
                }
            }
            free(ka);
            free(va);
            free(kb);
            free(vb);
        }
}

static void step_loop(kvt_dtype pdt, int sparse)
{
    const shape s = {3, 2, 2, 64, 8, pdt};
    const uint32_t Hq = s.H * s.G, row = (Hq + 2 * s.H) * s.D; /* fused QKV row */
    const uint32_t prefill[NS] = {13, 0, 40};
    uint64_t blocks = 8;
    const uint32_t steps = 12;
    for (uint32_t i = 0; i < NS; i++)
        blocks += (uint64_t)pages_of(prefill[i] + steps, s.P) * s.L * s.H;
    kvt_pool_opts o = tu_opts(s.L, s.H, Hq, s.D, s.P, pdt, blocks, 0);
    o.n_threads = 2;
    kvt_pool *A, *B;
    TU_OK(kvt_pool_create(&o, &A));
    o.n_threads = 1;
    TU_OK(kvt_pool_create(&o, &B));
    kvt_seq_id ia[NS], ib[NS];
    tu_rng r = {0x57e9ull + pdt * 10 + (uint64_t)sparse};
    for (uint32_t i = 0; i < NS; i++) {
        TU_OK(kvt_seq_create(A, NULL, &ia[i]));
        TU_OK(kvt_seq_create(B, NULL, &ib[i]));
        for (uint32_t l = 0; l < s.L && prefill[i]; l++) {
            size_t n = (size_t)prefill[i] * s.H * s.D;
            float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
            for (size_t e = 0; e < n; e++) {
                k[e] = 2.0f * tu_unit(&r);
                v[e] = tu_unit(&r);
            }
            TU_OK(kvt_seq_append(A, ia[i], l, k, v, prefill[i], KVT_DTYPE_F32, 0));
            TU_OK(kvt_seq_append(B, ib[i], l, k, v, prefill[i], KVT_DTYPE_F32, 0));
            free(k);
            free(v);
        }
    }
    kvt_selector *sel = NULL;
    const uint32_t K = 2, SINK = 1, LOCAL = 1;
    if (sparse) {
        kvt_geometry g = {s.L, s.H, Hq, s.D, s.P, pdt, {0, 0}};
        kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
        so.top_k_pages = K;
        so.sink_pages = SINK;
        so.local_pages = LOCAL;
        TU_OK(kvt_selector_create(&g, &so, &sel));
    }
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = sparse ? 0 : KVT_STEP_DENSE;
    so.selector = sel;
    const double scale = 1.0 / sqrt((double)s.D);
    const size_t es_max = 4;
    uint8_t *qkv = malloc((size_t)NS * row * es_max);
    float *q = malloc((size_t)NS * Hq * s.D * sizeof *q), *out = malloc((size_t)NS * Hq * s.D * 4);
    float lse[NS * 4];
    uint32_t pages[64];
    double ref[2 * 64], rl[2], kap[2], vmax, sc[64], tl[64];
    for (uint32_t step = 0; step < steps; step++) {
        /* The plan's order rotates, so the layouts follow it. */
        kvt_seq_id order_a[NS], order_b[NS];
        for (uint32_t i = 0; i < NS; i++) {
            order_a[i] = ia[(i + step) % NS];
            order_b[i] = ib[(i + step) % NS];
        }
        kvt_step *st;
        TU_OK(kvt_step_plan(A, order_a, NS, &so, &st));
        for (uint32_t l = 0; l < s.L; l++) {
            const kvt_dtype sdt = 1 + (step + l) % 3;
            const size_t es = kvt_dtype_size(sdt);
            for (size_t e = 0; e < (size_t)NS * row; e++)
                rand_elem(qkv, sdt, e, &r, e % row < (size_t)(Hq + s.H) * s.D ? 2.0 : 1.0);
            const uint8_t *kp = qkv + (size_t)Hq * s.D * es, *vp = kp + (size_t)s.H * s.D * es;
            uint32_t before[NS];
            for (uint32_t i = 0; i < NS; i++)
                TU_OK(kvt_seq_length_get(A, order_a[i], l, &before[i]));
            TU_OK(kvt_step_append(st, l, kp, vp, sdt, row));
            for (uint32_t i = 0; i < NS; i++)
                TU_OK(kvt_seq_append(B, order_b[i], l, kp + (size_t)i * row * es,
                                     vp + (size_t)i * row * es, 1, sdt, 0));
            for (size_t e = 0; e < (size_t)NS * Hq * s.D; e++)
                q[e] = 2.0f * tu_unit(&r);
            TU_OK(kvt_step_attend(st, l, q, out, lse));
            for (uint32_t i = 0; i < NS; i++) {
                uint32_t T;
                TU_OK(kvt_seq_length_get(A, order_a[i], l, &T));
                assert_int_equal(T, before[i] + 1);
                for (uint32_t h = 0; h < s.H; h++) {
                    uint32_t n, rr;
                    TU_OK(kvt_step_selection_get(st, l, i, h, pages, 64, &n, &rr));
                    const float *qg = q + ((size_t)i * Hq + (size_t)h * s.G) * s.D;
                    char what[128];
                    snprintf(what, sizeof what, "dtype %u %s step %u layer %u seq %u head %u",
                             pdt, sparse ? "sparse" : "dense", step, l, i, h);
                    if (sparse) {
                        assert_int_equal(rr, 1);
                        ref_minmax_sum(A, order_a[i], l, h, &s, pages_of(T, s.P), qg, sc, tl);
                        tu_check_selection(pages, n, T, s.P, K, SINK, LOCAL, sc, tl, what);
                    } else {
                        assert_int_equal(n, pages_of(T, s.P));
                        for (uint32_t j = 0; j < n; j++)
                            assert_int_equal(pages[j], j);
                    }
                    /* The new token (last of the layer) is always attended. */
                    assert_int_equal(pages[n - 1], pages_of(T, s.P) - 1);
                    ref_attn(A, order_a[i], l, h, &s, T, pages, n, qg, scale, ref, rl, kap,
                             &vmax);
                    const size_t ob = (size_t)i * Hq + (size_t)h * s.G;
                    check_rows(out + ob * s.D, lse + ob, ref, rl, kap, vmax, s.G, s.D, what);
                }
            }
        }
        TU_OK(kvt_step_finish(st));
        TU_CHECK(A);
        if (step % 4 == 3 || step == steps - 1)
            compare_pools(A, B, ia, ib, NS, &s);
    }
    kvt_stats sa = {.struct_size = sizeof sa}, sb = {.struct_size = sizeof sb};
    TU_OK(kvt_pool_stats_get(A, &sa));
    TU_OK(kvt_pool_stats_get(B, &sb));
    assert_int_equal(sa.n_tokens, sb.n_tokens);
    assert_int_equal(sa.tier[KVT_TIER_DEVICE].blocks_used, sb.tier[KVT_TIER_DEVICE].blocks_used);
    free(qkv);
    free(q);
    free(out);
    kvt_selector_destroy(sel);
    kvt_pool_destroy(A);
    kvt_pool_destroy(B);
}

static void test_step_loop_dense(void **state)
{
    (void)state;
    for (kvt_dtype dt = 1; dt <= 3; dt++)
        step_loop(dt, 0);
}

static void test_step_loop_sparse(void **state)
{
    (void)state;
    for (kvt_dtype dt = 1; dt <= 3; dt++)
        step_loop(dt, 1);
}

/* ---- the rerank schedule ------------------------------------------------------- */

enum { RS = 3, RL = 2, RH = 2, RSTEPS = 14 };

static void test_rerank(void **state)
{
    (void)state;
    const shape s = {RL, RH, 2, 32, 8, KVT_DTYPE_F16};
    const uint32_t Hq = s.H * s.G, K = 3, SINK = 1, LOCAL = 1, IV = 4;
    const uint32_t prefill[RS] = {100, 57, 200};
    kvt_pool_opts o = tu_opts(s.L, s.H, Hq, s.D, s.P, s.dt, 400, 0);
    o.n_threads = 3;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_id ids[RS];
    tu_rng r = {0x7e7a4ull};
    for (uint32_t i = 0; i < RS; i++) {
        TU_OK(kvt_seq_create(p, NULL, &ids[i]));
        for (uint32_t l = 0; l < s.L; l++) {
            size_t n = (size_t)prefill[i] * s.H * s.D;
            float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
            for (size_t e = 0; e < n; e++) {
                k[e] = 2.0f * tu_unit(&r);
                v[e] = tu_unit(&r);
            }
            TU_OK(kvt_seq_append(p, ids[i], l, k, v, prefill[i], KVT_DTYPE_F32, 0));
            free(k);
            free(v);
        }
    }
    kvt_geometry g = {s.L, s.H, Hq, s.D, s.P, s.dt, {0, 0}};
    kvt_selector_opts sopt = KVT_SELECTOR_OPTS_INIT;
    sopt.top_k_pages = K;
    sopt.sink_pages = SINK;
    sopt.local_pages = LOCAL;
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, &sopt, &sel));
    TU_OK(kvt_selector_rerank_interval_set(sel, KVT_ALL, KVT_ALL, IV));
    /* The interval alone (the selection cache: test_select_cache). */
    TU_OK(kvt_selector_rerank_similarity_set(sel, KVT_ALL, KVT_ALL, -1.0f));
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.selector = sel;
    static uint8_t rr_hist[RSTEPS][RS][RL][RH];
    static uint32_t topk[RS][RL][RH][16], n_topk[RS][RL][RH];
    float q[RS * 4 * 32], out[RS * 4 * 32], lse[RS * 4], kv[RS * 2 * 32 * 2];
    uint32_t pages[64];
    double sc[64], tl[64], ref[2 * 32], rl[2], kap[2], vmax;
    uint8_t forced[64];
    for (uint32_t step = 0; step < RSTEPS; step++) {
        kvt_step *st;
        TU_OK(kvt_step_plan(p, ids, RS, &so, &st));
        for (uint32_t l = 0; l < s.L; l++) {
            for (size_t e = 0; e < sizeof kv / sizeof kv[0]; e++)
                kv[e] = 2.0f * tu_unit(&r);
            TU_OK(kvt_step_append(st, l, kv, kv + RS * s.H * s.D, KVT_DTYPE_F32, 0));
            for (size_t e = 0; e < (size_t)RS * Hq * s.D; e++)
                q[e] = 2.0f * tu_unit(&r);
            TU_OK(kvt_step_select(st, l, q));
            TU_OK(kvt_step_decode(st, l, q, out, lse));
            for (uint32_t i = 0; i < RS; i++)
                for (uint32_t h = 0; h < s.H; h++) {
                    uint32_t T, n, rr = 9;
                    TU_OK(kvt_seq_length_get(p, ids[i], l, &T));
                    TU_OK(kvt_step_selection_get(st, l, i, h, pages, 64, &n, &rr));
                    assert_true(rr == 0 || rr == 1);
                    rr_hist[step][i][l][h] = (uint8_t)rr;
                    const uint32_t np = pages_of(T, s.P);
                    tu_forced_pages(forced, T, s.P, SINK, LOCAL);
                    const float *qg = q + ((size_t)i * Hq + (size_t)h * s.G) * s.D;
                    char what[96];
                    snprintf(what, sizeof what, "step %u seq %u layer %u head %u (%s)", step, i,
                             l, h, rr ? "reranked" : "reused");
                    if (rr) {
                        ref_minmax_sum(p, ids[i], l, h, &s, np, qg, sc, tl);
                        tu_check_selection(pages, n, T, s.P, K, SINK, LOCAL, sc, tl, what);
                        n_topk[i][l][h] = 0;
                        for (uint32_t j = 0; j < n; j++)
                            if (!forced[pages[j]])
                                topk[i][l][h][n_topk[i][l][h]++] = pages[j];
                    } else {
                        /* The last rerank's top-K pages plus today's forced pages. */
                        uint8_t want[64] = {0};
                        for (uint32_t j = 0; j < np; j++)
                            want[j] = forced[j];
                        for (uint32_t j = 0; j < n_topk[i][l][h]; j++)
                            want[topk[i][l][h][j]] = 1;
                        uint32_t nw = 0;
                        for (uint32_t j = 0; j < np; j++)
                            if (want[j]) {
                                if (nw >= n || pages[nw] != j)
                                    fail_msg("%s: page %u expected at entry %u", what, j, nw);
                                nw++;
                            }
                        assert_int_equal(n, nw);
                    }
                    ref_attn(p, ids[i], l, h, &s, T, pages, n, qg, 1.0 / sqrt((double)s.D), ref,
                             rl, kap, &vmax);
                    const size_t ob = (size_t)i * Hq + (size_t)h * s.G;
                    check_rows(out + ob * s.D, lse + ob, ref, rl, kap, vmax, s.G, s.D, what);
                }
        }
        TU_OK(kvt_step_finish(st));
    }
    /* The first step reranks every head (nothing to reuse); after it, a head
     * reranks once in every IV consecutive steps (IV steps apart). */
    for (uint32_t i = 0; i < RS; i++)
        for (uint32_t l = 0; l < s.L; l++)
            for (uint32_t h = 0; h < s.H; h++) {
                if (!rr_hist[0][i][l][h])
                    fail_msg("seq %u layer %u head %u: first step did not rerank", i, l, h);
                for (uint32_t s0 = 1; s0 + IV <= RSTEPS; s0++) {
                    uint32_t cnt = 0;
                    for (uint32_t t = s0; t < s0 + IV; t++)
                        cnt += rr_hist[t][i][l][h];
                    if (cnt != 1)
                        fail_msg("seq %u layer %u head %u: %u reranks in steps %u..%u "
                                 "(interval %u)", i, l, h, cnt, s0, s0 + IV - 1, IV);
                }
            }
    /* Interval 1 again: every head reranks at every step. */
    TU_OK(kvt_selector_rerank_interval_set(sel, KVT_ALL, KVT_ALL, 1));
    for (uint32_t step = 0; step < 3; step++) {
        kvt_step *st;
        TU_OK(kvt_step_plan(p, ids, RS, &so, &st));
        for (uint32_t l = 0; l < s.L; l++) {
            for (size_t e = 0; e < (size_t)RS * Hq * s.D; e++)
                q[e] = tu_unit(&r);
            TU_OK(kvt_step_select(st, l, q));
            for (uint32_t i = 0; i < RS; i++)
                for (uint32_t h = 0; h < s.H; h++) {
                    uint32_t n, rr = 9;
                    TU_OK(kvt_step_selection_get(st, l, i, h, pages, 64, &n, &rr));
                    assert_int_equal(rr, 1);
                }
        }
        TU_OK(kvt_step_finish(st));
    }
    TU_CHECK(p);
    kvt_selector_destroy(sel);
    kvt_pool_destroy(p);
}

/* kvt_selector_rerank_interval_set(3): reranks are decided from the step
 * counter, IV steps apart, and "a head that has no earlier selection to
 * reuse is always reranked". Two corners: a budget larger than the block
 * table's capacity while the sequence grows past it, and a head with
 * top_k_pages 0. Mismatches are collected and reported together. */
static void test_rerank_corners(void **state)
{
    (void)state;
    const uint32_t IV = 4, STEPS = 16, NSQ = 3;
    kvt_pool_opts o = tu_opts(1, 2, 2, 16, 8, KVT_DTYPE_F16, 256, 0);
    o.n_threads = 1;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_id ids[3];
    static float kv[200 * 2 * 16];
    tu_rng r = {0xc0c0ull};
    for (size_t e = 0; e < sizeof kv / sizeof kv[0]; e++)
        kv[e] = tu_unit(&r);
    /* 119..121 tokens: the block tables (16 pages at first) grow during the
     * run; head 0 has K 20 (more than 16 pages), head 1 has K 0. */
    for (uint32_t i = 0; i < NSQ; i++) {
        TU_OK(kvt_seq_create(p, NULL, &ids[i]));
        TU_OK(kvt_seq_append(p, ids[i], 0, kv, kv, 119 + i, KVT_DTYPE_F32, 0));
    }
    kvt_geometry g = {1, 2, 2, 16, 8, KVT_DTYPE_F16, {0, 0}};
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, NULL, &sel));
    TU_OK(kvt_selector_budget_set(sel, 0, 0, 20, 1, 1));
    TU_OK(kvt_selector_budget_set(sel, 0, 1, 0, 1, 1));
    TU_OK(kvt_selector_rerank_interval_set(sel, KVT_ALL, KVT_ALL, IV));
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.selector = sel;
    uint8_t rr_hist[16][3][2];
    float q[3 * 2 * 16], out[3 * 2 * 16];
    for (size_t e = 0; e < sizeof q / sizeof q[0]; e++)
        q[e] = tu_unit(&r);
    for (uint32_t step = 0; step < STEPS; step++) {
        kvt_step *st;
        TU_OK(kvt_step_plan(p, ids, NSQ, &so, &st));
        TU_OK(kvt_step_append(st, 0, kv + step * 2 * 16 * NSQ, kv + step * 2 * 16 * NSQ,
                              KVT_DTYPE_F32, 0));
        TU_OK(kvt_step_attend(st, 0, q, out, NULL));
        for (uint32_t i = 0; i < NSQ; i++)
            for (uint32_t h = 0; h < 2; h++) {
                uint32_t pages[64], n, rr;
                TU_OK(kvt_step_selection_get(st, 0, i, h, pages, 64, &n, &rr));
                rr_hist[step][i][h] = (uint8_t)rr;
            }
        TU_OK(kvt_step_finish(st));
    }
    char report[2048] = "";
    size_t used = 0;
    for (uint32_t i = 0; i < NSQ; i++)
        for (uint32_t h = 0; h < 2; h++) {
            if (!rr_hist[0][i][h] && used < sizeof report)
                used += (size_t)snprintf(report + used, sizeof report - used,
                                         "\n  seq %u head %u (K %u): not reranked at its first "
                                         "step", i, h, h ? 0 : 20);
            for (uint32_t s0 = 1; s0 + IV <= STEPS; s0++) {
                uint32_t cnt = 0;
                for (uint32_t t = s0; t < s0 + IV; t++)
                    cnt += rr_hist[t][i][h];
                if (cnt != 1 && used < sizeof report) {
                    used += (size_t)snprintf(report + used, sizeof report - used,
                                             "\n  seq %u head %u (K %u): %u reranks in steps "
                                             "%u..%u", i, h, h ? 0 : 20, cnt, s0, s0 + IV - 1);
                    break;
                }
            }
        }
    TU_CHECK(p);
    kvt_selector_destroy(sel);
    kvt_pool_destroy(p);
    if (used)
        fail_msg("rerank schedule (interval %u) differs from kvt_selector_rerank_interval_set(3):%s",
                 IV, report);
}

/* A sequence's rerank state must follow a change of selector or budget:
 * steps with a small K and interval > 1, then steps with a larger K (another
 * selector of the same geometry, or the same one re-budgeted with interval
 * 1). Every rescored selection must be the top-K of the current scores, and
 * the pool must stay intact. (Run under ASan or valgrind: the library once
 * kept the top-K pages of the larger K in storage sized for the smaller.) */
static void test_selector_change_between_steps(void **state)
{
    (void)state;
    const shape s = {1, 1, 1, 16, 8, KVT_DTYPE_F16};
    kvt_pool_opts o = tu_opts(1, 1, 1, 16, 8, KVT_DTYPE_F16, 128, 0);
    o.n_threads = 1;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_id a;
    TU_OK(kvt_seq_create(p, NULL, &a));
    static float kv[420 * 16];
    tu_rng r = {0x0f1ull};
    for (size_t e = 0; e < sizeof kv / sizeof kv[0]; e++)
        kv[e] = tu_unit(&r);
    TU_OK(kvt_seq_append(p, a, 0, kv, kv, 400, KVT_DTYPE_F32, 0)); /* 50 pages */
    kvt_geometry g = {1, 1, 1, 16, 8, KVT_DTYPE_F16, {0, 0}};
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.top_k_pages = 2;
    so.rerank_interval = 4;
    kvt_selector *small, *big;
    TU_OK(kvt_selector_create(&g, &so, &small));
    so.top_k_pages = 40;
    so.rerank_interval = 1;
    TU_OK(kvt_selector_create(&g, &so, &big));
    const kvt_selector *order[6] = {small, big, big, small, small, big};
    float q[16], out[16], lse[1];
    uint32_t pages[64], n, rr;
    double sc[64], tl[64], ref[16], rl[1], kap[1], vmax;
    for (int round = 0; round < 2; round++) {
        for (int step = 0; step < 6; step++) {
            const kvt_selector *sel = round == 0 ? order[step] : small;
            uint32_t K = round == 0 ? (sel == big ? 40 : 2) : (step < 2 ? 2 : 40);
            if (round == 1 && step == 2) { /* the same selector, re-budgeted */
                TU_OK(kvt_selector_rerank_interval_set(small, KVT_ALL, KVT_ALL, 1));
                TU_OK(kvt_selector_budget_set(small, KVT_ALL, KVT_ALL, 40, 1, 1));
            }
            kvt_step_opts sto = KVT_STEP_OPTS_INIT;
            sto.selector = sel;
            kvt_step *st;
            TU_OK(kvt_step_plan(p, &a, 1, &sto, &st));
            for (int d = 0; d < 16; d++)
                q[d] = tu_unit(&r);
            TU_OK(kvt_step_append(st, 0, kv + (size_t)(400 + 10 * round + step) * 16,
                                  kv + (size_t)(400 + 10 * round + step) * 16, KVT_DTYPE_F32, 0));
            TU_OK(kvt_step_attend(st, 0, q, out, lse));
            TU_OK(kvt_step_selection_get(st, 0, 0, 0, pages, 64, &n, &rr));
            uint32_t T;
            TU_OK(kvt_seq_length_get(p, a, 0, &T));
            char what[80];
            snprintf(what, sizeof what, "round %d step %d (K %u)", round, step, K);
            if (rr) {
                ref_minmax_sum(p, a, 0, 0, &s, pages_of(T, 8), q, sc, tl);
                tu_check_selection(pages, n, T, 8, K, 1, 1, sc, tl, what);
            }
            ref_attn(p, a, 0, 0, &s, T, pages, n, q, 0.25, ref, rl, kap, &vmax);
            check_rows(out, lse, ref, rl, kap, vmax, 1, 16, what);
            TU_OK(kvt_step_finish(st));
            TU_CHECK(p);
        }
    }
    kvt_selector_destroy(small);
    kvt_selector_destroy(big);
    kvt_pool_destroy(p);
}

/* ---- bad input ------------------------------------------------------------------- */

/* Everything a caller can observe of the pool's sequences. */
typedef struct {
    size_t n;
    uint8_t *bytes;
} snap;

static void snap_take(snap *sn, const kvt_pool *p, const kvt_seq_id *ids, uint32_t n_ids,
                      const shape *s)
{
    const size_t es = kvt_dtype_size(s->dt);
    size_t cap = 1 << 16, n = 0;
    uint8_t *b = malloc(cap);
#define PUT(ptr, len)                                                                    \
    do {                                                                                 \
        while (n + (len) > cap)                                                          \
            b = realloc(b, cap *= 2);                                                    \
        memcpy(b + n, (ptr), (len));                                                     \
        n += (len);                                                                      \
    } while (0)
    kvt_stats st = {.struct_size = sizeof st};
    TU_OK(kvt_pool_stats_get(p, &st));
    PUT(&st, sizeof st);
    for (uint32_t i = 0; i < n_ids; i++)
        for (uint32_t l = 0; l < s->L; l++) {
            uint32_t T;
            TU_OK(kvt_seq_length_get(p, ids[i], l, &T));
            PUT(&T, sizeof T);
            for (uint32_t h = 0; h < s->H && T; h++) {
                uint8_t *k = malloc((size_t)T * s->D * es), *v = malloc((size_t)T * s->D * es);
                TU_OK(kvt_seq_read_kv(p, ids[i], l, h, 0, T, k, v));
                PUT(k, (size_t)T * s->D * es);
                PUT(v, (size_t)T * s->D * es);
                free(k);
                free(v);
                float m[3 * 64];
                for (uint32_t pg = 0; pg < pages_of(T, s->P); pg++) {
                    TU_OK(kvt_seq_page_meta_get(p, ids[i], l, h, pg, m, m + s->D, m + 2 * s->D));
                    PUT(m, 3 * s->D * sizeof(float));
                }
            }
        }
#undef PUT
    sn->n = n;
    sn->bytes = b;
}

static void snap_same(const snap *a, const kvt_pool *p, const kvt_seq_id *ids, uint32_t n_ids,
                      const shape *s, const char *after)
{
    snap b;
    snap_take(&b, p, ids, n_ids, s);
    if (a->n != b.n || memcmp(a->bytes, b.bytes, a->n) != 0)
        fail_msg("the pool changed after %s", after);
    free(b.bytes);
    TU_CHECK(p);
}

static void test_plan_bad(void **state)
{
    (void)state;
    const shape s = {2, 2, 2, 32, 8, KVT_DTYPE_F16};
    const uint32_t Hq = 4;
    kvt_pool_opts o = tu_opts(s.L, s.H, Hq, s.D, s.P, s.dt, 64, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_id a, b, gone;
    TU_OK(kvt_seq_create(p, NULL, &a));
    TU_OK(kvt_seq_create(p, NULL, &b));
    TU_OK(kvt_seq_create(p, NULL, &gone));
    tu_rng r = {0xbadull};
    float kv[20 * 2 * 32];
    for (size_t e = 0; e < sizeof kv / sizeof kv[0]; e++)
        kv[e] = tu_unit(&r);
    for (uint32_t l = 0; l < s.L; l++) {
        TU_OK(kvt_seq_append(p, a, l, kv, kv, 20, KVT_DTYPE_F32, 0));
        TU_OK(kvt_seq_append(p, b, l, kv, kv, 8, KVT_DTYPE_F32, 0));
    }
    TU_OK(kvt_seq_release(p, gone));
    kvt_seq_id ids[2] = {a, b};
    snap s0;
    snap_take(&s0, p, ids, 2, &s);
    kvt_geometry g = {s.L, s.H, Hq, s.D, s.P, s.dt, {0, 0}};
    kvt_selector *sel, *other;
    TU_OK(kvt_selector_create(&g, NULL, &sel));
    kvt_geometry g2 = g;
    g2.head_dim = 64;
    TU_OK(kvt_selector_create(&g2, NULL, &other));
    kvt_step *st = (kvt_step *)&r;
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.selector = sel;

    /* kvt_step_opts_init writes the same defaults as the macro. */
    kvt_step_opts oi, om = KVT_STEP_OPTS_INIT;
    memset(&oi, 0xff, sizeof oi);
    TU_OK(kvt_step_opts_init(&oi));
    assert_int_equal(oi.struct_size, sizeof oi);
    assert_int_equal(oi.flags, 0);
    assert_null(oi.selector);
    assert_true(oi.scale == 0.0f);
    assert_int_equal(oi.reserved, 0);
    assert_null(oi.stream);
    assert_memory_equal(&oi, &om, sizeof oi);
    TU_EXPECT_ERR(kvt_step_opts_init(NULL), KVT_EINVAL, "opts");

    st = (kvt_step *)&oi;
    TU_EXPECT_ERR(kvt_step_plan(NULL, ids, 2, &so, &st), KVT_EINVAL, "pool");
    assert_ptr_equal(st, (kvt_step *)&oi); /* documented: *out untouched on failure */
    st = NULL;
    TU_EXPECT_ERR(kvt_step_plan(p, NULL, 2, &so, &st), KVT_EINVAL, "seqs");
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &so, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 0, &so, &st), KVT_EINVAL, "n_seqs");
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, NULL, &st), KVT_EINVAL, "opts");
    kvt_seq_id dup[3] = {a, b, a};
    TU_EXPECT_ERR(kvt_step_plan(p, dup, 3, &so, &st), KVT_EINVAL, "seqs");
    kvt_seq_id withgone[2] = {a, gone};
    TU_EXPECT_ERR(kvt_step_plan(p, withgone, 2, &so, &st), KVT_ENOENT, "seqs[1]");
    kvt_seq_id none[1] = {KVT_SEQ_NONE};
    TU_EXPECT_ERR(kvt_step_plan(p, none, 1, &so, &st), KVT_ENOENT, "seqs[0]");
    kvt_step_opts bad = so;
    bad.selector = NULL;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &bad, &st), KVT_EINVAL, "selector");
    bad.selector = other;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &bad, &st), KVT_EINVAL, "head_dim");
    bad.flags = KVT_STEP_DENSE; /* a mismatching selector is refused even when dense */
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &bad, &st), KVT_EINVAL, "head_dim");
    bad = so;
    bad.flags = 1u << 7;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &bad, &st), KVT_EINVAL, "flags");
    bad = so;
    bad.reserved = 1;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &bad, &st), KVT_EINVAL, "reserved");
    bad = so;
    bad.struct_size = 8;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &bad, &st), KVT_EINVAL, "struct_size");
    bad = so;
    bad.scale = -1.0f;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &bad, &st), KVT_EINVAL, "scale");
    bad.scale = NAN;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &bad, &st), KVT_EINVAL, "scale");
    bad.scale = INFINITY;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &bad, &st), KVT_EINVAL, "scale");
    snap_same(&s0, p, ids, 2, &s, "failed plans");

    /* No step was left open by the failures: a plan works now. A dense step
     * needs no selector. */
    kvt_step_opts dense = KVT_STEP_OPTS_INIT;
    dense.flags = KVT_STEP_DENSE;
    TU_OK(kvt_step_plan(p, ids, 2, &dense, &st));
    kvt_step *st2 = (kvt_step *)&r;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &so, &st2), KVT_ESTATE, "open");
    /* The failed plan leaves the engine's handle alone: the open step is
     * still reachable through it. */
    assert_ptr_equal(st2, (kvt_step *)&r);
    st2 = st;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &so, &st2), KVT_ESTATE, "open");
    assert_ptr_equal(st2, st);
    TU_OK(kvt_step_finish(st2));
    TU_OK(kvt_step_plan(p, ids, 2, &dense, &st));
    /* Only a subset of the sequences, and a finish with nothing run. */
    TU_OK(kvt_step_finish(st));
    TU_OK(kvt_step_plan(p, ids + 1, 1, &so, &st));
    TU_OK(kvt_step_finish(st));
    assert_int_equal(kvt_step_finish(NULL), 0);
    snap_same(&s0, p, ids, 2, &s, "empty steps");
    /* One layout: a struct_size short of it (the stream field) is refused,
     * a longer one with zeros past it accepted, one with a non-zero byte
     * past it refused; the CPU backend takes any stream and ignores it. */
    struct {
        kvt_step_opts o;
        uint64_t tail;
    } v2 = {so, 0};
    v2.o.struct_size = (uint32_t)offsetof(kvt_step_opts, stream);
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &v2.o, &st), KVT_EINVAL, "struct_size");
    v2.o.struct_size = (uint32_t)sizeof v2;
    TU_OK(kvt_step_plan(p, ids, 2, &v2.o, &st));
    TU_OK(kvt_step_finish(st));
    v2.tail = 1;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &v2.o, &st), KVT_EINVAL, "struct_size");
    kvt_step_opts withstream = so;
    withstream.stream = &r;
    TU_OK(kvt_step_plan(p, ids, 2, &withstream, &st));
    TU_OK(kvt_step_finish(st));
    kvt_selector_destroy(sel);
    kvt_selector_destroy(other);
    free(s0.bytes);
    kvt_pool_destroy(p);
}

static void test_per_layer_bad(void **state)
{
    (void)state;
    const shape s = {2, 2, 2, 32, 8, KVT_DTYPE_BF16};
    const uint32_t Hq = 4, L = 2, H = 2, D = 32;
    kvt_pool_opts o = tu_opts(s.L, s.H, Hq, s.D, s.P, s.dt, 64, 0);
    o.n_threads = 2;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_id a, b;
    TU_OK(kvt_seq_create(p, NULL, &a));
    TU_OK(kvt_seq_create(p, NULL, &b));
    tu_rng r = {0xbad2ull};
    float kv[20 * 2 * 32];
    for (size_t e = 0; e < sizeof kv / sizeof kv[0]; e++)
        kv[e] = tu_unit(&r);
    for (uint32_t l = 0; l < L; l++) {
        TU_OK(kvt_seq_append(p, a, l, kv, kv, 20, KVT_DTYPE_F32, 0));
        TU_OK(kvt_seq_append(p, b, l, kv, kv, 5, KVT_DTYPE_F32, 0));
    }
    kvt_seq_id ids[2] = {a, b};
    kvt_geometry g = {s.L, s.H, Hq, s.D, s.P, s.dt, {0, 0}};
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, NULL, &sel));
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.selector = sel;
    float q[2 * 4 * 32], out[2 * 4 * 32], lse[8], k1[2 * (2 * 2 * 32)]; /* K then V */
    for (size_t e = 0; e < sizeof q / sizeof q[0]; e++)
        q[e] = tu_unit(&r);
    for (size_t e = 0; e < sizeof k1 / sizeof k1[0]; e++)
        k1[e] = tu_unit(&r);
    uint32_t pages[16], n, rr;
    snap s0;
    snap_take(&s0, p, ids, 2, &s);

    kvt_step *st;
    TU_OK(kvt_step_plan(p, ids, 2, &so, &st));
    /* Nothing selected yet. */
    TU_EXPECT_ERR(kvt_step_decode(st, 0, q, out, lse), KVT_ESTATE, "layer");
    TU_EXPECT_ERR(kvt_step_selection_get(st, 0, 0, 0, pages, 16, &n, &rr), KVT_ESTATE, "layer");
    /* Arguments. */
    TU_EXPECT_ERR(kvt_step_append(st, L, k1, k1, KVT_DTYPE_F32, 0), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_step_append(st, 0, NULL, k1, KVT_DTYPE_F32, 0), KVT_EINVAL, "k");
    TU_EXPECT_ERR(kvt_step_append(st, 0, k1, NULL, KVT_DTYPE_F32, 0), KVT_EINVAL, "v");
    TU_EXPECT_ERR(kvt_step_append(st, 0, k1, k1, 0, 0), KVT_EINVAL, "src_dtype");
    TU_EXPECT_ERR(kvt_step_append(st, 0, k1, k1, 9, 0), KVT_EINVAL, "src_dtype");
    TU_EXPECT_ERR(kvt_step_append(st, 0, k1, k1, KVT_DTYPE_F32, H * D - 1), KVT_EINVAL,
                  "seq_stride");
    TU_EXPECT_ERR(kvt_step_append(st, 0, k1, k1, KVT_DTYPE_F32, UINT64_MAX / 2), KVT_EOVERFLOW,
                  "seq_stride");
    TU_EXPECT_ERR(kvt_step_select(st, L, q), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_step_select(st, 0, NULL), KVT_EINVAL, "q");
    TU_EXPECT_ERR(kvt_step_attend(st, L, q, out, lse), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_step_attend(st, 0, NULL, out, lse), KVT_EINVAL, "q");
    TU_EXPECT_ERR(kvt_step_attend(st, 0, q, NULL, lse), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_step_decode(st, L, q, out, lse), KVT_EINVAL, "layer");
    snap_same(&s0, p, ids, 2, &s, "refused per-layer calls");

    /* Layer 0: append once; a second append is refused and stores nothing. */
    TU_OK(kvt_step_append(st, 0, k1, k1 + 2 * H * D, KVT_DTYPE_F32, 0));
    snap s1;
    snap_take(&s1, p, ids, 2, &s);
    TU_EXPECT_ERR(kvt_step_append(st, 0, k1, k1, KVT_DTYPE_F32, 0), KVT_ESTATE, "layer");
    snap_same(&s1, p, ids, 2, &s, "a second append of layer 0");
    TU_OK(kvt_step_attend(st, 0, q, out, lse));
    TU_EXPECT_ERR(kvt_step_decode(st, 0, NULL, out, lse), KVT_EINVAL, "q");
    TU_EXPECT_ERR(kvt_step_decode(st, 0, q, NULL, lse), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_step_selection_get(st, 0, 2, 0, pages, 16, &n, &rr), KVT_EINVAL, "seq_index");
    TU_EXPECT_ERR(kvt_step_selection_get(st, 0, 0, H, pages, 16, &n, &rr), KVT_EINVAL, "kv_head");
    TU_EXPECT_ERR(kvt_step_selection_get(st, L, 0, 0, pages, 16, &n, &rr), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_step_selection_get(st, 0, 0, 0, pages, 16, NULL, &rr), KVT_EINVAL, "n_pages");
    /* Sequence a has 21 tokens in layer 0: 3 pages, all selected (K 64). */
    TU_EXPECT_ERR(kvt_step_selection_get(st, 0, 0, 0, pages, 2, &n, &rr), KVT_ERANGE, "capacity");
    assert_non_null(strstr(kvt_last_error(), "3"));
    TU_EXPECT_ERR(kvt_step_selection_get(st, 0, 0, 0, NULL, 16, &n, &rr), KVT_EINVAL, "pages");
    TU_OK(kvt_step_selection_get(st, 0, 0, 0, pages, 3, &n, NULL));
    assert_int_equal(n, 3);

    /* A sequence appended behind the plan's back makes the plan stale for
     * that layer. */
    TU_OK(kvt_seq_append(p, b, 1, kv, kv, 1, KVT_DTYPE_F32, 0));
    snap s2;
    snap_take(&s2, p, ids, 2, &s);
    TU_EXPECT_ERR(kvt_step_append(st, 1, k1, k1, KVT_DTYPE_F32, 0), KVT_ESTATE, "stale");
    TU_EXPECT_ERR(kvt_step_attend(st, 1, q, out, lse), KVT_ESTATE, "stale");
    TU_EXPECT_ERR(kvt_step_select(st, 1, q), KVT_ESTATE, "stale");
    snap_same(&s2, p, ids, 2, &s, "calls on a stale plan");
    /* Layer 0 was appended, layer 1 not: the finish names layer 1 and takes
     * layer 0's appends back. */
    TU_EXPECT_ERR(kvt_step_finish(st), KVT_ESTATE, "layer 1");
    uint32_t len0;
    TU_OK(kvt_seq_length_get(p, ids[0], 0, &len0));
    assert_int_equal(len0, 20);
    TU_CHECK(p);
    free(s2.bytes);
    snap_take(&s2, p, ids, 2, &s);

    /* After finish, every call with the step is KVT_ESTATE. */
    TU_EXPECT_ERR(kvt_step_append(st, 0, k1, k1, KVT_DTYPE_F32, 0), KVT_ESTATE, "step");
    TU_EXPECT_ERR(kvt_step_select(st, 0, q), KVT_ESTATE, "step");
    TU_EXPECT_ERR(kvt_step_decode(st, 0, q, out, lse), KVT_ESTATE, "step");
    TU_EXPECT_ERR(kvt_step_attend(st, 0, q, out, lse), KVT_ESTATE, "step");
    TU_EXPECT_ERR(kvt_step_selection_get(st, 0, 0, 0, pages, 16, &n, &rr), KVT_ESTATE, "step");
    TU_EXPECT_ERR(kvt_step_finish(st), KVT_ESTATE, "step");
    snap_same(&s2, p, ids, 2, &s, "calls on a finished step");

    /* A sequence released during a step: the per-layer calls refuse it, and
     * finish still closes the step. */
    TU_OK(kvt_step_plan(p, ids, 2, &so, &st));
    TU_OK(kvt_seq_release(p, b));
    kvt_clear_error();
    int rc = kvt_step_attend(st, 1, q, out, lse);
    assert_true(rc == KVT_ENOENT || rc == KVT_ESTATE);
    rc = kvt_step_append(st, 1, k1, k1, KVT_DTYPE_F32, 0);
    assert_true(rc == KVT_ENOENT || rc == KVT_ESTATE);
    TU_OK(kvt_step_finish(st));
    TU_CHECK(p);
    kvt_seq_id only_a[1] = {a};
    snap s3;
    snap_take(&s3, p, only_a, 1, &s);
    snap_same(&s3, p, only_a, 1, &s, "nothing");
    TU_OK(kvt_step_plan(p, only_a, 1, &so, &st));
    TU_OK(kvt_step_finish(st));
    /* Destroying a pool with a step still open frees the step too (ASan and
     * valgrind runs check for leaks). */
    TU_OK(kvt_step_plan(p, only_a, 1, &so, &st));
    TU_OK(kvt_step_append(st, 0, k1, k1 + 2 * H * D, KVT_DTYPE_F32, 0));
    free(s0.bytes);
    free(s1.bytes);
    free(s2.bytes);
    free(s3.bytes);
    kvt_selector_destroy(sel);
    kvt_pool_destroy(p);
}

/* KVT_ENOSPC from the plan when the device tier cannot take the next token
 * of every (sequence, layer, head); a partially filled last page needs no
 * block. */
static void test_enospc(void **state)
{
    (void)state;
    const shape s = {2, 2, 1, 32, 8, KVT_DTYPE_F16};
    float kv[16 * 2 * 32];
    tu_rng r = {0xe5ull};
    for (size_t e = 0; e < sizeof kv / sizeof kv[0]; e++)
        kv[e] = tu_unit(&r);
    kvt_step_opts dense = KVT_STEP_OPTS_INIT;
    dense.flags = KVT_STEP_DENSE;
    /* 16 tokens = 2 full pages in each of 4 (layer, head): 8 blocks used;
     * the next token needs 4 more. */
    for (uint32_t spare = 0; spare <= 4; spare++) {
        kvt_pool_opts o = tu_opts(s.L, s.H, s.H, s.D, s.P, s.dt, 1 + 8 + spare, 0);
        kvt_pool *p;
        TU_OK(kvt_pool_create(&o, &p));
        kvt_seq_id a;
        TU_OK(kvt_seq_create(p, NULL, &a));
        for (uint32_t l = 0; l < s.L; l++)
            TU_OK(kvt_seq_append(p, a, l, kv, kv, 16, KVT_DTYPE_F32, 0));
        snap s0;
        snap_take(&s0, p, &a, 1, &s);
        kvt_step *st = NULL;
        if (spare < 4) {
            TU_EXPECT_ERR(kvt_step_plan(p, &a, 1, &dense, &st), KVT_ENOSPC, "device");
            assert_null(st);
            snap_same(&s0, p, &a, 1, &s, "KVT_ENOSPC");
        } else {
            TU_OK(kvt_step_plan(p, &a, 1, &dense, &st));
            float out[2 * 32], lse[2];
            for (uint32_t l = 0; l < s.L; l++) {
                TU_OK(kvt_step_append(st, l, kv, kv, KVT_DTYPE_F32, 0));
                TU_OK(kvt_step_attend(st, l, kv, out, lse));
            }
            TU_OK(kvt_step_finish(st));
            TU_CHECK(p);
            kvt_stats stt = {.struct_size = sizeof stt};
            TU_OK(kvt_pool_stats_get(p, &stt));
            assert_int_equal(stt.tier[KVT_TIER_DEVICE].blocks_free, 0);
            /* 17 tokens: the last page is partial, so 7 more tokens need no
             * block even with the device tier full. */
            for (int t = 0; t < 7; t++) {
                TU_OK(kvt_step_plan(p, &a, 1, &dense, &st));
                for (uint32_t l = 0; l < s.L; l++)
                    TU_OK(kvt_step_append(st, l, kv, kv, KVT_DTYPE_F32, 0));
                TU_OK(kvt_step_finish(st));
            }
            /* 24 tokens, full again: the next plan fails and changes nothing. */
            snap s1;
            snap_take(&s1, p, &a, 1, &s);
            TU_EXPECT_ERR(kvt_step_plan(p, &a, 1, &dense, &st), KVT_ENOSPC, "device");
            snap_same(&s1, p, &a, 1, &s, "KVT_ENOSPC when full");
            /* Releasing a sequence makes room again (a new one, empty). */
            kvt_seq_id b;
            TU_OK(kvt_seq_create(p, NULL, &b));
            TU_EXPECT_ERR(kvt_step_plan(p, &b, 1, &dense, &st), KVT_ENOSPC, "device");
            TU_OK(kvt_seq_release(p, a));
            TU_OK(kvt_step_plan(p, &b, 1, &dense, &st));
            TU_OK(kvt_step_finish(st));
            free(s1.bytes);
        }
        free(s0.bytes);
        kvt_pool_destroy(p);
    }
}

/* Documented: a plan with a sequence whose layer already holds max_tokens
 * tokens fails with KVT_ERANGE (kvt_step_plan(3)). */
static void test_plan_at_token_limit(void **state)
{
    (void)state;
    const shape s = {1, 1, 1, 16, 8, KVT_DTYPE_F16};
    kvt_pool_opts o = tu_opts(s.L, s.H, s.H, s.D, s.P, s.dt, 16, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_opts sq = KVT_SEQ_OPTS_INIT;
    sq.max_tokens = 12;
    kvt_seq_id a, b;
    TU_OK(kvt_seq_create(p, &sq, &a));
    TU_OK(kvt_seq_create(p, NULL, &b));
    float kv[12 * 16] = {0};
    TU_OK(kvt_seq_append(p, a, 0, kv, kv, 12, KVT_DTYPE_F32, 0));
    TU_OK(kvt_seq_append(p, b, 0, kv, kv, 3, KVT_DTYPE_F32, 0));
    kvt_seq_id ids[2] = {b, a};
    snap s0;
    snap_take(&s0, p, ids, 2, &s);
    kvt_step_opts dense = KVT_STEP_OPTS_INIT;
    dense.flags = KVT_STEP_DENSE;
    kvt_step *st = NULL;
    kvt_clear_error();
    int rc = kvt_step_plan(p, ids, 2, &dense, &st);
    if (rc == 0) {
        /* Not what kvt_step_plan(3) documents; at least the append must be
         * all or nothing. */
        int arc = kvt_step_append(st, 0, kv, kv, KVT_DTYPE_F32, 0);
        TU_OK(kvt_step_finish(st));
        snap_same(&s0, p, ids, 2, &s, "an append past the token limit");
        free(s0.bytes);
        kvt_pool_destroy(p);
        fail_msg("kvt_step_plan accepted a sequence at its max_tokens (kvt_step_append then "
                 "returned %s); kvt_step_plan(3) documents KVT_ERANGE", kvt_err_name(arc));
    }
    assert_int_equal(rc, KVT_ERANGE);
    assert_null(st);
    snap_same(&s0, p, ids, 2, &s, "a plan refused at the token limit");
    free(s0.bytes);
    kvt_pool_destroy(p);
}

/* Documented: a step keeps the selection of the latest kvt_step_select only;
 * decoding (or reading the selection of) an earlier layer is KVT_ESTATE and
 * changes nothing, and selecting that layer again makes it work. */
static void test_select_layers_then_decode(void **state)
{
    (void)state;
    const shape s = {2, 1, 2, 32, 8, KVT_DTYPE_F32};
    kvt_pool_opts o = tu_opts(s.L, s.H, 2, s.D, s.P, s.dt, 32, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_id a;
    TU_OK(kvt_seq_create(p, NULL, &a));
    tu_rng r = {0x1a7e5ull};
    float kv[40 * 32], q[2][2 * 32], out[2 * 32], lse[2];
    for (size_t e = 0; e < sizeof kv / sizeof kv[0]; e++)
        kv[e] = tu_unit(&r);
    for (size_t e = 0; e < sizeof q / sizeof q[0][0]; e++)
        q[e / 64][e % 64] = 2.0f * tu_unit(&r);
    TU_OK(kvt_seq_append(p, a, 0, kv, kv, 40, KVT_DTYPE_F32, 0));
    TU_OK(kvt_seq_append(p, a, 1, kv, kv, 33, KVT_DTYPE_F32, 0));
    kvt_geometry g = {s.L, s.H, 2, s.D, s.P, s.dt, {0, 0}};
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.top_k_pages = 1;
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, &so, &sel));
    kvt_step_opts o2 = KVT_STEP_OPTS_INIT;
    o2.selector = sel;
    kvt_step *st;
    TU_OK(kvt_step_plan(p, &a, 1, &o2, &st));
    uint32_t p0[8], n0, p1[8], n1;
    TU_OK(kvt_step_select(st, 0, q[0]));
    TU_OK(kvt_step_selection_get(st, 0, 0, 0, p0, 8, &n0, NULL));
    TU_OK(kvt_step_select(st, 1, q[1]));
    TU_OK(kvt_step_selection_get(st, 1, 0, 0, p1, 8, &n1, NULL));
    for (size_t e = 0; e < sizeof out / sizeof out[0]; e++)
        out[e] = 12345.0f;
    TU_EXPECT_ERR(kvt_step_decode(st, 0, q[0], out, lse), KVT_ESTATE, "layer");
    for (size_t e = 0; e < sizeof out / sizeof out[0]; e++)
        assert_true(out[e] == 12345.0f);
    TU_EXPECT_ERR(kvt_step_selection_get(st, 0, 0, 0, p0, 8, &n0, NULL), KVT_ESTATE, "layer");
    TU_OK(kvt_step_select(st, 0, q[0]));
    TU_OK(kvt_step_selection_get(st, 0, 0, 0, p0, 8, &n0, NULL));
    TU_OK(kvt_step_decode(st, 0, q[0], out, lse));
    uint32_t pc[8], nc;
    TU_OK(kvt_step_selection_get(st, 0, 0, 0, pc, 8, &nc, NULL));
    assert_int_equal(nc, n0);
    assert_memory_equal(pc, p0, n0 * sizeof *p0);
    double ref[2 * 32], rl[2], kap[2], vmax;
    ref_attn(p, a, 0, 0, &s, 40, p0, n0, q[0], 1.0 / sqrt(32.0), ref, rl, kap, &vmax);
    check_rows(out, lse, ref, rl, kap, vmax, 2, 32, "layer 0 after selecting layer 1");
    TU_OK(kvt_step_finish(st));
    kvt_selector_destroy(sel);
    kvt_pool_destroy(p);
}

/* Documented argument checks that hold whatever the step's contents,
 * collected so that one report lists every mismatch. */
static void test_doc_edge_cases(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(1, 1, 1, 16, 8, KVT_DTYPE_F16, 16, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_id empty;
    TU_OK(kvt_seq_create(p, NULL, &empty));
    kvt_step_opts dense = KVT_STEP_OPTS_INIT;
    dense.flags = KVT_STEP_DENSE;
    kvt_step *st;
    TU_OK(kvt_step_plan(p, &empty, 1, &dense, &st));
    float q[16] = {0}, out[16], lse[1];
    uint32_t n, pages[4];
    char report[2048] = "";
    size_t used = 0;
#define DOC_EXPECT(call, code, needle)                                                     \
    do {                                                                                   \
        kvt_clear_error();                                                                 \
        int rc_ = (call);                                                                  \
        if (rc_ != (code) || !strstr(kvt_last_error(), (needle)))                          \
            used += (size_t)snprintf(report + used, sizeof report - used,                  \
                                     "\n  %s: %s '%s' (documented %s naming '%s')", #call,  \
                                     kvt_err_name(rc_), kvt_last_error(), #code, (needle)); \
    } while (0)
    /* kvt_step_select(3): "step or q is NULL" is KVT_EINVAL (dense or not). */
    DOC_EXPECT(kvt_step_select(st, 0, NULL), KVT_EINVAL, "q");
    TU_OK(kvt_step_select(st, 0, q));
    /* kvt_step_selection_get(3): "pages is NULL with a non-zero capacity" is
     * KVT_EINVAL, also when nothing is selected. */
    DOC_EXPECT(kvt_step_selection_get(st, 0, 0, 0, NULL, 4, &n, NULL), KVT_EINVAL, "pages");
    TU_OK(kvt_step_selection_get(st, 0, 0, 0, NULL, 0, &n, NULL));
    assert_int_equal(n, 0);
    /* A NULL step: the message names the argument as the headers do. */
    DOC_EXPECT(kvt_step_append(NULL, 0, q, q, KVT_DTYPE_F32, 0), KVT_EINVAL, "step");
    DOC_EXPECT(kvt_step_select(NULL, 0, q), KVT_EINVAL, "step");
    DOC_EXPECT(kvt_step_decode(NULL, 0, q, out, lse), KVT_EINVAL, "step");
    DOC_EXPECT(kvt_step_attend(NULL, 0, q, out, lse), KVT_EINVAL, "step");
    DOC_EXPECT(kvt_step_selection_get(NULL, 0, 0, 0, pages, 4, &n, NULL), KVT_EINVAL, "step");
#undef DOC_EXPECT
    TU_OK(kvt_step_finish(st));
    kvt_pool_destroy(p);
    if (used)
        fail_msg("calls that differ from their man pages:%s", report);
}

/* Stable-head reranks stay staggered when sequences come and go: 33
 * sequences, then all but the ones in slots 0, 16 and 32 released (slots
 * that coincide modulo the interval). Over any 16 steps each survivor
 * reranks once, and never two at the same step. */
static void test_stagger_after_churn(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(1, 1, 1, 16, 16, KVT_DTYPE_F32, 200, 0);
    o.n_threads = 1;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_id ids[33];
    float kv[64 * 16];
    tu_rng r = {33};
    for (int i = 0; i < 64 * 16; i++)
        kv[i] = tu_unit(&r);
    for (int i = 0; i < 33; i++) {
        TU_OK(kvt_seq_create(p, NULL, &ids[i]));
        TU_OK(kvt_seq_append(p, ids[i], 0, kv, kv, 64, KVT_DTYPE_F32, 0));
    }
    for (int i = 0; i < 33; i++)
        if (i % 16)
            TU_OK(kvt_seq_release(p, ids[i]));
    kvt_seq_id keep[3] = {ids[0], ids[16], ids[32]};
    kvt_selector *sel;
    kvt_selector_opts so;
    TU_OK(kvt_selector_opts_init(&so));
    so.top_k_pages = 1;
    so.rerank_interval = 16;
    TU_OK(kvt_selector_create(&o.geom, &so, &sel));
    kvt_step_opts sp;
    TU_OK(kvt_step_opts_init(&sp));
    sp.selector = sel;
    uint32_t rr[33][3];
    float q[3 * 16];
    for (int i = 0; i < 3 * 16; i++)
        q[i] = tu_unit(&r);
    for (int t = 0; t < 33; t++) {
        kvt_step *st;
        TU_OK(kvt_step_plan(p, keep, 3, &sp, &st));
        TU_OK(kvt_step_append(st, 0, kv, kv, KVT_DTYPE_F32, 0));
        TU_OK(kvt_step_select(st, 0, q));
        for (uint32_t i = 0; i < 3; i++) {
            uint32_t pages[16], n;
            TU_OK(kvt_step_selection_get(st, 0, i, 0, pages, 16, &n, &rr[t][i]));
        }
        TU_OK(kvt_step_finish(st));
    }
    for (int t = 1; t < 33; t++) { /* step 0: nothing kept yet, all rerank */
        uint32_t c = rr[t][0] + rr[t][1] + rr[t][2];
        if (c > 1)
            fail_msg("step %d: %u of 3 sequences rerank together", t, c);
    }
    for (uint32_t i = 0; i < 3; i++)
        for (int s0 = 1; s0 + 16 <= 33; s0++) {
            uint32_t c = 0;
            for (int t = s0; t < s0 + 16; t++)
                c += rr[t][i];
            assert_int_equal(c, 1);
        }
    kvt_selector_destroy(sel);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_step_loop_dense),
        cmocka_unit_test(test_step_loop_sparse),
        cmocka_unit_test(test_rerank),
        cmocka_unit_test(test_rerank_corners),
        cmocka_unit_test(test_plan_bad),
        cmocka_unit_test(test_per_layer_bad),
        cmocka_unit_test(test_enospc),
        cmocka_unit_test(test_plan_at_token_limit),
        cmocka_unit_test(test_select_layers_then_decode),
        cmocka_unit_test(test_doc_edge_cases),
        /* Last: with the heap overflow it guards against, it aborts. */
        cmocka_unit_test(test_selector_change_between_steps),
        cmocka_unit_test(test_stagger_after_churn),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
