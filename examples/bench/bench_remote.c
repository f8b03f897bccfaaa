/* kvtier-bench remote: the remote tier's write and read throughput against
 * redis-benchmark on the same server, with the same value size, pipeline
 * depth and connections. One JSON object per run and a summary line with
 * remote_put_vs_redis_benchmark and remote_get_vs_redis_benchmark (see
 * examples/bench/README.md).
 *
 *   kvtier-bench remote [--pages N] [--layers 8] [--kv-heads 8] [--head-dim 128]
 *                       [--page 16] [--pipeline 32] [--connections 2] [--runs 3]
 *                       [--endpoint URL] [--quick]
 *
 * The server: a redis-server this program starts on a unix socket in a
 * temp dir (persistence off) and shuts down at the end, or --endpoint (a
 * single node; it is FLUSHALLed). Each run:
 *
 * - put: a pool (CPU backend, f16, device tier for every page) appends the
 *   rows of a --pages-page sequence without ids (nothing is keyed), then
 *   records all the ids at once (kvt_seq_tokens_set): every page position
 *   is keyed and queued as one value (the caller's thread copies its
 *   blocks), and kvt_remote_flush waits until the last one is written.
 *   Rate: values / (the time from the ids to the flush's return).
 * - get: a second pool creates a sequence with those ids as its prefix
 *   (the fetch), and kvt_seq_prefix_wait lands the values (appends); then
 *   three times again after kvt_prefix_drop_all (the first fetch touches the
 *   value buffers' memory for the first time - reported as cold_ - and the
 *   tier keeps the buffers, as in an engine that has served requests).
 *   Rate: values / kvt_stats.remote_fetch_ns of the warm fetches (three,
 *   the median; the ask to the last answer, every value checked: CRC32C,
 *   header, ids); the landing is reported apart.
 * - reference: redis-benchmark -t set,get -d VALUE -P pipeline -c conns
 *   on the same socket (one key, so that every GET returns a whole value;
 *   4 x pages requests, at least 1000), its requests per second.
 * Every value must land and read back bit for bit (the rows of the first
 * and last page are compared), else the program exits 1. */
#include "bench_io.h"

#include <kvtier/kvtier.h>

#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PROG "kvtier-bench remote"
#define REMOTE_MAX_RUNS 15u
#define TARGET_RATIO 0.8
#define REMOTE_WARM 3u /* warm fetches per run */

static const char *remote_usage =
    "usage: kvtier-bench remote [options]\n"
    "  --pages N          page positions written and read (default 1024: 512 MiB of\n"
    "                     values at the defaults)\n"
    "  --layers N         layers (default 8)\n"
    "  --kv-heads N       KV heads (default 8)\n"
    "  --head-dim N       head dimension (default 128)\n"
    "  --page N           tokens per page (default 16; a value is layers x kv-heads\n"
    "                     blocks of 2 x page x head-dim f16: 512 KiB at the defaults)\n"
    "  --pipeline N       commands in flight per connection, both sides (default: the\n"
    "                     tier's own, about 4 MiB of values: 8 at the defaults)\n"
    "  --connections N    connections (the tier's threads; redis-benchmark -c) (default 2)\n"
    "  --runs N           runs (default 3; medians)\n"
    "  --endpoint URL     an existing single-node server (unix:/path or\n"
    "                     redis://host:port; FLUSHALLed) instead of one started here\n"
    "  --quick            --pages 256 --runs 3\n"
    "  --no-reference     no redis-benchmark runs (profiling the tier alone; the\n"
    "                     summary's ratios are then 0)\n"
    "  --no-reference     no redis-benchmark runs (profiling the tier alone; the\n"
    "                     summary's ratios are then 0)\n"
    "Needs redis-server and redis-benchmark (Debian: redis-server, redis-tools) and a\n"
    "libkvtier built with hiredis. Prints one JSON object per run on stdout and a\n"
    "summary line; progress on stderr.\n";

typedef struct {
    uint32_t pages, layers, kv_heads, head_dim, page, pipeline, conns, runs;
    const char *endpoint;
    int no_reference;
} remote_opts_t;

static void remote_parse(int argc, char **argv, remote_opts_t *o)
{
    *o = (remote_opts_t){1024, 8, 8, 128, 16, 0, 2, 3, NULL, 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        unsigned long long x = 0;
        uint32_t *dst = NULL;
        unsigned long long lo = 1, hi = 1u << 20;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(remote_usage, stdout);
            exit(0);
        } else if (!strcmp(a, "--quick")) {
            o->pages = 256;
            continue;
        } else if (!strcmp(a, "--no-reference")) {
            o->no_reference = 1;
            continue;

        } else if (!strcmp(a, "--endpoint") && v) {
            o->endpoint = v;
            i++;
            continue;
        } else if (!strcmp(a, "--pages")) {
            dst = &o->pages;
        } else if (!strcmp(a, "--layers")) {
            dst = &o->layers, hi = 256;
        } else if (!strcmp(a, "--kv-heads")) {
            dst = &o->kv_heads, hi = 256;
        } else if (!strcmp(a, "--head-dim")) {
            dst = &o->head_dim, hi = 1024;
        } else if (!strcmp(a, "--page")) {
            dst = &o->page, hi = 1024;
        } else if (!strcmp(a, "--pipeline")) {
            dst = &o->pipeline, hi = 4096;
        } else if (!strcmp(a, "--connections")) {
            dst = &o->conns, hi = 64;
        } else if (!strcmp(a, "--runs")) {
            dst = &o->runs, hi = REMOTE_MAX_RUNS;
        } else {
            bench_usage_exit(PROG, "unknown option", a, remote_usage);
        }
        if (!v || bench_count(v, lo, hi, &x))
            bench_usage_exit(PROG, "bad value for", a, remote_usage);
        *dst = (uint32_t)x;
        i++;
    }
}

/* ---- the server ---- */
static char srv_dir[64], srv_sock[128];
static pid_t srv_pid;

static void srv_stop(void)
{
    if (srv_pid > 0) {
        kill(srv_pid, SIGTERM);
        waitpid(srv_pid, NULL, 0);
        srv_pid = 0;
    }
    if (srv_dir[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", srv_dir);
        if (system(cmd) != 0)
            fprintf(stderr, PROG ": could not remove %s\n", srv_dir);
        srv_dir[0] = 0;
    }
}

/* redis-cli against the server, output to out (may be NULL). */
static int srv_cli(const char *args, char *out, size_t len)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "redis-cli -s '%s' %s 2>&1", srv_sock, args);
    FILE *f = popen(cmd, "r");
    if (!f)
        return -1;
    size_t n = out ? fread(out, 1, len - 1, f) : 0;
    if (out)
        out[n] = 0;
    else
        while (fgetc(f) != EOF) {
        }
    return pclose(f);
}

static void srv_start(void)
{
    snprintf(srv_dir, sizeof srv_dir, "/tmp/kvt-bench-redis-XXXXXX");
    if (!mkdtemp(srv_dir)) {
        fprintf(stderr, PROG ": mkdtemp failed\n");
        exit(1);
    }
    snprintf(srv_sock, sizeof srv_sock, "%s/redis.sock", srv_dir);
    char log[128];
    snprintf(log, sizeof log, "%s/redis.log", srv_dir);
    atexit(srv_stop);
    srv_pid = fork();
    if (srv_pid == 0) {
        execlp("redis-server", "redis-server", "--port", "0", "--unixsocket", srv_sock,
               "--unixsocketperm", "700", "--dir", srv_dir, "--save", "", "--appendonly", "no",
               "--logfile", log, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 200; i++) {
        char out[64];
        if (srv_cli("ping", out, sizeof out) == 0 && strstr(out, "PONG"))
            return;
        usleep(25000);
    }
    fprintf(stderr, PROG ": redis-server did not start (is it installed? see %s)\n", log);
    exit(1);
}

/* redis-benchmark's requests per second for test t ("set" or "get"), over
 * as many distinct keys as the tier's values (-r pages: the server reads
 * and writes the same volume of memory, not one value that stays in the
 * caches); the SET test writes at least 8 x pages requests, which leave all
 * but e^-8 of the keys set for the GET test's (at least) 4 x pages.
 * redis-benchmark times a test in whole milliseconds and prints "inf" when
 * it ends within one (small runs on a fast machine): the request count grows
 * until the test lasts REDIS_BENCH_MIN_S, so the rate is a measurement, not
 * a rounding artefact. */
#define REDIS_BENCH_MIN_S 0.05
static double redis_bench(const remote_opts_t *o, const char *t, size_t value)
{
    char cmd[512], line[512];
    double n = (double)o->pages * (t[0] == 's' ? 8u : 4u);
    for (int tries = 0;; tries++) {
        snprintf(cmd, sizeof cmd, "redis-benchmark -s '%s' -t %s -d %zu -P %u -c %u -n %.0f "
                 "-r %u --csv 2>/dev/null", srv_sock, t, value, o->pipeline, o->conns, n,
                 o->pages);
        FILE *f = popen(cmd, "r");
        double rps = 0;
        while (f && fgets(line, sizeof line, f)) {
            char *p = strstr(line, "\",\"");
            if (p && (line[1] == 'S' || line[1] == 'G')) /* "SET","12345.67",... */
                rps = strtod(p + 3, NULL);
        }
        if (!f || pclose(f) != 0 || !(rps > 0)) {
            fprintf(stderr, PROG ": redis-benchmark -t %s failed (is redis-tools installed?)\n",
                    t);
            exit(1);
        }
        if (isfinite(rps) && n / rps >= REDIS_BENCH_MIN_S)
            return rps;
        if (tries == 12 || n >= 1e8) {
            fprintf(stderr, PROG ": redis-benchmark -t %s: %.0f requests still end within "
                    "%.0f ms (%g requests/s)\n", t, n, REDIS_BENCH_MIN_S * 1e3, rps);
            exit(1);
        }
        /* inf: under 1 ms; else scale to twice the minimum */
        n = isfinite(rps) ? ceil(n * 2.0 * REDIS_BENCH_MIN_S / (n / rps)) : n * 16.0;
    }
}

/* ---- one run ---- */
typedef struct {
    double put_s, fetch_s, cold_fetch_s, land_s, put_rate, get_rate, ref_set, ref_get;
    uint64_t values, value_bytes;
} remote_run_t;

static kvt_pool *remote_pool(const remote_opts_t *o, const kvt_remote_opts *ro)
{
    kvt_pool_opts po;
    CHECK(kvt_pool_opts_init(&po));
    po.backend = KVT_BACKEND_CPU;
    po.geom.n_layers = o->layers;
    po.geom.n_kv_heads = o->kv_heads;
    po.geom.n_q_heads = o->kv_heads;
    po.geom.head_dim = o->head_dim;
    po.geom.page_tokens = o->page;
    po.geom.dtype = KVT_DTYPE_F16;
    const uint64_t block = 2ull * o->page * o->head_dim * 2u;
    po.device_bytes = ((uint64_t)o->pages * o->layers * o->kv_heads + 2u) * block;
    po.flags = KVT_POOL_PREFIX_CACHE;
    po.n_threads = 2;
    po.remote = ro;
    kvt_pool *p;
    CHECK(kvt_pool_create(&po, &p));
    return p;
}

static void remote_run(const remote_opts_t *o, const char *endpoint, uint32_t run,
                       remote_run_t *r)
{
    const uint32_t T = o->pages * o->page, H = o->kv_heads, D = o->head_dim;
    char fp[32];
    snprintf(fp, sizeof fp, "kvtier-bench-remote-%u", run); /* each run its own keys */
    kvt_remote_opts ro;
    CHECK(kvt_remote_opts_init(&ro));
    ro.endpoints = endpoint;
    ro.fingerprint = fp;
    ro.pipeline = o->pipeline;
    ro.n_connections = o->conns;
    ro.io_timeout_ms = 10000;
    ro.queue_bytes = 4ull << 30;
    uint32_t *ids = bench_xmalloc((size_t)T * sizeof *ids);
    for (uint32_t i = 0; i < T; i++)
        ids[i] = (uint32_t)((i * 2654435761u + run) % 50000u);
    const size_t rows = (size_t)T * H * D;
    uint16_t *k = bench_xmalloc(rows * 2), *v = bench_xmalloc(rows * 2);

    /* put */
    kvt_pool *a = remote_pool(o, &ro);
    kvt_seq_id sa;
    CHECK(kvt_seq_create(a, NULL, &sa));
    for (uint32_t l = 0; l < o->layers; l++) {
        bench_fill_f16(k, rows, 1000u * run + 2u * l);
        bench_fill_f16(v, rows, 1000u * run + 2u * l + 1u);
        CHECK(kvt_seq_append(a, sa, l, k, v, T, KVT_DTYPE_F16, 0));
    }
    double t0 = bench_now();
    CHECK(kvt_seq_tokens_set(a, sa, 0, ids, T));
    CHECK(kvt_remote_flush(a, 600000));
    r->put_s = bench_now() - t0;
    kvt_stats st = {.struct_size = sizeof st};
    CHECK(kvt_pool_stats_get(a, &st));
    r->values = st.remote_put_values;
    r->value_bytes = st.remote_put_values ? st.remote_put_bytes / st.remote_put_values : 0;
    if (st.remote_put_values != o->pages || st.remote_put_dropped) {
        fprintf(stderr, PROG ": %llu values written, %llu dropped, of %u\n",
                (unsigned long long)st.remote_put_values,
                (unsigned long long)st.remote_put_dropped, o->pages);
        exit(1);
    }
    kvt_pool_destroy(a);

    /* get */
    kvt_pool *b = remote_pool(o, &ro);
    kvt_seq_opts so;
    CHECK(kvt_seq_opts_init(&so));
    so.prefix = ids;
    so.n_prefix = T;
    /* A first (cold) fetch: the process's first touch of the value buffers'
     * memory; the tier keeps them for the next, as an engine's would be
     * after its first requests. The local cache is dropped between. */
    kvt_seq_id sb;
    uint32_t got = 0;
    CHECK(kvt_seq_create(b, &so, &sb));
    CHECK(kvt_seq_prefix_wait(b, sb, UINT32_MAX, &got));
    CHECK(kvt_pool_stats_get(b, &st));
    r->cold_fetch_s = (double)st.remote_fetch_ns * 1e-9;
    /* Then REMOTE_WARM warm fetches (the median is the run's). */
    double fetch[REMOTE_WARM], land[REMOTE_WARM], before = r->cold_fetch_s;
    for (uint32_t i = 0; i < REMOTE_WARM; i++) {
        CHECK(kvt_seq_release(b, sb));
        CHECK(kvt_prefix_drop_all(b, NULL));
        t0 = bench_now();
        CHECK(kvt_seq_create(b, &so, &sb));
        CHECK(kvt_seq_prefix_wait(b, sb, UINT32_MAX, &got));
        const double total = bench_now() - t0;
        CHECK(kvt_pool_stats_get(b, &st));
        fetch[i] = (double)st.remote_fetch_ns * 1e-9 - before;
        before += fetch[i];
        land[i] = total - fetch[i];
        if (got != T)
            break;
    }
    r->fetch_s = bench_median(fetch, REMOTE_WARM);
    r->land_s = bench_median(land, REMOTE_WARM);
    st.remote_hit_values /= 1u + REMOTE_WARM; /* (per fetch) */
    if (got != T || st.remote_hit_values != o->pages || st.remote_corrupt || st.remote_errors) {
        fprintf(stderr, PROG ": landed %u of %u tokens (%llu corrupt, %llu faults)\n", got, T,
                (unsigned long long)st.remote_corrupt, (unsigned long long)st.remote_errors);
        exit(1);
    }
    /* The last layer's rows, first and last page of head 0, bit for bit. */
    uint16_t *gk = bench_xmalloc((size_t)o->page * D * 2);
    const uint32_t L1 = o->layers - 1u;
    bench_fill_f16(k, rows, 1000u * run + 2u * L1);
    for (uint32_t pg = 0; pg < o->pages; pg += o->pages - 1u) {
        CHECK(kvt_seq_read_kv(b, sb, L1, 0, pg * o->page, o->page, gk, NULL));
        for (uint32_t t = 0; t < o->page; t++)
            if (memcmp(gk + (size_t)t * D, k + ((size_t)(pg * o->page + t) * H) * D, D * 2)) {
                fprintf(stderr, PROG ": page %u token %u: landed rows differ\n", pg, t);
                exit(1);
            }
        if (o->pages == 1)
            break;
    }
    free(gk);
    kvt_pool_destroy(b);
    r->put_rate = o->pages / r->put_s;
    r->get_rate = o->pages / r->fetch_s;

    /* the reference, same server, value size, depth and connections */
    srv_cli("flushall", NULL, 0);
    r->ref_set = o->no_reference ? 0 : redis_bench(o, "set", r->value_bytes);
    double g[REMOTE_WARM] = {0};
    for (uint32_t i = 0; i < REMOTE_WARM && !o->no_reference; i++) /* (as noisy as ours) */
        g[i] = redis_bench(o, "get", r->value_bytes);
    r->ref_get = bench_median(g, REMOTE_WARM);
    srv_cli("flushall", NULL, 0);
    free(ids);
    free(k);
    free(v);
}

int bench_remote_main(int argc, char **argv)
{
    remote_opts_t o;
    remote_parse(argc, argv, &o);
    char endpoint[160];
    if (o.endpoint) {
        if (strncmp(o.endpoint, "unix:", 5)) {
            fprintf(stderr, PROG ": --endpoint: only unix:/path here (redis-benchmark and "
                    "redis-cli are pointed at the same socket)\n");
            return 2;
        }
        snprintf(srv_sock, sizeof srv_sock, "%s", o.endpoint + 5);
        snprintf(endpoint, sizeof endpoint, "%s", o.endpoint);
    } else {
        srv_start();
        snprintf(endpoint, sizeof endpoint, "unix:%s", srv_sock);
    }
    srv_cli("flushall", NULL, 0);
    if (!o.pipeline) { /* the tier's default (kvtier/remote.h), for both sides */
        const double vb = 96.0 + 4.0 * o.page + 4.0 * o.page * o.head_dim * o.layers *
                          o.kv_heads + 4.0;
        const double d = (double)(4u << 20) / vb + 0.5;
        o.pipeline = d < 1 ? 1u : d > 32 ? 32u : (uint32_t)d;
    }
    const double mib = (double)o.pages * o.layers * o.kv_heads * 4.0 * o.page * o.head_dim /
                       1048576.0;
    fprintf(stderr, PROG ": %u values of %u x %u blocks (%.0f MiB), pipeline %u, %u "
            "connections, %u runs\n", o.pages, o.layers, o.kv_heads, mib, o.pipeline, o.conns,
            o.runs);
    double put_r[REMOTE_MAX_RUNS], get_r[REMOTE_MAX_RUNS];
    for (uint32_t run = 0; run < o.runs; run++) {
        remote_run_t r;
        remote_run(&o, endpoint, run, &r);
        put_r[run] = r.ref_set > 0 ? r.put_rate / r.ref_set : 0;
        get_r[run] = r.ref_get > 0 ? r.get_rate / r.ref_get : 0;
        printf("{\"bench\":\"remote\",\"run\":%u,\"values\":%llu,\"value_bytes\":%llu,"
               "\"pipeline\":%u,\"connections\":%u,\"put_s\":%.4f,\"put_values_s\":%.1f,"
               "\"redis_benchmark_set_s\":%.1f,\"fetch_s\":%.4f,\"get_values_s\":%.1f,"
               "\"redis_benchmark_get_s\":%.1f,\"land_s\":%.4f,\"put_gib_s\":%.3f,"
               "\"get_gib_s\":%.3f,\"cold_get_values_s\":%.1f}\n",
               run, (unsigned long long)r.values, (unsigned long long)r.value_bytes, o.pipeline,
               o.conns, r.put_s, r.put_rate, r.ref_set, r.fetch_s, r.get_rate, r.ref_get,
               r.land_s, r.put_rate * (double)r.value_bytes / 1073741824.0,
               r.get_rate * (double)r.value_bytes / 1073741824.0, o.pages / r.cold_fetch_s);
        fflush(stdout);
    }
    const double pr = bench_median(put_r, o.runs), gr = bench_median(get_r, o.runs);
    printf("{\"summary\":\"remote\",\"values\":%u,\"pipeline\":%u,\"connections\":%u,"
           "\"runs\":%u,\"remote_put_vs_redis_benchmark\":%.4f,"
           "\"remote_get_vs_redis_benchmark\":%.4f,\"target\":%.2f,\"put_met\":%s,"
           "\"get_met\":%s}\n",
           o.pages, o.pipeline, o.conns, o.runs, pr, gr, TARGET_RATIO,
           pr >= TARGET_RATIO ? "true" : "false", gr >= TARGET_RATIO ? "true" : "false");
    return 0;
}
