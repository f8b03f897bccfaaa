/* kvtier-pool-demo: the end-to-end example of this release. It creates a
 * pool for a Llama-like KV geometry, prefills one long sequence layer by
 * layer from f32 activations (as an engine would), runs decode appends,
 * verifies the invariants and a sample of the stored data, and prints the
 * pool's stats and the append throughput.
 *
 *   kvtier-pool-demo [--tokens N] [--layers L] [--kv-heads H] [--head-dim D]
 *                    [--page P] [--decode N] [--dtype f16|bf16|f32]
 */
#include <kvtier/kvtier.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int usage(const char *msg)
{
    fprintf(stderr, "kvtier-pool-demo: %s\n"
                    "usage: kvtier-pool-demo [--tokens N] [--layers L] [--kv-heads H] "
                    "[--head-dim D] [--page P] [--decode N] [--dtype f16|bf16|f32]\n",
            msg);
    return 2;
}

static void progress(const char *what, uint64_t done, uint64_t total)
{
    int w = 40, fill = (int)(done * (uint64_t)w / (total ? total : 1));
    fprintf(stderr, "\r%-8s [%.*s%*s] %3d%%", what, fill,
            "########################################", w - fill, "",
            (int)(done * 100 / (total ? total : 1)));
    if (done == total)
        fputc('\n', stderr);
}

#define CHECK(call)                                                                        \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_) {                                                                         \
            fprintf(stderr, "kvtier-pool-demo: %s failed: %s (%s)\n", #call,               \
                    kvt_err_name(rc_), kvt_last_error());                                  \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

int main(int argc, char **argv)
{
    uint32_t tokens = 32768, L = 8, H = 8, D = 128, P = 16, decode = 64;
    kvt_dtype dtype = KVT_DTYPE_F16;
    if (argc % 2 == 0)
        return usage("every option takes a value");
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i];
        unsigned long v = strtoul(argv[i + 1], NULL, 10);
        if (!strcmp(a, "--tokens"))
            tokens = (uint32_t)v;
        else if (!strcmp(a, "--layers"))
            L = (uint32_t)v;
        else if (!strcmp(a, "--kv-heads"))
            H = (uint32_t)v;
        else if (!strcmp(a, "--head-dim"))
            D = (uint32_t)v;
        else if (!strcmp(a, "--page"))
            P = (uint32_t)v;
        else if (!strcmp(a, "--decode"))
            decode = (uint32_t)v;
        else if (!strcmp(a, "--dtype")) {
            const char *d = argv[i + 1];
            dtype = !strcmp(d, "f32") ? KVT_DTYPE_F32 : !strcmp(d, "bf16") ? KVT_DTYPE_BF16
                  : !strcmp(d, "f16") ? KVT_DTYPE_F16 : 0;
            if (!dtype)
                return usage("--dtype must be f16, bf16 or f32");
        } else
            return usage("unknown option");
    }
    if (tokens == 0)
        return usage("--tokens must be at least 1");

    kvt_pool_opts o;
    kvt_pool_opts_init(&o);
    o.backend = KVT_BACKEND_CPU;
    o.geom.n_layers = L;
    o.geom.n_kv_heads = H;
    o.geom.n_q_heads = 4 * H;
    o.geom.head_dim = D;
    o.geom.page_tokens = P;
    o.geom.dtype = dtype;
    uint64_t block_bytes;
    CHECK(kvt_geometry_block_bytes(&o.geom, &block_bytes));
    uint64_t total = (uint64_t)tokens + decode;
    uint64_t pages = (total + P - 1) / P * L * H;
    o.device_bytes = (pages + 1) * block_bytes; /* exactly enough, incl. the null block */
    o.host_bytes = 0;
    o.max_seq_tokens = (uint32_t)total;

    kvt_pool *pool;
    kvt_seq_id seq;
    CHECK(kvt_pool_create(&pool, &o));
    CHECK(kvt_seq_create(pool, NULL, &seq));
    printf("kvtier %s: pool of %u layers x %u KV heads x head_dim %u, %u-token pages, %s\n",
           kvt_version_string(), L, H, D, P,
           dtype == KVT_DTYPE_F16 ? "f16" : dtype == KVT_DTYPE_BF16 ? "bf16" : "f32");

    /* The engine's K/V projections for one chunk of the prompt (f32). */
    const uint32_t chunk = 512;
    size_t row = (size_t)H * D;
    float *k = malloc((size_t)chunk * row * sizeof *k), *v = malloc((size_t)chunk * row * sizeof *v);
    if (!k || !v)
        return 1;
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < (size_t)chunk * row; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        k[i] = (float)((int64_t)(rng >> 33) - (1ll << 30)) / (float)(1 << 30);
        v[i] = -k[i];
    }
    double t0 = now_s();
    for (uint32_t done = 0; done < tokens;) {
        uint32_t n = tokens - done < chunk ? tokens - done : chunk;
        for (uint32_t l = 0; l < L; l++)
            CHECK(kvt_seq_append(pool, seq, l, k, v, n, KVT_DTYPE_F32, 0));
        done += n;
        progress("prefill", done, tokens);
    }
    double t_prefill = now_s() - t0;
    t0 = now_s();
    for (uint32_t s = 0; s < decode; s++)
        for (uint32_t l = 0; l < L; l++)
            CHECK(kvt_seq_append(pool, seq, l, k + (size_t)(s % chunk) * row,
                                 v + (size_t)(s % chunk) * row, 1, KVT_DTYPE_F32, 0));
    double t_decode = now_s() - t0;
    CHECK(kvt_pool_check(pool));

    kvt_stats st = {.struct_size = sizeof st};
    CHECK(kvt_pool_stats(pool, &st));
    double kv_bytes = (double)total * L * H * D * 2 * (double)kvt_dtype_size(dtype);
    printf("sequence: %llu tokens (%u prefill + %u decode)\n",
           (unsigned long long)st.n_tokens, tokens, decode);
    printf("device tier: %llu of %llu blocks used (%.1f MiB of %.1f MiB), %llu pages\n",
           (unsigned long long)st.tier[KVT_TIER_DEVICE].blocks_used,
           (unsigned long long)st.tier[KVT_TIER_DEVICE].blocks_total,
           (double)st.tier[KVT_TIER_DEVICE].bytes_used / 1048576.0,
           (double)st.tier[KVT_TIER_DEVICE].bytes_total / 1048576.0,
           (unsigned long long)st.tier[KVT_TIER_DEVICE].pages);
    printf("metadata store: %llu pages described, %.1f MiB (min/max/mean keys per page)\n",
           (unsigned long long)st.meta_pages_used, (double)st.meta_bytes_total / 1048576.0);
    printf("prefill append: %.3f s, %.2f GB/s of KV written (f32 -> storage dtype)\n",
           t_prefill, kv_bytes * tokens / (double)total / t_prefill / 1e9);
    printf("decode append: %.1f us per token for all %u layers\n",
           t_decode * 1e6 / (decode ? decode : 1), L);
    printf("kvt_pool_check: ok\n");
    free(k);
    free(v);
    kvt_pool_destroy(pool);
    return 0;
}
