/* kvtier-bench tier: the tiered placement (kvt_pool_opts.policy) in a decode
 * loop over synthetic sequences, against a dense pool holding every page on
 * the device tier, and with a disk tier under a small host tier; one JSON
 * object per pool run on stdout and a summary line with the targets
 * (see examples/bench/README.md).
 *
 *   kvtier-bench tier [--ctx 8k,32k,128k] [--steps 64] [--batch 1] [--layers 4]
 *                     [--budget 2048] [--interval 16] [--window 1]
 *                     [--unstable-fraction 0.25] [--disk-dir DIR] [--no-disk]
 *                     [--no-dense] [--quick] [--help]
 *
 * Per context length: a dense pool (no policy, KVT_STEP_DENSE steps), a
 * tiered pool whose host tier holds every page the stable heads offload,
 * and (at --disk-ctx) a tiered pool whose disk tier holds everything under a
 * host tier of --disk-host-fraction of that. Each is prefilled with the same
 * synthetic K/V in chunks (kvt_seq_append), warmed up (kvt_seq_warmup, tiered
 * pools) and decoded for --steps steps: kvt_step_plan, kvt_step_ready_get, per
 * layer kvt_step_append + kvt_step_select (kvt_step_select for the dense pool)
 * + kvt_step_decode, kvt_step_finish.
 */
#include "bench_io.h"

#include <kvtier/kvtier.h>

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statfs.h>
#include <unistd.h>

#define PROG "kvtier-bench tier"

#define TIER_MAX_CTX   16u
#define TIER_MAX_STEPS 100000u
#define TIER_PI        3.14159265358979323846

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif
#define TIER_RAMFS_MAGIC 0x858458f6

/* Targets of the issue (reported as ratios with met true/false). */
#define TARGET_DEVICE_FRACTION 0.27  /* (a) device KV bytes / dense at 128k */
#define TARGET_FETCH_RATIO     0.125 /* (b) host->device bytes / refetch bytes */
#define TARGET_DISK_SLOWDOWN   0.40  /* (c) disk-tier decode over host-only, - 1 */

/* The synthetic data (see make_keys / make_queries). */
#define KEY_AMPLITUDE   4.0f /* of the rotating component (dimensions 0, 1) */
#define KEY_NOISE       1.0f /* uniform noise in [-0.5, 0.5) x this, other dims */
#define QUERY_AMPLITUDE 1.0f
#define QUERY_NOISE     0.1f


static void tier_die(const char *msg, const char *arg)
{
    fprintf(stderr, PROG ": %s%s%s\n", msg, arg ? ": " : "", arg ? arg : "");
    exit(1);
}

/* ---- options ---------------------------------------------------------------------- */

typedef struct tier_opts {
    uint32_t ctx[TIER_MAX_CTX], n_ctx;
    uint32_t steps, batch, layers, kv_heads, q_heads, head_dim, page_tokens;
    uint32_t budget, window, interval, threads, chunk, n_obs, disk_ctx;
    double unstable_fraction, drift, stress_drift, disk_host_fraction;
    const char *disk_dir;
    bool disk, dense, stress;
    uint64_t seed;
} tier_opts;

static const char tier_usage[] =
    "usage: kvtier-bench tier [options]\n"
    "  --ctx LIST              context lengths, k = 1024 (default 8k,32k,128k)\n"
    "  --steps N               decode steps per pool (default 128)\n"
    "  --batch N               sequences decoded together (default 1)\n"
    "  --layers N              (default 4)      --kv-heads N    (default 8)\n"
    "  --q-heads N             (default 32)     --head-dim N    (default 128)\n"
    "  --page-tokens N         (default 16)\n"
    "  --budget N              selection budget in tokens: top_k_pages = N / page_tokens\n"
    "                          (default 2048)\n"
    "  --interval N            rerank interval of stable heads (default 16)\n"
    "  --window N              window multiplier of stable heads (default 1)\n"
    "  --unstable-fraction X   share of (layer, head) that are UNSTABLE (default 0.25)\n"
    "  --drift X               query drift of stable heads, radians per step (default 0.0015)\n"
    "  --stress-drift X        drift of the stress pair (host-only and disk pools at the disk\n"
    "                          case's context whose selections leave the host's cache;\n"
    "                          default 0.05)\n"
    "  --obs N                 observation queries for kvt_seq_warmup (default 16)\n"
    "  --chunk N               prefill tokens per kvt_seq_append (default 1024)\n"
    "  --threads N             pool worker threads (default 0: online CPUs)\n"
    "  --disk-dir DIR          directory of the disk tier's file (default: $TMPDIR, else\n"
    "                          /var/tmp)\n"
    "  --disk-ctx N            context of the disk case (default: the largest --ctx)\n"
    "  --disk-host-fraction X  host tier of the disk case, as a share of the pages the\n"
    "                          stable heads offload (default 0.25)\n"
    "  --no-disk               skip the disk case      --no-dense   skip the dense pools\n"
    "  --no-stress             skip the stress pair\n"
    "  --seed N                data seed (default 1)\n"
    "  --quick                 ctx 8k,32k, 32 steps (a smoke test; explicit flags win)\n"
    "  --help                  this text\n"
    "Prints one JSON object per pool run on stdout and a summary line, progress on stderr.\n";

static void tier_usage_error(const char *msg, const char *arg)
{
    bench_usage_exit(PROG, msg, arg, tier_usage);
}

/* A count in [lo, hi] with an optional k or m suffix (bench_count). */
static uint32_t tier_count(const char *s, const char *flag, uint32_t lo, uint32_t hi)
{
    unsigned long long v;
    if (bench_count(s, lo, hi, &v))
        tier_usage_error("bad value for", flag);
    return (uint32_t)v;
}

static double tier_real(const char *s, const char *flag, double lo, double hi)
{
    char *end;
    if (!s || !*s)
        tier_usage_error("bad value for", flag);
    double v = strtod(s, &end);
    if (*end || !(v >= lo) || !(v <= hi))
        tier_usage_error("bad value for", flag);
    return v;
}

static void tier_parse_args(int argc, char **argv, tier_opts *o)
{
    memset(o, 0, sizeof *o);
    o->ctx[0] = 8192;
    o->ctx[1] = 32768;
    o->ctx[2] = 131072;
    o->n_ctx = 3;
    o->steps = 128;
    o->batch = 1;
    o->layers = 4;
    o->kv_heads = 8;
    o->q_heads = 32;
    o->head_dim = 128;
    o->page_tokens = 16;
    o->budget = 2048;
    o->window = 1;
    o->interval = 16;
    o->chunk = 1024;
    o->n_obs = 16;
    o->unstable_fraction = 0.25;
    o->drift = 0.0015;
    o->stress_drift = 0.05;
    o->disk_host_fraction = 0.25;
    const char *tmp = getenv("TMPDIR");
    o->disk_dir = tmp && *tmp ? tmp : "/var/tmp";
    o->disk = true;
    o->dense = true;
    o->stress = true;
    o->seed = 1;
    bool quick = false, have_ctx = false, have_steps = false;

    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(tier_usage, stdout);
            exit(0);
        }
    for (int i = 1; i < argc; i++) {
        char flag[64];
        const char *a = argv[i], *val = NULL;
        if (strncmp(a, "--", 2) != 0)
            tier_usage_error("unknown argument", a);
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        if (len >= sizeof flag)
            tier_usage_error("unknown option", a);
        memcpy(flag, a, len);
        flag[len] = '\0';
        if (!strcmp(flag, "--quick") || !strcmp(flag, "--no-disk") ||
            !strcmp(flag, "--no-dense") || !strcmp(flag, "--no-stress")) {
            if (eq)
                tier_usage_error("this option takes no value", a);
            if (!strcmp(flag, "--quick"))
                quick = true;
            else if (!strcmp(flag, "--no-disk"))
                o->disk = false;
            else if (!strcmp(flag, "--no-stress"))
                o->stress = false;
            else
                o->dense = false;
            continue;
        }
        static const char *const with_value[] = {
            "--ctx", "--steps", "--batch", "--layers", "--kv-heads", "--q-heads",
            "--head-dim", "--page-tokens", "--budget", "--interval", "--window",
            "--unstable-fraction", "--drift", "--stress-drift", "--obs", "--chunk", "--threads", "--disk-dir",
            "--disk-ctx", "--disk-host-fraction", "--seed"};
        bool known = false;
        for (size_t j = 0; j < sizeof with_value / sizeof with_value[0]; j++)
            known = known || !strcmp(flag, with_value[j]);
        if (!known)
            tier_usage_error("unknown option", a);
        if (eq)
            val = eq + 1;
        else if (i + 1 < argc)
            val = argv[++i];
        else
            tier_usage_error("missing value for", flag);

        if (!strcmp(flag, "--ctx")) {
            char buf[256];
            if (strlen(val) >= sizeof buf)
                tier_usage_error("bad value for", flag);
            strcpy(buf, val);
            o->n_ctx = 0;
            for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
                 tok = strtok_r(NULL, ",", &save)) {
                if (o->n_ctx == TIER_MAX_CTX)
                    tier_usage_error("too many values for", flag);
                o->ctx[o->n_ctx++] = tier_count(tok, flag, 1, 1u << 26);
            }
            if (!o->n_ctx)
                tier_usage_error("empty list for", flag);
            have_ctx = true;
        } else if (!strcmp(flag, "--steps")) {
            o->steps = tier_count(val, flag, 1, TIER_MAX_STEPS);
            have_steps = true;
        } else if (!strcmp(flag, "--batch"))
            o->batch = tier_count(val, flag, 1, 4096);
        else if (!strcmp(flag, "--layers"))
            o->layers = tier_count(val, flag, 1, 4096);
        else if (!strcmp(flag, "--kv-heads"))
            o->kv_heads = tier_count(val, flag, 1, 4096);
        else if (!strcmp(flag, "--q-heads"))
            o->q_heads = tier_count(val, flag, 1, 1u << 20);
        else if (!strcmp(flag, "--head-dim"))
            o->head_dim = tier_count(val, flag, 8, 1024);
        else if (!strcmp(flag, "--page-tokens"))
            o->page_tokens = tier_count(val, flag, 8, 256);
        else if (!strcmp(flag, "--budget"))
            o->budget = tier_count(val, flag, 1, 1u << 30);
        else if (!strcmp(flag, "--interval"))
            o->interval = tier_count(val, flag, 1, 65536);
        else if (!strcmp(flag, "--window"))
            o->window = tier_count(val, flag, 1, KVT_POLICY_MAX_WINDOW);
        else if (!strcmp(flag, "--unstable-fraction"))
            o->unstable_fraction = tier_real(val, flag, 0.0, 1.0);
        else if (!strcmp(flag, "--drift"))
            o->drift = tier_real(val, flag, 0.0, 10.0);
        else if (!strcmp(flag, "--stress-drift"))
            o->stress_drift = tier_real(val, flag, 0.0, 10.0);
        else if (!strcmp(flag, "--obs"))
            o->n_obs = tier_count(val, flag, 1, 4096);
        else if (!strcmp(flag, "--chunk"))
            o->chunk = tier_count(val, flag, 1, 1u << 20);
        else if (!strcmp(flag, "--threads")) {
            if (!strcmp(val, "0"))
                o->threads = 0;
            else
                o->threads = tier_count(val, flag, 1, 1024);
        } else if (!strcmp(flag, "--disk-dir")) {
            if (!*val)
                tier_usage_error("bad value for", flag);
            o->disk_dir = val;
        } else if (!strcmp(flag, "--disk-ctx"))
            o->disk_ctx = tier_count(val, flag, 1, 1u << 26);
        else if (!strcmp(flag, "--disk-host-fraction"))
            o->disk_host_fraction = tier_real(val, flag, 0.0, 1.0);
        else if (!strcmp(flag, "--seed"))
            o->seed = tier_count(val, flag, 0, UINT32_MAX);
    }
    if (quick) {
        if (!have_ctx) {
            o->ctx[0] = 8192;
            o->ctx[1] = 32768;
            o->n_ctx = 2;
        }
        if (!have_steps)
            o->steps = 32;
    }
    if (o->q_heads % o->kv_heads)
        tier_usage_error("--q-heads must be a multiple of --kv-heads", NULL);
    if (o->budget < o->page_tokens)
        tier_usage_error("--budget must be at least --page-tokens", NULL);
    uint32_t max_ctx = 0;
    for (uint32_t i = 0; i < o->n_ctx; i++)
        max_ctx = o->ctx[i] > max_ctx ? o->ctx[i] : max_ctx;
    if (!o->disk_ctx)
        o->disk_ctx = max_ctx;
    if (o->disk_host_fraction <= 0.0)
        tier_usage_error("--disk-host-fraction must be above 0", NULL);
}

/* ---- synthetic data ---------------------------------------------------------------- */

static uint64_t t_mix(uint64_t a, uint64_t b) /* splitmix64 of a combination */
{
    uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double t_unit(uint64_t h) /* [0, 1) */
{
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

static inline float t_noise(uint64_t *s) /* xorshift64, uniform in [-0.5, 0.5) */
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *s = x;
    uint32_t b = (uint32_t)(x >> 41) | 0x3f800000u;
    float f;
    memcpy(&f, &b, sizeof f);
    return f - 1.5f;
}

typedef struct workload {
    const tier_opts *o;
    kvt_geometry g;
    uint32_t L, H, Hq, D, G;
    kvt_head_class *cls;  /* [L * H] */
    uint32_t n_stable;
    uint32_t ctx;
    uint32_t chunk;       /* prefill tokens per append, the same in every pool */
    double drift;         /* radians a step of a stable head's query phase */
    float *kstep, *vstep; /* [steps][L][batch][H][D]: the decode tokens */
    float *q;             /* [steps][L][batch][Hq][D] */
    float *obs;           /* [batch][L][n_obs][Hq][D] */
} workload;

static uint32_t period_of(const workload *w, uint32_t l, uint32_t h)
{
    return 1024u << ((l * w->H + h) % 3u);
}

/* K and V rows of tokens [t0, t0 + n) of (sequence b, layer l), f32,
 * [n][H][D]. A key is uniform noise plus, in dimensions 0 and 1, a vector
 * of length KEY_AMPLITUDE that turns once per period (1024, 2048 or 4096
 * tokens by head): pages at the same phase of the turn look alike, so a
 * query pointing at a phase selects a band of pages in every period.
 * Deterministic in (seed, b, l, t0): the pools built for one context get
 * the same bytes. */
static void make_kv(const workload *w, uint32_t b, uint32_t l, uint32_t t0, uint32_t n,
                    float *k, float *v)
{
    const uint32_t H = w->H, D = w->D;
    uint64_t s = t_mix(t_mix(w->o->seed, ((uint64_t)b << 32) | l), t0) | 1u;
    for (uint32_t h = 0; h < H; h++) {
        uint32_t T = period_of(w, l, h);
        double ph0 = 2.0 * TIER_PI * t_unit(t_mix(w->o->seed ^ 0x5a5a, ((uint64_t)b << 40) ^
                                                                      ((uint64_t)l << 20) ^ h));
        for (uint32_t i = 0; i < n; i++) {
            float *kr = k + ((size_t)i * H + h) * D, *vr = v + ((size_t)i * H + h) * D;
            double th = 2.0 * TIER_PI * (double)((t0 + i) % T) / (double)T + ph0;
            kr[0] = KEY_AMPLITUDE * (float)cos(th);
            kr[1] = KEY_AMPLITUDE * (float)sin(th);
            for (uint32_t d = 2; d < D; d++)
                kr[d] = KEY_NOISE * t_noise(&s);
            for (uint32_t d = 0; d < D; d++)
                vr[d] = t_noise(&s) * 2.0f;
        }
    }
}

/* The query of query head j (KV head j / G) of (b, l) at decode step s
 * (negative: the prompt's last tokens, for the warm-up): dimensions 0 and 1
 * point at phase psi, the others hold fixed noise. A stable head's psi
 * drifts by w->drift radians a step; an unstable head's jumps to a random
 * phase every step. */
static void make_query(const workload *w, uint32_t b, uint32_t l, uint32_t j, int64_t s, float *q)
{
    const uint32_t h = j / w->G;
    uint64_t hk = ((uint64_t)b << 40) ^ ((uint64_t)l << 20) ^ h;
    double psi;
    if (w->cls[l * w->H + h] == KVT_HEAD_UNSTABLE)
        psi = 2.0 * TIER_PI * t_unit(t_mix(t_mix(w->o->seed ^ 0x77, hk), (uint64_t)s));
    else
        psi = 2.0 * TIER_PI * t_unit(t_mix(w->o->seed ^ 0x33, hk)) + w->drift * (double)s;
    psi += 0.01 * (double)(j % w->G);
    q[0] = QUERY_AMPLITUDE * (float)cos(psi);
    q[1] = QUERY_AMPLITUDE * (float)sin(psi);
    uint64_t ns = t_mix(w->o->seed ^ 0x99, ((uint64_t)b << 40) ^ ((uint64_t)l << 20) ^ j) | 1u;
    for (uint32_t d = 2; d < w->D; d++)
        q[d] = QUERY_NOISE * t_noise(&ns);
}

static void workload_init(workload *w, const tier_opts *o, uint32_t ctx, double drift)
{
    memset(w, 0, sizeof *w);
    w->o = o;
    w->ctx = ctx;
    w->drift = drift;
    w->L = o->layers;
    w->H = o->kv_heads;
    w->Hq = o->q_heads;
    w->D = o->head_dim;
    w->G = w->Hq / w->H;
    w->g = (kvt_geometry){.n_layers = w->L, .n_kv_heads = w->H, .n_q_heads = w->Hq,
                          .head_dim = w->D, .page_tokens = o->page_tokens,
                          .dtype = KVT_DTYPE_F16};
    CHECK(kvt_geometry_validate(&w->g));

    /* Head i = l * H + h is unstable when (i * n_u) mod n < n_u: n_u heads,
     * spread evenly over the layers (every fourth for 25%: i % 4 == 0). */
    const uint32_t n = w->L * w->H;
    uint32_t n_u = (uint32_t)lround(o->unstable_fraction * n);
    w->cls = bench_xmalloc((size_t)n * sizeof *w->cls);
    w->n_stable = 0;
    for (uint32_t i = 0; i < n; i++) {
        w->cls[i] = (uint32_t)((uint64_t)i * n_u % n) < n_u ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE;
        w->n_stable += w->cls[i] == KVT_HEAD_STABLE;
    }

    /* A tiered pool's device tier is sized for the decode (kvt_pool_sizing),
     * and a prefill append keeps a stable head's new pages on device until
     * they are offloaded: a chunk holds at most top_k_pages x window pages.
     * Every pool of a context gets the same chunks (make_kv seeds by chunk). */
    w->chunk = o->chunk;
    uint64_t cap = (uint64_t)(o->budget / o->page_tokens) * o->window * o->page_tokens;
    if (w->chunk > cap) {
        fprintf(stderr, "prefill chunk %u -> %llu tokens (top_k_pages x window pages)\n",
                w->chunk, (unsigned long long)cap);
        w->chunk = (uint32_t)cap;
    }

    const uint32_t B = o->batch, S = o->steps, L = w->L, H = w->H, Hq = w->Hq, D = w->D;
    size_t kv_n = (size_t)S * L * B * H * D, q_n = (size_t)S * L * B * Hq * D;
    w->kstep = bench_xmalloc(kv_n * sizeof(float));
    w->vstep = bench_xmalloc(kv_n * sizeof(float));
    w->q = bench_xmalloc(q_n * sizeof(float));
    w->obs = bench_xmalloc((size_t)B * L * o->n_obs * Hq * D * sizeof(float));
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t b = 0; b < B; b++) {
                size_t row = ((size_t)s * L + l) * B + b;
                make_kv(w, b, l, ctx + s, 1, w->kstep + row * H * D, w->vstep + row * H * D);
                for (uint32_t j = 0; j < Hq; j++)
                    make_query(w, b, l, j, s, w->q + (row * Hq + j) * D);
            }
    for (uint32_t b = 0; b < B; b++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t i = 0; i < o->n_obs; i++)
                for (uint32_t j = 0; j < Hq; j++)
                    make_query(w, b, l, j, -(int64_t)o->n_obs + i,
                               w->obs + ((((size_t)b * L + l) * o->n_obs + i) * Hq + j) * D);
}

static void workload_free(workload *w)
{
    free(w->cls);
    free(w->kstep);
    free(w->vstep);
    free(w->q);
    free(w->obs);
}

/* ---- helpers --------------------------------------------------------------------- */

static int t_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double t_median(const double *v, uint32_t n)
{
    if (!n)
        return NAN;
    double *t = bench_xmalloc(n * sizeof *t);
    memcpy(t, v, n * sizeof *t);
    qsort(t, n, sizeof *t, t_cmp_double);
    double m = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
    free(t);
    return m;
}

/* MemAvailable of /proc/meminfo in bytes; 0 when unknown. */
static double mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return 0;
    char line[256];
    double kib = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lf kB", &kib) == 1)
            break;
    fclose(f);
    return kib * 1024.0;
}

static double gib(double b)
{
    return b / 1073741824.0;
}

/* JSON line writer. */
typedef struct jline {
    bool first;
} jline;

static void j_begin(jline *j)
{
    j->first = true;
    putchar('{');
}

static void j_key(jline *j, const char *k)
{
    printf("%s\"%s\":", j->first ? "" : ",", k);
    j->first = false;
}

static void j_str(jline *j, const char *k, const char *v)
{
    j_key(j, k);
    if (v)
        printf("\"%s\"", v);
    else
        printf("null");
}

static void j_u64(jline *j, const char *k, uint64_t v)
{
    j_key(j, k);
    printf("%llu", (unsigned long long)v);
}

static void j_real(jline *j, const char *k, double v, int prec)
{
    j_key(j, k);
    if (isfinite(v))
        printf("%.*f", prec, v);
    else
        printf("null");
}

/* -1: null, 0: false, 1: true */
static void j_bool(jline *j, const char *k, int v)
{
    j_key(j, k);
    printf("%s", v < 0 ? "null" : v ? "true" : "false");
}

static void j_end(jline *j)
{
    (void)j;
    printf("}\n");
    fflush(stdout);
}

/* ---- one pool run ----------------------------------------------------------------- */

enum { MODE_DENSE, MODE_HOST, MODE_DISK };

typedef struct run_result {
    bool ran;
    int mode;
    const char *isa;
    kvt_pool_sizing sz;           /* of the tiered geometry at the run's target */
    uint64_t block_bytes, target_tokens;
    uint64_t device_cap, host_cap, disk_cap, meta_bytes; /* capacities (device incl. null block) */
    uint64_t device_used_peak, host_used_end, disk_used_end, device_used_end;
    double prefill_s, warmup_ms, settle_ms;
    uint64_t warmup_promoted, warmup_h2d;
    /* per layer and step, ms */
    double step_ms, step_p50_ms, step_max_ms, append_ms, select_ms, decode_ms, other_ms;
    uint32_t cycles;
    /* decode-loop deltas */
    kvt_stats d;
    double refetch_bytes;    /* sum over steps of stable heads' selections x block */
    double selected_pages;   /* every head's selections, summed over steps */
    double rerank_pages;     /* stable heads' selections at their reranks */
    uint64_t not_ready;      /* sequences not ready right after a plan, over steps */
    bool disk_direct;
} run_result;

static void get_stats(const kvt_pool *pool, kvt_stats *s)
{
    memset(s, 0, sizeof *s);
    s->struct_size = (uint32_t)sizeof *s;
    CHECK(kvt_pool_stats_get(pool, s));
}

static void stats_delta(const kvt_stats *a, const kvt_stats *b, kvt_stats *d)
{
    memset(d, 0, sizeof *d);
    for (uint32_t i = 0; i < KVT_NUM_DIRS; i++) {
        d->moved_bytes[i] = b->moved_bytes[i] - a->moved_bytes[i];
        d->moved_requests[i] = b->moved_requests[i] - a->moved_requests[i];
    }
    d->sel_pages = b->sel_pages - a->sel_pages;
    d->sel_resident = b->sel_resident - a->sel_resident;
    d->promoted_pages = b->promoted_pages - a->promoted_pages;
    d->recycled_blocks = b->recycled_blocks - a->recycled_blocks;
    d->evicted_pages = b->evicted_pages - a->evicted_pages;
    d->offloaded_pages = b->offloaded_pages - a->offloaded_pages;
    d->reranked_heads = b->reranked_heads - a->reranked_heads;
    d->paused_seqs = b->paused_seqs - a->paused_seqs;
}

static void wait_moves(kvt_pool *pool)
{
    kvt_mover *mv;
    CHECK(kvt_pool_mover_get(pool, &mv));
    CHECK(kvt_mover_wait(mv, KVT_FENCE_ALL, UINT64_MAX));
}

static void track_peak(const kvt_pool *pool, run_result *r)
{
    kvt_stats s;
    get_stats(pool, &s);
    if (s.tier[KVT_TIER_DEVICE].bytes_used > r->device_used_peak)
        r->device_used_peak = s.tier[KVT_TIER_DEVICE].bytes_used;
}

static void check_finite(const float *p, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(p[i])) {
            fprintf(stderr, PROG ": %s: value %zu is not finite (%g)\n", what, i, (double)p[i]);
            exit(1);
        }
}

/* Bytes of a disk tier that holds every page of every (sequence, layer,
 * head) at `tokens` tokens: whole extents per (sequence, layer, head),
 * whole segments per (layer, head), one segment to spare. */
static uint64_t disk_bytes_for(const workload *w, uint64_t tokens, uint64_t block)
{
    kvt_mover_opts mo;
    CHECK(kvt_mover_opts_init(&mo));
    uint64_t slot = (block + 4095u) / 4096u * 4096u;
    uint64_t pages = tokens / w->g.page_tokens;
    uint64_t ext = (pages + mo.extent_pages - 1) / mo.extent_pages * w->o->batch;
    uint64_t seg = (ext + mo.segment_extents - 1) / mo.segment_extents;
    uint64_t seg_bytes = (uint64_t)mo.extent_pages * mo.segment_extents * slot;
    return ((uint64_t)w->L * w->H * seg + 1u) * seg_bytes;
}

/* One pool of a context: opened (created, prefilled, warmed up), then
 * stepped a cycle at a time, interleaved with the context's other pools,
 * then closed (counters read, checked, freed). */
typedef struct pool_run {
    const char *name;
    const workload *w;
    run_result r;
    bool tiered;
    kvt_pool *pool;
    kvt_seq_id *seqs;
    kvt_step_opts so;
    kvt_stats s0;
    uint32_t *pages, max_pages, next_step;
    float *out, *lse;
    double *step_s;  /* [steps] seconds of each step */
    double *cycle_s; /* [cycles] mean step seconds of each whole cycle */
    double app_s, sel_s, dec_s, tot_s;
} pool_run;

/* Returns false (nothing allocated) when a dense pool would not fit in
 * memory; a tiered pool that would not fit ends the program. */
static bool pool_open(pool_run *pr, const char *name, const workload *w, int mode,
                      const kvt_policy *pol, const kvt_selector *sel)
{
    const tier_opts *o = w->o;
    const uint32_t B = o->batch, L = w->L, H = w->H, Hq = w->Hq, D = w->D, S = o->steps;
    run_result *r = &pr->r;
    memset(pr, 0, sizeof *pr);
    pr->name = name;
    pr->w = w;
    pr->tiered = mode != MODE_DENSE;
    r->mode = mode;
    r->target_tokens = (uint64_t)w->ctx + S;

    kvt_pool_opts po;
    CHECK(kvt_pool_opts_init(&po));
    po.backend = KVT_BACKEND_CPU;
    po.geom = w->g;
    po.max_seqs = B;
    po.max_seq_tokens = w->ctx + S + o->page_tokens;
    po.n_threads = o->threads;
    po.policy = pol;
    po.selector = sel;
    po.target_tokens = r->target_tokens;
    po.target_seqs = B;
    r->sz.struct_size = (uint32_t)sizeof r->sz;
    CHECK(kvt_pool_sizing_get(&po, &r->sz));
    CHECK(kvt_geometry_block_bytes(&w->g, &r->block_bytes));
    const uint64_t blk = r->block_bytes;
    if (mode == MODE_DENSE) {
        po.policy = NULL;
        po.selector = NULL;
        po.target_tokens = 0;
        po.target_seqs = 0;
        po.device_bytes = r->sz.dense_bytes;
    } else {
        po.device_bytes = 0; /* sized by the library from target_tokens */
        po.host_bytes = r->sz.host_bytes;
        if (mode == MODE_DISK) {
            uint64_t hb = r->sz.host_bytes / blk - 1u;
            uint64_t keep = (uint64_t)floor((double)hb * o->disk_host_fraction);
            po.host_bytes = ((keep < 2 ? 2 : keep) + 1u) * blk;
            po.disk_bytes = disk_bytes_for(w, r->target_tokens, blk);
            po.disk_dir = o->disk_dir;
        }
    }

    /* The metadata store has a slot per block of every tier. */
    double meta = 3.0 * D * 2.0 *
                  ((double)(mode == MODE_DENSE ? r->sz.dense_bytes : r->sz.device_bytes) +
                   (double)po.host_bytes + (double)po.disk_bytes) / (double)blk;
    double need = (double)(mode == MODE_DENSE ? r->sz.dense_bytes : r->sz.device_bytes) +
                  (double)po.host_bytes + meta + 64.0 * 1048576.0;
    double avail = mem_available();
    fprintf(stderr, "%s ctx=%u batch=%u: device %.3f GiB, host %.3f GiB, disk %.3f GiB, "
            "metadata %.3f GiB (dense %.3f GiB)\n", name, w->ctx, B,
            gib(mode == MODE_DENSE ? (double)r->sz.dense_bytes : (double)r->sz.device_bytes),
            gib((double)po.host_bytes), gib((double)po.disk_bytes), gib(meta),
            gib((double)r->sz.dense_bytes));
    if (avail > 0 && need > 0.85 * avail) {
        fprintf(stderr, PROG ": %s ctx %u needs about %.1f GiB, more than 85%% of the %.1f GiB "
                "available; %s\n", name, w->ctx, gib(need), gib(avail),
                mode == MODE_DENSE ? "skipped" : "stopping");
        if (mode != MODE_DENSE)
            exit(1);
        return false;
    }

    CHECK(kvt_pool_create(&po, &pr->pool));
    kvt_pool *pool = pr->pool;
    CHECK(kvt_pool_kernel_isa_get(pool, &r->isa));
    {
        kvt_stats s;
        get_stats(pool, &s);
        r->device_cap = s.tier[KVT_TIER_DEVICE].bytes_total + blk;
        r->host_cap = s.tier[KVT_TIER_HOST].bytes_total;
        r->disk_cap = s.tier[KVT_TIER_DISK].bytes_total;
        r->meta_bytes = s.meta_bytes_total;
        if (mode == MODE_DISK) {
            kvt_mover *mv;
            kvt_mover_stats ms;
            memset(&ms, 0, sizeof ms);
            ms.struct_size = (uint32_t)sizeof ms;
            CHECK(kvt_pool_mover_get(pool, &mv));
            CHECK(kvt_mover_stats_get(mv, &ms));
            r->disk_direct = ms.disk_direct != 0;
        }
    }

    pr->seqs = bench_xmalloc(B * sizeof *pr->seqs);
    for (uint32_t b = 0; b < B; b++)
        CHECK(kvt_seq_create(pool, NULL, &pr->seqs[b]));

    /* Prefill: chunk by chunk, every layer of a chunk before the next one. */
    const uint32_t C = w->chunk;
    float *kc = bench_xmalloc((size_t)C * H * D * sizeof(float));
    float *vc = bench_xmalloc((size_t)C * H * D * sizeof(float));
    double t0 = bench_now(), gen_s = 0;
    for (uint32_t b = 0; b < B; b++)
        for (uint32_t t = 0; t < w->ctx; t += C) {
            uint32_t n = w->ctx - t < C ? w->ctx - t : C;
            for (uint32_t l = 0; l < L; l++) {
                double tg = bench_now();
                make_kv(w, b, l, t, n, kc, vc);
                gen_s += bench_now() - tg;
                CHECK(kvt_seq_append(pool, pr->seqs[b], l, kc, vc, n, KVT_DTYPE_F32, 0));
            }
            if ((t / C) % 16 == 0 || t + n == w->ctx) {
                track_peak(pool, r);
                fprintf(stderr, "\r  prefill seq %u: %u/%u tokens", b, t + n, w->ctx);
            }
        }
    r->prefill_s = bench_now() - t0 - gen_s;
    fprintf(stderr, "\r  prefill: %.2f s in the library (+ %.2f s generating data)\n",
            r->prefill_s, gen_s);
    free(kc);
    free(vc);

    if (pr->tiered) {
        kvt_stats s0, s1;
        get_stats(pool, &s0);
        double tw = bench_now();
        for (uint32_t b = 0; b < B; b++)
            CHECK(kvt_seq_warmup(pool, pr->seqs[b],
                                 w->obs + (size_t)b * L * o->n_obs * Hq * D, o->n_obs));
        double tw1 = bench_now();
        wait_moves(pool);
        double tw2 = bench_now();
        r->warmup_ms = (tw1 - tw) * 1e3;
        r->settle_ms = (tw2 - tw1) * 1e3;
        get_stats(pool, &s1);
        r->warmup_promoted = s1.promoted_pages - s0.promoted_pages;
        r->warmup_h2d = s1.moved_bytes[KVT_DIR_HOST_TO_DEVICE] -
                        s0.moved_bytes[KVT_DIR_HOST_TO_DEVICE];
        track_peak(pool, r);
        fprintf(stderr, "  warm-up: %.1f ms, then %.1f ms until its moves landed (%llu pages "
                "promoted)\n", r->warmup_ms, r->settle_ms,
                (unsigned long long)r->warmup_promoted);
    }

    pr->max_pages = (uint32_t)((r->target_tokens + o->page_tokens) / o->page_tokens + 1);
    pr->pages = bench_xmalloc((size_t)pr->max_pages * sizeof *pr->pages);
    pr->out = bench_xmalloc((size_t)B * Hq * D * sizeof *pr->out);
    pr->lse = bench_xmalloc((size_t)B * Hq * sizeof *pr->lse);
    pr->step_s = bench_xmalloc(S * sizeof *pr->step_s);
    pr->cycle_s = bench_xmalloc((S / o->interval + 1) * sizeof *pr->cycle_s);
    CHECK(kvt_step_opts_init(&pr->so));
    if (!pr->tiered)
        pr->so.flags = KVT_STEP_DENSE;
    get_stats(pool, &pr->s0);
    return true;
}

/* Runs the next n decode steps. */
static void pool_steps(pool_run *pr, uint32_t n_steps)
{
    const workload *w = pr->w;
    const tier_opts *o = w->o;
    const uint32_t B = o->batch, L = w->L, H = w->H, Hq = w->Hq, D = w->D;
    const double blk = (double)pr->r.block_bytes;
    run_result *r = &pr->r;
    for (uint32_t k = 0; k < n_steps; k++) {
        const uint32_t s = pr->next_step++;
        double untimed = 0, ta = bench_now();
        kvt_step *st;
        CHECK(kvt_step_plan(pr->pool, pr->seqs, B, &pr->so, &st));
        if (pr->tiered)
            for (uint32_t b = 0; b < B; b++) {
                uint32_t ready = 1;
                CHECK(kvt_step_ready_get(st, b, &ready));
                r->not_ready += !ready;
            }
        for (uint32_t l = 0; l < L; l++) {
            size_t row = ((size_t)s * L + l) * B;
            const float *q = w->q + row * Hq * D;
            double t1 = bench_now();
            CHECK(kvt_step_append(st, l, w->kstep + row * H * D, w->vstep + row * H * D,
                                  KVT_DTYPE_F32, 0));
            double t2 = bench_now();
            if (pr->tiered)
                CHECK(kvt_step_select(st, l, q));
            else
                CHECK(kvt_step_select(st, l, q));
            double t3 = bench_now();
            CHECK(kvt_step_decode(st, l, q, pr->out, pr->lse));
            double t4 = bench_now();
            pr->app_s += t2 - t1;
            pr->sel_s += t3 - t2;
            pr->dec_s += t4 - t3;
            /* Untimed: the selection (the refetch baseline) and the outputs. */
            for (uint32_t b = 0; b < B; b++)
                for (uint32_t h = 0; h < H; h++) {
                    uint32_t n = 0, rr = 0;
                    CHECK(kvt_step_selection_get(st, l, b, h, pr->pages, pr->max_pages, &n, &rr));
                    r->selected_pages += n;
                    if (w->cls[l * H + h] == KVT_HEAD_STABLE) {
                        r->refetch_bytes += (double)n * blk;
                        if (rr)
                            r->rerank_pages += n;
                    }
                }
            check_finite(pr->out, (size_t)B * Hq * D, "decode output");
            check_finite(pr->lse, (size_t)B * Hq, "decode lse");
            untimed += bench_now() - t4;
        }
        CHECK(kvt_step_finish(st));
        pr->step_s[s] = bench_now() - ta - untimed;
        pr->tot_s += pr->step_s[s];
        track_peak(pr->pool, r);
    }
}

static void pool_close(pool_run *pr)
{
    const workload *w = pr->w;
    const tier_opts *o = w->o;
    const uint32_t S = o->steps, L = w->L;
    run_result *r = &pr->r;
    kvt_stats s1;
    wait_moves(pr->pool);
    get_stats(pr->pool, &s1);
    stats_delta(&pr->s0, &s1, &r->d);
    r->device_used_end = s1.tier[KVT_TIER_DEVICE].bytes_used;
    r->host_used_end = s1.tier[KVT_TIER_HOST].bytes_used;
    r->disk_used_end = s1.tier[KVT_TIER_DISK].bytes_used;
    CHECK(kvt_pool_check(pr->pool));

    /* A cycle is `interval` steps (each stable head reranks once in it):
     * the mean step of each whole cycle, median over the cycles (one
     * partial cycle when steps < interval). */
    const uint32_t cyc = S >= o->interval ? S / o->interval : 1;
    const uint32_t per = S >= o->interval ? o->interval : S;
    for (uint32_t c = 0; c < cyc; c++) {
        double sum = 0;
        for (uint32_t i = 0; i < per; i++)
            sum += pr->step_s[c * per + i];
        pr->cycle_s[c] = sum / per;
    }
    r->cycles = cyc;
    r->step_ms = t_median(pr->cycle_s, cyc) * 1e3 / L;
    r->step_p50_ms = t_median(pr->step_s, S) * 1e3 / L;
    double mx = 0;
    for (uint32_t s = 0; s < S; s++)
        mx = pr->step_s[s] > mx ? pr->step_s[s] : mx;
    r->step_max_ms = mx * 1e3 / L;
    r->append_ms = pr->app_s * 1e3 / S / L;
    r->select_ms = pr->sel_s * 1e3 / S / L;
    r->decode_ms = pr->dec_s * 1e3 / S / L;
    r->other_ms = (pr->tot_s - pr->app_s - pr->sel_s - pr->dec_s) * 1e3 / S / L;
    r->ran = true;
    fprintf(stderr, "  %s ctx=%u: %.4f ms per layer and step (median of %u cycles of %u steps)\n",
            pr->name, w->ctx, r->step_ms, cyc, per);

    for (uint32_t b = 0; b < o->batch; b++)
        CHECK(kvt_seq_release(pr->pool, pr->seqs[b]));
    kvt_pool_destroy(pr->pool);
    pr->pool = NULL;
    free(pr->seqs);
    free(pr->pages);
    free(pr->out);
    free(pr->lse);
    free(pr->step_s);
}

/* The median over the cycles of a's cycle time / b's (the pools ran their
 * cycles interleaved, so each pair saw the same machine); NAN if either did
 * not run. */
static double paired_ratio(const pool_run *a, const pool_run *b)
{
    if (!a->r.ran || !b->r.ran || a->r.cycles != b->r.cycles)
        return NAN;
    double *v = bench_xmalloc(a->r.cycles * sizeof *v);
    for (uint32_t c = 0; c < a->r.cycles; c++)
        v[c] = a->cycle_s[c] / b->cycle_s[c];
    double m = t_median(v, a->r.cycles);
    free(v);
    return m;
}

/* ---- output ---------------------------------------------------------------------- */

static double ratio(double a, double b)
{
    return b > 0 ? a / b : NAN;
}

/* Figures of a tiered run that the summary needs. */
typedef struct tier_fig {
    double device_fraction, device_used_fraction, meta_fraction, device_meta_fraction;
    double fetch_ratio, hit_rate, rerank_hit_rate, paused_fraction, not_ready_fraction, vs_dense;
} tier_fig;

static void emit_run(const workload *w, const pool_run *pr, const pool_run *dense,
                     const pool_run *host, tier_fig *f)
{
    const run_result *r = &pr->r;
    const tier_opts *o = w->o;
    const double S = o->steps, B = o->batch, L = w->L, blk = (double)r->block_bytes;
    const double dense_cap = (double)r->sz.dense_bytes;
    const double dense_kv = (double)r->sz.dense_pages * blk;
    jline j;
    j_begin(&j);
    j_str(&j, "case", pr->name);
    j_u64(&j, "ctx", w->ctx);
    j_u64(&j, "batch", o->batch);
    j_u64(&j, "layers", w->L);
    j_u64(&j, "kv_heads", w->H);
    j_u64(&j, "q_heads", w->Hq);
    j_u64(&j, "head_dim", w->D);
    j_u64(&j, "page_tokens", o->page_tokens);
    j_str(&j, "dtype", "f16");
    j_u64(&j, "budget_tokens", o->budget);
    j_u64(&j, "top_k_pages", o->budget / o->page_tokens);
    j_u64(&j, "window", o->window);
    j_u64(&j, "interval", o->interval);
    j_u64(&j, "stable_heads", w->n_stable);
    j_u64(&j, "unstable_heads", w->L * w->H - w->n_stable);
    j_u64(&j, "steps", o->steps);
    j_real(&j, "drift", w->drift, 4);
    j_u64(&j, "target_tokens", r->target_tokens);
    j_str(&j, "isa", r->isa);
    j_u64(&j, "block_bytes", r->block_bytes);
    /* memory */
    j_u64(&j, "device_bytes", r->device_cap);
    j_u64(&j, "sizing_device_bytes", r->mode == MODE_DENSE ? r->sz.dense_bytes : r->sz.device_bytes);
    j_u64(&j, "dense_bytes", r->sz.dense_bytes);
    j_u64(&j, "device_used_peak_bytes", r->device_used_peak);
    j_u64(&j, "device_used_end_bytes", r->device_used_end);
    j_u64(&j, "meta_bytes", r->meta_bytes);
    j_u64(&j, "sizing_meta_bytes", r->sz.meta_bytes);
    j_u64(&j, "host_bytes", r->host_cap);
    j_u64(&j, "host_used_bytes", r->host_used_end);
    j_u64(&j, "disk_bytes", r->disk_cap);
    j_u64(&j, "disk_used_bytes", r->disk_used_end);
    tier_fig fig;
    fig.device_fraction = ratio((double)r->device_cap, dense_cap);
    fig.device_used_fraction = ratio((double)r->device_used_peak, dense_kv);
    fig.meta_fraction = ratio((double)r->meta_bytes, dense_cap);
    fig.device_meta_fraction =
        ratio((double)r->device_cap + (double)r->meta_bytes, dense_cap + (double)r->meta_bytes);
    j_real(&j, "device_fraction", fig.device_fraction, 4);
    j_real(&j, "device_used_fraction", fig.device_used_fraction, 4);
    j_real(&j, "meta_fraction", fig.meta_fraction, 4);
    j_real(&j, "device_meta_fraction", fig.device_meta_fraction, 4);
    /* movement, per step */
    const kvt_stats *d = &r->d;
    j_real(&j, "h2d_bytes_per_step", (double)d->moved_bytes[KVT_DIR_HOST_TO_DEVICE] / S, 0);
    j_real(&j, "d2h_bytes_per_step", (double)d->moved_bytes[KVT_DIR_DEVICE_TO_HOST] / S, 0);
    j_real(&j, "host_to_disk_bytes_per_step", (double)d->moved_bytes[KVT_DIR_HOST_TO_DISK] / S, 0);
    j_real(&j, "disk_to_host_bytes_per_step", (double)d->moved_bytes[KVT_DIR_DISK_TO_HOST] / S, 0);
    j_real(&j, "refetch_bytes_per_step", r->mode == MODE_DENSE ? NAN : r->refetch_bytes / S, 0);
    fig.fetch_ratio = r->mode == MODE_DENSE
                          ? NAN
                          : ratio((double)d->moved_bytes[KVT_DIR_HOST_TO_DEVICE], r->refetch_bytes);
    j_real(&j, "fetch_ratio", fig.fetch_ratio, 5);
    j_real(&j, "pages_selected_per_step", r->selected_pages / S, 1);
    fig.hit_rate = ratio((double)d->sel_resident, (double)d->sel_pages);
    j_real(&j, "hit_rate", fig.hit_rate, 4);
    j_u64(&j, "sel_pages", d->sel_pages);
    j_u64(&j, "sel_resident", d->sel_resident);
    fig.rerank_hit_rate = r->mode == MODE_DENSE
                              ? NAN
                              : 1.0 - ratio((double)d->promoted_pages, r->rerank_pages);
    j_real(&j, "rerank_hit_rate", fig.rerank_hit_rate, 4);
    fig.paused_fraction = r->mode == MODE_DENSE ? NAN : (double)d->paused_seqs / (S * B * L);
    fig.not_ready_fraction = r->mode == MODE_DENSE ? NAN : (double)r->not_ready / (S * B);
    j_real(&j, "paused_fraction", fig.paused_fraction, 4);
    j_real(&j, "not_ready_fraction", fig.not_ready_fraction, 4);
    j_u64(&j, "promoted_pages", d->promoted_pages);
    j_u64(&j, "recycled_blocks", d->recycled_blocks);
    j_u64(&j, "evicted_pages", d->evicted_pages);
    j_u64(&j, "offloaded_pages", d->offloaded_pages);
    j_u64(&j, "reranked_heads", d->reranked_heads);
    /* time */
    j_real(&j, "prefill_s", r->prefill_s, 3);
    j_real(&j, "warmup_ms", r->mode == MODE_DENSE ? NAN : r->warmup_ms, 3);
    j_real(&j, "warmup_settle_ms", r->mode == MODE_DENSE ? NAN : r->settle_ms, 3);
    j_u64(&j, "warmup_promoted_pages", r->warmup_promoted);
    j_u64(&j, "warmup_h2d_bytes", r->warmup_h2d);
    j_real(&j, "ms_per_layer", r->step_ms, 4);
    j_u64(&j, "cycles", r->cycles);
    j_real(&j, "step_p50_ms_per_layer", r->step_p50_ms, 4);
    j_real(&j, "step_max_ms_per_layer", r->step_max_ms, 4);
    j_real(&j, "append_ms", r->append_ms, 4);
    j_real(&j, "select_ms", r->select_ms, 4);
    j_real(&j, "decode_ms", r->decode_ms, 4);
    j_real(&j, "plan_finish_ms", r->other_ms, 4);
    double dms = dense && dense->r.ran ? dense->r.step_ms : NAN;
    j_real(&j, "dense_ms_per_layer", r->mode == MODE_DENSE ? NAN : dms, 4);
    fig.vs_dense = r->mode == MODE_DENSE || !dense ? NAN : paired_ratio(pr, dense);
    j_real(&j, "ms_vs_dense", fig.vs_dense, 4);
    if (r->mode == MODE_DISK) {
        j_real(&j, "host_only_ms_per_layer", host && host->r.ran ? host->r.step_ms : NAN, 4);
        j_real(&j, "decode_slowdown_disk", host ? paired_ratio(pr, host) - 1.0 : NAN, 4);
        j_real(&j, "disk_read_share", ratio((double)d->moved_bytes[KVT_DIR_DISK_TO_HOST],
                                            (double)d->moved_bytes[KVT_DIR_HOST_TO_DEVICE]), 4);
        j_real(&j, "host_fraction", o->disk_host_fraction, 4);
        j_bool(&j, "disk_direct", r->disk_direct);
        j_str(&j, "disk_dir", o->disk_dir);
    }
    j_end(&j);
    if (f)
        *f = fig;
}

static bool memfs_dir(const char *dir)
{
    struct statfs sf;
    if (statfs(dir, &sf))
        tier_die("cannot statfs the disk directory", dir);
    return sf.f_type == TMPFS_MAGIC || sf.f_type == TIER_RAMFS_MAGIC;
}

/* The disk comparison of one pair of pools (tier_disk against tier_host,
 * or the stress pair) for the summary. */
typedef struct disk_fig {
    uint32_t ctx; /* 0: not run */
    double slowdown, hit_rate, rerank_hit_rate, paused_fraction;
    double disk_read_bytes_per_step, disk_read_share; /* of the promoted bytes */
    double fetch_ratio; /* of the pair's host-only pool */
} disk_fig;

static void disk_summary(disk_fig *f, const pool_run *disk, const pool_run *host,
                         const tier_fig *fig, const tier_fig *host_fig, uint32_t ctx)
{
    f->fetch_ratio = host_fig->fetch_ratio;
    const kvt_stats *d = &disk->r.d;
    f->ctx = ctx;
    f->slowdown = paired_ratio(disk, host) - 1.0;
    f->hit_rate = fig->hit_rate;
    f->rerank_hit_rate = fig->rerank_hit_rate;
    f->paused_fraction = fig->paused_fraction;
    f->disk_read_bytes_per_step =
        (double)d->moved_bytes[KVT_DIR_DISK_TO_HOST] / disk->w->o->steps;
    f->disk_read_share = ratio((double)d->moved_bytes[KVT_DIR_DISK_TO_HOST],
                               (double)d->moved_bytes[KVT_DIR_HOST_TO_DEVICE]);
}

static void disk_json(jline *j, const char *sfx, const disk_fig *f, bool cond)
{
    char k[64];
    const bool ran = f->ctx != 0;
    snprintf(k, sizeof k, "disk%s_ctx", sfx);
    if (ran)
        j_u64(j, k, f->ctx);
    else
        j_str(j, k, NULL);
    snprintf(k, sizeof k, "decode_slowdown_disk%s", sfx);
    j_real(j, k, ran ? f->slowdown : NAN, 4);
    snprintf(k, sizeof k, "disk%s_target", sfx);
    j_real(j, k, TARGET_DISK_SLOWDOWN, 2);
    snprintf(k, sizeof k, "disk%s_met", sfx);
    j_bool(j, k, ran && cond && isfinite(f->slowdown) ? f->slowdown <= TARGET_DISK_SLOWDOWN : -1);
    snprintf(k, sizeof k, "disk%s_hit_rate", sfx);
    j_real(j, k, ran ? f->hit_rate : NAN, 4);
    snprintf(k, sizeof k, "disk%s_rerank_hit_rate", sfx);
    j_real(j, k, ran ? f->rerank_hit_rate : NAN, 4);
    snprintf(k, sizeof k, "disk%s_paused_fraction", sfx);
    j_real(j, k, ran ? f->paused_fraction : NAN, 4);
    snprintf(k, sizeof k, "disk%s_read_bytes_per_step", sfx);
    j_real(j, k, ran ? f->disk_read_bytes_per_step : NAN, 0);
    snprintf(k, sizeof k, "disk%s_read_share", sfx);
    j_real(j, k, ran ? f->disk_read_share : NAN, 4);
    if (*sfx) {
        snprintf(k, sizeof k, "fetch_ratio%s", sfx);
        j_real(j, k, ran ? f->fetch_ratio : NAN, 5);
    }
}

int bench_tier_main(int argc, char **argv)
{
    tier_opts o;
    tier_parse_args(argc, argv, &o);
    double t_start = bench_now();

    bool disk_case = false;
    for (uint32_t i = 0; i < o.n_ctx; i++)
        disk_case = disk_case || (o.disk && o.ctx[i] == o.disk_ctx);
    if (o.disk && !disk_case)
        fprintf(stderr, PROG ": warning: --disk-ctx %u is not among --ctx; no disk case\n",
                o.disk_ctx);
    if (disk_case) {
        if (access(o.disk_dir, W_OK))
            tier_die("the disk directory is not writable", o.disk_dir);
        if (memfs_dir(o.disk_dir)) {
            fprintf(stderr, PROG ": warning: the disk directory is tmpfs/ramfs (memory, not a "
                    "disk)\n");
            printf("{\"warning\":\"the disk directory %s is tmpfs/ramfs\"}\n", o.disk_dir);
        }
    }

    bool have_sum = false;
    uint32_t sum_ctx = 0;
    tier_fig sum_fig = {0};
    double worst_fetch = -1;
    disk_fig dbase = {.ctx = 0}, dstress = {.ctx = 0};
    for (uint32_t i = 0; i < o.n_ctx; i++) {
        const bool do_disk = o.disk && o.ctx[i] == o.disk_ctx && !dbase.ctx;
        const bool do_stress = do_disk && o.stress;
        workload w, ws;
        workload_init(&w, &o, o.ctx[i], o.drift);
        if (do_stress)
            workload_init(&ws, &o, o.ctx[i], o.stress_drift);
        const uint32_t n = w.L * w.H;
        kvt_policy_opts pso;
        CHECK(kvt_policy_opts_init(&pso));
        pso.top_k_pages = o.budget / o.page_tokens;
        pso.window = o.window;
        pso.sink_pages = 1;
        pso.local_pages = 1;
        pso.stable_interval = o.interval;
        pso.unstable_interval = 1;
        kvt_policy_heads ph;
        memset(&ph, 0, sizeof ph);
        ph.struct_size = (uint32_t)sizeof ph;
        ph.n_heads = n;
        ph.head_class = w.cls;
        kvt_policy *pol;
        CHECK(kvt_policy_create_heads(&w.g, &pso, &ph, &pol));
        kvt_selector *sel;
        CHECK(kvt_selector_create(&w.g, NULL, &sel));

        /* The context's pools are built one after the other, then decoded
         * a cycle (`interval` steps) at a time in turns, so that each pair
         * of cycles compared saw the same state of the machine. */
        pool_run host, disk, dense, hstress, dstress_run;
        memset(&disk, 0, sizeof disk);
        memset(&dense, 0, sizeof dense);
        memset(&hstress, 0, sizeof hstress);
        memset(&dstress_run, 0, sizeof dstress_run);
        pool_run *runs[5];
        uint32_t n_runs = 0;
        pool_open(&host, "tier_host", &w, MODE_HOST, pol, sel);
        runs[n_runs++] = &host;
        if (do_disk) {
            pool_open(&disk, "tier_disk", &w, MODE_DISK, pol, sel);
            runs[n_runs++] = &disk;
        }
        if (do_stress) {
            pool_open(&hstress, "tier_host_stress", &ws, MODE_HOST, pol, sel);
            runs[n_runs++] = &hstress;
            pool_open(&dstress_run, "tier_disk_stress", &ws, MODE_DISK, pol, sel);
            runs[n_runs++] = &dstress_run;
        }
        if (o.dense && pool_open(&dense, "dense", &w, MODE_DENSE, pol, sel))
            runs[n_runs++] = &dense;
        const uint32_t per = o.steps >= o.interval ? o.interval : o.steps;
        for (uint32_t done = 0, c = 0; done < o.steps; done += per, c++) {
            uint32_t n_st = o.steps - done < per ? o.steps - done : per;
            if (o.steps - done - n_st < per) /* the rest joins the last cycle */
                n_st = o.steps - done;
            for (uint32_t k = 0; k < n_runs; k++)
                pool_steps(runs[(c + k) % n_runs], n_st);
            fprintf(stderr, "\r  decode ctx=%u: step %u/%u", o.ctx[i], done + n_st, o.steps);
            if (done + n_st == o.steps)
                break;
        }
        fprintf(stderr, "\n");
        for (uint32_t k = 0; k < n_runs; k++)
            pool_close(runs[k]);

        tier_fig fig;
        if (dense.r.ran)
            emit_run(&w, &dense, NULL, NULL, NULL);
        emit_run(&w, &host, &dense, NULL, &fig);
        if (isfinite(fig.fetch_ratio) && fig.fetch_ratio > worst_fetch)
            worst_fetch = fig.fetch_ratio;
        if (o.ctx[i] >= sum_ctx) {
            have_sum = true;
            sum_ctx = o.ctx[i];
            sum_fig = fig;
        }
        if (do_disk) {
            tier_fig dfig;
            emit_run(&w, &disk, &dense, &host, &dfig);
            disk_summary(&dbase, &disk, &host, &dfig, &fig, o.ctx[i]);
        }
        if (do_stress) {
            tier_fig hfig, dfig;
            emit_run(&ws, &hstress, &dense, NULL, &hfig);
            emit_run(&ws, &dstress_run, &dense, &hstress, &dfig);
            disk_summary(&dstress, &dstress_run, &hstress, &dfig, &hfig, o.ctx[i]);
        }
        free(host.cycle_s);
        free(disk.cycle_s);
        free(dense.cycle_s);
        free(hstress.cycle_s);
        free(dstress_run.cycle_s);
        kvt_selector_destroy(sel);
        kvt_policy_destroy(pol);
        workload_free(&w);
        if (do_stress)
            workload_free(&ws);
    }

    /* The summary. (a) holds for 128k tokens, 25% unstable heads and a
     * 2048-token budget; its met is null under other settings. */
    const bool cond_a = sum_ctx == 131072 && o.budget == 2048 && o.page_tokens == 16 &&
                        fabs(o.unstable_fraction - 0.25) < 1e-9 && o.window == 1;
    jline j;
    j_begin(&j);
    j_str(&j, "summary", "tier");
    j_u64(&j, "ctx", sum_ctx);
    j_u64(&j, "batch", o.batch);
    j_u64(&j, "layers", o.layers);
    j_u64(&j, "steps", o.steps);
    j_u64(&j, "interval", o.interval);
    j_u64(&j, "budget_tokens", o.budget);
    j_real(&j, "unstable_fraction", o.unstable_fraction, 4);
    j_real(&j, "device_fraction", have_sum ? sum_fig.device_fraction : NAN, 4);
    j_real(&j, "device_fraction_128k",
           have_sum && sum_ctx == 131072 ? sum_fig.device_fraction : NAN, 4);
    j_real(&j, "meta_fraction", have_sum ? sum_fig.meta_fraction : NAN, 4);
    j_real(&j, "device_meta_fraction", have_sum ? sum_fig.device_meta_fraction : NAN, 4);
    j_real(&j, "device_target", TARGET_DEVICE_FRACTION, 2);
    j_bool(&j, "device_met",
           cond_a && isfinite(sum_fig.device_fraction)
               ? sum_fig.device_fraction <= TARGET_DEVICE_FRACTION
               : -1);
    j_real(&j, "fetch_ratio", have_sum ? sum_fig.fetch_ratio : NAN, 5);
    j_real(&j, "fetch_ratio_worst", worst_fetch >= 0 ? worst_fetch : NAN, 5);
    j_real(&j, "fetch_target", TARGET_FETCH_RATIO, 4);
    j_bool(&j, "fetch_met",
           o.interval == 16 && worst_fetch >= 0 ? worst_fetch <= TARGET_FETCH_RATIO : -1);
    j_real(&j, "hit_rate", have_sum ? sum_fig.hit_rate : NAN, 4);
    j_real(&j, "rerank_hit_rate", have_sum ? sum_fig.rerank_hit_rate : NAN, 4);
    j_real(&j, "paused_fraction", have_sum ? sum_fig.paused_fraction : NAN, 4);
    j_real(&j, "ms_vs_dense", have_sum ? sum_fig.vs_dense : NAN, 4);
    const bool cond_c = fabs(o.disk_host_fraction - 0.25) < 1e-9;
    disk_json(&j, "", &dbase, cond_c);
    j_real(&j, "stress_drift", o.stress ? o.stress_drift : NAN, 4);
    disk_json(&j, "_stress", &dstress, cond_c);
    if (!cond_a)
        j_str(&j, "missing", "device_met needs --ctx ...,128k --budget 2048 "
                             "--unstable-fraction 0.25 --window 1 --page-tokens 16");
    j_end(&j);
    fprintf(stderr, "total: %.1f s\n", bench_now() - t_start);
    return 0;
}
