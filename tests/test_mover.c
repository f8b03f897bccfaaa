/* The tier mover and the disk tier through the public API: byte-exact round
 * trips device -> host -> disk -> host -> device under a random workload
 * with kvt_pool_check after every step, coalescing, host eviction, full
 * tiers, directory errors, two pools in one directory, destroy and release
 * while moves are in flight. The reference is the f16 bit patterns the test
 * appended (f16 -> f16 storage is the identity). */
#include <math.h>
#include <stdbool.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tiertest.h"

/* ---- a fixed round trip ---------------------------------------------------- */
static void test_round_trip(void **state)
{
    (void)state;
    const kvt_mover_opts mo = tier_mover_opts(4, 2);
    tier_fx fx;
    tier_fx_open(&fx, 64, 32, 4u << 20, &mo, 7);
    tseq *t = tier_fx_add(&fx, 5 * PAGE_TOKENS + 3); /* 5 full pages and a partial one per head */

    const kvt_tier path[][2] = {{KVT_TIER_DEVICE, KVT_TIER_HOST},
                                {KVT_TIER_HOST, KVT_TIER_DISK},
                                {KVT_TIER_DISK, KVT_TIER_HOST},
                                {KVT_TIER_HOST, KVT_TIER_DEVICE}};
    for (int hop = 0; hop < 4; hop++) {
        kvt_move mv[N_LAYERS * N_KV_HEADS * 5];
        int32_t res[N_LAYERS * N_KV_HEADS * 5];
        uint32_t n = 0;
        for (uint32_t l = 0; l < N_LAYERS; l++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++)
                for (uint32_t pg = 0; pg < 5; pg++)
                    mv[n++] = (kvt_move){t->id, l, h, pg, path[hop][0], path[hop][1],
                                         KVT_MOVE_DROP_SOURCE};
        kvt_fence f;
        memset(res, 0x7f, sizeof res);
        TU_OK(kvt_mover_submit(fx.m, mv, n, 0, res, &f));
        assert_true(f > 0);
        TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
        for (uint32_t i = 0; i < n; i++) {
            assert_int_equal(res[i], 0);
            uint8_t want = (uint8_t)(1u << path[hop][1]);
            assert_int_equal(residency(fx.p, t->id, mv[i].layer, mv[i].kv_head, mv[i].page), want);
        }
        TU_CHECK(fx.p);
        tseq_verify(fx.p, t); /* hop 2 reads the disk-only pages synchronously */
        /* The same fence again: reported already, 0. */
        TU_OK(kvt_mover_poll(fx.m, f));
    }
    /* The partial last page never left the device. */
    assert_int_equal(residency(fx.p, t->id, 0, 0, 5), KVT_RES_DEVICE);

    kvt_stats st = {.struct_size = sizeof st};
    TU_OK(kvt_pool_stats_get(fx.p, &st));
    const uint64_t n = N_LAYERS * N_KV_HEADS * 5, bb = st.block_bytes;
    assert_int_equal(st.moved_requests[KVT_DIR_DEVICE_TO_HOST], n);
    assert_int_equal(st.moved_requests[KVT_DIR_HOST_TO_DISK], n);
    assert_int_equal(st.moved_requests[KVT_DIR_DISK_TO_HOST], n);
    assert_int_equal(st.moved_requests[KVT_DIR_HOST_TO_DEVICE], n);
    assert_int_equal(st.moved_bytes[KVT_DIR_HOST_TO_DISK], n * bb);
    kvt_mover_stats ms = {.struct_size = sizeof ms};
    TU_OK(kvt_mover_stats_get(fx.m, &ms));
    assert_int_equal(ms.moves_in_flight, 0);
    assert_int_equal(ms.disk_read_bytes, n * bb);
    assert_int_equal(ms.disk_write_bytes, n * bb);
    assert_int_equal(ms.checksum_errors + ms.io_errors, 0);
    /* Five pages of one (seq, layer, head) sit in two 4-page extents; with
     * the extents adjacent they coalesce: at most 2 requests per head. */
    assert_true(ms.disk_reads <= 2 * N_LAYERS * N_KV_HEADS);
    assert_true(ms.disk_writes <= 2 * N_LAYERS * N_KV_HEADS);

    TU_OK(kvt_seq_release(fx.p, t->id));
    TU_CHECK(fx.p);
    tier_fx_close(&fx);
    assert_int_equal(count_dir_entries(), 0);
}

/* Pages smaller than the 4 KiB I/O unit take a padded slot (the CRC covers
 * the page, not the padding): they round-trip byte for byte. */
static void test_small_pages(void **state)
{
    (void)state;
    enum { SD = 16, SP = 16, NT = 10 * SP };
    kvt_pool_opts o = tu_opts(1, 1, 1, SD, SP, KVT_DTYPE_F16, 32, 16); /* 1 KiB blocks */
    o.disk_dir = g_dir;
    o.disk_bytes = 8u << 20;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_mover *m = mover_of(p);
    kvt_seq_id id;
    TU_OK(kvt_seq_create(p, NULL, &id));
    tu_rng r = {8};
    static uint16_t k[NT * SD], v[NT * SD], k2[NT * SD], v2[NT * SD];
    for (int i = 0; i < NT * SD; i++) {
        k[i] = rand_f16(&r);
        v[i] = rand_f16(&r);
    }
    TU_OK(kvt_seq_append(p, id, 0, k, v, NT, KVT_DTYPE_F16, 0));
    kvt_move mv[10];
    kvt_fence f;
    const kvt_tier hops[][2] = {{KVT_TIER_DEVICE, KVT_TIER_DISK}, {KVT_TIER_DISK, KVT_TIER_HOST},
                                {KVT_TIER_HOST, KVT_TIER_DISK}, {KVT_TIER_DISK, KVT_TIER_DEVICE}};
    for (int h = 0; h < 4; h++) {
        for (uint32_t i = 0; i < 10; i++)
            mv[i] = (kvt_move){id, 0, 0, i, hops[h][0], hops[h][1],
                               h == 2 ? 0u : KVT_MOVE_DROP_SOURCE};
        TU_OK(kvt_mover_submit(m, mv, 10, 0, NULL, &f));
        TU_OK(kvt_mover_wait(m, f, UINT64_MAX));
        TU_CHECK(p);
        TU_OK(kvt_seq_read_kv(p, id, 0, 0, 0, NT, k2, v2));
        assert_memory_equal(k, k2, sizeof k);
        assert_memory_equal(v, v2, sizeof v);
    }
    for (uint32_t i = 0; i < 10; i++)
        assert_int_equal(residency(p, id, 0, 0, i), KVT_RES_DEVICE | KVT_RES_HOST);
    kvt_mover_stats ms = {.struct_size = sizeof ms};
    TU_OK(kvt_mover_stats_get(m, &ms));
    assert_int_equal(ms.disk_read_bytes, 2u * 10 * 4096); /* padded 4 KiB slots */
    kvt_pool_destroy(p);
}

/* ---- a random workload ------------------------------------------------------ */
static void test_random_workload(void **state)
{
    (void)state;
    kvt_mover_opts mo = tier_mover_opts(4, 2);
    mo.queue_depth = 8;
    mo.max_io_bytes = 32 << 10;
    mo.copy_threads = 2;
    tier_fx fx;
    tier_fx_open(&fx, 400, 40, 6u << 20, &mo, 2024);
    enum { NS = 3 };
    for (int i = 0; i < NS; i++)
        tier_fx_add(&fx, 1 + tu_below(&fx.r, 6 * PAGE_TOKENS));
    uint32_t refused = 0, done = 0;
    for (int step = 0; step < 300; step++) {
        int what = (int)tu_below(&fx.r, 10);
        if (what == 0) { /* grow a sequence */
            tseq *s = &fx.t[tu_below(&fx.r, NS)];
            uint32_t add = 1 + tu_below(&fx.r, 2 * PAGE_TOKENS);
            if (s->n + add <= MAXTOK)
                tseq_append(fx.p, s, add, &fx.r);
        } else if (what == 1 && step % 7 == 0) { /* replace a sequence */
            tseq *s = &fx.t[tu_below(&fx.r, NS)];
            TU_OK(kvt_seq_release(fx.p, s->id));
            s->n = 0;
            TU_OK(kvt_seq_create(fx.p, NULL, &s->id));
            tseq_append(fx.p, s, 1 + tu_below(&fx.r, 4 * PAGE_TOKENS), &fx.r);
        } else { /* a batch of moves */
            kvt_move mv[24];
            uint32_t n = random_batch(fx.p, fx.t, NS, &fx.r, mv, NULL, 24);
            int32_t out[24];
            kvt_fence f;
            int rc = kvt_mover_submit(fx.m, mv, n, tu_below(&fx.r, 4) == 0 ? KVT_SUBMIT_URGENT : 0,
                                      out, &f);
            if (rc == KVT_ENOSPC) {
                refused++; /* a full tier: nothing happened */
            } else {
                assert_int_equal(rc, 0);
                if (tu_below(&fx.r, 3) == 0) {
                    int prc;
                    while ((prc = kvt_mover_poll(fx.m, f)) == KVT_EAGAIN)
                        TU_CHECK(fx.p); /* consistent while moves are in flight */
                    assert_int_equal(prc, 0);
                } else {
                    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
                }
                for (uint32_t i = 0; i < n; i++) {
                    assert_int_equal(out[i], 0);
                    uint8_t res = residency(fx.p, mv[i].seq, mv[i].layer, mv[i].kv_head,
                                            mv[i].page);
                    assert_true(res & (1u << mv[i].to));
                    if (mv[i].flags & KVT_MOVE_DROP_SOURCE)
                        assert_false(res & (1u << mv[i].from));
                }
                done += n;
            }
        }
        TU_CHECK(fx.p);
        if (step % 25 == 0)
            for (int i = 0; i < NS; i++)
                tseq_verify(fx.p, &fx.t[i]);
    }
    for (int i = 0; i < NS; i++)
        tseq_verify(fx.p, &fx.t[i]);
    assert_true(done > 1000); /* the workload really moved pages */
    (void)refused;
    kvt_mover_stats ms = {.struct_size = sizeof ms};
    TU_OK(kvt_mover_stats_get(fx.m, &ms));
    assert_true(ms.disk_reads > 0 && ms.disk_writes > 0);
    tier_fx_close(&fx);
}

/* ---- bad input -------------------------------------------------------------- */
static void test_bad_input(void **state)
{
    (void)state;
    tier_fx fx;
    tier_fx_open(&fx, 64, 16, 16u << 20, NULL, 3);
    const kvt_seq_id id = tier_fx_add(&fx, 2 * PAGE_TOKENS + 1)->id;
    kvt_fence f = 99;
    kvt_move ok = {id, 0, 0, 0, KVT_TIER_DEVICE, KVT_TIER_HOST, 0};
    kvt_move mv;

    TU_EXPECT_ERR(kvt_pool_mover_get(NULL, &fx.m), KVT_EINVAL, "pool");
    assert_null(fx.m); /* cleared on failure */
    fx.m = mover_of(fx.p);
    TU_EXPECT_ERR(kvt_pool_mover_get(fx.p, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_mover_submit(NULL, &ok, 1, 0, NULL, &f), KVT_EINVAL, "mover");
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &ok, 1, 0, NULL, NULL), KVT_EINVAL, "fence");
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, NULL, 1, 0, NULL, &f), KVT_EINVAL, "moves");
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &ok, 1, 0x10, NULL, &f), KVT_EINVAL, "flags");
    assert_int_equal(f, 0);
    mv = ok; mv.layer = N_LAYERS;
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_EINVAL, "moves[0].layer");
    mv = ok; mv.kv_head = N_KV_HEADS;
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_EINVAL, "moves[0].kv_head");
    mv = ok; mv.page = 2; /* the partial last page */
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_EINVAL, "partially filled");
    mv = ok; mv.page = 3;
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_EINVAL, "moves[0].page");
    mv = ok; mv.to = 7;
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_EINVAL, "moves[0].to");
    mv = ok; mv.from = 5;
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_EINVAL, "moves[0].from");
    mv = ok; mv.to = KVT_TIER_DEVICE;
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_EINVAL, "equals from");
    mv = ok; mv.flags = 0x100;
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_EINVAL, "moves[0].flags");
    mv = ok; mv.from = KVT_TIER_HOST; mv.to = KVT_TIER_DEVICE;
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_ESTATE, "moves[0].from");
    mv = ok; mv.seq = id + 1;
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &f), KVT_ENOENT, "moves[0].seq");
    /* The same page twice in one batch; the second move refused, the first
     * undone: nothing is left busy. */
    kvt_move two[2] = {ok, ok};
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, two, 2, 0, NULL, &f), KVT_EBUSY, "moves[1]");
    TU_CHECK(fx.p);
    TU_OK(kvt_mover_submit(fx.m, two, 1, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    /* Fences: 0 and future ones are unknown. */
    TU_EXPECT_ERR(kvt_mover_poll(fx.m, 0), KVT_EINVAL, "fence");
    TU_EXPECT_ERR(kvt_mover_wait(fx.m, f + 1, 0), KVT_EINVAL, "fence");
    TU_EXPECT_ERR(kvt_mover_poll(NULL, f), KVT_EINVAL, "mover");
    TU_EXPECT_ERR(kvt_mover_wait(NULL, f, 0), KVT_EINVAL, "mover");
    /* An empty batch is complete at once. */
    TU_OK(kvt_mover_submit(fx.m, NULL, 0, 0, NULL, &f));
    TU_OK(kvt_mover_poll(fx.m, f));
    TU_OK(kvt_mover_wait(fx.m, KVT_FENCE_ALL, 0));

    /* Stats and path arguments. */
    kvt_mover_stats ms = {.struct_size = 8};
    TU_EXPECT_ERR(kvt_mover_stats_get(fx.m, &ms), KVT_EINVAL, "struct_size");
    TU_EXPECT_ERR(kvt_mover_stats_get(NULL, &ms), KVT_EINVAL, "mover");
    TU_EXPECT_ERR(kvt_mover_stats_get(fx.m, NULL), KVT_EINVAL, "stats");
    char path[512];
    size_t len = 0;
    TU_EXPECT_ERR(kvt_pool_disk_path_get(fx.p, path, 4, &len), KVT_ERANGE, "cap");
    assert_true(len > 4);
    TU_OK(kvt_pool_disk_path_get(fx.p, path, sizeof path, &len));
    assert_int_equal(strlen(path), len);
    assert_memory_equal(path, g_dir, strlen(g_dir));
    TU_EXPECT_ERR(kvt_pool_disk_path_get(NULL, path, sizeof path, &len), KVT_EINVAL, "pool");
    /* Not kept: the name is gone while the pool lives. */
    assert_int_equal(access(path, F_OK), -1);

    /* Options. */
    TU_EXPECT_ERR(kvt_mover_opts_init(NULL), KVT_EINVAL, "opts");
    kvt_mover_opts mo = KVT_MOVER_OPTS_INIT;
    assert_int_equal(mo.struct_size, sizeof mo);
    kvt_pool *q = NULL;
    fx.o.mover = &mo;
    mo.queue_depth = 5000;
    TU_EXPECT_ERR(kvt_pool_create(&fx.o, &q), KVT_EINVAL, "queue_depth");
    mo.queue_depth = 0;
    mo.flags = 0x80;
    TU_EXPECT_ERR(kvt_pool_create(&fx.o, &q), KVT_EINVAL, "mover->flags");
    mo.flags = 0;
    mo.struct_size = 3;
    TU_EXPECT_ERR(kvt_pool_create(&fx.o, &q), KVT_EINVAL, "struct_size");
    assert_null(q);

    tier_fx_close(&fx);

    /* A pool without a disk tier has a mover too (device <-> host). */
    kvt_pool_opts o =
        tu_opts(N_LAYERS, N_KV_HEADS, N_KV_HEADS, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, 16, 16);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    TU_EXPECT_ERR(kvt_pool_disk_path_get(p, path, sizeof path, NULL), KVT_ENOENT, "disk");
    kvt_mover *m = mover_of(p);
    tseq t;
    TU_OK(kvt_seq_create(p, NULL, &t.id));
    tseq_init(&t);
    TU_OK(kvt_seq_create(p, NULL, &t.id));
    tseq_append(p, &t, PAGE_TOKENS, &fx.r);
    mv = ok; mv.seq = t.id; mv.to = KVT_TIER_DISK;
    TU_EXPECT_ERR(kvt_mover_submit(m, &mv, 1, 0, NULL, &f), KVT_EINVAL, "no such tier");
    kvt_mover_stats ms2 = {.struct_size = sizeof ms2};
    TU_OK(kvt_mover_stats_get(m, &ms2));
    assert_int_equal(ms2.disk_file_bytes, 0);
    kvt_pool_destroy(p);
    tseq_free(&t);
}

/* ---- the host tier as a cache over the disk ---------------------------------- */
static void test_host_eviction(void **state)
{
    (void)state;
    tier_fx fx;
    tier_fx_open(&fx, 128, 17, 16u << 20, NULL, 11); /* 16 usable host blocks */
    tseq *t = tier_fx_add(&fx, 24 * PAGE_TOKENS); /* 24 full pages per head */
    kvt_move mv[24];
    kvt_fence f;
    /* Layer 0 head 0: every page to disk only. */
    for (uint32_t i = 0; i < 24; i++)
        mv[i] = (kvt_move){t->id, 0, 0, i, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE};
    TU_OK(kvt_mover_submit(fx.m, mv, 24, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    /* Fetch pages 0..7, then 8..15: the host tier is full. */
    for (int b = 0; b < 2; b++) {
        for (uint32_t i = 0; i < 8; i++)
            mv[i] = (kvt_move){t->id, 0, 0, 8u * b + i, KVT_TIER_DISK, KVT_TIER_HOST, 0};
        TU_OK(kvt_mover_submit(fx.m, mv, 8, 0, NULL, &f));
        TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    }
    /* Fetching 16..19 drops the least recently fetched host copies: 0..3
     * (equal importance; the first batch is older). */
    for (uint32_t i = 0; i < 4; i++)
        mv[i] = (kvt_move){t->id, 0, 0, 16 + i, KVT_TIER_DISK, KVT_TIER_HOST, 0};
    TU_OK(kvt_mover_submit(fx.m, mv, 4, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    for (uint32_t pg = 0; pg < 20; pg++) {
        uint8_t want = KVT_RES_DISK | (pg >= 4 ? KVT_RES_HOST : 0);
        assert_int_equal(residency(fx.p, t->id, 0, 0, pg), want);
    }
    kvt_mover_stats ms = {.struct_size = sizeof ms};
    TU_OK(kvt_mover_stats_get(fx.m, &ms));
    assert_int_equal(ms.evictions, 4);
    TU_CHECK(fx.p);
    tseq_verify(fx.p, t);

    /* Host pages without a disk copy cannot be dropped: filling the host
     * tier from the device with no disk copies left to drop is refused. */
    for (uint32_t i = 0; i < 20; i++)
        mv[i] = (kvt_move){t->id, 1, 0, i, KVT_TIER_DEVICE, KVT_TIER_HOST, 0};
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, mv, 20, 0, NULL, &f), KVT_ENOSPC, "host tier");
    TU_CHECK(fx.p);
    /* 16 fit once every disk-backed copy is gone. */
    TU_OK(kvt_mover_submit(fx.m, mv, 16, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    for (uint32_t pg = 0; pg < 20; pg++)
        assert_int_equal(residency(fx.p, t->id, 0, 0, pg), KVT_RES_DISK);
    TU_CHECK(fx.p);
    tseq_verify(fx.p, t);
    tier_fx_close(&fx);
}

/* A larger host tier: each fetch drops just the blocks it needs, the least
 * recently fetched first. */
static void test_eviction_batches(void **state)
{
    (void)state;
    tier_fx fx;
    tier_fx_open(&fx, 600, 129, 16u << 20, NULL, 12); /* 128 usable host blocks */
    tseq *t = tier_fx_add(&fx, 140 * PAGE_TOKENS); /* pages 0..139 */
    static kvt_move mv[140];
    kvt_fence f;
    for (uint32_t i = 0; i < 140; i++)
        mv[i] = (kvt_move){t->id, 0, 1, i, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE};
    TU_OK(kvt_mover_submit(fx.m, mv, 140, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    /* Four batches of 32 fill the host tier, oldest first; the batches go
     * in reverse page order so recency, not page index, decides. */
    for (uint32_t b = 0; b < 4; b++) {
        for (uint32_t i = 0; i < 32; i++)
            mv[i] = (kvt_move){t->id, 0, 1, 127 - (32 * b + i), KVT_TIER_DISK, KVT_TIER_HOST, 0};
        TU_OK(kvt_mover_submit(fx.m, mv, 32, 0, NULL, &f));
        TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    }
    /* Nine single fetches drop one each: always the oldest, ties (one
     * batch) by block, i.e. the order the batch took them: 127, ..., 119. */
    for (uint32_t i = 0; i < 9; i++) {
        mv[0] = (kvt_move){t->id, 0, 1, 128 + i, KVT_TIER_DISK, KVT_TIER_HOST, 0};
        TU_OK(kvt_mover_submit(fx.m, mv, 1, 0, NULL, &f));
        TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    }
    for (uint32_t pg = 0; pg < 140; pg++) {
        bool host = (pg < 119) || (pg >= 128 && pg < 137);
        assert_int_equal(residency(fx.p, t->id, 0, 1, pg),
                         KVT_RES_DISK | (host ? KVT_RES_HOST : 0));
    }
    kvt_mover_stats ms = {.struct_size = sizeof ms};
    TU_OK(kvt_mover_stats_get(fx.m, &ms));
    assert_int_equal(ms.evictions, 9);
    TU_CHECK(fx.p);
    tseq_verify(fx.p, t);
    tier_fx_close(&fx);
}

/* One move, submitted and waited for. */
static void move1(tier_fx *fx, kvt_seq_id id, uint32_t layer, uint32_t page, kvt_tier from,
                  kvt_tier to, uint32_t flags)
{
    kvt_move mv = {id, layer, 0, page, from, to, flags};
    kvt_fence f;
    TU_OK(kvt_mover_submit(fx->m, &mv, 1, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx->m, f, UINT64_MAX));
}

/* The eviction lists against a model: among equal importance, host copies
 * go least recently used first (the use stamp: arrival or selection; a
 * copy out of the host tier is not a use), ties by block, whatever order
 * the moves completed in; a copy without a disk copy is passed over until
 * a disk copy arrives, then goes after the pages filed before it. */
static void test_eviction_lists(void **state)
{
    (void)state;
    tier_fx fx;
    tier_fx_open(&fx, 600, 17, 16u << 20, NULL, 13); /* 16 usable host blocks */
    tseq *t = tier_fx_add(&fx, 40 * PAGE_TOKENS);
    for (uint32_t pg = 0; pg < 40; pg++)
        move1(&fx, t->id, 0, pg, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE);
    /* Layer 1 pages 0..3: host copies the disk does not hold (blocks 1..4). */
    for (uint32_t pg = 0; pg < 4; pg++)
        move1(&fx, t->id, 1, pg, KVT_TIER_DEVICE, KVT_TIER_HOST, 0);
    /* Layer 0 pages 0..11 from disk (blocks 5..16): the host tier is full. */
    for (uint32_t pg = 0; pg < 12; pg++)
        move1(&fx, t->id, 0, pg, KVT_TIER_DISK, KVT_TIER_HOST, 0);
    /* Page 0 copied to the device: not a use of its host copy. */
    move1(&fx, t->id, 0, 0, KVT_TIER_HOST, KVT_TIER_DEVICE, 0);
    /* Page 12 in: the layer-1 copies come first but cannot go; page 0 does. */
    move1(&fx, t->id, 0, 12, KVT_TIER_DISK, KVT_TIER_HOST, 0);
    assert_int_equal(residency(fx.p, t->id, 0, 0, 0), KVT_RES_DEVICE | KVT_RES_DISK);
    /* The layer-1 copies reach the disk: they may go now, filed with page
     * 12 after the pages already listed, by block (theirs are 1..4, page
     * 12's is 5, page 0's old one). */
    for (uint32_t pg = 0; pg < 4; pg++) {
        move1(&fx, t->id, 1, pg, KVT_TIER_HOST, KVT_TIER_DISK, 0);
        assert_int_equal(residency(fx.p, t->id, 1, 0, pg),
                         KVT_RES_DEVICE | KVT_RES_HOST | KVT_RES_DISK);
    }
    /* The model: the order the next 16 drops must follow, layer * 100 + page. */
    uint32_t order[16], n = 0;
    for (uint32_t pg = 1; pg < 12; pg++)
        order[n++] = pg;
    for (uint32_t pg = 0; pg < 4; pg++)
        order[n++] = 100 + pg;
    order[n++] = 12;
    assert_int_equal(n, 16);
    /* Pages 13..28 in, one at a time: each drops the next of the model's
     * order, checked after every fetch. */
    for (uint32_t i = 0; i < 16; i++) {
        move1(&fx, t->id, 0, 13 + i, KVT_TIER_DISK, KVT_TIER_HOST, 0);
        for (uint32_t j = 0; j < 16; j++) {
            const uint32_t l = order[j] / 100, pg = order[j] % 100;
            const uint8_t dev = l == 1 ? KVT_RES_DEVICE : 0;
            assert_int_equal(residency(fx.p, t->id, l, 0, pg),
                             dev | KVT_RES_DISK | (j <= i ? 0 : KVT_RES_HOST));
        }
    }
    kvt_mover_stats ms = {.struct_size = sizeof ms};
    TU_OK(kvt_mover_stats_get(fx.m, &ms));
    assert_int_equal(ms.evictions, 17);
    TU_CHECK(fx.p);
    tseq_verify(fx.p, t);
    tier_fx_close(&fx);
}

/* The host tier drops the pages the selector scored lowest first: the
 * importance is the last MINMAX score a step gave each page, checked here
 * against scores computed in double from the page metadata. */
static int cmp_score(const void *a, const void *b)
{
    const double *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* The documented ranking of an importance: its octave and which eighth of
 * it (linear in the mantissa), mirrored for negative values. */
static double oct8(double x)
{
    if (x == 0)
        return 0;
    int e;
    const double m = frexp(fabs(x), &e); /* [0.5, 1) */
    const double r = 2000.0 + e * 8.0 + floor((m * 2.0 - 1.0) * 8.0);
    return x > 0 ? r : -r;
}

/* One step that appends a token to every layer and selects layer 0 with
 * query q: every page of layer 0 gets q's MINMAX bound as its importance. */
static void score_layer0(tier_fx *fx, tseq *t, const float *q)
{
    kvt_geometry g = fx->o.geom;
    kvt_selector *sel;
    kvt_selector_opts so;
    TU_OK(kvt_selector_opts_init(&so));
    so.top_k_pages = 2;
    TU_OK(kvt_selector_create(&g, &so, &sel));
    kvt_step_opts sp;
    TU_OK(kvt_step_opts_init(&sp));
    sp.selector = sel;
    kvt_step *st;
    TU_OK(kvt_step_plan(fx->p, &t->id, 1, &sp, &st));
    float kv[2 * N_KV_HEADS * HEAD_DIM];
    for (int i = 0; i < 2 * N_KV_HEADS * HEAD_DIM; i++)
        kv[i] = tu_unit(&fx->r);
    for (uint32_t l = 0; l < N_LAYERS; l++)
        TU_OK(kvt_step_append(st, l, kv, kv + N_KV_HEADS * HEAD_DIM, KVT_DTYPE_F32, 0));
    TU_OK(kvt_step_select(st, 0, q));
    TU_OK(kvt_step_finish(st));
    kvt_selector_destroy(sel);
}

/* Reference: the MINMAX bound of head 0's query q over the n pages pgs of
 * layer 0, in double, sorted ascending as (score, page). */
static void ref_scores(tier_fx *fx, tseq *t, const float *q, const uint32_t *pgs, int n,
                       double sc[][2])
{
    for (int i = 0; i < n; i++) {
        float kmin[HEAD_DIM], kmax[HEAD_DIM];
        TU_OK(kvt_seq_page_meta_get(fx->p, t->id, 0, 0, pgs[i], kmin, kmax, NULL));
        double s = 0;
        for (int d = 0; d < HEAD_DIM; d++) {
            double a = (double)q[d] * kmin[d], b = (double)q[d] * kmax[d];
            s += a > b ? a : b;
        }
        sc[i][0] = s;
        sc[i][1] = pgs[i];
    }
    qsort(sc, (size_t)n, sizeof sc[0], cmp_score);
}

/* The host tier drops the lowest-scored copies, by the scores of the last
 * step - also when that step lowered pages that were listed higher. */
static void test_eviction_by_importance(void **state)
{
    (void)state;
    tier_fx fx;
    tier_fx_open(&fx, 128, 9, 16u << 20, NULL, 31); /* 8 usable host blocks */
    tseq *t = tier_fx_add(&fx, 16 * PAGE_TOKENS + 1);
    kvt_move mv[16];
    kvt_fence f;
    for (uint32_t i = 0; i < 16; i++)
        mv[i] = (kvt_move){t->id, 0, 0, i, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE};
    TU_OK(kvt_mover_submit(fx.m, mv, 16, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));

    /* A step scores every page of layer 0 with q1 (selection reads only
     * the metadata, which stays in the device tier); then pages 0..7 go to
     * the host tier in one batch (equal recency). */
    float q1[N_KV_HEADS * HEAD_DIM], q2[N_KV_HEADS * HEAD_DIM];
    for (int i = 0; i < N_KV_HEADS * HEAD_DIM; i++)
        q1[i] = tu_unit(&fx.r);
    score_layer0(&fx, t, q1);
    for (uint32_t i = 0; i < 8; i++)
        mv[i] = (kvt_move){t->id, 0, 0, i, KVT_TIER_DISK, KVT_TIER_HOST, 0};
    TU_OK(kvt_mover_submit(fx.m, mv, 8, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    /* Fetching page 12 drops the lowest by q1 (and lists the rest by q1's
     * scores). A clear cut: the host cache ranks importance to within 1/8
     * octave, so the two sides must differ there. */
    const uint32_t first8[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    double s1[8][2], s2[8][2];
    ref_scores(&fx, t, q1, first8, 8, s1);
    assert_true(oct8(s1[0][0]) < oct8(s1[1][0]));
    mv[0] = (kvt_move){t->id, 0, 0, 12, KVT_TIER_DISK, KVT_TIER_HOST, 0};
    TU_OK(kvt_mover_submit(fx.m, mv, 1, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    assert_int_equal(residency(fx.p, t->id, 0, 0, (uint32_t)s1[0][1]), KVT_RES_DISK);
    /* The host now holds these 8; q1's three lowest among them: */
    uint32_t held[8], n = 0;
    for (int i = 1; i < 8; i++)
        held[n++] = (uint32_t)s1[i][1];
    held[n++] = 12;
    ref_scores(&fx, t, q1, held, 8, s1);
    /* A step rescores them with a query q2 that has a clear cut after its
     * three lowest and a different three lowest than q1 (so q1's order
     * left in the lists would show); the drops must follow q2. */
    bool found = false;
    for (int tries = 0; tries < 256 && !found; tries++) {
        for (int i = 0; i < N_KV_HEADS * HEAD_DIM; i++)
            q2[i] = tu_unit(&fx.r);
        ref_scores(&fx, t, q2, held, 8, s2);
        bool moved = false;
        for (int i = 0; i < 3; i++) {
            bool low1 = false;
            for (int j = 0; j < 3; j++)
                low1 = low1 || s1[j][1] == s2[i][1];
            moved = moved || !low1;
        }
        found = moved && oct8(s2[2][0]) < oct8(s2[3][0]);
    }
    assert_true(found);
    score_layer0(&fx, t, q2);

    /* Fetching 8..10 drops the three lowest-scored host copies by q2. */
    for (uint32_t i = 0; i < 3; i++)
        mv[i] = (kvt_move){t->id, 0, 0, 8 + i, KVT_TIER_DISK, KVT_TIER_HOST, 0};
    TU_OK(kvt_mover_submit(fx.m, mv, 3, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    for (int i = 0; i < 8; i++) {
        uint32_t pg = (uint32_t)s2[i][1];
        assert_int_equal(residency(fx.p, t->id, 0, 0, pg),
                         KVT_RES_DISK | (i < 3 ? 0 : KVT_RES_HOST));
    }
    TU_CHECK(fx.p);
    tier_fx_close(&fx);
}

/* ---- full disk, directories, sharing ------------------------------------------ */
static void test_disk_full(void **state)
{
    (void)state;
    const kvt_mover_opts mo = tier_mover_opts(2, 2); /* a segment: 4 slots of 8 KiB */
    tier_fx fx;
    tier_fx_open(&fx, 64, 16, 3 * 4 * 8192, &mo, 5); /* 3 segments, 12 slots */
    tseq *t = tier_fx_add(&fx, 8 * PAGE_TOKENS);
    kvt_move mv[8];
    kvt_fence f;
    /* Head (0,0): 8 pages = 2 segments. Head (0,1) takes the third and then
     * borrows nothing: the file is full. */
    for (uint32_t i = 0; i < 8; i++)
        mv[i] = (kvt_move){t->id, 0, 0, i, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE};
    TU_OK(kvt_mover_submit(fx.m, mv, 8, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    for (uint32_t i = 0; i < 6; i++)
        mv[i] = (kvt_move){t->id, 0, 1, i, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE};
    TU_EXPECT_ERR(kvt_mover_submit(fx.m, mv, 6, 0, NULL, &f), KVT_ENOSPC, "disk tier");
    TU_CHECK(fx.p);
    for (uint32_t i = 0; i < 6; i++) /* nothing moved, nothing lost */
        assert_int_equal(residency(fx.p, t->id, 0, 1, i), KVT_RES_DEVICE);
    TU_OK(kvt_mover_submit(fx.m, mv, 4, 0, NULL, &f));
    TU_OK(kvt_mover_wait(fx.m, f, UINT64_MAX));
    kvt_stats st = {.struct_size = sizeof st};
    TU_OK(kvt_pool_stats_get(fx.p, &st));
    assert_int_equal(st.tier[KVT_TIER_DISK].blocks_total, 12);
    assert_int_equal(st.tier[KVT_TIER_DISK].blocks_used, 12);
    assert_int_equal(st.tier[KVT_TIER_DISK].pages, 12);
    tseq_verify(fx.p, t);
    /* Releasing the sequence gives the extents back. */
    TU_OK(kvt_seq_release(fx.p, t->id));
    TU_OK(kvt_pool_stats_get(fx.p, &st));
    assert_int_equal(st.tier[KVT_TIER_DISK].blocks_used, 0);
    TU_CHECK(fx.p);
    tier_fx_close(&fx);
}

static void test_directories(void **state)
{
    (void)state;
    kvt_pool *p = NULL, *q = NULL;
    kvt_pool_opts o = disk_opts(40, 16, 16u << 20, NULL);
    o.disk_dir = "/nonexistent/kvtier";
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "disk_dir");
    o.disk_dir = "/proc/self"; /* exists, but no file can be created there */
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "disk_dir");
    assert_null(p);
    if (geteuid() != 0) { /* root ignores directory permissions */
        char ro[300];
        snprintf(ro, sizeof ro, "%s/ro", g_dir);
        assert_int_equal(mkdir(ro, 0555), 0);
        o.disk_dir = ro;
        TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "disk_dir");
        rmdir(ro);
    }

    /* Two pools in one directory: distinct files, independent data. */
    o.disk_dir = g_dir;
    kvt_mover_opts mo;
    TU_OK(kvt_mover_opts_init(&mo));
    mo.flags = KVT_MOVER_KEEP_DISK_FILE;
    o.mover = &mo;
    TU_OK(kvt_pool_create(&o, &p));
    TU_OK(kvt_pool_create(&o, &q));
    char pa[512], pb[512];
    TU_OK(kvt_pool_disk_path_get(p, pa, sizeof pa, NULL));
    TU_OK(kvt_pool_disk_path_get(q, pb, sizeof pb, NULL));
    assert_string_not_equal(pa, pb);
    assert_int_equal(count_dir_entries(), 2); /* kept files are visible */
    struct stat sa;
    assert_int_equal(stat(pa, &sa), 0);
    assert_int_equal((uint64_t)sa.st_size, 16u << 20); /* preallocated */
    tu_rng r = {9};
    tseq a, b;
    tseq_init(&a);
    tseq_init(&b);
    TU_OK(kvt_seq_create(p, NULL, &a.id));
    TU_OK(kvt_seq_create(q, NULL, &b.id));
    tseq_append(p, &a, 4 * PAGE_TOKENS, &r);
    tseq_append(q, &b, 4 * PAGE_TOKENS, &r);
    kvt_move mv[4];
    kvt_fence fa, fb;
    for (uint32_t i = 0; i < 4; i++)
        mv[i] = (kvt_move){a.id, 1, 1, i, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE};
    TU_OK(kvt_mover_submit(mover_of(p), mv, 4, 0, NULL, &fa));
    for (uint32_t i = 0; i < 4; i++)
        mv[i].seq = b.id;
    TU_OK(kvt_mover_submit(mover_of(q), mv, 4, 0, NULL, &fb));
    TU_OK(kvt_mover_wait(mover_of(p), fa, UINT64_MAX));
    TU_OK(kvt_mover_wait(mover_of(q), fb, UINT64_MAX));
    tseq_verify(p, &a);
    tseq_verify(q, &b);
    kvt_pool_destroy(p);
    kvt_pool_destroy(q);
    assert_int_equal(unlink(pa), 0); /* kept after destroy */
    assert_int_equal(unlink(pb), 0);
    tseq_free(&a);
    tseq_free(&b);
}

/* ---- destroy and release while moves are in flight ---------------------------- */
static void test_in_flight(void **state)
{
    (void)state;
    kvt_mover_opts mo;
    TU_OK(kvt_mover_opts_init(&mo));
    mo.queue_depth = 4;
    for (int round = 0; round < 3; round++) {
        tier_fx fx;
        tier_fx_open(&fx, 600, 600, 16u << 20, &mo, (uint64_t)round + 100);
        for (int i = 0; i < 2; i++)
            tier_fx_add(&fx, 30 * PAGE_TOKENS);
        static kvt_move mv[2 * N_LAYERS * N_KV_HEADS * 30];
        uint32_t n = 0;
        for (int i = 0; i < 2; i++)
            for (uint32_t l = 0; l < N_LAYERS; l++)
                for (uint32_t h = 0; h < N_KV_HEADS; h++)
                    for (uint32_t pg = 0; pg < 30; pg++)
                        mv[n++] = (kvt_move){fx.t[i].id, l, h, pg, KVT_TIER_DEVICE,
                                             (pg + h) % 2 ? KVT_TIER_DISK : KVT_TIER_HOST,
                                             round == 2 ? KVT_MOVE_DROP_SOURCE : 0u};
        kvt_fence f;
        TU_OK(kvt_mover_submit(fx.m, mv, n, 0, NULL, &f));
        int rc = kvt_mover_wait(fx.m, f, 0); /* most likely still in flight */
        assert_true(rc == 0 || rc == KVT_ETIMEDOUT);
        if (round == 1) {
            TU_OK(kvt_seq_release(fx.p, fx.t[0].id)); /* waits for its moves */
            TU_CHECK(fx.p);
            tseq_verify(fx.p, &fx.t[1]);
        }
        if (round == 2) {
            TU_OK(kvt_mover_wait(fx.m, KVT_FENCE_ALL, UINT64_MAX));
            TU_CHECK(fx.p);
            tseq_verify(fx.p, &fx.t[0]);
            tseq_verify(fx.p, &fx.t[1]);
        }
        tier_fx_close(&fx); /* round 0: destroy waits for the whole batch */
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),     cmocka_unit_test(test_small_pages),     cmocka_unit_test(test_random_workload),
        cmocka_unit_test(test_bad_input),      cmocka_unit_test(test_host_eviction),
        cmocka_unit_test(test_eviction_batches),
        cmocka_unit_test(test_eviction_lists),
        cmocka_unit_test(test_eviction_by_importance),
        cmocka_unit_test(test_disk_full),      cmocka_unit_test(test_directories),
        cmocka_unit_test(test_in_flight),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
