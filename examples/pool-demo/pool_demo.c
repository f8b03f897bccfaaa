/* kvtier-pool-demo: the end-to-end example of this release. It creates a
 * tiered pool for a Llama-like KV geometry (a quarter of the KV heads
 * unstable, the rest stable with a 2048-token top-K; the device tier sized
 * by kvt_pool_sizing_get, every page offloaded once to the host tier),
 * prefills one long sequence layer by layer from f32 activations (as an
 * engine would), warms it up from the last prompt queries, decodes with the
 * fused rerank/recycle and sparse attention against a dense reference,
 * verifies the invariants, and prints the pool's stats and throughput.
 *
 *   kvtier-pool-demo [--tokens N] [--layers L] [--kv-heads H] [--head-dim D]
 *                    [--page P] [--decode N] [--dtype f16|bf16|f32]
 */
#include <kvtier/kvtier.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
    /* Tiered placement: a quarter of the KV heads (every fourth) unstable,
     * keeping every page on device; the others stable, keeping their sink,
     * local and last pages and a 2048-token top-K on device, reranked every
     * 16 steps, with every full page offloaded once to the host tier. */
    kvt_head_class *cls = calloc((size_t)L * H, sizeof *cls);
    if (!cls)
        return 1;
    for (uint32_t i = 0; i < L * H; i++)
        cls[i] = i % 4 == 0 ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE;
    kvt_policy_opts po;
    kvt_policy_opts_init(&po);
    po.top_k_pages = 2048 / P;
    kvt_policy_heads ph = {.struct_size = sizeof ph, .n_heads = L * H, .head_class = cls};
    kvt_policy *pol;
    CHECK(kvt_policy_create_heads(&o.geom, &po, &ph, &pol));
    kvt_selector *sel;
    kvt_selector_opts so;
    kvt_selector_opts_init(&so);
    so.top_k_pages = 2048 / P;
    CHECK(kvt_selector_create(&o.geom, &so, &sel));
    o.policy = pol;
    o.selector = sel;
    /* The device tier is sized by the library for this context and policy
     * (kvt_pool_sizing_get); the host tier holds every page. */
    o.device_bytes = 0;
    o.target_tokens = total + 1;
    o.target_seqs = 1;
    o.host_bytes = (pages + 1 + (uint64_t)L * H) * block_bytes;
    o.max_seq_tokens = (uint32_t)total + 1;
    kvt_pool_sizing sz = {.struct_size = sizeof sz};
    CHECK(kvt_pool_sizing_get(&o, &sz));

    kvt_pool *pool;
    kvt_seq_id seq;
    CHECK(kvt_pool_create(&o, &pool));
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
    /* Importance-guided warm-up: the queries of the last 16 prompt tokens
     * (here random, like the keys) choose which pages start on device. */
    {
        const uint32_t n_obs = 16;
        const size_t nq = (size_t)L * n_obs * 4 * H * D;
        float *obs = malloc(nq * sizeof *obs);
        if (!obs)
            return 1;
        for (size_t i = 0; i < nq; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            obs[i] = (float)((int64_t)(rng >> 33) - (1ll << 30)) / (float)(1 << 29);
        }
        CHECK(kvt_seq_warmup(pool, seq, obs, n_obs));
        free(obs);
    }
    /* Decode: one step plan per token; per layer the engine appends the
     * token's K/V and attends over the selected pages (2048-token budget,
     * MINMAX scores, summed over the 4 query heads of each KV head). After
     * each step a dense step over the same cache gives the reference. */
    const size_t qn = (size_t)o.geom.n_q_heads * D;
    float *q = malloc(qn * sizeof *q), *out_s = malloc(qn * sizeof *out_s),
          *out_d = malloc(qn * sizeof *out_d);
    float *lse_s = malloc(o.geom.n_q_heads * sizeof *lse_s),
          *lse_d = malloc(o.geom.n_q_heads * sizeof *lse_d);
    if (!q || !out_s || !out_d || !lse_s || !lse_d)
        return 1;
    double t_append = 0, t_sparse = 0, t_dense = 0, mass = 0;
    uint64_t n_mass = 0;
    for (uint32_t s = 0; s < decode; s++) {
        kvt_step_opts sp;
        kvt_step_opts_init(&sp); /* the pool's selector and policy */
        kvt_step *step;
        CHECK(kvt_step_plan(pool, &seq, 1, &sp, &step));
        for (uint32_t l = 0; l < L; l++) {
            for (size_t i = 0; i < qn; i++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                q[i] = (float)((int64_t)(rng >> 33) - (1ll << 30)) / (float)(1 << 29);
            }
            t0 = now_s();
            CHECK(kvt_step_append(step, l, k + (size_t)(s % chunk) * row, v + (size_t)(s % chunk) * row,
                                  KVT_DTYPE_F32, 0));
            double t1 = now_s();
            CHECK(kvt_step_select(step, l, q));
            CHECK(kvt_step_decode(step, l, q, out_s, lse_s));
            double t2 = now_s();
            t_append += t1 - t0;
            t_sparse += t2 - t1;
            /* The dense reference needs its own step; this one is done with l. */
            if (l + 1 == L)
                CHECK(kvt_step_finish(step));
            kvt_step_opts dp;
            kvt_step_opts_init(&dp);
            dp.flags = KVT_STEP_DENSE;
            kvt_step *dstep = NULL;
            if (l + 1 == L) {
                CHECK(kvt_step_plan(pool, &seq, 1, &dp, &dstep));
                t0 = now_s();
                CHECK(kvt_step_attend(dstep, l, q, out_d, lse_d));
                t_dense += now_s() - t0;
                CHECK(kvt_step_finish(dstep));
                /* exp(lse_sparse - lse_dense): the share of the full
                 * softmax mass that the selected pages carry. */
                for (uint32_t h = 0; h < o.geom.n_q_heads; h++, n_mass++)
                    mass += exp((double)lse_s[h] - (double)lse_d[h]);
            }
        }
    }
    free(q);
    free(out_s);
    free(out_d);
    free(lse_s);
    free(lse_d);
    CHECK(kvt_pool_check(pool));

    kvt_stats st = {.struct_size = sizeof st};
    CHECK(kvt_pool_stats_get(pool, &st));
    double kv_bytes = (double)total * L * H * D * 2 * (double)kvt_dtype_size(dtype);
    printf("sequence: %llu tokens (%u prefill + %u decode)\n",
           (unsigned long long)st.n_tokens, tokens, decode);
    printf("device tier: %llu of %llu blocks used (%.1f MiB of %.1f MiB), %llu pages\n",
           (unsigned long long)st.tier[KVT_TIER_DEVICE].blocks_used,
           (unsigned long long)st.tier[KVT_TIER_DEVICE].blocks_total,
           (double)st.tier[KVT_TIER_DEVICE].bytes_used / 1048576.0,
           (double)st.tier[KVT_TIER_DEVICE].bytes_total / 1048576.0,
           (unsigned long long)st.tier[KVT_TIER_DEVICE].pages);
    printf("  vs dense: %.1f%% of the %.1f MiB a pool without placement needs (sized for %.1f%%); "
           "host tier %.1f MiB, %llu pages offloaded once\n",
           100.0 * (double)st.tier[KVT_TIER_DEVICE].bytes_used / (double)(sz.dense_bytes - block_bytes),
           (double)(sz.dense_bytes - block_bytes) / 1048576.0,
           100.0 * (double)sz.device_pages / (double)sz.dense_pages,
           (double)st.tier[KVT_TIER_HOST].bytes_used / 1048576.0,
           (unsigned long long)st.offloaded_pages);
    printf("placement: %llu pages promoted host->device (%.1f MiB, %.2f per step), "
           "%.1f%% of selected pages already on device\n",
           (unsigned long long)st.promoted_pages,
           (double)st.moved_bytes[KVT_DIR_HOST_TO_DEVICE] / 1048576.0,
           (double)st.promoted_pages / (decode ? decode : 1),
           100.0 * (double)st.sel_resident / (double)(st.sel_pages ? st.sel_pages : 1));
    printf("metadata store: %llu pages described, %.1f MiB (min/max/mean keys per page)\n",
           (unsigned long long)st.meta_pages_used, (double)st.meta_bytes_total / 1048576.0);
    printf("prefill append: %.3f s, %.2f GB/s of KV written (f32 -> storage dtype)\n",
           t_prefill, kv_bytes * tokens / (double)total / t_prefill / 1e9);
    printf("decode append: %.1f us per token for all %u layers\n",
           t_append * 1e6 / (decode ? decode : 1), L);
    if (decode) {
        const char *isa = "?";
        CHECK(kvt_pool_kernel_isa_get(pool, &isa));
        printf("decode attention (rerank/recycle + sparse decode, %s, %u threads): sparse %.3f ms/layer "
               "(2048-token budget), dense %.3f ms/layer (last layer of each step)\n",
               isa, (unsigned)sysconf(_SC_NPROCESSORS_ONLN), t_sparse * 1e3 / ((double)decode * L),
               t_dense * 1e3 / decode);
        printf("softmax mass on the selected pages: %.1f%% (random keys have no structure "
               "to find, so about the budget's share of the tokens: %.1f%%)\n",
               100.0 * mass / (double)(n_mass ? n_mass : 1), 100.0 * 2048.0 / (double)total);
    }
    printf("kvt_pool_check: ok\n");
    free(k);
    free(v);
    kvt_pool_destroy(pool);
    kvt_selector_destroy(sel);
    kvt_policy_destroy(pol);
    free(cls);
    return 0;
}
