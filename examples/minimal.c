#include <kvtier/kvtier.h>
#include <stdio.h>

int main(void) {
    kvt_pool_opts o;                       /* the README's usage example */
    kvt_pool_opts_init(&o);
    o.geom = (kvt_geometry){.n_layers = 2, .n_kv_heads = 2, .n_q_heads = 8, .head_dim = 64};
    o.device_bytes = 64u << 20;            /* device tier: 64 MiB */
    kvt_pool *pool; kvt_seq_id seq;
    static float k[100][2][64], v[100][2][64];   /* [token][kv head][dim], from the engine */
    int rc = kvt_pool_create(&o, &pool);
    if (!rc) rc = kvt_seq_create(pool, NULL, &seq);
    for (uint32_t layer = 0; !rc && layer < 2; layer++) {   /* prefill 99, decode 1 */
        rc = kvt_seq_append(pool, seq, layer, k, v, 99, KVT_DTYPE_F32, 0);
        if (!rc) rc = kvt_seq_append(pool, seq, layer, k[99], v[99], 1, KVT_DTYPE_F32, 0);
    }
    kvt_stats st = {.struct_size = sizeof st};
    if (!rc) rc = kvt_pool_stats_get(pool, &st);
    if (rc) fprintf(stderr, "kvtier: %s: %s\n", kvt_err_name(rc), kvt_last_error());
    else printf("%llu tokens in %llu device blocks\n", (unsigned long long)st.n_tokens,
                (unsigned long long)st.tier[KVT_TIER_DEVICE].blocks_used);
    kvt_pool_destroy(pool);
    return rc ? 1 : 0;
}
