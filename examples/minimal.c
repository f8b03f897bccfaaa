/* The README's usage example: a pool, one sequence, prefill + decode. */
#include <kvtier/kvtier.h>
#include <stdio.h>

int main(void)
{
    kvt_pool_opts o;
    kvt_pool_opts_init(&o);
    o.geom = (kvt_geometry){.n_layers = 2, .n_kv_heads = 2, .n_q_heads = 8, .head_dim = 64};
    o.device_bytes = 64u << 20; /* device tier: 64 MiB */
    kvt_pool *pool;
    kvt_seq_id seq;
    if (kvt_pool_create(&pool, &o) || kvt_seq_create(pool, NULL, &seq)) {
        fprintf(stderr, "kvtier: %s\n", kvt_last_error());
        return 1;
    }
    static float k[100][2][64], v[100][2][64]; /* [tokens][kv heads][head_dim] */
    for (uint32_t layer = 0; layer < 2; layer++) /* prefill 99 tokens, then decode 1 */
        if (kvt_seq_append(pool, seq, layer, k, v, 99, KVT_DTYPE_F32, 0) ||
            kvt_seq_append(pool, seq, layer, k[99], v[99], 1, KVT_DTYPE_F32, 0))
            fprintf(stderr, "append: %s\n", kvt_last_error());
    kvt_stats st = {.struct_size = sizeof st};
    kvt_pool_stats(pool, &st);
    printf("%llu tokens in %llu device blocks\n", (unsigned long long)st.n_tokens,
           (unsigned long long)st.tier[KVT_TIER_DEVICE].blocks_used);
    kvt_pool_destroy(pool);
    return 0;
}
