/* Options structs and geometry: defaults, versioned struct_size, and every
 * kind of bad value rejected with KVT_EINVAL (or EOVERFLOW/ENOMEM/ENOTSUP)
 * and a message naming the field. */
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

static kvt_pool_opts base_opts(void)
{
    return tu_opts(2, 2, 4, 64, 16, KVT_DTYPE_F16, 64, 0);
}

static void test_opts_init(void **state)
{
    (void)state;
    kvt_pool_opts o;
    memset(&o, 0xab, sizeof o);
    TU_OK(kvt_pool_opts_init(&o));
    assert_int_equal(o.struct_size, sizeof o);
    assert_int_equal(o.backend, KVT_BACKEND_AUTO);
    assert_int_equal(o.geom.page_tokens, 16);
    assert_int_equal(o.geom.dtype, KVT_DTYPE_F16);
    assert_int_equal(o.max_seqs, KVT_MAX_SEQS_DEFAULT);
    assert_int_equal(o.max_seq_tokens, KVT_MAX_SEQ_TOKENS_DEFAULT);
    assert_int_equal(o.device_bytes, 0);
    assert_null(o.disk_dir);
    TU_EXPECT_ERR(kvt_pool_opts_init(NULL), KVT_EINVAL, "opts");

    /* The macro form: zero fields mean defaults at create time. */
    kvt_pool_opts m = KVT_POOL_OPTS_INIT;
    assert_int_equal(m.struct_size, sizeof m);
    m.geom.n_layers = 1;
    m.geom.n_kv_heads = 1;
    m.geom.head_dim = 8;
    m.device_bytes = 1 << 20;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&m, &p));
    kvt_geometry g;
    TU_OK(kvt_pool_geometry_get(p, &g));
    assert_int_equal(g.page_tokens, 16);
    assert_int_equal(g.dtype, KVT_DTYPE_F16);
    assert_int_equal(g.n_q_heads, 1);
    kvt_pool_destroy(p);

    kvt_seq_opts so;
    TU_OK(kvt_seq_opts_init(&so));
    assert_int_equal(so.struct_size, sizeof so);
    assert_int_equal(so.max_tokens, 0);
    TU_EXPECT_ERR(kvt_seq_opts_init(NULL), KVT_EINVAL, "opts");
    kvt_seq_opts sm = KVT_SEQ_OPTS_INIT;
    assert_int_equal(sm.struct_size, sizeof sm);
}

static void test_struct_size(void **state)
{
    (void)state;
    kvt_pool *p = NULL;
    kvt_pool_opts o = base_opts();
    o.struct_size = 4;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "struct_size");
    o.struct_size = 0;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "struct_size");
    o.struct_size = offsetof(kvt_pool_opts, prefix_cache_bytes) - 1; /* below the first layout */
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "struct_size");
    assert_null(p);
    o.struct_size = offsetof(kvt_pool_opts, prefix_cache_bytes); /* the first layout (0.1) */
    TU_OK(kvt_pool_create(&o, &p));
    kvt_pool_destroy(p);
    p = NULL;

    /* A newer caller's larger struct: accepted while the unknown tail is 0. */
    struct {
        kvt_pool_opts o;
        uint64_t future[4];
    } big;
    memset(&big, 0, sizeof big);
    big.o = base_opts();
    big.o.struct_size = sizeof big;
    TU_OK(kvt_pool_create(&big.o, &p));
    kvt_pool_destroy(p);
    big.future[2] = 1;
    TU_EXPECT_ERR(kvt_pool_create(&big.o, &p), KVT_EINVAL, "struct_size");

    /* Sequence options the same way. */
    o = base_opts();
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_opts so = KVT_SEQ_OPTS_INIT;
    kvt_seq_id s = 42;
    so.struct_size = 3;
    TU_EXPECT_ERR(kvt_seq_create(p, &so, &s), KVT_EINVAL, "struct_size");
    assert_int_equal(s, KVT_SEQ_NONE);
    struct {
        kvt_seq_opts o;
        uint32_t extra;
    } bs;
    memset(&bs, 0, sizeof bs); /* padding too: unknown tail bytes must be zero */
    bs.o.struct_size = sizeof bs;
    bs.extra = 7;
    TU_EXPECT_ERR(kvt_seq_create(p, &bs.o, &s), KVT_EINVAL, "struct_size");
    bs.extra = 0;
    TU_OK(kvt_seq_create(p, &bs.o, &s));

    /* Output structs: too small rejected, a larger one gets its tail zeroed. */
    kvt_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = 8;
    TU_EXPECT_ERR(kvt_pool_stats_get(p, &st), KVT_EINVAL, "struct_size");
    struct {
        kvt_stats s;
        uint64_t tail[3];
    } bst;
    memset(&bst, 0xff, sizeof bst);
    bst.s.struct_size = sizeof bst;
    TU_OK(kvt_pool_stats_get(p, &bst.s));
    assert_int_equal(bst.tail[0], 0);
    assert_int_equal(bst.tail[2], 0);
    assert_int_equal(bst.s.n_seqs, 1);
    kvt_seq_info si;
    si.struct_size = 2;
    TU_EXPECT_ERR(kvt_seq_info_get(p, s, &si), KVT_EINVAL, "struct_size");
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

struct geom_case {
    uint32_t L, H, Hq, D, P, dt, res;
    const char *field;
};

static void test_geometry_bad(void **state)
{
    (void)state;
    static const struct geom_case cases[] = {
        {0, 2, 2, 64, 16, 1, 0, "n_layers"},   {5000, 2, 2, 64, 16, 1, 0, "n_layers"},
        {2, 0, 0, 64, 16, 1, 0, "n_kv_heads"}, {2, 4, 6, 64, 16, 1, 0, "n_q_heads"},
        {2, 4, 2, 64, 16, 1, 0, "n_q_heads"},  {2, 2, 2, 12, 16, 1, 0, "head_dim"},
        {2, 2, 2, 0, 16, 1, 0, "head_dim"},    {2, 2, 2, 4, 16, 1, 0, "head_dim"},
        {2, 2, 2, 1032, 16, 1, 0, "head_dim"}, {2, 2, 2, 64, 24, 1, 0, "page_tokens"},
        {2, 2, 2, 64, 4, 1, 0, "page_tokens"}, {2, 2, 2, 64, 512, 1, 0, "page_tokens"},
        {2, 2, 2, 64, 7, 1, 0, "page_tokens"}, {2, 2, 2, 64, 16, 9, 0, "dtype"},
        {2, 2, 2, 64, 16, 1, 1, "reserved"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const struct geom_case *c = &cases[i];
        kvt_geometry g = {c->L, c->H, c->Hq, c->D, c->P, c->dt, {c->res, 0}};
        TU_EXPECT_ERR(kvt_geometry_validate(&g), KVT_EINVAL, c->field);
        uint64_t bb = 99;
        TU_EXPECT_ERR(kvt_geometry_block_bytes(&g, &bb), KVT_EINVAL, c->field);
        kvt_pool_opts o = base_opts();
        o.geom = g;
        kvt_pool *p = (kvt_pool *)&o;
        TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, c->field);
        assert_null(p);
    }
    TU_EXPECT_ERR(kvt_geometry_validate(NULL), KVT_EINVAL, "geom");
    kvt_geometry ok = {1, 1, 0, 8, 0, 0, {0, 0}};
    TU_EXPECT_ERR(kvt_geometry_block_bytes(&ok, NULL), KVT_EINVAL, "out");
}

static void test_geometry_good(void **state)
{
    (void)state;
    /* Block bytes by the definition 2 * P * D * elem for every legal P. */
    for (uint32_t P = 8; P <= 256; P *= 2)
        for (uint32_t dt = 1; dt <= 3; dt++) {
            kvt_geometry g = {3, 2, 8, 128, P, dt, {0, 0}};
            uint64_t bb;
            TU_OK(kvt_geometry_validate(&g));
            TU_OK(kvt_geometry_block_bytes(&g, &bb));
            assert_int_equal(bb, 2ull * P * 128 * (dt == 3 ? 4 : 2));
        }
    kvt_geometry d = {1, 1, 0, 128, 0, 0, {0, 0}};
    uint64_t bb;
    TU_OK(kvt_geometry_block_bytes(&d, &bb));
    assert_int_equal(bb, 2 * 16 * 128 * 2); /* defaults: P=16, f16 = 8 KiB */
}

static void test_pool_opts_bad(void **state)
{
    (void)state;
    kvt_pool *p = NULL;
    kvt_pool_opts o;
    uint64_t bb = 2ull * 16 * 64 * 2;

    TU_EXPECT_ERR(kvt_pool_create(&o, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_pool_create(NULL, &p), KVT_EINVAL, "opts");

    o = base_opts(); o.device_bytes = 0;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "device_bytes");
    o = base_opts(); o.device_bytes = bb + bb / 2; /* one block: only the null block */
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "device_bytes");
    o = base_opts(); o.device_bytes = UINT64_MAX; /* block count past 32 bits */
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EOVERFLOW, "device_bytes");
    o = base_opts(); o.host_bytes = UINT64_MAX - 5;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EOVERFLOW, "host_bytes");
    o = base_opts(); o.host_bytes = bb;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "host_bytes");
    /* Huge but representable: 2^31 blocks of 4 KiB = 8 TiB cannot be mapped. */
    o = base_opts(); o.device_bytes = (1ull << 31) * bb;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_ENOMEM, "device_bytes");
    o = base_opts(); o.host_bytes = (1ull << 31) * bb;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_ENOMEM, "host_bytes");
    o = base_opts(); o.backend = 7;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "backend");
    o = base_opts(); o.flags = 0x80;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "flags");
    o = base_opts(); o.host_numa = 9;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "host_numa");
    o = base_opts(); o.host_numa = KVT_NUMA_NODE; o.host_numa_node = 4096;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "host_numa_node");
    o = base_opts(); o.host_numa = KVT_NUMA_NODE; o.host_numa_node = -2;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "host_numa_node");
    o = base_opts(); o.max_seqs = KVT_MAX_SEQS_LIMIT + 1;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "max_seqs");
    o = base_opts(); o.max_seq_tokens = KVT_MAX_SEQ_TOKENS_LIMIT + 1;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "max_seq_tokens");
    o = base_opts(); o.n_threads = 100000;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "n_threads");
    assert_null(p);
}

static void test_disk_and_backend(void **state)
{
    (void)state;
    kvt_pool *p = NULL;
    kvt_pool_opts o = base_opts();
    o.disk_bytes = 1 << 20;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "disk_dir");
    o = base_opts();
    o.disk_dir = "/tmp";
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "disk_bytes");
    o.disk_bytes = 1 << 20;
    o.disk_dir = "/nonexistent/kvtier-dir";
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "disk_dir");
    o.disk_dir = "/etc/passwd"; /* exists, not a directory */
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "disk_dir");
    char dir[] = "/tmp/kvt-opts-XXXXXX";
    assert_non_null(mkdtemp(dir));
    o.disk_dir = dir;
    /* The disk tier needs a host tier to cache over it. */
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "host_bytes");
    o.host_bytes = 64 << 20;
    /* 1 MiB holds no whole segment (16 extents x 64 pages x 4 KiB slots). */
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "disk_bytes");
    assert_null(p);
    o.disk_bytes = 8u << 20;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_stats st0 = {.struct_size = sizeof st0};
    TU_OK(kvt_pool_stats_get(p, &st0));
    /* Two whole 4 MiB segments: 2 x 16 x 64 page slots. */
    assert_int_equal(st0.tier[KVT_TIER_DISK].blocks_total, 2 * 16 * 64);
    assert_int_equal(st0.tier[KVT_TIER_DISK].blocks_used, 0);
    kvt_pool_destroy(p);
    p = NULL;
    rmdir(dir); /* succeeds only if the pool left no file behind */
    assert_int_equal(access(dir, F_OK), -1);

    /* The CUDA backend: a build without it says so; a CUDA build without a
     * usable device (this machine) returns the CUDA error; with a device the
     * device-only pool is created (tests/gpu/test_cu_pool compares such a
     * pool with the CPU backend). */
    o = base_opts();
    o.backend = KVT_BACKEND_CUDA;
    kvt_clear_error();
    int rc = kvt_pool_create(&o, &p);
    if (!(kvt_build_features() & KVT_FEATURE_CUDA)) {
        assert_int_equal(rc, KVT_ENOTSUP);
        assert_non_null(strstr(kvt_last_error(), "no CUDA backend"));
        assert_null(p);
    } else if (rc) {
        assert_int_equal(rc, KVT_ENOTSUP);
        assert_non_null(strstr(kvt_last_error(), "cudaError"));
        assert_null(p);
    } else {
        kvt_stats sc = {.struct_size = sizeof sc};
        TU_OK(kvt_pool_stats_get(p, &sc));
        assert_int_equal(sc.backend, KVT_BACKEND_CUDA);
        kvt_pool_destroy(p);
        p = NULL;
    }
    o.backend = KVT_BACKEND_AUTO;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_stats st = {.struct_size = sizeof st};
    TU_OK(kvt_pool_stats_get(p, &st));
    assert_int_equal(st.backend, KVT_BACKEND_CPU);
    kvt_pool_destroy(p);
    kvt_pool_destroy(NULL); /* accepted */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_opts_init),        cmocka_unit_test(test_struct_size),
        cmocka_unit_test(test_geometry_bad),     cmocka_unit_test(test_geometry_good),
        cmocka_unit_test(test_pool_opts_bad),    cmocka_unit_test(test_disk_and_backend),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
