/* Page selection (kvt_selector_select) and the selector's budgets.
 *
 * Scores are checked against a double-precision reference computed from the
 * page metadata (kvt_seq_page_meta_get); the selection is checked against a
 * brute-force rule (forced pages + a full sort of the rest) applied to the
 * library's own scores, so that f32-vs-double near ties cannot flip the
 * answer. Planted needles, exact ties, NaN boxes, the budget setters and
 * bad input follow. */
#include "testutil.h"

/* ---- helpers --------------------------------------------------------------- */

static uint32_t n_pages_of(uint32_t tokens, uint32_t P)
{
    return (tokens + P - 1) / P;
}

/* Fills `layer` of seq with T tokens of random keys (scale ks) and values. */
static void fill_random(kvt_pool *p, kvt_seq_id seq, uint32_t layer, uint32_t T, uint32_t H,
                        uint32_t D, tu_rng *r, double ks)
{
    if (T == 0)
        return;
    size_t n = (size_t)T * H * D;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++) {
        k[i] = (float)(ks * tu_unit(r));
        v[i] = tu_unit(r);
    }
    TU_OK(kvt_seq_append(p, seq, layer, k, v, T, KVT_DTYPE_F32, 0));
    free(k);
    free(v);
}

/* The reference voted score of every page, in double, and a magnitude per
 * page (sum of |terms|) that bounds the f32 rounding of the dot products. */
static void ref_scores(const kvt_pool *p, kvt_seq_id seq, uint32_t layer, uint32_t kvh,
                       uint32_t G, uint32_t D, uint32_t n_pages, const float *q,
                       kvt_score_method method, kvt_vote vote, double vscale, double *ref,
                       double *mag)
{
    float *mn = malloc(D * sizeof *mn), *mx = malloc(D * sizeof *mx),
          *me = malloc(D * sizeof *me);
    double *raw = malloc((size_t)G * n_pages * sizeof *raw);
    double *rmag = malloc((size_t)G * n_pages * sizeof *rmag);
    for (uint32_t pg = 0; pg < n_pages; pg++) {
        TU_OK(kvt_seq_page_meta_get(p, seq, layer, kvh, pg, mn, mx, me));
        for (uint32_t j = 0; j < G; j++) {
            const float *qj = q + (size_t)j * D;
            double s = 0, m = 0;
            for (uint32_t d = 0; d < D; d++) {
                double t;
                if (method == KVT_SCORE_MINMAX) {
                    double a = (double)qj[d] * mn[d], b = (double)qj[d] * mx[d];
                    t = a > b ? a : b;
                } else {
                    t = (double)qj[d] * me[d];
                }
                s += t;
                m += fabs(t);
            }
            raw[(size_t)j * n_pages + pg] = s;
            rmag[(size_t)j * n_pages + pg] = m;
        }
    }
    for (uint32_t pg = 0; pg < n_pages; pg++) {
        ref[pg] = vote == KVT_VOTE_MAX ? -INFINITY : 0.0;
        mag[pg] = 0;
    }
    for (uint32_t j = 0; j < G; j++) {
        const double *rj = raw + (size_t)j * n_pages, *mj = rmag + (size_t)j * n_pages;
        if (vote == KVT_VOTE_SOFTVOTE) {
            double mxs = -INFINITY, z = 0;
            for (uint32_t pg = 0; pg < n_pages; pg++)
                mxs = vscale * rj[pg] > mxs ? vscale * rj[pg] : mxs;
            for (uint32_t pg = 0; pg < n_pages; pg++)
                z += exp(vscale * rj[pg] - mxs);
            for (uint32_t pg = 0; pg < n_pages; pg++)
                ref[pg] += exp(vscale * rj[pg] - mxs) / z;
        } else {
            for (uint32_t pg = 0; pg < n_pages; pg++) {
                if (vote == KVT_VOTE_SUM)
                    ref[pg] += rj[pg];
                else if (rj[pg] > ref[pg])
                    ref[pg] = rj[pg];
                mag[pg] = vote == KVT_VOTE_SUM ? mag[pg] + mj[pg]
                                               : (mj[pg] > mag[pg] ? mj[pg] : mag[pg]);
            }
        }
    }
    free(mn);
    free(mx);
    free(me);
    free(raw);
    free(rmag);
}

typedef struct {
    double s;
    uint32_t i;
} cand;

static int cand_cmp(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    if (x->s != y->s)
        return x->s > y->s ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

/* The documented rule by brute force. Returns the count; out in increasing
 * page order. */
static uint32_t brute_select(const float *scores, uint32_t tokens, uint32_t P, uint32_t K,
                             uint32_t sink, uint32_t local, uint32_t *out)
{
    uint32_t n = n_pages_of(tokens, P);
    if (n == 0)
        return 0;
    uint8_t *mark = calloc(n, 1);
    for (uint32_t i = 0; i < sink && i < n; i++)
        mark[i] = 1;
    /* a partial last page is forced on top of the local (full) pages */
    const uint32_t partial = tokens % P != 0;
    for (uint32_t i = 0; i < local + partial && i < n; i++)
        mark[n - 1 - i] = 1;
    cand *c = malloc(n * sizeof *c);
    uint32_t nc = 0;
    for (uint32_t i = 0; i < n; i++)
        if (!mark[i]) {
            c[nc].s = isnan(scores[i]) ? INFINITY : (double)scores[i];
            c[nc].i = i;
            nc++;
        }
    qsort(c, nc, sizeof *c, cand_cmp);
    for (uint32_t i = 0; i < nc && i < K; i++)
        mark[c[i].i] = 1;
    uint32_t cnt = 0;
    for (uint32_t i = 0; i < n; i++)
        if (mark[i])
            out[cnt++] = i;
    free(c);
    free(mark);
    return cnt;
}

static void expect_pages(const uint32_t *got, uint32_t n_got, const uint32_t *want,
                         uint32_t n_want, const char *what)
{
    if (n_got != n_want) {
        fail_msg("%s: %u pages selected, expected %u", what, n_got, n_want);
    }
    for (uint32_t i = 0; i < n_want; i++)
        if (got[i] != want[i])
            fail_msg("%s: entry %u is page %u, expected %u", what, i, got[i], want[i]);
}

static kvt_geometry geom_of(uint32_t L, uint32_t H, uint32_t Hq, uint32_t D, uint32_t P,
                            kvt_dtype dt)
{
    kvt_geometry g = {L, H, Hq, D, P, dt, {0, 0}};
    return g;
}

static const char *const method_name[] = {"MINMAX", "MEAN"};
static const char *const vote_name[] = {"SUM", "MAX", "SOFTVOTE"};

/* ---- scores and selection on random shapes ---------------------------------- */

static void test_random_shapes(void **state)
{
    (void)state;
    tu_rng r = {0x5e1ec7ull};
    const uint32_t trials = 24;
    for (uint32_t trial = 0; trial < trials; trial++) {
        const uint32_t P = 8u << tu_below(&r, 4), D = tu_below(&r, 2) ? 128 : 64;
        const uint32_t G = 1 + tu_below(&r, 8), H = 1 + tu_below(&r, 2), L = 1 + tu_below(&r, 2);
        const kvt_dtype dt = 1 + tu_below(&r, 3);
        uint32_t T[2];
        uint64_t blocks = 4;
        for (uint32_t l = 0; l < L; l++) {
            uint32_t full = tu_below(&r, 40), part = tu_below(&r, 2) ? tu_below(&r, P) : 0;
            T[l] = full * P + part;
            if (l == 0 && T[l] == 0)
                T[l] = 1 + tu_below(&r, P);
            blocks += (uint64_t)n_pages_of(T[l], P) * H;
        }
        kvt_pool_opts o = tu_opts(L, H, H * G, D, P, dt, blocks, 0);
        o.n_threads = 1;
        kvt_pool *p;
        kvt_seq_id seq;
        TU_OK(kvt_pool_create(&o, &p));
        TU_OK(kvt_seq_create(p, NULL, &seq));
        for (uint32_t l = 0; l < L; l++)
            fill_random(p, seq, l, T[l], H, D, &r, 2.0);
        kvt_geometry g = geom_of(L, H, H * G, D, P, dt);
        uint32_t maxpages = n_pages_of(T[0], P) > n_pages_of(L > 1 ? T[1] : 0, P)
                                ? n_pages_of(T[0], P)
                                : n_pages_of(L > 1 ? T[1] : 0, P);
        uint32_t cap = maxpages + 1;
        uint32_t *pages = malloc(cap * sizeof *pages), *want = malloc(cap * sizeof *want);
        float *scores = malloc(cap * sizeof *scores);
        double *ref = malloc(cap * sizeof *ref), *mag = malloc(cap * sizeof *mag);
        float *q = malloc((size_t)G * D * sizeof *q);

        for (kvt_score_method m = 0; m < 2; m++)
            for (kvt_vote vt = 0; vt < 3; vt++) {
                kvt_selector_opts so;
                TU_OK(kvt_selector_opts_init(&so));
                so.method = m;
                so.vote = vt;
                so.vote_scale = tu_below(&r, 2) ? 0.0f : (float)(0.05 + 0.5 * (tu_unit(&r) + 1));
                kvt_selector *sel;
                TU_OK(kvt_selector_create(&g, &so, &sel));
                const double vscale = so.vote_scale != 0.0f ? (double)so.vote_scale
                                                            : 1.0 / sqrt((double)D);
                /* A different budget per (layer, head). */
                uint32_t K[2][2], S[2][2], Lc[2][2];
                for (uint32_t l = 0; l < L; l++)
                    for (uint32_t h = 0; h < H; h++) {
                        uint32_t np = n_pages_of(T[l], P);
                        K[l][h] = tu_below(&r, 8) == 0 ? 0 : 1 + tu_below(&r, np + 3);
                        S[l][h] = tu_below(&r, 4);
                        Lc[l][h] = tu_below(&r, 4);
                        TU_OK(kvt_selector_budget_set(sel, l, h, K[l][h], S[l][h], Lc[l][h]));
                    }
                for (uint32_t l = 0; l < L; l++)
                    for (uint32_t h = 0; h < H; h++) {
                        uint32_t k, s, lc;
                        TU_OK(kvt_selector_budget_get(sel, l, h, &k, &s, &lc));
                        assert_int_equal(k, K[l][h]);
                        assert_int_equal(s, S[l][h]);
                        assert_int_equal(lc, Lc[l][h]);
                        const uint32_t np = n_pages_of(T[l], P);
                        for (size_t i = 0; i < (size_t)G * D; i++)
                            q[i] = tu_unit(&r);
                        uint32_t n_sel = 12345;
                        for (uint32_t i = 0; i < cap; i++)
                            scores[i] = -1234.5f;
                        TU_OK(kvt_selector_select(sel, p, seq, l, h, q, pages, cap, &n_sel, scores));
                        if (np == 0) {
                            assert_int_equal(n_sel, 0);
                            continue;
                        }
                        /* The slot past n_pages must be left alone. */
                        assert_true(scores[np] == -1234.5f);
                        ref_scores(p, seq, l, h, G, D, np, q, m, vt, vscale, ref, mag);
                        for (uint32_t pg = 0; pg < np; pg++) {
                            double tol = vt == KVT_VOTE_SOFTVOTE
                                             ? 1e-4 * fabs(ref[pg]) + 1e-7
                                             : 1e-4 * fabs(ref[pg]) + 1e-5 * mag[pg] + 1e-30;
                            if (!(fabs((double)scores[pg] - ref[pg]) <= tol))
                                fail_msg("trial %u %s/%s P %u D %u G %u layer %u head %u "
                                         "page %u/%u: score %.9g, reference %.9g",
                                         trial, method_name[m], vote_name[vt], P, D, G, l, h,
                                         pg, np, (double)scores[pg], ref[pg]);
                        }
                        uint32_t n_want =
                            brute_select(scores, T[l], P, K[l][h], S[l][h], Lc[l][h], want);
                        char what[160];
                        snprintf(what, sizeof what,
                                 "trial %u %s/%s T %u P %u K %u sink %u local %u", trial,
                                 method_name[m], vote_name[vt], T[l], P, K[l][h], S[l][h],
                                 Lc[l][h]);
                        expect_pages(pages, n_sel, want, n_want, what);
                        /* Exactly the count needed is enough capacity; one less is
                         * KVT_ERANGE. Scores are optional. */
                        TU_OK(kvt_selector_select(sel, p, seq, l, h, q, pages, n_want, &n_sel, NULL));
                        expect_pages(pages, n_sel, want, n_want, what);
                        if (n_want > 0) {
                            /* Refused: nothing written (pages, count, scores). */
                            for (uint32_t i = 0; i < cap; i++) {
                                pages[i] = 0xabcdu;
                                scores[i] = -1234.5f;
                            }
                            n_sel = 0xabcdu;
                            TU_EXPECT_ERR(kvt_selector_select(sel, p, seq, l, h, q, pages, n_want - 1,
                                                              &n_sel, scores),
                                          KVT_ERANGE, "capacity");
                            assert_int_equal(n_sel, 0xabcdu);
                            for (uint32_t i = 0; i < cap; i++)
                                assert_true(pages[i] == 0xabcdu && scores[i] == -1234.5f);
                        }
                    }
                kvt_selector_destroy(sel);
            }
        TU_CHECK(p);
        free(pages);
        free(want);
        free(scores);
        free(ref);
        free(mag);
        free(q);
        kvt_pool_destroy(p);
    }
}

/* ---- ties: identical pages, lower index wins -------------------------------- */

static void test_ties(void **state)
{
    (void)state;
    enum { P = 8, D = 64, G = 2, NP = 24 };
    tu_rng r = {0x7135ull};
    /* Two page patterns: A scores high (keys along q), B is random. Pages
     * 0..NP-2 are full, the last holds 3 tokens. */
    float q[G * D];
    for (int i = 0; i < G * D; i++)
        q[i] = tu_unit(&r);
    static float patA[P][D], patB[P][D];
    for (int t = 0; t < P; t++)
        for (int d = 0; d < D; d++) {
            patA[t][d] = (float)(2.0 * (q[d] + q[D + d]) + 0.01 * tu_unit(&r));
            patB[t][d] = 0.5f * tu_unit(&r);
        }
    const uint32_t T = (NP - 1) * P + 3;
    static float k[NP * P][D], v[NP * P][D];
    int isA[NP];
    for (int pg = 0; pg < NP; pg++) {
        isA[pg] = tu_below(&r, 3) == 0 || pg == 5 || pg == 9 || pg == 17;
        for (int t = 0; t < P; t++)
            for (int d = 0; d < D; d++) {
                k[pg * P + t][d] = isA[pg] ? patA[t][d] : patB[t][d];
                v[pg * P + t][d] = tu_unit(&r);
            }
    }
    for (kvt_dtype dt = 1; dt <= 3; dt++) {
        kvt_pool_opts o = tu_opts(1, 1, G, D, P, dt, NP + 2, 0);
        kvt_pool *p;
        kvt_seq_id seq;
        TU_OK(kvt_pool_create(&o, &p));
        TU_OK(kvt_seq_create(p, NULL, &seq));
        TU_OK(kvt_seq_append(p, seq, 0, k, v, T, KVT_DTYPE_F32, 0));
        kvt_geometry g = geom_of(1, 1, G, D, P, dt);
        for (kvt_score_method m = 0; m < 2; m++)
            for (kvt_vote vt = 0; vt < 3; vt++) {
                kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
                so.method = m;
                so.vote = vt;
                kvt_selector *sel;
                TU_OK(kvt_selector_create(&g, &so, &sel));
                for (uint32_t K = 1; K <= 6; K++)
                    for (uint32_t sink = 0; sink <= 2; sink++) {
                        TU_OK(kvt_selector_budget_set(sel, 0, 0, K, sink, 1));
                        uint32_t pages[NP], n_sel, want[NP], nw = 0;
                        /* Expected without looking at any score: sink pages, the
                         * first K pattern-A pages after them (all A pages score
                         * the same and above every B page), the partial last
                         * page and the local (full) page before it. */
                        uint32_t taken = 0;
                        for (uint32_t pg = 0; pg < NP; pg++) {
                            int forced = pg < sink || pg + 2 >= NP;
                            int pick = !forced && isA[pg] && taken < K;
                            if (pick)
                                taken++;
                            if (forced || pick)
                                want[nw++] = pg;
                        }
                        /* Fewer A pages than K: the best B pages (equal too) by
                         * index fill up. */
                        if (taken < K) {
                            nw = 0;
                            uint32_t needB = K - taken, tookB = 0;
                            for (uint32_t pg = 0; pg < NP; pg++) {
                                int forced = pg < sink || pg + 2 >= NP;
                                int pick = !forced && (isA[pg] || tookB++ < needB);
                                if (forced || pick)
                                    want[nw++] = pg;
                            }
                        }
                        TU_OK(kvt_selector_select(sel, p, seq, 0, 0, q, pages, NP, &n_sel, NULL));
                        char what[96];
                        snprintf(what, sizeof what, "ties dtype %u %s/%s K %u sink %u", dt,
                                 method_name[m], vote_name[vt], K, sink);
                        expect_pages(pages, n_sel, want, nw, what);
                    }
                kvt_selector_destroy(sel);
            }
        kvt_pool_destroy(p);
    }
}

/* ---- NaN boxes count as +infinity ------------------------------------------- */

static void test_nan_scores(void **state)
{
    (void)state;
    enum { P = 8, D = 16, NP = 12 };
    tu_rng r = {0xa4a4ull};
    static float k[NP * P][D], v[NP * P][D];
    for (int t = 0; t < NP * P; t++)
        for (int d = 0; d < D; d++) {
            k[t][d] = tu_unit(&r);
            v[t][d] = tu_unit(&r);
        }
    /* Page 4 has a NaN key in dimension 3, page 7 in dimension 5. */
    k[4 * P + 2][3] = NAN;
    k[7 * P + 6][5] = NAN;
    float q[D];
    for (int d = 0; d < D; d++)
        q[d] = tu_unit(&r);
    for (int variant = 0; variant < 2; variant++) {
        /* variant 0: q[3] = 0 -> page 4 scores 0 * inf = NaN, page 7 +inf;
         * variant 1: q[5] = 0 -> page 4 +inf, page 7 NaN. Either way both
         * count as +inf and page 4 wins a single place by its index. */
        float qq[D];
        memcpy(qq, q, sizeof qq);
        qq[variant ? 5 : 3] = 0.0f;
        kvt_pool_opts o = tu_opts(1, 1, 1, D, P, KVT_DTYPE_F32, NP + 2, 0);
        kvt_pool *p;
        kvt_seq_id seq;
        TU_OK(kvt_pool_create(&o, &p));
        TU_OK(kvt_seq_create(p, NULL, &seq));
        TU_OK(kvt_seq_append(p, seq, 0, k, v, NP * P, KVT_DTYPE_F32, 0));
        kvt_geometry g = geom_of(1, 1, 1, D, P, KVT_DTYPE_F32);
        for (kvt_vote vt = KVT_VOTE_SUM; vt <= KVT_VOTE_MAX; vt++) {
            kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
            so.vote = vt;
            so.sink_pages = 0;
            so.local_pages = 0;
            so.top_k_pages = 1;
            kvt_selector *sel;
            TU_OK(kvt_selector_create(&g, &so, &sel));
            uint32_t pages[NP], n_sel;
            float sc[NP];
            TU_OK(kvt_selector_select(sel, p, seq, 0, 0, qq, pages, NP, &n_sel, sc));
            /* Both count as +inf (0 * inf is NaN by IEEE, q * inf is inf). */
            assert_true(isnan(sc[4]) || (isinf(sc[4]) && sc[4] > 0));
            assert_true(isnan(sc[7]) || (isinf(sc[7]) && sc[7] > 0));
            assert_int_equal(n_sel, 1);
            assert_int_equal(pages[0], 4);
            TU_OK(kvt_selector_budget_set(sel, 0, 0, 2, 0, 0));
            TU_OK(kvt_selector_select(sel, p, seq, 0, 0, qq, pages, NP, &n_sel, NULL));
            assert_int_equal(n_sel, 2);
            assert_int_equal(pages[0], 4);
            assert_int_equal(pages[1], 7);
            kvt_selector_destroy(sel);
        }
        /* MEAN: the NaN key makes both means NaN in one dimension. */
        kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
        so.method = KVT_SCORE_MEAN;
        so.sink_pages = 0;
        so.local_pages = 0;
        so.top_k_pages = 1;
        kvt_selector *sel;
        TU_OK(kvt_selector_create(&g, &so, &sel));
        uint32_t pages[NP], n_sel;
        TU_OK(kvt_selector_select(sel, p, seq, 0, 0, q, pages, NP, &n_sel, NULL));
        assert_int_equal(n_sel, 1);
        assert_int_equal(pages[0], 4);
        kvt_selector_destroy(sel);
        TU_CHECK(p);
        kvt_pool_destroy(p);
    }
}

/* ---- a planted needle in 32k tokens ------------------------------------------ */

static void test_needle(void **state)
{
    (void)state;
    enum { P = 16, D = 128, T = 32768, NP = T / P };
    float *k = malloc((size_t)T * D * sizeof *k), *v = malloc((size_t)T * D * sizeof *v);
    uint32_t *pages = malloc(NP * sizeof *pages);
    const uint32_t groups[2] = {1, 4};
    for (int gi = 0; gi < 2; gi++)
        for (uint64_t seed = 1; seed <= 3; seed++) {
            const uint32_t G = groups[gi];
            tu_rng r = {0x6e6565646c65ull * seed + G};
            for (size_t i = 0; i < (size_t)T * D; i++) {
                k[i] = tu_unit(&r);
                v[i] = tu_unit(&r);
            }
            float q[4 * D];
            for (uint32_t i = 0; i < G * D; i++)
                q[i] = tu_unit(&r);
            /* The needle: head 0's query scaled to a largest element of 4,
             * somewhere outside the first and last pages. */
            const uint32_t pos = P + tu_below(&r, T - 2 * P);
            double qmax = 0;
            for (uint32_t d = 0; d < D; d++)
                qmax = fabs(q[d]) > qmax ? fabs(q[d]) : qmax;
            for (uint32_t d = 0; d < D; d++)
                k[(size_t)pos * D + d] = (float)(4.0 * q[d] / qmax);
            kvt_pool_opts o = tu_opts(1, 1, G, D, P, KVT_DTYPE_F16, NP + 2, 0);
            kvt_pool *p;
            kvt_seq_id seq;
            TU_OK(kvt_pool_create(&o, &p));
            TU_OK(kvt_seq_create(p, NULL, &seq));
            TU_OK(kvt_seq_append(p, seq, 0, k, v, T, KVT_DTYPE_F32, 0));
            kvt_geometry g = geom_of(1, 1, G, D, P, KVT_DTYPE_F16);
            for (kvt_score_method m = 0; m < (G == 1 ? 2u : 1u); m++) {
                kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT; /* SUM, K 64, sink 1, local 1 */
                so.method = m;
                kvt_selector *sel;
                TU_OK(kvt_selector_create(&g, &so, &sel));
                uint32_t n_sel = 0;
                TU_OK(kvt_selector_select(sel, p, seq, 0, 0, q, pages, NP, &n_sel, NULL));
                assert_int_equal(n_sel, 64 + 2);
                int found = 0;
                for (uint32_t i = 0; i < n_sel; i++)
                    found |= pages[i] == pos / P;
                if (!found)
                    fail_msg("needle at token %u (page %u) not selected (%s, G %u, seed %llu)",
                             pos, pos / P, method_name[m], G, (unsigned long long)seed);
                kvt_selector_destroy(sel);
            }
            kvt_pool_destroy(p);
        }
    free(k);
    free(v);
    free(pages);
}

/* ---- budgets ------------------------------------------------------------------ */

static void expect_budget(const kvt_selector *sel, uint32_t l, uint32_t h, uint32_t k,
                          uint32_t s, uint32_t lc)
{
    uint32_t a = 0xdead, b = 0xdead, c = 0xdead;
    TU_OK(kvt_selector_budget_get(sel, l, h, &a, &b, &c));
    if (a != k || b != s || c != lc)
        fail_msg("budget of layer %u head %u is (%u, %u, %u), expected (%u, %u, %u)", l, h, a,
                 b, c, k, s, lc);
}

static void test_budgets(void **state)
{
    (void)state;
    enum { L = 3, H = 4 };
    kvt_geometry g = geom_of(L, H, 2 * H, 64, 16, KVT_DTYPE_F16);
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, NULL, &sel));
    /* Defaults: K 64, sink 1, local 1 everywhere. */
    uint32_t B[L][H][3];
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++) {
            B[l][h][0] = 64;
            B[l][h][1] = 1;
            B[l][h][2] = 1;
        }
#define CHECK_ALL()                                                                       \
    do {                                                                                  \
        for (uint32_t l_ = 0; l_ < L; l_++)                                               \
            for (uint32_t h_ = 0; h_ < H; h_++)                                           \
                expect_budget(sel, l_, h_, B[l_][h_][0], B[l_][h_][1], B[l_][h_][2]);     \
    } while (0)
#define SET(l, h, k, s, lc)                                                               \
    do {                                                                                  \
        TU_OK(kvt_selector_budget_set(sel, l, h, k, s, lc));                              \
        for (uint32_t l_ = 0; l_ < L; l_++)                                               \
            for (uint32_t h_ = 0; h_ < H; h_++)                                           \
                if (((l) == KVT_ALL || (l) == l_) && ((h) == KVT_ALL || (h) == h_)) {     \
                    B[l_][h_][0] = k;                                                     \
                    B[l_][h_][1] = s;                                                     \
                    B[l_][h_][2] = lc;                                                    \
                }                                                                         \
        CHECK_ALL();                                                                      \
    } while (0)
    CHECK_ALL();
    SET(1, 2, 10, 2, 3);
    SET(KVT_ALL, 1, 7, 0, 0);
    SET(2, KVT_ALL, 0, 5, 6);
    SET(0, 3, KVT_SELECT_MAX_PAGES, KVT_SELECT_MAX_PAGES, KVT_SELECT_MAX_PAGES);
    SET(1, 2, 33, 1, 2);
    /* Outputs may be NULL. */
    uint32_t one = 0;
    TU_OK(kvt_selector_budget_get(sel, 1, 2, NULL, &one, NULL));
    assert_int_equal(one, 1);
    TU_OK(kvt_selector_budget_get(sel, 1, 2, NULL, NULL, NULL));

    /* Refused values change nothing, even with KVT_ALL. */
    const uint32_t big = KVT_SELECT_MAX_PAGES + 1;
    TU_EXPECT_ERR(kvt_selector_budget_set(sel, KVT_ALL, KVT_ALL, big, 1, 1), KVT_ERANGE,
                  "top_k_pages");
    TU_EXPECT_ERR(kvt_selector_budget_set(sel, KVT_ALL, KVT_ALL, 1, big, 1), KVT_ERANGE,
                  "sink_pages");
    TU_EXPECT_ERR(kvt_selector_budget_set(sel, 0, 0, 1, 1, UINT32_MAX), KVT_ERANGE,
                  "local_pages");
    TU_EXPECT_ERR(kvt_selector_budget_set(sel, L, 0, 1, 1, 1), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_selector_budget_set(sel, 0, H, 1, 1, 1), KVT_EINVAL, "kv_head");
    TU_EXPECT_ERR(kvt_selector_budget_set(sel, L, KVT_ALL, 1, 1, 1), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_selector_budget_set(NULL, 0, 0, 1, 1, 1), KVT_EINVAL, "sel");
    CHECK_ALL();
    uint32_t x;
    TU_EXPECT_ERR(kvt_selector_budget_get(sel, L, 0, &x, NULL, NULL), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_selector_budget_get(sel, 0, H, &x, NULL, NULL), KVT_EINVAL, "kv_head");
    TU_EXPECT_ERR(kvt_selector_budget_get(NULL, 0, 0, &x, NULL, NULL), KVT_EINVAL, "sel");

    /* Rerank intervals: accepted per head and for KVT_ALL; budgets untouched. */
    TU_OK(kvt_selector_rerank_interval_set(sel, KVT_ALL, KVT_ALL, 16));
    TU_OK(kvt_selector_rerank_interval_set(sel, 1, 3, 4));
    TU_OK(kvt_selector_rerank_interval_set(sel, KVT_ALL, 0, 1));
    TU_OK(kvt_selector_rerank_interval_set(sel, 2, KVT_ALL, 2));
    TU_EXPECT_ERR(kvt_selector_rerank_interval_set(sel, L, 0, 4), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_selector_rerank_interval_set(sel, 0, H, 4), KVT_EINVAL, "kv_head");
    TU_EXPECT_ERR(kvt_selector_rerank_interval_set(NULL, 0, 0, 4), KVT_EINVAL, "sel");
    /* Interval 0 has no meaning ("steps apart"); it must be refused. */
    kvt_clear_error();
    assert_true(kvt_selector_rerank_interval_set(sel, 0, 0, 0) < 0);
    assert_non_null(strstr(kvt_last_error(), "interval"));
    CHECK_ALL();
#undef SET
#undef CHECK_ALL
    kvt_selector_destroy(sel);
    kvt_selector_destroy(NULL);

    /* Budgets given at creation apply to every (layer, head). */
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.top_k_pages = 9;
    so.sink_pages = 0;
    so.local_pages = 4;
    TU_OK(kvt_selector_create(&g, &so, &sel));
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++)
            expect_budget(sel, l, h, 9, 0, 4);
    kvt_selector_destroy(sel);

    /* opts_init writes the documented defaults, equal to the macro. */
    kvt_selector_opts a, b = KVT_SELECTOR_OPTS_INIT;
    memset(&a, 0xff, sizeof a);
    TU_OK(kvt_selector_opts_init(&a));
    assert_int_equal(a.struct_size, sizeof a);
    assert_int_equal(a.method, KVT_SCORE_MINMAX);
    assert_int_equal(a.vote, KVT_VOTE_SUM);
    assert_int_equal(a.top_k_pages, 64);
    assert_int_equal(a.sink_pages, 1);
    assert_int_equal(a.local_pages, 1);
    assert_int_equal(a.rerank_interval, 1);
    assert_true(a.vote_scale == 0.0f);
    assert_memory_equal(&a, &b, sizeof a);
    TU_EXPECT_ERR(kvt_selector_opts_init(NULL), KVT_EINVAL, "opts");
}

/* ---- bad input ------------------------------------------------------------------ */

static void test_select_bad(void **state)
{
    (void)state;
    enum { L = 2, H = 2, G = 2, D = 64, P = 16, T = 100 };
    kvt_pool_opts o = tu_opts(L, H, H * G, D, P, KVT_DTYPE_F16, 64, 0);
    kvt_pool *p;
    kvt_seq_id seq, gone;
    TU_OK(kvt_pool_create(&o, &p));
    TU_OK(kvt_seq_create(p, NULL, &seq));
    TU_OK(kvt_seq_create(p, NULL, &gone));
    tu_rng r = {99};
    for (uint32_t l = 0; l < L; l++) {
        fill_random(p, seq, l, T, H, D, &r, 1.0);
        fill_random(p, gone, l, 20, H, D, &r, 1.0);
    }
    TU_OK(kvt_seq_release(p, gone));
    kvt_stats before = {.struct_size = sizeof before}, after = {.struct_size = sizeof after};
    TU_OK(kvt_pool_stats_get(p, &before));
    uint16_t kv_before[T * D], kv_after[T * D];
    TU_OK(kvt_seq_read_kv(p, seq, 1, 1, 0, T, kv_before, NULL));

    kvt_geometry g = geom_of(L, H, H * G, D, P, KVT_DTYPE_F16);
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, NULL, &sel));
    float q[G * D];
    for (int i = 0; i < G * D; i++)
        q[i] = tu_unit(&r);
    uint32_t pages[16], n_sel;
    float sc[16];
    TU_EXPECT_ERR(kvt_selector_select(NULL, p, seq, 0, 0, q, pages, 16, &n_sel, sc), KVT_EINVAL, "sel");
    TU_EXPECT_ERR(kvt_selector_select(sel, NULL, seq, 0, 0, q, pages, 16, &n_sel, sc), KVT_EINVAL,
                  "pool");
    TU_EXPECT_ERR(kvt_selector_select(sel, p, seq, 0, 0, NULL, pages, 16, &n_sel, sc), KVT_EINVAL,
                  "queries");
    TU_EXPECT_ERR(kvt_selector_select(sel, p, seq, 0, 0, q, NULL, 16, &n_sel, sc), KVT_EINVAL, "pages");
    TU_EXPECT_ERR(kvt_selector_select(sel, p, seq, 0, 0, q, pages, 16, NULL, sc), KVT_EINVAL,
                  "n_selected");
    TU_EXPECT_ERR(kvt_selector_select(sel, p, seq, L, 0, q, pages, 16, &n_sel, sc), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_selector_select(sel, p, seq, 0, H, q, pages, 16, &n_sel, sc), KVT_EINVAL,
                  "kv_head");
    TU_EXPECT_ERR(kvt_selector_select(sel, p, gone, 0, 0, q, pages, 16, &n_sel, sc), KVT_ENOENT, "seq");
    TU_EXPECT_ERR(kvt_selector_select(sel, p, KVT_SEQ_NONE, 0, 0, q, pages, 16, &n_sel, sc), KVT_ENOENT,
                  "seq");
    /* 7 pages, default budget: all 7 selected; capacity 6 is too small and
     * the message says how many are needed. */
    TU_EXPECT_ERR(kvt_selector_select(sel, p, seq, 0, 0, q, pages, 6, &n_sel, sc), KVT_ERANGE,
                  "capacity");
    assert_non_null(strstr(kvt_last_error(), "7"));
    TU_OK(kvt_selector_select(sel, p, seq, 0, 0, q, pages, 7, &n_sel, sc));
    assert_int_equal(n_sel, 7);

    /* A selector of another geometry: every field that must match. */
    struct {
        kvt_geometry g;
        const char *field;
    } mm[] = {
        {geom_of(L + 1, H, H * G, D, P, KVT_DTYPE_F16), "n_layers"},
        {geom_of(L, H * 2, H * G, D, P, KVT_DTYPE_F16), "n_kv_heads"},
        {geom_of(L, H, H, D, P, KVT_DTYPE_F16), "n_q_heads"},
        {geom_of(L, H, H * G, D * 2, P, KVT_DTYPE_F16), "head_dim"},
        {geom_of(L, H, H * G, D, P * 2, KVT_DTYPE_F16), "page_tokens"},
    };
    for (size_t i = 0; i < sizeof mm / sizeof mm[0]; i++) {
        kvt_selector *other;
        TU_OK(kvt_selector_create(&mm[i].g, NULL, &other));
        TU_EXPECT_ERR(kvt_selector_select(other, p, seq, 0, 0, q, pages, 16, &n_sel, sc), KVT_EINVAL,
                      mm[i].field);
        kvt_selector_destroy(other);
    }
    /* The storage dtype is not part of what must match, and defaults of the
     * geometry (n_q_heads 0, page_tokens 0) are resolved before comparing. */
    {
        kvt_geometry g2 = geom_of(L, H, H * G, D, P, KVT_DTYPE_F32);
        kvt_selector *other;
        TU_OK(kvt_selector_create(&g2, NULL, &other));
        TU_OK(kvt_selector_select(other, p, seq, 0, 0, q, pages, 16, &n_sel, sc));
        kvt_selector_destroy(other);
        kvt_pool_opts o2 = tu_opts(1, 2, 0, 64, 0, KVT_DTYPE_DEFAULT, 16, 0);
        o2.device_bytes = 16ull * 2 * 16 * 64 * 2;
        kvt_pool *p2;
        kvt_seq_id s2;
        TU_OK(kvt_pool_create(&o2, &p2));
        TU_OK(kvt_seq_create(p2, NULL, &s2));
        fill_random(p2, s2, 0, 40, 2, 64, &r, 1.0);
        kvt_geometry g3 = geom_of(1, 2, 2, 64, 16, KVT_DTYPE_F16);
        TU_OK(kvt_selector_create(&g3, NULL, &other));
        TU_OK(kvt_selector_select(other, p2, s2, 0, 1, q, pages, 16, &n_sel, sc));
        assert_int_equal(n_sel, 3);
        kvt_selector_destroy(other);
        kvt_geometry g4 = geom_of(1, 2, 0, 64, 0, KVT_DTYPE_DEFAULT);
        TU_OK(kvt_selector_create(&g4, NULL, &other));
        TU_OK(kvt_selector_select(other, p2, s2, 0, 1, q, pages, 16, &n_sel, sc));
        assert_int_equal(n_sel, 3);
        kvt_selector_destroy(other);
        kvt_pool_destroy(p2);
    }

    /* kvt_selector_create's own checks. */
    kvt_selector *bad = NULL;
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_selector_create(NULL, &so, &bad), KVT_EINVAL, "geom");
    kvt_geometry gbad = g;
    gbad.head_dim = 12;
    TU_EXPECT_ERR(kvt_selector_create(&gbad, &so, &bad), KVT_EINVAL, "head_dim");
    so.method = 4;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_EINVAL, "method");
    so = (kvt_selector_opts)KVT_SELECTOR_OPTS_INIT;
    so.rerank_similarity = NAN;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_EINVAL, "opts->rerank_similarity: nan");
    so.rerank_similarity = -1.01f;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_EINVAL, "opts->rerank_similarity: -1.01");
    so.rerank_similarity = 1.01f;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_EINVAL, "opts->rerank_similarity: 1.01");
    so.rerank_similarity = 0.5f;
    so.reserved = 1;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_EINVAL, "opts->reserved");
    so = (kvt_selector_opts)KVT_SELECTOR_OPTS_INIT;
    so.vote = 3;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_EINVAL, "vote");
    so = (kvt_selector_opts)KVT_SELECTOR_OPTS_INIT;
    so.struct_size = 4;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_EINVAL, "struct_size");
    so = (kvt_selector_opts)KVT_SELECTOR_OPTS_INIT;
    so.top_k_pages = KVT_SELECT_MAX_PAGES + 1;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_ERANGE, "top_k_pages");
    so = (kvt_selector_opts)KVT_SELECTOR_OPTS_INIT;
    so.sink_pages = KVT_SELECT_MAX_PAGES + 1;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_ERANGE, "sink_pages");
    so = (kvt_selector_opts)KVT_SELECTOR_OPTS_INIT;
    so.local_pages = KVT_SELECT_MAX_PAGES + 1;
    TU_EXPECT_ERR(kvt_selector_create(&g, &so, &bad), KVT_ERANGE, "local_pages");
    /* A larger struct with a zero tail is fine (a newer caller, nothing asked). */
    struct {
        kvt_selector_opts o;
        uint8_t tail[16];
    } big;
    memset(&big, 0, sizeof big);
    TU_OK(kvt_selector_opts_init(&big.o));
    big.o.struct_size = sizeof big;
    TU_OK(kvt_selector_create(&g, &big.o, &bad));
    kvt_selector_destroy(bad);
    big.tail[3] = 1;
    TU_EXPECT_ERR(kvt_selector_create(&g, &big.o, &bad), KVT_EINVAL, "struct_size");

    /* Nothing changed in the pool. */
    TU_OK(kvt_pool_stats_get(p, &after));
    assert_memory_equal(&before, &after, sizeof before);
    TU_OK(kvt_seq_read_kv(p, seq, 1, 1, 0, T, kv_after, NULL));
    assert_memory_equal(kv_before, kv_after, sizeof kv_before);
    TU_CHECK(p);
    kvt_selector_destroy(sel);
    kvt_pool_destroy(p);
}

/* An empty layer selects nothing; a selector serves several pools. */
static void test_empty_and_shared(void **state)
{
    (void)state;
    enum { D = 64, P = 8 };
    kvt_geometry g = geom_of(2, 1, 1, D, P, KVT_DTYPE_BF16);
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, NULL, &sel));
    tu_rng r = {4242};
    float q[D];
    for (int d = 0; d < D; d++)
        q[d] = tu_unit(&r);
    kvt_pool *pools[2];
    kvt_seq_id seqs[2];
    for (int i = 0; i < 2; i++) {
        kvt_pool_opts o = tu_opts(2, 1, 1, D, P, KVT_DTYPE_BF16, 64, 0);
        TU_OK(kvt_pool_create(&o, &pools[i]));
        TU_OK(kvt_seq_create(pools[i], NULL, &seqs[i]));
        fill_random(pools[i], seqs[i], 0, 50 + 30 * i, 1, D, &r, 1.0);
    }
    for (int i = 0; i < 2; i++) {
        uint32_t pages[16], n_sel = 99, want[16];
        float sc[16];
        for (int j = 0; j < 16; j++)
            sc[j] = 42.0f;
        TU_OK(kvt_selector_select(sel, pools[i], seqs[i], 1, 0, q, pages, 16, &n_sel, sc));
        assert_int_equal(n_sel, 0);
        for (int j = 0; j < 16; j++) /* scores are not written for an empty layer */
            assert_true(sc[j] == 42.0f);
        /* Capacity 0 is enough for an empty layer. */
        TU_OK(kvt_selector_select(sel, pools[i], seqs[i], 1, 0, q, pages, 0, &n_sel, NULL));
        assert_int_equal(n_sel, 0);
        TU_OK(kvt_selector_select(sel, pools[i], seqs[i], 0, 0, q, pages, 16, &n_sel, sc));
        uint32_t nw = brute_select(sc, 50 + 30 * i, P, 64, 1, 1, want);
        expect_pages(pages, n_sel, want, nw, "shared selector");
    }
    for (int i = 0; i < 2; i++)
        kvt_pool_destroy(pools[i]);
    kvt_selector_destroy(sel);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_shapes),
        cmocka_unit_test(test_ties),
        cmocka_unit_test(test_nan_scores),
        cmocka_unit_test(test_needle),
        cmocka_unit_test(test_budgets),
        cmocka_unit_test(test_select_bad),
        cmocka_unit_test(test_empty_and_shared),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
