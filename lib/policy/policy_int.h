/* Internal declarations of the policy area (lib/policy), shared with the
 * step plan (lib/attn/step.c). Prefix kvt__, never exported. */
#ifndef KVTIER_POLICY_INT_H
#define KVTIER_POLICY_INT_H

#include "../core/store.h"

/* ---- policy (policy.c) --------------------------------------------------- */
/* A tiered pool's stable head (lh = layer * H + head). */
KVT__HIDDEN bool kvt__stable(const kvt_pool *p, size_t lh);
struct kvt_policy {
    kvt_geometry g;     /* resolved */
    uint32_t n;         /* n_layers * n_kv_heads */
    uint32_t n_unstable;
    /* [n] each, head (layer, kv_head) at layer * n_kv_heads + kv_head; one
     * allocation starting at cls. */
    uint32_t *cls, *k, *window, *sink, *local, *interval;
    float *sim; /* [n] the selection cache's thresholds (own allocation) */
};

/* Builds a policy from complete per-head arrays (each [L * H]); checks
 * every value, naming it with `what` ("heads->window[3]" style prefix).
 * code is the error code for a bad value (KVT_EINVAL from the API,
 * KVT_ECORRUPT from a profile file). */
KVT__HIDDEN int kvt__policy_build(kvt_policy **out, const kvt_geometry *g, const uint32_t *cls,
                                  const uint32_t *k, const uint32_t *window,
                                  const uint32_t *sink, const uint32_t *local,
                                  const uint32_t *interval, const float *sim,
                                  const char *what, int code);
/* Copies and checks policy options (NULL = the defaults); messages name
 * the argument `name`. */
KVT__HIDDEN int kvt__policy_opts_get(kvt_policy_opts *o, const kvt_policy_opts *opts,
                                     const char *name);
/* Checks that two resolved geometries are the same (every field), naming
 * `what` and the differing field in the KVT_EINVAL message. */
KVT__HIDDEN int kvt__geometry_same(const kvt_geometry *a, const kvt_geometry *b,
                                   const char *what, const char *a_name, const char *b_name);

/* ---- profiler (profiler.c) ------------------------------------------------- */
/* FlexiCache's random-corrected overlap of two top-K sets (strictly
 * increasing page lists), with K = nb and N = n_candidates of the later
 * step: max(0, (|a & b| / K - K / N) / (1 - K / N)). K == 0 and K == N
 * carry no information about stability (nothing, or everything, is
 * selected): both give 1, "nothing to reload". Requires nb <= N. */
KVT__HIDDEN double kvt__rco(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb,
                            uint32_t n_candidates);
/* Makes sure the stream exists and every head of it can record a set of up
 * to kcap pages without allocating. */
KVT__HIDDEN int kvt__profiler_reserve(kvt_profiler *prof, uint64_t stream, uint32_t kcap);
/* kvt_profiler_record without the argument checks (pages strictly
 * increasing, n_pages <= n_candidates, layer and head in range). */
KVT__HIDDEN int kvt__profiler_add(kvt_profiler *prof, uint64_t stream, uint32_t layer,
                                  uint32_t kv_head, const uint32_t *pages, uint32_t n_pages,
                                  uint32_t n_candidates);
KVT__HIDDEN const kvt_geometry *kvt__profiler_geometry(const kvt_profiler *prof);

/* ---- multiple-choice knapsack (mckp.c) ------------------------------------
 * n groups of m choices each: choice j of group i costs cost[i * m + j] and
 * is worth value[i * m + j]. Exactly one choice per group; the summed cost
 * at most budget; the summed value as large as possible. Both write the
 * chosen index of every group to choice[n] and the summed value to *total.
 * KVT_ERANGE when even the cheapest choices exceed the budget.
 *
 * kvt__mckp_dp is exact: dynamic programming over the budget divided by
 * the greatest common divisor of the costs, O(n * m * budget / gcd) time
 * and n * (budget / gcd + 1) bytes; KVT_EOVERFLOW above max_cells cells.
 * Among equal totals it prefers, group by group from the last, the lower
 * index.
 *
 * kvt__mckp_greedy is KVDRIVE's benefit/cost heuristic: every group starts
 * at its cheapest choice (lowest index among equals), then, while one fits,
 * the upgrade (to a costlier choice of one group) with the best value gain
 * per extra cost is taken (ties: the larger gain, then the lower group and
 * choice); upgrades with no gain are never taken. Its total is at most the
 * exact one. O(n * m) per upgrade, at most n * m upgrades. */
KVT__HIDDEN int kvt__mckp_dp(uint32_t n, uint32_t m, const uint64_t *cost, const double *value,
                             uint64_t budget, uint64_t max_cells, uint32_t *choice,
                             double *total);
KVT__HIDDEN int kvt__mckp_greedy(uint32_t n, uint32_t m, const uint64_t *cost,
                                 const double *value, uint64_t budget, uint32_t *choice,
                                 double *total);

#endif /* KVTIER_POLICY_INT_H */
