/* The head-stability policy: construction, accessors, the device footprint
 * against a page-by-page count, describe, profile files (round trip, the
 * documented byte layout rebuilt here, every malformed-file case, the fuzz
 * corpus), the step plan's schedule under a policy (unstable heads every
 * step, stable heads every interval, staggered over sequences), recording
 * into a profiler from the step against a profiler fed by hand, and bad
 * input to every call. */
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

/* ---- helpers ------------------------------------------------------------------ */
/* CRC32C bit by bit (reflected 0x82F63B78), from the definition. */
static uint32_t ref_crc32c(const uint8_t *p, size_t n)
{
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++)
            crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
    return ~crc;
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Re-signs a modified profile: the CRC of everything before the trailer. */
static void resign(uint8_t *b, size_t n)
{
    put32(b + n - 4, ref_crc32c(b, n - 4));
}

typedef struct heads {
    uint32_t n;
    uint32_t cls[64], k[64], w[64], sink[64], local[64], iv[64];
    float sim[64];
} heads;

/* The documented format (kvtier-profile(5)), written out independently. */
static size_t ref_file_v(uint8_t *b, const kvt_geometry *g, const heads *hd, uint32_t version)
{
    const size_t n = 64 + 32 * (size_t)hd->n + 4;
    memset(b, 0, n);
    memcpy(b, "KVTPROF", 8); /* with its NUL */
    put32(b + 8, version);
    put32(b + 12, 64);
    put32(b + 16, 32);
    put32(b + 20, hd->n);
    put32(b + 24, g->n_layers);
    put32(b + 28, g->n_kv_heads);
    put32(b + 32, g->n_q_heads);
    put32(b + 36, g->head_dim);
    put32(b + 40, g->page_tokens);
    put32(b + 44, g->dtype);
    for (uint32_t i = 0; i < hd->n; i++) {
        uint8_t *r = b + 64 + 32 * (size_t)i;
        put32(r, hd->cls[i]);
        put32(r + 4, hd->k[i]);
        put32(r + 8, hd->w[i]);
        put32(r + 12, hd->sink[i]);
        put32(r + 16, hd->local[i]);
        put32(r + 20, hd->iv[i]);
        if (version >= 2) { /* the threshold's IEEE-754 bits */
            union {
                float f;
                uint32_t u;
            } x = {hd->sim[i]};
            put32(r + 24, x.u);
        }
    }
    resign(b, n);
    return n;
}

static size_t ref_file(uint8_t *b, const kvt_geometry *g, const heads *hd)
{
    return ref_file_v(b, g, hd, 2);
}

static void random_heads(heads *hd, uint32_t n, tu_rng *r)
{
    hd->n = n;
    for (uint32_t i = 0; i < n; i++) {
        hd->cls[i] = tu_below(r, 2);
        hd->k[i] = tu_below(r, 300);
        hd->w[i] = 1 + tu_below(r, KVT_POLICY_MAX_WINDOW);
        hd->sink[i] = tu_below(r, 4);
        hd->local[i] = tu_below(r, 4);
        hd->iv[i] = 1 + tu_below(r, 40);
        hd->sim[i] = (float)tu_below(r, 2001) / 1000.0f - 1.0f; /* -1 .. 1 */
    }
}

static kvt_policy *policy_of(const kvt_geometry *g, const heads *hd)
{
    kvt_policy_heads ph = {sizeof ph, hd->n, hd->cls, hd->k, hd->w, hd->sink, hd->local, hd->iv, hd->sim};
    kvt_policy *p;
    TU_OK(kvt_policy_create_heads(g, NULL, &ph, &p));
    return p;
}

/* Every head of p equals hd. */
static void same_heads(const kvt_policy *p, const kvt_geometry *g, const heads *hd)
{
    for (uint32_t i = 0; i < hd->n; i++) {
        kvt_policy_head_info info;
        memset(&info, 0xee, sizeof info);
        info.struct_size = sizeof info;
        TU_OK(kvt_policy_head_get(p, i / g->n_kv_heads, i % g->n_kv_heads, &info));
        assert_int_equal(info.head_class, hd->cls[i]);
        assert_int_equal(info.top_k_pages, hd->k[i]);
        assert_int_equal(info.window, hd->w[i]);
        assert_int_equal(info.sink_pages, hd->sink[i]);
        assert_int_equal(info.local_pages, hd->local[i]);
        assert_int_equal(info.rerank_interval, hd->iv[i]);
        assert_true(info.rerank_similarity == hd->sim[i]);
    }
}

/* ---- construction and accessors ------------------------------------------------- */
static void test_opts_and_uniform(void **state)
{
    (void)state;
    kvt_policy_opts a = KVT_POLICY_OPTS_INIT, b;
    memset(&b, 0x5a, sizeof b);
    TU_OK(kvt_policy_opts_init(&b));
    assert_memory_equal(&a, &b, sizeof a);
    assert_int_equal(b.struct_size, sizeof b);
    assert_int_equal(b.default_class, KVT_HEAD_STABLE);
    assert_int_equal(b.top_k_pages, 64);
    assert_int_equal(b.window, 1);
    assert_int_equal(b.sink_pages, 1);
    assert_int_equal(b.local_pages, 1);
    assert_int_equal(b.stable_interval, 16);
    assert_int_equal(b.unstable_interval, 1);

    /* Defaults resolved in the geometry: q heads, page_tokens, dtype. */
    kvt_geometry g = {3, 5, 0, 64, 0, 0, {0, 0}};
    kvt_policy *p;
    TU_OK(kvt_policy_create(&g, NULL, &p));
    kvt_geometry r;
    TU_OK(kvt_policy_geometry_get(p, &r));
    assert_int_equal(r.n_q_heads, 5);
    assert_int_equal(r.page_tokens, 16);
    assert_int_equal(r.dtype, KVT_DTYPE_F16);
    heads want = {.n = 15};
    for (uint32_t i = 0; i < 15; i++) {
        want.cls[i] = KVT_HEAD_STABLE;
        want.k[i] = 64;
        want.w[i] = 1;
        want.sink[i] = want.local[i] = 1;
        want.iv[i] = 16;
        want.sim[i] = KVT_RERANK_SIMILARITY_DEFAULT;
    }
    same_heads(p, &r, &want);
    uint32_t n;
    TU_OK(kvt_policy_count_get(p, KVT_HEAD_STABLE, &n));
    assert_int_equal(n, 15);
    TU_OK(kvt_policy_count_get(p, KVT_HEAD_UNSTABLE, &n));
    assert_int_equal(n, 0);
    kvt_policy_destroy(p);

    /* All unstable: their own interval. */
    b.default_class = KVT_HEAD_UNSTABLE;
    b.unstable_interval = 2;
    b.top_k_pages = 7;
    b.window = 3;
    b.sink_pages = 0;
    b.local_pages = 5;
    b.rerank_similarity = -1.0f;
    TU_OK(kvt_policy_create(&g, &b, &p));
    for (uint32_t i = 0; i < 15; i++) {
        want.sim[i] = -1.0f;
        want.cls[i] = KVT_HEAD_UNSTABLE;
        want.k[i] = 7;
        want.w[i] = 3;
        want.sink[i] = 0;
        want.local[i] = 5;
        want.iv[i] = 2;
    }
    same_heads(p, &r, &want);
    TU_OK(kvt_policy_count_get(p, KVT_HEAD_UNSTABLE, &n));
    assert_int_equal(n, 15);
    kvt_policy_destroy(p);
    kvt_policy_destroy(NULL);
}

static void test_create_heads(void **state)
{
    (void)state;
    kvt_geometry g = {4, 6, 12, 32, 8, KVT_DTYPE_BF16, {0, 0}};
    tu_rng r = {0x9011c1};
    heads hd;
    random_heads(&hd, 24, &r);
    kvt_policy *p = policy_of(&g, &hd);
    same_heads(p, &g, &hd);
    uint32_t nu = 0, ns = 0, cu = 0;
    for (uint32_t i = 0; i < 24; i++)
        cu += hd.cls[i] == KVT_HEAD_UNSTABLE;
    TU_OK(kvt_policy_count_get(p, KVT_HEAD_UNSTABLE, &nu));
    TU_OK(kvt_policy_count_get(p, KVT_HEAD_STABLE, &ns));
    assert_int_equal(nu, cu);
    assert_int_equal(ns, 24 - cu);
    kvt_policy_destroy(p);

    /* NULL arrays take the options; a NULL interval follows the class. */
    kvt_policy_opts o;
    kvt_policy_opts_init(&o);
    o.top_k_pages = 9;
    o.window = 2;
    o.stable_interval = 8;
    o.unstable_interval = 3;
    o.rerank_similarity = 0.5f;
    kvt_policy_heads ph = {sizeof ph, 24, hd.cls, NULL, NULL, NULL, NULL, NULL, NULL};
    TU_OK(kvt_policy_create_heads(&g, &o, &ph, &p));
    heads want = hd;
    for (uint32_t i = 0; i < 24; i++) {
        want.sim[i] = 0.5f;
        want.k[i] = 9;
        want.w[i] = 2;
        want.sink[i] = want.local[i] = 1;
        want.iv[i] = hd.cls[i] == KVT_HEAD_UNSTABLE ? 3 : 8;
    }
    same_heads(p, &g, &want);
    kvt_policy_destroy(p);
    /* All NULL: the uniform policy. */
    kvt_policy_heads none = {sizeof none, 24, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    o.default_class = KVT_HEAD_UNSTABLE;
    TU_OK(kvt_policy_create_heads(&g, &o, &none, &p));
    for (uint32_t i = 0; i < 24; i++) {
        want.cls[i] = KVT_HEAD_UNSTABLE;
        want.iv[i] = 3;
    }
    same_heads(p, &g, &want);
    kvt_policy_destroy(p);
}

/* The device footprint, page by page: the selection rule marks sink, local
 * and a partial last page, then top_k * window pages (unstable: all). */
static uint64_t ref_device_pages(const heads *hd, uint64_t T, uint32_t P, uint64_t *total)
{
    const uint64_t np = (T + P - 1) / P;
    uint64_t dev = 0;
    *total = 0;
    uint8_t *mark = malloc(np + 1);
    for (uint32_t i = 0; i < hd->n; i++) {
        *total += np;
        if (hd->cls[i] == KVT_HEAD_UNSTABLE) {
            dev += np;
            continue;
        }
        memset(mark, 0, np + 1);
        for (uint64_t p = 0; p < np; p++)
            if (p < hd->sink[i] || p + hd->local[i] + (T % P != 0) >= np)
                mark[p] = 1;
        uint64_t extra = (uint64_t)hd->k[i] * hd->w[i], n = 0;
        for (uint64_t p = 0; p < np; p++) {
            if (!mark[p] && extra) {
                mark[p] = 1;
                extra--;
            }
            n += mark[p];
        }
        dev += n;
    }
    free(mark);
    return dev;
}

static void test_device_pages(void **state)
{
    (void)state;
    kvt_geometry g = {2, 4, 4, 16, 16, KVT_DTYPE_F16, {0, 0}};
    tu_rng r = {77};
    for (int it = 0; it < 60; it++) {
        heads hd;
        random_heads(&hd, 8, &r);
        for (uint32_t i = 0; i < 8; i++) { /* small budgets so every rule bites */
            hd.k[i] = tu_below(&r, 6);
            hd.w[i] = 1 + tu_below(&r, 3);
            hd.sink[i] = tu_below(&r, 3);
            hd.local[i] = tu_below(&r, 3);
        }
        kvt_policy *p = policy_of(&g, &hd);
        const uint64_t ctxs[] = {0, 1, 15, 16, 17, 33, 100, 160, 1000 + (uint64_t)it};
        for (size_t c = 0; c < sizeof ctxs / sizeof ctxs[0]; c++) {
            uint64_t dev = 1, tot = 1, rt;
            TU_OK(kvt_policy_device_pages_get(p, ctxs[c], &dev, &tot));
            const uint64_t rd = ref_device_pages(&hd, ctxs[c], 16, &rt);
            if (dev != rd || tot != rt)
                fail_msg("ctx %llu: %llu of %llu device pages, reference %llu of %llu",
                         (unsigned long long)ctxs[c], (unsigned long long)dev,
                         (unsigned long long)tot, (unsigned long long)rd,
                         (unsigned long long)rt);
        }
        kvt_policy_destroy(p);
    }
    /* Huge contexts: the page count overflows. */
    kvt_policy *p;
    TU_OK(kvt_policy_create(&g, NULL, &p));
    uint64_t dev, tot;
    TU_OK(kvt_policy_device_pages_get(p, UINT64_MAX, &dev, NULL));
    TU_OK(kvt_policy_device_pages_get(p, UINT64_MAX, &dev, &tot));
    assert_true(tot == (UINT64_MAX / 16 + 1) * 8);
    kvt_geometry big = {4, 8, 8, 16, 8, KVT_DTYPE_F16, {0, 0}}; /* 32 x 2^61 pages */
    kvt_policy *pb;
    kvt_policy_opts o;
    kvt_policy_opts_init(&o);
    o.default_class = KVT_HEAD_UNSTABLE;
    TU_OK(kvt_policy_create(&big, &o, &pb));
    TU_EXPECT_ERR(kvt_policy_device_pages_get(pb, UINT64_MAX, &dev, &tot), KVT_EOVERFLOW,
                  "ctx_tokens");
    kvt_policy_destroy(pb);
    kvt_policy_destroy(p);
}

static void test_describe(void **state)
{
    (void)state;
    kvt_geometry g = {2, 4, 8, 128, 16, KVT_DTYPE_F16, {0, 0}};
    heads hd = {.n = 8};
    for (uint32_t i = 0; i < 8; i++) {
        hd.cls[i] = i % 4 == 1 ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE;
        hd.k[i] = 128;
        hd.w[i] = 1 + (i % 2);
        hd.sink[i] = hd.local[i] = 1;
        hd.iv[i] = hd.cls[i] ? 1 : 16;
    }
    kvt_policy *p = policy_of(&g, &hd);
    size_t need = 0;
    TU_OK(kvt_policy_describe(p, 32768, NULL, 0, &need));
    assert_true(need > 0);
    char *buf = malloc(need + 1);
    size_t need2 = 0;
    TU_OK(kvt_policy_describe(p, 32768, buf, need + 1, &need2));
    assert_int_equal(need, need2);
    assert_int_equal(strlen(buf), need);
    /* Counts per class and the memory line at 32768 tokens. */
    assert_non_null(strstr(buf, "stable:   6 heads (75.0%)"));
    assert_non_null(strstr(buf, "unstable: 2 heads (25.0%)"));
    assert_non_null(strstr(buf, "window x1-2"));
    assert_non_null(strstr(buf, "rerank every 16 steps"));
    assert_non_null(strstr(buf, "rerank every 1 step\n"));
    uint64_t dev, tot, rt;
    TU_OK(kvt_policy_device_pages_get(p, 32768, &dev, &tot));
    assert_true(dev == ref_device_pages(&hd, 32768, 16, &rt));
    char line[160];
    snprintf(line, sizeof line, "at 32768 tokens per sequence: %llu of %llu KV pages",
             (unsigned long long)dev, (unsigned long long)tot);
    assert_non_null(strstr(buf, line));
    /* snprintf semantics: a short buffer holds a NUL-terminated prefix. */
    char small[20];
    memset(small, 'x', sizeof small);
    TU_OK(kvt_policy_describe(p, 32768, small, sizeof small, &need2));
    assert_int_equal(need2, need);
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_memory_equal(small, buf, sizeof small - 1);
    /* cap 1: just the NUL. No ctx: no memory line. */
    TU_OK(kvt_policy_describe(p, 32768, small, 1, NULL));
    assert_int_equal(small[0], '\0');
    TU_OK(kvt_policy_describe(p, 0, buf, need + 1, &need2));
    assert_null(strstr(buf, "tokens per sequence"));
    free(buf);
    kvt_policy_destroy(p);
}

static void test_bad_input(void **state)
{
    (void)state;
    kvt_geometry g = {2, 2, 2, 16, 16, KVT_DTYPE_F16, {0, 0}};
    kvt_policy *p = (kvt_policy *)&g;
    kvt_policy_opts o;
    TU_EXPECT_ERR(kvt_policy_opts_init(NULL), KVT_EINVAL, "opts");
    TU_EXPECT_ERR(kvt_policy_create(&g, NULL, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_policy_create(NULL, NULL, &p), KVT_EINVAL, "geom");
    assert_null(p);
    kvt_geometry bg = g;
    bg.n_layers = 0;
    TU_EXPECT_ERR(kvt_policy_create(&bg, NULL, &p), KVT_EINVAL, "n_layers");
#define BAD_OPT(field, val, code, needle)                                                  \
    do {                                                                                   \
        kvt_policy_opts_init(&o);                                                          \
        o.field = val;                                                                     \
        p = (kvt_policy *)&g;                                                              \
        TU_EXPECT_ERR(kvt_policy_create(&g, &o, &p), code, needle);                        \
        assert_null(p);                                                                    \
    } while (0)
    BAD_OPT(default_class, 2, KVT_EINVAL, "opts->default_class");
    BAD_OPT(top_k_pages, KVT_SELECT_MAX_PAGES + 1, KVT_ERANGE, "opts->top_k_pages");
    BAD_OPT(window, 0, KVT_EINVAL, "opts->window");
    BAD_OPT(window, KVT_POLICY_MAX_WINDOW + 1, KVT_ERANGE, "opts->window");
    BAD_OPT(sink_pages, KVT_SELECT_MAX_PAGES + 1, KVT_ERANGE, "opts->sink_pages");
    BAD_OPT(local_pages, KVT_SELECT_MAX_PAGES + 1, KVT_ERANGE, "opts->local_pages");
    BAD_OPT(stable_interval, 0, KVT_EINVAL, "opts->stable_interval");
    BAD_OPT(unstable_interval, 0, KVT_EINVAL, "opts->unstable_interval");
    BAD_OPT(struct_size, 16, KVT_EINVAL, "opts->struct_size");
    BAD_OPT(rerank_similarity, NAN, KVT_EINVAL, "opts->rerank_similarity: nan");
    BAD_OPT(rerank_similarity, -1.0001f, KVT_EINVAL, "opts->rerank_similarity: -1.0001");
    BAD_OPT(rerank_similarity, 1.0001f, KVT_EINVAL, "opts->rerank_similarity: 1.0001");
    BAD_OPT(rerank_similarity, INFINITY, KVT_EINVAL, "opts->rerank_similarity: inf");
    BAD_OPT(reserved, 1, KVT_EINVAL, "opts->reserved");
#undef BAD_OPT
    /* The first layout (struct_size 32): the threshold reads as the default. */
    {
        kvt_policy_opts_init(&o);
        o.struct_size = 32;
        o.rerank_similarity = NAN; /* past the caller's struct: never read */
        TU_OK(kvt_policy_create(&g, &o, &p));
        kvt_policy_head_info hi = {.struct_size = sizeof hi};
        TU_OK(kvt_policy_head_get(p, 0, 0, &hi));
        assert_true(hi.rerank_similarity == KVT_RERANK_SIMILARITY_DEFAULT);
        kvt_policy_destroy(p);
    }
    /* At the limits: accepted. */
    kvt_policy_opts_init(&o);
    o.top_k_pages = o.sink_pages = o.local_pages = KVT_SELECT_MAX_PAGES;
    o.window = KVT_POLICY_MAX_WINDOW;
    o.stable_interval = UINT32_MAX;
    TU_OK(kvt_policy_create(&g, &o, &p));
    kvt_policy_destroy(p);

    /* Per-head arrays: wrong count, each bad field named with its index. */
    kvt_policy_opts_init(&o);
    uint32_t cls[4] = {0, 1, 0, 0}, k[4] = {1, 2, 3, 4}, w[4] = {1, 1, 1, 1};
    uint32_t s[4] = {0, 0, 0, 0}, l[4] = {1, 1, 1, 1}, iv[4] = {1, 1, 1, 1};
    kvt_policy_heads ph = {sizeof ph, 4, cls, k, w, s, l, iv, NULL};
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_policy_create_heads(NULL, NULL, &ph, &p), KVT_EINVAL, "geom");
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, NULL, &p), KVT_EINVAL, "heads");
    ph.n_heads = 3;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_EINVAL, "heads->n_heads");
    ph.n_heads = 4;
    ph.struct_size = 8;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_EINVAL, "heads->struct_size");
    ph.struct_size = sizeof ph;
    o.window = 0;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, &o, &ph, &p), KVT_EINVAL, "opts->window");
    cls[2] = 7;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_EINVAL,
                  "heads->head_class[2] (layer 1, kv_head 0)");
    cls[2] = 0;
    k[3] = KVT_SELECT_MAX_PAGES + 1;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_ERANGE,
                  "heads->top_k_pages[3]");
    k[3] = 4;
    w[1] = 0;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_EINVAL, "heads->window[1]");
    w[1] = KVT_POLICY_MAX_WINDOW + 1;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_ERANGE, "heads->window[1]");
    w[1] = 1;
    s[0] = KVT_SELECT_MAX_PAGES + 1;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_ERANGE,
                  "heads->sink_pages[0]");
    s[0] = 0;
    l[0] = KVT_SELECT_MAX_PAGES + 1;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_ERANGE,
                  "heads->local_pages[0]");
    l[0] = 1;
    iv[3] = 0;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_EINVAL,
                  "heads->rerank_interval[3]");
    iv[3] = 1;
    float sim[4] = {-1.0f, 1.0f, 0.0f, NAN};
    ph.rerank_similarity = sim;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_EINVAL,
                  "heads->rerank_similarity[3] (layer 1, kv_head 1): nan");
    sim[3] = -1.5f;
    TU_EXPECT_ERR(kvt_policy_create_heads(&g, NULL, &ph, &p), KVT_EINVAL,
                  "heads->rerank_similarity[3]");
    sim[3] = 0.25f;
    TU_OK(kvt_policy_create_heads(&g, NULL, &ph, &p));
    {
        kvt_policy_head_info hi = {.struct_size = sizeof hi};
        TU_OK(kvt_policy_head_get(p, 1, 1, &hi));
        assert_true(hi.rerank_similarity == 0.25f);
        kvt_policy_destroy(p);
    }
    ph.rerank_similarity = NULL;
    TU_OK(kvt_policy_create_heads(&g, NULL, &ph, &p));

    /* Accessors. */
    kvt_policy_head_info info = {.struct_size = sizeof info};
    TU_EXPECT_ERR(kvt_policy_head_get(NULL, 0, 0, &info), KVT_EINVAL, "pol");
    TU_EXPECT_ERR(kvt_policy_head_get(p, 2, 0, &info), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_policy_head_get(p, 0, 2, &info), KVT_EINVAL, "kv_head");
    TU_EXPECT_ERR(kvt_policy_head_get(p, 0, 0, NULL), KVT_EINVAL, "info");
    info.struct_size = 12;
    TU_EXPECT_ERR(kvt_policy_head_get(p, 0, 0, &info), KVT_EINVAL, "struct_size");
    union {
        kvt_policy_head_info i;
        uint8_t b[sizeof(kvt_policy_head_info) + 8];
    } raw;
    memset(&raw, 0xcd, sizeof raw);
    raw.i.struct_size = sizeof raw;
    TU_OK(kvt_policy_head_get(p, 1, 1, &raw.i));
    assert_int_equal(raw.i.top_k_pages, 4);
    for (size_t i = sizeof raw.i; i < sizeof raw; i++)
        assert_int_equal(raw.b[i], 0);
    kvt_geometry og;
    TU_EXPECT_ERR(kvt_policy_geometry_get(NULL, &og), KVT_EINVAL, "pol");
    TU_EXPECT_ERR(kvt_policy_geometry_get(p, NULL), KVT_EINVAL, "out");
    uint32_t n;
    TU_EXPECT_ERR(kvt_policy_count_get(NULL, 0, &n), KVT_EINVAL, "pol");
    TU_EXPECT_ERR(kvt_policy_count_get(p, 2, &n), KVT_EINVAL, "head_class");
    TU_EXPECT_ERR(kvt_policy_count_get(p, 0, NULL), KVT_EINVAL, "n_heads");
    uint64_t dev;
    TU_EXPECT_ERR(kvt_policy_device_pages_get(NULL, 1, &dev, NULL), KVT_EINVAL, "pol");
    TU_EXPECT_ERR(kvt_policy_device_pages_get(p, 1, NULL, NULL), KVT_EINVAL, "device_pages");
    char buf[8];
    TU_EXPECT_ERR(kvt_policy_describe(NULL, 0, buf, sizeof buf, NULL), KVT_EINVAL, "pol");
    TU_EXPECT_ERR(kvt_policy_describe(p, 0, NULL, 8, NULL), KVT_EINVAL, "buf");
    /* Files and buffers. */
    size_t need;
    TU_EXPECT_ERR(kvt_policy_save_buffer(NULL, buf, sizeof buf, &need), KVT_EINVAL, "pol");
    TU_EXPECT_ERR(kvt_policy_save_buffer(p, buf, sizeof buf, NULL), KVT_EINVAL, "needed");
    TU_EXPECT_ERR(kvt_policy_save_buffer(p, NULL, 200, &need), KVT_EINVAL, "buf");
    TU_EXPECT_ERR(kvt_policy_save_buffer(p, buf, sizeof buf, &need), KVT_ERANGE, "cap");
    assert_int_equal(need, 64 + 4 * 32 + 4);
    kvt_policy *q = (kvt_policy *)&g;
    TU_EXPECT_ERR(kvt_policy_load_buffer(buf, 8, NULL, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_policy_load_buffer(NULL, 8, NULL, &q), KVT_EINVAL, "data");
    assert_null(q);
    TU_EXPECT_ERR(kvt_policy_load_buffer(NULL, 0, NULL, &q), KVT_ECORRUPT, "data");
    TU_EXPECT_ERR(kvt_policy_save(NULL, "x"), KVT_EINVAL, "pol");
    TU_EXPECT_ERR(kvt_policy_save(p, NULL), KVT_EINVAL, "path");
    TU_EXPECT_ERR(kvt_policy_load("x", NULL, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_policy_load(NULL, NULL, &q), KVT_EINVAL, "path");
    kvt_policy_destroy(p);
}

/* ---- profile files ---------------------------------------------------------------- */
static char tmpdir[64];

static void make_tmpdir(void)
{
    if (tmpdir[0])
        return;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvt_test_policy.XXXXXX");
    assert_non_null(mkdtemp(tmpdir));
}

static void test_roundtrip(void **state)
{
    (void)state;
    tu_rng r = {0xf11e};
    make_tmpdir();
    const kvt_geometry gs[] = {
        {1, 1, 1, 8, 8, KVT_DTYPE_F32, {0, 0}},
        {4, 8, 32, 128, 16, KVT_DTYPE_F16, {0, 0}},
        {2, 3, 24, 64, 256, KVT_DTYPE_BF16, {0, 0}},
    };
    for (size_t gi = 0; gi < sizeof gs / sizeof gs[0]; gi++) {
        const kvt_geometry *g = &gs[gi];
        heads hd;
        random_heads(&hd, g->n_layers * g->n_kv_heads, &r);
        kvt_policy *p = policy_of(g, &hd);
        size_t need = 0;
        TU_OK(kvt_policy_save_buffer(p, NULL, 0, &need));
        uint8_t *b = malloc(need), *ref = malloc(need);
        TU_OK(kvt_policy_save_buffer(p, b, need, &need));
        /* Byte for byte the documented layout. */
        assert_int_equal(ref_file(ref, g, &hd), need);
        assert_memory_equal(b, ref, need);
        kvt_policy *q;
        TU_OK(kvt_policy_load_buffer(b, need, g, &q));
        same_heads(q, g, &hd);
        kvt_policy_destroy(q);
        TU_OK(kvt_policy_load_buffer(b, need, NULL, &q));
        kvt_geometry qg;
        TU_OK(kvt_policy_geometry_get(q, &qg));
        assert_memory_equal(&qg, g, sizeof qg);
        kvt_policy_destroy(q);
        /* Through a file, over an older one. */
        char path[128];
        snprintf(path, sizeof path, "%s/p%zu.kvtprof", tmpdir, gi);
        TU_OK(kvt_policy_save(p, path));
        TU_OK(kvt_policy_save(p, path));
        TU_OK(kvt_policy_load(path, g, &q));
        same_heads(q, g, &hd);
        kvt_policy_destroy(q);
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        uint8_t *fb = malloc(need + 1);
        assert_int_equal(fread(fb, 1, need + 1, f), need);
        fclose(f);
        assert_memory_equal(fb, ref, need);
        free(fb);
        unlink(path);
        free(b);
        free(ref);
        kvt_policy_destroy(p);
    }
}

static void test_malformed(void **state)
{
    (void)state;
    const kvt_geometry g = {2, 3, 6, 32, 16, KVT_DTYPE_F16, {0, 0}};
    tu_rng r = {0xbad};
    heads hd;
    random_heads(&hd, 6, &r);
    uint8_t good[64 + 6 * 32 + 4], b[sizeof good + 8];
    const size_t n = ref_file(good, &g, &hd);
    assert_int_equal(n, sizeof good);
    kvt_policy *q = NULL;
    TU_OK(kvt_policy_load_buffer(good, n, &g, &q));
    kvt_policy_destroy(q);

    /* Truncated at every length. */
    for (size_t len = 0; len < n; len++) {
        int rc = kvt_policy_load_buffer(good, len, &g, &q);
        if (rc != KVT_ECORRUPT)
            fail_msg("truncated to %zu bytes: %s (%s)", len, kvt_err_name(rc),
                     kvt_last_error());
        assert_null(q);
    }
    /* Every byte damaged (one bit, and all bits). */
    for (size_t i = 0; i < n; i++)
        for (int m = 0; m < 2; m++) {
            memcpy(b, good, n);
            b[i] ^= m ? 0xff : 0x10;
            int rc = kvt_policy_load_buffer(b, n, &g, &q);
            if (rc != KVT_ECORRUPT)
                fail_msg("byte %zu ^ 0x%02x: %s (%s)", i, m ? 0xff : 0x10, kvt_err_name(rc),
                         kvt_last_error());
            assert_null(q);
        }
    /* Bytes appended, with and without a matching checksum. */
    memcpy(b, good, n);
    memset(b + n, 0, 8);
    TU_EXPECT_ERR(kvt_policy_load_buffer(b, n + 8, &g, &q), KVT_ECORRUPT, "checksum");
    memcpy(b, good, n - 4);
    memset(b + n - 4, 0, 8);
    resign(b, n + 4);
    TU_EXPECT_ERR(kvt_policy_load_buffer(b, n + 4, &g, &q), KVT_ECORRUPT, "bytes");

    /* Another geometry: each field, named with both values. */
    const char *names[] = {"n_layers", "n_kv_heads", "n_q_heads", "head_dim", "page_tokens",
                           "dtype"};
    const kvt_geometry other[6] = {
        {4, 3, 6, 32, 16, KVT_DTYPE_F16, {0, 0}},  {2, 6, 6, 32, 16, KVT_DTYPE_F16, {0, 0}},
        {2, 3, 12, 32, 16, KVT_DTYPE_F16, {0, 0}}, {2, 3, 6, 64, 16, KVT_DTYPE_F16, {0, 0}},
        {2, 3, 6, 32, 32, KVT_DTYPE_F16, {0, 0}},  {2, 3, 6, 32, 16, KVT_DTYPE_BF16, {0, 0}},
    };
    for (int f = 0; f < 6; f++) {
        kvt_geometry e = other[f];
        kvt_clear_error();
        int rc = kvt_policy_load_buffer(good, n, &e, &q);
        if (rc != KVT_EINVAL || !strstr(kvt_last_error(), names[f]) ||
            !strstr(kvt_last_error(), "expect"))
            fail_msg("geometry %s: %s (%s)", names[f], kvt_err_name(rc), kvt_last_error());
        assert_null(q);
    }
    kvt_geometry inv = g;
    inv.head_dim = 9;
    TU_EXPECT_ERR(kvt_policy_load_buffer(good, n, &inv, &q), KVT_EINVAL, "expect");

    /* Version: newer is KVT_EINVAL, 0 is corrupt (checksums correct). */
    memcpy(b, good, n);
    put32(b + 8, 3);
    resign(b, n);
    TU_EXPECT_ERR(kvt_policy_load_buffer(b, n, &g, &q), KVT_EINVAL, "version 3");
    put32(b + 8, 0);
    resign(b, n);
    TU_EXPECT_ERR(kvt_policy_load_buffer(b, n, &g, &q), KVT_ECORRUPT, "version 0");
    /* A newer version may be shorter than version 1's header. */
    memcpy(b, good, 12);
    put32(b + 8, 9);
    resign(b, 16);
    TU_EXPECT_ERR(kvt_policy_load_buffer(b, 16, NULL, &q), KVT_EINVAL, "version 9");

    /* Bad values with a correct checksum: offset, value, what the message names. */
    struct {
        size_t off;
        uint32_t v;
        const char *needle;
    } bad[] = {
        {12, 60, "header size"},
        {16, 36, "record size"},
        {20, 5, "records"},
        {24, 0, "n_layers"},
        {24, 3, "records"},
        {28, 4097, "n_kv_heads"},
        {32, 5, "n_q_heads"},
        {32, 0, "default"},
        {36, 12, "head_dim"},
        {40, 0, "default"},
        {40, 24, "page_tokens"},
        {44, 0, "default"},
        {44, 9, "dtype"},
        {48, 1, "reserved"},
        {60, 1, "reserved"},
        {64 + 0, 2, "head_class[0]"},
        {64 + 32 + 4, KVT_SELECT_MAX_PAGES + 1, "top_k_pages[1]"},
        {64 + 64 + 8, 0, "window[2]"},
        {64 + 64 + 8, KVT_POLICY_MAX_WINDOW + 1, "window[2]"},
        {64 + 96 + 12, KVT_SELECT_MAX_PAGES + 1, "sink_pages[3]"},
        {64 + 128 + 16, KVT_SELECT_MAX_PAGES + 1, "local_pages[4]"},
        {64 + 160 + 20, 0, "rerank_interval[5] (layer 1, kv_head 2)"},
        {64 + 160 + 28, 1, "record 5"},
        {64 + 28, 3, "record 0"},
        /* rerank_similarity: NaN, below -1, above 1 (IEEE-754 bits). */
        {64 + 32 + 24, 0x7fc00000u, "rerank_similarity[1] (layer 0, kv_head 1)"},
        {64 + 64 + 24, 0xbf800001u, "rerank_similarity[2]"},
        {64 + 96 + 24, 0x3f800001u, "rerank_similarity[3]"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memcpy(b, good, n);
        put32(b + bad[i].off, bad[i].v);
        resign(b, n);
        kvt_clear_error();
        int rc = kvt_policy_load_buffer(b, n, NULL, &q);
        if (rc != KVT_ECORRUPT || !strstr(kvt_last_error(), bad[i].needle))
            fail_msg("offset %zu = %u: %s (%s), expected KVT_ECORRUPT naming '%s'", bad[i].off,
                     bad[i].v, kvt_err_name(rc), kvt_last_error(), bad[i].needle);
        assert_null(q);
    }
    /* Version 1 (no thresholds; its bytes 24..31 of a record are reserved)
     * still loads, every head at KVT_RERANK_SIMILARITY_DEFAULT; a non-zero
     * byte there is corrupt in version 1. */
    heads h1 = hd;
    for (uint32_t i = 0; i < h1.n; i++)
        h1.sim[i] = KVT_RERANK_SIMILARITY_DEFAULT;
    ref_file_v(b, &g, &hd, 1);
    TU_OK(kvt_policy_load_buffer(b, n, &g, &q));
    same_heads(q, &g, &h1);
    kvt_policy_destroy(q);
    put32(b + 64 + 24, 0x3f000000u);
    resign(b, n);
    TU_EXPECT_ERR(kvt_policy_load_buffer(b, n, &g, &q), KVT_ECORRUPT, "record 0");
    /* Bad magic, even with a correct checksum. */
    memcpy(b, good, n);
    b[0] = 'k';
    resign(b, n);
    TU_EXPECT_ERR(kvt_policy_load_buffer(b, n, NULL, &q), KVT_ECORRUPT, "magic");
}

static void test_file_errors(void **state)
{
    (void)state;
    make_tmpdir();
    kvt_geometry g = {1, 2, 2, 8, 8, KVT_DTYPE_F16, {0, 0}};
    kvt_policy *p, *q = (kvt_policy *)&g;
    TU_OK(kvt_policy_create(&g, NULL, &p));
    char path[160];
    snprintf(path, sizeof path, "%s/missing.kvtprof", tmpdir);
    TU_EXPECT_ERR(kvt_policy_load(path, NULL, &q), KVT_ENOENT, "missing.kvtprof");
    assert_null(q);
    TU_EXPECT_ERR(kvt_policy_load(tmpdir, NULL, &q), KVT_EINVAL, "regular file");
    snprintf(path, sizeof path, "%s/no/such/dir/p.kvtprof", tmpdir);
    TU_EXPECT_ERR(kvt_policy_save(p, path), KVT_EIO, "path");
    /* A damaged file names the file in the message. */
    snprintf(path, sizeof path, "%s/short.kvtprof", tmpdir);
    FILE *f = fopen(path, "wb");
    fwrite("KVTPROF\0\1\0\0", 1, 11, f);
    fclose(f);
    TU_EXPECT_ERR(kvt_policy_load(path, NULL, &q), KVT_ECORRUPT, "short.kvtprof");
    unlink(path);
    /* An empty file. */
    f = fopen(path, "wb");
    fclose(f);
    TU_EXPECT_ERR(kvt_policy_load(path, NULL, &q), KVT_ECORRUPT, "truncated");
    unlink(path);
    kvt_policy_destroy(p);
    rmdir(tmpdir);
    tmpdir[0] = '\0';
}

/* Every file of the fuzzer's corpus loads or fails cleanly; those that load
 * survive a save/load round trip unchanged. */
static void test_fuzz_corpus(void **state)
{
    (void)state;
    const char *dir = "tests/fuzz/corpus/policy_load";
    DIR *d = opendir(dir);
    if (!d)
        fail_msg("cannot open %s (run the tests from the source tree)", dir);
    uint32_t files = 0, valid = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        kvt_policy *p;
        int rc = kvt_policy_load(path, NULL, &p);
        files++;
        if (rc == 0) {
            valid++;
            size_t need;
            TU_OK(kvt_policy_save_buffer(p, NULL, 0, &need));
            uint8_t *b = malloc(need);
            TU_OK(kvt_policy_save_buffer(p, b, need, &need));
            FILE *f = fopen(path, "rb");
            uint8_t *fb = malloc(need + 1);
            size_t got = fread(fb, 1, need + 1, f);
            fclose(f);
            assert_int_equal(got, need);
            if (fb[8] == 1) {
                /* Version 1 is saved as version 2: the same bytes but the
                 * version, each record's threshold (the default) and the
                 * checksum. */
                for (size_t x = 64; x + 4 < need; x += 32) {
                    union {
                        float f;
                        uint32_t u;
                    } t = {KVT_RERANK_SIMILARITY_DEFAULT};
                    put32(fb + x + 24, t.u);
                }
                put32(fb + 8, 2);
                resign(fb, need);
            }
            assert_memory_equal(fb, b, need);
            free(fb);
            free(b);
            kvt_policy_destroy(p);
        } else if (rc != KVT_ECORRUPT && rc != KVT_EINVAL) {
            fail_msg("%s: %s (%s)", path, kvt_err_name(rc), kvt_last_error());
        }
    }
    closedir(d);
    assert_true(files >= 4);
    assert_true(valid >= 2);
}

/* ---- the step plan under a policy ---------------------------------------------------- */
#define SL 2
#define SH 4
#define SG 2
#define SD 16
#define SP 8
#define SN 8
#define SIV 4
#define SSTEPS 13

static kvt_pool *step_pool(kvt_seq_id *ids, uint32_t n, tu_rng *r)
{
    kvt_pool_opts o = tu_opts(SL, SH, SH * SG, SD, SP, KVT_DTYPE_F16, 4096, 0);
    o.n_threads = 2;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    for (uint32_t i = 0; i < n; i++) {
        TU_OK(kvt_seq_create(p, NULL, &ids[i]));
        const uint32_t T = 60 + 13 * i;
        float *kv = malloc((size_t)T * SH * SD * sizeof *kv);
        for (size_t e = 0; e < (size_t)T * SH * SD; e++)
            kv[e] = tu_unit(r);
        for (uint32_t l = 0; l < SL; l++)
            TU_OK(kvt_seq_append(p, ids[i], l, kv, kv, T, KVT_DTYPE_F32, 0));
        free(kv);
    }
    return p;
}

/* Forced pages of a head (sink, local, partial last page) of T tokens. */
static uint32_t n_forced(uint32_t T, uint32_t sink, uint32_t local)
{
    const uint32_t np = (T + SP - 1) / SP;
    uint32_t n = 0;
    for (uint32_t p = 0; p < np; p++)
        n += p < sink || p + local + (T % SP != 0) >= np;
    return n;
}

static void test_step_schedule(void **state)
{
    (void)state;
    tu_rng r = {0x5c4ed};
    kvt_seq_id ids[SN];
    kvt_pool *pool = step_pool(ids, SN, &r);
    kvt_geometry g;
    TU_OK(kvt_pool_geometry_get(pool, &g));
    heads hd = {.n = SL * SH};
    for (uint32_t i = 0; i < hd.n; i++) {
        hd.cls[i] = (i == 1 || i == 6) ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE;
        hd.k[i] = 2 + i % 3;
        hd.w[i] = 1;
        hd.sink[i] = i % 2;
        hd.local[i] = 1 + i % 2;
        hd.iv[i] = hd.cls[i] == KVT_HEAD_UNSTABLE ? 1 : SIV;
        hd.sim[i] = -1.0f; /* the interval alone (test_select_cache: the cache) */
    }
    kvt_policy *pol = policy_of(&g, &hd);
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, NULL, &sel)); /* its K 64 and interval 1 are overridden */
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.selector = sel;
    so.policy = pol;
    static uint8_t rr[SSTEPS][SN][SL * SH];
    float q[SN * SH * SG * SD], kv[SN * SH * SD];
    uint32_t pages[256];
    for (uint32_t step = 0; step < SSTEPS; step++) {
        kvt_step *st;
        TU_OK(kvt_step_plan(pool, ids, SN, &so, &st));
        for (uint32_t l = 0; l < SL; l++) {
            for (size_t e = 0; e < sizeof kv / sizeof kv[0]; e++)
                kv[e] = tu_unit(&r);
            for (size_t e = 0; e < sizeof q / sizeof q[0]; e++)
                q[e] = tu_unit(&r);
            TU_OK(kvt_step_append(st, l, kv, kv, KVT_DTYPE_F32, 0));
            TU_OK(kvt_step_select(st, l, q));
            for (uint32_t i = 0; i < SN; i++)
                for (uint32_t h = 0; h < SH; h++) {
                    const uint32_t b = l * SH + h;
                    uint32_t n, re = 9, T;
                    TU_OK(kvt_step_selection_get(st, l, i, h, pages, 256, &n, &re));
                    TU_OK(kvt_seq_length_get(pool, ids[i], l, &T));
                    assert_true(re <= 1);
                    rr[step][i][b] = (uint8_t)re;
                    if (re) { /* the policy's budget of this head */
                        const uint32_t np = (T + SP - 1) / SP;
                        const uint32_t f = n_forced(T, hd.sink[b], hd.local[b]);
                        const uint32_t want = f + (hd.k[b] < np - f ? hd.k[b] : np - f);
                        if (n != want)
                            fail_msg("step %u seq %u head %u: %u pages, policy K %u gives %u",
                                     step, i, b, n, hd.k[b], want);
                    }
                }
        }
        TU_OK(kvt_step_finish(st));
    }
    for (uint32_t i = 0; i < SN; i++)
        for (uint32_t b = 0; b < SL * SH; b++) {
            if (hd.cls[b] == KVT_HEAD_UNSTABLE) {
                for (uint32_t t = 0; t < SSTEPS; t++)
                    if (!rr[t][i][b])
                        fail_msg("unstable head %u of seq %u not reranked at step %u", b, i, t);
                continue;
            }
            if (!rr[0][i][b])
                fail_msg("stable head %u of seq %u: no rerank at its first step", b, i);
            for (uint32_t s0 = 1; s0 + SIV <= SSTEPS; s0++) {
                uint32_t c = 0;
                for (uint32_t t = s0; t < s0 + SIV; t++)
                    c += rr[t][i][b];
                if (c != 1)
                    fail_msg("stable head %u of seq %u: %u reranks in steps %u..%u (interval "
                             "%u)", b, i, c, s0, s0 + SIV - 1, SIV);
            }
            /* The stable heads of a sequence rerank together. */
            for (uint32_t t = 0; t < SSTEPS; t++)
                assert_int_equal(rr[t][i][b], rr[t][i][0]);
        }
    /* Staggered: at each later step about 1/interval of the sequences. */
    for (uint32_t t = 1; t < SSTEPS; t++) {
        uint32_t c = 0;
        for (uint32_t i = 0; i < SN; i++)
            c += rr[t][i][0];
        if (c < SN / SIV || c > (SN + SIV - 1) / SIV)
            fail_msg("step %u: %u of %u sequences rerank their stable heads (interval %u)", t,
                     c, SN, SIV);
    }
    TU_CHECK(pool);
    kvt_selector_destroy(sel);
    kvt_policy_destroy(pol);
    kvt_pool_destroy(pool);
}

/* The top-K part of a selection: without sink, local and a partial last
 * page; returns the candidate count np - forced. */
static uint32_t topk_part(const uint32_t *sel, uint32_t n, uint32_t T, uint32_t sink,
                          uint32_t local, uint32_t *out, uint32_t *nk)
{
    const uint32_t np = (T + SP - 1) / SP;
    *nk = 0;
    for (uint32_t j = 0; j < n; j++) {
        const uint32_t p = sel[j];
        if (!(p < sink || p + local + (T % SP != 0) >= np))
            out[(*nk)++] = p;
    }
    return np - n_forced(T, sink, local);
}

static void test_step_profiler(void **state)
{
    (void)state;
    tu_rng r = {0x9a0f};
    enum { N = 3, STEPS = 20 };
    kvt_seq_id ids[N];
    kvt_pool *pool = step_pool(ids, N, &r);
    kvt_geometry g;
    TU_OK(kvt_pool_geometry_get(pool, &g));
    kvt_selector_opts sopt = KVT_SELECTOR_OPTS_INIT;
    sopt.top_k_pages = 3;
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, &sopt, &sel));
    kvt_profiler_opts po;
    kvt_profiler_opts_init(&po);
    po.window_steps = 4;
    kvt_profiler *auto_p, *hand_p;
    TU_OK(kvt_profiler_create(&g, &po, &auto_p));
    TU_OK(kvt_profiler_create(&g, &po, &hand_p));
    kvt_step_opts so;
    kvt_step_opts_init(&so);
    so.selector = sel;
    so.profiler = auto_p;
    float q[N * SH * SG * SD], kv[N * SH * SD];
    uint32_t pages[256], part[256];
    for (uint32_t step = 0; step < STEPS; step++) {
        kvt_step *st;
        TU_OK(kvt_step_plan(pool, ids, N, &so, &st));
        for (uint32_t l = 0; l < SL; l++) {
            for (size_t e = 0; e < sizeof kv / sizeof kv[0]; e++)
                kv[e] = tu_unit(&r);
            TU_OK(kvt_step_append(st, l, kv, kv, KVT_DTYPE_F32, 0));
            /* Queries that move slowly for head 0, randomly for the rest. */
            for (size_t e = 0; e < sizeof q / sizeof q[0]; e++)
                q[e] = ((e / (SG * SD)) % SH == 0) ? 1.0f + 0.01f * tu_unit(&r) : tu_unit(&r);
            TU_OK(kvt_step_select(st, l, q));
            if (step % 3 == 0) /* selecting a layer again records nothing more */
                TU_OK(kvt_step_select(st, l, q));
            for (uint32_t i = 0; i < N; i++)
                for (uint32_t h = 0; h < SH; h++) {
                    uint32_t n, re, T, nk;
                    TU_OK(kvt_step_selection_get(st, l, i, h, pages, 256, &n, &re));
                    assert_int_equal(re, 1);
                    TU_OK(kvt_seq_length_get(pool, ids[i], l, &T));
                    const uint32_t nc = topk_part(pages, n, T, 1, 1, part, &nk);
                    TU_OK(kvt_profiler_record(hand_p, ids[i], l, h, part, nk, nc));
                }
        }
        TU_OK(kvt_step_finish(st));
    }
    /* A dense step records nothing. */
    kvt_step_opts dso = so;
    dso.flags = KVT_STEP_DENSE;
    dso.selector = NULL;
    kvt_step *st;
    TU_OK(kvt_step_plan(pool, ids, N, &dso, &st));
    TU_OK(kvt_step_select(st, 0, q));
    TU_OK(kvt_step_finish(st));
    for (uint32_t l = 0; l < SL; l++)
        for (uint32_t h = 0; h < SH; h++) {
            kvt_profiler_head_stats a = {.struct_size = sizeof a}, b = {.struct_size = sizeof b};
            TU_OK(kvt_profiler_head_get(auto_p, l, h, &a));
            TU_OK(kvt_profiler_head_get(hand_p, l, h, &b));
            assert_int_equal(a.records, (uint64_t)N * STEPS);
            assert_memory_equal(&a, &b, sizeof a);
        }
    kvt_profiler_destroy(auto_p);
    kvt_profiler_destroy(hand_p);
    kvt_selector_destroy(sel);
    TU_CHECK(pool);
    kvt_pool_destroy(pool);
}

static void test_step_bad(void **state)
{
    (void)state;
    tu_rng r = {0xbadd};
    kvt_seq_id ids[2];
    kvt_pool *pool = step_pool(ids, 2, &r);
    kvt_geometry g;
    TU_OK(kvt_pool_geometry_get(pool, &g));
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, NULL, &sel));
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.selector = sel;
    kvt_step *st = NULL;
    kvt_geometry og = g;
    og.dtype = KVT_DTYPE_BF16;
    kvt_policy *opol;
    TU_OK(kvt_policy_create(&og, NULL, &opol));
    so.policy = opol;
    TU_EXPECT_ERR(kvt_step_plan(pool, ids, 2, &so, &st), KVT_EINVAL, "opts->policy");
    assert_null(st);
    so.policy = NULL;
    og = g;
    og.n_layers = 3;
    kvt_profiler *oprof;
    TU_OK(kvt_profiler_create(&og, NULL, &oprof));
    so.profiler = oprof;
    TU_EXPECT_ERR(kvt_step_plan(pool, ids, 2, &so, &st), KVT_EINVAL, "n_layers");
    TU_EXPECT_ERR(kvt_step_plan(pool, ids, 2, &so, &st), KVT_EINVAL, "opts->profiler");
    so.profiler = NULL;
    /* One layout (0.1): a struct_size below it is refused, the step stays
     * unplanned. */
    so.struct_size = 24;
    st = NULL;
    TU_EXPECT_ERR(kvt_step_plan(pool, ids, 2, &so, &st), KVT_EINVAL, "struct_size");
    assert_null(st);
    so.struct_size = sizeof so;
    /* A policy needs a selector to score with, unless the step is dense. */
    kvt_policy *pol;
    TU_OK(kvt_policy_create(&g, NULL, &pol));
    kvt_step_opts so2 = KVT_STEP_OPTS_INIT;
    so2.policy = pol;
    TU_EXPECT_ERR(kvt_step_plan(pool, ids, 2, &so2, &st), KVT_EINVAL, "opts->selector");
    so2.flags = KVT_STEP_DENSE;
    TU_OK(kvt_step_plan(pool, ids, 2, &so2, &st));
    TU_OK(kvt_step_finish(st));
    /* A profiler with too few streams fails the plan, before the step opens. */
    kvt_profiler_opts po;
    kvt_profiler_opts_init(&po);
    po.max_streams = 1;
    kvt_profiler *small;
    TU_OK(kvt_profiler_create(&g, &po, &small));
    kvt_step_opts so3 = KVT_STEP_OPTS_INIT;
    so3.selector = sel;
    so3.profiler = small;
    TU_EXPECT_ERR(kvt_step_plan(pool, ids, 2, &so3, &st), KVT_ENOSPC, "max_streams");
    TU_OK(kvt_step_plan(pool, ids, 1, &so3, &st));
    TU_OK(kvt_step_finish(st));
    TU_CHECK(pool);
    kvt_profiler_destroy(small);
    kvt_policy_destroy(pol);
    kvt_profiler_destroy(oprof);
    kvt_policy_destroy(opol);
    kvt_selector_destroy(sel);
    kvt_pool_destroy(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_opts_and_uniform),
        cmocka_unit_test(test_create_heads),
        cmocka_unit_test(test_device_pages),
        cmocka_unit_test(test_describe),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_file_errors),
        cmocka_unit_test(test_fuzz_corpus),
        cmocka_unit_test(test_step_schedule),
        cmocka_unit_test(test_step_profiler),
        cmocka_unit_test(test_step_bad),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
