/* kvtier-profile: builds head-stability profiles (kvtier-profile(5)) from
 * recorded top-K traces or from a live decode run, prints a profile's class
 * map, and compares the unstable-head sets of several profiles
 * (FlexiCache's cross-task overlap |A_i & A_j| / |A_i|).
 *
 *   kvtier-profile record [source options] -o TRACE
 *   kvtier-profile live   [source options] [build options] -o PROFILE
 *   kvtier-profile build  TRACE... [build options] -o PROFILE
 *   kvtier-profile show   PROFILE [--ctx N]
 *   kvtier-profile compare PROFILE PROFILE...
 *
 * The live source is a synthetic model (see examples/profile/README.md):
 * some heads are designed stable (their queries keep one direction), the
 * others unstable (a new random query each step). The example decoder
 * (issue 7) does not exist yet; it will plug in as another trace_source.
 */
#include <kvtier/kvtier.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROG "kvtier-profile"

#define CHECK(call)                                                                        \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_) {                                                                         \
            fprintf(stderr, PROG ": %s failed: %s (%s)\n", #call, kvt_err_name(rc_),       \
                    kvt_last_error());                                                     \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static const char usage_text[] =
    "usage: " PROG " record [source options] -o TRACE\n"
    "       " PROG " live   [source options] [build options] -o PROFILE\n"
    "       " PROG " build  TRACE... [build options] -o PROFILE\n"
    "       " PROG " show   PROFILE [--ctx N]\n"
    "       " PROG " compare PROFILE PROFILE...\n"
    "\n"
    "record  runs a live decode and writes the top-K page set of every (step, layer,\n"
    "        sequence, KV head) to a trace file (format below)\n"
    "live    runs a live decode with the profiler attached to the step plan\n"
    "        (kvt_step_opts.profiler) and writes the profile\n"
    "build   feeds one or more traces to the profiler and writes the profile\n"
    "show    prints a profile's summary and class map\n"
    "compare prints the overlap |A_i & A_j| / |A_i| of the profiles' unstable sets\n"
    "\n"
    "source options (record, live):\n"
    "  --model M           synthetic (the only source so far; the example decoder of\n"
    "                      issue 7 is not built yet)\n"
    "  --layers N (4)  --kv-heads N (8)  --gqa N (4)  --head-dim N (64)  --page-tokens N (16)\n"
    "  --seqs N (2)        sequences decoded together (each one profiler stream)\n"
    "  --prompt N (2048)   prefill tokens per sequence\n"
    "  --steps N (64)      decode steps\n"
    "  --budget N (256)    selection budget in tokens (top-K = budget / page-tokens)\n"
    "  --unstable-heads F  share of heads the synthetic model makes unstable (0.25)\n"
    "  --seed N (1)\n"
    "build options (live, build):\n"
    "  --window N (16)            steps per stability window\n"
    "  --unstable-fraction F (0.25)  share of heads made UNSTABLE\n"
    "  --bottom-fraction F (0.25) share of heads counted as bottom in each window\n"
    "  --top-k N                  top-K pages of the policy (default: the largest set recorded)\n"
    "  --interval N (16)          rerank interval of stable heads\n"
    "  --device-pages N (0)       page budget of the stable heads' windows (0: window 1)\n"
    "show options:\n"
    "  --ctx N (32768)     context length for the device-memory line\n"
    "\n"
    "Trace file (little-endian): a 40-byte header \"KVTTRACE\", u32 version (1), u32\n"
    "n_layers, n_kv_heads, n_q_heads, head_dim, page_tokens, dtype, u32 0; then records\n"
    "until the end: u64 stream, u32 layer, u32 kv_head, u32 n_candidates, u32 n_pages,\n"
    "u32 pages[n_pages] (strictly increasing). The records of one (stream, layer, head)\n"
    "are its consecutive steps.\n";

static void usage_error(const char *msg, const char *arg)
{
    fprintf(stderr, PROG ": %s%s%s\n%s", msg, arg ? ": " : "", arg ? arg : "", usage_text);
    exit(2);
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, PROG ": out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* ---- options ------------------------------------------------------------------ */
typedef struct opts {
    const char *model, *out;
    uint32_t L, H, G, D, P, seqs, prompt, steps, budget;
    double unstable_heads;
    uint64_t seed;
    uint32_t window, top_k, interval;
    double unstable_fraction, bottom_fraction;
    uint64_t device_pages, ctx;
    const char *inputs[64];
    uint32_t n_inputs;
} opts;

static uint64_t parse_u64(const char *s, const char *flag, uint64_t lo, uint64_t hi)
{
    char *end;
    if (!s || !*s || *s == '-')
        usage_error("bad value for", flag);
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || v < lo || v > hi)
        usage_error("value out of range for", flag);
    return v;
}

static double parse_frac(const char *s, const char *flag)
{
    char *end;
    if (!s || !*s)
        usage_error("bad value for", flag);
    double v = strtod(s, &end);
    if (*end || !(v >= 0.0 && v <= 1.0))
        usage_error("a value in 0..1 is needed for", flag);
    return v;
}

static void parse(int argc, char **argv, int first, opts *o, const char *cmd)
{
    const bool src = !strcmp(cmd, "record") || !strcmp(cmd, "live");
    const bool bld = !strcmp(cmd, "live") || !strcmp(cmd, "build");
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-') {
            if (o->n_inputs == sizeof o->inputs / sizeof o->inputs[0])
                usage_error("too many input files", a);
            o->inputs[o->n_inputs++] = a;
            continue;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(usage_text, stdout);
            exit(0);
        }
        if (i + 1 >= argc)
            usage_error("missing value for", a);
        const char *v = argv[++i];
        if (!strcmp(a, "-o") && (src || bld))
            o->out = v;
        else if (src && !strcmp(a, "--model"))
            o->model = v;
        else if (src && !strcmp(a, "--layers"))
            o->L = (uint32_t)parse_u64(v, a, 1, 256);
        else if (src && !strcmp(a, "--kv-heads"))
            o->H = (uint32_t)parse_u64(v, a, 1, 256);
        else if (src && !strcmp(a, "--gqa"))
            o->G = (uint32_t)parse_u64(v, a, 1, 64);
        else if (src && !strcmp(a, "--head-dim"))
            o->D = (uint32_t)parse_u64(v, a, 8, 1024);
        else if (src && !strcmp(a, "--page-tokens"))
            o->P = (uint32_t)parse_u64(v, a, 8, 256);
        else if (src && !strcmp(a, "--seqs"))
            o->seqs = (uint32_t)parse_u64(v, a, 1, 256);
        else if (src && !strcmp(a, "--prompt"))
            o->prompt = (uint32_t)parse_u64(v, a, 1, 1u << 20);
        else if (src && !strcmp(a, "--steps"))
            o->steps = (uint32_t)parse_u64(v, a, 1, 1u << 20);
        else if (src && !strcmp(a, "--budget"))
            o->budget = (uint32_t)parse_u64(v, a, 1, 1u << 26);
        else if (src && !strcmp(a, "--unstable-heads"))
            o->unstable_heads = parse_frac(v, a);
        else if (src && !strcmp(a, "--seed"))
            o->seed = parse_u64(v, a, 0, UINT64_MAX);
        else if (bld && !strcmp(a, "--window"))
            o->window = (uint32_t)parse_u64(v, a, 2, 65536);
        else if (bld && !strcmp(a, "--unstable-fraction"))
            o->unstable_fraction = parse_frac(v, a);
        else if (bld && !strcmp(a, "--bottom-fraction"))
            o->bottom_fraction = parse_frac(v, a);
        else if (bld && !strcmp(a, "--top-k"))
            o->top_k = (uint32_t)parse_u64(v, a, 0, KVT_SELECT_MAX_PAGES);
        else if (bld && !strcmp(a, "--interval"))
            o->interval = (uint32_t)parse_u64(v, a, 1, UINT32_MAX);
        else if (bld && !strcmp(a, "--device-pages"))
            o->device_pages = parse_u64(v, a, 0, UINT64_MAX);
        else if (!strcmp(cmd, "show") && !strcmp(a, "--ctx"))
            o->ctx = parse_u64(v, a, 0, UINT64_MAX);
        else
            usage_error("unknown option for this command", a);
    }
}

/* ---- little-endian I/O ------------------------------------------------------------ */
static void put_u32(FILE *f, uint32_t v)
{
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    if (fwrite(b, 1, 4, f) != 4) {
        perror(PROG ": writing the trace");
        exit(1);
    }
}

static void put_u64(FILE *f, uint64_t v)
{
    put_u32(f, (uint32_t)v);
    put_u32(f, (uint32_t)(v >> 32));
}

/* 1 = read, 0 = clean end of file before the first byte. */
static int get_u32(FILE *f, uint32_t *v, const char *path)
{
    uint8_t b[4];
    size_t n = fread(b, 1, 4, f);
    if (n == 0 && feof(f))
        return 0;
    if (n != 4) {
        fprintf(stderr, PROG ": %s: truncated trace\n", path);
        exit(1);
    }
    *v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return 1;
}

static void need_u32(FILE *f, uint32_t *v, const char *path)
{
    if (!get_u32(f, v, path)) {
        fprintf(stderr, PROG ": %s: truncated trace\n", path);
        exit(1);
    }
}

/* ---- the trace source ------------------------------------------------------------------ */
/* What a live run needs from a model, called in decode order: the keys and
 * values of tokens [t0, t0 + n) of sequence s in layer l ([n][H][D] f32
 * each), and the queries of sequence s in layer l at decode step `step`
 * ([Hq][D] f32). The example decoder (issue 7) will implement these with
 * its forward pass. */
typedef struct trace_source {
    const char *name;
    void *ctx;
    void (*kv)(void *ctx, uint32_t s, uint32_t l, uint32_t t0, uint32_t n, float *k, float *v);
    void (*q)(void *ctx, uint32_t s, uint32_t l, uint32_t step, float *q);
} trace_source;

/* The synthetic model: page p of (s, l, h) has a random unit direction u;
 * its keys are 4u plus noise, so a query's bound score ranks pages by
 * q . u. A stable head's queries keep one direction (plus a little noise),
 * an unstable head's are new random vectors every step. */
typedef struct synth {
    uint32_t L, H, G, D, P;
    uint64_t seed;
    uint8_t *unstable; /* [L * H] */
    float *qdir;       /* [L * H * G][D] */
} synth;

static uint64_t mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A normal-ish value (sum of four uniforms, centred) from state s. */
static float gauss(uint64_t *s)
{
    double x = 0;
    for (int i = 0; i < 4; i++) {
        *s = mix(*s);
        x += (double)(*s >> 11) * 0x1p-53;
    }
    return (float)((x - 2.0) * 1.7320508);
}

static void unit_vec(uint64_t seed, float *u, uint32_t D)
{
    double n = 0;
    for (uint32_t d = 0; d < D; d++) {
        u[d] = gauss(&seed);
        n += (double)u[d] * u[d];
    }
    const float inv = (float)(1.0 / sqrt(n > 0 ? n : 1.0));
    for (uint32_t d = 0; d < D; d++)
        u[d] *= inv;
}

static void synth_kv(void *ctx, uint32_t s, uint32_t l, uint32_t t0, uint32_t n, float *k,
                     float *v)
{
    const synth *m = ctx;
    float *u = xmalloc(m->D * sizeof *u);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < m->H; h++) {
            const uint32_t tok = t0 + t, page = tok / m->P;
            unit_vec(mix(m->seed ^ mix(((uint64_t)s << 48) ^ ((uint64_t)l << 40) ^
                                       ((uint64_t)h << 32) ^ page)),
                     u, m->D);
            uint64_t ns = mix(m->seed * 31 + ((uint64_t)s << 40) + ((uint64_t)l << 32) + tok * 8 + h);
            float *kr = k + ((size_t)t * m->H + h) * m->D, *vr = v + ((size_t)t * m->H + h) * m->D;
            for (uint32_t d = 0; d < m->D; d++) {
                kr[d] = 4.0f * u[d] + 0.1f * gauss(&ns);
                vr[d] = gauss(&ns);
            }
        }
    free(u);
}

static void synth_q(void *ctx, uint32_t s, uint32_t l, uint32_t step, float *q)
{
    const synth *m = ctx;
    const uint32_t Hq = m->H * m->G;
    for (uint32_t j = 0; j < Hq; j++) {
        const uint32_t h = j / m->G;
        float *qr = q + (size_t)j * m->D;
        uint64_t ns = mix(m->seed ^ 0x51ull ^ mix(((uint64_t)s << 48) ^ ((uint64_t)l << 36) ^
                                                 ((uint64_t)j << 24) ^ step));
        if (m->unstable[(size_t)l * m->H + h]) {
            unit_vec(ns, qr, m->D);
        } else {
            const float *dir = m->qdir + ((size_t)l * Hq + j) * m->D;
            for (uint32_t d = 0; d < m->D; d++)
                qr[d] = dir[d] + 0.02f * gauss(&ns);
        }
    }
}

static void synth_init(synth *m, const opts *o)
{
    m->L = o->L;
    m->H = o->H;
    m->G = o->G;
    m->D = o->D;
    m->P = o->P;
    m->seed = mix(o->seed);
    const uint32_t n = o->L * o->H, Hq = o->H * o->G;
    m->unstable = calloc(n, 1);
    m->qdir = xmalloc((size_t)o->L * Hq * o->D * sizeof *m->qdir);
    if (!m->unstable)
        exit(1);
    /* Exactly round(share * heads) unstable heads, by a seeded shuffle. */
    uint32_t *idx = xmalloc(n * sizeof *idx);
    for (uint32_t i = 0; i < n; i++)
        idx[i] = i;
    uint64_t r = m->seed ^ 0xabcdefull;
    for (uint32_t i = n; i > 1; i--) {
        r = mix(r);
        uint32_t j = (uint32_t)(r % i), x = idx[i - 1];
        idx[i - 1] = idx[j];
        idx[j] = x;
    }
    const uint32_t nu = (uint32_t)floor(o->unstable_heads * n + 0.5);
    for (uint32_t i = 0; i < nu; i++)
        m->unstable[idx[i]] = 1;
    free(idx);
    for (uint32_t j = 0; j < o->L * Hq; j++)
        unit_vec(mix(m->seed ^ 0x71ull ^ ((uint64_t)j << 20)), m->qdir + (size_t)j * o->D,
                 o->D);
}

/* ---- live runs ----------------------------------------------------------------------- */
static void write_trace_header(FILE *f, const kvt_geometry *g)
{
    if (fwrite("KVTTRACE", 1, 8, f) != 8) {
        perror(PROG ": writing the trace");
        exit(1);
    }
    const uint32_t h[8] = {1, g->n_layers, g->n_kv_heads, g->n_q_heads, g->head_dim,
                           g->page_tokens, g->dtype, 0};
    for (int i = 0; i < 8; i++)
        put_u32(f, h[i]);
}

/* Decodes o->steps tokens of o->seqs sequences after an o->prompt-token
 * prefill, selecting pages with an interval-1 selector (every head is
 * reranked at every step). Writes each top-K set to `trace` (may be NULL)
 * and lets the step plan feed `prof` (may be NULL). */
static void run_live(const opts *o, const trace_source *src, FILE *trace, kvt_profiler *prof,
                     kvt_geometry *g_out)
{
    kvt_pool_opts po;
    CHECK(kvt_pool_opts_init(&po));
    po.backend = KVT_BACKEND_CPU;
    po.geom.n_layers = o->L;
    po.geom.n_kv_heads = o->H;
    po.geom.n_q_heads = o->H * o->G;
    po.geom.head_dim = o->D;
    po.geom.page_tokens = o->P;
    po.geom.dtype = KVT_DTYPE_F16;
    uint64_t bb;
    CHECK(kvt_geometry_block_bytes(&po.geom, &bb));
    const uint64_t pages = ((uint64_t)o->prompt + o->steps + o->P - 1) / o->P + 1;
    po.device_bytes = ((uint64_t)o->seqs * o->L * o->H * pages + 16) * bb;
    po.max_seqs = o->seqs;
    po.n_threads = 2;
    kvt_pool *pool;
    CHECK(kvt_pool_create(&po, &pool));
    kvt_geometry g;
    CHECK(kvt_pool_geometry_get(pool, &g));
    *g_out = g;
    const uint32_t H = g.n_kv_heads, Hq = g.n_q_heads, D = g.head_dim, L = g.n_layers;
    kvt_seq_id *ids = xmalloc(o->seqs * sizeof *ids);
    float *k = xmalloc((size_t)o->prompt * H * D * sizeof *k);
    float *v = xmalloc((size_t)o->prompt * H * D * sizeof *v);
    for (uint32_t s = 0; s < o->seqs; s++) {
        CHECK(kvt_seq_create(pool, NULL, &ids[s]));
        for (uint32_t l = 0; l < L; l++) {
            src->kv(src->ctx, s, l, 0, o->prompt, k, v);
            CHECK(kvt_seq_append(pool, ids[s], l, k, v, o->prompt, KVT_DTYPE_F32, 0));
        }
    }
    kvt_selector_opts so;
    CHECK(kvt_selector_opts_init(&so));
    so.top_k_pages = o->budget / o->P;
    so.sink_pages = 1;
    so.local_pages = 1;
    kvt_selector *sel;
    CHECK(kvt_selector_create(&g, &so, &sel));
    kvt_step_opts to;
    CHECK(kvt_step_opts_init(&to));
    to.selector = sel;
    to.profiler = prof;
    float *q = xmalloc((size_t)o->seqs * Hq * D * sizeof *q);
    const uint32_t cap = (uint32_t)pages;
    uint32_t *sel_pages = xmalloc(cap * sizeof *sel_pages);
    if (trace)
        write_trace_header(trace, &g);
    for (uint32_t step = 0; step < o->steps; step++) {
        kvt_step *st;
        CHECK(kvt_step_plan(pool, ids, o->seqs, &to, &st));
        for (uint32_t l = 0; l < L; l++) {
            for (uint32_t s = 0; s < o->seqs; s++) {
                src->kv(src->ctx, s, l, o->prompt + step, 1, k + (size_t)s * H * D,
                        v + (size_t)s * H * D);
                src->q(src->ctx, s, l, step, q + (size_t)s * Hq * D);
            }
            CHECK(kvt_step_append(st, l, k, v, KVT_DTYPE_F32, 0));
            CHECK(kvt_step_select(st, l, q));
            if (!trace)
                continue;
            for (uint32_t s = 0; s < o->seqs; s++) {
                uint32_t T;
                CHECK(kvt_seq_length_get(pool, ids[s], l, &T));
                const uint32_t np = (T + o->P - 1) / o->P;
                for (uint32_t h = 0; h < H; h++) {
                    uint32_t n, m = 0, forced = 0;
                    CHECK(kvt_step_selection_get(st, l, s, h, sel_pages, cap, &n, NULL));
                    /* The top-K part: without the sink page, the local page
                     * and a partial last page. */
                    for (uint32_t p = 0; p < np; p++)
                        forced += p < so.sink_pages || p + so.local_pages >= np ||
                                  (p == np - 1 && T % o->P);
                    for (uint32_t j = 0; j < n; j++) {
                        const uint32_t p = sel_pages[j];
                        if (!(p < so.sink_pages || p + so.local_pages >= np ||
                              (p == np - 1 && T % o->P)))
                            sel_pages[m++] = p;
                    }
                    put_u64(trace, s);
                    put_u32(trace, l);
                    put_u32(trace, h);
                    put_u32(trace, np - forced);
                    put_u32(trace, m);
                    for (uint32_t j = 0; j < m; j++)
                        put_u32(trace, sel_pages[j]);
                }
            }
        }
        CHECK(kvt_step_finish(st));
        if (step % 16 == 15 || step + 1 == o->steps)
            fprintf(stderr, "\r  step %u/%u", step + 1, o->steps);
    }
    fprintf(stderr, "\n");
    free(q);
    free(sel_pages);
    free(k);
    free(v);
    free(ids);
    kvt_selector_destroy(sel);
    kvt_pool_destroy(pool);
}

static void source_of(const opts *o, synth *m, trace_source *src)
{
    if (strcmp(o->model, "synthetic") != 0) {
        if (!strcmp(o->model, "decoder"))
            fprintf(stderr, PROG ": the example decoder (issue 7) is not built yet; use "
                    "--model synthetic\n");
        else
            fprintf(stderr, PROG ": unknown model '%s' (synthetic)\n", o->model);
        exit(2);
    }
    if (o->budget < o->P)
        usage_error("--budget must be at least --page-tokens", NULL);
    synth_init(m, o);
    src->name = "synthetic";
    src->ctx = m;
    src->kv = synth_kv;
    src->q = synth_q;
    uint32_t nu = 0;
    for (uint32_t i = 0; i < o->L * o->H; i++)
        nu += m->unstable[i];
    fprintf(stderr, "synthetic model: %u layers x %u KV heads, %u designed unstable:", o->L,
            o->H, nu);
    for (uint32_t i = 0; i < o->L * o->H; i++)
        if (m->unstable[i])
            fprintf(stderr, " L%u.H%u", i / o->H, i % o->H);
    fprintf(stderr, "\n");
}

/* ---- profiles ------------------------------------------------------------------------ */
static void print_profile(const kvt_policy *pol, uint64_t ctx)
{
    size_t need;
    CHECK(kvt_policy_describe(pol, ctx, NULL, 0, &need));
    char *text = xmalloc(need + 1);
    CHECK(kvt_policy_describe(pol, ctx, text, need + 1, NULL));
    fputs(text, stdout);
    free(text);
    kvt_geometry g;
    CHECK(kvt_policy_geometry_get(pol, &g));
    printf("class map (U = unstable; a digit = a stable head's window):\n");
    for (uint32_t l = 0; l < g.n_layers; l++) {
        printf("  layer %3u:", l);
        for (uint32_t h = 0; h < g.n_kv_heads; h++) {
            kvt_policy_head_info info;
            memset(&info, 0, sizeof info);
            info.struct_size = sizeof info;
            CHECK(kvt_policy_head_get(pol, l, h, &info));
            if (info.head_class == KVT_HEAD_UNSTABLE)
                printf(" U");
            else if (info.window < 10)
                printf(" %u", info.window);
            else
                printf(" +");
        }
        printf("\n");
    }
}

static kvt_profiler *new_profiler(const opts *o, const kvt_geometry *g)
{
    kvt_profiler_opts po;
    CHECK(kvt_profiler_opts_init(&po));
    po.window_steps = o->window;
    po.unstable_fraction = o->unstable_fraction;
    po.bottom_fraction = o->bottom_fraction;
    po.max_streams = 1u << 20;
    kvt_profiler *p;
    CHECK(kvt_profiler_create(g, &po, &p));
    return p;
}

static void finish_profile(const opts *o, const kvt_profiler *prof, const kvt_geometry *g)
{
    kvt_policy_opts base;
    CHECK(kvt_policy_opts_init(&base));
    uint32_t kmax = 0;
    for (uint32_t l = 0; l < g->n_layers; l++)
        for (uint32_t h = 0; h < g->n_kv_heads; h++) {
            kvt_profiler_head_stats st;
            memset(&st, 0, sizeof st);
            st.struct_size = sizeof st;
            CHECK(kvt_profiler_head_get(prof, l, h, &st));
            kmax = st.k_max > kmax ? st.k_max : kmax;
        }
    base.top_k_pages = o->top_k ? o->top_k : kmax;
    base.stable_interval = o->interval;
    kvt_policy *pol;
    CHECK(kvt_profiler_build_policy(prof, &base, o->device_pages, &pol));
    CHECK(kvt_policy_save(pol, o->out));
    printf("wrote %s\n", o->out);
    print_profile(pol, 32768);
    kvt_policy_destroy(pol);
}

static int cmd_record(const opts *o)
{
    synth m;
    trace_source src;
    source_of(o, &m, &src);
    FILE *f = fopen(o->out, "wb");
    if (!f) {
        perror(o->out);
        return 1;
    }
    kvt_geometry g;
    run_live(o, &src, f, NULL, &g);
    if (fclose(f) != 0) {
        perror(o->out);
        return 1;
    }
    printf("wrote %s: %u steps x %u layers x %u sequences x %u KV heads\n", o->out, o->steps,
           o->L, o->seqs, o->H);
    free(m.unstable);
    free(m.qdir);
    return 0;
}

static int cmd_live(const opts *o)
{
    synth m;
    trace_source src;
    source_of(o, &m, &src);
    kvt_geometry g = {o->L, o->H, o->H * o->G, o->D, o->P, KVT_DTYPE_F16, {0, 0}};
    kvt_profiler *prof = new_profiler(o, &g);
    run_live(o, &src, NULL, prof, &g);
    finish_profile(o, prof, &g);
    kvt_profiler_destroy(prof);
    free(m.unstable);
    free(m.qdir);
    return 0;
}

static int cmd_build(const opts *o)
{
    kvt_profiler *prof = NULL;
    kvt_geometry g0;
    uint32_t *pages = NULL;
    uint32_t cap = 0;
    for (uint32_t i = 0; i < o->n_inputs; i++) {
        const char *path = o->inputs[i];
        FILE *f = fopen(path, "rb");
        if (!f) {
            perror(path);
            exit(1);
        }
        char magic[8];
        if (fread(magic, 1, 8, f) != 8 || memcmp(magic, "KVTTRACE", 8) != 0) {
            fprintf(stderr, PROG ": %s: not a kvtier trace\n", path);
            exit(1);
        }
        uint32_t h[8];
        for (int j = 0; j < 8; j++)
            need_u32(f, &h[j], path);
        if (h[0] != 1) {
            fprintf(stderr, PROG ": %s: trace version %u (this program reads 1)\n", path, h[0]);
            exit(1);
        }
        kvt_geometry g = {h[1], h[2], h[3], h[4], h[5], h[6], {0, 0}};
        if (kvt_geometry_validate(&g)) {
            fprintf(stderr, PROG ": %s: bad geometry: %s\n", path, kvt_last_error());
            exit(1);
        }
        if (!prof) {
            g0 = g;
            prof = new_profiler(o, &g);
        } else if (memcmp(&g, &g0, sizeof g) != 0) {
            fprintf(stderr, PROG ": %s: another geometry than %s\n", path, o->inputs[0]);
            exit(1);
        }
        uint64_t n_rec = 0;
        uint32_t lo;
        while (get_u32(f, &lo, path)) {
            uint32_t hi, l, kh, nc, n;
            need_u32(f, &hi, path);
            need_u32(f, &l, path);
            need_u32(f, &kh, path);
            need_u32(f, &nc, path);
            need_u32(f, &n, path);
            if (n > KVT_SELECT_MAX_PAGES) {
                fprintf(stderr, PROG ": %s: record %llu has %u pages\n", path,
                        (unsigned long long)n_rec, n);
                exit(1);
            }
            if (n > cap) {
                free(pages);
                cap = n;
                pages = xmalloc((size_t)cap * sizeof *pages);
            }
            for (uint32_t j = 0; j < n; j++)
                need_u32(f, &pages[j], path);
            /* Streams of different files are different sequences. */
            const uint64_t stream = ((uint64_t)i << 48) ^ ((uint64_t)hi << 32 | lo);
            int rc = kvt_profiler_record(prof, stream, l, kh, pages, n, nc);
            if (rc) {
                fprintf(stderr, PROG ": %s: record %llu: %s (%s)\n", path,
                        (unsigned long long)n_rec, kvt_err_name(rc), kvt_last_error());
                exit(1);
            }
            n_rec++;
        }
        fclose(f);
        fprintf(stderr, "%s: %llu records\n", path, (unsigned long long)n_rec);
    }
    free(pages);
    finish_profile(o, prof, &g0);
    kvt_profiler_destroy(prof);
    return 0;
}

static int cmd_show(const opts *o)
{
    kvt_policy *pol;
    CHECK(kvt_policy_load(o->inputs[0], NULL, &pol));
    print_profile(pol, o->ctx);
    kvt_policy_destroy(pol);
    return 0;
}

static int cmd_compare(const opts *o)
{
    const uint32_t n = o->n_inputs;
    kvt_policy **pol = xmalloc(n * sizeof *pol);
    kvt_geometry g0;
    for (uint32_t i = 0; i < n; i++) {
        CHECK(kvt_policy_load(o->inputs[i], i ? &g0 : NULL, &pol[i]));
        if (i == 0)
            CHECK(kvt_policy_geometry_get(pol[0], &g0));
    }
    const uint32_t nh = g0.n_layers * g0.n_kv_heads;
    uint8_t *u = xmalloc((size_t)n * nh);
    uint32_t *cnt = calloc(n, sizeof *cnt);
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t h = 0; h < nh; h++) {
            kvt_policy_head_info info;
            memset(&info, 0, sizeof info);
            info.struct_size = sizeof info;
            CHECK(kvt_policy_head_get(pol[i], h / g0.n_kv_heads, h % g0.n_kv_heads, &info));
            u[(size_t)i * nh + h] = info.head_class == KVT_HEAD_UNSTABLE;
            cnt[i] += u[(size_t)i * nh + h];
        }
    printf("overlap of unstable heads |A_i & A_j| / |A_i| (row i, column j):\n");
    for (uint32_t i = 0; i < n; i++)
        printf("  [%u] %s: %u unstable of %u heads\n", i, o->inputs[i], cnt[i], nh);
    printf("      ");
    for (uint32_t j = 0; j < n; j++)
        printf("   [%2u]", j);
    printf("\n");
    for (uint32_t i = 0; i < n; i++) {
        printf("  [%2u]", i);
        for (uint32_t j = 0; j < n; j++) {
            uint32_t both = 0;
            for (uint32_t h = 0; h < nh; h++)
                both += u[(size_t)i * nh + h] && u[(size_t)j * nh + h];
            if (cnt[i])
                printf("  %5.3f", (double)both / cnt[i]);
            else
                printf("      -");
        }
        printf("\n");
    }
    for (uint32_t i = 0; i < n; i++)
        kvt_policy_destroy(pol[i]);
    free(pol);
    free(u);
    free(cnt);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        usage_error("missing command", NULL);
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        fputs(usage_text, stdout);
        return 0;
    }
    opts o = {.model = "synthetic", .L = 4, .H = 8, .G = 4, .D = 64, .P = 16, .seqs = 2,
              .prompt = 2048, .steps = 64, .budget = 256, .unstable_heads = 0.25, .seed = 1,
              .window = 16, .interval = 16, .unstable_fraction = 0.25,
              .bottom_fraction = 0.25, .ctx = 32768};
    if (strcmp(cmd, "record") && strcmp(cmd, "live") && strcmp(cmd, "build") &&
        strcmp(cmd, "show") && strcmp(cmd, "compare"))
        usage_error("unknown command", cmd);
    parse(argc, argv, 2, &o, cmd);
    if (!strcmp(cmd, "record") || !strcmp(cmd, "live")) {
        if (o.n_inputs)
            usage_error("unexpected argument", o.inputs[0]);
        if (!o.out)
            usage_error("missing -o", cmd);
        return !strcmp(cmd, "record") ? cmd_record(&o) : cmd_live(&o);
    }
    if (!strcmp(cmd, "build")) {
        if (!o.n_inputs)
            usage_error("build needs a trace", NULL);
        if (!o.out)
            usage_error("missing -o", cmd);
        return cmd_build(&o);
    }
    if (!strcmp(cmd, "show")) {
        if (o.n_inputs != 1)
            usage_error("show takes one profile", NULL);
        return cmd_show(&o);
    }
    if (o.n_inputs < 2)
        usage_error("compare needs two or more profiles", NULL);
    return cmd_compare(&o);
}
