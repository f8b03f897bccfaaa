/* Fault injection into the mover's disk I/O (test build of the library):
 * every fault kind on reads and on writes must give the right per-page
 * code, leave the page in the tier it was in, and lose nothing; a random
 * storm of faults keeps kvt_pool_check and the byte-exact reference true.
 * Also the buffered fallback where O_DIRECT is refused. */
#include "../lib/tier/tier.h" /* kvt__mover_fault, KVT__FAULT_* */

#include "tiertest.h"

#define NPG 12 /* full pages per head */

/* The fixture of the single-fault tests: one sequence t[0] of NPG full
 * pages and a partial one per head. */
static void fx_open(tier_fx *fx, uint64_t seed)
{
    kvt_mover_opts mo = tier_mover_opts(4, 2);
    mo.max_io_bytes = 8192; /* one page per request: the Nth request is page N-1 */
    tier_fx_open(fx, 128, 64, 4u << 20, &mo, seed);
    tier_fx_add(fx, NPG * PAGE_TOKENS + 5);
}

static void fx_close(tier_fx *fx)
{
    TU_CHECK(fx->p);
    tier_fx_close(fx);
}

/* Moves pages 0..NPG-1 of (layer 0, head 0) in one batch; returns wait's code. */
static int move_all(tier_fx *fx, kvt_tier from, kvt_tier to, uint32_t flags, int32_t *res)
{
    kvt_move mv[NPG];
    for (uint32_t i = 0; i < NPG; i++)
        mv[i] = (kvt_move){fx->t[0].id, 0, 0, i, from, to, flags};
    kvt_fence fe;
    TU_OK(kvt_mover_submit(fx->m, mv, NPG, 0, res, &fe));
    return kvt_mover_wait(fx->m, fe, UINT64_MAX);
}

static const char *kind_name(uint32_t k)
{
    static const char *n[] = {"none", "EIO", "SHORT", "FLIP", "ENOSPC", "EAGAIN"};
    return n[k];
}

/* A write fault: the failed page keeps its device copy even though the
 * batch asked to drop it. */
static void write_fault(uint32_t kind)
{
    for (uint32_t nth = 1; nth <= NPG; nth += 5) {
        tier_fx fx;
        fx_open(&fx, 100 + kind * 13 + nth);
        kvt_mover_stats ms = {.struct_size = sizeof ms};
        assert_int_equal(kvt__mover_fault(fx.m, true, kind, nth), 0);
        int32_t res[NPG];
        const uint32_t drop = kind == KVT__FAULT_FLIP ? 0u : KVT_MOVE_DROP_SOURCE;
        int rc = move_all(&fx, KVT_TIER_DEVICE, KVT_TIER_DISK, drop, res);
        const int want = kind == KVT__FAULT_EIO ? KVT_EIO : kind == KVT__FAULT_ENOSPC ? KVT_ENOSPC : 0;
        if (rc != want)
            fail_msg("write fault %s at %u: wait gave %d, want %d", kind_name(kind), nth, rc, want);
        for (uint32_t i = 0; i < NPG; i++) {
            const bool hit = i == nth - 1;
            assert_int_equal(res[i], hit ? want : 0);
            uint8_t r = residency(fx.p, fx.t[0].id, 0, 0, i);
            if (hit && want)
                assert_int_equal(r, KVT_RES_DEVICE); /* stays where it was */
            else
                assert_int_equal(r, drop ? KVT_RES_DISK : (KVT_RES_DEVICE | KVT_RES_DISK));
        }
        TU_CHECK(fx.p);
        TU_OK(kvt_mover_stats_get(fx.m, &ms));
        if (kind == KVT__FAULT_SHORT)
            assert_true(ms.short_io >= 1);
        if (kind == KVT__FAULT_EAGAIN)
            assert_true(ms.retries >= 1);
        if (want)
            assert_int_equal(ms.io_errors, 1);
        if (kind == KVT__FAULT_FLIP) {
            /* The disk now holds a corrupted page: reading it back is
             * KVT_ECORRUPT for that page only, and nothing is used. */
            rc = move_all(&fx, KVT_TIER_DISK, KVT_TIER_HOST, 0, res);
            assert_int_equal(rc, KVT_ECORRUPT);
            assert_non_null(strstr(kvt_last_error(), "CRC32C"));
            for (uint32_t i = 0; i < NPG; i++) {
                assert_int_equal(res[i], i == nth - 1 ? KVT_ECORRUPT : 0);
                uint8_t r = residency(fx.p, fx.t[0].id, 0, 0, i);
                assert_int_equal(r, KVT_RES_DEVICE | KVT_RES_DISK |
                                        (i == nth - 1 ? 0 : KVT_RES_HOST));
            }
            TU_OK(kvt_mover_stats_get(fx.m, &ms));
            assert_int_equal(ms.checksum_errors, 1);
        }
        tseq_verify(fx.p, &fx.t[0]);
        fx_close(&fx);
    }
}

/* A read fault: the failed page stays on disk only, a second read works. */
static void read_fault(uint32_t kind)
{
    for (uint32_t nth = 1; nth <= NPG; nth += 4) {
        tier_fx fx;
        fx_open(&fx, 200 + kind * 17 + nth);
        int32_t res[NPG];
        assert_int_equal(
            move_all(&fx, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE, res), 0);
        assert_int_equal(kvt__mover_fault(fx.m, false, kind, nth), 0);
        kvt_tier to = nth % 2 ? KVT_TIER_HOST : KVT_TIER_DEVICE;
        int rc = move_all(&fx, KVT_TIER_DISK, to, 0, res);
        const int want = kind == KVT__FAULT_EIO ? KVT_EIO : kind == KVT__FAULT_FLIP ? KVT_ECORRUPT : 0;
        if (rc != want)
            fail_msg("read fault %s at %u: wait gave %d, want %d", kind_name(kind), nth, rc, want);
        for (uint32_t i = 0; i < NPG; i++) {
            const bool hit = i == nth - 1 && want;
            assert_int_equal(res[i], hit ? want : 0);
            uint8_t r = residency(fx.p, fx.t[0].id, 0, 0, i);
            assert_int_equal(r, KVT_RES_DISK | (hit ? 0u : (1u << to)));
        }
        TU_CHECK(fx.p);
        tseq_verify(fx.p, &fx.t[0]); /* the failed page reads from disk, intact */
        if (want) { /* the fault was transient: the page can be fetched now */
            kvt_move mv = {fx.t[0].id, 0, 0, nth - 1, KVT_TIER_DISK, to, 0};
            kvt_fence fe;
            TU_OK(kvt_mover_submit(fx.m, &mv, 1, 0, NULL, &fe));
            TU_OK(kvt_mover_wait(fx.m, fe, UINT64_MAX));
            tseq_verify(fx.p, &fx.t[0]);
        }
        fx_close(&fx);
    }
}

static void test_write_eio(void **s) { (void)s; write_fault(KVT__FAULT_EIO); }
static void test_write_enospc(void **s) { (void)s; write_fault(KVT__FAULT_ENOSPC); }
static void test_write_short(void **s) { (void)s; write_fault(KVT__FAULT_SHORT); }
static void test_write_eagain(void **s) { (void)s; write_fault(KVT__FAULT_EAGAIN); }
static void test_write_flip(void **s) { (void)s; write_fault(KVT__FAULT_FLIP); }
static void test_read_eio(void **s) { (void)s; read_fault(KVT__FAULT_EIO); }
static void test_read_short(void **s) { (void)s; read_fault(KVT__FAULT_SHORT); }
static void test_read_eagain(void **s) { (void)s; read_fault(KVT__FAULT_EAGAIN); }
static void test_read_flip(void **s) { (void)s; read_fault(KVT__FAULT_FLIP); }

/* Random moves with a random fault armed before most batches: a failed move
 * changes nothing, a successful one does what it says, and every page of
 * every sequence stays byte-exact. (Write flips are left out: they model
 * media corruption, which loses the data of a page whose only copy is on
 * disk, and are covered above.) */
static void test_fault_storm(void **state)
{
    (void)state;
    kvt_mover_opts mo = tier_mover_opts(4, 2);
    mo.max_io_bytes = 32 << 10;
    mo.queue_depth = 4;
    tier_fx fx;
    tier_fx_open(&fx, 300, 40, 6u << 20, &mo, 4242);
    enum { NS = 2 };
    for (int i = 0; i < NS; i++)
        tier_fx_add(&fx, 8 * PAGE_TOKENS + tu_below(&fx.r, PAGE_TOKENS));
    uint32_t failed = 0, ok = 0;
    for (int step = 0; step < 250; step++) {
        if (tu_below(&fx.r, 4)) {
            static const uint32_t kinds[] = {KVT__FAULT_EIO, KVT__FAULT_SHORT, KVT__FAULT_EAGAIN,
                                             KVT__FAULT_ENOSPC, KVT__FAULT_FLIP};
            bool wr = tu_below(&fx.r, 2);
            uint32_t k = kinds[tu_below(&fx.r, wr ? 4 : 5)];
            assert_int_equal(kvt__mover_fault(fx.m, wr, k, 1 + tu_below(&fx.r, 4)), 0);
        }
        kvt_move mv[16];
        uint8_t before[16];
        uint32_t n = random_batch(fx.p, fx.t, NS, &fx.r, mv, before, 16);
        int32_t out[16];
        kvt_fence fe;
        int rc = kvt_mover_submit(fx.m, mv, n, 0, out, &fe);
        if (rc == KVT_ENOSPC) {
            TU_CHECK(fx.p);
            continue;
        }
        assert_int_equal(rc, 0);
        rc = kvt_mover_wait(fx.m, fe, UINT64_MAX);
        assert_true(rc == 0 || rc == KVT_EIO || rc == KVT_ENOSPC || rc == KVT_ECORRUPT);
        for (uint32_t i = 0; i < n; i++) {
            uint8_t res = residency(fx.p, mv[i].seq, mv[i].layer, mv[i].kv_head, mv[i].page);
            if (out[i] == 0) {
                ok++;
                assert_true(res & (1u << mv[i].to));
                if (mv[i].flags & KVT_MOVE_DROP_SOURCE)
                    assert_false(res & (1u << mv[i].from));
            } else {
                failed++;
                assert_true(out[i] == KVT_EIO || out[i] == KVT_ENOSPC || out[i] == KVT_ECORRUPT);
                /* Unchanged, except that the host may have dropped a copy
                 * the disk also holds to make room. */
                assert_int_equal(res & ~KVT_RES_HOST, before[i] & ~KVT_RES_HOST);
                assert_true(res != 0);
            }
        }
        TU_CHECK(fx.p);
        if (step % 20 == 0)
            for (int i = 0; i < NS; i++)
                tseq_verify(fx.p, &fx.t[i]);
    }
    for (int i = 0; i < NS; i++)
        tseq_verify(fx.p, &fx.t[i]);
    assert_true(failed > 10 && ok > 500);
    tier_fx_close(&fx);
}

/* A filesystem that refuses O_DIRECT: buffered I/O unless the caller
 * insists on direct I/O. */
static void test_no_direct(void **state)
{
    (void)state;
    assert_int_equal(setenv("KVT_FAULT_NO_DIRECT", "1", 1), 0);
    kvt_mover_opts mo;
    TU_OK(kvt_mover_opts_init(&mo));
    mo.flags = KVT_MOVER_REQUIRE_DIRECT;
    kvt_pool_opts o = disk_opts(64, 32, 16u << 20, &mo);
    kvt_pool *p = NULL;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_ENOTSUP, "O_DIRECT");
    assert_null(p);
    mo.flags = 0;
    tier_fx fx;
    tier_fx_open(&fx, 64, 32, 16u << 20, &mo, 77);
    kvt_mover_stats ms = {.struct_size = sizeof ms};
    TU_OK(kvt_mover_stats_get(fx.m, &ms));
    assert_int_equal(ms.disk_direct, 0);
    tseq *t = tier_fx_add(&fx, 6 * PAGE_TOKENS);
    kvt_move mv[6];
    kvt_fence fe;
    for (uint32_t i = 0; i < 6; i++)
        mv[i] = (kvt_move){t->id, 1, 1, i, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE};
    TU_OK(kvt_mover_submit(fx.m, mv, 6, 0, NULL, &fe));
    TU_OK(kvt_mover_wait(fx.m, fe, UINT64_MAX));
    tseq_verify(fx.p, t);
    for (uint32_t i = 0; i < 6; i++)
        mv[i] = (kvt_move){t->id, 1, 1, i, KVT_TIER_DISK, KVT_TIER_DEVICE, KVT_MOVE_DROP_SOURCE};
    TU_OK(kvt_mover_submit(fx.m, mv, 6, 0, NULL, &fe));
    TU_OK(kvt_mover_wait(fx.m, fe, UINT64_MAX));
    tseq_verify(fx.p, t);
    TU_CHECK(fx.p);
    tier_fx_close(&fx);
    unsetenv("KVT_FAULT_NO_DIRECT");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_eio),   cmocka_unit_test(test_write_enospc),
        cmocka_unit_test(test_write_short), cmocka_unit_test(test_write_eagain),
        cmocka_unit_test(test_write_flip),  cmocka_unit_test(test_read_eio),
        cmocka_unit_test(test_read_short),  cmocka_unit_test(test_read_eagain),
        cmocka_unit_test(test_read_flip),   cmocka_unit_test(test_fault_storm),
        cmocka_unit_test(test_no_direct),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
