/* The multiple-choice knapsack behind window scaling: one window size per
 * stable head, the summed reload benefit as large as possible under a
 * device-page budget. An exact dynamic program (budgets in units of the
 * costs' greatest common divisor are small for real models, since every
 * cost is a multiple of a head's top-K) and KVDRIVE's greedy, which the
 * tests hold against the exact answer. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "policy_int.h"

static uint64_t kvt__gcd(uint64_t a, uint64_t b)
{
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Sum of each group's cheapest and costliest choice. */
static int kvt__mckp_bounds(uint32_t n, uint32_t m, const uint64_t *cost, uint64_t *lo,
                            uint64_t *hi)
{
    uint64_t a = 0, b = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t mn = UINT64_MAX, mx = 0;
        for (uint32_t j = 0; j < m; j++) {
            const uint64_t c = cost[(size_t)i * m + j];
            mn = c < mn ? c : mn;
            mx = c > mx ? c : mx;
        }
        if (!kvt__add_u64(a, mn, &a) || !kvt__add_u64(b, mx, &b))
            return kvt__err(KVT_EOVERFLOW, "mckp: the summed costs of %u groups overflow", n);
    }
    *lo = a;
    *hi = b;
    return 0;
}

static int kvt__mckp_args(uint32_t n, uint32_t m, const uint64_t *cost, const double *value,
                          const uint32_t *choice, const double *total)
{
    if (m == 0 || m > 256)
        return kvt__err(KVT_EINVAL, "mckp: %u choices per group (1..256)", m);
    if (n && (!cost || !value || !choice))
        return kvt__err(KVT_EINVAL, "mckp: NULL arrays");
    if (!total)
        return kvt__err(KVT_EINVAL, "mckp: total must not be NULL");
    if ((size_t)n > SIZE_MAX / m / sizeof(uint64_t))
        return kvt__err(KVT_EOVERFLOW, "mckp: %u groups x %u choices overflow", n, m);
    return 0;
}

int kvt__mckp_dp(uint32_t n, uint32_t m, const uint64_t *cost, const double *value,
                 uint64_t budget, uint64_t max_cells, uint32_t *choice, double *total)
{
    int rc = kvt__mckp_args(n, m, cost, value, choice, total);
    if (rc)
        return rc;
    uint64_t lo, hi;
    if ((rc = kvt__mckp_bounds(n, m, cost, &lo, &hi)))
        return rc;
    if (lo > budget)
        return kvt__err(KVT_ERANGE, "mckp: the cheapest choices cost %llu, above the budget "
                        "%llu", (unsigned long long)lo, (unsigned long long)budget);
    uint64_t g = 0;
    for (size_t e = 0; e < (size_t)n * m; e++)
        g = kvt__gcd(cost[e], g);
    /* Beyond the costliest combination a larger budget changes nothing. */
    const uint64_t cap = budget < hi ? budget : hi;
    const uint64_t B = g ? cap / g : 0;
    uint64_t cells;
    if (!kvt__mul_u64(n, B + 1u, &cells) || cells > max_cells || cells > SIZE_MAX / 2)
        return kvt__err(KVT_EOVERFLOW, "mckp: %u groups x %llu budget units is above the %llu "
                        "cells allowed", n, (unsigned long long)(B + 1u),
                        (unsigned long long)max_cells);
    const size_t W = (size_t)B + 1u;
    double *prev = malloc(W * sizeof *prev), *cur = malloc(W * sizeof *cur);
    uint8_t *ch = malloc(cells ? (size_t)cells : 1u);
    if (!prev || !cur || !ch) {
        free(prev);
        free(cur);
        free(ch);
        return kvt__err(KVT_ENOMEM, "mckp: cannot allocate %llu cells",
                        (unsigned long long)cells);
    }
    /* prev[b]: the best value of the groups so far at a cost of at most
     * b units; -inf where none fits. */
    for (size_t b = 0; b < W; b++)
        prev[b] = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        const uint64_t *c = cost + (size_t)i * m;
        const double *v = value + (size_t)i * m;
        uint8_t *row = ch + (size_t)i * W;
        for (size_t b = 0; b < W; b++) {
            double best = -INFINITY;
            uint32_t bj = 0;
            for (uint32_t j = 0; j < m; j++) {
                const uint64_t u = g ? c[j] / g : 0;
                if (u > b || prev[b - u] == -INFINITY)
                    continue;
                const double x = prev[b - u] + v[j];
                if (x > best) {
                    best = x;
                    bj = j;
                }
            }
            cur[b] = best;
            row[b] = (uint8_t)bj;
        }
        double *t = prev;
        prev = cur;
        cur = t;
    }
    size_t b = W - 1;
    *total = prev[b];
    for (uint32_t i = n; i-- > 0;) {
        const uint32_t j = ch[(size_t)i * W + b];
        choice[i] = j;
        b -= g ? (size_t)(cost[(size_t)i * m + j] / g) : 0u;
    }
    free(prev);
    free(cur);
    free(ch);
    return 0;
}

int kvt__mckp_greedy(uint32_t n, uint32_t m, const uint64_t *cost, const double *value,
                     uint64_t budget, uint32_t *choice, double *total)
{
    int rc = kvt__mckp_args(n, m, cost, value, choice, total);
    if (rc)
        return rc;
    uint64_t lo, hi;
    if ((rc = kvt__mckp_bounds(n, m, cost, &lo, &hi)))
        return rc;
    if (lo > budget)
        return kvt__err(KVT_ERANGE, "mckp: the cheapest choices cost %llu, above the budget "
                        "%llu", (unsigned long long)lo, (unsigned long long)budget);
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        const uint64_t *c = cost + (size_t)i * m;
        const double *v = value + (size_t)i * m;
        uint32_t bj = 0;
        for (uint32_t j = 1; j < m; j++)
            if (c[j] < c[bj] || (c[j] == c[bj] && v[j] > v[bj]))
                bj = j;
        choice[i] = bj;
        sum += v[bj];
    }
    uint64_t left = budget - lo;
    for (;;) {
        double best_ratio = 0.0, best_gain = 0.0;
        uint32_t bi = UINT32_MAX, bj = 0;
        for (uint32_t i = 0; i < n; i++) {
            const uint64_t *c = cost + (size_t)i * m;
            const double *v = value + (size_t)i * m;
            const uint32_t j0 = choice[i];
            for (uint32_t j = 0; j < m; j++) {
                if (c[j] <= c[j0] || c[j] - c[j0] > left)
                    continue;
                const double gain = v[j] - v[j0];
                if (!(gain > 0.0))
                    continue;
                const double ratio = gain / (double)(c[j] - c[j0]);
                if (bi == UINT32_MAX || ratio > best_ratio ||
                    (ratio == best_ratio && gain > best_gain)) {
                    best_ratio = ratio;
                    best_gain = gain;
                    bi = i;
                    bj = j;
                }
            }
        }
        if (bi == UINT32_MAX)
            break;
        const uint64_t *c = cost + (size_t)bi * m;
        left -= c[bj] - c[choice[bi]];
        sum += value[(size_t)bi * m + bj] - value[(size_t)bi * m + choice[bi]];
        choice[bi] = bj;
    }
    /* Recomputed so that the total is the exact sum of the chosen values. */
    sum = 0.0;
    for (uint32_t i = 0; i < n; i++)
        sum += value[(size_t)i * m + choice[i]];
    *total = sum;
    return 0;
}
