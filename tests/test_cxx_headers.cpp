// The public headers compile as C++17 with -Wall -Wextra -Wpedantic -Werror
// and link against the C library (extern "C" guards work).
#include <kvtier/kvtier.h>

#include <cstdio>
#include <cstring>
#include <type_traits>

static_assert(std::is_standard_layout<kvt_pool_opts>::value, "C layout");
static_assert(std::is_trivially_copyable<kvt_stats>::value, "plain data");
static_assert(std::is_standard_layout<kvt_policy_heads>::value, "C layout");
static_assert(std::is_trivially_copyable<kvt_profiler_head_stats>::value, "plain data");

int main()
{
    kvt_pool_opts o;
    if (kvt_pool_opts_init(&o) != KVT_OK)
        return 1;
    o.backend = KVT_BACKEND_CPU;
    o.geom.n_layers = 2;
    o.geom.n_kv_heads = 2;
    o.geom.head_dim = 16;
    o.device_bytes = 1u << 20;
    kvt_pool *pool = nullptr;
    if (kvt_pool_create(&o, &pool) != KVT_OK) {
        std::fprintf(stderr, "create: %s\n", kvt_last_error());
        return 1;
    }
    kvt_seq_id seq = KVT_SEQ_NONE;
    float kv[3 * 2 * 16] = {};
    kv[5] = 1.5f;
    int rc = kvt_seq_create(pool, nullptr, &seq);
    if (rc == 0)
        rc = kvt_seq_append(pool, seq, 0, kv, kv, 3, KVT_DTYPE_F32, 0);
    kvt_stats st;
    std::memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    if (rc == 0)
        rc = kvt_pool_stats_get(pool, &st);
    if (rc == 0)
        rc = kvt_pool_check(pool);
    // A policy for the pool's model: two of four heads unstable.
    kvt_geometry g;
    kvt_policy_opts po;
    kvt_policy *pol = nullptr;
    const kvt_head_class cls[4] = {KVT_HEAD_STABLE, KVT_HEAD_UNSTABLE, KVT_HEAD_STABLE,
                                   KVT_HEAD_UNSTABLE};
    kvt_policy_heads heads;
    std::memset(&heads, 0, sizeof heads);
    heads.struct_size = sizeof heads;
    heads.n_heads = 4;
    heads.head_class = cls;
    uint32_t n_unstable = 0;
    if (rc == 0)
        rc = kvt_pool_geometry_get(pool, &g);
    if (rc == 0)
        rc = kvt_policy_opts_init(&po);
    if (rc == 0)
        rc = kvt_policy_create_heads(&g, &po, &heads, &pol);
    if (rc == 0)
        rc = kvt_policy_count_get(pol, KVT_HEAD_UNSTABLE, &n_unstable);
    kvt_policy_destroy(pol);
    if (rc == 0 && n_unstable != 2)
        rc = KVT_EINTERNAL;
    kvt_pool_destroy(pool);
    if (rc != 0 || st.tier[KVT_TIER_DEVICE].blocks_used != 2) {
        std::fprintf(stderr, "C++ consumer: %s: %s\n", kvt_err_name(rc), kvt_last_error());
        return 1;
    }
    std::printf("C++17 consumer: ok (kvtier %s)\n", kvt_version_string());
    return 0;
}
