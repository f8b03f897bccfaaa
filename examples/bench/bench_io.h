/* kvtier-bench: the io and tier subcommands' entry points and helpers shared
 * by the subcommands. io: the disk tier's page reads against a plain io_uring
 * reader of the same file (bench_io.c); tier: the tiered placement's decode
 * loop (bench_tier.c). See examples/bench/README.md. */
#ifndef KVTIER_BENCH_IO_H
#define KVTIER_BENCH_IO_H

/* argv[0] is "io"; returns the process exit status. */
int bench_io_main(int argc, char **argv);
/* argv[0] is "tier": the tiered placement's decode loop (bench_tier.c);
 * returns the process exit status. */
int bench_tier_main(int argc, char **argv);
/* argv[0] is "fork": a prompt forked into children against independent
 * copies (bench_fork.c); returns the process exit status. */
int bench_fork_main(int argc, char **argv);
/* argv[0] is "prefix": a chat workload through the prefix cache
 * (bench_prefix.c); returns the process exit status. */
int bench_prefix_main(int argc, char **argv);
/* argv[0] is "remote": the remote tier against redis-benchmark
 * (bench_remote.c); returns the process exit status. */
int bench_remote_main(int argc, char **argv);

/* Helpers both subcommands use. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Exits with the library's message when a kvt_* call fails (PROG names the
 * program in each file). */
#define CHECK(call)                                                                        \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_) {                                                                         \
            fprintf(stderr, PROG ": %s failed: %s (%s)\n", #call, kvt_err_name(rc_),       \
                    kvt_last_error());                                                     \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static inline void *bench_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "kvtier-bench: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* Reports a bad command line (the subcommand's usage text after it) and
 * exits with status 2. */
static inline void bench_usage_exit(const char *prog, const char *msg, const char *arg,
                                    const char *usage)
{
    fprintf(stderr, "%s: %s%s%s\n%s", prog, msg, arg ? ": " : "", arg ? arg : "", usage);
    exit(2);
}

/* A count with an optional k (x1024) or m (x1048576) suffix in [lo, hi]:
 * 0 and *out set, or -1 (the caller reports its usage error). */
static inline int bench_count(const char *s, unsigned long long lo, unsigned long long hi,
                              unsigned long long *out)
{
    char *end;
    if (!s || !*s || *s == '-')
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || errno)
        return -1;
    unsigned long long mul = 1;
    if (*end == 'k' || *end == 'K')
        mul = 1024ull, end++;
    else if (*end == 'm' || *end == 'M')
        mul = 1048576ull, end++;
    if (*end || v > hi / mul || v * mul < lo || v * mul > hi)
        return -1;
    *out = v * mul;
    return 0;
}

/* The median of v[n] (sorts v). */
static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static inline double bench_median(double *v, uint32_t n)
{
    qsort(v, n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* A deterministic f16 pattern from seed: small finite values (sign,
 * exponent 11..14, i.e. 0.0039 .. 2, random mantissa). */
static inline void bench_fill_f16(uint16_t *b, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b[i] = (uint16_t)(((x >> 20) & 0x8000u) | ((11u + ((x >> 40) & 3u)) << 10) |
                          ((x >> 8) & 0x3ffu));
    }
}

static inline double bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif /* KVTIER_BENCH_IO_H */
