/* kvtier-bench: measures, in one run, the ratios that matter for sparse
 * decode on the CPU backend - dense decode against the DRAM read bandwidth,
 * selection against dense, sparse against dense - and prints one JSON
 * object per case on its own line (see examples/bench/README.md).
 *
 *   kvtier-bench attn [--ctx 8k,32k,128k] [--gqa 1,4] [--threads 1,2]
 *                     [--budget 1024,2048] [--dtype f16|bf16|f32] [--kv-heads 8]
 *                     [--head-dim 128] [--page-tokens 16] [--reps 5]
 *                     [--min-kv-gib 2] [--min-meta-mib 512] [--quick]
 *                     [--simd portable|avx2|avx512] [--policy] [--help]
 *
 * Every timed pass walks all L layers of one sequence in order, and L is
 * chosen so that the KV (and the page metadata) of those layers is many
 * times the last-level cache: each per-layer call reads from DRAM, as in a
 * real decode step where the other layers' work evicts this layer's data.
 */
#include <kvtier/kvtier.h>

#include "bench_io.h"
#include "bench_cuda.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define BENCH_X86 1
#else
#define BENCH_X86 0
#endif

#define PROG "kvtier-bench"
#define MAX_LIST 16

/* ---- errors --------------------------------------------------------------- */


static void die(const char *msg)
{
    fprintf(stderr, PROG ": %s\n", msg);
    exit(1);
}

/* ---- options -------------------------------------------------------------- */

typedef struct u32_list {
    uint32_t v[MAX_LIST];
    uint32_t n;
} u32_list;

/* --multi: the verification step's tokens (a draft of 4 and the last one). */
#define MULTI_ROWS 5u

typedef struct bench_opts {
    u32_list ctx, gqa, threads, budget;
    kvt_dtype dtype;
    uint32_t kv_heads, head_dim, page_tokens, reps;
    double min_kv_gib, min_meta_mib;
    const char *simd;
    bool policy;
    uint32_t multi; /* --multi: also steps of this many query tokens (5) */
} bench_opts;

static const char usage_text[] =
    "usage: " PROG " attn [options]\n"
    "  --ctx LIST          context lengths, k = 1024 (default 8k,32k,128k)\n"
    "  --gqa LIST          query heads per KV head (default 1,4)\n"
    "  --threads LIST      pool worker threads (default 1,2)\n"
    "  --budget LIST       top-K budget in tokens (default 1024,2048)\n"
    "  --dtype T           f16|bf16|f32 (default f16)\n"
    "  --kv-heads N        (default 8)      --head-dim N     (default 128)\n"
    "  --page-tokens N     (default 16)     --reps N         timed passes, median (default 5)\n"
    "  --min-kv-gib X      rotate over at least X GiB of KV (default 2)\n"
    "  --min-meta-mib X    ... and at least X MiB of page metadata (default 512)\n"
    "  --quick             ctx 32k, gqa 4, threads 2, budget 2048, reps 3 (< 60 s)\n"
    "  --simd ISA          cap the kernels: portable|avx2|avx512 (sets KVTIER_SIMD)\n"
    "  --multi             also steps of 5 query tokens (a speculative verification,\n"
    "                      kvt_step_opts.n_new): dense, select, sparse and attend\n"
    "  --policy            also decode under a head-stability policy: 25% unstable heads\n"
    "                      reranked every step, the others every 16 steps (16-step passes)\n"
    "  --help              this text\n"
    "Prints one JSON object per case on stdout, progress on stderr.\n"
    "Other commands: io, tier, fork, prefix, remote (kvtier-bench CMD --help).\n";

static void usage_error(const char *msg, const char *arg)
{
    bench_usage_exit(PROG, msg, arg, usage_text);
}

/* A positive count with an optional k or m suffix (bench_count). */
static uint32_t parse_count(const char *s, const char *flag)
{
    unsigned long long v;
    if (bench_count(s, 1, UINT32_MAX, &v))
        usage_error("bad value for", flag);
    return (uint32_t)v;
}

static double parse_real(const char *s, const char *flag)
{
    char *end;
    if (!s || !*s)
        usage_error("bad value for", flag);
    double v = strtod(s, &end);
    if (*end || !(v >= 0.0) || v > 1e6)
        usage_error("bad value for", flag);
    return v;
}

static void parse_list(u32_list *l, const char *s, const char *flag)
{
    char buf[256];
    if (!s || strlen(s) >= sizeof buf)
        usage_error("bad value for", flag);
    strcpy(buf, s);
    l->n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (l->n == MAX_LIST)
            usage_error("too many values for", flag);
        l->v[l->n++] = parse_count(tok, flag);
    }
    if (l->n == 0)
        usage_error("empty list for", flag);
}

static void set_list(u32_list *l, uint32_t a, uint32_t b, uint32_t c)
{
    l->n = 0;
    l->v[l->n++] = a;
    if (b)
        l->v[l->n++] = b;
    if (c)
        l->v[l->n++] = c;
}

static const char *dtype_name(kvt_dtype d)
{
    return d == KVT_DTYPE_F32 ? "f32" : d == KVT_DTYPE_BF16 ? "bf16" : "f16";
}

static void parse_args(int argc, char **argv, bench_opts *o)
{
    memset(o, 0, sizeof *o);
    set_list(&o->ctx, 8192, 32768, 131072);
    set_list(&o->gqa, 1, 4, 0);
    set_list(&o->threads, 1, 2, 0);
    set_list(&o->budget, 1024, 2048, 0);
    o->dtype = KVT_DTYPE_F16;
    o->kv_heads = 8;
    o->head_dim = 128;
    o->page_tokens = 16;
    o->reps = 5;
    o->min_kv_gib = 2.0;
    o->min_meta_mib = 512.0;

    /* --quick sets defaults; explicit flags win wherever they appear. */
    bool have_cmd = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(usage_text, stdout);
            exit(0);
        }
        if (!strcmp(argv[i], "--quick")) {
            set_list(&o->ctx, 32768, 0, 0);
            set_list(&o->gqa, 4, 0, 0);
            set_list(&o->threads, 2, 0, 0);
            set_list(&o->budget, 2048, 0, 0);
            o->reps = 3;
        }
    }
    for (int i = 1; i < argc; i++) {
        char flag[64];
        const char *a = argv[i], *val = NULL;
        if (strncmp(a, "--", 2) != 0) {
            if (!strcmp(a, "attn") && !have_cmd) {
                have_cmd = true;
                continue;
            }
            usage_error("unknown command or argument", a);
        }
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        if (len >= sizeof flag)
            usage_error("unknown option", a);
        memcpy(flag, a, len);
        flag[len] = '\0';
        if (!strcmp(flag, "--quick")) {
            if (eq)
                usage_error("--quick takes no value", a);
            continue;
        }
        if (!strcmp(flag, "--policy")) {
            if (eq)
                usage_error("--policy takes no value", a);
            o->policy = true;
            continue;
        }
        if (!strcmp(flag, "--multi")) {
            if (eq)
                usage_error("--multi takes no value", a);
            o->multi = MULTI_ROWS;
            continue;
        }
        static const char *const with_value[] = {
            "--ctx", "--gqa", "--threads", "--budget", "--dtype", "--kv-heads", "--head-dim",
            "--page-tokens", "--reps", "--min-kv-gib", "--min-meta-mib", "--simd"};
        bool known = false;
        for (size_t j = 0; j < sizeof with_value / sizeof with_value[0]; j++)
            known = known || !strcmp(flag, with_value[j]);
        if (!known)
            usage_error("unknown option", a);
        if (eq)
            val = eq + 1;
        else if (i + 1 < argc)
            val = argv[++i];
        else
            usage_error("missing value for", flag);

        if (!strcmp(flag, "--ctx"))
            parse_list(&o->ctx, val, flag);
        else if (!strcmp(flag, "--gqa"))
            parse_list(&o->gqa, val, flag);
        else if (!strcmp(flag, "--threads"))
            parse_list(&o->threads, val, flag);
        else if (!strcmp(flag, "--budget"))
            parse_list(&o->budget, val, flag);
        else if (!strcmp(flag, "--dtype")) {
            o->dtype = !strcmp(val, "f16")    ? KVT_DTYPE_F16
                       : !strcmp(val, "bf16") ? KVT_DTYPE_BF16
                       : !strcmp(val, "f32")  ? KVT_DTYPE_F32
                                              : 0u;
            if (!o->dtype)
                usage_error("--dtype must be f16, bf16 or f32", val);
        } else if (!strcmp(flag, "--kv-heads"))
            o->kv_heads = parse_count(val, flag);
        else if (!strcmp(flag, "--head-dim"))
            o->head_dim = parse_count(val, flag);
        else if (!strcmp(flag, "--page-tokens"))
            o->page_tokens = parse_count(val, flag);
        else if (!strcmp(flag, "--reps"))
            o->reps = parse_count(val, flag);
        else if (!strcmp(flag, "--min-kv-gib"))
            o->min_kv_gib = parse_real(val, flag);
        else if (!strcmp(flag, "--min-meta-mib"))
            o->min_meta_mib = parse_real(val, flag);
        else if (!strcmp(flag, "--simd")) {
            if (strcmp(val, "portable") && strcmp(val, "avx2") && strcmp(val, "avx512"))
                usage_error("--simd must be portable, avx2 or avx512", val);
            o->simd = val;
        }
    }
    if (!have_cmd)
        usage_error("missing command", "attn");
    if (o->reps > 1000)
        usage_error("--reps is at most 1000", NULL);
    for (uint32_t i = 0; i < o->threads.n; i++)
        if (o->threads.v[i] > 1024)
            usage_error("--threads values are at most 1024", NULL);
    for (uint32_t i = 0; i < o->gqa.n; i++)
        if (o->gqa.v[i] > 256)
            usage_error("--gqa values are at most 256", NULL);
    for (uint32_t i = 0; i < o->budget.n; i++)
        if (o->budget.v[i] < o->page_tokens)
            usage_error("--budget values must be at least --page-tokens", NULL);
    for (uint32_t i = 0; i < o->ctx.n; i++)
        if (o->ctx.v[i] > KVT_MAX_SEQ_TOKENS_LIMIT - 1024u)
            usage_error("--ctx value too large", NULL);
}

/* ---- random data ---------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) /* splitmix64 */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_unit(uint64_t *s) /* uniform in [-1, 1) */
{
    return (float)((double)(rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static uint16_t f32_to_f16(float f) /* round to nearest even */
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) { /* below the smallest normal: units of 2^-24 */
        float af;
        memcpy(&af, &ax, sizeof af);
        return (uint16_t)(sign | (uint32_t)lrintf(af * 16777216.0f));
    }
    uint32_t r = ax - 0x38000000u; /* rebias the exponent 127 -> 15 */
    r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
    return (uint16_t)(sign | r);
}

static uint16_t f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* n random elements of the pool's dtype, so that prefill is a copy. */
static void *random_elems(size_t n, kvt_dtype dtype, uint64_t seed)
{
    size_t elem = kvt_dtype_size(dtype);
    void *buf = bench_xmalloc(n * elem);
    uint64_t s = seed;
    if (dtype == KVT_DTYPE_F32) {
        float *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] = rng_unit(&s);
    } else {
        uint16_t *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] = dtype == KVT_DTYPE_BF16 ? f32_to_bf16(rng_unit(&s)) : f32_to_f16(rng_unit(&s));
    }
    return buf;
}

/* Writes a fresh random element 0 into every row of k and v before a
 * layer's append, so that no two layers' blocks (and no two probe pages)
 * hold the same bytes: memory deduplication (KSM in a host, say) could
 * otherwise merge identical pages and serve "DRAM" reads from the cache. */
static void stamp_rows(void *k, void *v, size_t rows, uint32_t D, kvt_dtype dtype, uint64_t seed)
{
    uint64_t s = seed;
    for (size_t r = 0; r < rows; r++) {
        float a = rng_unit(&s), b = rng_unit(&s);
        if (dtype == KVT_DTYPE_F32) {
            ((float *)k)[r * D] = a;
            ((float *)v)[r * D] = b;
        } else if (dtype == KVT_DTYPE_BF16) {
            ((uint16_t *)k)[r * D] = f32_to_bf16(a);
            ((uint16_t *)v)[r * D] = f32_to_bf16(b);
        } else {
            ((uint16_t *)k)[r * D] = f32_to_f16(a);
            ((uint16_t *)v)[r * D] = f32_to_f16(b);
        }
    }
}

/* ---- DRAM read-bandwidth probe ---------------------------------------------- */

static uint64_t sum_words(const uint8_t *p, size_t n)
{
    const uint64_t *w = (const uint64_t *)(const void *)p;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    for (size_t i = 0; i + 8 <= n / 8; i += 8) {
        a0 += w[i];
        a1 += w[i + 1];
        a2 += w[i + 2];
        a3 += w[i + 3];
        a4 += w[i + 4];
        a5 += w[i + 5];
        a6 += w[i + 6];
        a7 += w[i + 7];
    }
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

#if BENCH_X86
__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint8_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(const void *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(const void *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(const void *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(const void *)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)(void *)out, s);
    return out[0] + out[1] + out[2] + out[3];
}
#endif

static bool probe_use_avx2(void)
{
#if BENCH_X86
    return __builtin_cpu_supports("avx2");
#else
    return false;
#endif
}

typedef struct probe_part {
    const uint8_t *p;
    size_t n;
    bool avx2;
    uint64_t sum;
} probe_part;

static void *probe_thread(void *arg)
{
    probe_part *pp = arg;
#if BENCH_X86
    if (pp->avx2) {
        pp->sum = sum_avx2(pp->p, pp->n);
        return NULL;
    }
#endif
    pp->sum = sum_words(pp->p, pp->n);
    return NULL;
}

static volatile uint64_t probe_sink;

/* One pass over buf[0, bytes) with T threads, each reading a contiguous part. */
static double probe_pass(const uint8_t *buf, size_t bytes, uint32_t T, bool avx2)
{
    probe_part parts[1024];
    pthread_t tid[1024];
    size_t part = bytes / T / 4096 * 4096;
    double t0 = bench_now();
    for (uint32_t t = 0; t < T; t++) {
        parts[t] = (probe_part){.p = buf + (size_t)t * part, .n = part, .avx2 = avx2};
        if (pthread_create(&tid[t], NULL, probe_thread, &parts[t]))
            die("pthread_create failed");
    }
    uint64_t sum = 0;
    for (uint32_t t = 0; t < T; t++) {
        pthread_join(tid[t], NULL);
        sum += parts[t].sum;
    }
    double dt = bench_now() - t0;
    probe_sink = sum;
    return dt;
}

/* ---- JSON output -------------------------------------------------------------- */

typedef struct case_row {
    const char *kase;
    const char *when; /* probes: "start", "before" or "after" a pool's cases */
    uint32_t ctx, kv_heads, q_heads, head_dim, page_tokens, threads, budget, layers, reps;
    const char *dtype, *isa;
    double ms_per_layer, bytes_per_layer, gbps, bw_fraction, probe_gbps;
    double pages_selected; /* < 0: not meaningful */
    uint32_t pages_total;  /* pages of one layer over all KV heads; 0: none */
    uint32_t rows;         /* query tokens per step (0: a probe) */
} case_row;

static void print_u32_or_null(const char *key, uint32_t v)
{
    if (v)
        printf(",\"%s\":%u", key, v);
    else
        printf(",\"%s\":null", key);
}

static void print_real_or_null(const char *key, double v, int prec)
{
    if (isfinite(v))
        printf(",\"%s\":%.*f", key, prec, v);
    else
        printf(",\"%s\":null", key);
}

static void emit(const case_row *r)
{
    printf("{\"case\":\"%s\"", r->kase);
    if (r->when)
        printf(",\"when\":\"%s\"", r->when);
    print_u32_or_null("ctx", r->ctx);
    print_u32_or_null("kv_heads", r->kv_heads);
    print_u32_or_null("q_heads", r->q_heads);
    print_u32_or_null("head_dim", r->head_dim);
    if (r->dtype)
        printf(",\"dtype\":\"%s\"", r->dtype);
    else
        printf(",\"dtype\":null");
    printf(",\"threads\":%u", r->threads);
    print_u32_or_null("budget_tokens", r->budget);
    print_u32_or_null("page_tokens", r->page_tokens);
    print_u32_or_null("layers", r->layers);
    print_u32_or_null("query_tokens", r->rows);
    printf(",\"reps\":%u,\"isa\":\"%s\"", r->reps, r->isa);
    print_real_or_null("ms_per_layer", r->ms_per_layer, 4);
    printf(",\"kv_bytes_read\":%.0f", r->bytes_per_layer);
    print_real_or_null("gbps", r->gbps, 3);
    print_real_or_null("bw_fraction", r->bw_fraction, 4);
    print_real_or_null("probe_gbps", r->probe_gbps, 3);
    print_real_or_null("pages_selected", r->pages_selected >= 0 ? r->pages_selected : NAN, 1);
    print_u32_or_null("pages_total", r->pages_total);
    printf("}\n");
    fflush(stdout);
}

/* The probe buffer stays mapped for the whole run: each pool is probed
 * again right before its cases, so that a case and the bandwidth it is
 * compared with are measured seconds, not minutes, apart (other load on
 * the machine moves both). */
typedef struct probe_state {
    uint8_t *buf;
    size_t bytes;
    bool avx2;
    uint32_t reps;
} probe_state;

/* Median GB/s of reps passes with T threads (after one warm-up pass); prints
 * a "probe" line, with the pool's ctx and q_heads when it brackets a pool. */
static double run_probe(const probe_state *ps, const char *when, uint32_t T, uint32_t ctx,
                        uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim,
                        const char *dtype)
{
    double v[1000];
    probe_pass(ps->buf, ps->bytes, T, ps->avx2);
    for (uint32_t r = 0; r < ps->reps; r++)
        v[r] = probe_pass(ps->buf, ps->bytes, T, ps->avx2);
    double s = bench_median(v, ps->reps);
    size_t read = ps->bytes / T / 4096 * 4096 * T;
    double gbps = (double)read / s / 1e9;
    case_row r = {.kase = "probe", .when = when, .ctx = ctx, .kv_heads = kv_heads, .q_heads = q_heads,
                  .head_dim = head_dim, .dtype = dtype, .threads = T, .reps = ps->reps,
                  .isa = ps->avx2 ? "avx2" : "scalar", .ms_per_layer = NAN,
                  .bytes_per_layer = (double)read, .gbps = gbps, .bw_fraction = 1.0,
                  .probe_gbps = gbps, .pages_selected = -1};
    emit(&r);
    return gbps;
}

/* ---- one pool: (ctx, gqa, threads) ------------------------------------------ */

typedef struct pool_ctx {
    const bench_opts *o;
    kvt_pool *pool;
    kvt_seq_id seq;
    kvt_geometry g;
    uint32_t L, ctx, T, n_pages; /* n_pages: of one (layer, KV head) */
    size_t elem;
    uint64_t block_bytes;
    uint32_t rows;  /* query tokens of the current passes (1, or --multi's) */
    uint32_t rmax;  /* rows the arrays below hold per layer */
    float *q;     /* [L][rmax][n_q_heads][head_dim] */
    float *out;   /* [L][rmax][n_q_heads][head_dim] */
    float *lse;   /* [L][rmax][n_q_heads] */
    uint32_t *pages; /* [n_pages] */
    const char *isa;
} pool_ctx;

enum { K_DENSE, K_SELECT, K_SPARSE, K_ATTEND, K_POLICY_SELECT, K_POLICY, K_SELECT_TOKEN };
static const char *const kind_name[] = {"dense",  "select",        "sparse",
                                        "attend", "policy_select", "policy", "select_token"};

/* --policy: every fourth (layer, head) is unstable (25%), reranked every
 * step; the others rerank every POLICY_INTERVAL steps. A pass is one whole
 * rerank cycle, so its selection work is the amortized one. */
#define POLICY_INTERVAL 16u
#define POLICY_STEPS POLICY_INTERVAL

static const float *q_of(const pool_ctx *c, uint32_t l)
{
    return c->q + (size_t)l * c->rmax * c->g.n_q_heads * c->g.head_dim;
}

static float *out_of(const pool_ctx *c, uint32_t l)
{
    return c->out + (size_t)l * c->rmax * c->g.n_q_heads * c->g.head_dim;
}

static float *lse_of(const pool_ctx *c, uint32_t l)
{
    return c->lse + (size_t)l * c->rmax * c->g.n_q_heads;
}

/* Pages selected for one layer, summed over the KV heads. A step keeps the
 * selection of the most recently selected layer only, so this runs right
 * after that layer's kvt_step_select / kvt_step_attend. */
static uint64_t count_selected(const pool_ctx *c, const kvt_step *st, uint32_t l)
{
    uint64_t total = 0;
    for (uint32_t h = 0; h < c->g.n_kv_heads; h++) {
        uint32_t n = 0;
        CHECK(kvt_step_selection_get(st, l, 0, h, c->pages, c->n_pages, &n, NULL));
        total += n;
    }
    return total;
}

static void check_outputs(const pool_ctx *c, const char *what)
{
    const size_t n = (size_t)c->rows * c->g.n_q_heads; /* per layer */
    for (uint32_t l = 0; l < c->L; l++) {
        for (size_t i = 0; i < n * c->g.head_dim; i++)
            if (!isfinite(out_of(c, l)[i])) {
                fprintf(stderr, PROG ": %s: layer %u output %zu is not finite (%g)\n", what, l,
                        i, (double)out_of(c, l)[i]);
                exit(1);
            }
        for (size_t i = 0; i < n; i++)
            if (!isfinite(lse_of(c, l)[i])) {
                fprintf(stderr, PROG ": %s: layer %u lse %zu is not finite (%g)\n", what, l, i,
                        (double)lse_of(c, l)[i]);
                exit(1);
            }
    }
}

/* One decode step without appends over every layer; returns the seconds of
 * the timed part. Planning and finishing are outside the clock (the pool
 * keeps the step's memory, so only the first plan allocates). For dense and
 * sparse, each layer's kvt_step_select runs untimed just before its timed
 * kvt_step_decode: a step holds one layer's selection at a time.
 * *selected (may be NULL; for the untimed warm-up pass) receives the pages
 * selected per layer over all KV heads, averaged over the layers. */
static double run_pass(const pool_ctx *c, int kind, const kvt_selector *sel, double *selected)
{
    kvt_step_opts so;
    CHECK(kvt_step_opts_init(&so));
    if (kind == K_DENSE)
        so.flags = KVT_STEP_DENSE;
    else
        so.selector = sel;
    if (c->rows > 1) {
        /* Without appends, the rows are the last `rows` stored tokens: the
         * same reads and causal masks as a verification step. */
        so.n_new = &c->rows;
        so.n_rows = c->rows;
    }
    kvt_step *st;
    CHECK(kvt_step_plan(c->pool, &c->seq, 1, &so, &st));
    double t0, timed = 0;
    uint64_t total = 0;
    const uint32_t L = c->L;
    switch (kind) {
    case K_DENSE:
    case K_SPARSE:
        for (uint32_t l = 0; l < L; l++) {
            CHECK(kvt_step_select(st, l, q_of(c, l)));
            if (selected)
                total += count_selected(c, st, l);
            t0 = bench_now();
            CHECK(kvt_step_decode(st, l, q_of(c, l), out_of(c, l), lse_of(c, l)));
            timed += bench_now() - t0;
        }
        break;
    case K_SELECT:
    case K_SELECT_TOKEN:
        t0 = bench_now();
        for (uint32_t l = 0; l < L; l++) {
            CHECK(kvt_step_select(st, l, q_of(c, l)));
            if (selected)
                total += count_selected(c, st, l);
        }
        timed = bench_now() - t0;
        break;
    default:
        t0 = bench_now();
        for (uint32_t l = 0; l < L; l++) {
            CHECK(kvt_step_attend(st, l, q_of(c, l), out_of(c, l), lse_of(c, l)));
            if (selected)
                total += count_selected(c, st, l);
        }
        timed = bench_now() - t0;
        break;
    }
    if (selected)
        *selected = (double)total / L;
    CHECK(kvt_step_finish(st));
    return timed;
}

/* Warm-up pass, then reps timed passes; returns the median pass seconds. */
static double measure(const pool_ctx *c, int kind, const kvt_selector *sel, double *selected)
{
    double v[1000];
    run_pass(c, kind, sel, selected);
    if (kind != K_SELECT && kind != K_SELECT_TOKEN)
        check_outputs(c, kind_name[kind]);
    for (uint32_t r = 0; r < c->o->reps; r++)
        v[r] = run_pass(c, kind, sel, NULL);
    return bench_median(v, c->o->reps);
}

/* ---- --policy ------------------------------------------------------------------ */

static kvt_policy *bench_policy(const pool_ctx *c, uint32_t budget)
{
    const uint32_t n = c->g.n_layers * c->g.n_kv_heads;
    kvt_head_class *cls = bench_xmalloc((size_t)n * sizeof *cls);
    for (uint32_t i = 0; i < n; i++)
        cls[i] = i % 4 == 0 ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE;
    kvt_policy_opts po;
    CHECK(kvt_policy_opts_init(&po));
    po.top_k_pages = budget / c->g.page_tokens;
    po.sink_pages = 1;
    po.local_pages = 1;
    po.stable_interval = POLICY_INTERVAL;
    po.unstable_interval = 1;
    kvt_policy_heads ph;
    memset(&ph, 0, sizeof ph);
    ph.struct_size = (uint32_t)sizeof ph;
    ph.n_heads = n;
    ph.head_class = cls;
    kvt_policy *pol;
    CHECK(kvt_policy_create_heads(&c->g, &po, &ph, &pol));
    free(cls);
    return pol;
}

typedef struct policy_pass_out {
    double select_s, total_s; /* per step: selection, selection + sparse decode */
    uint64_t reranked;        /* (layer, head) rescored, over the pass */
} policy_pass_out;

/* POLICY_STEPS decode steps (no appends) under the policy. Each layer's
 * kvt_step_select and kvt_step_decode are timed; when `count`, the heads
 * reranked are counted between the two, outside the clock. */
static void policy_pass(const pool_ctx *c, const kvt_selector *sel, const kvt_policy *pol,
                        bool count, policy_pass_out *po)
{
    memset(po, 0, sizeof *po);
    kvt_step_opts so;
    CHECK(kvt_step_opts_init(&so));
    so.selector = sel;
    so.policy = pol;
    for (uint32_t step = 0; step < POLICY_STEPS; step++) {
        kvt_step *st;
        CHECK(kvt_step_plan(c->pool, &c->seq, 1, &so, &st));
        for (uint32_t l = 0; l < c->L; l++) {
            double t0 = bench_now();
            CHECK(kvt_step_select(st, l, q_of(c, l)));
            double t1 = bench_now();
            if (count)
                for (uint32_t h = 0; h < c->g.n_kv_heads; h++) {
                    uint32_t n, rr = 0;
                    CHECK(kvt_step_selection_get(st, l, 0, h, c->pages, c->n_pages, &n, &rr));
                    po->reranked += rr;
                }
            double t2 = bench_now();
            CHECK(kvt_step_decode(st, l, q_of(c, l), out_of(c, l), lse_of(c, l)));
            double t3 = bench_now();
            po->select_s += t1 - t0;
            po->total_s += (t1 - t0) + (t3 - t2);
        }
        CHECK(kvt_step_finish(st));
    }
    po->select_s /= POLICY_STEPS;
    po->total_s /= POLICY_STEPS;
}

/* A warm-up pass (its first step reranks every head: nothing kept yet), a
 * counting pass, then reps timed passes; medians of the per-step times. */
static void measure_policy(const pool_ctx *c, const kvt_selector *sel, const kvt_policy *pol,
                           double *select_s, double *total_s, double *work_fraction)
{
    double vs[1000], vt[1000];
    policy_pass_out po;
    policy_pass(c, sel, pol, false, &po);
    policy_pass(c, sel, pol, true, &po);
    check_outputs(c, "policy");
    *work_fraction = (double)po.reranked / ((double)POLICY_STEPS * c->L * c->g.n_kv_heads);
    for (uint32_t r = 0; r < c->o->reps; r++) {
        policy_pass(c, sel, pol, false, &po);
        vs[r] = po.select_s;
        vt[r] = po.total_s;
    }
    *select_s = bench_median(vs, c->o->reps);
    *total_s = bench_median(vt, c->o->reps);
}

typedef struct summary {
    bool have, have_multi;
    double dense_ms, select_ms, sparse_ms, attend_ms, dense_bw_fraction, probe_gbps;
    double m_dense_ms, m_select_ms, m_sparse_ms, m_attend_ms; /* --multi's steps */
    double token_select_ms; /* a rerank step's KVT_SCORE_TOKEN selection */
    bool have_policy;
    double policy_ms, policy_select_ms, policy_work_fraction;
} summary;

static void report(const pool_ctx *c, int kind, uint32_t budget, double pass_s,
                   double bytes_per_layer, double probe_gbps, double selected)
{
    case_row r = {
        .kase = kind_name[kind],
        .ctx = c->ctx,
        .kv_heads = c->g.n_kv_heads,
        .q_heads = c->g.n_q_heads,
        .head_dim = c->g.head_dim,
        .page_tokens = c->g.page_tokens,
        .threads = c->T,
        .budget = budget,
        .layers = c->L,
        .reps = c->o->reps,
        .dtype = dtype_name(c->g.dtype),
        .isa = c->isa,
        .ms_per_layer = pass_s * 1e3 / c->L,
        .rows = c->rows,
        .bytes_per_layer = bytes_per_layer,
        .gbps = bytes_per_layer * c->L / pass_s / 1e9,
        .pages_selected = selected,
        .pages_total = c->n_pages * c->g.n_kv_heads,
    };
    r.bw_fraction = r.gbps / probe_gbps;
    r.probe_gbps = probe_gbps;
    emit(&r);
}

static void bench_pool(const bench_opts *o, uint32_t ctx, uint32_t gqa, uint32_t T, uint32_t L,
                       void *ksrc, void *vsrc, const probe_state *ps,
                       summary *sum)
{
    pool_ctx c = {.o = o, .ctx = ctx, .T = T, .L = L};
    kvt_pool_opts po;
    CHECK(kvt_pool_opts_init(&po));
    po.backend = KVT_BACKEND_CPU;
    po.geom.n_layers = L;
    po.geom.n_kv_heads = o->kv_heads;
    po.geom.n_q_heads = gqa * o->kv_heads;
    po.geom.head_dim = o->head_dim;
    po.geom.page_tokens = o->page_tokens;
    po.geom.dtype = o->dtype;
    CHECK(kvt_geometry_block_bytes(&po.geom, &c.block_bytes));
    c.n_pages = (ctx + o->page_tokens - 1) / o->page_tokens;
    /* Every page of the prefill, one more page per (layer, head) for the
     * token a step plan makes room for, the null block and some slack. */
    uint64_t blocks = (uint64_t)L * o->kv_heads * (c.n_pages + 1ull) + 1u + 16u;
    po.device_bytes = blocks * c.block_bytes;
    po.max_seqs = 4;
    po.max_seq_tokens = ctx + o->page_tokens;
    po.n_threads = T;

    fprintf(stderr, "pool ctx=%u gqa=%u threads=%u: %u layers, %.2f GiB KV + %.0f MiB metadata\n",
            ctx, gqa, T, L, (double)po.device_bytes / 1073741824.0,
            (double)blocks * 3.0 * o->head_dim * (double)kvt_dtype_size(o->dtype) / 1048576.0);
    CHECK(kvt_pool_create(&po, &c.pool));
    CHECK(kvt_pool_geometry_get(c.pool, &c.g));
    CHECK(kvt_seq_create(c.pool, NULL, &c.seq));
    CHECK(kvt_pool_kernel_isa_get(c.pool, &c.isa));
    c.elem = kvt_dtype_size(c.g.dtype);

    double t0 = bench_now();
    for (uint32_t l = 0; l < L; l++) {
        stamp_rows(ksrc, vsrc, (size_t)ctx * o->kv_heads, o->head_dim, o->dtype,
                   0x7a3b0000ull + (uint64_t)l * 0x10001ull + gqa * 7919ull + T);
        CHECK(kvt_seq_append(c.pool, c.seq, l, ksrc, vsrc, ctx, o->dtype, 0));
        fprintf(stderr, "\r  prefill layer %u/%u", l + 1, L);
    }
    double tp = bench_now() - t0;
    fprintf(stderr, "\r  prefill: %.1f s (%.2f GB/s of KV)\n", tp,
            (double)L * 2.0 * ctx * o->kv_heads * o->head_dim * (double)c.elem / tp / 1e9);

    c.rows = 1;
    c.rmax = o->multi ? o->multi : 1;
    size_t qn = (size_t)L * c.rmax * c.g.n_q_heads * c.g.head_dim;
    c.q = bench_xmalloc(qn * sizeof *c.q);
    c.out = bench_xmalloc(qn * sizeof *c.out);
    c.lse = bench_xmalloc((size_t)L * c.rmax * c.g.n_q_heads * sizeof *c.lse);
    c.pages = bench_xmalloc((size_t)c.n_pages * sizeof *c.pages);
    uint64_t s = 0x5eed0000ull + ctx * 31ull + gqa;
    for (size_t i = 0; i < qn; i++)
        c.q[i] = rng_unit(&s);

    double probe = run_probe(ps, "before", T, ctx, c.g.n_q_heads, c.g.n_kv_heads,
                             c.g.head_dim, dtype_name(c.g.dtype));
    bool is_summary = ctx == 32768 && gqa == 4 && T == 2;
    double D = c.g.head_dim, H = c.g.n_kv_heads, elem = (double)c.elem;

    fprintf(stderr, "  dense\n");
    double sel_dense = 0;
    double dense_s = measure(&c, K_DENSE, NULL, &sel_dense);
    double dense_bytes = 2.0 * ctx * H * D * elem;
    report(&c, K_DENSE, 0, dense_s, dense_bytes, probe, sel_dense);
    if (sel_dense != (double)c.n_pages * H)
        fprintf(stderr, PROG ": warning: the dense step selected %.1f of %u pages per layer\n",
                sel_dense, c.n_pages * c.g.n_kv_heads);

    for (uint32_t b = 0; b < o->budget.n; b++) {
        uint32_t budget = o->budget.v[b];
        kvt_selector_opts so;
        CHECK(kvt_selector_opts_init(&so));
        so.method = KVT_SCORE_MINMAX;
        so.vote = KVT_VOTE_SUM;
        kvt_selector *sel;
        CHECK(kvt_selector_create(&c.g, &so, &sel));
        CHECK(kvt_selector_budget_set(sel, KVT_ALL, KVT_ALL, budget / c.g.page_tokens, 1, 1));

        fprintf(stderr, "  budget %u: select, sparse, attend\n", budget);
        double selected = 0;
        double select_s = measure(&c, K_SELECT, sel, &selected);
        double meta_bytes = (double)c.n_pages * H * 2.0 * D * elem;
        report(&c, K_SELECT, budget, select_s, meta_bytes, probe, selected);

        /* TokenSelect's scores on a rerank step: every page's keys, K only. */
        kvt_selector_opts tso;
        CHECK(kvt_selector_opts_init(&tso));
        tso.method = KVT_SCORE_TOKEN;
        tso.vote = KVT_VOTE_SOFTVOTE;
        kvt_selector *tsel;
        CHECK(kvt_selector_create(&c.g, &tso, &tsel));
        CHECK(kvt_selector_budget_set(tsel, KVT_ALL, KVT_ALL, budget / c.g.page_tokens, 1, 1));
        double tselected = 0;
        double token_select_s = measure(&c, K_SELECT_TOKEN, tsel, &tselected);
        report(&c, K_SELECT_TOKEN, budget, token_select_s, dense_bytes / 2.0, probe, tselected);
        fprintf(stderr, "  token scores: %.4f ms/layer, %.3f of dense\n", token_select_s * 1e3 / L,
                token_select_s / dense_s);
        kvt_selector_destroy(tsel);

        double sparse_s = measure(&c, K_SPARSE, sel, NULL);
        double sparse_bytes = selected * (double)c.block_bytes;
        report(&c, K_SPARSE, budget, sparse_s, sparse_bytes, probe, selected);

        double attend_s = measure(&c, K_ATTEND, sel, NULL);
        report(&c, K_ATTEND, budget, attend_s, meta_bytes + sparse_bytes, probe, selected);

        double pol_sel_s = NAN, pol_s = NAN, work = NAN;
        if (o->policy) {
            fprintf(stderr, "  budget %u: policy (%u-step passes)\n", budget, POLICY_STEPS);
            kvt_policy *pol = bench_policy(&c, budget);
            measure_policy(&c, sel, pol, &pol_sel_s, &pol_s, &work);
            report(&c, K_POLICY_SELECT, budget, pol_sel_s, meta_bytes * work, probe, selected);
            report(&c, K_POLICY, budget, pol_s, meta_bytes * work + sparse_bytes, probe,
                   selected);
            fprintf(stderr, "  policy: %.4f ms/layer (select %.4f), %.1fx dense, %.3f of the "
                    "heads scored per step\n", pol_s * 1e3 / L, pol_sel_s * 1e3 / L,
                    dense_s / pol_s, work);
            kvt_policy_destroy(pol);
        }

        /* --multi: the same cases with a step of MULTI_ROWS query tokens. */
        double m_dense = NAN, m_select = NAN, m_sparse = NAN, m_attend = NAN;
        if (o->multi) {
            fprintf(stderr, "  budget %u: %u-token steps: dense, select, sparse, attend\n",
                    budget, o->multi);
            c.rows = o->multi;
            double msel = 0;
            m_dense = measure(&c, K_DENSE, NULL, NULL);
            report(&c, K_DENSE, 0, m_dense, dense_bytes, probe, sel_dense);
            m_select = measure(&c, K_SELECT, sel, &msel);
            report(&c, K_SELECT, budget, m_select, meta_bytes, probe, msel);
            m_sparse = measure(&c, K_SPARSE, sel, NULL);
            report(&c, K_SPARSE, budget, m_sparse, msel * (double)c.block_bytes, probe, msel);
            m_attend = measure(&c, K_ATTEND, sel, NULL);
            report(&c, K_ATTEND, budget, m_attend, meta_bytes + msel * (double)c.block_bytes,
                   probe, msel);
            fprintf(stderr, "  %u tokens over 1: dense %.2fx, select %.2fx, sparse %.2fx, "
                    "attend %.2fx\n", o->multi, m_dense / dense_s, m_select / select_s,
                    m_sparse / sparse_s, m_attend / attend_s);
            c.rows = 1;
        }

        if (is_summary && budget == 2048) {
            sum->have = true;
            if (o->multi) {
                sum->have_multi = true;
                sum->m_dense_ms = m_dense * 1e3 / L;
                sum->m_select_ms = m_select * 1e3 / L;
                sum->m_sparse_ms = m_sparse * 1e3 / L;
                sum->m_attend_ms = m_attend * 1e3 / L;
            }
            if (o->policy) {
                sum->have_policy = true;
                sum->policy_ms = pol_s * 1e3 / L;
                sum->policy_select_ms = pol_sel_s * 1e3 / L;
                sum->policy_work_fraction = work;
            }
            sum->dense_ms = dense_s * 1e3 / L;
            sum->select_ms = select_s * 1e3 / L;
            sum->token_select_ms = token_select_s * 1e3 / L;
            sum->sparse_ms = sparse_s * 1e3 / L;
            sum->attend_ms = attend_s * 1e3 / L;
            sum->dense_bw_fraction = dense_bytes * L / dense_s / 1e9 / probe;
            sum->probe_gbps = probe;
        }
        kvt_selector_destroy(sel);
    }

    /* The bandwidth can move under a run (other tenants, vCPU placement):
     * a second probe after the cases says whether the fractions above hold. */
    double after = run_probe(ps, "after", T, ctx, c.g.n_q_heads, c.g.n_kv_heads,
                             c.g.head_dim, dtype_name(c.g.dtype));
    if (after > 1.2 * probe || after < probe / 1.2)
        fprintf(stderr, PROG ": warning: the probe moved from %.1f to %.1f GB/s during the "
                "cases of this pool; its bw_fraction values are unreliable\n", probe, after);

    free(c.q);
    free(c.out);
    free(c.lse);
    free(c.pages);
    kvt_pool_destroy(c.pool);
}

/* Layers needed so that one pass rotates over at least min_kv bytes of KV
 * and min_meta bytes of page metadata. */
static uint32_t layers_for(const bench_opts *o, uint32_t ctx)
{
    double elem = (double)kvt_dtype_size(o->dtype);
    double pages = (double)((ctx + o->page_tokens - 1) / o->page_tokens) * o->kv_heads;
    double kv = pages * 2.0 * o->page_tokens * o->head_dim * elem;
    double meta = pages * 3.0 * o->head_dim * elem;
    double need_kv = ceil(o->min_kv_gib * 1073741824.0 / kv);
    double need_meta = ceil(o->min_meta_mib * 1048576.0 / meta);
    double L = need_kv > need_meta ? need_kv : need_meta;
    if (L < 1)
        L = 1;
    if (L > 4096) {
        fprintf(stderr, PROG ": warning: ctx %u needs %.0f layers; capped at 4096\n", ctx, L);
        L = 4096;
    }
    return (uint32_t)L;
}

int main(int argc, char **argv)
{
    /* --backend cuda: the CUDA kernels (bench_cuda.c), whatever the command. */
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--backend=cuda") ||
            (!strcmp(argv[i], "--backend") && i + 1 < argc && !strcmp(argv[i + 1], "cuda"))) {
#ifdef KVT_BENCH_CUDA
            return kvt_bench_cuda_main(argc, argv);
#else
            printf("{\"bench\":\"cuda\",\"skipped\":\"kvtier-bench was built without CUDA\"}\n");
            return 77;
#endif
        }
    if (argc > 1 && strcmp(argv[1], "io") == 0)
        return bench_io_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "tier") == 0)
        return bench_tier_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "fork") == 0)
        return bench_fork_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "prefix") == 0)
        return bench_prefix_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "remote") == 0)
        return bench_remote_main(argc - 1, argv + 1);
    bench_opts o;
    parse_args(argc, argv, &o);
    double t_start = bench_now();
    if (o.simd && setenv("KVTIER_SIMD", o.simd, 1))
        die("setenv(KVTIER_SIMD) failed");

    kvt_geometry gcheck = {.n_layers = 1, .n_kv_heads = o.kv_heads,
                           .n_q_heads = o.kv_heads, .head_dim = o.head_dim,
                           .page_tokens = o.page_tokens, .dtype = o.dtype};
    CHECK(kvt_geometry_validate(&gcheck));

    /* Peak memory: the largest pool, its prefill source and the probe buffer. */
    size_t probe_bytes = (size_t)(o.min_kv_gib * 1073741824.0);
    if (probe_bytes < (256u << 20))
        probe_bytes = 256u << 20;
    double phys = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    double elem = (double)kvt_dtype_size(o.dtype);
    for (uint32_t i = 0; i < o.ctx.n; i++) {
        uint32_t ctx = o.ctx.v[i], L = layers_for(&o, ctx);
        double pages = (double)L * o.kv_heads * ((ctx + o.page_tokens - 1) / o.page_tokens + 1);
        double need = pages * (2.0 * o.page_tokens + 3.0) * o.head_dim * elem +
                      2.0 * ctx * o.kv_heads * o.head_dim * elem + (double)probe_bytes;
        if (phys > 0 && need > 0.75 * phys) {
            fprintf(stderr, PROG ": ctx %u needs about %.1f GiB, more than 3/4 of the %.1f GiB "
                    "of memory; lower --min-kv-gib or --min-meta-mib\n", ctx,
                    need / 1073741824.0, phys / 1073741824.0);
            return 1;
        }
    }

    /* The probe buffer is mapped and touched before any pool exists. */
    probe_state ps = {.reps = o.reps, .avx2 = probe_use_avx2(), .bytes = probe_bytes};
    ps.buf = mmap(NULL, ps.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ps.buf == MAP_FAILED)
        die("cannot map the bandwidth probe buffer");
    madvise(ps.buf, ps.bytes, MADV_HUGEPAGE); /* like the library's device arena */
    for (size_t i = 0; i < ps.bytes / 8; i++) /* distinct pages, see stamp_rows */
        ((uint64_t *)(void *)ps.buf)[i] = i * 0x9e3779b97f4a7c15ull;
    fprintf(stderr, "probe: %.2f GiB, %s reader\n", (double)ps.bytes / 1073741824.0,
            ps.avx2 ? "avx2" : "scalar");
    for (uint32_t i = 0; i < o.threads.n; i++) {
        bool seen = false;
        for (uint32_t j = 0; j < i; j++)
            seen = seen || o.threads.v[j] == o.threads.v[i];
        if (!seen)
            run_probe(&ps, "start", o.threads.v[i], 0, 0, 0, 0, NULL);
    }

    summary sum = {0};
    for (uint32_t i = 0; i < o.ctx.n; i++) {
        uint32_t ctx = o.ctx.v[i], L = layers_for(&o, ctx);
        size_t n = (size_t)ctx * o.kv_heads * o.head_dim;
        void *k = random_elems(n, o.dtype, 0x1000ull + ctx);
        void *v = random_elems(n, o.dtype, 0x2000ull + ctx);
        for (uint32_t gi = 0; gi < o.gqa.n; gi++)
            for (uint32_t ti = 0; ti < o.threads.n; ti++)
                bench_pool(&o, ctx, o.gqa.v[gi], o.threads.v[ti], L, k, v, &ps, &sum);
        free(k);
        free(v);
    }
    munmap(ps.buf, ps.bytes);

    const char *what = "ctx 32k, gqa 4, threads 2, budget 2048";
    if (sum.have)
        printf("{\"summary\":\"%s\",\"dense_ms\":%.4f,\"select_ms\":%.4f,\"sparse_ms\":%.4f,"
               "\"attend_ms\":%.4f,\"probe_gbps\":%.3f,\"sparse_speedup_32k\":%.3f,\"attend_speedup_32k\":%.3f,"
               "\"select_fraction_32k\":%.4f,\"dense_bw_fraction_32k\":%.4f,"
               "\"token_select_ms\":%.4f,\"token_select_fraction_32k\":%.4f",
               what, sum.dense_ms, sum.select_ms, sum.sparse_ms, sum.attend_ms, sum.probe_gbps,
               sum.dense_ms / sum.sparse_ms, sum.dense_ms / sum.attend_ms,
               sum.select_ms / sum.dense_ms, sum.dense_bw_fraction, sum.token_select_ms,
               sum.token_select_ms / sum.dense_ms);
    else
        printf("{\"summary\":\"%s\",\"sparse_speedup_32k\":null,\"attend_speedup_32k\":null,"
               "\"select_fraction_32k\":null,\"dense_bw_fraction_32k\":null,"
               "\"token_select_fraction_32k\":null",
               what);
    if (sum.have_multi)
        printf(",\"verify5_dense_ms\":%.4f,\"verify5_sparse_ms\":%.4f,\"verify5_attend_ms\":%.4f,"
               "\"verify5_over_1_dense\":%.3f,\"verify5_over_1_sparse\":%.3f,"
               "\"verify5_over_1_select\":%.3f,\"verify5_over_1_attend\":%.3f",
               sum.m_dense_ms, sum.m_sparse_ms, sum.m_attend_ms, sum.m_dense_ms / sum.dense_ms,
               sum.m_sparse_ms / sum.sparse_ms, sum.m_select_ms / sum.select_ms,
               sum.m_attend_ms / sum.attend_ms);
    else if (o.multi)
        printf(",\"verify5_over_1_dense\":null,\"verify5_over_1_sparse\":null");
    if (sum.have_policy)
        printf(",\"policy_ms\":%.4f,\"policy_select_ms\":%.4f,\"policy_speedup_32k\":%.3f,"
               "\"policy_select_work_fraction\":%.4f,\"policy_select_time_fraction\":%.4f}\n",
               sum.policy_ms, sum.policy_select_ms, sum.dense_ms / sum.policy_ms,
               sum.policy_work_fraction, sum.policy_select_ms / sum.select_ms);
    else if (sum.have)
        printf(",\"policy_speedup_32k\":null,\"policy_select_work_fraction\":null,"
               "\"missing\":\"the policy figures need --policy\"}\n");
    else
        printf(",\"policy_speedup_32k\":null,\"policy_select_work_fraction\":null,"
               "\"missing\":\"needs the case --ctx 32k --gqa 4 --threads 2 --budget 2048%s\"}\n",
               o.policy ? "" : " and --policy");
    fflush(stdout);
    fprintf(stderr, "total: %.1f s\n", bench_now() - t_start);
    return 0;
}
