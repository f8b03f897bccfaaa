/* Sparse and dense flash-decode through a step (kvt_step_select,
 * kvt_step_decode, kvt_step_attend) against a double-precision reference:
 * softmax attention over the tokens of the selected pages, computed from
 * the stored K/V read back with kvt_seq_read_kv. Random shapes on every
 * SIMD path the CPU has, several sequences of different lengths (empty
 * ones too), thread-count independence (bit-identical), and a budget that
 * covers every page giving the dense result. */
#include "testutil.h"

enum { MAXS = 5, MAXL = 3 };

typedef struct {
    uint32_t L, H, G, D, P;
    kvt_dtype dt;
    uint32_t n_threads;
    uint32_t n_seqs;
    uint32_t len[MAXS][MAXL]; /* tokens of sequence i in layer l */
} dcfg;

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

/* A pool holding the configuration's sequences, filled from `seed` (the
 * same seed gives the same contents in any pool of the same shape). */
static kvt_pool *make_pool(const dcfg *c, uint64_t seed, kvt_seq_id *ids)
{
    uint64_t blocks = 4;
    for (uint32_t i = 0; i < c->n_seqs; i++)
        for (uint32_t l = 0; l < c->L; l++)
            blocks += (uint64_t)(pages_of(c->len[i][l], c->P) + 1) * c->H;
    kvt_pool_opts o = tu_opts(c->L, c->H, c->H * c->G, c->D, c->P, c->dt, blocks, 0);
    o.n_threads = c->n_threads;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {seed * 0x9e3779b97f4a7c15ull + 1};
    for (uint32_t i = 0; i < c->n_seqs; i++) {
        TU_OK(kvt_seq_create(p, NULL, &ids[i]));
        for (uint32_t l = 0; l < c->L; l++) {
            const uint32_t T = c->len[i][l];
            if (T == 0)
                continue;
            size_t n = (size_t)T * c->H * c->D;
            float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
            for (size_t e = 0; e < n; e++) {
                k[e] = 2.0f * tu_unit(&r);
                v[e] = tu_unit(&r);
            }
            TU_OK(kvt_seq_append(p, ids[i], l, k, v, T, KVT_DTYPE_F32, 0));
            free(k);
            free(v);
        }
    }
    TU_CHECK(p);
    return p;
}

/* Reference attention of the G query rows q[G][D] of one KV head over the
 * tokens of `pages` (np of them), from the stored K/V, in double. */
static void ref_attn(const kvt_pool *p, kvt_seq_id seq, uint32_t layer, uint32_t kvh,
                     const dcfg *c, uint32_t T, const uint32_t *pages, uint32_t np,
                     const float *q, double scale, double *out, double *lse, double *kappa,
                     double *vmax)
{
    const uint32_t D = c->D, P = c->P, G = c->G;
    const size_t es = kvt_dtype_size(c->dt);
    uint8_t *kb = malloc((size_t)P * D * es), *vb = malloc((size_t)P * D * es);
    double *kd = malloc((size_t)np * P * D * sizeof *kd);
    double *vd = malloc((size_t)np * P * D * sizeof *vd);
    uint32_t n = 0;
    for (uint32_t j = 0; j < np; j++) {
        const uint32_t t0 = pages[j] * P, cnt = T - t0 < P ? T - t0 : P;
        assert_true(pages[j] * P < T);
        TU_OK(kvt_seq_read_kv(p, seq, layer, kvh, t0, cnt, kb, vb));
        for (size_t e = 0; e < (size_t)cnt * D; e++) {
            kd[(size_t)n * D + e] = elem_value(kb, c->dt, e);
            vd[(size_t)n * D + e] = elem_value(vb, c->dt, e);
        }
        n += cnt;
    }
    tu_ref_attention(q, G, D, kd, vd, n, scale, out, lse, kappa, vmax);
    free(kb);
    free(vb);
    free(kd);
    free(vd);
}

/* Compares the library's rows out[G][D] / lse[G] with the reference.
 * Tolerance: `tol` relative to the largest output element, plus what f32
 * arithmetic allows: a score scale * q.k has an error of about
 * 2^-24 * sqrt(D) * kappa (kappa = scale * max_t sum_d |q_d k_td|), which
 * moves the softmax weights by that relative amount, hence the output by
 * that times max |v| (constants generous). */
static void check_rows(const float *out, const float *lse, const double *ref,
                       const double *ref_lse, const double *kappa, double vmax, uint32_t G,
                       uint32_t D, double tol, const char *what)
{
    for (uint32_t g = 0; g < G; g++) {
        const float *o = out + (size_t)g * D;
        const double *rf = ref + (size_t)g * D;
        if (isinf(ref_lse[g])) { /* nothing to attend: zeros, lse -inf */
            for (uint32_t d = 0; d < D; d++)
                if (o[d] != 0.0f)
                    fail_msg("%s head %u: empty layer, out[%u] = %g, expected 0", what, g, d,
                             (double)o[d]);
            if (lse && !(isinf(lse[g]) && lse[g] < 0))
                fail_msg("%s head %u: empty layer, lse %g, expected -inf", what, g,
                         (double)lse[g]);
            continue;
        }
        double err = 0, norm = 0;
        for (uint32_t d = 0; d < D; d++) {
            double e = fabs((double)o[d] - rf[d]);
            if (!(e <= err)) /* NaN propagates */
                err = e;
            norm = fabs(rf[d]) > norm ? fabs(rf[d]) : norm;
        }
        const double serr = 8.0 * 0x1p-24 * sqrt((double)D) * kappa[g];
        const double otol = tol * (norm > 1e-2 ? norm : 1e-2) + serr * vmax;
        if (!(err <= otol))
            fail_msg("%s head %u: max |out - ref| %.3g over max |ref| %.3g (tolerance %.3g)",
                     what, g, err, norm, otol);
        if (lse && !(fabs((double)lse[g] - ref_lse[g]) <= 1e-5 * (1 + fabs(ref_lse[g])) + serr))
            fail_msg("%s head %u: lse %.9g, reference %.9g", what, g, (double)lse[g],
                     ref_lse[g]);
    }
}

/* ---- reference page scores (for the validity of sparse selections) -------- */
static void ref_vote(const kvt_pool *p, kvt_seq_id seq, uint32_t layer, uint32_t kvh,
                     const dcfg *c, uint32_t np, const float *q, kvt_score_method method,
                     kvt_vote vote, double *ref, double *tol)
{
    const uint32_t D = c->D, G = c->G;
    float *mn = malloc(D * sizeof *mn), *mx = malloc(D * sizeof *mx),
          *me = malloc(D * sizeof *me);
    double *raw = malloc((size_t)G * np * sizeof *raw), *mag = malloc((size_t)G * np * sizeof *mag);
    for (uint32_t pg = 0; pg < np; pg++) {
        TU_OK(kvt_seq_page_meta_get(p, seq, layer, kvh, pg, mn, mx, me));
        for (uint32_t g = 0; g < G; g++) {
            double s = 0, m = 0;
            for (uint32_t d = 0; d < D; d++) {
                double qd = q[(size_t)g * D + d], t;
                if (method == KVT_SCORE_MINMAX)
                    t = qd * mn[d] > qd * mx[d] ? qd * mn[d] : qd * mx[d];
                else
                    t = qd * me[d];
                s += t;
                m += fabs(t);
            }
            raw[(size_t)g * np + pg] = s;
            mag[(size_t)g * np + pg] = m;
        }
    }
    const double vs = 1.0 / sqrt((double)D);
    for (uint32_t pg = 0; pg < np; pg++) {
        ref[pg] = vote == KVT_VOTE_MAX ? -INFINITY : 0;
        tol[pg] = 0;
    }
    for (uint32_t g = 0; g < G; g++) {
        const double *rg = raw + (size_t)g * np, *mg = mag + (size_t)g * np;
        if (vote == KVT_VOTE_SOFTVOTE) {
            double m = -INFINITY, z = 0;
            for (uint32_t pg = 0; pg < np; pg++)
                m = vs * rg[pg] > m ? vs * rg[pg] : m;
            for (uint32_t pg = 0; pg < np; pg++)
                z += exp(vs * rg[pg] - m);
            for (uint32_t pg = 0; pg < np; pg++) {
                double w = exp(vs * rg[pg] - m) / z;
                ref[pg] += w;
                tol[pg] += 1e-4 * w + 1e-7;
            }
        } else {
            for (uint32_t pg = 0; pg < np; pg++) {
                if (vote == KVT_VOTE_SUM)
                    ref[pg] += rg[pg];
                else
                    ref[pg] = rg[pg] > ref[pg] ? rg[pg] : ref[pg];
                tol[pg] += 1e-4 * fabs(rg[pg]) + 1e-5 * mg[pg];
            }
        }
    }
    free(mn);
    free(mx);
    free(me);
    free(raw);
    free(mag);
}


/* ---- one step over a configuration ------------------------------------------ */

typedef struct {
    int sparse;
    kvt_score_method method;
    kvt_vote vote;
    float scale; /* 0 = default */
    uint32_t K[MAXL], sink[MAXL], local[MAXL]; /* per layer, every head */
} dmode;

static kvt_selector *make_selector(const dcfg *c, const dmode *m)
{
    kvt_geometry g = {c->L, c->H, c->H * c->G, c->D, c->P, c->dt, {0, 0}};
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.method = m->method;
    so.vote = m->vote;
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, &so, &sel));
    for (uint32_t l = 0; l < c->L; l++)
        TU_OK(kvt_selector_budget_set(sel, l, KVT_ALL, m->K[l], m->sink[l], m->local[l]));
    return sel;
}

/* Runs one step over every layer of pool (whose sequences are ids) and
 * checks each layer against the reference. outs/lses, when not NULL,
 * receive [L][n][Hq][D] and [L][n][Hq]. */
static void run_and_check(kvt_pool *p, const kvt_seq_id *ids, const dcfg *c, const dmode *m,
                          const float *qs, float *outs, float *lses, const char *tag)
{
    const uint32_t Hq = c->H * c->G, n = c->n_seqs;
    const size_t qn = (size_t)n * Hq * c->D;
    kvt_selector *sel = m->sparse ? make_selector(c, m) : NULL;
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = m->sparse ? 0 : KVT_STEP_DENSE;
    so.selector = sel;
    so.scale = m->scale;
    const double scale = m->scale > 0 ? (double)m->scale : 1.0 / sqrt((double)c->D);
    kvt_step *st;
    TU_OK(kvt_step_plan(p, ids, n, &so, &st));
    float *out = malloc(qn * sizeof *out), *lse = malloc((size_t)n * Hq * sizeof *lse);
    float *out2 = malloc(qn * sizeof *out2);
    uint32_t maxp = 1;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t l = 0; l < c->L; l++)
            maxp = pages_of(c->len[i][l], c->P) > maxp ? pages_of(c->len[i][l], c->P) : maxp;
    uint32_t *pg = malloc(maxp * sizeof *pg);
    double *ref = malloc((size_t)c->G * c->D * sizeof *ref), *rl = malloc(c->G * sizeof *rl);
    double *kap = malloc(c->G * sizeof *kap), vmax;
    double *sc = malloc(maxp * sizeof *sc), *tl = malloc(maxp * sizeof *tl);
    for (uint32_t l = 0; l < c->L; l++) {
        const float *q = qs + (size_t)l * qn;
        for (size_t e = 0; e < qn; e++)
            out[e] = NAN;
        for (size_t e = 0; e < (size_t)n * Hq; e++)
            lse[e] = NAN;
        if (l % 2 == 0) {
            TU_OK(kvt_step_attend(st, l, q, out, lse));
        } else {
            TU_OK(kvt_step_select(st, l, q));
            TU_OK(kvt_step_decode(st, l, q, out, lse));
        }
        /* lse is optional and changes nothing else. */
        TU_OK(kvt_step_decode(st, l, q, out2, NULL));
        assert_memory_equal(out, out2, qn * sizeof *out);
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t h = 0; h < c->H; h++) {
                const uint32_t T = c->len[i][l], np = pages_of(T, c->P);
                uint32_t cnt = 0xffff, rr = 7;
                TU_OK(kvt_step_selection_get(st, l, i, h, pg, maxp, &cnt, &rr));
                char what[200];
                snprintf(what, sizeof what,
                         "%s: %s dt %u P %u D %u G %u H %u thr %u seq %u (T %u) layer %u "
                         "kv head %u",
                         tag, m->sparse ? "sparse" : "dense", c->dt, c->P, c->D, c->G, c->H,
                         c->n_threads, i, T, l, h);
                const float *qg = q + ((size_t)i * Hq + (size_t)h * c->G) * c->D;
                if (!m->sparse) {
                    assert_int_equal(cnt, np);
                    for (uint32_t j = 0; j < cnt; j++)
                        assert_int_equal(pg[j], j);
                } else {
                    assert_int_equal(rr, np ? 1 : rr); /* interval 1: every head rescored */
                    ref_vote(p, ids[i], l, h, c, np, qg, m->method, m->vote, sc, tl);
                    tu_check_selection(pg, cnt, T, c->P, m->K[l], m->sink[l], m->local[l], sc, tl,
                                    what);
                }
                ref_attn(p, ids[i], l, h, c, T, pg, cnt, qg, scale, ref, rl, kap, &vmax);
                const size_t o = ((size_t)i * Hq + (size_t)h * c->G);
                check_rows(out + o * c->D, lse + o, ref, rl, kap, vmax, c->G, c->D, 1e-4, what);
            }
        if (outs)
            memcpy(outs + (size_t)l * qn, out, qn * sizeof *out);
        if (lses)
            memcpy(lses + (size_t)l * n * Hq, lse, (size_t)n * Hq * sizeof *lse);
    }
    TU_OK(kvt_step_finish(st));
    TU_CHECK(p);
    /* The step appended nothing: every length is as before. */
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t l = 0; l < c->L; l++) {
            uint32_t t;
            TU_OK(kvt_seq_length_get(p, ids[i], l, &t));
            assert_int_equal(t, c->len[i][l]);
        }
    free(out);
    free(out2);
    free(lse);
    free(pg);
    free(ref);
    free(rl);
    free(kap);
    free(sc);
    free(tl);
    kvt_selector_destroy(sel);
}

static float *make_queries(const dcfg *c, tu_rng *r)
{
    size_t n = (size_t)c->L * c->n_seqs * c->H * c->G * c->D;
    float *q = malloc(n * sizeof *q);
    for (size_t e = 0; e < n; e++)
        q[e] = 2.0f * tu_unit(r);
    return q;
}

static void random_cfg(dcfg *c, tu_rng *r, int with_empty)
{
    static const uint32_t dims[] = {64, 80, 96, 128, 256};
    memset(c, 0, sizeof *c);
    c->P = 8u << tu_below(r, 5);
    c->D = dims[tu_below(r, 5)];
    c->G = 1 + tu_below(r, 8);
    c->H = 1 + tu_below(r, 2);
    c->L = 1 + tu_below(r, MAXL);
    c->dt = 1 + tu_below(r, 3);
    c->n_threads = 1 + tu_below(r, 4);
    c->n_seqs = 1 + tu_below(r, MAXS - 1);
    /* Keep the reference's work (tokens x D x query heads) modest. */
    const uint32_t budget = 2400000u / (c->D * c->G * c->H * c->L * c->n_seqs) + 1;
    for (uint32_t i = 0; i < c->n_seqs; i++) {
        uint32_t T = 1 + tu_below(r, budget < 12 * c->P ? budget : 12 * c->P);
        if (tu_below(r, 3) == 0)
            T = pages_of(T, c->P) * c->P; /* a full last page */
        for (uint32_t l = 0; l < c->L; l++) {
            c->len[i][l] = T;
            if (l > 0 && tu_below(r, 4) == 0) /* a layer of another length */
                c->len[i][l] = tu_below(r, T + 1);
        }
    }
    if (with_empty) { /* a new sequence (no tokens in any layer) */
        c->len[c->n_seqs][0] = 0;
        for (uint32_t l = 0; l < c->L; l++)
            c->len[c->n_seqs][l] = 0;
        c->n_seqs++;
    }
}

static void random_mode(dmode *m, const dcfg *c, tu_rng *r, int sparse)
{
    memset(m, 0, sizeof *m);
    m->sparse = sparse;
    m->method = tu_below(r, 2);
    m->vote = tu_below(r, 3);
    m->scale = tu_below(r, 2) ? 0.0f : (float)(0.05 + 0.1 * (tu_unit(r) + 1));
    uint32_t maxp = 1;
    for (uint32_t i = 0; i < c->n_seqs; i++)
        for (uint32_t l = 0; l < c->L; l++)
            maxp = pages_of(c->len[i][l], c->P) > maxp ? pages_of(c->len[i][l], c->P) : maxp;
    for (uint32_t l = 0; l < c->L; l++) {
        m->K[l] = tu_below(r, maxp / 2 + 3);
        m->sink[l] = tu_below(r, 3);
        m->local[l] = tu_below(r, 3);
    }
}

/* Sets KVTIER_SIMD and creates the pool; returns NULL (and says so) when
 * the CPU lacks the instruction set, so that path is skipped. */
static kvt_pool *make_pool_isa(const dcfg *c, uint64_t seed, kvt_seq_id *ids, const char *isa)
{
    if (isa)
        setenv("KVTIER_SIMD", isa, 1);
    else
        unsetenv("KVTIER_SIMD");
    kvt_pool *p = make_pool(c, seed, ids);
    const char *got = NULL;
    TU_OK(kvt_pool_kernel_isa_get(p, &got));
    assert_non_null(got);
    if (isa && strcmp(got, isa) != 0) {
        print_message("kvtier: this CPU has no %s kernels (the pool uses %s): skipped\n", isa,
                      got);
        kvt_pool_destroy(p);
        return NULL;
    }
    return p;
}

static const char *const isas[] = {"portable", "avx2", "avx512"};

static void test_random_isas(void **state)
{
    (void)state;
    for (int ii = 0; ii < 3; ii++) {
        tu_rng r = {0xdec0deull + (uint64_t)ii};
        for (int trial = 0; trial < 10; trial++) {
            dcfg c;
            random_cfg(&c, &r, trial % 3 == 0);
            kvt_seq_id ids[MAXS];
            kvt_pool *p = make_pool_isa(&c, 1000u * ii + trial, ids, isas[ii]);
            if (!p)
                break;
            float *q = make_queries(&c, &r);
            dmode m;
            random_mode(&m, &c, &r, trial % 2);
            char tag[64];
            snprintf(tag, sizeof tag, "%s trial %d", isas[ii], trial);
            run_and_check(p, ids, &c, &m, q, NULL, NULL, tag);
            /* The same pool, the other mode. */
            random_mode(&m, &c, &r, !(trial % 2));
            run_and_check(p, ids, &c, &m, q, NULL, NULL, tag);
            free(q);
            kvt_pool_destroy(p);
        }
    }
    unsetenv("KVTIER_SIMD");
}

/* Every page size and head_dim on the default path, a long-ish sequence so
 * that a head's pages span several decode chunks. */
static void test_shapes_long(void **state)
{
    (void)state;
    static const uint32_t dims[] = {64, 80, 96, 128, 256};
    tu_rng r = {0x10f6ull};
    unsetenv("KVTIER_SIMD");
    for (uint32_t pi = 0; pi < 5; pi++) {
        dcfg c;
        memset(&c, 0, sizeof c);
        c.P = 8u << pi;
        c.D = dims[pi];
        c.G = pi + 1;
        c.H = 1;
        c.L = 1;
        c.dt = 1 + pi % 3;
        c.n_threads = 2;
        c.n_seqs = 2;
        /* 271 pages: three decode chunks of KVT__CHUNK_PAGES (128) */
        c.len[0][0] = 270 * c.P + 3;
        c.len[1][0] = 130 * c.P;
        if (c.len[0][0] * c.D * c.G > 12000000u) {
            c.len[0][0] = 12000000u / (c.D * c.G) + 1;
            c.len[1][0] = c.len[0][0] / 2;
        }
        kvt_seq_id ids[MAXS];
        kvt_pool *p = make_pool(&c, 77 + pi, ids);
        float *q = make_queries(&c, &r);
        dmode m;
        random_mode(&m, &c, &r, 0);
        run_and_check(p, ids, &c, &m, q, NULL, NULL, "long");
        random_mode(&m, &c, &r, 1);
        m.K[0] = 140; /* more than one chunk of selected pages */
        run_and_check(p, ids, &c, &m, q, NULL, NULL, "long");
        free(q);
        kvt_pool_destroy(p);
    }
}

/* Corners of the kernels' vector tiling on every path: head_dim below or
 * between vector widths (8, 24, 40), the largest page (256 tokens), and
 * query groups that are not a multiple of the kernels' head blocking. */
static void test_tiling_corners(void **state)
{
    (void)state;
    static const uint32_t dims[] = {8, 24, 40, 72};
    static const uint32_t groups[] = {12, 5, 3, 1};
    static const uint32_t ptoks[] = {256, 8, 32, 256};
    for (int ii = 0; ii < 3; ii++)
        for (int k = 0; k < 4; k++) {
            dcfg c;
            memset(&c, 0, sizeof c);
            c.D = dims[k];
            c.G = groups[k];
            c.P = ptoks[k];
            c.H = 2;
            c.L = 1;
            c.dt = 1 + (uint32_t)k % 3;
            c.n_threads = 2;
            c.n_seqs = 3;
            c.len[0][0] = 3 * c.P + 5;
            c.len[1][0] = c.P;
            c.len[2][0] = 1;
            kvt_seq_id ids[MAXS];
            kvt_pool *p = make_pool_isa(&c, 40 + k, ids, isas[ii]);
            if (!p)
                break;
            tu_rng r = {0xc0ull + (uint64_t)k};
            float *q = make_queries(&c, &r);
            dmode m;
            random_mode(&m, &c, &r, 0);
            run_and_check(p, ids, &c, &m, q, NULL, NULL, isas[ii]);
            random_mode(&m, &c, &r, 1);
            run_and_check(p, ids, &c, &m, q, NULL, NULL, isas[ii]);
            free(q);
            kvt_pool_destroy(p);
        }
    unsetenv("KVTIER_SIMD");
}

/* Same data, n_threads 1..4: bit-identical outputs and lse, dense and sparse,
 * on the default path and the portable one. */
static void test_thread_independence(void **state)
{
    (void)state;
    dcfg c;
    memset(&c, 0, sizeof c);
    c.L = 2;
    c.H = 2;
    c.G = 4;
    c.D = 128;
    c.P = 16;
    c.dt = KVT_DTYPE_F16;
    c.n_seqs = 4;
    const uint32_t lens[4] = {2300, 517, 0, 64}; /* 144 pages: two decode chunks */
    for (uint32_t i = 0; i < 4; i++)
        for (uint32_t l = 0; l < 2; l++)
            c.len[i][l] = lens[i] - (l && lens[i] ? 1 : 0);
    const size_t qn = (size_t)c.L * c.n_seqs * c.H * c.G * c.D;
    const size_t ln = (size_t)c.L * c.n_seqs * c.H * c.G;
    tu_rng r = {0x7777ull};
    float *q = make_queries(&c, &r);
    const char *paths[2] = {NULL, "portable"};
    for (int pi = 0; pi < 2; pi++)
        for (int sparse = 0; sparse < 2; sparse++) {
            dmode m;
            random_mode(&m, &c, &r, sparse);
            m.method = KVT_SCORE_MINMAX;
            m.vote = KVT_VOTE_SOFTVOTE;
            m.K[0] = 135; /* > one chunk (128 pages) */
            m.K[1] = 7;
            float *out0 = malloc(qn * sizeof *out0), *lse0 = malloc(ln * sizeof *lse0);
            float *out1 = malloc(qn * sizeof *out1), *lse1 = malloc(ln * sizeof *lse1);
            for (uint32_t thr = 1; thr <= 4; thr++) {
                c.n_threads = thr;
                kvt_seq_id ids[MAXS];
                kvt_pool *p = make_pool_isa(&c, 5, ids, paths[pi]);
                assert_non_null(p);
                run_and_check(p, ids, &c, &m, q, thr == 1 ? out0 : out1, thr == 1 ? lse0 : lse1,
                              "threads");
                if (thr > 1) {
                    if (memcmp(out0, out1, qn * sizeof *out0) != 0)
                        fail_msg("%s %s: outputs with %u threads differ from 1 thread",
                                 paths[pi] ? paths[pi] : "default", sparse ? "sparse" : "dense",
                                 thr);
                    if (memcmp(lse0, lse1, ln * sizeof *lse0) != 0)
                        fail_msg("%s %s: lse with %u threads differs from 1 thread",
                                 paths[pi] ? paths[pi] : "default", sparse ? "sparse" : "dense",
                                 thr);
                }
                kvt_pool_destroy(p);
            }
            free(out0);
            free(lse0);
            free(out1);
            free(lse1);
        }
    unsetenv("KVTIER_SIMD");
    free(q);
}

/* A budget that covers every page selects every page, and the result is
 * the dense one, bit for bit (same pages, same chunks, same kernel). */
static void test_full_budget_is_dense(void **state)
{
    (void)state;
    tu_rng r = {0xfb11ull};
    for (int trial = 0; trial < 4; trial++) {
        dcfg c;
        random_cfg(&c, &r, trial == 0);
        kvt_seq_id ids[MAXS];
        kvt_pool *p = make_pool(&c, 900 + trial, ids);
        float *q = make_queries(&c, &r);
        const size_t qn = (size_t)c.L * c.n_seqs * c.H * c.G * c.D;
        const size_t ln = (size_t)c.L * c.n_seqs * c.H * c.G;
        float *od = malloc(qn * sizeof *od), *ld = malloc(ln * sizeof *ld);
        float *os = malloc(qn * sizeof *os), *ls = malloc(ln * sizeof *ls);
        dmode m;
        random_mode(&m, &c, &r, 0);
        m.scale = 0;
        run_and_check(p, ids, &c, &m, q, od, ld, "full budget (dense)");
        m.sparse = 1;
        for (uint32_t l = 0; l < c.L; l++) {
            m.K[l] = trial == 1 ? KVT_SELECT_MAX_PAGES : 100000;
            m.sink[l] = tu_below(&r, 3);
            m.local[l] = tu_below(&r, 3);
        }
        run_and_check(p, ids, &c, &m, q, os, ls, "full budget (sparse)");
        assert_memory_equal(od, os, qn * sizeof *od);
        assert_memory_equal(ld, ls, ln * sizeof *ld);
        free(od);
        free(ld);
        free(os);
        free(ls);
        free(q);
        kvt_pool_destroy(p);
    }
}

/* Peaked attention: one key per head far above the rest must dominate the
 * output (a check of the softmax scaling that does not rely on small
 * differences), and a large scale must not overflow. */
static void test_peaked(void **state)
{
    (void)state;
    dcfg c;
    memset(&c, 0, sizeof c);
    c.L = 1;
    c.H = 1;
    c.G = 2;
    c.D = 64;
    c.P = 16;
    c.dt = KVT_DTYPE_BF16;
    c.n_threads = 1;
    c.n_seqs = 1;
    c.len[0][0] = 300;
    kvt_seq_id ids[1];
    kvt_pool *p = make_pool(&c, 31, ids);
    tu_rng r = {0x9ea4ull};
    float *q = make_queries(&c, &r);
    dmode m;
    random_mode(&m, &c, &r, 0);
    m.scale = 40.0f; /* scores of several hundred: exp would overflow unshifted */
    run_and_check(p, ids, &c, &m, q, NULL, NULL, "peaked");
    free(q);
    kvt_pool_destroy(p);
}

/* KVTIER_SIMD caps the choice; other values leave it to the CPU; a NULL
 * pool names "" and the argument. */
static void test_isa_env(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(1, 1, 1, 64, 16, KVT_DTYPE_F16, 8, 0);
    kvt_pool *p;
    unsetenv("KVTIER_SIMD");
    TU_OK(kvt_pool_create(&o, &p));
    char best[16];
    const char *isa0 = NULL;
    TU_OK(kvt_pool_kernel_isa_get(p, &isa0));
    snprintf(best, sizeof best, "%s", isa0);
    kvt_pool_destroy(p);
    assert_true(!strcmp(best, "portable") || !strcmp(best, "avx2") || !strcmp(best, "avx512"));
    const char *vals[] = {"", "bogus", "AVX2", "avx512", "portable", "avx2"};
    for (int i = 0; i < 6; i++) {
        setenv("KVTIER_SIMD", vals[i], 1);
        TU_OK(kvt_pool_create(&o, &p));
        const char *got = NULL;
        TU_OK(kvt_pool_kernel_isa_get(p, &got));
        if (i < 4) { /* no cap (or a cap at or above the best) */
            assert_string_equal(got, best);
        } else if (i == 4) {
            assert_string_equal(got, "portable");
        } else {
            assert_string_equal(got, strcmp(best, "portable") ? "avx2" : "portable");
        }
        kvt_pool_destroy(p);
    }
    unsetenv("KVTIER_SIMD");
    kvt_clear_error();
    const char *s = "untouched";
    TU_EXPECT_ERR(kvt_pool_kernel_isa_get(NULL, &s), KVT_EINVAL, "pool");
    assert_string_equal(s, "untouched");
    TU_OK(kvt_pool_create(&o, &p));
    TU_EXPECT_ERR(kvt_pool_kernel_isa_get(p, NULL), KVT_EINVAL, "isa");
    kvt_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_isas),
        cmocka_unit_test(test_shapes_long),
        cmocka_unit_test(test_tiling_corners),
        cmocka_unit_test(test_thread_independence),
        cmocka_unit_test(test_full_budget_is_dense),
        cmocka_unit_test(test_peaked),
        cmocka_unit_test(test_isa_env),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
