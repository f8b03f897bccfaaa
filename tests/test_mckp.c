/* The window knapsack solvers (internal kvt__mckp_dp / kvt__mckp_greedy)
 * against exhaustive search: the exact solver must reach the brute-force
 * optimum, the greedy one a feasible total no larger, on random instances
 * and on window-shaped ones (cost w * K, w = 1..4). */
#include "testutil.h"

#include "../lib/policy/policy_int.h"

/* Exhaustive optimum: every combination of choices (m^n). Returns -inf
 * when none fits. */
static double brute(uint32_t n, uint32_t m, const uint64_t *cost, const double *value,
                    uint64_t budget)
{
    uint32_t idx[16] = {0};
    double best = -INFINITY;
    for (;;) {
        uint64_t c = 0;
        double v = 0;
        for (uint32_t i = 0; i < n; i++) {
            c += cost[i * m + idx[i]];
            v += value[i * m + idx[i]];
        }
        if (c <= budget && v > best)
            best = v;
        uint32_t i = 0;
        while (i < n && ++idx[i] == m)
            idx[i++] = 0;
        if (i == n)
            break;
    }
    return best;
}

/* A solver's answer: a choice per group, within budget, summing to total. */
static void check_answer(uint32_t n, uint32_t m, const uint64_t *cost, const double *value,
                         uint64_t budget, const uint32_t *choice, double total, const char *who)
{
    uint64_t c = 0;
    double v = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (choice[i] >= m)
            fail_msg("%s: group %u chose %u of %u", who, i, choice[i], m);
        c += cost[i * m + choice[i]];
        v += value[i * m + choice[i]];
    }
    if (c > budget)
        fail_msg("%s: cost %llu above budget %llu", who, (unsigned long long)c,
                 (unsigned long long)budget);
    if (v != total)
        fail_msg("%s: total %g, the choices sum to %g", who, total, v);
}

static void lo_hi(uint32_t n, uint32_t m, const uint64_t *cost, uint64_t *lo, uint64_t *hi)
{
    *lo = *hi = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t a = UINT64_MAX, b = 0;
        for (uint32_t j = 0; j < m; j++) {
            a = cost[i * m + j] < a ? cost[i * m + j] : a;
            b = cost[i * m + j] > b ? cost[i * m + j] : b;
        }
        *lo += a;
        *hi += b;
    }
}

static void run_instance(uint32_t n, uint32_t m, const uint64_t *cost, const double *value,
                         uint64_t budget, uint32_t *greedy_worse)
{
    uint32_t ch[16];
    double dp_total = -1, gr_total = -1;
    const double want = brute(n, m, cost, value, budget);
    uint64_t lo, hi;
    lo_hi(n, m, cost, &lo, &hi);
    if (lo > budget) {
        assert_true(want == -INFINITY);
        TU_EXPECT_ERR(kvt__mckp_dp(n, m, cost, value, budget, 1u << 20, ch, &dp_total),
                      KVT_ERANGE, "budget");
        TU_EXPECT_ERR(kvt__mckp_greedy(n, m, cost, value, budget, ch, &gr_total), KVT_ERANGE,
                      "budget");
        return;
    }
    TU_OK(kvt__mckp_dp(n, m, cost, value, budget, 1u << 20, ch, &dp_total));
    check_answer(n, m, cost, value, budget, ch, dp_total, "dp");
    if (dp_total != want)
        fail_msg("dp total %g, brute force %g (n %u, m %u, budget %llu)", dp_total, want, n, m,
                 (unsigned long long)budget);
    TU_OK(kvt__mckp_greedy(n, m, cost, value, budget, ch, &gr_total));
    check_answer(n, m, cost, value, budget, ch, gr_total, "greedy");
    if (gr_total > want)
        fail_msg("greedy total %g above the optimum %g", gr_total, want);
    *greedy_worse += gr_total < want;
}

static void test_random_instances(void **state)
{
    (void)state;
    tu_rng r = {0x6d636b70ull};
    uint64_t cost[64];
    double value[64];
    uint32_t worse = 0, runs = 0;
    for (int it = 0; it < 3000; it++) {
        const uint32_t n = tu_below(&r, 7), m = 1 + tu_below(&r, 4);
        /* A common unit, so that the DP's divisor reduction is exercised. */
        const uint64_t unit = 1 + tu_below(&r, 3) * (it % 5 == 0 ? 1000000007ull : 1ull);
        for (uint32_t e = 0; e < n * m; e++) {
            cost[e] = unit * tu_below(&r, 9);
            value[e] = (double)tu_below(&r, 50);
        }
        uint64_t lo, hi;
        lo_hi(n, m, cost, &lo, &hi);
        uint64_t budget;
        switch (tu_below(&r, 4)) {
        case 0:
            budget = lo ? lo - 1 : 0; /* infeasible when lo > 0 */
            break;
        case 1:
            budget = hi + unit * tu_below(&r, 3);
            break;
        default:
            budget = lo + (hi > lo ? tu_next(&r) % (hi - lo + 1) : 0);
            break;
        }
        run_instance(n, m, cost, value, budget, &worse);
        runs++;
    }
    print_message("greedy below the optimum in %u of %u random instances\n", worse, runs);
}

/* Window scaling as build_policy poses it: cost w * K, a benefit that
 * grows with w (hits within w * K recent pages). */
static void test_window_instances(void **state)
{
    (void)state;
    tu_rng r = {0x77696e64ull};
    uint64_t cost[32];
    double value[32];
    uint32_t worse = 0;
    for (int it = 0; it < 2000; it++) {
        const uint32_t n = 1 + tu_below(&r, 6), m = 4;
        const uint64_t K = 1 + tu_below(&r, 200);
        for (uint32_t i = 0; i < n; i++) {
            double v = (double)tu_below(&r, 1000);
            for (uint32_t w = 1; w <= m; w++) {
                cost[i * m + w - 1] = w * K;
                value[i * m + w - 1] = v;
                v += (double)tu_below(&r, 500);
            }
        }
        const uint64_t budget = n * K + K * tu_below(&r, 3 * n + 2);
        run_instance(n, m, cost, value, budget, &worse);
    }
    print_message("greedy below the optimum in %u of 2000 window instances\n", worse);
}

/* A case where benefit per page misleads the greedy: one group's small
 * upgrade has the best ratio but blocks a larger, more valuable one. */
static void test_greedy_suboptimal_case(void **state)
{
    (void)state;
    const uint64_t cost[] = {0, 1, 0, 10};
    const double value[] = {0, 2, 0, 15};
    uint32_t ch[2];
    double t;
    TU_OK(kvt__mckp_greedy(2, 2, cost, value, 10, ch, &t));
    assert_true(t == 2.0); /* takes ratio 2 first, then 10 no longer fits */
    assert_true(brute(2, 2, cost, value, 10) == 15.0);
    TU_OK(kvt__mckp_dp(2, 2, cost, value, 10, 1000, ch, &t));
    assert_true(t == 15.0);
    assert_int_equal(ch[0], 0);
    assert_int_equal(ch[1], 1);
}

static void test_limits_and_args(void **state)
{
    (void)state;
    uint64_t cost[8] = {0, 1, 0, 1, 0, 1, 0, 1};
    double value[8] = {0, 1, 0, 1, 0, 1, 0, 1};
    uint32_t ch[4];
    double t;
    /* 4 groups x (4 units + 1) cells = 20: allowed at 20, not at 19. */
    TU_OK(kvt__mckp_dp(4, 2, cost, value, 4, 20, ch, &t));
    assert_true(t == 4.0);
    TU_EXPECT_ERR(kvt__mckp_dp(4, 2, cost, value, 4, 19, ch, &t), KVT_EOVERFLOW, "cells");
    /* A huge budget is cut at the costliest combination. */
    TU_OK(kvt__mckp_dp(4, 2, cost, value, UINT64_MAX, 20, ch, &t));
    assert_true(t == 4.0);
    /* Costs that overflow when summed. */
    uint64_t big[4] = {UINT64_MAX, UINT64_MAX, UINT64_MAX / 2 + 2, UINT64_MAX / 2 + 2};
    double v4[4] = {1, 2, 3, 4};
    TU_EXPECT_ERR(kvt__mckp_dp(2, 2, big, v4, UINT64_MAX, 100, ch, &t), KVT_EOVERFLOW,
                  "overflow");
    TU_EXPECT_ERR(kvt__mckp_greedy(2, 2, big, v4, UINT64_MAX, ch, &t), KVT_EOVERFLOW,
                  "overflow");
    TU_EXPECT_ERR(kvt__mckp_dp(1, 0, cost, value, 1, 100, ch, &t), KVT_EINVAL, "choices");
    TU_EXPECT_ERR(kvt__mckp_greedy(1, 300, cost, value, 1, ch, &t), KVT_EINVAL, "choices");
    TU_EXPECT_ERR(kvt__mckp_dp(1, 2, NULL, value, 1, 100, ch, &t), KVT_EINVAL, "NULL");
    TU_EXPECT_ERR(kvt__mckp_greedy(1, 2, cost, value, 1, ch, NULL), KVT_EINVAL, "total");
    /* No groups: total 0. */
    TU_OK(kvt__mckp_dp(0, 2, NULL, NULL, 0, 100, NULL, &t));
    assert_true(t == 0.0);
    TU_OK(kvt__mckp_greedy(0, 2, NULL, NULL, 0, NULL, &t));
    assert_true(t == 0.0);
    /* Zero costs everywhere: the best value of each group. */
    uint64_t zc[6] = {0};
    double zv[6] = {3, 1, 2, 5, 5, 0};
    TU_OK(kvt__mckp_dp(2, 3, zc, zv, 0, 100, ch, &t));
    assert_true(t == 8.0);
    TU_OK(kvt__mckp_greedy(2, 3, zc, zv, 0, ch, &t));
    assert_true(t == 8.0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_instances),
        cmocka_unit_test(test_window_instances),
        cmocka_unit_test(test_greedy_suboptimal_case),
        cmocka_unit_test(test_limits_and_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
