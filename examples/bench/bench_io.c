/* kvtier-bench io: the disk tier's page reads (through the tier mover) against
 * a plain io_uring O_DIRECT reader of the same file, with the same request
 * size and queue depth, in one run; one JSON object per case on stdout
 * (see examples/bench/README.md).
 *
 *   kvtier-bench io [--dir DIR] [--file-gib 8] [--qd 64] [--seconds 5]
 *                   [--reps 3] [--cases LIST] [--quick] [--no-fio] [--help]
 *
 * A pool whose disk tier holds --file-gib GiB of 8 KiB pages is filled
 * (device -> disk moves), then each case reads pages disk -> host: random
 * single pages, random runs of 4, 8 and 16 adjacent pages (one request
 * each after the mover coalesces them) and every page of every (layer,
 * head) in order, in 16-page requests. The reference reads the same file,
 * O_DIRECT, with registered buffers, the same queue depth, the same
 * request sizes and the same kind of offsets (random aligned, or in file
 * order). Reference and library passes alternate; medians are reported.
 */
#include "bench_io.h"

#include <kvtier/kvtier.h>

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PROG "kvtier-bench io"

#define IO_HEAD_DIM     128u
#define IO_PAGE_TOKENS  16u
#define IO_KV_HEADS     8u
/* Pages per (layer, head): 64 extents of 64 pages, i.e. 4 whole segments of
 * the mover's default layout, so the file is exactly full of data. */
#define IO_PAGES_PER_LH 4096u
#define IO_CHUNK_TOKENS 16384u   /* one append: one segment per head */
#define IO_LAYERS_PER_GIB 4u     /* 8 heads x 4096 pages x 8 KiB = 256 MiB a layer */
#define IO_BATCH_REQ    64u      /* requests per submitted batch */
#define IO_MAX_RUN      16u
#define IO_MAX_IO_BYTES (128u << 10)
#define IO_DEVICE_BYTES (1ull << 30)
#define IO_HOST_BYTES   (256ull << 20)
#define IO_FILL_INFLIGHT 4u      /* append chunks whose moves may be in flight */
#define IO_VERIFY_PAGES 256u
#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif
#define IO_RAMFS_MAGIC 0x858458f6

extern char **environ;

/* ---- errors, helpers ---------------------------------------------------------- */

#define CHECK(call)                                                                        \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_) {                                                                         \
            fprintf(stderr, PROG ": %s failed: %s (%s)\n", #call, kvt_err_name(rc_),       \
                    kvt_last_error());                                                     \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static void io_die(const char *msg, const char *arg)
{
    fprintf(stderr, PROG ": %s%s%s\n", msg, arg ? ": " : "", arg ? arg : "");
    exit(1);
}

/* user + system CPU seconds of the whole process (every thread). */
static double io_cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static uint64_t io_rng(uint64_t *s) /* splitmix64 */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int io_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double io_median(const double *v, uint32_t n)
{
    double t[1000];
    memcpy(t, v, n * sizeof *t);
    qsort(t, n, sizeof *t, io_cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

/* The kept disk file's path. It lives in a process-wide variable because
 * the atexit and signal handlers that remove it take no argument: an
 * interrupted or failed run must not leave a file of many GiB behind. */
static char io_path[4096];
static volatile sig_atomic_t io_path_set;

static void io_unlink_path(void)
{
    if (io_path_set) {
        io_path_set = 0;
        unlink(io_path);
    }
}

static void io_on_signal(int sig)
{
    if (io_path_set)
        unlink(io_path);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigaction(sig, &sa, NULL);
    raise(sig);
}

/* ---- cases ---------------------------------------------------------------------------- */

typedef struct io_case {
    const char *name;
    uint32_t run;  /* pages per request */
    bool seq;      /* in order (else random, aligned to run) */
} io_case;

static const io_case io_cases[] = {
    {"rand_1", 1, false}, {"run_4", 4, false}, {"run_8", 8, false},
    {"run_16", 16, false}, {"seq", 16, true},
};
#define IO_N_CASES (sizeof io_cases / sizeof io_cases[0])

/* ---- options -------------------------------------------------------------------- */

typedef struct io_opts {
    const char *dir;
    uint32_t file_gib, qd, reps;
    double seconds;
    bool quick, fio;
    uint32_t cases;         /* bit i: io_cases[i] runs */
} io_opts;

static const char io_usage[] =
    "usage: kvtier-bench io [options]\n"
    "  --dir DIR       directory of the disk file; a real disk, not tmpfs\n"
    "                  (default: $TMPDIR, else /var/tmp)\n"
    "  --file-gib N    size of the disk file in GiB, at least 8 (default 8)\n"
    "  --qd N          requests in flight, library and reference (default 64)\n"
    "  --seconds S     seconds per measured pass (default 5)\n"
    "  --reps R        passes per reader and case, alternating; medians (default 3)\n"
    "  --quick         1 GiB file, 1 s passes, 1 rep (a smoke test; explicit flags win)\n"
    "  --cases LIST    cases to run: rand_1,run_4,run_8,run_16,seq (default: all)\n"
    "  --no-fio        do not run fio even when it is installed\n"
    "  --help          this text\n"
    "Prints one JSON object per case on stdout, progress on stderr.\n";

static void io_usage_error(const char *msg, const char *arg)
{
    bench_usage_exit(PROG, msg, arg, io_usage);
}

static uint32_t io_parse_u32(const char *s, const char *flag, uint32_t lo, uint32_t hi)
{
    char *end;
    if (!s || !*s || *s == '-')
        io_usage_error("bad value for", flag);
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno || v < lo || v > hi)
        io_usage_error("bad value for", flag);
    return (uint32_t)v;
}

static void io_parse_args(int argc, char **argv, io_opts *o)
{
    memset(o, 0, sizeof *o);
    const char *tmp = getenv("TMPDIR");
    o->dir = tmp && *tmp ? tmp : "/var/tmp";
    o->file_gib = 8;
    o->qd = 64;
    o->reps = 3;
    o->seconds = 5.0;
    o->fio = true;
    o->cases = (1u << IO_N_CASES) - 1u;
    bool have_gib = false, have_s = false, have_reps = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(io_usage, stdout);
            exit(0);
        }
    }
    for (int i = 1; i < argc; i++) {
        char flag[64];
        const char *a = argv[i], *val = NULL;
        if (strncmp(a, "--", 2) != 0)
            io_usage_error("unknown argument", a);
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        if (len >= sizeof flag)
            io_usage_error("unknown option", a);
        memcpy(flag, a, len);
        flag[len] = '\0';
        if (!strcmp(flag, "--quick") || !strcmp(flag, "--no-fio")) {
            if (eq)
                io_usage_error("this option takes no value", a);
            if (!strcmp(flag, "--quick"))
                o->quick = true;
            else
                o->fio = false;
            continue;
        }
        static const char *const with_value[] = {"--dir", "--file-gib", "--qd", "--seconds",
                                                 "--reps", "--cases"};
        bool known = false;
        for (size_t j = 0; j < sizeof with_value / sizeof with_value[0]; j++)
            known = known || !strcmp(flag, with_value[j]);
        if (!known)
            io_usage_error("unknown option", a);
        if (eq)
            val = eq + 1;
        else if (i + 1 < argc)
            val = argv[++i];
        else
            io_usage_error("missing value for", flag);

        if (!strcmp(flag, "--dir")) {
            if (!*val)
                io_usage_error("bad value for", flag);
            o->dir = val;
        } else if (!strcmp(flag, "--file-gib")) {
            o->file_gib = io_parse_u32(val, flag, 1, 1024);
            have_gib = true;
        } else if (!strcmp(flag, "--qd")) {
            o->qd = io_parse_u32(val, flag, 1, 4096);
        } else if (!strcmp(flag, "--reps")) {
            o->reps = io_parse_u32(val, flag, 1, 1000);
            have_reps = true;
        } else if (!strcmp(flag, "--cases")) {
            char buf[256];
            if (strlen(val) >= sizeof buf)
                io_usage_error("bad value for", flag);
            strcpy(buf, val);
            o->cases = 0;
            for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
                 tok = strtok_r(NULL, ",", &save)) {
                size_t j = 0;
                while (j < IO_N_CASES && strcmp(tok, io_cases[j].name))
                    j++;
                if (j == IO_N_CASES)
                    io_usage_error("unknown case", tok);
                o->cases |= 1u << j;
            }
            if (!o->cases)
                io_usage_error("empty list for", flag);
        } else if (!strcmp(flag, "--seconds")) {
            char *end;
            double v = strtod(val, &end);
            if (!*val || *end || !(v >= 0.1) || v > 3600.0)
                io_usage_error("--seconds must lie in 0.1..3600", val);
            o->seconds = v;
            have_s = true;
        }
    }
    if (o->quick) {
        if (!have_gib)
            o->file_gib = 1;
        if (!have_s)
            o->seconds = 1.0;
        if (!have_reps)
            o->reps = 1;
    } else if (o->file_gib < 8) {
        io_usage_error("--file-gib must be at least 8 (a file that dwarfs any cache); "
                       "--quick allows less", NULL);
    }
}

/* ---- the benchmark's state ---------------------------------------------------------- */


typedef struct io_ctx {
    const io_opts *o;
    kvt_pool *pool;
    kvt_mover *mover;
    kvt_seq_id seq;
    uint32_t L, H, P;       /* layers, KV heads, pages per (layer, head) */
    uint64_t n_pages;       /* L * H * P, numbered (layer, head, page) */
    uint64_t page_bytes;
    uint64_t file_bytes;
    uint32_t host_blocks;
    uint8_t *busy;          /* [n_pages] 1 while a move of the page is in flight */
    uint64_t rng;
    uint64_t lib_cursor;    /* next page of the sequential case */
    uint64_t ref_cursor;    /* next offset of the reference's sequential case */
    uint16_t *k, *v;        /* prefill sources of one chunk, [token][head][dim] f16 */
    int ref_fd;
} io_ctx;

typedef struct io_pass {
    double secs, bytes, requests, cpu_s;
} io_pass;

/* ---- data: random f16 rows, stamped per (layer, token, head) --------------------------- */

/* A finite f16 in +-[2^-7, 2): exponent 8..15, any mantissa. */
static uint16_t io_rand_f16(uint64_t r)
{
    return (uint16_t)((r & 0x83ffu) | ((8u + (uint32_t)((r >> 16) & 7u)) << 10));
}

/* The first four elements of K row (layer, token, head): unique bytes in every
 * page, so nothing below us (a deduplicating or compressing virtual disk)
 * can serve the reads from fewer bytes than the file holds. */
static void io_stamp(uint16_t *row, uint32_t layer, uint32_t token, uint32_t head)
{
    uint64_t s = ((uint64_t)layer << 40) ^ ((uint64_t)token << 8) ^ head ^ 0x51ed270b27a1c2d5ull;
    for (int i = 0; i < 4; i++)
        row[i] = io_rand_f16(io_rng(&s));
}

/* Appends every layer of the sequence chunk by chunk and moves each chunk's
 * pages device -> disk, dropping the device copy, while the next chunk is
 * appended; returns the seconds taken. */
static double io_fill(io_ctx *c)
{
    const uint32_t H = c->H, D = IO_HEAD_DIM, CH = IO_CHUNK_TOKENS;
    const uint32_t ppc = CH / IO_PAGE_TOKENS, n_ch = c->P / ppc;
    kvt_move *mv = bench_xmalloc((size_t)H * ppc * sizeof *mv);
    kvt_fence f[IO_FILL_INFLIGHT];
    uint32_t head = 0, nf = 0;
    double t0 = bench_now();
    for (uint32_t l = 0; l < c->L; l++) {
        for (uint32_t ch = 0; ch < n_ch; ch++) {
            for (uint32_t t = 0; t < CH; t++)
                for (uint32_t h = 0; h < H; h++)
                    io_stamp(c->k + ((size_t)t * H + h) * D, l, ch * CH + t, h);
            CHECK(kvt_seq_append(c->pool, c->seq, l, c->k, c->v, CH, KVT_DTYPE_F16, 0));
            uint32_t n = 0;
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t p = ch * ppc; p < (ch + 1) * ppc; p++)
                    mv[n++] = (kvt_move){c->seq, l, h, p, KVT_TIER_DEVICE, KVT_TIER_DISK,
                                         KVT_MOVE_DROP_SOURCE};
            if (nf == IO_FILL_INFLIGHT) {
                CHECK(kvt_mover_wait(c->mover, f[head], UINT64_MAX));
                head = (head + 1) % IO_FILL_INFLIGHT;
                nf--;
            }
            CHECK(kvt_mover_submit(c->mover, mv, n, 0, NULL, &f[(head + nf) % IO_FILL_INFLIGHT]));
            nf++;
        }
        fprintf(stderr, "\r  fill: layer %u/%u", l + 1, c->L);
    }
    CHECK(kvt_mover_wait(c->mover, KVT_FENCE_ALL, UINT64_MAX));
    free(mv);
    return bench_now() - t0;
}

/* ---- the library's reads ------------------------------------------------------------- */

static void io_page_of(const io_ctx *c, uint64_t g, uint32_t *l, uint32_t *h, uint32_t *p)
{
    *l = (uint32_t)(g / ((uint64_t)c->H * c->P));
    *h = (uint32_t)(g / c->P % c->H);
    *p = (uint32_t)(g % c->P);
}

/* The next request of a case: `run` adjacent pages of one (layer, head),
 * aligned to `run` (so inside one 64-page extent, contiguous on disk), none
 * of them in flight (a second move would be KVT_EBUSY) or already in the
 * host tier (its move would be a no-op, not a disk read). Returns the first
 * page's number. */
static uint64_t io_pick(io_ctx *c, const io_case *k)
{
    const uint64_t n_runs = c->n_pages / k->run;
    uint8_t res[IO_MAX_RUN];
    for (uint64_t tries = 0; tries < 100000000u; tries++) {
        uint64_t g;
        if (k->seq) {
            g = c->lib_cursor;
            c->lib_cursor = (g + k->run) % c->n_pages;
        } else {
            g = io_rng(&c->rng) % n_runs * k->run;
        }
        bool ok = true;
        for (uint32_t i = 0; i < k->run && ok; i++)
            ok = !c->busy[g + i];
        if (!ok)
            continue;
        uint32_t l, h, p;
        io_page_of(c, g, &l, &h, &p);
        CHECK(kvt_seq_block_table_get(c->pool, c->seq, l, h, p, k->run, NULL, NULL, res));
        for (uint32_t i = 0; i < k->run && ok; i++)
            ok = !(res[i] & KVT_RES_HOST);
        if (ok)
            return g;
    }
    io_die("found no page to read (every candidate is in flight or in the host tier)", NULL);
    return 0;
}

typedef struct io_batch {
    kvt_move *mv;
    uint32_t n;
    kvt_fence fence;
} io_batch;

/* Keeps max_out batches of IO_BATCH_REQ requests submitted (a new one as
 * soon as the oldest completes) for o->seconds, then drains. Bytes and
 * requests are the mover's disk counters: what was really read. */
static void io_lib_pass(io_ctx *c, const io_case *k, io_pass *out)
{
    const uint32_t per = IO_BATCH_REQ * k->run;
    /* At least 3x the queue depth of requests queued, so that the I/O thread
     * never runs dry while the caller handles a completed batch; at most half
     * the host tier reserved by moves in flight. */
    uint32_t max_out = 3u * c->o->qd / IO_BATCH_REQ + 2u;
    while (max_out > 2 && (uint64_t)max_out * per > c->host_blocks / 2u)
        max_out--;
    io_batch *bt = bench_xmalloc(max_out * sizeof *bt);
    for (uint32_t i = 0; i < max_out; i++)
        bt[i].mv = bench_xmalloc((size_t)per * sizeof *bt[i].mv);

    kvt_mover_stats s0 = {.struct_size = sizeof s0}, s1 = {.struct_size = sizeof s1};
    CHECK(kvt_mover_stats_get(c->mover, &s0));
    double cpu0 = io_cpu_s(), t0 = bench_now(), end = t0 + c->o->seconds;
    uint32_t head = 0, n_out = 0;
    for (;;) {
        if (bench_now() < end) {
            while (n_out < max_out) {
                io_batch *b = &bt[(head + n_out) % max_out];
                b->n = 0;
                for (uint32_t r = 0; r < IO_BATCH_REQ; r++) {
                    uint64_t g = io_pick(c, k);
                    uint32_t l, h, p;
                    io_page_of(c, g, &l, &h, &p);
                    for (uint32_t i = 0; i < k->run; i++) {
                        c->busy[g + i] = 1;
                        b->mv[b->n++] = (kvt_move){c->seq, l, h, p + i, KVT_TIER_DISK,
                                                   KVT_TIER_HOST, 0};
                    }
                }
                CHECK(kvt_mover_submit(c->mover, b->mv, b->n, 0, NULL, &b->fence));
                n_out++;
            }
        }
        if (!n_out)
            break;
        io_batch *b = &bt[head];
        CHECK(kvt_mover_wait(c->mover, b->fence, UINT64_MAX));
        for (uint32_t i = 0; i < b->n; i++) {
            const kvt_move *m = &b->mv[i];
            c->busy[((uint64_t)m->layer * c->H + m->kv_head) * c->P + m->page] = 0;
        }
        head = (head + 1) % max_out;
        n_out--;
    }
    double t1 = bench_now(), cpu1 = io_cpu_s();
    CHECK(kvt_mover_stats_get(c->mover, &s1));
    out->secs = t1 - t0;
    out->cpu_s = cpu1 - cpu0;
    out->bytes = (double)(s1.disk_read_bytes - s0.disk_read_bytes);
    out->requests = (double)(s1.disk_reads - s0.disk_reads);
    for (uint32_t i = 0; i < max_out; i++)
        free(bt[i].mv);
    free(bt);
}

/* ---- the reference: plain io_uring, O_DIRECT, registered buffers and file ------------ */

/* Queues the reference's next read into buffer i: the next block for the
 * sequential case, a random one otherwise. */
static void io_ref_read(io_ctx *c, const io_case *k, struct io_uring *ring, bool reg,
                        const struct iovec *iov, uint32_t i, uint32_t bs, uint64_t n_blk)
{
    uint64_t off;
    if (k->seq) {
        off = c->ref_cursor;
        c->ref_cursor = (off + bs) % (n_blk * bs);
    } else {
        off = io_rng(&c->rng) % n_blk * bs;
    }
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    if (reg) {
        io_uring_prep_read_fixed(sqe, 0, iov[i].iov_base, bs, off, (int)i);
        sqe->flags |= IOSQE_FIXED_FILE;
    } else {
        io_uring_prep_read(sqe, c->ref_fd, iov[i].iov_base, bs, off);
    }
    io_uring_sqe_set_data64(sqe, i);
}

static void io_ref_pass(io_ctx *c, const io_case *k, io_pass *out)
{
    const uint32_t qd = c->o->qd;
    const uint32_t bs = k->run * (uint32_t)c->page_bytes;
    const uint64_t n_blk = c->file_bytes / bs;
    struct io_uring ring;
    int e = io_uring_queue_init(qd, &ring, 0);
    if (e < 0)
        io_die("reference: io_uring_queue_init failed", strerror(-e));
    /* Buffers on transparent huge pages (2 MiB aligned, MADV_HUGEPAGE), so
     * that a request is one physically contiguous segment: the reference is
     * the best this reader can do. On the development VM's virtio disk a
     * 128 KiB read into 4 KiB pages (32 segments) ran at about half the
     * bandwidth (README.md); how contiguous 4 KiB pages happen to be is
     * luck, which would make the ratios drift from run to run. */
    const size_t huge = 2u << 20;
    size_t len = (size_t)qd * bs, map = len + huge;
    uint8_t *raw = mmap(NULL, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        io_die("reference: cannot map its buffers", NULL);
    uint8_t *buf = (uint8_t *)(((uintptr_t)raw + huge - 1u) & ~(uintptr_t)(huge - 1u));
    (void)madvise(buf, len, MADV_HUGEPAGE); /* a hint: without THP, 4 KiB pages */
    struct iovec *iov = bench_xmalloc(qd * sizeof *iov);
    for (uint32_t i = 0; i < qd; i++)
        iov[i] = (struct iovec){buf + (size_t)i * bs, bs};
    bool reg = io_uring_register_buffers(&ring, iov, qd) == 0;
    if (reg && io_uring_register_files(&ring, &c->ref_fd, 1) != 0) {
        io_uring_unregister_buffers(&ring);
        reg = false;
    }
    static bool warned;
    if (!reg && !warned) {
        warned = true;
        fprintf(stderr, PROG ": warning: the reference runs without registered buffers\n");
    }

    double cpu0 = io_cpu_s(), t0 = bench_now(), end = t0 + c->o->seconds;
    uint64_t bytes = 0, reqs = 0;
    uint32_t inflight = 0;
    bool more = true;
    for (uint32_t i = 0; i < qd; i++) {
        io_ref_read(c, k, &ring, reg, iov, i, bs, n_blk);
        inflight++;
    }
    while (inflight) {
        do
            e = io_uring_submit_and_wait(&ring, 1);
        while (e == -EINTR);
        if (e < 0)
            io_die("reference: io_uring_submit_and_wait failed", strerror(-e));
        more = more && bench_now() < end;
        struct io_uring_cqe *cqe;
        unsigned hd, seen = 0;
        io_uring_for_each_cqe(&ring, hd, cqe)
        {
            uint32_t i = (uint32_t)io_uring_cqe_get_data64(cqe);
            if (cqe->res != (int)bs) {
                fprintf(stderr, PROG ": reference read returned %d (expected %u): %s\n",
                        cqe->res, bs, cqe->res < 0 ? strerror(-cqe->res) : "short read");
                exit(1);
            }
            seen++;
            inflight--;
            bytes += bs;
            reqs++;
            if (!more)
                continue;
            io_ref_read(c, k, &ring, reg, iov, i, bs, n_blk);
            inflight++;
        }
        io_uring_cq_advance(&ring, seen);
    }
    double t1 = bench_now(), cpu1 = io_cpu_s();
    out->secs = t1 - t0;
    out->cpu_s = cpu1 - cpu0;
    out->bytes = (double)bytes;
    out->requests = (double)reqs;
    io_uring_queue_exit(&ring);
    munmap(raw, map);
    free(iov);
}

/* ---- output ------------------------------------------------------------------------------- */

static void io_json_real(const char *key, double v, int prec)
{
    if (isfinite(v))
        printf(",\"%s\":%.*f", key, prec, v);
    else
        printf(",\"%s\":null", key);
}

static void io_json_str(const char *key, const char *s)
{
    printf(",\"%s\":\"", key);
    for (; *s; s++) {
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

static void io_warning(const char *msg)
{
    fprintf(stderr, PROG ": warning: %s\n", msg);
    printf("{\"warning\":\"%s\"}\n", msg);
    fflush(stdout);
}

typedef struct io_row {
    double bps, iops, cpu_us, avg_req;
} io_row;

/* Medians over the passes of one reader and case. */
static io_row io_summarise(const io_ctx *c, const io_pass *ps, uint32_t n, uint32_t bs)
{
    double bps[1000], cpu[1000], req[1000];
    for (uint32_t i = 0; i < n; i++) {
        bps[i] = ps[i].bytes / ps[i].secs;
        cpu[i] = ps[i].bytes > 0 ? ps[i].cpu_s * 1e6 / (ps[i].bytes / (double)c->page_bytes) : NAN;
        req[i] = ps[i].requests > 0 ? ps[i].bytes / ps[i].requests : NAN;
    }
    io_row r;
    r.bps = io_median(bps, n);
    r.iops = r.bps / bs;
    r.cpu_us = io_median(cpu, n);
    r.avg_req = io_median(req, n);
    return r;
}

static void io_emit(const char *who, const io_case *k, uint32_t bs, const io_ctx *c,
                    const io_row *r, double ratio)
{
    printf("{\"case\":\"%s_%s\",\"block_bytes\":%u,\"queue_depth\":%u", who, k->name, bs,
           c->o->qd);
    io_json_real("iops", r->iops, 0);
    io_json_real("gbps", r->bps / 1e9, 3);
    io_json_real("ratio_vs_reference", ratio, 4);
    io_json_real("cpu_us_per_page", r->cpu_us, 3);
    io_json_real("avg_request_bytes", r->avg_req, 0);
    printf(",\"page_bytes\":%llu,\"reps\":%u", (unsigned long long)c->page_bytes, c->o->reps);
    io_json_real("seconds", c->o->seconds, 2);
    printf("}\n");
    fflush(stdout);
}

/* ---- verification: pages read back against the bytes appended ----------------------------- */

/* Reads IO_VERIFY_PAGES random pages with kvt_seq_read_kv (from the host
 * tier when a case left them there, else a synchronous CRC-checked disk
 * read) and compares them with the rows io_fill appended. */
static uint32_t io_verify(io_ctx *c, uint32_t *from_host)
{
    const uint32_t D = IO_HEAD_DIM, T = IO_PAGE_TOKENS, H = c->H;
    uint16_t kb[IO_PAGE_TOKENS * IO_HEAD_DIM], vb[IO_PAGE_TOKENS * IO_HEAD_DIM];
    uint16_t row[IO_HEAD_DIM];
    uint32_t bad = 0;
    *from_host = 0;
    for (uint32_t n = 0; n < IO_VERIFY_PAGES; n++) {
        uint64_t g = io_rng(&c->rng) % c->n_pages;
        uint32_t l, h, p;
        uint8_t res;
        io_page_of(c, g, &l, &h, &p);
        CHECK(kvt_seq_block_table_get(c->pool, c->seq, l, h, p, 1, NULL, NULL, &res));
        *from_host += (res & KVT_RES_HOST) != 0;
        CHECK(kvt_seq_read_kv(c->pool, c->seq, l, h, p * T, T, kb, vb));
        bool ok = true;
        for (uint32_t t = 0; t < T && ok; t++) {
            uint32_t tok = p * T + t;
            size_t src = ((size_t)(tok % IO_CHUNK_TOKENS) * H + h) * D;
            memcpy(row, c->k + src, sizeof row);
            io_stamp(row, l, tok, h);
            ok = !memcmp(kb + (size_t)t * D, row, sizeof row) &&
                 !memcmp(vb + (size_t)t * D, c->v + src, sizeof row);
        }
        if (!ok) {
            if (bad < 5)
                fprintf(stderr, PROG ": page (layer %u, head %u, page %u) reads back wrong\n", l,
                        h, p);
            bad++;
        }
    }
    return bad;
}

/* ---- fio --------------------------------------------------------------------------------- */

static bool io_in_path(const char *prog)
{
    const char *path = getenv("PATH");
    char buf[4096];
    if (!path)
        return false;
    while (*path) {
        size_t n = strcspn(path, ":");
        if (n > 0 && n + strlen(prog) + 2 <= sizeof buf) {
            memcpy(buf, path, n);
            buf[n] = '/';
            strcpy(buf + n + 1, prog);
            if (access(buf, X_OK) == 0)
                return true;
        }
        path += n;
        if (*path == ':')
            path++;
    }
    return false;
}

/* Runs fio's random read of `file` with the reference's settings and
 * returns its IOPS (NaN when it cannot be run or read). cmd receives the
 * command line (what the user would type). */
static double io_fio(const char *file, uint32_t size_gib, uint32_t bs, uint32_t qd,
                     double seconds, bool run, char *cmd, size_t cap)
{
    char a_name[] = "--name=kvtier-ref", a_file[4224], a_bs[32], a_qd[32], a_rt[32], a_sz[32];
    char fesc[4200];
    size_t j = 0;
    for (const char *s = file; *s && j + 3 < sizeof fesc; s++) { /* ':' separates fio files */
        if (*s == ':')
            fesc[j++] = '\\';
        fesc[j++] = *s;
    }
    fesc[j] = '\0';
    snprintf(a_file, sizeof a_file, "--filename=%s", fesc);
    snprintf(a_bs, sizeof a_bs, "--bs=%uk", bs / 1024u);
    snprintf(a_qd, sizeof a_qd, "--iodepth=%u", qd);
    snprintf(a_rt, sizeof a_rt, "--runtime=%.0f", ceil(seconds));
    snprintf(a_sz, sizeof a_sz, "--size=%ug", size_gib);
    /* A file of our own (the kept disk file, read only), or one fio lays out. */
    char *argv[] = {"fio", a_name, a_file, size_gib ? a_sz : "--readonly",
                    "--ioengine=io_uring", "--direct=1", "--rw=randread", a_bs, a_qd, a_rt,
                    "--time_based", "--output-format=terse", NULL};
    size_t used = 0;
    cmd[0] = '\0';
    for (int i = 0; argv[i] && used < cap; i++)
        used += (size_t)snprintf(cmd + used, cap - used, "%s%s", i ? " " : "", argv[i]);
    if (!run)
        return NAN;

    int pfd[2];
    if (pipe(pfd))
        return NAN;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pfd[1], 1);
    posix_spawn_file_actions_addclose(&fa, pfd[0]);
    posix_spawn_file_actions_addclose(&fa, pfd[1]);
    pid_t pid;
    int e = posix_spawnp(&pid, "fio", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(pfd[1]);
    if (e) {
        close(pfd[0]);
        fprintf(stderr, PROG ": cannot run fio: %s\n", strerror(e));
        return NAN;
    }
    char out[65536];
    size_t n = 0;
    for (;;) {
        ssize_t r = read(pfd[0], out + n, sizeof out - 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
        if (n == sizeof out - 1)
            break;
    }
    out[n] = '\0';
    close(pfd[0]);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, PROG ": fio failed (status %d):\n%s\n", st, out);
        return NAN;
    }
    /* Terse v3: terse_version;fio_version;jobname;groupid;error;read_kb;
     * read_bandwidth;read_iops;... - the line that starts with "3;". */
    for (char *line = out; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = '\0';
        if (!strncmp(line, "3;", 2)) {
            char *f = line;
            for (int i = 0; i < 7 && f; i++) {
                f = strchr(f, ';');
                if (f)
                    f++;
            }
            if (f) {
                char *end;
                double v = strtod(f, &end);
                if (end != f && (*end == ';' || *end == '\0'))
                    return v;
            }
        }
        line = nl ? nl + 1 : NULL;
    }
    fprintf(stderr, PROG ": cannot read fio's output:\n%s\n", out);
    return NAN;
}

/* ---- main --------------------------------------------------------------------------------- */

int bench_io_main(int argc, char **argv)
{
    io_opts o;
    io_parse_args(argc, argv, &o);
    double t_start = bench_now();
    if (!(kvt_build_features() & KVT_FEATURE_URING))
        io_die("this libkvtier was built without the io_uring disk tier", NULL);

    io_ctx c;
    memset(&c, 0, sizeof c);
    c.o = &o;
    c.L = o.file_gib * IO_LAYERS_PER_GIB;
    c.H = IO_KV_HEADS;
    c.P = IO_PAGES_PER_LH;
    c.n_pages = (uint64_t)c.L * c.H * c.P;
    c.rng = 0x10b0c5eedull;
    c.ref_fd = -1;

    /* The directory: a real disk with room for the file. */
    struct statfs sf;
    if (statfs(o.dir, &sf))
        io_die("cannot stat the directory (--dir)", o.dir);
    bool memfs = sf.f_type == TMPFS_MAGIC || sf.f_type == IO_RAMFS_MAGIC;
    struct statvfs sv;
    if (statvfs(o.dir, &sv))
        io_die("cannot stat the directory (--dir)", o.dir);

    kvt_pool_opts po;
    CHECK(kvt_pool_opts_init(&po));
    po.backend = KVT_BACKEND_CPU;
    po.geom.n_layers = c.L;
    po.geom.n_kv_heads = c.H;
    po.geom.n_q_heads = c.H;
    po.geom.head_dim = IO_HEAD_DIM;
    po.geom.page_tokens = IO_PAGE_TOKENS;
    po.geom.dtype = KVT_DTYPE_F16;
    CHECK(kvt_geometry_block_bytes(&po.geom, &c.page_bytes));
    c.file_bytes = c.n_pages * c.page_bytes;
    double avail = (double)sv.f_bavail * (double)sv.f_frsize;
    if (avail < (double)c.file_bytes + (512.0 * 1048576.0)) {
        fprintf(stderr, PROG ": %s has %.1f GiB free; the %u GiB file needs %.1f GiB (use --dir)\n",
                o.dir, avail / 1073741824.0, o.file_gib,
                (double)c.file_bytes / 1073741824.0 + 0.5);
        return 1;
    }
    /* The host tier is a small cache over the disk: a random page is in it
     * with probability host / file, and such pages are not picked. */
    uint64_t host = c.file_bytes / 16u < IO_HOST_BYTES ? c.file_bytes / 16u : IO_HOST_BYTES;
    po.device_bytes = IO_DEVICE_BYTES;
    po.host_bytes = host;
    po.disk_bytes = c.file_bytes;
    po.disk_dir = o.dir;
    po.max_seqs = 4;
    po.max_seq_tokens = c.P * IO_PAGE_TOKENS;
    po.n_threads = 1;
    kvt_mover_opts mo;
    CHECK(kvt_mover_opts_init(&mo));
    mo.flags = KVT_MOVER_KEEP_DISK_FILE; /* the reference and fio open it by path */
    mo.queue_depth = o.qd;
    mo.max_io_bytes = IO_MAX_IO_BYTES;
    po.mover = &mo;

    atexit(io_unlink_path);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = io_on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);

    fprintf(stderr, "io: %u layers x %u heads x %u pages of %llu bytes = %.2f GiB in %s\n", c.L,
            c.H, c.P, (unsigned long long)c.page_bytes, (double)c.file_bytes / 1073741824.0,
            o.dir);
    CHECK(kvt_pool_create(&po, &c.pool));
    size_t plen = 0;
    CHECK(kvt_pool_disk_path_get(c.pool, io_path, sizeof io_path, &plen));
    io_path_set = 1;
    CHECK(kvt_pool_mover_get(c.pool, &c.mover));
    kvt_stats ps = {.struct_size = sizeof ps};
    CHECK(kvt_pool_stats_get(c.pool, &ps));
    c.host_blocks = (uint32_t)ps.tier[KVT_TIER_HOST].blocks_total;
    kvt_mover_stats ms = {.struct_size = sizeof ms};
    CHECK(kvt_mover_stats_get(c.mover, &ms));
    if (ms.disk_file_bytes != c.file_bytes) {
        fprintf(stderr, PROG ": the disk file has %llu bytes, expected %llu\n",
                (unsigned long long)ms.disk_file_bytes, (unsigned long long)c.file_bytes);
        return 1;
    }
    if (memfs)
        io_warning("the disk file lies on tmpfs/ramfs (memory, not a disk); use --dir on a "
                   "real disk");
    if (ms.disk_direct != 1)
        io_warning("the disk file is not open with O_DIRECT (the filesystem refused it): "
                   "library reads may come from the page cache");
    if (ms.registered != 1)
        io_warning("the mover runs without registered buffers and file");

    c.ref_fd = open(io_path, O_RDONLY | O_CLOEXEC | (ms.disk_direct ? O_DIRECT : 0));
    if (c.ref_fd < 0)
        io_die("cannot open the disk file for the reference", strerror(errno));

    /* Prefill sources: random f16, stamped per chunk (io_stamp). */
    size_t n_elem = (size_t)IO_CHUNK_TOKENS * c.H * IO_HEAD_DIM;
    c.k = bench_xmalloc(n_elem * sizeof *c.k);
    c.v = bench_xmalloc(n_elem * sizeof *c.v);
    uint64_t s = 0x5eedf00dull;
    for (size_t i = 0; i < n_elem; i++) {
        c.k[i] = io_rand_f16(io_rng(&s));
        c.v[i] = io_rand_f16(io_rng(&s));
    }
    c.busy = calloc(c.n_pages, 1);
    if (!c.busy)
        io_die("out of memory", NULL);
    CHECK(kvt_seq_create(c.pool, NULL, &c.seq));
    double fill_s = io_fill(&c);
    fprintf(stderr, "\r  fill: %.1f s (%.2f GB/s device -> disk)\n", fill_s,
            (double)c.file_bytes / fill_s / 1e9);
    kvt_seq_info si = {.struct_size = sizeof si};
    CHECK(kvt_seq_info_get(c.pool, c.seq, &si));
    if (si.pages_in_tier[KVT_TIER_DISK] != c.n_pages || si.pages_in_tier[KVT_TIER_DEVICE] ||
        si.pages_in_tier[KVT_TIER_HOST]) {
        fprintf(stderr, PROG ": after the fill %llu pages are on disk (expected %llu), %llu on "
                "device, %llu in host\n", (unsigned long long)si.pages_in_tier[KVT_TIER_DISK],
                (unsigned long long)c.n_pages,
                (unsigned long long)si.pages_in_tier[KVT_TIER_DEVICE],
                (unsigned long long)si.pages_in_tier[KVT_TIER_HOST]);
        return 1;
    }
    CHECK(kvt_mover_stats_get(c.mover, &ms));
    printf("{\"setup\":\"io\"");
    io_json_str("dir", o.dir);
    printf(",\"tmpfs\":%s,\"file_bytes\":%llu,\"page_bytes\":%llu,\"layers\":%u,"
           "\"kv_heads\":%u,\"pages\":%llu,\"host_bytes\":%llu,\"queue_depth\":%u,"
           "\"max_io_bytes\":%u,\"disk_direct\":%u,\"registered\":%u",
           memfs ? "true" : "false", (unsigned long long)c.file_bytes,
           (unsigned long long)c.page_bytes, c.L, c.H, (unsigned long long)c.n_pages,
           (unsigned long long)host, o.qd, IO_MAX_IO_BYTES, ms.disk_direct, ms.registered);
    io_json_real("fill_s", fill_s, 2);
    io_json_real("fill_gbps", (double)c.file_bytes / fill_s / 1e9, 3);
    printf("}\n");
    fflush(stdout);

    /* The cases: reference and library passes alternate. */
    double ratio[IO_N_CASES], lib_cpu[IO_N_CASES], ref_cpu[IO_N_CASES];
    double lib_iops[IO_N_CASES], ref_iops[IO_N_CASES];
    io_pass *lp = bench_xmalloc(o.reps * sizeof *lp), *rp = bench_xmalloc(o.reps * sizeof *rp);
    for (size_t ci = 0; ci < IO_N_CASES; ci++) {
        ratio[ci] = lib_cpu[ci] = ref_cpu[ci] = lib_iops[ci] = ref_iops[ci] = NAN;
        if (!(o.cases & (1u << ci)))
            continue;
        const io_case *k = &io_cases[ci];
        const uint32_t bs = k->run * (uint32_t)c.page_bytes;
        for (uint32_t r = 0; r < o.reps; r++) {
            io_ref_pass(&c, k, &rp[r]);
            io_lib_pass(&c, k, &lp[r]);
            fprintf(stderr, "  %-7s rep %u: ref %8.0f IOPS %6.3f GB/s | lib %8.0f IOPS %6.3f GB/s "
                    "(%.2f)\n", k->name, r + 1, rp[r].bytes / rp[r].secs / bs,
                    rp[r].bytes / rp[r].secs / 1e9, lp[r].bytes / lp[r].secs / bs,
                    lp[r].bytes / lp[r].secs / 1e9,
                    (lp[r].bytes / lp[r].secs) / (rp[r].bytes / rp[r].secs));
        }
        io_row rr = io_summarise(&c, rp, o.reps, bs), lr = io_summarise(&c, lp, o.reps, bs);
        ratio[ci] = lr.bps / rr.bps;
        lib_cpu[ci] = lr.cpu_us;
        ref_cpu[ci] = rr.cpu_us;
        lib_iops[ci] = lr.iops;
        ref_iops[ci] = rr.iops;
        io_emit("ref", k, bs, &c, &rr, 1.0);
        io_emit("lib", k, bs, &c, &lr, ratio[ci]);
    }
    free(lp);
    free(rp);

    /* Every read was CRC-checked by the mover; a sample is also compared
     * with the appended bytes, and the pool's invariants are walked. */
    uint32_t from_host = 0;
    uint32_t bad = io_verify(&c, &from_host);
    CHECK(kvt_pool_check(c.pool));
    CHECK(kvt_mover_stats_get(c.mover, &ms));

    char cmd[8192];
    bool have_fio = io_in_path("fio");
    double fio_iops = NAN;
    if (o.fio && have_fio)
        fprintf(stderr, "  fio randread %u KiB, qd %u, %.0f s\n",
                (unsigned)(c.page_bytes / 1024u), o.qd, ceil(o.seconds));
    bool run_fio = o.fio && have_fio;
    char fio_file[4200];
    snprintf(fio_file, sizeof fio_file, "%s/kvtier-fio.dat", o.dir);
    fio_iops = io_fio(run_fio ? io_path : fio_file, run_fio ? 0 : o.file_gib,
                      (uint32_t)c.page_bytes, o.qd, o.seconds, run_fio, cmd, sizeof cmd);

    /* The targets: >= 0.9 of the reference in every case (null: not all ran). */
    const char *met = "true";
    for (size_t ci = 0; ci < IO_N_CASES; ci++)
        if (!isfinite(ratio[ci]))
            met = "null";
        else if (ratio[ci] < 0.9 && strcmp(met, "null"))
            met = "false";
    char what[160];
    snprintf(what, sizeof what, "io: %u GiB file, %llu KiB pages, qd %u, %.1f s x %u reps",
             o.file_gib, (unsigned long long)(c.page_bytes / 1024u), o.qd, o.seconds, o.reps);
    printf("{\"summary\":\"%s\"", what);
    if (o.qd == 64 && c.page_bytes == 8192)
        io_json_real("rand_8k_qd64_ratio", ratio[0], 4);
    else
        printf(",\"rand_8k_qd64_ratio\":null");
    io_json_real("rand_1_ratio", ratio[0], 4);
    io_json_real("run4_ratio", ratio[1], 4);
    io_json_real("run8_ratio", ratio[2], 4);
    io_json_real("run16_ratio", ratio[3], 4);
    io_json_real("seq_ratio", ratio[4], 4);
    io_json_real("lib_rand_iops", lib_iops[0], 0);
    io_json_real("ref_rand_iops", ref_iops[0], 0);
    io_json_real("fio_rand_iops", fio_iops, 0);
    io_json_real("cpu_us_per_page_rand", lib_cpu[0], 3);
    io_json_real("ref_cpu_us_per_page_rand", ref_cpu[0], 3);
    io_json_real("cpu_us_per_page_seq", lib_cpu[4], 3);
    io_json_real("ref_cpu_us_per_page_seq", ref_cpu[4], 3);
    printf(",\"disk_direct\":%u,\"checksum_errors\":%llu,\"io_errors\":%llu,\"retries\":%llu,"
           "\"short_io\":%llu,\"evictions\":%llu,\"verified_pages\":%u,\"verified_from_host\":%u,"
           "\"verify_mismatches\":%u,\"targets_met\":%s",
           ms.disk_direct, (unsigned long long)ms.checksum_errors,
           (unsigned long long)ms.io_errors, (unsigned long long)ms.retries,
           (unsigned long long)ms.short_io, (unsigned long long)ms.evictions, IO_VERIFY_PAGES,
           from_host, bad, met);
    io_json_str("fio_command", cmd);
    printf("}\n");
    fflush(stdout);

    if (isfinite(fio_iops))
        fprintf(stderr, "note: fio (%s) read %.0f IOPS; the reference %.0f, the library %.0f\n",
                cmd, fio_iops, ref_iops[0], lib_iops[0]);
    else
        fprintf(stderr, "note: %s; for fio's figure with the same settings run: %s\n",
                !have_fio ? "fio is not installed" : o.fio ? "fio failed" : "fio was not run (--no-fio)",
                cmd);

    close(c.ref_fd);
    kvt_pool_destroy(c.pool);
    io_unlink_path();
    free(c.k);
    free(c.v);
    free(c.busy);
    fprintf(stderr, "total: %.1f s\n", bench_now() - t_start);
    return ms.checksum_errors || ms.io_errors || bad ? 1 : 0;
}
