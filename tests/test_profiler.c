/* The head-stability profiler: the random-corrected overlap and the
 * temporal-stability score against hand-computed values (including the
 * N_t == K and K == 0 corners), exact classification of synthetic traces
 * (heads that keep their pages vs heads that draw new random pages every
 * step), reload benefit per window size against an independent recency
 * count, window choice against brute force, and bad input to every call.
 * Linked statically for the internal kvt__rco. */
#include "testutil.h"

#include "../lib/policy/policy_int.h"

static kvt_geometry geom(uint32_t L, uint32_t H)
{
    kvt_geometry g = {L, H, 2 * H, 16, 16, KVT_DTYPE_F16, {0, 0}};
    return g;
}

static kvt_profiler *make_prof(uint32_t L, uint32_t H, uint32_t W, double unstable,
                               double bottom)
{
    kvt_profiler_opts o;
    TU_OK(kvt_profiler_opts_init(&o));
    o.window_steps = W;
    o.unstable_fraction = unstable;
    o.bottom_fraction = bottom;
    kvt_geometry g = geom(L, H);
    kvt_profiler *p;
    TU_OK(kvt_profiler_create(&g, &o, &p));
    return p;
}

static kvt_profiler_head_stats head_stats(const kvt_profiler *p, uint32_t l, uint32_t h)
{
    kvt_profiler_head_stats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    TU_OK(kvt_profiler_head_get(p, l, h, &s));
    return s;
}

static int close_to(double a, double b)
{
    return fabs(a - b) <= 1e-12 * (1.0 + fabs(b));
}

/* ---- RCO and TS ------------------------------------------------------------ */
static void test_rco_hand(void **state)
{
    (void)state;
    const uint32_t a[] = {1, 2, 3, 4}, b[] = {1, 2, 5, 6}, c[] = {7, 8, 9, 10};
    /* K = 4, N = 16: overlap 2/4, chance 1/4 -> (1/2 - 1/4) / (3/4) = 1/3. */
    assert_true(close_to(kvt__rco(a, 4, b, 4, 16), 1.0 / 3.0));
    /* Identical sets: 1. Disjoint: (0 - 1/4) / (3/4) < 0 -> 0. */
    assert_true(close_to(kvt__rco(a, 4, a, 4, 16), 1.0));
    assert_true(kvt__rco(a, 4, c, 4, 16) == 0.0);
    /* Overlap at the chance level gives 0: 2 of 4 with N = 8. */
    assert_true(close_to(kvt__rco(a, 4, b, 4, 8), 0.0));
    /* 3 of 4 with N = 10: (3/4 - 2/5) / (3/5) = 7/12. */
    const uint32_t d[] = {1, 2, 3, 9};
    assert_true(close_to(kvt__rco(a, 4, d, 4, 10), 7.0 / 12.0));
    /* Different sizes: K is the later set's: b' = {1, 2}, K = 2, N = 10:
     * (2/2 - 1/5) / (4/5) = 1. */
    const uint32_t e[] = {1, 2};
    assert_true(close_to(kvt__rco(a, 4, e, 2, 10), 1.0));
    /* ... and the earlier set smaller: a' = {1}, later {1, 2}: (1/2 - 1/5)/(4/5) = 3/8. */
    assert_true(close_to(kvt__rco(e, 1, e, 2, 10), 3.0 / 8.0));
    /* N_t == K: every candidate selected, no information: 1. */
    assert_true(kvt__rco(a, 4, c, 4, 4) == 1.0);
    /* K == 0: nothing selected: 1; also with N == 0. */
    assert_true(kvt__rco(a, 4, NULL, 0, 16) == 1.0);
    assert_true(kvt__rco(NULL, 0, NULL, 0, 0) == 1.0);
    /* An empty earlier set against a non-empty later one: chance only -> 0. */
    assert_true(kvt__rco(NULL, 0, a, 4, 16) == 0.0);
}

static void test_ts_hand(void **state)
{
    (void)state;
    kvt_profiler *p = make_prof(1, 1, 3, 0.0, 0.25);
    const uint32_t s0[] = {0, 1, 2, 3}, s1[] = {0, 1, 4, 5}, s3[] = {8, 9, 10, 11};
    /* Window 1: anchor s0; RCO(s0, s1) at N 8 = (1/2 - 1/2)/(1/2) = 0,
     * RCO(s0, s0) = 1 -> TS 1/2. */
    TU_OK(kvt_profiler_record(p, 7, 0, 0, s0, 4, 8));
    TU_OK(kvt_profiler_record(p, 7, 0, 0, s1, 4, 8));
    kvt_profiler_head_stats st = head_stats(p, 0, 0);
    assert_int_equal(st.windows, 0);
    assert_true(st.mean_ts == 0.0);
    TU_OK(kvt_profiler_record(p, 7, 0, 0, s0, 4, 8));
    st = head_stats(p, 0, 0);
    assert_int_equal(st.records, 3);
    assert_int_equal(st.windows, 1);
    assert_true(close_to(st.mean_ts, 0.5));
    /* Window 2: anchor s3, then s3 with N_t == K (1 by definition), then
     * an empty set (K = 0: 1) -> TS 1; mean (1/2 + 1) / 2 = 3/4. */
    TU_OK(kvt_profiler_record(p, 7, 0, 0, s3, 4, 12));
    TU_OK(kvt_profiler_record(p, 7, 0, 0, s0, 4, 4));
    TU_OK(kvt_profiler_record(p, 7, 0, 0, NULL, 0, 12));
    st = head_stats(p, 0, 0);
    assert_int_equal(st.windows, 2);
    assert_true(close_to(st.mean_ts, 0.75));
    assert_int_equal(st.k_max, 4);
    /* A single head: each complete window is ranked; bottom share 0.25 of
     * one head rounds to 0 heads, so it is never "bottom". */
    assert_int_equal(st.ranked_windows, 2);
    assert_int_equal(st.bottom, 0);
    assert_true(st.instability == 0.0);
    /* A second stream keeps its own windows. */
    TU_OK(kvt_profiler_record(p, 8, 0, 0, s0, 4, 16));
    TU_OK(kvt_profiler_record(p, 8, 0, 0, s0, 4, 16));
    TU_OK(kvt_profiler_record(p, 8, 0, 0, s0, 4, 16));
    st = head_stats(p, 0, 0);
    assert_int_equal(st.windows, 3);
    assert_true(close_to(st.mean_ts, (0.5 + 1.0 + 1.0) / 3.0));
    kvt_profiler_destroy(p);
}

/* ---- synthetic traces --------------------------------------------------------- */
/* K distinct random pages of [0, N), sorted. */
static void random_set(tu_rng *r, uint32_t *out, uint32_t K, uint32_t N)
{
    uint8_t used[1024] = {0};
    for (uint32_t i = 0; i < K;) {
        uint32_t pg = tu_below(r, N);
        if (!used[pg]) {
            used[pg] = 1;
            i++;
        }
    }
    uint32_t n = 0;
    for (uint32_t pg = 0; pg < N; pg++)
        if (used[pg])
            out[n++] = pg;
}

/* Heads marked in `random_head` draw a new random set every step; the
 * others keep one set per stream. Streams interleave step by step, and the
 * heads of a step are recorded in a shuffled order. */
static void feed_trace(kvt_profiler *p, uint32_t L, uint32_t H, const uint8_t *random_head,
                       uint32_t n_streams, uint32_t steps, uint32_t K, uint32_t N, uint64_t seed)
{
    tu_rng r = {seed};
    const uint32_t nh = L * H;
    uint32_t *fixed = malloc((size_t)n_streams * nh * K * sizeof *fixed);
    uint32_t *order = malloc(nh * sizeof *order), set[256];
    for (uint32_t s = 0; s < n_streams; s++)
        for (uint32_t i = 0; i < nh; i++)
            random_set(&r, fixed + ((size_t)s * nh + i) * K, K, N);
    for (uint32_t t = 0; t < steps; t++)
        for (uint32_t s = 0; s < n_streams; s++) {
            for (uint32_t i = 0; i < nh; i++)
                order[i] = i;
            for (uint32_t i = nh; i > 1; i--) {
                uint32_t j = tu_below(&r, i), x = order[i - 1];
                order[i - 1] = order[j];
                order[j] = x;
            }
            for (uint32_t o = 0; o < nh; o++) {
                const uint32_t i = order[o];
                const uint32_t *pg = fixed + ((size_t)s * nh + i) * K;
                if (random_head[i]) {
                    random_set(&r, set, K, N);
                    pg = set;
                }
                TU_OK(kvt_profiler_record(p, 1000 + 17ull * s, i / H, i % H, pg, K, N));
            }
        }
    free(fixed);
    free(order);
}

static void classify_case(uint32_t L, uint32_t H, uint32_t n_random, double unstable,
                          double bottom, uint32_t W, uint32_t streams, uint32_t steps,
                          uint64_t seed)
{
    const uint32_t nh = L * H;
    uint8_t rnd[64] = {0};
    tu_rng r = {seed ^ 0x5a5a};
    for (uint32_t c = 0; c < n_random;) {
        uint32_t i = tu_below(&r, nh);
        if (!rnd[i]) {
            rnd[i] = 1;
            c++;
        }
    }
    kvt_profiler *p = make_prof(L, H, W, unstable, bottom);
    feed_trace(p, L, H, rnd, streams, steps, 8, 64, seed);
    const uint64_t windows = (uint64_t)streams * (steps / W);
    for (uint32_t i = 0; i < nh; i++) {
        kvt_profiler_head_stats st = head_stats(p, i / H, i % H);
        assert_int_equal(st.records, (uint64_t)streams * steps);
        assert_int_equal(st.windows, windows);
        assert_int_equal(st.ranked_windows, windows);
        if (!rnd[i]) /* identical sets: every overlap is 1 */
            assert_true(st.mean_ts == 1.0);
        else if (!(st.mean_ts < 0.5))
            fail_msg("random head %u: mean TS %g", i, st.mean_ts);
        /* As many random heads as bottom places: each lands there in
         * every window, the stable ones never. */
        if ((uint32_t)floor(bottom * nh + 0.5) == n_random)
            assert_true(st.instability == (rnd[i] ? 1.0 : 0.0));
    }
    kvt_policy *pol;
    kvt_policy_opts base;
    TU_OK(kvt_policy_opts_init(&base));
    TU_OK(kvt_profiler_build_policy(p, &base, 0, &pol));
    uint32_t n_unstable = 0;
    TU_OK(kvt_policy_count_get(pol, KVT_HEAD_UNSTABLE, &n_unstable));
    assert_int_equal(n_unstable, n_random);
    for (uint32_t i = 0; i < nh; i++) {
        kvt_policy_head_info info = {.struct_size = sizeof info};
        TU_OK(kvt_policy_head_get(pol, i / H, i % H, &info));
        if (info.head_class != (rnd[i] ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE))
            fail_msg("head %u (layer %u, kv_head %u) designed %s, classified %s", i, i / H,
                     i % H, rnd[i] ? "random" : "stable",
                     info.head_class == KVT_HEAD_UNSTABLE ? "UNSTABLE" : "STABLE");
        assert_int_equal(info.rerank_interval, rnd[i] ? 1u : 16u);
        assert_int_equal(info.window, 1u);
    }
    kvt_policy_destroy(pol);
    kvt_profiler_destroy(p);
}

static void test_classify_synthetic(void **state)
{
    (void)state;
    /* 8 heads, 2 random, the default quartile and fraction. */
    classify_case(2, 4, 2, 0.25, 0.25, 16, 3, 64, 11);
    /* 12 heads, 3 random: 3 bottom places (0.25 * 12). */
    classify_case(3, 4, 3, 0.25, 0.25, 16, 2, 48, 12);
    /* 16 heads, 4 random, only 2 bottom places per window: the random
     * heads share them, the stable ones never get one; 4 made unstable. */
    classify_case(4, 4, 4, 0.25, 0.125, 8, 4, 64, 13);
    /* A window of 2 (TS = one overlap) and a single stream. */
    classify_case(1, 8, 2, 0.25, 0.25, 2, 1, 40, 14);
}

/* ---- reload benefit ------------------------------------------------------------ */
/* Independent recency count: page p's depth before step t is the number of
 * distinct pages used more recently, where among pages of the same step the
 * lower page counts as more recent. */
static void ref_benefit(const uint32_t *sets, const uint32_t *sizes, uint32_t steps,
                        uint32_t stride, uint32_t N, uint64_t hits[4], uint64_t *demand)
{
    int64_t last[1024];
    for (uint32_t i = 0; i < N; i++)
        last[i] = -1;
    memset(hits, 0, 4 * sizeof *hits);
    *demand = 0;
    for (uint32_t t = 0; t < steps; t++) {
        const uint32_t *s = sets + (size_t)t * stride, k = sizes[t];
        if (t > 0) {
            *demand += k;
            for (uint32_t j = 0; j < k; j++) {
                const uint32_t p = s[j];
                if (last[p] < 0)
                    continue;
                uint64_t d = 0;
                for (uint32_t q = 0; q < N; q++)
                    if (last[q] > last[p] || (last[q] == last[p] && q < p))
                        d++;
                for (uint32_t w = 1; w <= 4; w++)
                    hits[w - 1] += d < (uint64_t)w * k;
            }
        }
        for (uint32_t j = 0; j < k; j++)
            last[s[j]] = t;
    }
}

static void test_benefit_vs_reference(void **state)
{
    (void)state;
    tu_rng r = {0xbe7e};
    enum { STEPS = 60, K = 6, N = 40 };
    static uint32_t sets[STEPS * K], sizes[STEPS];
    for (int trial = 0; trial < 40; trial++) {
        kvt_profiler *p = make_prof(1, 1, 4, 0.0, 0.0);
        /* A mix: reuse the previous set, one of the last few, or fresh
         * random pages, drawn per step; K constant. */
        for (uint32_t t = 0; t < STEPS; t++) {
            uint32_t *s = sets + t * K;
            sizes[t] = K;
            const uint32_t mode = tu_below(&r, 4);
            if (t >= 3 && mode == 0)
                memcpy(s, sets + (t - 1 - tu_below(&r, 3)) * K, K * sizeof *s);
            else if (t >= 1 && mode == 1) {
                /* the previous set with one page swapped */
                uint8_t in[N] = {0};
                for (uint32_t j = 0; j < K; j++)
                    in[sets[(t - 1) * K + j]] = 1;
                in[sets[(t - 1) * K + tu_below(&r, K)]] = 0;
                uint32_t add;
                do
                    add = tu_below(&r, N);
                while (in[add]);
                in[add] = 1;
                uint32_t n = 0;
                for (uint32_t pg = 0; pg < N; pg++)
                    if (in[pg])
                        s[n++] = pg;
            } else {
                random_set(&r, s, K, N);
            }
            TU_OK(kvt_profiler_record(p, 3, 0, 0, s, K, N));
        }
        uint64_t hits[4], demand;
        ref_benefit(sets, sizes, STEPS, K, N, hits, &demand);
        kvt_profiler_head_stats st = head_stats(p, 0, 0);
        assert_int_equal(st.demand, demand);
        for (int w = 0; w < 4; w++)
            if (st.benefit[w] != hits[w])
                fail_msg("trial %d: benefit[w=%d] %llu, reference %llu", trial, w + 1,
                         (unsigned long long)st.benefit[w], (unsigned long long)hits[w]);
        for (int w = 1; w < 4; w++)
            assert_true(st.benefit[w] >= st.benefit[w - 1]);
        kvt_profiler_destroy(p);
    }
}

/* A hand example: period-2 alternation of two disjoint sets of K = 2.
 * Window 1 (2 pages) never holds the set from two steps back; window 2
 * (4 pages) always does, from step 2 on. */
static void test_benefit_hand(void **state)
{
    (void)state;
    kvt_profiler *p = make_prof(1, 1, 16, 0.0, 0.0);
    const uint32_t a[] = {1, 2}, b[] = {5, 6};
    for (int t = 0; t < 10; t++)
        TU_OK(kvt_profiler_record(p, 1, 0, 0, t % 2 ? b : a, 2, 20));
    kvt_profiler_head_stats st = head_stats(p, 0, 0);
    assert_int_equal(st.demand, 18);    /* steps 1..9, 2 pages each */
    assert_int_equal(st.benefit[0], 0);
    assert_int_equal(st.benefit[1], 16); /* steps 2..9 */
    assert_int_equal(st.benefit[2], 16);
    assert_int_equal(st.benefit[3], 16);
    kvt_profiler_destroy(p);
}

/* ---- window choice ----------------------------------------------------------------- */
/* Four stable heads whose sets cycle with periods 1, 2, 3 and 5 (so a
 * window of w sets catches them from period <= w on), K = 4. The chosen
 * windows must maximise the summed benefit (from the reference count)
 * under each budget, as brute force over 4^4 choices finds. */
static void test_windows_vs_brute(void **state)
{
    (void)state;
    enum { L = 1, H = 4, K = 4, N = 64, STEPS = 64 };
    const uint32_t period[H] = {1, 2, 3, 5};
    static uint32_t sets[H][STEPS * K];
    uint32_t sizes[STEPS];
    kvt_profiler *p = make_prof(L, H, 16, 0.0, 0.25);
    for (uint32_t t = 0; t < STEPS; t++) {
        sizes[t] = K;
        for (uint32_t h = 0; h < H; h++) {
            uint32_t *s = sets[h] + t * K;
            const uint32_t phase = t % period[h];
            for (uint32_t j = 0; j < K; j++)
                s[j] = phase * K + j; /* disjoint sets per phase */
            TU_OK(kvt_profiler_record(p, 42, 0, h, s, K, N));
        }
    }
    double ben[H][4];
    for (uint32_t h = 0; h < H; h++) {
        uint64_t hits[4], demand;
        ref_benefit(sets[h], sizes, STEPS, K, N, hits, &demand);
        kvt_profiler_head_stats st = head_stats(p, 0, h);
        for (int w = 0; w < 4; w++) {
            assert_int_equal(st.benefit[w], hits[w]);
            ben[h][w] = (double)hits[w];
        }
    }
    kvt_policy_opts base;
    TU_OK(kvt_policy_opts_init(&base));
    base.top_k_pages = K;
    for (uint64_t budget = H * K; budget <= 4 * H * K + 3; budget++) {
        double best = -1;
        for (uint32_t c = 0; c < 256; c++) {
            uint64_t cost = 0;
            double v = 0;
            for (uint32_t h = 0; h < H; h++) {
                const uint32_t w = 1 + ((c >> (2 * h)) & 3);
                cost += (uint64_t)w * K;
                v += ben[h][w - 1];
            }
            if (cost <= budget && v > best)
                best = v;
        }
        kvt_policy *pol;
        TU_OK(kvt_profiler_build_policy(p, &base, budget, &pol));
        uint64_t cost = 0;
        double v = 0;
        for (uint32_t h = 0; h < H; h++) {
            kvt_policy_head_info info = {.struct_size = sizeof info};
            TU_OK(kvt_policy_head_get(pol, 0, h, &info));
            assert_int_equal(info.head_class, KVT_HEAD_STABLE);
            assert_true(info.window >= 1 && info.window <= 4);
            cost += (uint64_t)info.window * K;
            v += ben[h][info.window - 1];
        }
        if (cost > budget || v != best)
            fail_msg("budget %llu: windows cost %llu, benefit %g; brute force %g",
                     (unsigned long long)budget, (unsigned long long)cost, v, best);
        kvt_policy_destroy(pol);
    }
    /* With every budget it can use, period-p heads get window p (p <= 4);
     * the period-5 head gains nothing from any window up to 4. */
    kvt_policy *pol;
    TU_OK(kvt_profiler_build_policy(p, &base, 4 * H * K, &pol));
    const uint32_t want[H] = {1, 2, 3, 1};
    for (uint32_t h = 0; h < H; h++) {
        kvt_policy_head_info info = {.struct_size = sizeof info};
        TU_OK(kvt_policy_head_get(pol, 0, h, &info));
        assert_int_equal(info.window, want[h]);
    }
    kvt_policy_destroy(pol);
    /* Below every head at window 1: KVT_ERANGE. */
    TU_EXPECT_ERR(kvt_profiler_build_policy(p, &base, H * K - 1, &pol), KVT_ERANGE,
                  "device_page_budget");
    assert_null(pol);
    kvt_profiler_destroy(p);
}

/* ---- bad input ------------------------------------------------------------------------ */
static void test_bad_input(void **state)
{
    (void)state;
    kvt_geometry g = geom(2, 2);
    kvt_profiler *p = (kvt_profiler *)&g;
    kvt_profiler_opts o;
    TU_EXPECT_ERR(kvt_profiler_opts_init(NULL), KVT_EINVAL, "opts");
    TU_EXPECT_ERR(kvt_profiler_create(&g, NULL, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_profiler_create(NULL, NULL, &p), KVT_EINVAL, "geom");
    assert_null(p);
    kvt_geometry bad = g;
    bad.head_dim = 7;
    TU_EXPECT_ERR(kvt_profiler_create(&bad, NULL, &p), KVT_EINVAL, "head_dim");
#define BAD_OPT(field, val, needle)                                                        \
    do {                                                                                   \
        kvt_profiler_opts_init(&o);                                                        \
        o.field = val;                                                                     \
        TU_EXPECT_ERR(kvt_profiler_create(&g, &o, &p), KVT_EINVAL, needle);                \
        assert_null(p);                                                                    \
    } while (0)
    BAD_OPT(window_steps, 1, "window_steps");
    BAD_OPT(window_steps, 65537, "window_steps");
    BAD_OPT(unstable_fraction, -0.01, "unstable_fraction");
    BAD_OPT(unstable_fraction, 1.5, "unstable_fraction");
    BAD_OPT(unstable_fraction, NAN, "unstable_fraction");
    BAD_OPT(bottom_fraction, -1.0, "bottom_fraction");
    BAD_OPT(bottom_fraction, NAN, "bottom_fraction");
    BAD_OPT(max_streams, 0, "max_streams");
    BAD_OPT(max_streams, (1u << 20) + 1, "max_streams");
    BAD_OPT(reserved, 1, "reserved");
    BAD_OPT(struct_size, 8, "struct_size");
#undef BAD_OPT
    /* A larger struct from newer headers: zero tail accepted, else refused. */
    struct {
        kvt_profiler_opts o;
        uint32_t extra;
    } big;
    memset(&big, 0, sizeof big);
    kvt_profiler_opts_init(&big.o);
    big.o.struct_size = sizeof big;
    TU_OK(kvt_profiler_create(&g, &big.o, &p));
    kvt_profiler_destroy(p);
    big.extra = 1;
    TU_EXPECT_ERR(kvt_profiler_create(&g, &big.o, &p), KVT_EINVAL, "struct_size");
    kvt_profiler_destroy(NULL);

    kvt_profiler_opts_init(&o);
    o.max_streams = 2;
    TU_OK(kvt_profiler_create(&g, &o, &p));
    const uint32_t pg[] = {3, 5, 9}, dup[] = {3, 3}, down[] = {5, 3};
    TU_EXPECT_ERR(kvt_profiler_record(NULL, 1, 0, 0, pg, 3, 10), KVT_EINVAL, "prof");
    TU_EXPECT_ERR(kvt_profiler_record(p, 1, 2, 0, pg, 3, 10), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_profiler_record(p, 1, 0, 2, pg, 3, 10), KVT_EINVAL, "kv_head");
    TU_EXPECT_ERR(kvt_profiler_record(p, 1, 0, 0, NULL, 3, 10), KVT_EINVAL, "pages");
    TU_EXPECT_ERR(kvt_profiler_record(p, 1, 0, 0, pg, 3, 2), KVT_EINVAL, "n_candidates");
    TU_EXPECT_ERR(kvt_profiler_record(p, 1, 0, 0, dup, 2, 10), KVT_EINVAL, "pages[1]");
    TU_EXPECT_ERR(kvt_profiler_record(p, 1, 0, 0, down, 2, 10), KVT_EINVAL, "pages[1]");
    TU_OK(kvt_profiler_record(p, 1, 0, 0, NULL, 0, 0));
    TU_OK(kvt_profiler_record(p, 2, 0, 0, pg, 3, 3));
    TU_EXPECT_ERR(kvt_profiler_record(p, 3, 0, 0, pg, 3, 3), KVT_ENOSPC, "max_streams");
    kvt_profiler_head_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    TU_EXPECT_ERR(kvt_profiler_head_get(NULL, 0, 0, &st), KVT_EINVAL, "prof");
    TU_EXPECT_ERR(kvt_profiler_head_get(p, 2, 0, &st), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_profiler_head_get(p, 0, 2, &st), KVT_EINVAL, "kv_head");
    TU_EXPECT_ERR(kvt_profiler_head_get(p, 0, 0, NULL), KVT_EINVAL, "stats");
    st.struct_size = 4;
    TU_EXPECT_ERR(kvt_profiler_head_get(p, 0, 0, &st), KVT_EINVAL, "struct_size");
    /* A larger output struct (newer headers): the tail is zeroed. */
    union {
        kvt_profiler_head_stats s;
        uint8_t b[sizeof(kvt_profiler_head_stats) + 8];
    } raw;
    memset(&raw, 0xab, sizeof raw);
    raw.s.struct_size = (uint32_t)sizeof raw;
    TU_OK(kvt_profiler_head_get(p, 0, 0, &raw.s));
    for (size_t i = sizeof(kvt_profiler_head_stats); i < sizeof raw; i++)
        assert_int_equal(raw.b[i], 0);
    assert_int_equal(raw.s.records, 2); /* streams 1 and 2 */

    kvt_policy *pol = (kvt_policy *)&g;
    TU_EXPECT_ERR(kvt_profiler_build_policy(p, NULL, 0, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_profiler_build_policy(NULL, NULL, 0, &pol), KVT_EINVAL, "prof");
    assert_null(pol);
    TU_EXPECT_ERR(kvt_profiler_build_policy(p, NULL, 0, &pol), KVT_ESTATE, "window");
    kvt_policy_opts base;
    kvt_policy_opts_init(&base);
    base.window = 0;
    TU_EXPECT_ERR(kvt_profiler_build_policy(p, &base, 0, &pol), KVT_EINVAL, "base->window");
    kvt_policy_opts_init(&base);
    base.stable_interval = 0;
    TU_EXPECT_ERR(kvt_profiler_build_policy(p, &base, 0, &pol), KVT_EINVAL,
                  "base->stable_interval");
    kvt_profiler_destroy(p);
}

/* build_policy with the defaults and a NULL base: interval 16 / 1, K 64. */
static void test_build_defaults(void **state)
{
    (void)state;
    uint8_t rnd[4] = {0, 0, 1, 0};
    kvt_profiler *p = make_prof(1, 4, 16, 0.25, 0.25);
    feed_trace(p, 1, 4, rnd, 1, 16, 4, 32, 99);
    kvt_policy *pol;
    TU_OK(kvt_profiler_build_policy(p, NULL, 0, &pol));
    for (uint32_t h = 0; h < 4; h++) {
        kvt_policy_head_info info = {.struct_size = sizeof info};
        TU_OK(kvt_policy_head_get(pol, 0, h, &info));
        assert_int_equal(info.head_class, h == 2 ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE);
        assert_int_equal(info.top_k_pages, 64);
        assert_int_equal(info.rerank_interval, h == 2 ? 1u : 16u);
    }
    kvt_geometry a, b = geom(1, 4);
    TU_OK(kvt_policy_geometry_get(pol, &a));
    assert_memory_equal(&a, &b, sizeof a);
    kvt_policy_destroy(pol);
    kvt_profiler_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rco_hand),
        cmocka_unit_test(test_ts_hand),
        cmocka_unit_test(test_classify_synthetic),
        cmocka_unit_test(test_benefit_hand),
        cmocka_unit_test(test_benefit_vs_reference),
        cmocka_unit_test(test_windows_vs_brute),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_build_defaults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
