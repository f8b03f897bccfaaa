/* Pool capacity, the null block, ENOSPC without loss, NUMA placement,
 * sequence slots and ids, and NULL / released handles everywhere. */
#include "testutil.h"

static void test_capacity_and_stats(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(2, 4, 8, 64, 16, KVT_DTYPE_F16, 33, 17);
    o.device_bytes += 100; /* partial blocks are rounded down */
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_stats s = {.struct_size = sizeof s};
    TU_OK(kvt_pool_stats_get(p, &s));
    uint64_t bb = 2ull * 16 * 64 * 2;
    assert_int_equal(s.block_bytes, bb);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].blocks_total, 32);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].blocks_free, 32);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].bytes_total, 32 * bb);
    assert_int_equal(s.tier[KVT_TIER_HOST].blocks_total, 16);
    assert_int_equal(s.tier[KVT_TIER_DISK].blocks_total, 0);
    assert_int_equal(s.meta_pages_total, 48);
    assert_int_equal(s.meta_bytes_total, 49ull * 3 * 64 * 2);
    assert_int_equal(s.n_seqs, 0);
    for (uint32_t d = 0; d < KVT_NUM_DIRS; d++)
        assert_int_equal(s.moved_bytes[d] + s.moved_requests[d], 0);

    kvt_seq_id q;
    TU_OK(kvt_seq_create(p, NULL, &q));
    uint16_t kv[33 * 4 * 64] = {0};
    TU_OK(kvt_seq_append(p, q, 0, kv, kv, 33, KVT_DTYPE_F16, 0)); /* 3 pages x 4 heads */
    TU_OK(kvt_seq_append(p, q, 1, kv, kv, 5, KVT_DTYPE_F16, 0));  /* 1 page x 4 heads */
    TU_OK(kvt_pool_stats_get(p, &s));
    assert_int_equal(s.tier[KVT_TIER_DEVICE].blocks_used, 16);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].blocks_free, 16);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].bytes_used, 16 * bb);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].pages, 16);
    assert_int_equal(s.meta_pages_used, 16);
    assert_int_equal(s.n_seqs, 1);
    assert_int_equal(s.n_tokens, 5);
    TU_CHECK(p);
    TU_OK(kvt_seq_release(p, q));
    TU_OK(kvt_pool_stats_get(p, &s));
    assert_int_equal(s.tier[KVT_TIER_DEVICE].blocks_used, 0);
    assert_int_equal(s.meta_pages_used, 0);
    assert_int_equal(s.n_seqs, 0);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

/* Fills the device tier exactly, then asks for more: KVT_ENOSPC, nothing
 * lost, the null block never handed out, and space returns on release. */
static void test_full_device_tier(void **state)
{
    (void)state;
    enum { H = 2, D = 8, P = 8, BLOCKS = 9 }; /* 8 usable blocks */
    kvt_pool_opts o = tu_opts(1, H, H, D, P, KVT_DTYPE_F32, BLOCKS, 0);
    kvt_pool *p;
    kvt_seq_id a, b;
    TU_OK(kvt_pool_create(&o, &p));
    TU_OK(kvt_seq_create(p, NULL, &a));
    TU_OK(kvt_seq_create(p, NULL, &b));
    float k[32 * H * D], v[32 * H * D];
    tu_rng r = {5};
    for (size_t i = 0; i < 32 * H * D; i++) {
        k[i] = tu_unit(&r);
        v[i] = tu_unit(&r);
    }
    TU_OK(kvt_seq_append(p, a, 0, k, v, 30, KVT_DTYPE_F32, 0)); /* 4 pages x 2 heads */
    uint32_t dev[4];
    uint8_t used[BLOCKS] = {0};
    for (uint32_t h = 0; h < H; h++) {
        TU_OK(kvt_seq_block_table_get(p, a, 0, h, 0, 4, dev, NULL, NULL));
        for (int i = 0; i < 4; i++) {
            assert_true(dev[i] >= 1 && dev[i] < BLOCKS);
            assert_false(used[dev[i]]);
            used[dev[i]] = 1;
        }
    }
    /* The last page still has room for 2 tokens: no new block needed. */
    TU_OK(kvt_seq_append(p, a, 0, k + 30 * H * D, v + 30 * H * D, 2, KVT_DTYPE_F32, 0));
    TU_EXPECT_ERR(kvt_seq_append(p, a, 0, k, v, 1, KVT_DTYPE_F32, 0), KVT_ENOSPC,
                  "device tier");
    TU_EXPECT_ERR(kvt_seq_append(p, b, 0, k, v, 1, KVT_DTYPE_F32, 0), KVT_ENOSPC,
                  "device tier");
    TU_CHECK(p);
    uint32_t n;
    TU_OK(kvt_seq_length_get(p, a, 0, &n));
    assert_int_equal(n, 32);
    TU_OK(kvt_seq_length_get(p, b, 0, &n));
    assert_int_equal(n, 0);
    float back[32 * D];
    for (uint32_t h = 0; h < H; h++) {
        TU_OK(kvt_seq_read_kv(p, a, 0, h, 0, 32, NULL, back));
        for (uint32_t t = 0; t < 32; t++)
            assert_memory_equal(back + t * D, v + (t * H + h) * D, D * sizeof(float));
    }
    kvt_stats s = {.struct_size = sizeof s};
    TU_OK(kvt_pool_stats_get(p, &s));
    assert_int_equal(s.tier[KVT_TIER_DEVICE].blocks_free, 0);
    /* Release frees space for the other sequence. */
    TU_OK(kvt_seq_release(p, a));
    TU_OK(kvt_seq_append(p, b, 0, k, v, 32, KVT_DTYPE_F32, 0));
    TU_EXPECT_ERR(kvt_seq_append(p, b, 0, k, v, 1, KVT_DTYPE_F32, 0), KVT_ENOSPC, "device");
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

static void test_numa_and_hugepages(void **state)
{
    (void)state;
    const kvt_numa_policy pol[3] = {KVT_NUMA_LOCAL, KVT_NUMA_NODE, KVT_NUMA_INTERLEAVE};
    for (int i = 0; i < 3; i++) {
        kvt_pool_opts o = tu_opts(1, 1, 1, 64, 16, KVT_DTYPE_F16, 64, 1024);
        o.host_numa = pol[i];
        o.host_numa_node = 0;
        o.flags = i == 2 ? KVT_POOL_HUGEPAGES : 0;
        kvt_pool *p;
        TU_OK(kvt_pool_create(&o, &p));
        kvt_stats s = {.struct_size = sizeof s};
        TU_OK(kvt_pool_stats_get(p, &s));
        assert_int_equal(s.tier[KVT_TIER_HOST].blocks_total, 1023);
        TU_CHECK(p);
        kvt_pool_destroy(p);
    }
}

static void test_seq_slots_and_ids(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(1, 1, 1, 8, 8, KVT_DTYPE_F16, 16, 0);
    o.max_seqs = 4;
    kvt_pool *p;
    kvt_seq_id s[5];
    TU_OK(kvt_pool_create(&o, &p));
    for (int i = 0; i < 4; i++) {
        TU_OK(kvt_seq_create(p, NULL, &s[i]));
        assert_int_not_equal(s[i], KVT_SEQ_NONE);
        for (int j = 0; j < i; j++)
            assert_int_not_equal(s[i], s[j]);
    }
    TU_EXPECT_ERR(kvt_seq_create(p, NULL, &s[4]), KVT_ENOSPC, "max_seqs");
    TU_OK(kvt_seq_release(p, s[1]));
    TU_OK(kvt_seq_create(p, NULL, &s[4]));
    /* The slot is reused, but the old id stays dead. */
    assert_int_not_equal(s[4], s[1]);
    TU_EXPECT_ERR(kvt_seq_release(p, s[1]), KVT_ENOENT, "released");
    TU_EXPECT_ERR(kvt_seq_release(p, KVT_SEQ_NONE), KVT_ENOENT, "seq");
    TU_EXPECT_ERR(kvt_seq_release(p, (kvt_seq_id)99), KVT_ENOENT, "seq");
    TU_CHECK(p);
    kvt_pool_destroy(p); /* live sequences are released with the pool */
}

/* An id is only valid in the pool that made it: using it on another pool
 * must not touch that pool's own sequences. */
static void test_ids_are_per_pool(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(1, 1, 1, 8, 8, KVT_DTYPE_F16, 16, 0);
    kvt_pool *a, *b;
    kvt_seq_id sa, sb;
    TU_OK(kvt_pool_create(&o, &a));
    TU_OK(kvt_pool_create(&o, &b));
    TU_OK(kvt_seq_create(a, NULL, &sa));
    TU_OK(kvt_seq_create(b, NULL, &sb));
    assert_int_not_equal(sa, sb);
    uint32_t n;
    TU_EXPECT_ERR(kvt_seq_release(b, sa), KVT_ENOENT, "seq");
    TU_EXPECT_ERR(kvt_seq_length_get(a, sb, 0, &n), KVT_ENOENT, "seq");
    TU_OK(kvt_seq_length_get(b, sb, 0, &n)); /* b's own sequence is still there */
    TU_OK(kvt_seq_release(b, sb));
    TU_OK(kvt_seq_release(a, sa));
    TU_CHECK(a);
    TU_CHECK(b);
    kvt_pool_destroy(a);
    kvt_pool_destroy(b);
}

static void test_released_sequence(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(1, 2, 2, 8, 8, KVT_DTYPE_F16, 16, 0);
    kvt_pool *p;
    kvt_seq_id s;
    TU_OK(kvt_pool_create(&o, &p));
    TU_OK(kvt_seq_create(p, NULL, &s));
    uint16_t kv[2 * 8] = {0};
    TU_OK(kvt_seq_append(p, s, 0, kv, kv, 1, KVT_DTYPE_F16, 0));
    TU_OK(kvt_seq_release(p, s));
    uint32_t n, blk;
    float m[8];
    kvt_seq_info in = {.struct_size = sizeof in};
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, kv, kv, 1, KVT_DTYPE_F16, 0), KVT_ENOENT, "seq");
    TU_EXPECT_ERR(kvt_seq_release(p, s), KVT_ENOENT, "seq");
    TU_EXPECT_ERR(kvt_seq_length_get(p, s, 0, &n), KVT_ENOENT, "seq");
    TU_EXPECT_ERR(kvt_seq_info_get(p, s, &in), KVT_ENOENT, "seq");
    TU_EXPECT_ERR(kvt_seq_block_table_get(p, s, 0, 0, 0, 1, &blk, NULL, NULL), KVT_ENOENT, "seq");
    TU_EXPECT_ERR(kvt_seq_read_kv(p, s, 0, 0, 0, 1, kv, NULL), KVT_ENOENT, "seq");
    TU_EXPECT_ERR(kvt_seq_page_meta_get(p, s, 0, 0, 0, m, NULL, NULL), KVT_ENOENT, "seq");
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

static void test_null_arguments(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(1, 1, 1, 8, 8, KVT_DTYPE_F16, 16, 0);
    kvt_pool *p;
    kvt_seq_id s;
    TU_OK(kvt_pool_create(&o, &p));
    TU_OK(kvt_seq_create(p, NULL, &s));
    kvt_stats st = {.struct_size = sizeof st};
    kvt_seq_info in = {.struct_size = sizeof in};
    kvt_geometry g;
    uint32_t n;
    float m[8];
    uint16_t kv[8];
    TU_EXPECT_ERR(kvt_pool_geometry_get(NULL, &g), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_pool_geometry_get(p, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_pool_stats_get(NULL, &st), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_pool_stats_get(p, NULL), KVT_EINVAL, "stats");
    TU_EXPECT_ERR(kvt_pool_check(NULL), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_create(NULL, NULL, &s), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_create(p, NULL, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_seq_release(NULL, s), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_info_get(NULL, s, &in), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_info_get(p, s, NULL), KVT_EINVAL, "info");
    TU_EXPECT_ERR(kvt_seq_length_get(NULL, s, 0, &n), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_read_kv(NULL, s, 0, 0, 0, 1, kv, NULL), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_page_meta_get(NULL, s, 0, 0, 0, m, NULL, NULL), KVT_EINVAL, "pool");
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_capacity_and_stats), cmocka_unit_test(test_full_device_tier),
        cmocka_unit_test(test_numa_and_hugepages), cmocka_unit_test(test_seq_slots_and_ids),
        cmocka_unit_test(test_released_sequence),  cmocka_unit_test(test_null_arguments),
        cmocka_unit_test(test_ids_are_per_pool),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
