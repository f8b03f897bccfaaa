/* The remote tier (issue 26): prefixes shared through Redis by pools in
 * other processes, against independent references:
 *
 * - the rows of a token prefix are a pure function of the prefix
 *   (tests/prefixtest.c), so every row a sequence landed from Redis reads
 *   back equal to the rows of its ids, bit for bit, and dense steps over
 *   them equal double-precision attention;
 * - what lands against what the writer keyed: the longest run of whole
 *   pages of the prompt under the same fingerprint and salt, past the
 *   local match;
 * - the store is inspected and damaged with plain Redis commands (the test
 *   finds a page's key by reading the value headers the server holds, not
 *   by the library's naming);
 * - every fault (no server, a killed node, CLIENT PAUSE past the timeout,
 *   a wrong password, garbage, a value of another page, a flipped byte,
 *   FLUSHALL under a reader, a slot resharded under a reader) is a miss:
 *   the request goes on with what landed, rows exact, kvt_pool_check
 *   clean, faults counted.
 * The servers are this test's children (tests/redistest.c): a single node
 * on a unix socket, a node with a password and an ACL user, and a
 * three-master cluster on loopback ports. Exit 77 without redis-server;
 * in a build without hiredis only the KVT_ENOTSUP contract is checked. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "prefixtest.h"

#define FP "stories-test-fingerprint"

static kvt_remote_opts ropts(const char *endpoints);

#if KVT_TEST_EXPECT_REDIS
#include "redistest.h"

static rsrv one; /* the single node of most tests */

/* ---- the log callback ---- */
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char log_buf[16384];
static unsigned log_lines;

static void log_cb(void *ctx, const char *msg)
{
    (void)ctx;
    pthread_mutex_lock(&log_mu);
    log_lines++;
    size_t n = strlen(log_buf);
    if (n + strlen(msg) + 2 < sizeof log_buf) {
        strcat(log_buf, msg);
        strcat(log_buf, "\n");
    }
    pthread_mutex_unlock(&log_mu);
}

static bool log_has(const char *needle)
{
    pthread_mutex_lock(&log_mu);
    bool r = strstr(log_buf, needle) != NULL;
    pthread_mutex_unlock(&log_mu);
    return r;
}

static void log_reset(void)
{
    pthread_mutex_lock(&log_mu);
    log_buf[0] = 0;
    log_lines = 0;
    pthread_mutex_unlock(&log_mu);
}
#endif

static kvt_remote_opts ropts(const char *endpoints)
{
    kvt_remote_opts r;
    kvt_remote_opts_init(&r);
    r.endpoints = endpoints;
    r.fingerprint = FP;
    r.connect_timeout_ms = 500;
    r.io_timeout_ms = 500;
    r.retry_ms = 100;
#if KVT_TEST_EXPECT_REDIS
    r.log = log_cb;
#endif
    return r;
}

#if KVT_TEST_EXPECT_REDIS
static kvt_pool *rpool(const kvt_remote_opts *r, uint32_t dev, uint32_t host)
{
    kvt_pool_opts o = cache_opts(dev, host);
    o.remote = r;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    return p;
}
#endif

/* Bad options: each field named; nothing created. */
static void test_opts_errors(void **state)
{
    (void)state;
    kvt_remote_opts r = ropts("unix:/nonexistent/kvt.sock");
    kvt_pool_opts o = cache_opts(64, 0);
    o.remote = &r;
    kvt_pool *p = NULL;
    o.flags &= ~KVT_POOL_PREFIX_CACHE;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "KVT_POOL_PREFIX_CACHE");
    o.flags |= KVT_POOL_PREFIX_CACHE;
    r.fingerprint = "";
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "opts->remote->fingerprint");
    r.fingerprint = NULL;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "opts->remote->fingerprint");
    r = ropts(NULL);
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "opts->remote->endpoints");
    r = ropts("unix:/x");
    r.flags = 1u << 7;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "opts->remote->flags");
    r.flags = 0;
    r.n_connections = 65;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "opts->remote->n_connections");
    r.n_connections = 0;
    r.pipeline = 5000;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "opts->remote->pipeline");
    r.pipeline = 0;
    r.struct_size = 8;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "opts->remote");
    assert_null(p);
    /* NULL arguments and unknown ids of the remote calls. */
    TU_EXPECT_ERR(kvt_remote_opts_init(NULL), KVT_EINVAL, "opts");
    TU_EXPECT_ERR(kvt_remote_flush(NULL, 0), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_prefix_wait(NULL, 1, 0, NULL), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_remote_push(NULL, 1, NULL), KVT_EINVAL, "pool");
    {
        kvt_pool_opts lo = cache_opts(64, 0);
        kvt_pool *lp;
        TU_OK(kvt_pool_create(&lo, &lp));
        kvt_seq_id sid;
        TU_OK(kvt_seq_create(lp, NULL, &sid));
        uint32_t have = 7;
        TU_OK(kvt_seq_prefix_wait(lp, sid, 0, &have)); /* not loading: at once */
        assert_int_equal(have, 0);
        TU_OK(kvt_seq_release(lp, sid));
        assert_int_equal(kvt_seq_prefix_wait(lp, sid, 0, &have), KVT_ENOENT);
        kvt_pool_destroy(lp);
    }
#if KVT_TEST_EXPECT_REDIS
    const char *bad[] = {"redis://", "redis://host:0", "redis://host:70000", "redis://u:p@h:1",
                         "unix:", "host:12x", ","};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        r = ropts(bad[i]);
        TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "remote->endpoints");
    }
    r = ropts("unix:/x");
    r.user = "kvt";
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "remote->user");
    r = ropts("unix:/x");
    r.key_prefix = "a b";
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "remote->key_prefix");
    r.key_prefix = "{tag}";
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "remote->key_prefix");
    assert_null(p);
    /* No server answering is not an error: the tier retries later. */
    r = ropts("unix:/nonexistent/kvt.sock,redis://127.0.0.1:1");
    TU_OK(kvt_pool_create(&o, &p));
    TU_OK(kvt_remote_flush(p, 1000));
    kvt_pool_destroy(p);
#else
    r = ropts("unix:/x");
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_ENOTSUP, "hiredis");
    o.remote = NULL;
    TU_OK(kvt_pool_create(&o, &p));
    TU_EXPECT_ERR(kvt_remote_flush(p, 10), KVT_ENOTSUP, "remote");
    kvt_pool_destroy(p);
#endif
}

#if KVT_TEST_EXPECT_REDIS
/* ---- helpers ---- */
static double tu_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void nap_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static kvt_stats stats_of(const kvt_pool *p)
{
    kvt_stats s = {.struct_size = sizeof s};
    TU_OK(kvt_pool_stats_get(p, &s));
    return s;
}

/* A prompt: n ids from seed. */
static void prompt(conv *c, uint64_t salt, uint32_t n, uint32_t seed)
{
    memset(c, 0, sizeof *c);
    c->salt = salt;
    tu_rng r = {0x9e3779b97f4a7c15ull ^ ((uint64_t)seed * 0x2545F4914F6CDD1Dull)};
    rand_ids(c->ids, n, &r);
}

/* Writes c's first n tokens in pool p (a new sequence), then flushes. */
static void write_conv(kvt_pool *p, conv *c, uint32_t n)
{
    kvt_seq_opts so;
    kvt_seq_opts_init(&so);
    so.salt = c->salt;
    TU_OK(kvt_seq_create(p, &so, &c->id));
    c->live = true;
    c->n = 0;
    conv_append(p, c, n);
    TU_OK(kvt_remote_flush(p, 10000));
    TU_CHECK(p);
}

/* Creates c with prefix ids[0..n_prefix) and lands its remote pages; checks
 * the sequence's state before and after; returns prefix_tokens. */
static uint32_t read_conv(kvt_pool *p, conv *c, uint32_t n_prefix)
{
    kvt_seq_opts so;
    kvt_seq_opts_init(&so);
    so.salt = c->salt;
    so.prefix = c->ids;
    so.n_prefix = n_prefix;
    TU_OK(kvt_seq_create(p, &so, &c->id));
    c->live = true;
    kvt_seq_info si = {.struct_size = sizeof si};
    TU_OK(kvt_seq_info_get(p, c->id, &si));
    if (si.remote_loading) { /* nothing may change the sequence until it lands */
        uint16_t row[H * D] = {0};
        assert_int_equal(kvt_seq_append(p, c->id, 0, row, row, 1, KVT_DTYPE_F16, 0), KVT_EAGAIN);
        assert_int_equal(kvt_seq_truncate(p, c->id, 0), KVT_EAGAIN);
        kvt_seq_id f;
        assert_int_equal(kvt_seq_fork(p, c->id, NULL, &f), KVT_EAGAIN);
        kvt_step *st;
        kvt_step_opts sto;
        TU_OK(kvt_step_opts_init(&sto));
        sto.flags = KVT_STEP_DENSE;
        assert_int_equal(kvt_step_plan(p, &c->id, 1, &sto, &st), KVT_EAGAIN);
        assert_non_null(strstr(kvt_last_error(), "kvt_seq_prefix_wait"));
    }
    uint32_t got = 0;
    TU_OK(kvt_seq_prefix_wait(p, c->id, UINT32_MAX, &got));
    TU_OK(kvt_seq_info_get(p, c->id, &si));
    assert_int_equal(si.remote_loading, 0);
    assert_int_equal(si.prefix_tokens, got);
    assert_int_equal(si.n_tokens, got);
    assert_int_equal(si.token_ids, n_prefix);
    assert_int_equal(got % P, 0);
    c->n = got;
    TU_CHECK(p);
    conv_verify(p, c);
    return got;
}

/* The key of the value of (salt, page) on server s: found by reading the
 * headers of the values the server holds (page at byte 40, salt at 48). */
static bool key_of_page(const rsrv *s, uint64_t salt, uint32_t page, char *key, size_t len)
{
    redisContext *c = rsrv_conn(s, NULL);
    redisReply *ks = redisCommand(c, "KEYS *");
    bool found = false;
    for (size_t i = 0; ks && i < ks->elements && !found; i++) {
        redisReply *v = redisCommand(c, "GETRANGE %s 40 55", ks->element[i]->str);
        uint32_t pg;
        uint64_t sl;
        if (v && v->type == REDIS_REPLY_STRING && v->len == 16) {
            memcpy(&pg, v->str, 4);
            memcpy(&sl, v->str + 8, 8);
            if (pg == page && sl == salt) {
                snprintf(key, len, "%s", ks->element[i]->str);
                found = true;
            }
        }
        if (v)
            freeReplyObject(v);
    }
    if (ks)
        freeReplyObject(ks);
    redisFree(c);
    return found;
}

static long long dbsize(const rsrv *s)
{
    redisContext *c = rsrv_conn(s, NULL);
    redisReply *r = redisCommand(c, "DBSIZE");
    long long n = r && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    if (r)
        freeReplyObject(r);
    redisFree(c);
    return n;
}

/* One dense step of 3 tokens against double-precision attention. */
static void step_conv(kvt_pool *p, conv *c, uint32_t seed)
{
    tu_rng r = {0x9e3779b97f4a7c15ull ^ ((uint64_t)seed * 0x2545F4914F6CDD1Dull)};
    conv *cs[1] = {c};
    const uint32_t nn[1] = {3};
    conv_step(p, cs, 1, nn, &r);
    TU_CHECK(p);
}

/* ---- tests ---- */

/* Two pools (one writes, one reads) share a prefix: exact rows, dense
 * steps, stats; other fingerprints, salts and divergent prompts. */
static void test_share(void **state)
{
    (void)state;
    rsrv_cmd(&one, NULL, "FLUSHALL");
    kvt_remote_opts r = ropts(one.endpoint);
    kvt_pool *a = rpool(&r, 256, 0), *b = rpool(&r, 256, 0);
    conv w, x;
    prompt(&w, SALT_A, 10 * P + 5, 1);
    write_conv(a, &w, 10 * P + 5);
    kvt_stats sa = stats_of(a);
    assert_int_equal(sa.remote_put_values, 10); /* one value per keyed page position */
    assert_int_equal(sa.remote_put_bytes, 10 * (96 + 4 * P + NLH * 2 * P * D * 2 + 4));
    assert_int_equal(sa.remote_put_dropped, 0);
    assert_int_equal(dbsize(&one), 10);

    /* The same prompt in b: every whole page lands. */
    prompt(&x, SALT_A, 10 * P + 5, 1);
    assert_int_equal(read_conv(b, &x, 10 * P + 5), 10 * P);
    kvt_seq_info si = {.struct_size = sizeof si};
    TU_OK(kvt_seq_info_get(b, x.id, &si));
    assert_int_equal(si.remote_tokens, 10 * P);
    kvt_stats sb = stats_of(b);
    assert_int_equal(sb.remote_fetches, 1);
    assert_int_equal(sb.remote_hit_values, 10);
    assert_int_equal(sb.remote_miss_values, 0);
    assert_int_equal(sb.remote_errors + sb.remote_corrupt, 0);
    assert_int_equal(sb.prefix_hit_tokens, 10 * P);
    TU_OK(kvt_remote_flush(b, 10000));
    assert_int_equal(stats_of(b).remote_put_values, 0); /* landed pages are not written back */
    step_conv(b, &x, 7);
    conv_release(b, &x);

    /* Local first, then the remote tier: a new pool holds 4 pages of its
     * own (b's cache has all 10 now). */
    kvt_pool *b2 = rpool(&r, 256, 0);
    conv y;
    prompt(&y, SALT_A, 10 * P, 1);
    kvt_seq_opts so;
    kvt_seq_opts_init(&so);
    so.salt = SALT_A;
    TU_OK(kvt_seq_create(b2, &so, &y.id));
    y.live = true;
    conv_append(b2, &y, 4 * P); /* (written again: the same values) */
    conv z;
    prompt(&z, SALT_A, 10 * P + 5, 1);
    assert_int_equal(read_conv(b2, &z, 10 * P + 5), 10 * P);
    TU_OK(kvt_seq_info_get(b2, z.id, &si));
    assert_int_equal(si.remote_tokens, 6 * P);
    assert_int_equal(stats_of(b2).remote_hit_values, 6);
    step_conv(b2, &z, 5);
    conv_release(b2, &z);
    conv_release(b2, &y);
    kvt_pool_destroy(b2);

    /* A prompt that leaves the written one at page 6: 6 pages land. */
    conv d;
    prompt(&d, SALT_A, 9 * P, 1);
    d.ids[6 * P + 3] ^= 1u;
    assert_int_equal(read_conv(b, &d, 9 * P), 6 * P);
    conv_release(b, &d);
    /* Another salt, another fingerprint: nothing. */
    conv e;
    prompt(&e, SALT_B, 10 * P, 1);
    assert_int_equal(read_conv(b, &e, 10 * P), 0);
    conv_release(b, &e);
    kvt_remote_opts r2 = ropts(one.endpoint);
    r2.fingerprint = FP "-other";
    kvt_pool *c = rpool(&r2, 256, 0);
    prompt(&e, SALT_A, 10 * P, 1);
    assert_int_equal(read_conv(c, &e, 10 * P), 0);
    assert_int_equal(stats_of(c).remote_miss_values, 10);
    kvt_pool_destroy(c);
    conv_release(a, &w);
    kvt_pool_destroy(a);
    kvt_pool_destroy(b);
}

/* KVT_REMOTE_NO_PUT: nothing is written behind; kvt_seq_remote_push writes
 * a chosen sequence (every keyed page, the landed ones too), which another
 * pool then lands whole. Its errors. */
static void test_push(void **state)
{
    (void)state;
    rsrv_cmd(&one, NULL, "FLUSHALL");
    kvt_remote_opts r = ropts(one.endpoint);
    r.flags = KVT_REMOTE_NO_PUT;
    kvt_pool *a = rpool(&r, 256, 0);
    conv w, x;
    prompt(&w, SALT_A, 7 * P + 9, 12);
    write_conv(a, &w, 7 * P + 9);
    assert_int_equal(stats_of(a).remote_put_values, 0);
    assert_int_equal(dbsize(&one), 0);
    uint32_t n = 99;
    TU_OK(kvt_seq_remote_push(a, w.id, &n));
    assert_int_equal(n, 7);
    TU_OK(kvt_remote_flush(a, 10000));
    assert_int_equal(stats_of(a).remote_put_values, 7);
    assert_int_equal(dbsize(&one), 7);
    kvt_pool *b = rpool(&r, 256, 0); /* NO_PUT reads all the same */
    prompt(&x, SALT_A, 7 * P + 9, 12);
    assert_int_equal(read_conv(b, &x, 7 * P + 9), 7 * P);
    TU_OK(kvt_seq_remote_push(b, x.id, &n)); /* landed pages go again on request */
    assert_int_equal(n, 7);
    conv_release(b, &x);
    /* Errors: a released id, a pool without the tier, a loading sequence. */
    assert_int_equal(kvt_seq_remote_push(b, x.id, &n), KVT_ENOENT);
    assert_int_equal(n, 0);
    kvt_pool_opts o = cache_opts(64, 0);
    kvt_pool *c;
    TU_OK(kvt_pool_create(&o, &c));
    kvt_seq_id sid;
    TU_OK(kvt_seq_create(c, NULL, &sid));
    TU_EXPECT_ERR(kvt_seq_remote_push(c, sid, NULL), KVT_ENOTSUP, "remote");
    TU_EXPECT_ERR(kvt_seq_remote_push(NULL, sid, NULL), KVT_EINVAL, "pool");
    kvt_pool_destroy(c);
    rsrv_cmd(&one, NULL, "CLIENT PAUSE 1000 ALL"); /* keeps the next fetch in flight */
    kvt_seq_opts so;
    kvt_seq_opts_init(&so);
    so.salt = SALT_A;
    so.prefix = x.ids;
    so.n_prefix = 7 * P;
    TU_OK(kvt_prefix_drop_all(b, NULL));
    TU_OK(kvt_seq_create(b, &so, &x.id));
    assert_int_equal(kvt_seq_remote_push(b, x.id, NULL), KVT_EAGAIN);
    TU_OK(kvt_seq_release(b, x.id)); /* a loading sequence can go: its fetch is cancelled */
    TU_CHECK(b);
    kvt_pool_destroy(b);
    conv_release(a, &w);
    kvt_pool_destroy(a);
    nap_ms(1000);
}

/* A reader whose device tier holds 5 pages in every layer and head lands
 * 5 of 10 (in a chunk cut to the room), keeps them exact, reports no
 * error, and counts the other 5 as misses. */
static void test_land_room(void **state)
{
    (void)state;
    rsrv_cmd(&one, NULL, "FLUSHALL");
    kvt_remote_opts r = ropts(one.endpoint);
    kvt_pool *a = rpool(&r, 256, 0), *b = rpool(&r, 5 * NLH + 1, 0);
    conv w, x;
    prompt(&w, SALT_A, 10 * P, 16);
    write_conv(a, &w, 10 * P);
    prompt(&x, SALT_A, 10 * P, 16);
    log_reset();
    assert_int_equal(read_conv(b, &x, 10 * P), 5 * P);
    assert_int_equal(stats_of(b).remote_hit_values, 5);
    assert_int_equal(stats_of(b).remote_miss_values, 5);
    assert_true(log_has("5 of 10 values landed"));
    conv_release(b, &x);
    conv_release(a, &w);
    kvt_pool_destroy(a);
    kvt_pool_destroy(b);
}

/* ---- a fake node: not Redis, a script of replies ---- */
/* Answers each command with what fake_reply says, on a unix socket or a
 * loopback port, one connection at a time, until stopped. */
typedef struct {
    int lfd, port;
    _Atomic int stop;
    char path[160];
    pthread_t th;
    _Atomic int mode; /* 0: GET -> MOVED to `to`; 1: GET -> a value's header, 100 bytes,
                         close; 2: GET -> "$2000000000" then close */
    int to;        /* MOVED's port */
    size_t value;  /* a value's bytes */
    _Atomic int gets;
} fake_node;

static void fake_send(int fd, const char *s)
{
    if (send(fd, s, strlen(s), MSG_NOSIGNAL) < 0) { /* (a client gone: no SIGPIPE) */
    }
}

/* Reads one RESP command (an array of bulk strings) into cmd (first word). */
static int fake_cmd(int fd, char *cmd, size_t cap)
{
    char line[256];
    size_t n = 0;
    int args = -1, got = 0;
    cmd[0] = 0;
    for (;;) {
        char ch;
        if (read(fd, &ch, 1) != 1)
            return -1;
        if (n + 1 < sizeof line)
            line[n++] = ch;
        if (ch != '\n')
            continue;
        line[n] = 0;
        n = 0;
        if (line[0] == '*') {
            args = atoi(line + 1);
        } else if (line[0] == '$') {
            const int len = atoi(line + 1);
            char *arg = malloc((size_t)len + 2);
            size_t have = 0;
            while (have < (size_t)len + 2) {
                const ssize_t k = read(fd, arg + have, (size_t)len + 2 - have);
                if (k <= 0) {
                    free(arg);
                    return -1;
                }
                have += (size_t)k;
            }
            if (got == 0)
                snprintf(cmd, cap, "%.*s", len < 64 ? len : 64, arg);
            free(arg);
            if (++got == args)
                return 0;
        }
    }
}

static void *fake_main(void *arg)
{
    fake_node *f = arg;
    while (!f->stop) {
        const int fd = accept(f->lfd, NULL, NULL);
        if (fd < 0)
            continue;
        char cmd[80];
        while (!f->stop && fake_cmd(fd, cmd, sizeof cmd) == 0) {
            if (!strcasecmp(cmd, "CLUSTER")) {
                fake_send(fd, "-ERR This instance has cluster support disabled\r\n");
            } else if (!strcasecmp(cmd, "GET")) {
                f->gets++;
                char b[96];
                if (f->mode == 0) {
                    snprintf(b, sizeof b, "-MOVED 1234 127.0.0.1:%d\r\n", f->to);
                    fake_send(fd, b);
                } else if (f->mode == 1) {
                    snprintf(b, sizeof b, "$%zu\r\n", f->value);
                    fake_send(fd, b);
                    char junk[100] = {0};
                    if (send(fd, junk, sizeof junk, MSG_NOSIGNAL) < 0) {
                    }
                    break; /* closed mid-value */
                } else {
                    fake_send(fd, "$2000000000\r\nshort");
                    break;
                }
            } else {
                fake_send(fd, "+OK\r\n");
            }
        }
        close(fd);
    }
    return NULL;
}

static void fake_start(fake_node *f, const char *name, int port)
{
    f->stop = 0;
    f->port = port;
    if (port) {
        f->lfd = socket(AF_INET, SOCK_STREAM, 0);
        const int one_ = 1;
        setsockopt(f->lfd, SOL_SOCKET, SO_REUSEADDR, &one_, sizeof one_);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        assert_int_equal(bind(f->lfd, (struct sockaddr *)&a, sizeof a), 0);
    } else {
        snprintf(f->path, sizeof f->path, "%s/%s.sock", rsrv_dir(), name);
        unlink(f->path);
        f->lfd = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        const size_t pl = strlen(f->path);
        assert_true(pl < sizeof a.sun_path);
        memcpy(a.sun_path, f->path, pl + 1);
        assert_int_equal(bind(f->lfd, (struct sockaddr *)&a, sizeof a), 0);
    }
    assert_int_equal(listen(f->lfd, 8), 0);
    assert_int_equal(pthread_create(&f->th, NULL, fake_main, f), 0);
}

static void fake_stop(fake_node *f)
{
    f->stop = 1;
    shutdown(f->lfd, SHUT_RDWR);
    close(f->lfd);
    pthread_join(f->th, NULL);
}

/* Broken and hostile replies are misses, the pool stays sound, and the
 * tier's buffers are not handed out twice: a MOVED to a node that closes
 * mid-value, and a node announcing a 2 GB value; the value buffers are
 * capped at one (queue_bytes 1), so a buffer given back twice would be
 * freed while listed and reused (AddressSanitizer's use after free). */
static void test_broken_replies(void **state)
{
    (void)state;
    const int port = 24000 + (int)(getpid() % 3000);
    fake_node a = {.mode = 0, .to = port}, b = {.mode = 1};
    kvt_remote_opts r = ropts("");
    r.queue_bytes = 1;
    r.retry_ms = 1; /* (the broken nodes are tried again at once) */
    kvt_pool_opts o = cache_opts(512, 0);
    b.value = 96 + 4 * P + NLH * 2 * P * D * 2 + 4;
    fake_start(&b, NULL, port);
    fake_start(&a, "fake-a", 0);
    char ep[200];
    snprintf(ep, sizeof ep, "unix:%s", a.path);
    r.endpoints = ep;
    o.remote = &r;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    for (int round = 0; round < 3; round++) {
        conv x;
        prompt(&x, SALT_A, 6 * P, 14);
        assert_int_equal(read_conv(p, &x, 6 * P), 0); /* MOVED, then a cut value */
        conv_append(p, &x, 6 * P);
        conv_verify(p, &x);
        conv_release(p, &x);
        TU_OK(kvt_prefix_drop_all(p, NULL));
    }
    assert_true(stats_of(p).remote_errors >= 1);
    assert_true(stats_of(p).remote_redirects >= 1);
    assert_true(b.gets >= 1);
    b.mode = 2; /* now a 2 GB value, cut short */
    for (int round = 0; round < 2; round++) {
        conv x;
        prompt(&x, SALT_A, 6 * P, 15);
        assert_int_equal(read_conv(p, &x, 6 * P), 0);
        conv_release(p, &x);
    }
    TU_CHECK(p);
    kvt_pool_destroy(p);
    fake_stop(&a);
    fake_stop(&b);
}

/* Values that fail their checks are misses: garbage, another page's value
 * under this page's key, a flipped byte. The landing stops before them. */
static void test_damaged_values(void **state)
{
    (void)state;
    kvt_remote_opts r = ropts(one.endpoint);
    for (int kind = 0; kind < 3; kind++) {
        rsrv_cmd(&one, NULL, "FLUSHALL");
        kvt_pool *a = rpool(&r, 256, 0), *b = rpool(&r, 256, 0);
        conv w, x;
        prompt(&w, SALT_A, 8 * P, 2);
        write_conv(a, &w, 8 * P);
        char k3[200], k5[200];
        assert_true(key_of_page(&one, SALT_A, 3, k3, sizeof k3));
        assert_true(key_of_page(&one, SALT_A, 5, k5, sizeof k5));
        if (kind == 0) {
            rsrv_cmd(&one, NULL, "SET %s garbage", k3);
        } else if (kind == 1) { /* a valid value of page 5 under page 3's key */
            redisContext *cc = rsrv_conn(&one, NULL);
            redisReply *v = redisCommand(cc, "GET %s", k5);
            assert_true(v && v->type == REDIS_REPLY_STRING);
            redisReply *s = redisCommand(cc, "SET %s %b", k3, v->str, v->len);
            assert_true(s && s->type == REDIS_REPLY_STATUS);
            freeReplyObject(s);
            freeReplyObject(v);
            redisFree(cc);
        } else { /* one byte of page 3's rows */
            rsrv_cmd(&one, NULL, "SETRANGE %s 1000 X", k3);
        }
        log_reset();
        prompt(&x, SALT_A, 8 * P, 2);
        assert_int_equal(read_conv(b, &x, 8 * P), 3 * P);
        kvt_stats sb = stats_of(b);
        assert_true(sb.remote_corrupt >= 1);
        assert_int_equal(sb.remote_hit_values, 3);
        assert_int_equal(sb.remote_miss_values, 5);
        assert_true(log_has("rejected"));
        /* The request goes on: the engine prefills the rest. */
        conv_append(b, &x, 5 * P);
        conv_verify(b, &x);
        step_conv(b, &x, 11);
        conv_release(b, &x);
        conv_release(a, &w);
        kvt_pool_destroy(a);
        kvt_pool_destroy(b);
    }
}

/* FLUSHALL before a reader: all misses; and under one (while its fetch is
 * in flight): whatever landed is exact. */
static void test_flushall(void **state)
{
    (void)state;
    rsrv_cmd(&one, NULL, "FLUSHALL");
    kvt_remote_opts r = ropts(one.endpoint);
    r.pipeline = 2;
    r.n_connections = 1;
    kvt_pool *a = rpool(&r, 4096, 0), *b = rpool(&r, 4096, 0);
    conv w, x;
    prompt(&w, SALT_A, 200 * P, 3);
    write_conv(a, &w, 200 * P);
    assert_int_equal(dbsize(&one), 200);
    rsrv_cmd(&one, NULL, "FLUSHALL");
    prompt(&x, SALT_A, 200 * P, 3);
    assert_int_equal(read_conv(b, &x, 200 * P), 0);
    assert_int_equal(stats_of(b).remote_miss_values, 200);
    conv_release(b, &x);
    /* Written again, then flushed while b reads. */
    conv_release(a, &w);
    kvt_pool_destroy(a);
    a = rpool(&r, 4096, 0);
    write_conv(a, &w, 200 * P);
    kvt_seq_opts so;
    kvt_seq_opts_init(&so);
    so.salt = SALT_A;
    so.prefix = x.ids;
    so.n_prefix = 200 * P;
    TU_OK(kvt_seq_create(b, &so, &x.id));
    rsrv_cmd(&one, NULL, "FLUSHALL");
    uint32_t got = 0;
    TU_OK(kvt_seq_prefix_wait(b, x.id, UINT32_MAX, &got));
    x.n = got;
    assert_true(got <= 200 * P);
    TU_CHECK(b);
    conv_verify(b, &x);
    conv_append(b, &x, 200 * P - got);
    conv_verify(b, &x);
    conv_release(b, &x);
    conv_release(a, &w);
    kvt_pool_destroy(a);
    kvt_pool_destroy(b);
}

/* CLIENT PAUSE past the io timeout: a miss within about the timeout, the
 * node backs off, and it serves again once the pause ends. */
static void test_pause(void **state)
{
    (void)state;
    rsrv_cmd(&one, NULL, "FLUSHALL");
    kvt_remote_opts r = ropts(one.endpoint);
    r.io_timeout_ms = 200;
    kvt_pool *a = rpool(&r, 256, 0), *b = rpool(&r, 256, 0);
    conv w, x;
    prompt(&w, SALT_A, 6 * P, 4);
    write_conv(a, &w, 6 * P);
    log_reset();
    rsrv_cmd(&one, NULL, "CLIENT PAUSE 3000 ALL");
    const double t0 = tu_now();
    prompt(&x, SALT_A, 6 * P, 4);
    assert_int_equal(read_conv(b, &x, 6 * P), 0);
    assert_true(tu_now() - t0 < 2.5); /* the io timeout, not the pause */
    assert_true(stats_of(b).remote_errors >= 1);
    assert_true(log_has("not tried again"));
    conv_release(b, &x);
    /* After the pause (and the back-off), the same prompt lands. */
    uint32_t got = 0;
    for (int i = 0; i < 150 && got == 0; i++) {
        nap_ms(100);
        prompt(&x, SALT_A, 6 * P, 4);
        got = read_conv(b, &x, 6 * P);
        conv_release(b, &x);
    }
    assert_int_equal(got, 6 * P);
    assert_true(log_has("answers again"));
    conv_release(a, &w);
    kvt_pool_destroy(a);
    kvt_pool_destroy(b);
}

/* A server with a password and an ACL user: the right credentials share,
 * a wrong password is a miss (and its writes are dropped), never an error. */
static void test_auth(void **state)
{
    (void)state;
    rsrv s;
    const char *extra[] = {"--requirepass", "s3cret", NULL};
    rsrv_start(&s, "auth", 0, false, extra);
    rsrv_cmd(&s, "s3cret", "ACL SETUSER kvt on >kvtpw ~* +@all");
    kvt_remote_opts r = ropts(s.endpoint);
    r.password = "s3cret";
    kvt_pool *a = rpool(&r, 256, 0);
    conv w, x;
    prompt(&w, SALT_A, 5 * P, 5);
    write_conv(a, &w, 5 * P);
    assert_int_equal(stats_of(a).remote_put_values, 5);
    r.user = "kvt";
    r.password = "kvtpw";
    kvt_pool *b = rpool(&r, 256, 0);
    prompt(&x, SALT_A, 5 * P, 5);
    assert_int_equal(read_conv(b, &x, 5 * P), 5 * P);
    conv_release(b, &x);
    kvt_pool_destroy(b);
    log_reset();
    r.user = NULL;
    r.password = "wrong";
    b = rpool(&r, 256, 0);
    prompt(&x, SALT_A, 5 * P, 5);
    assert_int_equal(read_conv(b, &x, 5 * P), 0);
    assert_true(stats_of(b).remote_errors >= 1);
    assert_true(log_has("AUTH refused"));
    conv_append(b, &x, 5 * P + 3); /* its writes are dropped, its cache works */
    TU_OK(kvt_remote_flush(b, 5000));
    assert_int_equal(stats_of(b).remote_put_values, 0);
    assert_true(stats_of(b).remote_put_dropped >= 5);
    conv_verify(b, &x);
    conv_release(b, &x);
    kvt_pool_destroy(b);
    conv_release(a, &w);
    kvt_pool_destroy(a);
    rsrv_stop(&s, false);
}

/* No server, and a server killed while a reader's fetch is in flight: the
 * request goes on; a dead node is not tried again before its back-off. */
static void test_node_down(void **state)
{
    (void)state;
    kvt_remote_opts r = ropts("unix:/nonexistent/kvt.sock");
    r.retry_ms = 5000;
    kvt_pool *b = rpool(&r, 256, 0);
    conv x;
    prompt(&x, SALT_A, 4 * P, 6);
    assert_int_equal(read_conv(b, &x, 4 * P), 0);
    const uint64_t e1 = stats_of(b).remote_errors;
    assert_true(e1 >= 1);
    conv_append(b, &x, 4 * P);
    conv_verify(b, &x);
    conv_release(b, &x);
    TU_OK(kvt_prefix_drop_all(b, NULL)); /* (the local cache has them now) */
    const double t0 = tu_now();
    assert_int_equal(read_conv(b, &x, 4 * P), 0);
    assert_int_equal(stats_of(b).remote_errors, e1); /* backing off: not even a connect */
    assert_true(tu_now() - t0 < 2.0);
    conv_release(b, &x);
    kvt_pool_destroy(b);

    rsrv s;
    rsrv_start(&s, "victim", 0, false, NULL);
    r = ropts(s.endpoint);
    r.pipeline = 1;
    r.n_connections = 1;
    kvt_pool *a = rpool(&r, 4096, 0);
    b = rpool(&r, 4096, 0);
    conv w;
    prompt(&w, SALT_A, 300 * P, 7);
    write_conv(a, &w, 300 * P);
    prompt(&x, SALT_A, 300 * P, 7);
    kvt_seq_opts so;
    kvt_seq_opts_init(&so);
    so.salt = SALT_A;
    so.prefix = x.ids;
    so.n_prefix = 300 * P;
    TU_OK(kvt_seq_create(b, &so, &x.id));
    nap_ms(2);
    rsrv_stop(&s, true); /* SIGKILL mid-transfer */
    uint32_t got = 0;
    TU_OK(kvt_seq_prefix_wait(b, x.id, UINT32_MAX, &got));
    assert_true(got <= 300 * P);
    if (got < 300 * P) /* (the usual case: the kill beat the transfer) */
        assert_true(stats_of(b).remote_errors >= 1);
    x.n = got;
    TU_CHECK(b);
    conv_verify(b, &x);
    conv_append(b, &x, 300 * P - got);
    conv_verify(b, &x);
    step_conv(b, &x, 13);
    conv_release(b, &x);
    conv_release(a, &w);
    kvt_pool_destroy(a); /* its queue: dropped against a dead node, promptly */
    kvt_pool_destroy(b);
}

static const char *self_exe; /* this program: argv[0] */

/* The writer of share_across_processes, in a process of its own (this
 * program run again with --writer): exit 0 when every value was written. */
static int writer_main(const char *endpoint, uint32_t n_pages, uint32_t seed)
{
    kvt_remote_opts r = ropts(endpoint);
    kvt_pool_opts o = cache_opts(4096, 0);
    o.remote = &r;
    kvt_pool *a;
    if (kvt_pool_create(&o, &a))
        return 2;
    static conv w;
    prompt(&w, SALT_A, n_pages * P + 7, seed);
    write_conv(a, &w, n_pages * P + 7);
    const kvt_stats s = stats_of(a);
    kvt_pool_destroy(a);
    return s.remote_put_values == n_pages && s.remote_put_dropped == 0 ? 0 : 3;
}

/* Writer and reader in different processes. */
static void share_across_processes(const char *endpoint, uint32_t n_pages, uint32_t seed)
{
    char np[16], sd[16];
    snprintf(np, sizeof np, "%u", n_pages);
    snprintf(sd, sizeof sd, "%u", seed);
    fflush(NULL);
    const pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* argv[0], not /proc/self/exe: under valgrind that is valgrind's tool */
        execl(self_exe, self_exe, "--writer", endpoint, np, sd, (char *)NULL);
        _exit(127);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    kvt_remote_opts r = ropts(endpoint);
    kvt_pool *b = rpool(&r, 4096, 0);
    conv x;
    prompt(&x, SALT_A, n_pages * P + 7, seed);
    assert_int_equal(read_conv(b, &x, n_pages * P + 7), n_pages * P);
    step_conv(b, &x, seed);
    conv_release(b, &x);
    kvt_pool_destroy(b);
}

static void test_processes(void **state)
{
    (void)state;
    rsrv_cmd(&one, NULL, "FLUSHALL");
    share_across_processes(one.endpoint, 40, 8);
}

/* A three-master cluster: values spread over the nodes, two processes
 * share through it; then a slot resharded under a reader (ASK while it
 * migrates, MOVED after). */
static void test_cluster(void **state)
{
    (void)state;
    rsrv n[3];
    const int base = 21000 + (int)(getpid() % 2000) * 3;
    rsrv_cluster(n, base);
    share_across_processes(n[0].endpoint, 60, 9);
    long long total = 0;
    int used = 0;
    for (int i = 0; i < 3; i++) {
        const long long k = dbsize(&n[i]);
        total += k;
        used += k > 0;
    }
    assert_int_equal(total, 60);
    assert_true(used >= 2);

    /* Resharding: the reader's pool reads the slot map first. */
    kvt_remote_opts r = ropts(n[1].endpoint);
    kvt_pool *b = rpool(&r, 4096, 0);
    char key[200];
    int src = -1;
    for (int i = 0; i < 3 && src < 0; i++)
        if (key_of_page(&n[i], SALT_A, 3, key, sizeof key))
            src = i;
    assert_true(src >= 0);
    const int dst = (src + 1) % 3;
    redisContext *cs = rsrv_conn(&n[src], NULL), *cd = rsrv_conn(&n[dst], NULL);
    redisReply *sl = redisCommand(cs, "CLUSTER KEYSLOT %s", key);
    redisReply *ids = redisCommand(cs, "CLUSTER MYID"), *idd = redisCommand(cd, "CLUSTER MYID");
    assert_true(sl && ids && idd && sl->type == REDIS_REPLY_INTEGER);
    const long long slot = sl->integer;
    redisReply *q;
#define RQ(c, ...)                                                                            \
    do {                                                                                      \
        q = redisCommand(c, __VA_ARGS__);                                                     \
        if (!q || q->type == REDIS_REPLY_ERROR)                                               \
            fail_msg("%s", q ? q->str : "no reply");                                          \
        freeReplyObject(q);                                                                   \
    } while (0)
    RQ(cd, "CLUSTER SETSLOT %lld IMPORTING %s", slot, ids->str);
    RQ(cs, "CLUSTER SETSLOT %lld MIGRATING %s", slot, idd->str);
    RQ(cs, "MIGRATE 127.0.0.1 %d %s 0 5000", n[dst].port, key);
    const uint64_t r0 = stats_of(b).remote_redirects;
    conv x;
    prompt(&x, SALT_A, 60 * P + 7, 9);
    assert_int_equal(read_conv(b, &x, 60 * P + 7), 60 * P); /* ASK */
    conv_release(b, &x);
    TU_OK(kvt_prefix_drop_all(b, NULL)); /* (b's own cache would serve them now) */
    const uint64_t r1 = stats_of(b).remote_redirects;
    assert_true(r1 > r0);
    for (int i = 0; i < 3; i++) {
        redisContext *c = rsrv_conn(&n[i], NULL);
        RQ(c, "CLUSTER SETSLOT %lld NODE %s", slot, idd->str);
        redisFree(c);
    }
    prompt(&x, SALT_A, 60 * P + 7, 9);
    assert_int_equal(read_conv(b, &x, 60 * P + 7), 60 * P); /* MOVED */
    conv_release(b, &x);
    assert_true(stats_of(b).remote_redirects > r1);
    TU_OK(kvt_prefix_drop_all(b, NULL));
    prompt(&x, SALT_A, 60 * P + 7, 9); /* the map learnt: no redirect now */
    const uint64_t r2 = stats_of(b).remote_redirects;
    assert_int_equal(read_conv(b, &x, 60 * P + 7), 60 * P);
    assert_int_equal(stats_of(b).remote_redirects, r2);
    conv_release(b, &x);
    freeReplyObject(sl);
    freeReplyObject(ids);
    freeReplyObject(idd);
    redisFree(cs);
    redisFree(cd);
    kvt_pool_destroy(b);
    for (int i = 0; i < 3; i++)
        rsrv_stop(&n[i], false);
}
#endif

int main(int argc, char **argv)
{
#if KVT_TEST_EXPECT_REDIS
    self_exe = argv[0];
    if (argc == 5 && !strcmp(argv[1], "--writer"))
        return writer_main(argv[2], (uint32_t)atoi(argv[3]), (uint32_t)atoi(argv[4]));
    if (!rsrv_installed()) {
        printf("redis-server/redis-cli not installed: skipped\n");
        return 77;
    }
    rsrv_start(&one, "single", 0, false, NULL);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_opts_errors),
        cmocka_unit_test(test_share),
        cmocka_unit_test(test_push),
        cmocka_unit_test(test_broken_replies),
        cmocka_unit_test(test_land_room),
        cmocka_unit_test(test_damaged_values),
        cmocka_unit_test(test_flushall),
        cmocka_unit_test(test_pause),
        cmocka_unit_test(test_auth),
        cmocka_unit_test(test_node_down),
        cmocka_unit_test(test_processes),
        cmocka_unit_test(test_cluster),
    };
    const int rc = cmocka_run_group_tests(tests, NULL, NULL);
    rsrv_stop(&one, false);
    return rc;
#else
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_opts_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
