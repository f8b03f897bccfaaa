/* kvtier-bench prefix: a chat workload through the prefix cache. One JSON
 * object per pool run and a summary line with prefix_saved_vs_ideal,
 * attach_ns_per_page and bytes_vs_no_sharing (see examples/bench/README.md).
 *
 *   kvtier-bench prefix [--convs 64] [--system 4k] [--turns 8] [--turn-tokens 256]
 *                       [--layers 4] [--kv-heads 8] [--head-dim 128] [--page 16]
 *                       [--device-frac 4] [--host-frac 4:3] [--runs 3] [--quick]
 *
 * --convs conversations share a --system-token system prompt; each has
 * --turns turns, and turn t's request is the system prompt, the t earlier
 * turns and --turn-tokens new tokens. Requests come round-robin (turn 0 of
 * every conversation, then turn 1, ...), the order that keeps the most
 * conversations waiting. Each request creates a sequence with its ids as
 * the prefix (kvt_seq_opts.prefix: the cache attaches what it has),
 * appends the rows of the rest (kvt_seq_append, every layer: the prefix's
 * ids are the sequence's, so its full pages are keyed), and releases the sequence (its pages stay cached).
 *
 * The pool (CPU backend, f16): a device tier of 1/--device-frac of the
 * workload's KV (every distinct token's rows once) and a host tier of
 * --host-frac of it (N:D, default 3/4): cached pages the device cannot keep
 * spill to the host, the least recently used ones are reclaimed.
 *
 * Reported, per run: the prefill tokens the cache saved against an ideal
 * infinite cache of the same page size (every token of every earlier
 * request's prefix: the system prompt and the conversation's earlier
 * turns); the lookup + attach time of kvt_seq_create per attached physical
 * page (one (layer, KV head) page); the device + host bytes in use at the
 * end against every conversation's full KV kept without sharing (each with
 * its own copy of the system prompt); and the same workload on the same
 * pool without KVT_POOL_PREFIX_CACHE (every token prefilled), whose
 * prefill time the cached run's is compared with. */
#include "bench_io.h"

#include <kvtier/kvtier.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROG "kvtier-bench prefix"
#define PFX_MAX_RUNS 15u
#define TARGET_SAVED 0.85
#define TARGET_ATTACH_NS 50.0

static const char *prefix_usage =
    "usage: kvtier-bench prefix [options]\n"
    "  --convs N          conversations (default 64)\n"
    "  --system N         system prompt tokens, shared by all (default 4k)\n"
    "  --turns N          turns per conversation (default 8)\n"
    "  --turn-tokens N    new tokens per turn (default 256)\n"
    "  --layers N         layers (default 4: 2.1 GiB of distinct KV at the defaults)\n"
    "  --kv-heads N       KV heads (default 8)\n"
    "  --head-dim N       head dimension (default 128)\n"
    "  --page N           tokens per page (default 16)\n"
    "  --device-frac N    device tier = 1/N of the distinct KV (default 4)\n"
    "  --host-num N       host tier = N/--host-den of the distinct KV (default 3)\n"
    "  --host-den N       (default 4; --host-num 0: no host tier)\n"
    "  --runs N           runs, each with and without the cache (default 3; medians)\n"
    "  --quick            16 conversations, 4 turns, 2 layers, 1 run (a smoke test;\n"
    "                     explicit flags win)\n"
    "Prints one JSON object per pool run on stdout and a summary line, progress on stderr.\n";

typedef struct {
    uint32_t convs, system, turns, turn_tokens, layers, kv_heads, head_dim, page, dev_frac,
        host_num, host_den, runs;
} prefix_opts;

typedef struct {
    double total_s, prefill_s, attach_s;
    uint64_t prefilled, saved, ideal, attached_pages, requests;
    uint64_t bytes_used, reclaimed, cached[KVT_NUM_TIERS];
} prefix_run;

/* Token ids: the system prompt, then each conversation's own turns. */
static uint32_t tok_id(uint32_t conv, uint32_t pos, uint32_t system)
{
    if (pos < system)
        return pos * 2654435761u % 32000u;
    uint64_t x = ((uint64_t)conv << 32 | pos) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 29;
    return (uint32_t)(x % 32000u);
}

static void run_pool(const prefix_opts *o, bool cache, const uint16_t *rows, prefix_run *r)
{
    const uint32_t L = o->layers, H = o->kv_heads, D = o->head_dim, P = o->page;
    const uint64_t tok_bytes = (uint64_t)L * H * D * 2u * 2u;
    const uint64_t block = 2ull * P * D * 2u;
    const uint64_t distinct = (uint64_t)o->system + (uint64_t)o->convs * o->turns * o->turn_tokens;
    const uint32_t max_len = o->system + o->turns * o->turn_tokens;
    kvt_pool_opts po;
    CHECK(kvt_pool_opts_init(&po));
    po.backend = KVT_BACKEND_CPU;
    po.geom.n_layers = L;
    po.geom.n_kv_heads = H;
    po.geom.n_q_heads = H;
    po.geom.head_dim = D;
    po.geom.page_tokens = P;
    po.geom.dtype = KVT_DTYPE_F16;
    /* A quarter of the KV, but at least one request's pages (and the null block). */
    uint64_t dev = distinct * tok_bytes / o->dev_frac;
    const uint64_t one = ((uint64_t)max_len / P + 2u) * L * H * block;
    po.device_bytes = (dev > one ? dev : one) + block;
    po.host_bytes = o->host_num ? distinct * tok_bytes * o->host_num / o->host_den + block : 0;
    po.max_seqs = 4;
    po.max_seq_tokens = max_len + P;
    po.flags = cache ? KVT_POOL_PREFIX_CACHE : 0;
    kvt_pool *pool;
    CHECK(kvt_pool_create(&po, &pool));
    uint32_t *ids = bench_xmalloc((size_t)max_len * sizeof *ids);
    const size_t tokw = (size_t)H * D;
    memset(r, 0, sizeof *r);
    const double t_all = bench_now();
    for (uint32_t t = 0; t < o->turns; t++)
        for (uint32_t c = 0; c < o->convs; c++) {
            const uint32_t len = o->system + (t + 1u) * o->turn_tokens;
            for (uint32_t i = 0; i < len; i++)
                ids[i] = tok_id(c, i, o->system);
            /* The ideal infinite cache: every earlier request's tokens. */
            r->ideal += (t == 0 && c == 0) ? 0u : (uint64_t)(len - o->turn_tokens) / P * P;
            kvt_seq_opts so;
            CHECK(kvt_seq_opts_init(&so));
            so.prefix = ids;
            so.n_prefix = len;
            kvt_seq_id s;
            double t0 = bench_now();
            CHECK(kvt_seq_create(pool, &so, &s));
            r->attach_s += bench_now() - t0;
            kvt_seq_info si = {.struct_size = sizeof si};
            CHECK(kvt_seq_info_get(pool, s, &si));
            const uint32_t have = si.n_tokens, rest = len - have;
            r->saved += have;
            r->prefilled += rest;
            r->attached_pages += (uint64_t)have / P * L * H;
            t0 = bench_now();
            for (uint32_t l = 0; l < L; l++)
                CHECK(kvt_seq_append(pool, s, l, rows + (size_t)have * tokw,
                                     rows + ((size_t)max_len + have) * tokw, rest, KVT_DTYPE_F16,
                                     0));
            r->prefill_s += bench_now() - t0;
            CHECK(kvt_seq_release(pool, s));
            r->requests++;
        }
    r->total_s = bench_now() - t_all;
    kvt_stats ps;
    ps.struct_size = sizeof ps;
    CHECK(kvt_pool_stats_get(pool, &ps));
    r->bytes_used = ps.tier[KVT_TIER_DEVICE].bytes_used + ps.tier[KVT_TIER_HOST].bytes_used;
    r->reclaimed = ps.prefix_reclaimed_pages;
    memcpy(r->cached, ps.prefix_cached_pages, sizeof r->cached);
    if (cache && (ps.prefix_hit_tokens != r->saved || ps.prefix_hit_pages != r->attached_pages)) {
        fprintf(stderr, PROG ": the pool's stats (%llu tokens, %llu pages) disagree with the "
                "sequences' (%llu, %llu)\n", (unsigned long long)ps.prefix_hit_tokens,
                (unsigned long long)ps.prefix_hit_pages, (unsigned long long)r->saved,
                (unsigned long long)r->attached_pages);
        exit(1);
    }
    CHECK(kvt_pool_check(pool));
    kvt_pool_destroy(pool);
    free(ids);
}

static uint32_t prefix_count(const char *flag, const char *v, unsigned long long lo,
                             unsigned long long hi)
{
    unsigned long long x;
    if (bench_count(v, lo, hi, &x))
        bench_usage_exit(PROG, "bad value for", flag, prefix_usage);
    return (uint32_t)x;
}

#define NOPT 12
int bench_prefix_main(int argc, char **argv)
{
    prefix_opts o = {64, 4096, 8, 256, 4, 8, 128, 16, 4, 3, 4, 3};
    bool set[NOPT] = {false};
    const char *names[NOPT] = {"--convs",    "--system", "--turns",       "--turn-tokens",
                               "--layers",   "--kv-heads", "--head-dim",  "--page",
                               "--device-frac", "--host-num", "--host-den", "--runs"};
    uint32_t *vals[NOPT] = {&o.convs,  &o.system,   &o.turns,    &o.turn_tokens,
                            &o.layers, &o.kv_heads, &o.head_dim, &o.page,
                            &o.dev_frac, &o.host_num, &o.host_den, &o.runs};
    const unsigned long long lo[NOPT] = {1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1};
    const unsigned long long hi[NOPT] = {4096, 1u << 20, 1024, 1u << 16, 256, 256, 1024, 4096,
                                         1024, 64,       64,   PFX_MAX_RUNS};
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(prefix_usage, stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--quick")) {
            quick = true;
            continue;
        }
        int k = -1;
        for (int j = 0; j < NOPT; j++)
            if (!strcmp(argv[i], names[j]))
                k = j;
        if (k < 0)
            bench_usage_exit(PROG, "unknown option", argv[i], prefix_usage);
        if (i + 1 >= argc)
            bench_usage_exit(PROG, "missing value for", argv[i], prefix_usage);
        *vals[k] = prefix_count(argv[i], argv[i + 1], lo[k], hi[k]);
        set[k] = true;
        i++;
    }
    if (quick) {
        const uint32_t qv[NOPT] = {16, 4096, 4, 256, 2, 8, 128, 16, 4, 3, 4, 1};
        for (int j = 0; j < NOPT; j++)
            if (!set[j])
                *vals[j] = qv[j];
    }
    if (o.host_num > o.host_den * 4u)
        bench_usage_exit(PROG, "--host-num over 4 x --host-den", NULL, prefix_usage);
    const uint32_t max_len = o.system + o.turns * o.turn_tokens;
    const size_t tokw = (size_t)o.kv_heads * o.head_dim;
    uint16_t *rows = bench_xmalloc((size_t)max_len * tokw * 2u * sizeof *rows);
    bench_fill_f16(rows, (size_t)max_len * tokw * 2u, 7); /* (content does not matter) */
    const uint64_t tok_bytes = (uint64_t)o.layers * tokw * 2u * 2u;
    const uint64_t no_share =
        (uint64_t)o.convs * ((uint64_t)o.system + (uint64_t)o.turns * o.turn_tokens) * tok_bytes;
    double saved_r[PFX_MAX_RUNS], attach_r[PFX_MAX_RUNS], bytes_r[PFX_MAX_RUNS],
        time_r[PFX_MAX_RUNS];
    for (uint32_t run = 0; run < o.runs; run++) {
        prefix_run cr, nr;
        for (int pass = 0; pass < 2; pass++) { /* alternate which goes first */
            const bool cache = (pass == 0) == (run % 2 == 0);
            prefix_run *r = cache ? &cr : &nr;
            fprintf(stderr, PROG ": run %u: %s (%u conversations x %u turns, system %u, %u "
                    "layers)\n", run, cache ? "cache" : "no cache", o.convs, o.turns, o.system,
                    o.layers);
            run_pool(&o, cache, rows, r);
            printf("{\"bench\":\"prefix\",\"run\":%u,\"case\":\"%s\",\"convs\":%u,\"system\":%u,"
                   "\"turns\":%u,\"turn_tokens\":%u,\"layers\":%u,\"kv_heads\":%u,"
                   "\"head_dim\":%u,\"page_tokens\":%u,\"dtype\":\"f16\",\"requests\":%llu,"
                   "\"total_s\":%.4f,\"prefill_s\":%.4f,\"attach_s\":%.6f,"
                   "\"prefilled_tokens\":%llu,\"saved_tokens\":%llu,\"ideal_saved_tokens\":%llu,"
                   "\"attached_pages\":%llu,\"bytes_used\":%llu,\"no_sharing_bytes\":%llu,"
                   "\"reclaimed_pages\":%llu,\"cached_pages\":[%llu,%llu,%llu]}\n",
                   run, cache ? "cache" : "no_cache", o.convs, o.system, o.turns, o.turn_tokens,
                   o.layers, o.kv_heads, o.head_dim, o.page, (unsigned long long)r->requests,
                   r->total_s, r->prefill_s, r->attach_s, (unsigned long long)r->prefilled,
                   (unsigned long long)r->saved, (unsigned long long)r->ideal,
                   (unsigned long long)r->attached_pages, (unsigned long long)r->bytes_used,
                   (unsigned long long)no_share, (unsigned long long)r->reclaimed,
                   (unsigned long long)r->cached[0], (unsigned long long)r->cached[1],
                   (unsigned long long)r->cached[2]);
            fflush(stdout);
        }
        saved_r[run] = cr.ideal ? (double)cr.saved / (double)cr.ideal : 1.0;
        attach_r[run] = cr.attached_pages ? cr.attach_s * 1e9 / (double)cr.attached_pages : 0.0;
        bytes_r[run] = (double)cr.bytes_used / (double)no_share;
        time_r[run] = cr.total_s / nr.total_s;
    }
    const double sv = bench_median(saved_r, o.runs), at = bench_median(attach_r, o.runs);
    const double by = bench_median(bytes_r, o.runs), tr = bench_median(time_r, o.runs);
    printf("{\"summary\":\"prefix\",\"convs\":%u,\"system\":%u,\"turns\":%u,\"turn_tokens\":%u,"
           "\"runs\":%u,\"prefix_saved_vs_ideal\":%.4f,\"prefix_saved_target\":%.2f,"
           "\"prefix_saved_met\":%s,\"attach_ns_per_page\":%.2f,\"attach_ns_target\":%.0f,"
           "\"attach_ns_met\":%s,\"bytes_vs_no_sharing\":%.4f,"
           "\"workload_time_vs_no_cache\":%.4f}\n",
           o.convs, o.system, o.turns, o.turn_tokens, o.runs, sv, TARGET_SAVED,
           sv >= TARGET_SAVED ? "true" : "false", at, TARGET_ATTACH_NS,
           at <= TARGET_ATTACH_NS ? "true" : "false", by, tr);
    free(rows);
    return 0;
}
