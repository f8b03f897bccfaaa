/* Steps of several tokens per sequence (kvt_step_opts.n_new): speculative
 * verification and chunked prefill, against independent references.
 *
 *   - every output row against a double-precision causal attention: row j
 *     of sequence i (token T - n_new + j) over the tokens of the pages the
 *     step selected (all of them when dense) at positions <= its own, K/V
 *     read back with kvt_seq_read_kv; random n_new per sequence in a batch,
 *     random geometry and dtype, dense and sparse, on the portable, AVX2
 *     and best kernels;
 *   - a sparse selection: every page holding a new token selected, and the
 *     top-K part against the SUM of MINMAX bounds over all n_new x G query
 *     rows recomputed in double from kvt_seq_page_meta_get;
 *   - chunked prefill (dense steps of 64 tokens) against whole-prompt
 *     causal attention, row for row;
 *   - a verify step of 5 tokens then kvt_seq_truncate of 3 against a step
 *     appending the 2 kept tokens: the stored K/V and page metadata byte for
 *     byte, and the next step's output bit for bit;
 *   - a tiered pool (host and disk tiers, its policy): multi-token sparse
 *     steps whose selections promote pages from host and disk, and a dense
 *     chunk that reads host pages in place, each against the reference;
 *   - bad input: n_new 0 or above max_new, n_rows not their sum, a chunk
 *     past max_tokens: KVT_EINVAL / KVT_ERANGE naming the field and the
 *     sequence index, nothing appended. */
#include "placetest.h"

static double elem_value(const void *buf, kvt_dtype dt, size_t i)
{
    if (dt == KVT_DTYPE_F32)
        return (double)((const float *)buf)[i];
    uint16_t h = ((const uint16_t *)buf)[i];
    return dt == KVT_DTYPE_F16 ? tu_f16_value(h) : tu_bf16_value(h);
}

typedef struct {
    kvt_pool *p;
    kvt_geometry g;
    uint32_t G;
} mpool;

static mpool mp_of(kvt_pool *p)
{
    mpool m = {p, {0}, 0};
    TU_OK(kvt_pool_geometry_get(p, &m.g));
    m.G = m.g.n_q_heads / m.g.n_kv_heads;
    return m;
}

/* Checks the rows of (seq, layer, kv head) of a step that appended nn
 * tokens: the first ncheck rows' G query heads (q, out, lse at row j of
 * the step's sequence, Hq heads apart) against double attention over the
 * tokens of pages[np] at positions <= T - nn + j. */
static void check_seq_rows(const mpool *m, kvt_seq_id seq, uint32_t layer, uint32_t kvh,
                           uint32_t nn, uint32_t ncheck, const uint32_t *pages, uint32_t np,
                           const float *q, const float *out, const float *lse, double scale,
                           const char *tag)
{
    const uint32_t D = m->g.head_dim, P = m->g.page_tokens, G = m->G, Hq = m->g.n_q_heads;
    const size_t es = kvt_dtype_size(m->g.dtype);
    uint32_t T;
    TU_OK(kvt_seq_length_get(m->p, seq, layer, &T));
    uint8_t *kb = malloc((size_t)P * D * es), *vb = malloc((size_t)P * D * es);
    double *kd = malloc(((size_t)np * P + 1) * D * sizeof *kd);
    double *vd = malloc(((size_t)np * P + 1) * D * sizeof *vd);
    uint32_t *tpos = malloc(((size_t)np * P + 1) * sizeof *tpos);
    uint32_t n = 0;
    for (uint32_t j = 0; j < np; j++) {
        const uint32_t t0 = pages[j] * P, cnt = T - t0 < P ? T - t0 : P;
        assert_true(t0 < T);
        TU_OK(kvt_seq_read_kv(m->p, seq, layer, kvh, t0, cnt, kb, vb));
        for (uint32_t t = 0; t < cnt; t++, n++) {
            tpos[n] = t0 + t;
            for (uint32_t d = 0; d < D; d++) {
                kd[(size_t)n * D + d] = elem_value(kb, m->g.dtype, (size_t)t * D + d);
                vd[(size_t)n * D + d] = elem_value(vb, m->g.dtype, (size_t)t * D + d);
            }
        }
    }
    double *ref = malloc((size_t)G * D * sizeof *ref), rl[64], kap[64], vmax;
    assert_true(G <= 64);
    for (uint32_t j = 0; j < ncheck; j++) {
        /* The tokens row j sees: a prefix of the gathered ones, which are in
         * increasing position order. */
        const uint32_t lim = T - nn + j + 1;
        uint32_t vis = 0;
        while (vis < n && tpos[vis] < lim)
            vis++;
        const size_t o = (size_t)j * Hq + (size_t)kvh * G;
        tu_ref_attention(q + o * D, G, D, kd, vd, vis, scale, ref, rl, kap, &vmax);
        for (uint32_t g = 0; g < G; g++) {
            const float *og = out + (o + g) * D;
            double err = 0, norm = 0;
            for (uint32_t d = 0; d < D; d++) {
                const double e = fabs((double)og[d] - ref[(size_t)g * D + d]);
                err = !(e <= err) ? e : err;
                norm = fabs(ref[(size_t)g * D + d]) > norm ? fabs(ref[(size_t)g * D + d]) : norm;
            }
            const double serr = 8.0 * 0x1p-24 * sqrt((double)D) * kap[g];
            const double tol = 1e-4 * (norm > 1e-2 ? norm : 1e-2) + serr * vmax;
            if (!(err <= tol))
                fail_msg("%s layer %u kv head %u row %u (of %u, T %u, %u visible) head %u: "
                         "max |out - ref| %.3g (tolerance %.3g)", tag, layer, kvh, j, nn, T,
                         vis, g, err, tol);
            if (vis == 0 ? !(isinf(lse[o + g]) && lse[o + g] < 0)
                         : !(fabs((double)lse[o + g] - rl[g]) <= 1e-5 * (1 + fabs(rl[g])) + serr))
                fail_msg("%s layer %u row %u head %u: lse %.9g, reference %.9g", tag, layer, j,
                         g, (double)lse[o + g], rl[g]);
        }
    }
    free(kb);
    free(vb);
    free(kd);
    free(vd);
    free(tpos);
    free(ref);
}

/* A sparse selection of a multi-token step: the pages of the new tokens
 * are in it, and the rest is the top K by the SUM over all nn x G query
 * rows of the MINMAX bounds (double, from the page metadata). */
static void check_selection(const mpool *m, kvt_seq_id seq, uint32_t layer, uint32_t kvh,
                            uint32_t nn, const uint32_t *sel, uint32_t cnt, uint32_t K,
                            uint32_t sink, uint32_t local, const float *q, const char *tag)
{
    const uint32_t D = m->g.head_dim, P = m->g.page_tokens, G = m->G, Hq = m->g.n_q_heads;
    uint32_t T;
    TU_OK(kvt_seq_length_get(m->p, seq, layer, &T));
    const uint32_t np = (T + P - 1) / P;
    const uint32_t first_new = (T - nn) / P;
    for (uint32_t pg = first_new; pg < np; pg++) {
        bool in = false;
        for (uint32_t j = 0; j < cnt; j++)
            in = in || sel[j] == pg;
        if (!in)
            fail_msg("%s layer %u kv head %u: page %u holds a new token and is not selected",
                     tag, layer, kvh, pg);
    }
    /* Forced span widened to the new tokens' pages, as the step does. */
    const uint32_t span = np - first_new, need = span - (T % P != 0);
    const uint32_t lloc = need > local ? need : local;
    float *mn = malloc(D * sizeof *mn), *mx = malloc(D * sizeof *mx), *me = malloc(D * sizeof *me);
    double *ref = calloc(np, sizeof *ref), *tol = calloc(np, sizeof *tol);
    for (uint32_t pg = 0; pg < np; pg++) {
        TU_OK(kvt_seq_page_meta_get(m->p, seq, layer, kvh, pg, mn, mx, me));
        for (uint32_t j = 0; j < nn; j++)
            for (uint32_t g = 0; g < G; g++) {
                const float *qg = q + ((size_t)j * Hq + (size_t)kvh * G + g) * D;
                double s = 0, a = 0;
                for (uint32_t d = 0; d < D; d++) {
                    const double qd = qg[d];
                    const double t = qd * mn[d] > qd * mx[d] ? qd * mn[d] : qd * mx[d];
                    s += t;
                    a += fabs(t);
                }
                ref[pg] += s;
                tol[pg] += 1e-4 * fabs(s) + 1e-5 * a;
            }
    }
    tu_check_selection(sel, cnt, T, P, K, sink, lloc, ref, tol, tag);
    free(mn);
    free(mx);
    free(me);
    free(ref);
    free(tol);
}

/* Random rows: k, v [rows][H][D] f32, q [rows][Hq][D]. */
static float *rand_rows(size_t n, float a, tu_rng *r)
{
    float *x = malloc((n ? n : 1) * sizeof *x);
    for (size_t e = 0; e < n; e++)
        x[e] = a * tu_unit(r);
    return x;
}

/* One step of nn[i] tokens over every layer, each layer checked. sel NULL:
 * dense. Returns nothing; the step is finished. */
static void multi_step(const mpool *m, const kvt_seq_id *ids, uint32_t n, const uint32_t *nn,
                       const kvt_selector *sel, const uint32_t *K, const uint32_t *sink,
                       const uint32_t *local, tu_rng *r, const char *tag)
{
    const uint32_t L = m->g.n_layers, H = m->g.n_kv_heads, Hq = m->g.n_q_heads;
    const uint32_t D = m->g.head_dim;
    uint32_t rows = 0, *row0 = malloc(n * sizeof *row0);
    for (uint32_t i = 0; i < n; i++) {
        row0[i] = rows;
        rows += nn[i];
    }
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = sel ? 0 : KVT_STEP_DENSE;
    so.selector = sel;
    so.n_new = nn;
    so.n_rows = rows;
    kvt_step *st;
    TU_OK(kvt_step_plan(m->p, ids, n, &so, &st));
    const double scale = 1.0 / sqrt((double)D);
    uint32_t *pg = malloc(65536 * sizeof *pg);
    for (uint32_t l = 0; l < L; l++) {
        float *k = rand_rows((size_t)rows * H * D, 2.0f, r), *v = rand_rows((size_t)rows * H * D, 1.0f, r);
        float *q = rand_rows((size_t)rows * Hq * D, 2.0f, r);
        float *out = malloc((size_t)rows * Hq * D * sizeof *out);
        float *lse = malloc((size_t)rows * Hq * sizeof *lse);
        TU_OK(kvt_step_append(st, l, k, v, KVT_DTYPE_F32, 0));
        const int arc = kvt_step_attend(st, l, q, out, lse);
        if (arc)
            fail_msg("%s: kvt_step_attend of layer %u: %s (%s)", tag, l, kvt_err_name(arc),
                     kvt_last_error());
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t h = 0; h < H; h++) {
                uint32_t cnt = 0;
                TU_OK(kvt_step_selection_get(st, l, i, h, pg, 65536, &cnt, NULL));
                char what[160];
                snprintf(what, sizeof what, "%s seq %u (n_new %u)", tag, i, nn[i]);
                const float *qi = q + (size_t)row0[i] * Hq * D;
                if (sel) {
                    uint32_t rr = 0;
                    TU_OK(kvt_step_selection_get(st, l, i, h, pg, 65536, &cnt, &rr));
                    if (rr)
                        check_selection(m, ids[i], l, h, nn[i], pg, cnt, K[l], sink[l],
                                        local[l], qi, what);
                }
                check_seq_rows(m, ids[i], l, h, nn[i], nn[i], pg, cnt, qi,
                               out + (size_t)row0[i] * Hq * D, lse + (size_t)row0[i] * Hq, scale,
                               what);
            }
        free(k);
        free(v);
        free(q);
        free(out);
        free(lse);
    }
    TU_OK(kvt_step_finish(st));
    TU_CHECK(m->p);
    free(pg);
    free(row0);
}

static void prefill(kvt_pool *p, kvt_seq_id id, uint32_t L, uint32_t n, tu_rng *r)
{
    if (!n)
        return;
    kvt_geometry g;
    TU_OK(kvt_pool_geometry_get(p, &g));
    for (uint32_t l = 0; l < L; l++) {
        float *k = rand_rows((size_t)n * g.n_kv_heads * g.head_dim, 2.0f, r);
        float *v = rand_rows((size_t)n * g.n_kv_heads * g.head_dim, 1.0f, r);
        TU_OK(kvt_seq_append(p, id, l, k, v, n, KVT_DTYPE_F32, 0));
        free(k);
        free(v);
    }
}

/* Random geometry, dtype and batch; dense and sparse steps of random n_new. */
static void test_multi_random(void **state)
{
    (void)state;
    tu_rng r = {0x5eed0024};
    static const kvt_dtype dts[] = {KVT_DTYPE_F32, KVT_DTYPE_F16, KVT_DTYPE_BF16};
    /* Every kernel this CPU runs (KVTIER_SIMD caps the pool's choice at
     * creation): the many-row tiles differ per ISA. */
    static const char *const isas[] = {"portable", "avx2", NULL};
    for (int it = 0; it < 12; it++) {
        if (isas[it % 3])
            setenv("KVTIER_SIMD", isas[it % 3], 1);
        else
            unsetenv("KVTIER_SIMD");
        const uint32_t L = 2, H = 1 + tu_below(&r, 2), G = 1u << tu_below(&r, 3);
        const uint32_t D = 32u << tu_below(&r, 2), P = 8u << tu_below(&r, 2);
        const kvt_dtype dt = dts[tu_below(&r, 3)];
        kvt_pool_opts o = tu_opts(L, H, H * G, D, P, dt, 4096, 0);
        o.n_threads = 1 + tu_below(&r, 2);
        kvt_pool *p;
        TU_OK(kvt_pool_create(&o, &p));
        mpool m = mp_of(p);
        const uint32_t n = 1 + tu_below(&r, 4);
        kvt_seq_id ids[4];
        uint32_t nn[4];
        for (uint32_t i = 0; i < n; i++) {
            TU_OK(kvt_seq_create(p, NULL, &ids[i]));
            prefill(p, ids[i], L, tu_below(&r, 5 * P), &r);
        }
        kvt_selector_opts sop = KVT_SELECTOR_OPTS_INIT;
        sop.method = KVT_SCORE_MINMAX;
        sop.vote = KVT_VOTE_SUM;
        kvt_selector *sel;
        TU_OK(kvt_selector_create(&m.g, &sop, &sel));
        uint32_t K[2] = {1 + tu_below(&r, 3), 2}, sink[2] = {1, 0}, local[2] = {0, 1};
        for (uint32_t l = 0; l < L; l++)
            TU_OK(kvt_selector_budget_set(sel, l, KVT_ALL, K[l], sink[l], local[l]));
        for (int step = 0; step < 4; step++) {
            for (uint32_t i = 0; i < n; i++)
                nn[i] = 1 + tu_below(&r, step == 3 ? 3 * P : 8);
            char tag[160];
            snprintf(tag, sizeof tag, "it %d step %d (%s, G %u, D %u, P %u, dt %u, %u seqs)", it,
                     step, step % 2 ? "sparse" : "dense", G, D, P, dt, n);
            multi_step(&m, ids, n, nn, step % 2 ? sel : NULL, K, sink, local, &r, tag);
        }
        kvt_selector_destroy(sel);
        kvt_pool_destroy(p);
    }
    unsetenv("KVTIER_SIMD");
}

/* Chunked prefill == whole-prompt causal attention, row for row: a prompt
 * of 300 tokens in dense steps of 64 (the last one 44), each row checked
 * against attention over every earlier token of the prompt. */
static void test_chunked_prefill(void **state)
{
    (void)state;
    tu_rng r = {77};
    kvt_pool_opts o = tu_opts(2, 2, 8, 64, 16, KVT_DTYPE_F16, 4096, 0);
    o.n_threads = 2;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    mpool m = mp_of(p);
    kvt_seq_id id;
    TU_OK(kvt_seq_create(p, NULL, &id));
    for (uint32_t done = 0; done < 300; done += 64) {
        uint32_t nn = 300 - done < 64 ? 300 - done : 64;
        multi_step(&m, &id, 1, &nn, NULL, NULL, NULL, NULL, &r, "chunked prefill");
    }
    uint32_t t;
    TU_OK(kvt_seq_length_get(p, id, 1, &t));
    assert_int_equal(t, 300);
    kvt_pool_destroy(p);
}

/* A step of one token per sequence through kvt_step_attend; out [Hq][D] per
 * sequence. */
static void one_step(kvt_pool *p, kvt_seq_id id, uint32_t L, const float *k, const float *v,
                     const float *q, float *out)
{
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *st;
    TU_OK(kvt_step_plan(p, &id, 1, &so, &st));
    for (uint32_t l = 0; l < L; l++) {
        TU_OK(kvt_step_append(st, l, k, v, KVT_DTYPE_F32, 0));
        TU_OK(kvt_step_attend(st, l, q, out + (size_t)l * 4 * 32, NULL));
    }
    TU_OK(kvt_step_finish(st));
}

/* Verify 5 then truncate 3 == append the 2 kept tokens. */
static void test_verify_truncate(void **state)
{
    (void)state;
    tu_rng r = {99};
    const uint32_t L = 2, H = 2, G = 2, D = 32, P = 8, T0 = 21;
    kvt_pool *pa, *pb;
    kvt_pool_opts o = tu_opts(L, H, H * G, D, P, KVT_DTYPE_F16, 512, 0);
    TU_OK(kvt_pool_create(&o, &pa));
    TU_OK(kvt_pool_create(&o, &pb));
    kvt_seq_id a, b;
    TU_OK(kvt_seq_create(pa, NULL, &a));
    TU_OK(kvt_seq_create(pb, NULL, &b));
    tu_rng r2 = r;
    prefill(pa, a, L, T0, &r);
    prefill(pb, b, L, T0, &r2);
    const size_t kvn = (size_t)5 * H * D, qn = (size_t)5 * H * G * D;
    float *k[2], *v[2], *q[2];
    for (uint32_t l = 0; l < L; l++) {
        k[l] = rand_rows(kvn, 2.0f, &r);
        v[l] = rand_rows(kvn, 1.0f, &r);
        q[l] = rand_rows(qn, 2.0f, &r);
    }
    float *oa = malloc(qn * sizeof *oa), *ob = malloc(qn * sizeof *ob);
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    uint32_t n5 = 5, n2 = 2;
    kvt_step *st;
    for (int side = 0; side < 2; side++) {
        kvt_pool *p = side ? pb : pa;
        so.n_new = side ? &n2 : &n5;
        so.n_rows = side ? 2 : 5;
        TU_OK(kvt_step_plan(p, side ? &b : &a, 1, &so, &st));
        for (uint32_t l = 0; l < L; l++) {
            TU_OK(kvt_step_append(st, l, k[l], v[l], KVT_DTYPE_F32, 0));
            TU_OK(kvt_step_attend(st, l, q[l], side ? ob : oa, NULL));
        }
        TU_OK(kvt_step_finish(st));
        if (!side)
            TU_OK(kvt_seq_truncate(pa, a, T0 + 2));
    }
    /* The verify's first two rows are the two-token step's rows (each row
     * sees the same tokens; kernel grouping may round differently). */
    for (size_t e = 0; e < (size_t)2 * H * G * D; e++)
        assert_true(fabsf(oa[e] - ob[e]) <= 1e-5f * (1.0f + fabsf(ob[e])));
    /* The stored K/V and page metadata, byte for byte. */
    uint16_t ka[(T0 + 2) * 32], kb2[(T0 + 2) * 32], va[(T0 + 2) * 32], vb[(T0 + 2) * 32];
    float mna[32], mxa[32], mea[32], mnb[32], mxb[32], meb[32];
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++) {
            uint32_t ta, tb;
            TU_OK(kvt_seq_length_get(pa, a, l, &ta));
            TU_OK(kvt_seq_length_get(pb, b, l, &tb));
            assert_int_equal(ta, T0 + 2);
            assert_int_equal(tb, T0 + 2);
            TU_OK(kvt_seq_read_kv(pa, a, l, h, 0, T0 + 2, ka, va));
            TU_OK(kvt_seq_read_kv(pb, b, l, h, 0, T0 + 2, kb2, vb));
            assert_memory_equal(ka, kb2, sizeof ka);
            assert_memory_equal(va, vb, sizeof va);
            for (uint32_t pg = 0; pg < (T0 + 2 + P - 1) / P; pg++) {
                TU_OK(kvt_seq_page_meta_get(pa, a, l, h, pg, mna, mxa, mea));
                TU_OK(kvt_seq_page_meta_get(pb, b, l, h, pg, mnb, mxb, meb));
                assert_memory_equal(mna, mnb, sizeof mna);
                assert_memory_equal(mxa, mxb, sizeof mxa);
                assert_memory_equal(mea, meb, sizeof mea);
            }
        }
    /* The next step: the same output, bit for bit. */
    float *na = malloc((size_t)L * 4 * 32 * sizeof *na), *nb = malloc((size_t)L * 4 * 32 * sizeof *nb);
    one_step(pa, a, L, k[0], v[0], q[1], na);
    one_step(pb, b, L, k[0], v[0], q[1], nb);
    assert_memory_equal(na, nb, (size_t)L * 4 * 32 * sizeof *na);
    for (uint32_t l = 0; l < L; l++) {
        free(k[l]);
        free(v[l]);
        free(q[l]);
    }
    free(oa);
    free(ob);
    free(na);
    free(nb);
    TU_CHECK(pa);
    TU_CHECK(pb);
    kvt_pool_destroy(pa);
    kvt_pool_destroy(pb);
}

/* A tiered pool with host and disk tiers: sparse multi-token steps promote
 * pages from both; a dense chunk reads the host tier in place. */
static void test_multi_tiered(void **state)
{
    (void)state;
    pheads ph = ph_uniform(3, 1, 1, 1, 1);
    ph_unstable(&ph, 1, 1);
    /* A host tier too small for everything: the older pages go to disk. */
    pfx *f = pfx_open(&ph, 160, 40, 8u << 20, 24);
    mpool m = mp_of(f->p);
    pfx_add(f, 20 * PAGE_TOKENS + 5, KEYS_RANDOM);
    pfx_add(f, 9 * PAGE_TOKENS, KEYS_RANDOM);
    kvt_seq_id ids[2] = {f->t[0].id, f->t[1].id};
    uint32_t K[N_LAYERS], sink[N_LAYERS], local[N_LAYERS];
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        K[l] = 3;
        sink[l] = 1;
        local[l] = 1;
    }
    tu_rng r = {2424};
    for (int step = 0; step < 6; step++) {
        uint32_t nn[2] = {1 + tu_below(&r, 6), 1 + tu_below(&r, 6)};
        char tag[64];
        snprintf(tag, sizeof tag, "tiered step %d", step);
        /* The pool's selector scores; the reference checks the policy's K. */
        multi_step(&m, ids, 2, nn, f->sel, K, sink, local, &r, tag);
        wait_all(f);
    }
    kvt_stats s = pstats(f->p);
    assert_true(s.promoted_pages > 0);
    /* A step that selects without appending, its rows the last 200 stored
     * tokens: their pages are forced, old ones a stable head moved out,
     * so the recycle promotes them (room the plan counts). */
    {
        uint32_t n_ro = 200;
        kvt_step_opts so = KVT_STEP_OPTS_INIT;
        so.n_new = &n_ro;
        so.n_rows = 200;
        kvt_step *st;
        TU_OK(kvt_step_plan(f->p, ids, 1, &so, &st));
        float *q = rand_rows((size_t)200 * HQ * HEAD_DIM, 2.0f, &r);
        float *out = malloc((size_t)200 * HQ * HEAD_DIM * sizeof *out);
        float *lse = malloc((size_t)200 * HQ * sizeof *lse);
        uint32_t *pg = malloc(MAXPG * sizeof *pg);
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            TU_OK(kvt_step_attend(st, l, q, out, lse));
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                uint32_t cnt;
                TU_OK(kvt_step_selection_get(st, l, 0, h, pg, MAXPG, &cnt, NULL));
                check_seq_rows(&m, ids[0], l, h, 200, 200, pg, cnt, q, out, lse,
                               1.0 / sqrt((double)HEAD_DIM), "read-only tiered step");
            }
        }
        TU_OK(kvt_step_finish(st));
        free(q);
        free(out);
        free(lse);
        free(pg);
        wait_all(f);
    }
    /* A dense chunk of prefill: pages on host are read in place. */
    uint32_t nn = 2 * PAGE_TOKENS + 3;
    multi_step(&m, ids, 1, &nn, NULL, NULL, NULL, NULL, &r, "tiered dense chunk");
    wait_all(f);
    pfx_close(f);
}

/* A NaN key among the new tokens: the rows that see its page are NaN (no
 * defined attention), the earlier rows, whose causal limit ends before
 * that page, keep their attention. */
static void test_multi_nonfinite_causal(void **state)
{
    (void)state;
    tu_rng r = {31};
    const uint32_t H = 1, G = 2, D = 32, P = 8;
    kvt_pool_opts o = tu_opts(1, H, H * G, D, P, KVT_DTYPE_F32, 64, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    mpool m = mp_of(p);
    kvt_seq_id id;
    TU_OK(kvt_seq_create(p, NULL, &id));
    prefill(p, id, 1, P - 2, &r); /* tokens 0 .. 5; the step's are 6, 7 | 8 */
    uint32_t nn = 3;
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    so.n_new = &nn;
    so.n_rows = 3;
    kvt_step *st;
    TU_OK(kvt_step_plan(p, &id, 1, &so, &st));
    float *k = rand_rows((size_t)3 * D, 2.0f, &r), *v = rand_rows((size_t)3 * D, 1.0f, &r);
    float *q = rand_rows((size_t)3 * G * D, 2.0f, &r);
    float out[3 * 2 * 32], lse[3 * 2];
    k[2 * D + 5] = NAN; /* token 8, the first of page 1 */
    TU_OK(kvt_step_append(st, 0, k, v, KVT_DTYPE_F32, 0));
    TU_OK(kvt_step_attend(st, 0, q, out, lse));
    uint32_t pages[2] = {0, 1};
    check_seq_rows(&m, id, 0, 0, 3, 2, pages, 1, q, out, lse, 1.0 / sqrt((double)D),
                   "rows before the NaN key");
    for (uint32_t g = 0; g < G; g++)
        assert_true(isnan(lse[2 * G + g]) && isnan(out[(2 * G + g) * D]));
    TU_OK(kvt_step_finish(st));
    free(k);
    free(v);
    free(q);
    kvt_pool_destroy(p);
}

/* Both sequences of ids hold t0 and t1 tokens in each of L layers. */
static void expect_lengths(const kvt_pool *p, const kvt_seq_id *ids, uint32_t L, uint32_t t0,
                           uint32_t t1)
{
    for (uint32_t l = 0; l < L; l++) {
        uint32_t t;
        TU_OK(kvt_seq_length_get(p, ids[0], l, &t));
        assert_int_equal(t, t0);
        TU_OK(kvt_seq_length_get(p, ids[1], l, &t));
        assert_int_equal(t, t1);
    }
}

static void test_multi_bad_input(void **state)
{
    (void)state;
    tu_rng r = {5};
    kvt_pool_opts o = tu_opts(2, 1, 2, 32, 8, KVT_DTYPE_F16, 256, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_opts sq = KVT_SEQ_OPTS_INIT;
    sq.max_tokens = 40;
    kvt_seq_id ids[2];
    TU_OK(kvt_seq_create(p, NULL, &ids[0]));
    TU_OK(kvt_seq_create(p, &sq, &ids[1]));
    prefill(p, ids[0], 2, 10, &r);
    prefill(p, ids[1], 2, 30, &r);
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *st = NULL;
    uint32_t nn[2] = {3, 0};
    so.n_new = nn;
    so.n_rows = 3;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &so, &st), KVT_EINVAL, "n_new[1]");
    nn[1] = 9;
    so.max_new = 8;
    so.n_rows = 12;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &so, &st), KVT_EINVAL, "n_new[1]");
    so.max_new = 0;
    so.n_rows = 11;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &so, &st), KVT_EINVAL, "n_rows");
    so.max_new = KVT_STEP_MAX_NEW + 1;
    so.n_rows = 12;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &so, &st), KVT_EINVAL, "max_new");
    so.max_new = 0;
    nn[1] = 11; /* 30 + 11 > 40 */
    so.n_rows = 14;
    nn[0] = 3;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &so, &st), KVT_ERANGE, "seqs[1]");
    so.n_new = NULL;
    TU_EXPECT_ERR(kvt_step_plan(p, ids, 2, &so, &st), KVT_EINVAL, "n_rows");
    assert_null(st);
    /* Nothing was appended. */
    expect_lengths(p, ids, 2, 10, 30);
    /* A step that appends some layers only: finish takes every token of
     * each sequence back (KVT_ESTATE naming the layer it missed). */
    nn[0] = 3;
    nn[1] = 2;
    so.n_new = nn;
    so.n_rows = 5;
    TU_OK(kvt_step_plan(p, ids, 2, &so, &st));
    {
        float *k = rand_rows((size_t)5 * 32, 1.0f, &r), *v = rand_rows((size_t)5 * 32, 1.0f, &r);
        TU_OK(kvt_step_append(st, 0, k, v, KVT_DTYPE_F32, 0));
        free(k);
        free(v);
    }
    TU_EXPECT_ERR(kvt_step_finish(st), KVT_ESTATE, "layer 1");
    expect_lengths(p, ids, 2, 10, 30);
    TU_CHECK(p);
    /* The first layout (struct_size 48) still plans one token each. */
    kvt_step_opts old = KVT_STEP_OPTS_INIT;
    old.struct_size = (uint32_t)offsetof(kvt_step_opts, n_new);
    old.flags = KVT_STEP_DENSE;
    TU_OK(kvt_step_plan(p, ids, 2, &old, &st));
    TU_OK(kvt_step_finish(st));
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_multi_random),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_verify_truncate),
        cmocka_unit_test(test_multi_nonfinite_causal),
        cmocka_unit_test(test_multi_bad_input),
        cmocka_unit_test(test_multi_tiered),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
