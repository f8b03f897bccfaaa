/* TokenSelect: token-level page scores (KVT_SCORE_TOKEN), the attention-
 * mass oracle (KVT_SCORE_ORACLE) and the selection cache
 * (rerank_similarity). Every score is checked against a double-precision
 * brute force over the keys as stored (read back with kvt_seq_read_kv),
 * every selection against a brute-force top-K of those reference scores,
 * every cache decision against a reference cosine of the test's own
 * queries. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tiertest.h"

/* The stored keys of (seq, layer, head), widened to double: [T][D]. */
static double *stored_keys(const kvt_pool *p, kvt_seq_id s, uint32_t l, uint32_t h, uint32_t T,
                           uint32_t D, kvt_dtype dt)
{
    const size_t es = kvt_dtype_size(dt);
    uint8_t *raw = malloc((size_t)T * D * es);
    double *kd = malloc((size_t)T * D * sizeof *kd);
    assert_non_null(raw);
    assert_non_null(kd);
    TU_OK(kvt_seq_read_kv(p, s, l, h, 0, T, raw, NULL));
    for (size_t i = 0; i < (size_t)T * D; i++) {
        if (dt == KVT_DTYPE_F32) {
            float f;
            memcpy(&f, raw + 4 * i, 4);
            kd[i] = f;
        } else {
            uint16_t u;
            memcpy(&u, raw + 2 * i, 2);
            kd[i] = dt == KVT_DTYPE_F16 ? tu_f16_value(u) : tu_bf16_value(u);
        }
    }
    free(raw);
    return kd;
}

/* Reference raw scores S[g][np]: max_t q.k (c == 0) or (1/c) ln sum exp(c q.k). */
static void ref_raw(const float *q, uint32_t G, uint32_t D, const double *kd, uint32_t T,
                    uint32_t P, double c, double *S)
{
    const uint32_t np = (T + P - 1) / P;
    for (uint32_t g = 0; g < G; g++)
        for (uint32_t pg = 0; pg < np; pg++) {
            const uint32_t t1 = (pg + 1) * P < T ? (pg + 1) * P : T;
            double mx = -INFINITY, sum = 0;
            for (uint32_t t = pg * P; t < t1; t++) {
                double dot = 0;
                for (uint32_t d = 0; d < D; d++)
                    dot += (double)q[(size_t)g * D + d] * kd[(size_t)t * D + d];
                mx = dot > mx ? dot : mx;
            }
            if (c > 0) {
                for (uint32_t t = pg * P; t < t1; t++) {
                    double dot = 0;
                    for (uint32_t d = 0; d < D; d++)
                        dot += (double)q[(size_t)g * D + d] * kd[(size_t)t * D + d];
                    sum += exp(c * (dot - mx));
                }
                S[(size_t)g * np + pg] = mx + log(sum) / c;
            } else {
                S[(size_t)g * np + pg] = mx;
            }
        }
}

/* The vote of reference raw scores (SUM, MAX, SOFTVOTE at scale c). */
static void ref_vote(const double *S, uint32_t G, uint32_t np, kvt_vote vote, double c,
                     double *v)
{
    for (uint32_t pg = 0; pg < np; pg++)
        v[pg] = vote == KVT_VOTE_MAX ? -INFINITY : 0.0;
    for (uint32_t g = 0; g < G; g++) {
        const double *r = S + (size_t)g * np;
        double mx = -INFINITY, sum = 0;
        for (uint32_t pg = 0; pg < np; pg++)
            mx = r[pg] > mx ? r[pg] : mx;
        for (uint32_t pg = 0; pg < np; pg++)
            sum += exp(c * (r[pg] - mx));
        for (uint32_t pg = 0; pg < np; pg++) {
            if (vote == KVT_VOTE_SUM)
                v[pg] += r[pg];
            else if (vote == KVT_VOTE_MAX)
                v[pg] = r[pg] > v[pg] ? r[pg] : v[pg];
            else
                v[pg] += exp(c * (r[pg] - mx)) / sum;
        }
    }
}

/* The selection must be the forced pages plus the k best by the reference
 * vote; a near tie at the boundary (within tol) may go either way. */
static void check_topk(const uint32_t *sel, uint32_t n, const double *v, uint32_t np, uint32_t T,
                       uint32_t P, uint32_t k, uint32_t sink, uint32_t local, double tol)
{
    uint8_t *forced = calloc(np, 1), *in = calloc(np, 1);
    tu_forced_pages(forced, T, P, sink, local);
    for (uint32_t j = 0; j < n; j++)
        in[sel[j]] = 1;
    double lo_in = INFINITY, hi_out = -INFINITY;
    uint32_t n_comp = 0, n_in = 0;
    for (uint32_t pg = 0; pg < np; pg++) {
        if (forced[pg]) {
            assert_true(in[pg]);
            continue;
        }
        n_comp++;
        if (in[pg]) {
            n_in++;
            lo_in = v[pg] < lo_in ? v[pg] : lo_in;
        } else {
            hi_out = v[pg] > hi_out ? v[pg] : hi_out;
        }
    }
    assert_int_equal(n_in, k < n_comp ? k : n_comp);
    if (!(lo_in >= hi_out - tol))
        fail_msg("a page of vote %.9g was selected over one of %.9g", lo_in, hi_out);
    free(forced);
    free(in);
}

typedef struct shape {
    uint32_t H, G, D, P;
    kvt_dtype dt;
    uint32_t T;
} shape;

/* TOKEN and ORACLE scores (every vote) and selections of a device-only
 * pool against the brute force. */
static void test_token_and_oracle(void **state)
{
    (void)state;
    const shape shapes[] = {
        {2, 1, 16, 8, KVT_DTYPE_F32, 77},  {2, 4, 64, 16, KVT_DTYPE_F16, 300},
        {1, 8, 128, 16, KVT_DTYPE_BF16, 129}, {4, 2, 8, 16, KVT_DTYPE_F16, 480},
        {2, 3, 24, 32, KVT_DTYPE_F32, 1000},
    };
    tu_rng r = {0x70c5e1};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const shape *sh = &shapes[si];
        const uint32_t Hq = sh->H * sh->G, D = sh->D, P = sh->P, T = sh->T;
        kvt_pool_opts o = tu_opts(1, sh->H, Hq, D, P, sh->dt, 256, 0);
        o.n_threads = 2;
        kvt_pool *p;
        TU_OK(kvt_pool_create(&o, &p));
        kvt_seq_id s;
        TU_OK(kvt_seq_create(p, NULL, &s));
        float *kv = malloc((size_t)T * sh->H * D * sizeof *kv);
        for (size_t e = 0; e < (size_t)T * sh->H * D; e++)
            kv[e] = 2.0f * tu_unit(&r) - 1.0f;
        TU_OK(kvt_seq_append(p, s, 0, kv, kv, T, KVT_DTYPE_F32, 0));
        kvt_geometry g;
        TU_OK(kvt_pool_geometry_get(p, &g));
        const uint32_t np = (T + P - 1) / P;
        float *q = malloc((size_t)sh->G * D * sizeof *q), *got = malloc(np * sizeof *got);
        double *S = malloc((size_t)sh->G * np * sizeof *S), *v = malloc(np * sizeof *v);
        uint32_t *sel = malloc(np * sizeof *sel);
        const double c = 1.0 / sqrt((double)D);
        for (uint32_t h = 0; h < sh->H; h++) {
            double *kd = stored_keys(p, s, 0, h, T, D, sh->dt);
            for (uint32_t e = 0; e < sh->G * D; e++)
                q[e] = 2.0f * tu_unit(&r) - 1.0f;
            for (uint32_t method = KVT_SCORE_TOKEN; method <= KVT_SCORE_ORACLE; method++) {
                ref_raw(q, sh->G, D, kd, T, P, method == KVT_SCORE_ORACLE ? c : 0.0, S);
                double mag = 0; /* the scores' scale, for the tolerance */
                for (uint32_t e = 0; e < D; e++)
                    mag += fabs(q[e]);
                for (kvt_vote vote = KVT_VOTE_SUM; vote <= KVT_VOTE_SOFTVOTE; vote++) {
                    if (method == KVT_SCORE_ORACLE && vote != KVT_VOTE_SUM)
                        continue; /* the oracle votes by SOFTVOTE whatever is set */
                    const kvt_vote rv = method == KVT_SCORE_ORACLE ? KVT_VOTE_SOFTVOTE : vote;
                    ref_vote(S, sh->G, np, rv, c, v);
                    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
                    so.method = method;
                    so.vote = vote;
                    so.top_k_pages = np / 4 + 1;
                    kvt_selector *ks;
                    TU_OK(kvt_selector_create(&g, &so, &ks));
                    uint32_t n = 0;
                    TU_OK(kvt_selector_select(ks, p, s, 0, h, q + 0 * D, sel, np, &n, got));
                    /* Absolute tolerance: f32 sums of D products of |q| |k|
                     * <= mag (the keys are in [-1, 1]); softvote's are masses. */
                    const double tol = rv == KVT_VOTE_SOFTVOTE ? 1e-4 * sh->G
                                                                : 1e-5 * mag * sh->G + 1e-6;
                    for (uint32_t pg = 0; pg < np; pg++)
                        if (!(fabs(got[pg] - v[pg]) <= tol))
                            fail_msg("shape %zu head %u method %u vote %u page %u: %.9g, "
                                     "reference %.9g", si, h, method, vote, pg, got[pg],
                                     v[pg]);
                    check_topk(sel, n, v, np, T, P, so.top_k_pages, so.sink_pages,
                               so.local_pages, 2 * tol);
                    kvt_selector_destroy(ks);
                }
            }
            /* The oracle's votes are attention masses: over the group they
             * sum to G (every token's weight lands on its page). */
            free(kd);
        }
        free(kv);
        free(q);
        free(got);
        free(S);
        free(v);
        free(sel);
        TU_CHECK(p);
        kvt_pool_destroy(p);
    }
}

/* Keys the host cannot read (on disk only) score by the MINMAX bound
 * (ORACLE: plus ln(tokens) / c); keys on the host tier only are read there
 * exactly. Pages are moved by the mover. */
static void test_offdevice_bound(void **state)
{
    (void)state;
    tu_rng r = {0xb0d};
    kvt_mover_opts mo = tier_mover_opts(4, 4);
    kvt_pool_opts o = disk_opts(64, 64, 64ull << 20, &mo);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_mover *m;
    TU_OK(kvt_pool_mover_get(p, &m));
    struct {
        kvt_seq_id id;
        uint32_t n;
    } t = {0, 10 * PAGE_TOKENS + 5};
    TU_OK(kvt_seq_create(p, NULL, &t.id));
    float *kv = malloc((size_t)t.n * N_KV_HEADS * HEAD_DIM * sizeof *kv);
    for (size_t e = 0; e < (size_t)t.n * N_KV_HEADS * HEAD_DIM; e++)
        kv[e] = 2.0f * tu_unit(&r) - 1.0f;
    for (uint32_t l = 0; l < N_LAYERS; l++)
        TU_OK(kvt_seq_append(p, t.id, l, kv, kv, t.n, KVT_DTYPE_F32, 0));
    free(kv);
    /* Pages 2, 3 to the disk only, 5, 6 to the host only (head 1, layer 0). */
    kvt_move mv[4] = {
        {t.id, 0, 1, 2, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE},
        {t.id, 0, 1, 3, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE},
        {t.id, 0, 1, 5, KVT_TIER_DEVICE, KVT_TIER_HOST, KVT_MOVE_DROP_SOURCE},
        {t.id, 0, 1, 6, KVT_TIER_DEVICE, KVT_TIER_HOST, KVT_MOVE_DROP_SOURCE},
    };
    int32_t res[4];
    kvt_fence f;
    TU_OK(kvt_mover_submit(m, mv, 4, 0, res, &f));
    TU_OK(kvt_mover_wait(m, f, UINT64_MAX));
    for (int i = 0; i < 4; i++)
        assert_int_equal(res[i], 0);
    assert_int_equal(residency(p, t.id, 0, 1, 2), KVT_RES_DISK);
    assert_int_equal(residency(p, t.id, 0, 1, 5), KVT_RES_HOST);
    kvt_geometry g;
    TU_OK(kvt_pool_geometry_get(p, &g));
    const uint32_t T = t.n, np = (T + PAGE_TOKENS - 1) / PAGE_TOKENS, D = HEAD_DIM;
    float q[HEAD_DIM], mm[16], tok[16], orc[16];
    for (uint32_t d = 0; d < D; d++)
        q[d] = 2.0f * tu_unit(&r) - 1.0f;
    uint32_t sel[16], n;
    const kvt_score_method ms[3] = {KVT_SCORE_MINMAX, KVT_SCORE_TOKEN, KVT_SCORE_ORACLE};
    float *outs[3] = {mm, tok, orc};
    for (int i = 0; i < 3; i++) {
        kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
        so.method = ms[i];
        kvt_selector *ks;
        TU_OK(kvt_selector_create(&g, &so, &ks));
        TU_OK(kvt_selector_select(ks, p, t.id, 0, 1, q, sel, 16, &n, outs[i]));
        kvt_selector_destroy(ks);
    }
    double *kd = stored_keys(p, t.id, 0, 1, T, D, KVT_DTYPE_F16);
    double S[16], So[16];
    const double c = 1.0 / sqrt((double)D);
    ref_raw(q, 1, D, kd, T, PAGE_TOKENS, 0.0, S);
    ref_raw(q, 1, D, kd, T, PAGE_TOKENS, c, So);
    double mag = 0;
    for (uint32_t d = 0; d < D; d++)
        mag += fabs(q[d]);
    for (uint32_t pg = 0; pg < np; pg++) {
        const bool disk = pg == 2 || pg == 3;
        /* G = 1 and SUM: the vote is the raw score. The disk pages' is the
         * MINMAX bound itself; the others' the exact maximum (keys in
         * [-1, 1]). */
        const double tol = 1e-5 * mag + 1e-6;
        if (disk ? tok[pg] != mm[pg] : !(fabs(tok[pg] - S[pg]) <= tol))
            fail_msg("TOKEN page %u (%s): %.9g, want %.9g", pg, disk ? "disk: the bound" : "exact",
                     tok[pg], disk ? mm[pg] : S[pg]);
        assert_true(mm[pg] >= S[pg] - tol); /* the bound is an upper bound */
    }
    /* The oracle: a disk page's share comes from bound + ln(P) / c. */
    double raw[16], mx = -INFINITY, sum = 0;
    for (uint32_t pg = 0; pg < np; pg++) {
        const uint32_t nt = (pg + 1) * PAGE_TOKENS <= T ? PAGE_TOKENS : T - pg * PAGE_TOKENS;
        raw[pg] = (pg == 2 || pg == 3) ? (double)mm[pg] + log((double)nt) / c : So[pg];
        mx = raw[pg] > mx ? raw[pg] : mx;
    }
    for (uint32_t pg = 0; pg < np; pg++)
        sum += exp(c * (raw[pg] - mx));
    for (uint32_t pg = 0; pg < np; pg++) {
        const double want = exp(c * (raw[pg] - mx)) / sum;
        if (!(fabs(orc[pg] - want) <= 1e-4))
            fail_msg("ORACLE page %u: %.9g, want %.9g", pg, orc[pg], want);
    }
    free(kd);
    TU_CHECK(p);
    TU_OK(kvt_seq_release(p, t.id));
    kvt_pool_destroy(p);
}

/* The step's TOKEN selection (the score pass splits a head's pages into
 * chunks over the workers): every head's selection equals the brute-force
 * top-K of the reference votes, and is the same with 1 and 2 threads. Two
 * sequences, one of 2000 tokens (125 pages: two chunks) and one of 900. */
static void test_step_token(void **state)
{
    (void)state;
    const uint32_t H = 2, G = 4, D = 64, P = 16, L = 2, NSQ = 2;
    const uint32_t T[2] = {2000, 900};
    uint32_t sel1[2][2][2][160], n1[2][2][2]; /* [threads - 1][seq][head] */
    for (uint32_t threads = 1; threads <= 2; threads++) {
        tu_rng r = {0x51e9};
        kvt_pool_opts o = tu_opts(L, H, H * G, D, P, KVT_DTYPE_F16, 1024, 0);
        o.n_threads = threads;
        kvt_pool *p;
        TU_OK(kvt_pool_create(&o, &p));
        kvt_seq_id ids[2];
        for (uint32_t i = 0; i < NSQ; i++) {
            TU_OK(kvt_seq_create(p, NULL, &ids[i]));
            float *kv = malloc((size_t)T[i] * H * D * sizeof *kv);
            for (size_t e = 0; e < (size_t)T[i] * H * D; e++)
                kv[e] = 2.0f * tu_unit(&r) - 1.0f;
            for (uint32_t l = 0; l < L; l++)
                TU_OK(kvt_seq_append(p, ids[i], l, kv, kv, T[i], KVT_DTYPE_F32, 0));
            free(kv);
        }
        kvt_geometry g;
        TU_OK(kvt_pool_geometry_get(p, &g));
        kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
        so.method = KVT_SCORE_TOKEN;
        so.vote = KVT_VOTE_SOFTVOTE;
        so.top_k_pages = 12;
        kvt_selector *ks;
        TU_OK(kvt_selector_create(&g, &so, &ks));
        kvt_step_opts sto = KVT_STEP_OPTS_INIT;
        sto.selector = ks;
        kvt_step *st;
        TU_OK(kvt_step_plan(p, ids, NSQ, &sto, &st));
        float q[2 * 8 * 64], kvn[2 * 2 * 64];
        for (uint32_t e = 0; e < NSQ * H * D; e++)
            kvn[e] = 0.25f;
        for (uint32_t l = 0; l < L; l++) {
            for (uint32_t e = 0; e < NSQ * H * G * D; e++)
                q[e] = 2.0f * tu_unit(&r) - 1.0f;
            TU_OK(kvt_step_append(st, l, kvn, kvn, KVT_DTYPE_F32, 0));
            TU_OK(kvt_step_select(st, l, q));
            for (uint32_t i = 0; i < NSQ; i++)
                for (uint32_t h = 0; h < H; h++) {
                    uint32_t n, re, pages[160];
                    TU_OK(kvt_step_selection_get(st, l, i, h, pages, 160, &n, &re));
                    assert_int_equal(re, 1);
                    const uint32_t Tn = T[i] + 1, np = (Tn + P - 1) / P;
                    double *kd = stored_keys(p, ids[i], l, h, Tn, D, KVT_DTYPE_F16);
                    double *S = malloc((size_t)G * np * sizeof *S), *v = malloc(np * sizeof *v);
                    const float *qh = q + ((size_t)i * H * G + (size_t)h * G) * D;
                    ref_raw(qh, G, D, kd, Tn, P, 0.0, S);
                    ref_vote(S, G, np, KVT_VOTE_SOFTVOTE, 1.0 / sqrt((double)D), v);
                    check_topk(pages, n, v, np, Tn, P, so.top_k_pages, so.sink_pages,
                               so.local_pages, 1e-4 * G);
                    free(kd);
                    free(S);
                    free(v);
                    if (l == L - 1) { /* the last layer's selection, per thread count */
                        memcpy(sel1[threads - 1][i][h], pages, n * sizeof *pages);
                        n1[threads - 1][i][h] = n;
                    }
                }
        }
        TU_OK(kvt_step_finish(st));
        TU_CHECK(p);
        kvt_selector_destroy(ks);
        kvt_pool_destroy(p);
    }
    for (uint32_t i = 0; i < NSQ; i++)
        for (uint32_t h = 0; h < H; h++) {
            assert_int_equal(n1[0][i][h], n1[1][i][h]);
            assert_memory_equal(sel1[0][i][h], sel1[1][i][h], n1[0][i][h] * sizeof(uint32_t));
        }
}

/* ---- the selection cache -------------------------------------------------- */
#define CL 2
#define CH 3
#define CG 2
#define CD 32
#define CSTEPS 40

static double cosine(const double *a, const double *b, uint32_t D)
{
    double ab = 0, aa = 0, bb = 0;
    for (uint32_t d = 0; d < D; d++) {
        ab += a[d] * b[d];
        aa += a[d] * a[d];
        bb += b[d] * b[d];
    }
    return ab / sqrt(aa * bb);
}

/* Each head's queries follow one of a few random directions, switching at
 * random steps, with noise that keeps the cosine to the last rerank's query
 * either >= 0.95 (same direction) or <= 0.3 (another): every decision of the
 * library must equal the reference's: rerank at the first step, when the
 * cosine of the group mean to the one of its last rerank is below the
 * threshold (0.7), and never otherwise (interval 1000). */
static void test_select_cache(void **state)
{
    (void)state;
    tu_rng r = {0xcac4e};
    const uint32_t Hq = CH * CG;
    kvt_pool_opts o = tu_opts(CL, CH, Hq, CD, 8, KVT_DTYPE_F16, 512, 0);
    o.n_threads = 2;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_id s;
    TU_OK(kvt_seq_create(p, NULL, &s));
    float *kv = malloc((size_t)200 * CH * CD * sizeof *kv);
    for (size_t e = 0; e < (size_t)200 * CH * CD; e++)
        kv[e] = 2.0f * tu_unit(&r) - 1.0f;
    for (uint32_t l = 0; l < CL; l++)
        TU_OK(kvt_seq_append(p, s, l, kv, kv, 200, KVT_DTYPE_F32, 0));
    kvt_geometry g;
    TU_OK(kvt_pool_geometry_get(p, &g));
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.top_k_pages = 4;
    so.rerank_interval = 1000;
    so.rerank_similarity = 0.7f;
    kvt_selector *ks;
    TU_OK(kvt_selector_create(&g, &so, &ks));
    /* One head without the cache: it never reranks after its first step;
     * nor does one whose budget covers every page (no kept set is reused,
     * so its drift is not tested). */
    TU_OK(kvt_selector_rerank_similarity_set(ks, 1, 2, -1.0f));
    TU_OK(kvt_selector_budget_set(ks, 0, 1, 64, 1, 1));
    /* Directions: 4 orthogonal-ish unit vectors per head (random, then the
     * test only uses the measured cosines). */
    static double dir[CL * CH][4][CD], ref[CL * CH][CD];
    for (uint32_t b = 0; b < CL * CH; b++)
        for (int k = 0; k < 4; k++)
            for (uint32_t d = 0; d < CD; d++)
                dir[b][k][d] = (d % 4 == (uint32_t)k ? 1.0 : 0.0) * (1.0 + tu_unit(&r)) +
                               0.02 * (tu_unit(&r) - 0.5);
    uint32_t cur[CL * CH] = {0};
    kvt_stats s0 = {.struct_size = sizeof s0};
    TU_OK(kvt_pool_stats_get(p, &s0));
    uint64_t want_sim = 0, want_rr = 0;
    float q[CH * CG * CD], kvn[CH * CD];
    for (uint32_t e = 0; e < CH * CD; e++)
        kvn[e] = 0.5f;
    for (uint32_t step = 0; step < CSTEPS; step++) {
        kvt_step_opts sto = KVT_STEP_OPTS_INIT;
        sto.selector = ks;
        kvt_step *st;
        TU_OK(kvt_step_plan(p, &s, 1, &sto, &st));
        for (uint32_t l = 0; l < CL; l++) {
            double mean[CH][CD];
            for (uint32_t h = 0; h < CH; h++) {
                const uint32_t b = l * CH + h;
                if (step > 0 && tu_below(&r, 4) == 0)
                    cur[b] = (cur[b] + 1 + tu_below(&r, 3)) % 4;
                for (uint32_t d = 0; d < CD; d++)
                    mean[h][d] = 0;
                for (uint32_t gq = 0; gq < CG; gq++)
                    for (uint32_t d = 0; d < CD; d++) {
                        const float x = (float)(dir[b][cur[b]][d] * (1.0 + 0.3 * gq)) +
                                        0.01f * (tu_unit(&r) - 0.5f);
                        q[(h * CG + gq) * CD + d] = x;
                        mean[h][d] += (double)x / CG;
                    }
            }
            TU_OK(kvt_step_append(st, l, kvn, kvn, KVT_DTYPE_F32, 0));
            TU_OK(kvt_step_select(st, l, q));
            for (uint32_t h = 0; h < CH; h++) {
                const uint32_t b = l * CH + h;
                const bool cache = b != 1 * CH + 2 && b != 0 * CH + 1;
                bool want = step == 0;
                if (!want && cache) {
                    const double cs = cosine(mean[h], ref[b], CD);
                    if (cs > 0.65 && cs < 0.75)
                        fail_msg("the test's queries came within 0.05 of the threshold "
                                 "(%.3f): pick other directions", cs);
                    want = cs < 0.7;
                    want_sim += want;
                }
                uint32_t pages[64], n, re = 9;
                TU_OK(kvt_step_selection_get(st, l, 0, h, pages, 64, &n, &re));
                if (re != (uint32_t)want)
                    fail_msg("step %u layer %u head %u: reranked %u, the reference says %u",
                             step, l, h, re, want);
                if (want) {
                    memcpy(ref[b], mean[h], sizeof ref[b]);
                    want_rr++;
                }
            }
            /* A layer selected again in the step: the same decisions, and
             * the counters count the layer once. */
            if (step == CSTEPS - 1)
                TU_OK(kvt_step_select(st, l, q));
        }
        TU_OK(kvt_step_finish(st));
    }
    kvt_stats s1 = {.struct_size = sizeof s1};
    TU_OK(kvt_pool_stats_get(p, &s1));
    assert_int_equal(s1.head_selections - s0.head_selections, (uint64_t)CSTEPS * CL * CH);
    assert_int_equal(s1.reranked_heads - s0.reranked_heads, want_rr);
    assert_int_equal(s1.similarity_reranks - s0.similarity_reranks, want_sim);
    assert_true(want_sim > 10 && want_rr < (uint64_t)CSTEPS * CL * CH / 2);

    /* Bad thresholds: KVT_EINVAL naming the value, the old one kept. */
    TU_EXPECT_ERR(kvt_selector_rerank_similarity_set(ks, 0, 0, NAN), KVT_EINVAL, "threshold: nan");
    TU_EXPECT_ERR(kvt_selector_rerank_similarity_set(ks, 0, 0, -1.5f), KVT_EINVAL, "-1.5");
    TU_EXPECT_ERR(kvt_selector_rerank_similarity_set(ks, 0, 0, 1.5f), KVT_EINVAL, "1.5");
    TU_EXPECT_ERR(kvt_selector_rerank_similarity_set(ks, 2, 0, 0.5f), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_selector_rerank_similarity_set(NULL, 0, 0, 0.5f), KVT_EINVAL, "sel");
    TU_CHECK(p);
    kvt_selector_destroy(ks);
    free(kv);
    kvt_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_token_and_oracle),
        cmocka_unit_test(test_offdevice_bound),
        cmocka_unit_test(test_step_token),
        cmocka_unit_test(test_select_cache),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
