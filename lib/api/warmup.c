/* kvt_seq_warmup: the public importance-guided warm-up after a prefill.
 * Checks the arguments and the pool's state, then lets the placement
 * (lib/tier/place.c) score and place the sequence's pages. */
#include "../core/store.h"
#include "../step/step.h"
#include "../tier/tier.h"

KVT_API int kvt_seq_warmup(kvt_pool *pool, kvt_seq_id seq, const float *obs_queries,
                           uint32_t n_obs)
{
    KVT__CHECK_NULL(pool);
    kvt__seq *s;
    int rc = kvt__seq_lookup(pool, seq, &s);
    if (rc || (rc = kvt__seq_loading_err(s, "kvt_seq_warmup")))
        return rc;
    KVT__CHECK_NULL(obs_queries);
    if (n_obs == 0)
        return kvt__err(KVT_EINVAL, "n_obs: must be at least 1");
    if (n_obs > 65536)
        return kvt__err(KVT_EINVAL, "n_obs: %u queries; at most 65536", n_obs);
    if (!pool->pol)
        return kvt__err(KVT_EINVAL, "pool: has no placement policy (kvt_pool_opts.policy)");
    if (!pool->sel)
        return kvt__err(KVT_EINVAL, "pool: has no selector (kvt_pool_opts.selector) to score "
                        "pages with");
    if (pool->step && kvt__step_is_open(pool->step))
        return kvt__err(KVT_ESTATE, "pool: a step is open; warm up before kvt_step_plan or "
                        "after kvt_step_finish");
    return kvt__place_warmup(pool, s, seq, obs_queries, n_obs);
}
