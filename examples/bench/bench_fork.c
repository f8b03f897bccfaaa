/* kvtier-bench fork: a long prompt forked into several children that decode
 * on their own (parallel sampling), against as many independent sequences
 * holding their own copy of the prompt. One JSON object per pool run and a
 * summary line with fork_bytes_ratio, fork_us_per_1k_pages and
 * fork_step_time_ratio (see examples/bench/README.md).
 *
 *   kvtier-bench fork [--ctx 32k] [--children 8] [--steps 64] [--layers 4]
 *                     [--kv-heads 8] [--q-heads 32] [--head-dim 128] [--page 32]
 *                     [--top-k 64] [--runs 3] [--quick] [--help]
 *
 * Each run builds two pools of the same size in turn (CPU backend, f16):
 * "fork": one parent prefilled with --ctx tokens in every layer, forked
 * --children times (timed); "copies": --children sequences each prefilled
 * with the same tokens. Then each decodes --steps steps over the children
 * (one new token each per layer, sparse attention with a top-K selector
 * reranking every step). Bytes: device blocks and metadata in use after the
 * steps. The ratios are fork / copies within a run; the summary takes the
 * median over the runs.
 */
#include "bench_io.h"

#include <kvtier/kvtier.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROG "kvtier-bench fork"
#define FORK_MAX_RUNS 15u
#define FORK_MAX_CHILDREN 64u

#define TARGET_BYTES_RATIO (1.0 / 6.0)
#define TARGET_STEP_RATIO 1.10

static const char *fork_usage =
    "usage: kvtier-bench fork [options]\n"
    "  --ctx N            prompt tokens (default 32k)\n"
    "  --children N       forks of the prompt / independent copies (default 8)\n"
    "  --steps N          decode steps of the children (default 64)\n"
    "  --layers N         layers (default 4: 512 MiB of prompt KV at the defaults)\n"
    "  --kv-heads N       KV heads (default 8)\n"
    "  --q-heads N        query heads (default 32)\n"
    "  --head-dim N       head dimension (default 128)\n"
    "  --page N           tokens per page (default 32)\n"
    "  --top-k N          pages each head attends besides sink and local (default 64)\n"
    "  --runs N           runs, each both pools (default 3; median of the ratios)\n"
    "  --quick            ctx 8k, 2 layers, 16 steps, 1 run (a smoke test; explicit flags win)\n"
    "Prints one JSON object per pool run on stdout and a summary line, progress on stderr.\n";

typedef struct {
    uint32_t ctx, children, steps, layers, kv_heads, q_heads, head_dim, page, top_k, runs;
} fork_opts;

typedef struct {
    double build_s;      /* fork: the forks; copies: the prefills of the copies */
    double step_ms;      /* median step (all layers, all children) */
    uint64_t dev_bytes;  /* device blocks in use after the steps */
    uint64_t meta_bytes; /* metadata slots in use after the steps */
    uint64_t pages;      /* pages of the prompt (layers x heads x pages) */
} fork_run;

static void run_pool(const fork_opts *o, bool fork, const uint16_t *prompt, fork_run *r)
{
    const uint32_t L = o->layers, H = o->kv_heads, D = o->head_dim, P = o->page;
    const uint32_t C = o->children;
    const uint64_t ppl = (uint64_t)(o->ctx + o->steps + P - 1) / P + 1; /* pages per head */
    kvt_pool_opts po;
    CHECK(kvt_pool_opts_init(&po));
    po.backend = KVT_BACKEND_CPU;
    po.geom.n_layers = L;
    po.geom.n_kv_heads = H;
    po.geom.n_q_heads = o->q_heads;
    po.geom.head_dim = D;
    po.geom.page_tokens = P;
    po.geom.dtype = KVT_DTYPE_F16;
    /* Room for the copies (the larger need), so both pools are alike. */
    po.device_bytes = (uint64_t)C * L * H * ppl * 2u * P * D * 2u + (64u << 20);
    po.max_seqs = C + 1;
    po.max_seq_tokens = o->ctx + o->steps + P;
    kvt_pool *pool;
    CHECK(kvt_pool_create(&po, &pool));
    kvt_seq_id *kids = bench_xmalloc(C * sizeof *kids);
    const size_t tok = (size_t)H * D;
    kvt_seq_id parent = 0;
    double t0;
    if (fork) {
        CHECK(kvt_seq_create(pool, NULL, &parent));
        for (uint32_t l = 0; l < L; l++)
            CHECK(kvt_seq_append(pool, parent, l, prompt, prompt + (size_t)o->ctx * tok, o->ctx,
                                 KVT_DTYPE_F16, 0));
        t0 = bench_now();
        for (uint32_t c = 0; c < C; c++)
            CHECK(kvt_seq_fork(pool, parent, NULL, &kids[c]));
        r->build_s = bench_now() - t0;
    } else {
        t0 = bench_now();
        for (uint32_t c = 0; c < C; c++) {
            CHECK(kvt_seq_create(pool, NULL, &kids[c]));
            for (uint32_t l = 0; l < L; l++)
                CHECK(kvt_seq_append(pool, kids[c], l, prompt, prompt + (size_t)o->ctx * tok,
                                     o->ctx, KVT_DTYPE_F16, 0));
        }
        r->build_s = bench_now() - t0;
    }
    r->pages = (uint64_t)L * H * ((o->ctx + P - 1) / P);

    kvt_selector_opts so;
    CHECK(kvt_selector_opts_init(&so));
    so.top_k_pages = o->top_k;
    kvt_selector *sel;
    kvt_geometry g = po.geom;
    CHECK(kvt_selector_create(&g, &so, &sel));
    kvt_step_opts sto;
    CHECK(kvt_step_opts_init(&sto));
    sto.selector = sel;
    uint16_t *kv = bench_xmalloc((size_t)C * tok * 2u * sizeof *kv);
    float *q = bench_xmalloc((size_t)C * o->q_heads * D * sizeof *q);
    float *out = bench_xmalloc((size_t)C * o->q_heads * D * sizeof *out);
    float *lse = bench_xmalloc((size_t)C * o->q_heads * sizeof *lse);
    double *st = bench_xmalloc(o->steps * sizeof *st);
    uint64_t x = 12345;
    for (uint32_t s = 0; s < o->steps; s++) {
        /* Each child its own token and queries (the samples diverge). */
        bench_fill_f16(kv, (size_t)C * tok * 2u, 1000u + s);
        for (size_t i = 0; i < (size_t)C * o->q_heads * D; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            q[i] = (float)((double)(x >> 11) * 0x1p-53 - 0.5);
        }
        t0 = bench_now();
        kvt_step *step;
        CHECK(kvt_step_plan(pool, kids, C, &sto, &step));
        for (uint32_t l = 0; l < L; l++) {
            CHECK(kvt_step_append(step, l, kv, kv + (size_t)C * tok, KVT_DTYPE_F16, 0));
            CHECK(kvt_step_attend(step, l, q, out, lse));
        }
        CHECK(kvt_step_finish(step));
        st[s] = bench_now() - t0;
    }
    r->step_ms = bench_median(st, o->steps) * 1e3;
    kvt_stats ps;
    ps.struct_size = sizeof ps;
    CHECK(kvt_pool_stats_get(pool, &ps));
    r->dev_bytes = ps.tier[KVT_TIER_DEVICE].bytes_used + ps.tier[KVT_TIER_HOST].bytes_used;
    r->meta_bytes = ps.meta_pages_used * (3ull * D * 2u);
    CHECK(kvt_pool_check(pool));
    for (uint32_t c = 0; c < C; c++)
        CHECK(kvt_seq_release(pool, kids[c]));
    if (parent)
        CHECK(kvt_seq_release(pool, parent));
    kvt_selector_destroy(sel);
    kvt_pool_destroy(pool);
    free(kids);
    free(kv);
    free(q);
    free(out);
    free(lse);
    free(st);
}

static uint32_t fork_count(const char *flag, const char *v, unsigned long long lo,
                           unsigned long long hi)
{
    unsigned long long x;
    if (bench_count(v, lo, hi, &x))
        bench_usage_exit(PROG, "bad value for", flag, fork_usage);
    return (uint32_t)x;
}

int bench_fork_main(int argc, char **argv)
{
    fork_opts o = {32768, 8, 64, 4, 8, 32, 128, 32, 64, 3};
    bool set[10] = {false};
    const char *names[10] = {"--ctx",     "--children", "--steps",    "--layers", "--kv-heads",
                             "--q-heads", "--head-dim", "--page",     "--top-k",  "--runs"};
    uint32_t *vals[10] = {&o.ctx,     &o.children, &o.steps, &o.layers, &o.kv_heads,
                          &o.q_heads, &o.head_dim, &o.page,  &o.top_k,  &o.runs};
    const unsigned long long hi[10] = {1u << 22, FORK_MAX_CHILDREN, 100000, 4096, 1024,
                                       4096,     1024,              4096,   1u << 20, FORK_MAX_RUNS};
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(fork_usage, stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--quick")) {
            quick = true;
            continue;
        }
        int k = -1;
        for (int j = 0; j < 10; j++)
            if (!strcmp(argv[i], names[j]))
                k = j;
        if (k < 0)
            bench_usage_exit(PROG, "unknown option", argv[i], fork_usage);
        if (i + 1 >= argc)
            bench_usage_exit(PROG, "missing value for", argv[i], fork_usage);
        *vals[k] = fork_count(argv[i], argv[i + 1], 1, hi[k]);
        set[k] = true;
        i++;
    }
    if (quick) {
        const uint32_t qv[10] = {8192, 8, 16, 2, 8, 32, 128, 32, 64, 1};
        for (int j = 0; j < 10; j++)
            if (!set[j])
                *vals[j] = qv[j];
    }
    if (o.q_heads % o.kv_heads)
        bench_usage_exit(PROG, "--q-heads must be a multiple of --kv-heads", NULL, fork_usage);
    const size_t tok = (size_t)o.kv_heads * o.head_dim;
    uint16_t *prompt = bench_xmalloc((size_t)o.ctx * tok * 2u * sizeof *prompt);
    bench_fill_f16(prompt, (size_t)o.ctx * tok * 2u, 7);
    double bytes_r[FORK_MAX_RUNS], step_r[FORK_MAX_RUNS], fork_us[FORK_MAX_RUNS];
    for (uint32_t run = 0; run < o.runs; run++) {
        fork_run fr, cr;
        /* Alternate the order so neither pool always runs on a warm machine. */
        for (int pass = 0; pass < 2; pass++) {
            const bool fork = (pass == 0) == (run % 2 == 0);
            fork_run *r = fork ? &fr : &cr;
            fprintf(stderr, PROG ": run %u: %s pool (ctx %u, %u children, %u layers)\n", run,
                    fork ? "fork" : "copies", o.ctx, o.children, o.layers);
            run_pool(&o, fork, prompt, r);
            printf("{\"bench\":\"fork\",\"run\":%u,\"case\":\"%s\",\"ctx\":%u,\"children\":%u,"
                   "\"steps\":%u,\"layers\":%u,\"kv_heads\":%u,\"q_heads\":%u,\"head_dim\":%u,"
                   "\"page_tokens\":%u,\"top_k\":%u,\"dtype\":\"f16\",\"build_s\":%.6f,"
                   "\"step_ms\":%.4f,\"device_bytes\":%llu,\"meta_bytes\":%llu,"
                   "\"prompt_pages\":%llu}\n",
                   run, fork ? "fork" : "copies", o.ctx, o.children, o.steps, o.layers,
                   o.kv_heads, o.q_heads, o.head_dim, o.page, o.top_k, r->build_s, r->step_ms,
                   (unsigned long long)r->dev_bytes, (unsigned long long)r->meta_bytes,
                   (unsigned long long)r->pages);
            fflush(stdout);
        }
        bytes_r[run] = (double)(fr.dev_bytes + fr.meta_bytes) / (double)(cr.dev_bytes + cr.meta_bytes);
        step_r[run] = fr.step_ms / cr.step_ms;
        fork_us[run] = fr.build_s / o.children * 1e6 / ((double)fr.pages / 1000.0);
    }
    const double b = bench_median(bytes_r, o.runs), s = bench_median(step_r, o.runs);
    const double f = bench_median(fork_us, o.runs);
    printf("{\"summary\":\"fork\",\"ctx\":%u,\"children\":%u,\"steps\":%u,\"runs\":%u,"
           "\"fork_bytes_ratio\":%.4f,\"fork_bytes_target\":%.4f,\"fork_bytes_met\":%s,"
           "\"fork_us_per_1k_pages\":%.2f,"
           "\"fork_step_time_ratio\":%.4f,\"fork_step_time_target\":%.2f,"
           "\"fork_step_time_met\":%s}\n",
           o.ctx, o.children, o.steps, o.runs, b, TARGET_BYTES_RATIO,
           b <= TARGET_BYTES_RATIO ? "true" : "false", f, s, TARGET_STEP_RATIO,
           s <= TARGET_STEP_RATIO ? "true" : "false");
    free(prompt);
    return 0;
}
