/* kvtier-bench --backend cuda: the CUDA backend's kernels, each measured in
 * the same run as the hardware limit it is compared with, one JSON object
 * per case on stdout (progress on stderr), a short table at the end.
 *
 *   kvtier-bench --backend cuda attn [--batch 1,8,16,40] [--ctx 10k,32k,128k]
 *   kvtier-bench --backend cuda copy [--sizes 8k,64k,256k,1m,4m]
 *   kvtier-bench --backend cuda all        (attn, then copy)
 *   kvtier-bench --backend cuda tier [--batch ...] [--ctx ...]
 *   common: [--reps N] [--smoke] [--json-only] [--help]
 *
 * attn: one layer of Llama-3-8B geometry (8 KV heads, GQA 4, head_dim 128,
 * f16, 16-token pages) for B sequences of ctx tokens, every block at a
 * random place of a device arena. Dense decode (every page) against sparse
 * decode (64 random pages + the last one per KV head: a 1024-token budget),
 * and the selection that would pick them (kvt__cu_score MINMAX/SUM +
 * kvt__cu_topk k = 64). Before every timed launch a read-only pass over a
 * separate arena of >= 4x the L2 size evicts the L2, so each launch reads
 * its KV from HBM (as in a real step, where the other layers' work has
 * evicted this layer's). The dense rate is compared with a device-to-device
 * cudaMemcpyAsync of >= 2 GiB in the same run (read + write bytes).
 *
 * copy: scattered pinned host pages -> device blocks, 1 GiB per pass from a
 * 2 GiB pinned arena, via the zero-copy kernel on a low-priority stream and
 * via cudaMemcpyAsync per transfer, against one 1 GiB cudaMemcpyAsync; then
 * a batch-8 x 32k sparse decode alone and while 64 KiB transfers stream in.
 *
 * Times are CUDA events, medians of --reps launches after one warm-up.
 * Built against the CPU emulation (KVT_BENCH_EMU, libkvtier-emu.a) every
 * event time is 0: ratios over a zero time print as null, and --smoke runs
 * tiny sizes there and checks the results.
 */
#include "bench_cuda.h"

#include "bench_io.h"

#include <kvtier/kvtier.h>

#include "kvt_cuda.h"

#include <cuda_runtime_api.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PROG "kvtier-bench --backend cuda"
#define CB_MAX_LIST 16

/* Geometry of one Llama-3-8B layer. */
#define CB_H  8u   /* KV heads */
#define CB_G  4u   /* query heads per KV head */
#define CB_D  128u /* head_dim */
#define CB_P  16u  /* tokens per page */
#define CB_ELEM 2u /* f16 */
#define CB_BLOCK_BYTES ((uint64_t)2 * CB_P * CB_D * CB_ELEM) /* 8 KiB */
#define CB_META_BYTES  ((uint64_t)3 * CB_D * CB_ELEM)        /* 768 B */
#define CB_MM_BYTES    ((uint64_t)2 * CB_D * CB_ELEM)        /* a slot's min, max rows */

/* Selection: top-K pages per KV head plus the last (local) page. */
#define CB_TOPK_PAGES  64u
#define CB_SMOKE_TOPK  4u

/* Targets of the issue. */
#define CB_TARGET_SPEEDUP   4.0         /* batch 40 x 10k, dense / sparse */
#define CB_TARGET_BATCH     40u
#define CB_TARGET_CTX       10240u
#define CB_TARGET_HBM_FRAC  (1.0 / 1.3) /* dense within 1.3x of KV bytes / HBM rate */
#define CB_TARGET_COPY_FRAC 0.80        /* UVA kernel, 8 KiB pages, of the H2D probe */

#define GIB 1073741824.0

/* ---- errors ----------------------------------------------------------------- */

static void cb_die(const char *what, const char *detail)
{
    fprintf(stderr, PROG ": %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    exit(1);
}

/* A CUDA runtime call that must not fail (a failure here is sticky or a bug). */
#define CU(call)                                                                           \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, PROG ": %s failed: %s (%s)\n", #call, cudaGetErrorName(e_),   \
                    cudaGetErrorString(e_));                                               \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* A library (kvt__cu_*) call that must not fail: CHECK (bench_io.h). */

/* ---- options ---------------------------------------------------------------- */

typedef struct cb_list {
    uint32_t v[CB_MAX_LIST];
    uint32_t n;
} cb_list;

enum { CMD_NONE, CMD_ATTN, CMD_COPY, CMD_ALL, CMD_TIER };

typedef struct cb_opts {
    int cmd;
    bool smoke, json_only;
    uint32_t reps;
    cb_list batch, ctx, sizes;
} cb_opts;

static const char cb_usage_text[] =
    "usage: " PROG " attn|copy|all|tier [options]\n"
    "  attn             dense vs sparse decode + selection kernels, vs a device-to-device\n"
    "                   HBM probe (Llama-3-8B layer: 8 KV heads, GQA 4, D 128, f16, P 16)\n"
    "  copy             scattered pinned host pages -> device: zero-copy kernel vs\n"
    "                   cudaMemcpyAsync vs a 1 GiB host-to-device probe; decode slowdown\n"
    "                   under a concurrent copy\n"
    "  all              attn, then copy\n"
    "  tier             a tiered pool's decode loop (policy, pinned host tier, 2 layers,\n"
    "                   top-K pages, window 2, rerank every 4 steps) against a\n"
    "                   device-only pool with the same selector: ms per step, device\n"
    "                   pages, promotions per step (default batch 1,8,16,40 x ctx 32k)\n"
    "  --batch LIST     sequences per attn case (default 1,8,16,40)\n"
    "  --ctx LIST       tokens per sequence, k = 1024 (default 10k,32k,128k)\n"
    "  --sizes LIST     copy transfer sizes, k/m suffixes (default 8k,64k,256k,1m,4m)\n"
    "  --reps N         timed launches per figure, median (default 7)\n"
    "  --smoke          tiny sizes (seconds, also under the CPU emulation) and checks:\n"
    "                   attention rows against a double-precision reference, scores,\n"
    "                   top-K, byte-exact copies; exit 1 on a mismatch\n"
    "  --json-only      no table at the end\n"
    "Prints one JSON object per case on stdout (the table's lines start with '#'),\n"
    "progress on stderr. Exit 77 without a CUDA device.\n";

static void cb_usage_error(const char *msg, const char *arg)
{
    bench_usage_exit(PROG, msg, arg, cb_usage_text);
}

/* A positive count with an optional k or m suffix (bench_count). */
static uint32_t cb_parse_count(const char *s, const char *flag)
{
    unsigned long long v;
    if (bench_count(s, 1, UINT32_MAX, &v))
        cb_usage_error("bad value for", flag);
    return (uint32_t)v;
}

static void cb_parse_list(cb_list *l, const char *s, const char *flag)
{
    char buf[256];
    if (!s || strlen(s) >= sizeof buf)
        cb_usage_error("bad value for", flag);
    strcpy(buf, s);
    l->n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (l->n == CB_MAX_LIST)
            cb_usage_error("too many values for", flag);
        l->v[l->n++] = cb_parse_count(tok, flag);
    }
    if (l->n == 0)
        cb_usage_error("empty list for", flag);
}

static void cb_set_list(cb_list *l, const uint32_t *v, uint32_t n)
{
    l->n = n;
    memcpy(l->v, v, n * sizeof *v);
}

static void cb_parse_args(int argc, char **argv, cb_opts *o)
{
    static const uint32_t batch[] = {1, 8, 16, 40}, ctx[] = {10240, 32768, 131072},
                          sizes[] = {8192, 65536, 262144, 1048576, 4194304};
    static const uint32_t s_batch[] = {2}, s_ctx[] = {200}, s_sizes[] = {8192, 65536, 262144};
    bool have_batch = false, have_ctx = false, have_sizes = false, have_reps = false;
    memset(o, 0, sizeof *o);
    o->reps = 7;

    for (int i = 1; i < argc; i++) {
        char flag[64];
        const char *a = argv[i], *val = NULL;
        if (strncmp(a, "--", 2) != 0) {
            int cmd = !strcmp(a, "attn")   ? CMD_ATTN
                      : !strcmp(a, "copy") ? CMD_COPY
                      : !strcmp(a, "all")  ? CMD_ALL
                      : !strcmp(a, "tier") ? CMD_TIER
                                           : CMD_NONE;
            if (cmd == CMD_NONE || o->cmd != CMD_NONE)
                cb_usage_error("unknown command or argument", a);
            o->cmd = cmd;
            continue;
        }
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        if (len >= sizeof flag)
            cb_usage_error("unknown option", a);
        memcpy(flag, a, len);
        flag[len] = '\0';
        if (!strcmp(flag, "--help")) {
            fputs(cb_usage_text, stdout);
            exit(0);
        }
        if (!strcmp(flag, "--smoke") || !strcmp(flag, "--json-only")) {
            if (eq)
                cb_usage_error("takes no value", a);
            if (flag[2] == 's')
                o->smoke = true;
            else
                o->json_only = true;
            continue;
        }
        if (strcmp(flag, "--backend") && strcmp(flag, "--batch") && strcmp(flag, "--ctx") &&
            strcmp(flag, "--sizes") && strcmp(flag, "--reps"))
            cb_usage_error("unknown option", a);
        if (eq)
            val = eq + 1;
        else if (i + 1 < argc)
            val = argv[++i];
        else
            cb_usage_error("missing value for", flag);
        if (!strcmp(flag, "--backend")) {
            if (strcmp(val, "cuda"))
                cb_usage_error("this entry point serves --backend cuda only, not", val);
        } else if (!strcmp(flag, "--batch")) {
            cb_parse_list(&o->batch, val, flag);
            have_batch = true;
        } else if (!strcmp(flag, "--ctx")) {
            cb_parse_list(&o->ctx, val, flag);
            have_ctx = true;
        } else if (!strcmp(flag, "--sizes")) {
            cb_parse_list(&o->sizes, val, flag);
            have_sizes = true;
        } else {
            o->reps = cb_parse_count(val, flag);
            have_reps = true;
        }
    }
    if (o->cmd == CMD_NONE)
        cb_usage_error("missing command", "attn, copy, all or tier");
    /* --smoke sets the sizes; explicit flags win. */
    if (!have_batch)
        o->smoke ? cb_set_list(&o->batch, s_batch, 1) : cb_set_list(&o->batch, batch, 4);
    if (!have_ctx)
        o->smoke ? cb_set_list(&o->ctx, s_ctx, 1) : cb_set_list(&o->ctx, ctx, 3);
    if (!have_sizes)
        o->smoke ? cb_set_list(&o->sizes, s_sizes, 3) : cb_set_list(&o->sizes, sizes, 5);
    if (o->cmd == CMD_TIER) { /* a loop of whole steps: smaller defaults */
        static const uint32_t t_ctx = 32768, ts_batch = 3, ts_ctx = 300;
        if (!have_ctx)
            o->smoke ? cb_set_list(&o->ctx, &ts_ctx, 1) : cb_set_list(&o->ctx, &t_ctx, 1);
        if (!have_batch && o->smoke)
            cb_set_list(&o->batch, &ts_batch, 1);
        for (uint32_t i = 0; i < o->batch.n; i++)
            if (o->batch.v[i] > 64)
                cb_usage_error("tier: --batch values are at most 64", NULL);
    }
    if (!have_reps && o->smoke)
        o->reps = 2;
    if (o->reps > 1000)
        cb_usage_error("--reps is at most 1000", NULL);
    for (uint32_t i = 0; i < o->batch.n; i++)
        if (o->batch.v[i] > 4096)
            cb_usage_error("--batch values are at most 4096", NULL);
    for (uint32_t i = 0; i < o->ctx.n; i++)
        if (o->ctx.v[i] > (1u << 24))
            cb_usage_error("--ctx values are at most 16m", NULL);
    for (uint32_t i = 0; i < o->sizes.n; i++)
        if (o->sizes.v[i] > (256u << 20))
            cb_usage_error("--sizes values are at most 256m", NULL);
}

/* ---- small helpers ------------------------------------------------------------ */

static uint64_t cb_rng(uint64_t *s) /* splitmix64 */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float cb_unit(uint64_t *s) /* uniform in [-1, 1) */
{
    return (float)((double)(cb_rng(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static uint64_t cb_below(uint64_t *s, uint64_t n) /* uniform in [0, n), n > 0 */
{
    return (uint64_t)(((unsigned __int128)cb_rng(s) * n) >> 64);
}

static uint16_t cb_f32_to_f16(float f) /* round to nearest even */
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) {
        float af;
        memcpy(&af, &ax, sizeof af);
        return (uint16_t)(sign | (uint32_t)lrintf(af * 16777216.0f));
    }
    uint32_t r = ax - 0x38000000u;
    r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
    return (uint16_t)(sign | r);
}

static double cb_f16_to_f64(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0    ? ldexp((double)m, -24)
               : e == 31 ? (m ? NAN : INFINITY)
                         : ldexp((double)(m | 0x400), e - 25);
    return (h & 0x8000) ? -v : v;
}

static int cb_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int cb_cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static double cb_median(double *v, uint32_t n)
{
    if (n == 0)
        return NAN;
    qsort(v, n, sizeof *v, cb_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* a / b where both are finite and b > 0; NaN (printed null) otherwise, so
 * the emulated build's zero event times never divide. */
static double cb_div(double a, double b)
{
    return isfinite(a) && isfinite(b) && b > 0 ? a / b : NAN;
}

static double cb_gbps(double bytes, double ms)
{
    return cb_div(bytes, ms * 1e6);
}

/* cudaMemcpy/cudaMemset (kvt__cu_memcpy/_memset) run on the legacy default
 * stream, which does not order against the non-blocking streams the
 * kernels run on, and may return before the device has finished (device
 * to device copies, memsets, pageable uploads): every setup phase ends
 * here before a kernel reads what it wrote. */
static void cb_settle(void)
{
    CU(cudaDeviceSynchronize());
}

static void *cb_dev_alloc(size_t bytes)
{
    void *d = NULL;
    CHECK(kvt__cu_malloc(&d, bytes));
    return d;
}

static void *cb_dev_upload(const void *h, size_t bytes)
{
    void *d = cb_dev_alloc(bytes);
    if (bytes)
        CHECK(kvt__cu_memcpy(d, h, bytes));
    return d;
}

/* ---- JSON output ------------------------------------------------------------------ */

static void j_begin(const char *cmd, const char *kase)
{
    printf("{\"bench\":\"cuda\",\"cmd\":\"%s\"", cmd);
    if (kase)
        printf(",\"case\":\"%s\"", kase);
}

static void j_num(const char *key, double v, int prec)
{
    if (isfinite(v))
        printf(",\"%s\":%.*f", key, prec, v);
    else
        printf(",\"%s\":null", key);
}

static void j_u64(const char *key, uint64_t v)
{
    printf(",\"%s\":%llu", key, (unsigned long long)v);
}

static void j_int(const char *key, long long v)
{
    printf(",\"%s\":%lld", key, v);
}

static void j_bool(const char *key, int v) /* v < 0: null */
{
    printf(",\"%s\":%s", key, v < 0 ? "null" : v ? "true" : "false");
}

/* met: 1, 0, or -1 (null) when the figure is unknown. */
static int cb_met_ge(double v, double target)
{
    return isfinite(v) ? v >= target : -1;
}

static void j_str(const char *key, const char *s)
{
    printf(",\"%s\":\"", key);
    for (; s && *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            printf("\\%c", ch);
        else if (ch < 0x20)
            printf("\\u%04x", ch);
        else
            putchar(ch);
    }
    putchar('"');
}

static void j_end(void)
{
    printf("}\n");
    fflush(stdout);
}

/* ---- the device ---------------------------------------------------------------- */

typedef struct cb_dev {
    char name[256];
    bool emulated;
    int sms, l2_bytes, mem_clock_khz, bus_bits, cc_major, cc_minor;
    int prio_low, prio_high, prio_normal;
    double peak_gbps; /* from the memory clock and bus width; NaN unknown */
} cb_dev;

/* Free and total device memory (the emulated build: half the host's memory,
 * which is what the emulator allocates from). */
static void cb_mem_info(size_t *free_b, size_t *total_b)
{
#ifdef KVT_BENCH_EMU
    double phys = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    *total_b = phys > 0 ? (size_t)(phys / 2) : (size_t)1 << 30;
    *free_b = *total_b;
#else
    CU(cudaMemGetInfo(free_b, total_b));
#endif
}

static int cb_attr(enum cudaDeviceAttr a)
{
    int v = 0;
    if (cudaDeviceGetAttribute(&v, a, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return v;
}

static void cb_dev_probe(cb_dev *d)
{
    memset(d, 0, sizeof *d);
#ifdef KVT_BENCH_EMU
    d->emulated = true;
    snprintf(d->name, sizeof d->name, "emulated (cuda/emu on the CPU)");
#else
    struct cudaDeviceProp p;
    CU(cudaGetDeviceProperties(&p, 0));
    snprintf(d->name, sizeof d->name, "%s", p.name);
#endif
    d->sms = cb_attr(cudaDevAttrMultiProcessorCount);
    d->l2_bytes = cb_attr(cudaDevAttrL2CacheSize);
    d->mem_clock_khz = cb_attr(cudaDevAttrMemoryClockRate);
    d->bus_bits = cb_attr(cudaDevAttrGlobalMemoryBusWidth);
    d->cc_major = cb_attr(cudaDevAttrComputeCapabilityMajor);
    d->cc_minor = cb_attr(cudaDevAttrComputeCapabilityMinor);
    /* Double data rate: two transfers per memory clock. */
    d->peak_gbps = d->mem_clock_khz > 0 && d->bus_bits > 0
                       ? 2.0 * d->mem_clock_khz * 1e3 * (d->bus_bits / 8.0) / 1e9
                       : NAN;
    int lo = 0, hi = 0;
    if (cudaDeviceGetStreamPriorityRange(&lo, &hi) != cudaSuccess) {
        (void)cudaGetLastError();
        lo = hi = 0;
    }
    d->prio_low = lo;
    d->prio_high = hi;
    /* 0 is the default priority of a stream (what an engine's decode
     * stream has unless it asks otherwise); clamp into the range. */
    d->prio_normal = hi <= 0 && 0 <= lo ? 0 : lo;
}

static void cb_dev_emit(const cb_dev *d)
{
    size_t free_b, total_b;
    cb_mem_info(&free_b, &total_b);
    j_begin("device", NULL);
    j_str("name", d->name);
    j_bool("emulated", d->emulated);
    printf(",\"cc\":\"%d.%d\"", d->cc_major, d->cc_minor);
    j_int("sms", d->sms);
    j_int("l2_bytes", d->l2_bytes);
    j_int("mem_clock_khz", d->mem_clock_khz);
    j_int("bus_width_bits", d->bus_bits);
    j_num("peak_gbps", d->peak_gbps, 1);
    j_u64("free_bytes", free_b);
    j_u64("total_bytes", total_b);
    j_int("stream_priority_low", d->prio_low);
    j_int("stream_priority_high", d->prio_high);
#ifndef KVT_BENCH_EMU
    int rt = 0, drv = 0;
    if (cudaRuntimeGetVersion(&rt) != cudaSuccess || cudaDriverGetVersion(&drv) != cudaSuccess)
        (void)cudaGetLastError();
    j_int("runtime_version", rt);
    j_int("driver_version", drv);
#endif
    j_end();
}

/* ---- the bench context: streams, events, the L2 flush ------------------------- */

typedef struct cb_flush {
    bool on;
    uint64_t bytes;
    uint8_t *d_arena;
    uint32_t *d_blocks, *d_ntok;
    kvt__cu_attn_item *d_items;
    float *d_q, *d_out;
    void *d_work;
    kvt__cu_attn_args args;
} cb_flush;

typedef struct cb {
    cb_opts o;
    cb_dev dev;
    void *s_normal;          /* decode: the default priority */
    void *s_high;            /* decode: the greatest priority (kvt__cu_stream_create(.., 0)) */
    void *s_low;             /* copies: the least priority (kvt__cu_stream_create(.., 1)) */
    cudaEvent_t *ev_a, *ev_b; /* reps + 1 each */
    cudaEvent_t ev_x, ev_y;
    double *ms;              /* reps */
    cb_flush fl;
    int failures;            /* --smoke checks that failed */
} cb;

static cudaEvent_t cb_event(void)
{
    cudaEvent_t e;
    CU(cudaEventCreateWithFlags(&e, cudaEventDefault));
    return e;
}

static double cb_elapsed(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0;
    CU(cudaEventSynchronize(b));
    CU(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

static void *cb_stream_normal(const cb_dev *d)
{
    cudaStream_t s;
    CU(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, d->prio_normal));
    return s;
}

/* A read-only pass over an arena of >= 4x the L2 (>= 256 MiB): a dense
 * attention over it, so the L2 is left holding clean lines of the flush
 * arena and none of the KV the next launch reads (a memset would leave
 * dirty lines whose write-back the timed kernel would pay for). */
static void cb_flush_init(cb *c)
{
    cb_flush *f = &c->fl;
    uint64_t want = (uint64_t)c->dev.l2_bytes * 4;
    if (want < (256ull << 20))
        want = 256ull << 20;
    if (c->o.smoke)
        want = 16 * CB_BLOCK_BYTES;
    uint32_t per_head = (uint32_t)(want / CB_BLOCK_BYTES / CB_H);
    uint32_t n = per_head * CB_H;
    f->bytes = (uint64_t)n * CB_BLOCK_BYTES;
    f->d_arena = cb_dev_alloc((size_t)(n + 1ull) * CB_BLOCK_BYTES);
    /* f16 0x3c3c = 1.06: finite keys and values. */
    CHECK(kvt__cu_memset(f->d_arena, 0x3c, (size_t)(n + 1ull) * CB_BLOCK_BYTES));
    uint32_t *blocks = bench_xmalloc((size_t)n * sizeof *blocks);
    uint32_t *ntok = bench_xmalloc((size_t)n * sizeof *ntok);
    for (uint32_t i = 0; i < n; i++) {
        blocks[i] = i + 1;
        ntok[i] = CB_P;
    }
    kvt__cu_attn_item items[CB_H];
    for (uint32_t h = 0; h < CB_H; h++)
        items[h] = (kvt__cu_attn_item){.q_off = (uint64_t)h * CB_G * CB_D,
                                       .out_off = (uint64_t)h * CB_G * CB_D,
                                       .pages_off = (uint64_t)h * per_head,
                                       .n_pages = per_head};
    float q[CB_H * CB_G * CB_D];
    uint64_t s = 0xf1u;
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++)
        q[i] = cb_unit(&s);
    f->d_blocks = cb_dev_upload(blocks, (size_t)n * sizeof *blocks);
    f->d_ntok = cb_dev_upload(ntok, (size_t)n * sizeof *ntok);
    f->d_items = cb_dev_upload(items, sizeof items);
    f->d_q = cb_dev_upload(q, sizeof q);
    f->d_out = cb_dev_alloc(sizeof q);
    free(blocks);
    free(ntok);
    f->args = (kvt__cu_attn_args){
        .d_items = f->d_items, .n_items = CB_H, .G = CB_G, .D = CB_D, .P = CB_P,
        .dtype = KVT_DTYPE_F16, .scale = 1.0f / sqrtf((float)CB_D), .max_pages = per_head,
        .d_q = f->d_q, .d_out = f->d_out, .d_blocks = f->d_blocks, .d_ntok = f->d_ntok,
        .d_dev_base = f->d_arena, .block_bytes = CB_BLOCK_BYTES};
    f->d_work = cb_dev_alloc(kvt__cu_attn_workspace_bytes(&f->args));
    f->args.d_work = f->d_work;
    f->on = true;
    cb_settle();
    /* One trial launch: without a working flush the figures are still
     * taken, but say so (an L2-resident case then reads from the cache). */
    int rc = kvt__cu_attn(&f->args, c->s_normal);
    if (rc == 0)
        rc = kvt__cu_stream_sync(c->s_normal);
    if (rc) {
        fprintf(stderr, PROG ": warning: the L2 flush launch failed (%s: %s); timing "
                        "without it\n", kvt_err_name(rc), kvt_last_error());
        f->on = false;
    }
    fprintf(stderr, "L2 flush: %.2f MiB read before every timed launch%s\n",
            (double)f->bytes / 1048576.0, f->on ? "" : " (disabled)");
}

static void cb_flush_free(cb_flush *f)
{
    kvt__cu_free(f->d_arena);
    kvt__cu_free(f->d_blocks);
    kvt__cu_free(f->d_ntok);
    kvt__cu_free(f->d_items);
    kvt__cu_free(f->d_q);
    kvt__cu_free(f->d_out);
    kvt__cu_free(f->d_work);
    memset(f, 0, sizeof *f);
}

static void cb_flush_enqueue(cb *c, void *stream)
{
    if (c->fl.on)
        CHECK(kvt__cu_attn(&c->fl.args, stream));
}

/* What a timed launch runs: returns 0 or a KVT_E* code. */
typedef int (*cb_launch_fn)(void *arg, void *stream);

/* Enqueues, on one stream, reps x (flush, event a[r], fn, event b[r]);
 * returns the first launcher error (nothing more is enqueued then). */
static int cb_enqueue_timed(cb *c, cb_launch_fn fn, void *arg, void *stream, uint32_t reps,
                            cudaEvent_t *a, cudaEvent_t *b)
{
    for (uint32_t r = 0; r < reps; r++) {
        cb_flush_enqueue(c, stream);
        CU(cudaEventRecord(a[r], (cudaStream_t)stream));
        int rc = fn(arg, stream);
        if (rc)
            return rc;
        CU(cudaEventRecord(b[r], (cudaStream_t)stream));
    }
    return 0;
}

static double cb_collect(cb *c, uint32_t reps)
{
    for (uint32_t r = 0; r < reps; r++)
        c->ms[r] = cb_elapsed(c->ev_a[r], c->ev_b[r]);
    return cb_median(c->ms, reps);
}

/* Median ms of reps timed launches after one warm-up; NaN and *err set
 * (the library's message) when the launcher refuses. */
static double cb_time(cb *c, cb_launch_fn fn, void *arg, void *stream, char *err, size_t errn)
{
    int rc = cb_enqueue_timed(c, fn, arg, stream, 1, c->ev_a, c->ev_b);
    if (rc == 0) {
        CHECK(kvt__cu_stream_sync(stream));
        rc = cb_enqueue_timed(c, fn, arg, stream, c->o.reps, c->ev_a, c->ev_b);
    }
    if (rc) {
        snprintf(err, errn, "%s: %s", kvt_err_name(rc), kvt_last_error());
        CHECK(kvt__cu_stream_sync(stream));
        return NAN;
    }
    CHECK(kvt__cu_stream_sync(stream));
    return cb_collect(c, c->o.reps);
}

/* ---- attention cases ------------------------------------------------------------- */

typedef struct cb_attn {
    uint32_t B, ctx, np, n_items, sp, k; /* sp: sparse pages per item */
    uint64_t n_blocks;                    /* B * H * np (block 0 is the null block) */
    uint8_t *d_arena, *d_meta;
    uint32_t *d_blocks, *d_ntok, *d_meta_table, *d_sp_blocks, *d_sp_ntok;
    kvt__cu_attn_item *d_dense_items, *d_sp_items;
    kvt__cu_score_item *d_score_items;
    kvt__cu_topk_item *d_topk_items;
    float *d_q, *d_out, *d_lse, *d_vote;
    uint32_t *d_sel, *d_n_sel;
    void *d_work;
    kvt__cu_attn_args dense, sparse;
    kvt__cu_score_args score;
    kvt__cu_topk_args topk;
    /* host copies kept for the --smoke checks */
    uint32_t *h_blocks, *h_ntok, *h_meta_table, *h_sp_blocks, *h_sp_ntok;
    float *h_q;
} cb_attn;

static uint64_t cb_attn_bytes(uint32_t B, uint32_t ctx, uint32_t k, uint64_t *arena)
{
    uint64_t np = (ctx + CB_P - 1) / CB_P, items = (uint64_t)B * CB_H, n = items * np;
    uint64_t sp = np - 1 <= k ? np : k + 1;
    *arena = (n + 1) * CB_BLOCK_BYTES;
    return *arena + (n + 1) * CB_META_BYTES + n * 4 * 4 /* tables, votes */ +
           items * sp * 8 + items * (k + 2) * 4 + items * CB_G * (CB_D * 8 + 4) +
           (64ull << 20) /* items, workspace, slack */;
}

/* Random f16 contents, a pattern of up to 48 MiB uploaded once and tiled
 * over the arena by device-to-device copies. meta: the pattern is made of
 * valid (min, max) row pairs of the store's first plane (min <= max per
 * dimension: the MINMAX score max(q*kmin, q*kmax) = qa.kmax + qb.kmin needs
 * it); else
 * values uniform in [-1, 1). */
static void cb_fill_random(uint8_t *d, uint64_t bytes, uint64_t seed, bool meta)
{
    /* (metadata: the store's first plane is (min, max) row pairs; the
     * pattern repeats pairs over both planes, and MINMAX reads the first) */
    uint64_t unit = meta ? CB_MM_BYTES : 2, cap = 65536 * CB_META_BYTES; /* 48 MiB */
    uint64_t pat = (bytes < cap ? bytes : cap) / unit * unit;
    if (pat == 0)
        return;
    uint16_t *h = bench_xmalloc((size_t)pat);
    uint64_t s = seed;
    if (meta) {
        for (uint64_t slot = 0; slot < pat / CB_MM_BYTES; slot++) {
            uint16_t *r = h + slot * 2 * CB_D;
            for (uint32_t dd = 0; dd < CB_D; dd++) {
                float a = cb_unit(&s), b = cb_unit(&s);
                r[dd] = cb_f32_to_f16(a < b ? a : b);
                r[CB_D + dd] = cb_f32_to_f16(a < b ? b : a);
            }
        }
    } else {
        for (uint64_t i = 0; i < pat / 2; i++)
            h[i] = cb_f32_to_f16(cb_unit(&s));
    }
    CHECK(kvt__cu_memcpy(d, h, (size_t)pat));
    free(h);
    for (uint64_t off = pat; off < bytes; off += pat) {
        uint64_t n = bytes - off < pat ? bytes - off : pat;
        CU(cudaMemcpy(d + off, d, (size_t)n, cudaMemcpyDeviceToDevice));
    }
}

/* n distinct values 1..n in random order. */
static uint32_t *cb_perm1(uint64_t n, uint64_t seed)
{
    uint32_t *p = bench_xmalloc((size_t)n * sizeof *p);
    uint64_t s = seed;
    for (uint64_t i = 0; i < n; i++)
        p[i] = (uint32_t)(i + 1);
    for (uint64_t i = n; i > 1; i--) {
        uint64_t j = cb_below(&s, i);
        uint32_t t = p[i - 1];
        p[i - 1] = p[j];
        p[j] = t;
    }
    return p;
}

static void cb_attn_free(cb_attn *a)
{
    void *d[] = {a->d_arena, a->d_meta, a->d_blocks, a->d_ntok, a->d_meta_table,
                 a->d_sp_blocks, a->d_sp_ntok, a->d_dense_items, a->d_sp_items,
                 a->d_score_items, a->d_topk_items, a->d_q, a->d_out, a->d_lse, a->d_vote,
                 a->d_sel, a->d_n_sel, a->d_work};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        kvt__cu_free(d[i]);
    free(a->h_blocks);
    free(a->h_ntok);
    free(a->h_meta_table);
    free(a->h_sp_blocks);
    free(a->h_sp_ntok);
    free(a->h_q);
    memset(a, 0, sizeof *a);
}

/* Builds one case: B sequences of ctx tokens, every (sequence, KV head)'s
 * pages in blocks at random places of the arena, metadata slots likewise;
 * the sparse set of each is k random pages and the last one. */
static void cb_attn_setup(cb_attn *a, uint32_t B, uint32_t ctx, uint32_t k, uint64_t seed)
{
    memset(a, 0, sizeof *a);
    a->B = B;
    a->ctx = ctx;
    a->k = k;
    a->np = (ctx + CB_P - 1) / CB_P;
    a->n_items = B * CB_H;
    a->n_blocks = (uint64_t)a->n_items * a->np;
    a->sp = a->np - 1 <= k ? a->np : k + 1;
    uint32_t np = a->np, ni = a->n_items, sp = a->sp;
    uint64_t n = a->n_blocks;
    uint32_t last_tok = ctx - (np - 1) * CB_P;

    a->d_arena = cb_dev_alloc((size_t)((n + 1) * CB_BLOCK_BYTES));
    a->d_meta = cb_dev_alloc((size_t)((n + 1) * CB_META_BYTES));
    cb_fill_random(a->d_arena, (n + 1) * CB_BLOCK_BYTES, seed ^ 0xa11aull, false);
    cb_fill_random(a->d_meta, (n + 1) * CB_META_BYTES, seed ^ 0x3e7aull, true);

    a->h_blocks = cb_perm1(n, seed ^ 0xb10cull);
    a->h_meta_table = cb_perm1(n, seed ^ 0x3e7bull);
    a->h_ntok = bench_xmalloc((size_t)n * sizeof *a->h_ntok);
    for (uint64_t i = 0; i < n; i++)
        a->h_ntok[i] = i % np == np - 1 ? last_tok : CB_P;

    /* Sparse: k distinct random pages of [0, np - 1), sorted, + the last. */
    a->h_sp_blocks = bench_xmalloc((size_t)ni * sp * sizeof *a->h_sp_blocks);
    a->h_sp_ntok = bench_xmalloc((size_t)ni * sp * sizeof *a->h_sp_ntok);
    uint32_t *pool = bench_xmalloc((size_t)np * sizeof *pool), *pick = bench_xmalloc(
                                                                     (size_t)sp * sizeof *pick);
    for (uint32_t i = 0; i + 1 < np; i++)
        pool[i] = i;
    uint64_t s = seed ^ 0x5a45ull;
    for (uint32_t it = 0; it < ni; it++) {
        if (sp == np) {
            for (uint32_t j = 0; j < np; j++)
                pick[j] = j;
        } else {
            for (uint32_t j = 0; j < k; j++) { /* partial Fisher-Yates */
                uint32_t r = j + (uint32_t)cb_below(&s, np - 1 - j);
                uint32_t t = pool[j];
                pool[j] = pool[r];
                pool[r] = t;
                pick[j] = pool[j];
            }
            qsort(pick, k, sizeof *pick, cb_cmp_u32);
            pick[k] = np - 1;
        }
        for (uint32_t j = 0; j < sp; j++) {
            a->h_sp_blocks[(uint64_t)it * sp + j] = a->h_blocks[(uint64_t)it * np + pick[j]];
            a->h_sp_ntok[(uint64_t)it * sp + j] = a->h_ntok[(uint64_t)it * np + pick[j]];
        }
    }
    free(pool);
    free(pick);

    size_t qn = (size_t)ni * CB_G * CB_D;
    a->h_q = bench_xmalloc(qn * sizeof *a->h_q);
    s = seed ^ 0x9u;
    for (size_t i = 0; i < qn; i++)
        a->h_q[i] = cb_unit(&s);

    kvt__cu_attn_item *di = bench_xmalloc((size_t)ni * sizeof *di);
    kvt__cu_attn_item *si = bench_xmalloc((size_t)ni * sizeof *si);
    kvt__cu_score_item *sc = bench_xmalloc((size_t)ni * sizeof *sc);
    kvt__cu_topk_item *tk = bench_xmalloc((size_t)ni * sizeof *tk);
    for (uint32_t it = 0; it < ni; it++) {
        uint64_t qo = (uint64_t)it * CB_G * CB_D;
        di[it] = (kvt__cu_attn_item){.q_off = qo, .out_off = qo, .lse_off = (uint64_t)it * CB_G,
                                     .pages_off = (uint64_t)it * np, .n_pages = np};
        si[it] = di[it];
        si[it].pages_off = (uint64_t)it * sp;
        si[it].n_pages = sp;
        sc[it] = (kvt__cu_score_item){.q_off = qo, .table_off = (uint64_t)it * np,
                                      .vote_off = (uint64_t)it * np, .n_pages = np};
        tk[it] = (kvt__cu_topk_item){.vote_off = (uint64_t)it * np,
                                     .sel_off = (uint64_t)it * (k + 2), .n_pages = np,
                                     /* one forced page, the last: a partial
                                        one is forced on its own, a full one
                                        as the local page */
                                     .tokens = ctx, .k = k, .sink = 0,
                                     .local = ctx % CB_P ? 0u : 1u};
    }
    a->d_blocks = cb_dev_upload(a->h_blocks, (size_t)n * 4);
    a->d_ntok = cb_dev_upload(a->h_ntok, (size_t)n * 4);
    a->d_meta_table = cb_dev_upload(a->h_meta_table, (size_t)n * 4);
    a->d_sp_blocks = cb_dev_upload(a->h_sp_blocks, (size_t)ni * sp * 4);
    a->d_sp_ntok = cb_dev_upload(a->h_sp_ntok, (size_t)ni * sp * 4);
    a->d_dense_items = cb_dev_upload(di, (size_t)ni * sizeof *di);
    a->d_sp_items = cb_dev_upload(si, (size_t)ni * sizeof *si);
    a->d_score_items = cb_dev_upload(sc, (size_t)ni * sizeof *sc);
    a->d_topk_items = cb_dev_upload(tk, (size_t)ni * sizeof *tk);
    a->d_q = cb_dev_upload(a->h_q, qn * sizeof *a->h_q);
    a->d_out = cb_dev_alloc(qn * sizeof(float));
    a->d_lse = cb_dev_alloc((size_t)ni * CB_G * sizeof(float));
    a->d_vote = cb_dev_alloc((size_t)n * sizeof(float));
    a->d_sel = cb_dev_alloc((size_t)ni * (k + 2) * sizeof(uint32_t));
    a->d_n_sel = cb_dev_alloc((size_t)ni * sizeof(uint32_t));
    free(di);
    free(si);
    free(sc);
    free(tk);

    a->dense = (kvt__cu_attn_args){
        .d_items = a->d_dense_items, .n_items = ni, .G = CB_G, .D = CB_D, .P = CB_P,
        .dtype = KVT_DTYPE_F16, .scale = 1.0f / sqrtf((float)CB_D), .max_pages = np,
        .d_q = a->d_q, .d_out = a->d_out, .d_lse = a->d_lse, .d_blocks = a->d_blocks,
        .d_ntok = a->d_ntok, .d_dev_base = a->d_arena, .block_bytes = CB_BLOCK_BYTES};
    a->sparse = a->dense;
    a->sparse.d_items = a->d_sp_items;
    a->sparse.max_pages = sp;
    a->sparse.d_blocks = a->d_sp_blocks;
    a->sparse.d_ntok = a->d_sp_ntok;
    size_t w1 = kvt__cu_attn_workspace_bytes(&a->dense),
           w2 = kvt__cu_attn_workspace_bytes(&a->sparse);
    a->d_work = cb_dev_alloc(w1 > w2 ? w1 : w2);
    a->dense.d_work = a->sparse.d_work = a->d_work;

    a->score = (kvt__cu_score_args){
        .d_items = a->d_score_items, .n_items = ni, .G = CB_G, .D = CB_D,
        .dtype = KVT_DTYPE_F16, .method = KVT_SCORE_MINMAX, .vote = KVT_VOTE_SUM,
        .vote_scale = 1.0f, .max_pages = np, .d_q = a->d_q, .d_meta_table = a->d_meta_table,
        .d_meta_base = a->d_meta, .meta_bytes = CB_META_BYTES, .meta_slots = (uint32_t)(n + 1),
        .d_vote = a->d_vote};
    a->topk = (kvt__cu_topk_args){
        .d_items = a->d_topk_items, .n_items = ni, .P = CB_P, .max_pages = np,
        .d_vote = a->d_vote, .d_sel = a->d_sel, .d_n_sel = a->d_n_sel};
    cb_settle();
}

static int cb_launch_dense(void *arg, void *stream)
{
    return kvt__cu_attn(&((cb_attn *)arg)->dense, stream);
}

static int cb_launch_sparse(void *arg, void *stream)
{
    return kvt__cu_attn(&((cb_attn *)arg)->sparse, stream);
}

static int cb_launch_select(void *arg, void *stream)
{
    cb_attn *a = arg;
    int rc = kvt__cu_score(&a->score, stream);
    return rc ? rc : kvt__cu_topk(&a->topk, stream);
}

/* ---- --smoke checks against independent references ------------------------------- */

/* softmax(scale q.k) v over n pages, in double, for query row q. */
static void cb_ref_row(const uint8_t *arena, const uint32_t *blocks, const uint32_t *ntok,
                       uint32_t n, const float *q, double scale, double *out, double *lse)
{
    double m = -INFINITY, sum = 0;
    for (uint32_t d = 0; d < CB_D; d++)
        out[d] = 0;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t p = 0; p < n; p++) {
            const uint8_t *blk = arena + (uint64_t)blocks[p] * CB_BLOCK_BYTES;
            for (uint32_t t = 0; t < ntok[p]; t++) {
                const uint16_t *kr = (const uint16_t *)(const void *)(blk + (uint64_t)t * CB_D * 2);
                const uint16_t *vr =
                    (const uint16_t *)(const void *)(blk + (uint64_t)(CB_P + t) * CB_D * 2);
                double dot = 0;
                for (uint32_t d = 0; d < CB_D; d++)
                    dot += (double)q[d] * cb_f16_to_f64(kr[d]);
                dot *= scale;
                if (pass == 0) {
                    m = dot > m ? dot : m;
                } else {
                    double w = exp(dot - m);
                    sum += w;
                    for (uint32_t d = 0; d < CB_D; d++)
                        out[d] += w * cb_f16_to_f64(vr[d]);
                }
            }
        }
    for (uint32_t d = 0; d < CB_D; d++)
        out[d] /= sum;
    *lse = m + log(sum);
}

static void cb_fail(cb *c, const char *what)
{
    fprintf(stderr, PROG ": smoke check FAILED: %s\n", what);
    c->failures++;
}

/* Output rows of a few (item, g) against the double reference. Tolerance:
 * f32 accumulation of f16-exact inputs over a few hundred tokens errs by
 * ~1e-6; 2e-4 absolute on outputs of magnitude <= 1 (values in [-1, 1))
 * still catches any wrong row, page or token (those move outputs by 1e-2). */
static void cb_check_attn(cb *c, const cb_attn *a, bool sparse, const uint8_t *arena)
{
    size_t qn = (size_t)a->n_items * CB_G * CB_D;
    float *out = bench_xmalloc(qn * sizeof *out), *lse = bench_xmalloc(a->n_items * CB_G * 4);
    CHECK(kvt__cu_memcpy(out, a->d_out, qn * sizeof *out));
    CHECK(kvt__cu_memcpy(lse, a->d_lse, (size_t)a->n_items * CB_G * 4));
    uint32_t rows[][2] = {{0, 0}, {1, 3}, {a->n_items / 2, 1}, {a->n_items - 1, CB_G - 1}};
    double worst = 0, worst_lse = 0;
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        uint32_t it = rows[r][0] < a->n_items ? rows[r][0] : 0, g = rows[r][1];
        uint32_t n = sparse ? a->sp : a->np;
        const uint32_t *bl = sparse ? a->h_sp_blocks + (uint64_t)it * a->sp
                                    : a->h_blocks + (uint64_t)it * a->np;
        const uint32_t *nt = sparse ? a->h_sp_ntok + (uint64_t)it * a->sp
                                    : a->h_ntok + (uint64_t)it * a->np;
        double ref[CB_D], rl;
        const float *q = a->h_q + ((uint64_t)it * CB_G + g) * CB_D;
        cb_ref_row(arena, bl, nt, n, q, 1.0 / sqrt((double)CB_D), ref, &rl);
        const float *o = out + ((uint64_t)it * CB_G + g) * CB_D;
        for (uint32_t d = 0; d < CB_D; d++) {
            double e = fabs((double)o[d] - ref[d]);
            if (!(e <= worst))
                worst = isnan(e) ? INFINITY : e;
        }
        double el = fabs((double)lse[it * CB_G + g] - rl) / (1.0 + fabs(rl));
        if (!(el <= worst_lse))
            worst_lse = isnan(el) ? INFINITY : el;
    }
    bool ok = worst <= 2e-4 && worst_lse <= 1e-4;
    fprintf(stderr, "  check %s attention: 4 rows, max |out - ref| %.2e, max lse rel err "
                    "%.2e: %s\n", sparse ? "sparse" : "dense", worst, worst_lse,
            ok ? "ok" : "MISMATCH");
    if (!ok)
        cb_fail(c, sparse ? "sparse attention output" : "dense attention output");
    free(out);
    free(lse);
}

/* Votes (MINMAX, SUM) of every page against a double reference, and the
 * top-K rule against the kernel's own votes. */
static void cb_check_select(cb *c, const cb_attn *a)
{
    uint64_t n = a->n_blocks;
    float *vote = bench_xmalloc((size_t)n * sizeof *vote);
    uint32_t *sel = bench_xmalloc((size_t)a->n_items * (a->k + 2) * 4),
             *nsel = bench_xmalloc((size_t)a->n_items * 4);
    uint8_t *meta = bench_xmalloc((size_t)((n + 1) * CB_META_BYTES));
    CHECK(kvt__cu_memcpy(vote, a->d_vote, (size_t)n * sizeof *vote));
    CHECK(kvt__cu_memcpy(sel, a->d_sel, (size_t)a->n_items * (a->k + 2) * 4));
    CHECK(kvt__cu_memcpy(nsel, a->d_n_sel, (size_t)a->n_items * 4));
    CHECK(kvt__cu_memcpy(meta, a->d_meta, (size_t)((n + 1) * CB_META_BYTES)));
    double worst = 0;
    bool ok_topk = true;
    for (uint32_t it = 0; it < a->n_items; it++) {
        const float *q = a->h_q + (uint64_t)it * CB_G * CB_D;
        for (uint32_t p = 0; p < a->np; p++) {
            const uint16_t *slot = (const uint16_t *)(const void *)(
                meta + (uint64_t)a->h_meta_table[(uint64_t)it * a->np + p] * CB_MM_BYTES);
            double v = 0, mag = 0;
            for (uint32_t g = 0; g < CB_G; g++)
                for (uint32_t d = 0; d < CB_D; d++) {
                    double x = q[g * CB_D + d], lo = x * cb_f16_to_f64(slot[d]),
                           hi = x * cb_f16_to_f64(slot[CB_D + d]);
                    v += lo > hi ? lo : hi;
                    mag += fabs(lo) + fabs(hi);
                }
            double e = fabs((double)vote[(uint64_t)it * a->np + p] - v) / (mag + 1e-30);
            if (!(e <= worst))
                worst = isnan(e) ? INFINITY : e;
        }
        /* The selection: increasing, the last page in it, and the k best
         * of the others (vote desc, index asc) by the kernel's votes. */
        uint32_t want = a->np <= a->k + 1 ? a->np : a->k + 1, ns = nsel[it];
        const uint32_t *s = sel + (uint64_t)it * (a->k + 2);
        const float *vt = vote + (uint64_t)it * a->np;
        bool ok = ns == want && ns > 0 && s[ns - 1] == a->np - 1;
        for (uint32_t j = 1; ok && j < ns; j++)
            ok = s[j - 1] < s[j];
        for (uint32_t p = 0; ok && p + 1 < a->np; p++) {
            bool in = false;
            for (uint32_t j = 0; j < ns; j++)
                in = in || s[j] == p;
            if (in)
                continue;
            for (uint32_t j = 0; ok && j + 1 < ns; j++) /* every chosen non-last page */
                ok = vt[s[j]] > vt[p] || (vt[s[j]] == vt[p] && s[j] < p);
        }
        if (!ok && ok_topk)
            fprintf(stderr, "  top-K of item %u: %u pages selected (want %u)\n", it, ns, want);
        ok_topk = ok_topk && ok;
    }
    /* f32 sums of 2 * G * D products: relative to the sum of magnitudes,
     * ~1e-7 expected; 1e-5 leaves room for any summation order. */
    bool ok = worst <= 1e-5;
    fprintf(stderr, "  check scores: %llu pages, max rel err %.2e: %s; top-K rule: %s\n",
            (unsigned long long)n, worst, ok ? "ok" : "MISMATCH", ok_topk ? "ok" : "MISMATCH");
    if (!ok)
        cb_fail(c, "page scores");
    if (!ok_topk)
        cb_fail(c, "top-K selection");
    free(vote);
    free(sel);
    free(nsel);
    free(meta);
}

static void cb_smoke_attn(cb *c, cb_attn *a)
{
    uint64_t bytes = (a->n_blocks + 1) * CB_BLOCK_BYTES;
    uint8_t *arena = bench_xmalloc((size_t)bytes);
    CHECK(kvt__cu_memcpy(arena, a->d_arena, (size_t)bytes));
    CHECK(cb_launch_dense(a, c->s_normal));
    CHECK(kvt__cu_stream_sync(c->s_normal));
    cb_check_attn(c, a, false, arena);
    CHECK(cb_launch_sparse(a, c->s_normal));
    CHECK(kvt__cu_stream_sync(c->s_normal));
    cb_check_attn(c, a, true, arena);
    CHECK(cb_launch_select(a, c->s_normal));
    CHECK(kvt__cu_stream_sync(c->s_normal));
    cb_check_select(c, a);
    free(arena);
}

/* ---- attn ------------------------------------------------------------------------ */

typedef struct cb_attn_row {
    uint32_t B, ctx;
    bool skipped;
    double dense_ms, sparse_ms, select_ms, dense_gbps, hbm_fraction;
} cb_attn_row;

/* Device-to-device cudaMemcpyAsync of `bytes` (>= 2 GiB; less only where
 * the device lacks the memory): GB/s of read + write. */
static double cb_hbm_probe(cb *c, const char *when)
{
    uint64_t bytes = c->o.smoke ? (4ull << 20) : (2ull << 30);
    size_t free_b, total_b;
    cb_mem_info(&free_b, &total_b);
    while (bytes > (64ull << 20) && 2 * bytes + (1ull << 30) > free_b)
        bytes /= 2;
    uint8_t *a = cb_dev_alloc((size_t)bytes), *b = cb_dev_alloc((size_t)bytes);
    CHECK(kvt__cu_memset(a, 0x5a, (size_t)bytes));
    CHECK(kvt__cu_memset(b, 0, (size_t)bytes));
    cb_settle();
    cudaStream_t s = (cudaStream_t)c->s_normal;
    for (uint32_t r = 0; r <= c->o.reps; r++) { /* r == 0: warm-up */
        uint32_t i = r ? r - 1 : 0;
        CU(cudaEventRecord(c->ev_a[i], s));
        CU(cudaMemcpyAsync(b, a, (size_t)bytes, cudaMemcpyDeviceToDevice, s));
        CU(cudaEventRecord(c->ev_b[i], s));
        if (r == 0)
            CHECK(kvt__cu_stream_sync(s));
    }
    CHECK(kvt__cu_stream_sync(s));
    double ms = cb_collect(c, c->o.reps), gbps = cb_gbps(2.0 * (double)bytes, ms);
    kvt__cu_free(a);
    kvt__cu_free(b);
    j_begin("attn", "hbm_probe");
    j_str("when", when);
    j_str("what", "device-to-device cudaMemcpyAsync, read + write bytes");
    j_u64("bytes", bytes);
    j_u64("rw_bytes", 2 * bytes);
    j_int("reps", c->o.reps);
    j_num("ms", ms, 4);
    j_num("gbps", gbps, 1);
    j_num("peak_gbps", c->dev.peak_gbps, 1);
    j_num("peak_fraction", cb_div(gbps, c->dev.peak_gbps), 4);
    j_end();
    fprintf(stderr, "HBM probe (%s): %.2f GiB device-to-device, %.1f GB/s read + write\n", when,
            (double)bytes / GIB, isfinite(gbps) ? gbps : 0.0);
    return gbps;
}

static void cb_attn_case(cb *c, uint32_t B, uint32_t ctx, double hbm, cb_attn_row *row)
{
    uint32_t k = c->o.smoke ? CB_SMOKE_TOPK : CB_TOPK_PAGES;
    uint64_t arena, need = cb_attn_bytes(B, ctx, k, &arena);
    size_t free_b, total_b;
    cb_mem_info(&free_b, &total_b);
    *row = (cb_attn_row){.B = B, .ctx = ctx, .dense_ms = NAN, .sparse_ms = NAN,
                         .select_ms = NAN, .dense_gbps = NAN, .hbm_fraction = NAN};
    uint64_t np = (ctx + CB_P - 1) / CB_P, nblocks = (uint64_t)B * CB_H * np;
    if (nblocks + 1 >= UINT32_MAX || need + (512ull << 20) > free_b) {
        char why[160];
        snprintf(why, sizeof why, "needs %.2f GiB of device memory, %.2f GiB free",
                 (double)need / GIB, (double)free_b / GIB);
        j_begin("attn", "decode");
        j_int("batch", B);
        j_int("ctx", ctx);
        j_str("skipped", why);
        j_end();
        fprintf(stderr, "attn batch %u ctx %u: skipped (%s)\n", B, ctx, why);
        row->skipped = true;
        return;
    }
    fprintf(stderr, "attn batch %u ctx %u: %.2f GiB of KV in %llu scattered blocks\n", B, ctx,
            (double)arena / GIB, (unsigned long long)nblocks);
    cb_attn a;
    cb_attn_setup(&a, B, ctx, k, 0xc0ffeeull + B * 1000003ull + ctx);
    if (c->o.smoke)
        cb_smoke_attn(c, &a);

    char e_dense[256] = "", e_sparse[256] = "", e_select[256] = "";
    double dense = cb_time(c, cb_launch_dense, &a, c->s_normal, e_dense, sizeof e_dense);
    double sparse = cb_time(c, cb_launch_sparse, &a, c->s_normal, e_sparse, sizeof e_sparse);
    double select = cb_time(c, cb_launch_select, &a, c->s_normal, e_select, sizeof e_select);
    double dense_bytes = 2.0 * ctx * B * CB_H * CB_D * CB_ELEM;
    double sparse_bytes = (double)a.n_items * a.sp * (double)CB_BLOCK_BYTES;
    double meta_read = (double)nblocks * 2.0 * CB_D * CB_ELEM; /* min and max rows */
    double total = select + sparse;
    double dense_gbps = cb_gbps(dense_bytes, dense), frac = cb_div(dense_gbps, hbm);
    double sk = cb_div(dense, sparse), st = cb_div(dense, total);
    bool is_target = B == CB_TARGET_BATCH && ctx == CB_TARGET_CTX;

    j_begin("attn", "decode");
    j_int("batch", B);
    j_int("ctx", ctx);
    j_int("kv_heads", CB_H);
    j_int("q_heads", CB_H * CB_G);
    j_int("head_dim", CB_D);
    j_int("page_tokens", CB_P);
    j_str("dtype", "f16");
    j_int("topk_pages", k);
    j_int("budget_tokens", (long long)k * CB_P);
    j_int("pages_dense", (long long)nblocks);
    j_int("pages_sparse", (long long)a.n_items * a.sp);
    j_int("reps", c->o.reps);
    j_bool("l2_flush", c->fl.on);
    j_num("dense_ms", dense, 4);
    j_num("sparse_ms", sparse, 4);
    j_num("select_ms", select, 4);
    j_num("sparse_total_ms", total, 4);
    j_num("speedup_kernel", sk, 3);
    j_num("speedup_total", st, 3);
    j_num("dense_kv_bytes", dense_bytes, 0);
    j_num("dense_gbps", dense_gbps, 1);
    j_num("sparse_kv_bytes", sparse_bytes, 0);
    j_num("sparse_gbps", cb_gbps(sparse_bytes, sparse), 1);
    j_num("select_meta_bytes", meta_read, 0);
    j_num("select_gbps", cb_gbps(meta_read, select), 1);
    j_num("hbm_gbps", hbm, 1);
    j_num("hbm_fraction", frac, 4);
    j_num("hbm_fraction_target", CB_TARGET_HBM_FRAC, 4);
    j_bool("hbm_fraction_met", cb_met_ge(frac, CB_TARGET_HBM_FRAC));
    if (is_target) {
        j_num("speedup_target", CB_TARGET_SPEEDUP, 1);
        j_bool("speedup_kernel_met", cb_met_ge(sk, CB_TARGET_SPEEDUP));
        j_bool("speedup_total_met", cb_met_ge(st, CB_TARGET_SPEEDUP));
    }
    if (*e_dense)
        j_str("dense_error", e_dense);
    if (*e_sparse)
        j_str("sparse_error", e_sparse);
    if (*e_select)
        j_str("select_error", e_select);
    j_end();
    fprintf(stderr, "  dense %.4f ms, sparse %.4f ms, select %.4f ms\n", dense, sparse, select);
    if (*e_dense || *e_sparse || *e_select)
        fprintf(stderr, PROG ": launcher error(s): %s %s %s\n", e_dense, e_sparse, e_select);
    row->dense_ms = dense;
    row->sparse_ms = sparse;
    row->select_ms = select;
    row->dense_gbps = dense_gbps;
    row->hbm_fraction = frac;
    cb_attn_free(&a);
}

static void cb_print_num(double v, int w, int prec)
{
    if (isfinite(v))
        printf(" %*.*f", w, prec, v);
    else
        printf(" %*s", w, "-");
}

static void cb_cmd_attn(cb *c)
{
    double hbm = cb_hbm_probe(c, "start");
    cb_attn_row rows[CB_MAX_LIST * CB_MAX_LIST];
    uint32_t nr = 0;
    for (uint32_t ci = 0; ci < c->o.ctx.n; ci++)
        for (uint32_t bi = 0; bi < c->o.batch.n; bi++)
            cb_attn_case(c, c->o.batch.v[bi], c->o.ctx.v[ci], hbm, &rows[nr++]);
    double after = cb_hbm_probe(c, "end");
    if (isfinite(hbm) && isfinite(after) && (after > 1.1 * hbm || after < hbm / 1.1))
        fprintf(stderr, PROG ": warning: the HBM probe moved from %.1f to %.1f GB/s during "
                        "the cases; hbm_fraction values are unreliable\n", hbm, after);

    /* Summary: the two targets. */
    const cb_attn_row *t = NULL;
    uint32_t met = 0, known = 0;
    double fmin = INFINITY, fmax = -INFINITY;
    for (uint32_t i = 0; i < nr; i++) {
        if (rows[i].B == CB_TARGET_BATCH && rows[i].ctx == CB_TARGET_CTX && !rows[i].skipped)
            t = &rows[i];
        if (isfinite(rows[i].hbm_fraction)) {
            known++;
            met += rows[i].hbm_fraction >= CB_TARGET_HBM_FRAC;
            fmin = rows[i].hbm_fraction < fmin ? rows[i].hbm_fraction : fmin;
            fmax = rows[i].hbm_fraction > fmax ? rows[i].hbm_fraction : fmax;
        }
    }
    double sk = t ? cb_div(t->dense_ms, t->sparse_ms) : NAN;
    double st = t ? cb_div(t->dense_ms, t->select_ms + t->sparse_ms) : NAN;
    j_begin("attn", "summary");
    j_str("speedup_case", "batch 40 x ctx 10k (10240)");
    j_num("speedup_kernel_40x10k", sk, 3);
    j_num("speedup_total_40x10k", st, 3);
    j_num("speedup_target", CB_TARGET_SPEEDUP, 1);
    j_bool("speedup_kernel_met", cb_met_ge(sk, CB_TARGET_SPEEDUP));
    j_bool("speedup_total_met", cb_met_ge(st, CB_TARGET_SPEEDUP));
    j_num("hbm_fraction_40x10k", t ? t->hbm_fraction : NAN, 4);
    j_num("hbm_fraction_min", known ? fmin : NAN, 4);
    j_num("hbm_fraction_max", known ? fmax : NAN, 4);
    j_num("hbm_fraction_target", CB_TARGET_HBM_FRAC, 4);
    j_int("hbm_fraction_met_cases", met);
    j_int("hbm_fraction_known_cases", known);
    j_num("hbm_gbps_start", hbm, 1);
    j_num("hbm_gbps_end", after, 1);
    if (!t)
        j_str("missing", "the speedup target needs the case --batch 40 --ctx 10k");
    j_end();

    if (c->o.json_only)
        return;
    printf("# attn: %s; 8 KV heads, GQA 4, D 128, f16, 16-token pages; sparse = %u random "
           "pages + the last per KV head; HBM probe %.1f GB/s\n",
           c->dev.name, c->o.smoke ? CB_SMOKE_TOPK : CB_TOPK_PAGES, isfinite(hbm) ? hbm : 0.0);
    printf("# %5s %7s %9s %9s %9s %8s %8s %9s %8s\n", "batch", "ctx", "dense_ms", "sparse_ms",
           "select_ms", "x_kernel", "x_total", "dense_GBs", "hbm_frac");
    for (uint32_t i = 0; i < nr; i++) {
        const cb_attn_row *r = &rows[i];
        printf("# %5u %7u", r->B, r->ctx);
        if (r->skipped) {
            printf(" skipped (device memory)\n");
            continue;
        }
        cb_print_num(r->dense_ms, 9, 4);
        cb_print_num(r->sparse_ms, 9, 4);
        cb_print_num(r->select_ms, 9, 4);
        cb_print_num(cb_div(r->dense_ms, r->sparse_ms), 8, 2);
        cb_print_num(cb_div(r->dense_ms, r->select_ms + r->sparse_ms), 8, 2);
        cb_print_num(r->dense_gbps, 9, 1);
        cb_print_num(r->hbm_fraction, 8, 3);
        printf("\n");
    }
    printf("# targets: speedup at batch 40 x 10k >= %.0f (kernel %s, with selection %s); "
           "hbm_frac >= %.2f (%u of %u cases)\n", CB_TARGET_SPEEDUP,
           cb_met_ge(sk, CB_TARGET_SPEEDUP) < 0 ? "n/a" : cb_met_ge(sk, CB_TARGET_SPEEDUP) ? "met" : "not met",
           cb_met_ge(st, CB_TARGET_SPEEDUP) < 0 ? "n/a" : cb_met_ge(st, CB_TARGET_SPEEDUP) ? "met" : "not met",
           CB_TARGET_HBM_FRAC, met, known);
    fflush(stdout);
}

/* ---- copy ------------------------------------------------------------------------- */

typedef struct cb_copy_env {
    uint64_t host_bytes, pass_bytes;
    uint8_t *h_arena;  /* pinned, mapped */
    uint8_t *h_dev;    /* its device address (UVA: the same) */
    uint8_t *d_arena;  /* pass_bytes */
} cb_copy_env;

typedef struct cb_copy_list {
    uint32_t n;
    uint64_t size;
    kvt__cu_copy *h_list;
    kvt__cu_copy *d_list;
} cb_copy_list;

/* pass_bytes / size transfers from distinct random size-aligned slots of
 * the host arena to a random permutation of the device arena's slots. */
static void cb_copy_list_make(const cb_copy_env *e, uint64_t size, uint64_t seed,
                              cb_copy_list *l)
{
    uint64_t slots = e->host_bytes / size, n = e->pass_bytes / size;
    uint32_t *src = cb_perm1(slots, seed ^ 0x51cull), *dst = cb_perm1(n, seed ^ 0xd57ull);
    l->n = (uint32_t)n;
    l->size = size;
    l->h_list = bench_xmalloc((size_t)n * sizeof *l->h_list);
    for (uint64_t i = 0; i < n; i++)
        l->h_list[i] = (kvt__cu_copy){
            .src = (uint64_t)(uintptr_t)(e->h_dev + (uint64_t)(src[i] - 1) * size),
            .dst = (uint64_t)(uintptr_t)(e->d_arena + (uint64_t)(dst[i] - 1) * size),
            .bytes = size};
    l->d_list = cb_dev_upload(l->h_list, (size_t)n * sizeof *l->h_list);
    free(src);
    free(dst);
    cb_settle();
}

static void cb_copy_list_free(cb_copy_list *l)
{
    free(l->h_list);
    kvt__cu_free(l->d_list);
    memset(l, 0, sizeof *l);
}

static int cb_launch_copy_kernel(void *arg, void *stream)
{
    const cb_copy_list *l = arg;
    return kvt__cu_copy_kernel(l->d_list, l->n, 0, 0, stream);
}

static int cb_launch_copy_memcpy(void *arg, void *stream)
{
    const cb_copy_list *l = arg;
    return kvt__cu_copy_memcpy(l->h_list, l->n, stream);
}

/* Zeroes the device arena, runs one pass and compares every transfer's
 * bytes with its source. */
static void cb_check_copy(cb *c, const cb_copy_env *e, const cb_copy_list *l, bool kernel)
{
    CHECK(kvt__cu_memset(e->d_arena, 0, (size_t)e->pass_bytes));
    cb_settle();
    CHECK(kernel ? cb_launch_copy_kernel((void *)l, c->s_low) : cb_launch_copy_memcpy((void *)l, c->s_low));
    CHECK(kvt__cu_stream_sync(c->s_low));
    uint8_t *back = bench_xmalloc((size_t)e->pass_bytes);
    CHECK(kvt__cu_memcpy(back, e->d_arena, (size_t)e->pass_bytes));
    uint32_t bad = 0;
    for (uint32_t i = 0; i < l->n; i++) {
        const uint8_t *src = e->h_arena + ((uint8_t *)(uintptr_t)l->h_list[i].src - e->h_dev);
        const uint8_t *dst = back + ((uint8_t *)(uintptr_t)l->h_list[i].dst - e->d_arena);
        bad += memcmp(src, dst, (size_t)l->size) != 0;
    }
    fprintf(stderr, "  check %s copy of %u x %llu B: %s\n", kernel ? "kernel" : "memcpy", l->n,
            (unsigned long long)l->size, bad ? "MISMATCH" : "byte-exact");
    if (bad)
        cb_fail(c, kernel ? "kernel copy bytes" : "memcpy copy bytes");
    free(back);
}

/* One 1 GiB (pass_bytes) cudaMemcpyAsync pinned -> device: GB/s. */
static double cb_h2d_probe(cb *c, const cb_copy_env *e, const char *when)
{
    cudaStream_t s = (cudaStream_t)c->s_low;
    for (uint32_t r = 0; r <= c->o.reps; r++) {
        uint32_t i = r ? r - 1 : 0;
        CU(cudaEventRecord(c->ev_a[i], s));
        CU(cudaMemcpyAsync(e->d_arena, e->h_arena, (size_t)e->pass_bytes,
                           cudaMemcpyHostToDevice, s));
        CU(cudaEventRecord(c->ev_b[i], s));
        if (r == 0)
            CHECK(kvt__cu_stream_sync(s));
    }
    CHECK(kvt__cu_stream_sync(s));
    double ms = cb_collect(c, c->o.reps), gbps = cb_gbps((double)e->pass_bytes, ms);
    j_begin("copy", "h2d_probe");
    j_str("when", when);
    j_str("what", "one cudaMemcpyAsync pinned host -> device");
    j_u64("bytes", e->pass_bytes);
    j_int("reps", c->o.reps);
    j_num("ms", ms, 4);
    j_num("gbps", gbps, 2);
    j_end();
    fprintf(stderr, "H2D probe (%s): %.2f GiB, %.2f GB/s\n", when,
            (double)e->pass_bytes / GIB, isfinite(gbps) ? gbps : 0.0);
    return gbps;
}

typedef struct cb_copy_row {
    uint64_t size;
    double kernel_gbps, memcpy_gbps, enqueue_ms;
} cb_copy_row;

typedef struct cb_conc_row {
    const char *path, *stream;
    double alone_ms, conc_ms, slowdown, copy_gbps;
    int overlap;
} cb_conc_row;

/* The batch-8 x 32k sparse decode alone and while 64 KiB transfers stream
 * in on the low-priority stream (kernel path: launches of the copy kernel
 * enqueued before and after the decodes; memcpy path: a quarter of the
 * transfers, the decodes, the rest). overlap: the copy began before the
 * first timed decode and ended after the last. */
static void cb_concurrency(cb *c, const cb_copy_env *e, cb_conc_row *out, uint32_t *nout)
{
    uint32_t B = c->o.smoke ? c->o.batch.v[0] : 8, ctx = c->o.smoke ? c->o.ctx.v[0] : 32768;
    uint32_t k = c->o.smoke ? CB_SMOKE_TOPK : CB_TOPK_PAGES;
    uint64_t arena, need = cb_attn_bytes(B, ctx, k, &arena);
    size_t free_b, total_b;
    cb_mem_info(&free_b, &total_b);
    *nout = 0;
    if (need + (512ull << 20) > free_b) {
        j_begin("copy", "decode_under_copy");
        j_str("skipped", "not enough device memory for the decode case");
        j_end();
        return;
    }
    uint64_t size = 65536 <= e->pass_bytes ? 65536 : e->pass_bytes;
    fprintf(stderr, "decode under copy: batch %u ctx %u sparse decode, %llu B transfers\n", B,
            ctx, (unsigned long long)size);
    cb_attn a;
    cb_attn_setup(&a, B, ctx, k, 0xc0c0ull + ctx);
    cb_copy_list l;
    cb_copy_list_make(e, size, 0x64aull, &l);
    uint32_t reps = c->o.reps, quarter = l.n / 4 ? l.n / 4 : 1;
    char err[256] = "";

    const char *stream_name[2] = {"normal", "high"};
    void *streams[2] = {c->s_normal, c->s_high};
    for (int si = 0; si < 2; si++) {
        void *ds = streams[si];
        double alone = cb_time(c, cb_launch_sparse, &a, ds, err, sizeof err);
        if (!isfinite(alone) && *err)
            cb_die("sparse decode launch failed", err);
        for (int kernel = 1; kernel >= 0; kernel--) {
            cudaStream_t cs = (cudaStream_t)c->s_low;
            CU(cudaEventRecord(c->ev_x, cs));
            if (kernel) {
                CHECK(cb_launch_copy_kernel(&l, cs));
            } else {
                CHECK(kvt__cu_copy_memcpy(l.h_list, quarter, cs));
            }
            CHECK(cb_enqueue_timed(c, cb_launch_sparse, &a, ds, reps, c->ev_a, c->ev_b));
            if (kernel) {
                CHECK(cb_launch_copy_kernel(&l, cs));
            } else if (l.n > quarter) {
                CHECK(kvt__cu_copy_memcpy(l.h_list + quarter, l.n - quarter, cs));
            }
            CU(cudaEventRecord(c->ev_y, cs));
            CHECK(kvt__cu_stream_sync(ds));
            CHECK(kvt__cu_stream_sync(cs));
            double conc = cb_collect(c, reps);
            double lead = cb_elapsed(c->ev_x, c->ev_a[0]), tail = cb_elapsed(c->ev_b[reps - 1], c->ev_y);
            double copy_ms = cb_elapsed(c->ev_x, c->ev_y);
            double copied = (double)l.n * (double)size * (kernel ? 2.0 : 1.0);
            int overlap = c->dev.emulated ? -1 : lead > 0 && tail > 0;
            cb_conc_row r = {.path = kernel ? "kernel" : "memcpy", .stream = stream_name[si],
                             .alone_ms = alone, .conc_ms = conc,
                             .slowdown = cb_div(conc, alone) - 1.0,
                             .copy_gbps = cb_gbps(copied, copy_ms), .overlap = overlap};
            out[(*nout)++] = r;
            j_begin("copy", "decode_under_copy");
            j_int("batch", B);
            j_int("ctx", ctx);
            j_int("pages_sparse", (long long)a.n_items * a.sp);
            j_str("copy_path", r.path);
            j_int("transfer_bytes", (long long)size);
            j_str("decode_stream", r.stream);
            j_int("decode_priority", si ? c->dev.prio_high : c->dev.prio_normal);
            j_int("copy_priority", c->dev.prio_low);
            j_int("reps", reps);
            j_bool("l2_flush", c->fl.on);
            j_num("alone_ms", alone, 4);
            j_num("concurrent_ms", conc, 4);
            j_num("decode_slowdown", r.slowdown, 4);
            j_num("copy_gbps_during", r.copy_gbps, 2);
            j_bool("overlap", overlap);
            j_end();
            if (overlap == 0)
                fprintf(stderr, PROG ": warning: the %s copy did not span the timed decodes "
                                "(%.3f ms before, %.3f ms after)\n", r.path, lead, tail);
        }
    }
    cb_copy_list_free(&l);
    cb_attn_free(&a);
}

static void cb_cmd_copy(cb *c)
{
    cb_copy_env e = {.host_bytes = c->o.smoke ? (8ull << 20) : (2ull << 30),
                     .pass_bytes = c->o.smoke ? (1ull << 20) : (1ull << 30)};
    fprintf(stderr, "copy: %.2f GiB pinned host arena, %.2f GiB per pass\n",
            (double)e.host_bytes / GIB, (double)e.pass_bytes / GIB);
    CHECK(kvt__cu_host_alloc((void **)&e.h_arena, (size_t)e.host_bytes));
    e.h_dev = kvt__cu_host_device_ptr(e.h_arena);
    if (!e.h_dev)
        cb_die("cudaHostGetDevicePointer failed on the pinned arena", NULL);
    /* Distinct contents everywhere, so that a misplaced copy shows. */
    uint64_t s = 0xfeedull;
    for (uint64_t i = 0; i < e.host_bytes / 8; i++)
        ((uint64_t *)(void *)e.h_arena)[i] = c->o.smoke ? cb_rng(&s) : i * 0x9e3779b97f4a7c15ull;
    e.d_arena = cb_dev_alloc((size_t)e.pass_bytes);

    double probe = cb_h2d_probe(c, &e, "start");
    cb_copy_row rows[CB_MAX_LIST];
    uint32_t nr = 0;
    for (uint32_t i = 0; i < c->o.sizes.n; i++) {
        uint64_t size = c->o.sizes.v[i];
        if (size > e.pass_bytes || 2 * size > e.host_bytes) {
            j_begin("copy", "h2d_scattered");
            j_int("transfer_bytes", (long long)size);
            j_str("skipped", "transfer larger than half the host arena or than a pass");
            j_end();
            continue;
        }
        cb_copy_list l;
        cb_copy_list_make(&e, size, 0x11ull + size, &l);
        fprintf(stderr, "copy %llu B x %u\n", (unsigned long long)size, l.n);
        if (c->o.smoke) {
            cb_check_copy(c, &e, &l, true);
            cb_check_copy(c, &e, &l, false);
        }
        char ek[256] = "", em[256] = "";
        double kms = cb_time(c, cb_launch_copy_kernel, &l, c->s_low, ek, sizeof ek);
        /* The memcpy path: also the host's enqueue time, which the events
         * include where the copies outrun the enqueueing. */
        double mms = NAN, enq[1000];
        CHECK(cb_launch_copy_memcpy(&l, c->s_low));
        CHECK(kvt__cu_stream_sync(c->s_low));
        for (uint32_t r = 0; r < c->o.reps; r++) {
            double t0 = bench_now();
            CU(cudaEventRecord(c->ev_a[r], (cudaStream_t)c->s_low));
            int rc = cb_launch_copy_memcpy(&l, c->s_low);
            CU(cudaEventRecord(c->ev_b[r], (cudaStream_t)c->s_low));
            enq[r] = (bench_now() - t0) * 1e3;
            if (rc) {
                snprintf(em, sizeof em, "%s: %s", kvt_err_name(rc), kvt_last_error());
                break;
            }
        }
        CHECK(kvt__cu_stream_sync(c->s_low));
        if (!*em)
            mms = cb_collect(c, c->o.reps);
        double enq_ms = *em ? NAN : cb_median(enq, c->o.reps);
        double bytes = (double)l.n * (double)size;
        cb_copy_row row = {.size = size, .kernel_gbps = cb_gbps(bytes, kms),
                           .memcpy_gbps = cb_gbps(bytes, mms), .enqueue_ms = enq_ms};
        for (int kernel = 1; kernel >= 0; kernel--) {
            double g = kernel ? row.kernel_gbps : row.memcpy_gbps, f = cb_div(g, probe);
            j_begin("copy", "h2d_scattered");
            j_str("path", kernel ? "kernel" : "memcpy");
            j_int("transfer_bytes", (long long)size);
            j_int("transfers", l.n);
            j_num("bytes", bytes, 0);
            j_int("host_arena_bytes", (long long)e.host_bytes);
            j_int("reps", c->o.reps);
            if (kernel) {
                j_str("stream", "low priority");
                j_str("grid", "default cap (2 blocks per SM), 256 KiB chunks");
            } else {
                j_num("enqueue_ms", enq_ms, 3);
            }
            j_num("ms", kernel ? kms : mms, 4);
            j_num("gbps", g, 2);
            j_num("probe_gbps", probe, 2);
            j_num("probe_fraction", f, 4);
            if (kernel && size == 8192) {
                j_num("target", CB_TARGET_COPY_FRAC, 2);
                j_bool("met", cb_met_ge(f, CB_TARGET_COPY_FRAC));
            }
            if (kernel && *ek)
                j_str("error", ek);
            if (!kernel && *em)
                j_str("error", em);
            j_end();
        }
        fprintf(stderr, "  kernel %.2f GB/s, memcpy %.2f GB/s (enqueue %.2f ms)\n",
                isfinite(row.kernel_gbps) ? row.kernel_gbps : 0.0,
                isfinite(row.memcpy_gbps) ? row.memcpy_gbps : 0.0, isfinite(enq_ms) ? enq_ms : 0.0);
        rows[nr++] = row;
        cb_copy_list_free(&l);
    }

    cb_conc_row conc[4];
    uint32_t nc = 0;
    cb_concurrency(c, &e, conc, &nc);
    double after = cb_h2d_probe(c, &e, "end");

    /* Summary: the 8 KiB target and the size from which cudaMemcpyAsync
     * beats the kernel (what KVT__CU_COPY_KERNEL_MAX should be). */
    double f8 = NAN;
    uint64_t cross = 0;
    bool have_all = nr > 0, have_8k = false;
    for (uint32_t i = 0; i < nr; i++) {
        if (rows[i].size == 8192) {
            f8 = cb_div(rows[i].kernel_gbps, probe);
            have_8k = true;
        }
        if (!isfinite(rows[i].kernel_gbps) || !isfinite(rows[i].memcpy_gbps))
            have_all = false;
        else if (!cross && rows[i].memcpy_gbps > rows[i].kernel_gbps)
            cross = rows[i].size;
    }
    j_begin("copy", "summary");
    j_num("probe_gbps_start", probe, 2);
    j_num("probe_gbps_end", after, 2);
    j_num("kernel_8k_probe_fraction", f8, 4);
    j_num("target", CB_TARGET_COPY_FRAC, 2);
    j_bool("met", cb_met_ge(f8, CB_TARGET_COPY_FRAC));
    if (have_all && cross)
        j_int("memcpy_faster_from_bytes", (long long)cross);
    else
        printf(",\"memcpy_faster_from_bytes\":null");
    j_int("kernel_max_bytes_now", KVT__CU_COPY_KERNEL_MAX);
    for (uint32_t i = 0; i < nc; i++) {
        char key[64];
        snprintf(key, sizeof key, "decode_slowdown_%s_%s", conc[i].path, conc[i].stream);
        j_num(key, conc[i].slowdown, 4);
    }
    if (!have_8k)
        j_str("missing", "the target needs --sizes with 8k");
    j_end();
    if (isfinite(probe) && isfinite(after) && (after > 1.1 * probe || after < probe / 1.1))
        fprintf(stderr, PROG ": warning: the H2D probe moved from %.2f to %.2f GB/s during "
                        "the cases\n", probe, after);

    if (!c->o.json_only) {
        printf("# copy: %s; scattered pinned host -> device, %.2f GiB per pass from a %.2f GiB "
               "arena; H2D probe %.2f GB/s\n", c->dev.name, (double)e.pass_bytes / GIB,
               (double)e.host_bytes / GIB, isfinite(probe) ? probe : 0.0);
        printf("# %9s %10s %8s %10s %8s %10s\n", "transfer", "kernel_GBs", "frac", "memcpy_GBs",
               "frac", "enqueue_ms");
        for (uint32_t i = 0; i < nr; i++) {
            printf("# %9llu", (unsigned long long)rows[i].size);
            cb_print_num(rows[i].kernel_gbps, 10, 2);
            cb_print_num(cb_div(rows[i].kernel_gbps, probe), 8, 3);
            cb_print_num(rows[i].memcpy_gbps, 10, 2);
            cb_print_num(cb_div(rows[i].memcpy_gbps, probe), 8, 3);
            cb_print_num(rows[i].enqueue_ms, 10, 2);
            printf("\n");
        }
        printf("# target: kernel at 8 KiB >= %.2f of the probe: %s\n", CB_TARGET_COPY_FRAC,
               cb_met_ge(f8, CB_TARGET_COPY_FRAC) < 0 ? "n/a"
               : cb_met_ge(f8, CB_TARGET_COPY_FRAC)   ? "met"
                                                      : "not met");
        for (uint32_t i = 0; i < nc; i++) {
            printf("# decode under %s copy, %s-priority decode stream: alone", conc[i].path,
                   conc[i].stream);
            cb_print_num(conc[i].alone_ms, 0, 4);
            printf(" ms, concurrent");
            cb_print_num(conc[i].conc_ms, 0, 4);
            printf(" ms, slowdown");
            cb_print_num(conc[i].slowdown, 0, 3);
            printf("%s\n", conc[i].overlap == 0 ? " (copy did not span the decodes)" : "");
        }
        fflush(stdout);
    }
    kvt__cu_free(e.d_arena);
    kvt__cu_host_free(e.h_arena);
}

/* ---- tier: a tiered pool's decode loop against a device-only pool ------------------- */

/* Two layers of the attn geometry; the policy keeps every head stable with
 * top-K pages, a window of 2 and a rerank every 4 steps. */
#define CB_TIER_L 2u
#define CB_TIER_IV 4u

typedef struct cb_tier_pool {
    kvt_pool *p;
    kvt_seq_id ids[64];
    double *ms;    /* [steps] */
} cb_tier_pool;

static kvt_pool_opts cb_tier_opts(uint64_t dev_bytes, uint64_t host_bytes)
{
    kvt_pool_opts o;
    CHECK(kvt_pool_opts_init(&o));
    o.backend = KVT_BACKEND_CUDA;
    o.geom = (kvt_geometry){CB_TIER_L, CB_H, CB_H * CB_G, CB_D, CB_P, KVT_DTYPE_F16, {0, 0}};
    o.device_bytes = dev_bytes;
    o.host_bytes = host_bytes;
    o.max_seqs = 64;
    o.n_threads = 1;
    return o;
}

/* Prefill of ctx random tokens per sequence, in chunks (a tiered pool
 * trims each chunk's pages before the next). */
static void cb_tier_prefill(cb_tier_pool *tp, uint32_t B, uint32_t ctx, const float *d_rows,
                            uint32_t chunk)
{
    for (uint32_t i = 0; i < B; i++) {
        CHECK(kvt_seq_create(tp->p, NULL, &tp->ids[i]));
        for (uint32_t t = 0; t < ctx; t += chunk) {
            const uint32_t n = ctx - t < chunk ? ctx - t : chunk;
            for (uint32_t l = 0; l < CB_TIER_L; l++) {
                const float *k = d_rows + (size_t)((i + l + t / chunk) % 3) * CB_H * CB_D;
                CHECK(kvt_seq_append(tp->p, tp->ids[i], l, k, k + (size_t)CB_H * CB_D, n,
                                     KVT_DTYPE_F32, 0));
            }
        }
    }
}

static void cb_cmd_tier(cb *c)
{
    const bool smoke = c->o.smoke;
    const uint32_t K = smoke ? CB_SMOKE_TOPK : CB_TOPK_PAGES, steps = smoke ? 8u : 40u;
    const uint32_t Hq = CB_H * CB_G;
    kvt_geometry g = {CB_TIER_L, CB_H, Hq, CB_D, CB_P, KVT_DTYPE_F16, {0, 0}};
    kvt_policy_opts po = KVT_POLICY_OPTS_INIT;
    po.top_k_pages = K;
    po.window = 2;
    po.stable_interval = CB_TIER_IV;
    kvt_policy *pol;
    CHECK(kvt_policy_create(&g, &po, &pol));
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.top_k_pages = K;
    so.rerank_interval = CB_TIER_IV;
    kvt_selector *sel;
    CHECK(kvt_selector_create(&g, &so, &sel));
    const uint32_t *bl = c->o.batch.v, *cl = c->o.ctx.v;
    const uint32_t nb = c->o.batch.n, nc = c->o.ctx.n;
    uint64_t rng = 0x71e5;
    for (uint32_t ib = 0; ib < nb; ib++)
        for (uint32_t ic = 0; ic < nc; ic++) {
            const uint32_t B = bl[ib], ctx = cl[ic];
            /* Rows: 3 prefill patterns of chunk tokens, and per step a q, k, v. */
            const uint32_t chunk = smoke ? 64u : 2048u;
            const size_t prow = (size_t)chunk * CB_H * CB_D * 2 + 2u * CB_H * CB_D;
            const size_t qn = (size_t)B * Hq * CB_D, kn = (size_t)B * CB_H * CB_D;
            float *h = bench_xmalloc((prow > qn + 2 * kn ? prow : qn + 2 * kn) * sizeof *h);
            for (size_t e = 0; e < prow; e++)
                h[e] = cb_unit(&rng);
            float *d_rows = cb_dev_upload(h, prow * sizeof *h);
            float *d_q = cb_dev_alloc(qn * 4), *d_k = cb_dev_alloc(kn * 4),
                  *d_v = cb_dev_alloc(kn * 4);
            float *d_out[2] = {cb_dev_alloc(qn * 4), cb_dev_alloc(qn * 4)};

            kvt_pool_opts oq = cb_tier_opts(0, 0);
            oq.policy = pol;
            oq.target_tokens = ctx + steps + CB_P;
            oq.target_seqs = B;
            kvt_pool_sizing sz = {sizeof sz, 0, 0, 0, 0, 0, 0, 0};
            CHECK(kvt_pool_sizing_get(&oq, &sz));
            /* Tiered: the sizing's device tier plus a chunk's pages (the
             * prefill's room); the host holds every offloaded page. */
            const uint64_t chunk_bytes = (uint64_t)B * CB_TIER_L * CB_H *
                                         ((chunk + CB_P - 1) / CB_P + 1) * CB_BLOCK_BYTES;
            cb_tier_pool tp[2];
            memset(tp, 0, sizeof tp);
            kvt_pool_opts ot = cb_tier_opts(sz.device_bytes + chunk_bytes, sz.host_bytes);
            ot.policy = pol;
            ot.selector = sel;
            kvt_pool_opts od = cb_tier_opts(sz.dense_bytes, 0);
            od.selector = sel;
            if (kvt_pool_create(&ot, &tp[0].p) || kvt_pool_create(&od, &tp[1].p)) {
                fprintf(stderr, PROG ": tier batch %u ctx %u: %s (skipped)\n", B, ctx,
                        kvt_last_error());
                kvt_pool_destroy(tp[0].p);
                kvt_pool_destroy(tp[1].p);
                free(h);
                continue;
            }
            for (int w = 0; w < 2; w++) {
                tp[w].ms = bench_xmalloc(steps * sizeof(double));
                cb_tier_prefill(&tp[w], B, ctx, d_rows, chunk);
            }
            kvt_stats s0 = {.struct_size = sizeof s0};
            CHECK(kvt_pool_stats_get(tp[0].p, &s0));
            double worst = 0;
            for (uint32_t st = 0; st < steps; st++) {
                for (size_t e = 0; e < qn + 2 * kn; e++)
                    h[e] = cb_unit(&rng);
                CHECK(kvt__cu_memcpy(d_q, h, qn * 4));
                CHECK(kvt__cu_memcpy(d_k, h + qn, kn * 4));
                CHECK(kvt__cu_memcpy(d_v, h + qn + kn, kn * 4));
                for (int w = 0; w < 2; w++) {
                    kvt_step_opts sto = KVT_STEP_OPTS_INIT;
                    sto.selector = sel;
                    sto.stream = c->s_normal;
                    kvt_step *stp;
                    const double t0 = bench_now();
                    CHECK(kvt_step_plan(tp[w].p, tp[w].ids, B, &sto, &stp));
                    for (uint32_t l = 0; l < CB_TIER_L; l++) {
                        CHECK(kvt_step_append(stp, l, d_k, d_v, KVT_DTYPE_F32, 0));
                        CHECK(kvt_step_select(stp, l, d_q));
                        CHECK(kvt_step_decode(stp, l, d_q, d_out[w], NULL));
                    }
                    CHECK(kvt_step_finish(stp));
                    CHECK(kvt__cu_stream_sync(c->s_normal));
                    tp[w].ms[st] = (bench_now() - t0) * 1e3;
                }
                if (smoke) { /* the same selections: the same attention */
                    float *a = bench_xmalloc(qn * 8);
                    CHECK(kvt__cu_memcpy(a, d_out[0], qn * 4));
                    CHECK(kvt__cu_memcpy(a + qn, d_out[1], qn * 4));
                    for (size_t e = 0; e < qn; e++) {
                        const double d = fabs((double)a[e] - (double)a[qn + e]);
                        worst = d > worst || d != d ? d : worst;
                    }
                    free(a);
                }
            }
            kvt_stats s1 = {.struct_size = sizeof s1}, sd = {.struct_size = sizeof sd};
            CHECK(kvt_pool_stats_get(tp[0].p, &s1));
            CHECK(kvt_pool_stats_get(tp[1].p, &sd));
            const uint32_t warm = steps / 4; /* the first steps fill the windows */
            const double mt = cb_median(tp[0].ms + warm, steps - warm);
            const double md = cb_median(tp[1].ms + warm, steps - warm);
            const uint64_t promoted = s1.promoted_pages - s0.promoted_pages;
            const double h2d = (double)(s1.moved_bytes[KVT_DIR_HOST_TO_DEVICE] -
                                        s0.moved_bytes[KVT_DIR_HOST_TO_DEVICE]);
            double tsum = 0;
            for (uint32_t st = 0; st < steps; st++)
                tsum += tp[0].ms[st];
            j_begin("tier", NULL);
            j_int("batch", B);
            j_int("ctx", ctx);
            j_int("layers", CB_TIER_L);
            j_int("top_k_pages", K);
            j_int("steps", steps);
            j_num("tiered_step_ms", mt, 3);
            j_num("device_only_step_ms", md, 3);
            j_num("tiered_over_device_only", cb_div(mt, md), 3);
            j_u64("tiered_device_pages", s1.tier[KVT_TIER_DEVICE].pages);
            j_u64("device_only_pages", sd.tier[KVT_TIER_DEVICE].pages);
            j_num("promoted_per_step", (double)promoted / steps, 2);
            j_num("hit_rate", cb_div((double)(s1.sel_resident - s0.sel_resident),
                                     (double)(s1.sel_pages - s0.sel_pages)), 4);
            j_u64("paused_seqs", s1.paused_seqs - s0.paused_seqs);
            j_num("h2d_gbps_over_run", cb_gbps(h2d, tsum), 3);
            if (smoke) {
                j_num("max_abs_diff_vs_device_only", worst, 9);
                if (!(worst <= 2e-5))
                    cb_fail(c, "tier: tiered and device-only outputs differ");
            }
            j_end();
            if (!c->o.json_only)
                printf("# tier B=%u ctx=%u: tiered %.3f ms/step, device-only %.3f ms/step, "
                       "%llu vs %llu device pages, %.1f promotions/step\n", B, ctx, mt, md,
                       (unsigned long long)s1.tier[KVT_TIER_DEVICE].pages,
                       (unsigned long long)sd.tier[KVT_TIER_DEVICE].pages,
                       (double)promoted / steps);
            for (int w = 0; w < 2; w++) {
                kvt_pool_destroy(tp[w].p);
                free(tp[w].ms);
            }
            void *d[] = {d_rows, d_q, d_k, d_v, d_out[0], d_out[1]};
            for (size_t j = 0; j < sizeof d / sizeof d[0]; j++)
                kvt__cu_free(d[j]);
            free(h);
        }
    kvt_selector_destroy(sel);
    kvt_policy_destroy(pol);
}

/* ---- entry ------------------------------------------------------------------------ */

int kvt_bench_cuda_main(int argc, char **argv)
{
    cb c;
    memset(&c, 0, sizeof c);
    cb_parse_args(argc, argv, &c.o);
    const char *why = "";
    if (kvt__cu_device_count(&why) <= 0) {
        printf("{\"bench\":\"cuda\"");
        j_str("skipped", why && *why ? why : "no CUDA device");
        j_end();
        return 77;
    }
    double t0 = bench_now();
    cb_dev_probe(&c.dev);
    cb_dev_emit(&c.dev);
    fprintf(stderr, "device: %s, %d SMs, L2 %d KiB%s\n", c.dev.name, c.dev.sms,
            c.dev.l2_bytes / 1024, c.o.smoke ? " (smoke sizes)" : "");
    c.s_normal = cb_stream_normal(&c.dev);
    CHECK(kvt__cu_stream_create(&c.s_high, 0));
    CHECK(kvt__cu_stream_create(&c.s_low, 1));
    c.ev_a = bench_xmalloc((c.o.reps + 1) * sizeof *c.ev_a);
    c.ev_b = bench_xmalloc((c.o.reps + 1) * sizeof *c.ev_b);
    c.ms = bench_xmalloc((c.o.reps + 1) * sizeof *c.ms);
    for (uint32_t i = 0; i <= c.o.reps; i++) {
        c.ev_a[i] = cb_event();
        c.ev_b[i] = cb_event();
    }
    c.ev_x = cb_event();
    c.ev_y = cb_event();
    cb_flush_init(&c);

    if (c.o.cmd == CMD_ATTN || c.o.cmd == CMD_ALL)
        cb_cmd_attn(&c);
    if (c.o.cmd == CMD_COPY || c.o.cmd == CMD_ALL)
        cb_cmd_copy(&c);
    if (c.o.cmd == CMD_TIER)
        cb_cmd_tier(&c);

    cb_flush_free(&c.fl);
    for (uint32_t i = 0; i <= c.o.reps; i++) {
        (void)cudaEventDestroy(c.ev_a[i]);
        (void)cudaEventDestroy(c.ev_b[i]);
    }
    (void)cudaEventDestroy(c.ev_x);
    (void)cudaEventDestroy(c.ev_y);
    free(c.ev_a);
    free(c.ev_b);
    free(c.ms);
    kvt__cu_stream_destroy(c.s_normal);
    kvt__cu_stream_destroy(c.s_high);
    kvt__cu_stream_destroy(c.s_low);
    fprintf(stderr, "total: %.1f s%s\n", bench_now() - t0,
            c.failures ? "; smoke checks FAILED" : c.o.smoke ? "; smoke checks passed" : "");
    return c.failures ? 1 : 0;
}
