/* Fault injection into the disk I/O under tiered placement (test build of
 * the library): a disk tier with a host too small to cache the offloaded
 * pages, so promotions read from the disk.
 *   - A read fault (EIO, or a flipped byte caught by the CRC: ECORRUPT)
 *     during a step's promotions: kvt_sparse_decode returns the code after
 *     decoding the other sequences exactly, the failing sequence comes back
 *     zeroed (lse -inf), the pool passes kvt_pool_check, every page still
 *     reads back byte-exact (the flip is in the read, not on the disk), and
 *     the next step rescores the failed heads and decodes exactly.
 *   - A write fault on the offload submitted by kvt_step_finish: the page
 *     keeps its device copy, is offloaded by a later step, and nothing is
 *     lost.
 * Every step is checked by placetest.h's pfx_step (references from the K/V
 * the test appended). */
#include "../lib/tier/tier.h" /* kvt__mover_fault, KVT__FAULT_* */

#include "placetest.h"

/* The fault to arm, and where. */
static struct {
    bool write;
    uint32_t kind;
    uint64_t nth;
} g_fault;

static void arm_before_layer0(pfx *f, uint32_t layer)
{
    if (layer == 0)
        assert_int_equal(kvt__mover_fault(f->m, g_fault.write, g_fault.kind, g_fault.nth), 0);
}

static void arm_before_finish(pfx *f)
{
    assert_int_equal(kvt__mover_fault(f->m, g_fault.write, g_fault.kind, g_fault.nth), 0);
}

/* Two sequences, three stable heads (rerank interval iv) and one unstable;
 * a host of two usable blocks over the disk. */
static pfx *open_small_host(uint32_t len0, uint32_t len1, uint32_t iv, uint64_t seed)
{
    pheads ph = ph_uniform(2, 1, 1, 1, iv);
    ph_unstable(&ph, 1, 1);
    pfx *f = pfx_open(&ph, 300, 3, 8u << 20, seed);
    pfx_add(f, len0, KEYS_RANDOM);
    pfx_add(f, len1, KEYS_RANDOM);
    TU_OK(wait_all(f));
    check_offloaded(f, KVT_RES_DISK, false);
    return f;
}

static void read_fault(uint32_t kind, uint64_t nth)
{
    pfx *f = open_small_host(6 * P + 5, 8 * P + 3, 4, 300 + kind * 7 + nth);
    kvt_mover_stats m0 = {.struct_size = sizeof m0}, m1 = {.struct_size = sizeof m1};
    TU_OK(kvt_mover_stats_get(f->m, &m0));
    /* The first step reranks every stable head (nothing selected yet): each
     * promotes K pages, almost all from the disk. The fault hits the nth
     * disk read from layer 0's rerank on. */
    g_fault.write = false;
    g_fault.kind = kind;
    g_fault.nth = nth;
    const int want = kind == KVT__FAULT_EIO ? KVT_EIO : KVT_ECORRUPT;
    const step_args a = {.faulty = true, .before_rerank = arm_before_layer0};
    step_res r;
    pfx_step(f, &a, &r); /* checks the other sequences and the pool */
    uint32_t bad_layers = 0, bad_layer = 0;
    for (uint32_t l = 0; l < L; l++) {
        if (r.rc[l] == 0)
            continue;
        if (r.rc[l] != want)
            fail_msg("%s read fault %llu: layer %u decode %s, expected %s", kind == KVT__FAULT_EIO
                     ? "EIO" : "FLIP", (unsigned long long)nth, l, kvt_err_name(r.rc[l]),
                     kvt_err_name(want));
        bad_layers++;
        bad_layer = l;
    }
    if (bad_layers != 1)
        fail_msg("read fault %llu: %u layers failed, expected 1", (unsigned long long)nth,
                 bad_layers);
    /* One failed copy: one sequence zeroed, the other decoded (and checked
     * against the reference by pfx_step). */
    assert_int_equal(__builtin_popcount(r.failed[bad_layer]), 1);
    uint32_t bad_seq = (uint32_t)__builtin_ctz(r.failed[bad_layer]), n_fail_heads = 0;
    for (uint32_t lh = 0; lh < NLH; lh++)
        n_fail_heads += r.fail_head[bad_seq][lh];
    assert_int_equal(n_fail_heads, 1);
    TU_OK(kvt_mover_stats_get(f->m, &m1));
    if (kind == KVT__FAULT_EIO)
        assert_int_equal(m1.io_errors - m0.io_errors, 1);
    else
        assert_int_equal(m1.checksum_errors - m0.checksum_errors, 1);
    TU_CHECK(f->p);
    verify_all(f); /* nothing lost; the disk copy is intact */

    /* The fault has cleared: the failed head rescores and every sequence
     * decodes exactly. */
    const step_args ok = {.wait_before = true, .exact_stats = true};
    step_res r2;
    pfx_step(f, &ok, &r2);
    for (uint32_t lh = 0; lh < NLH; lh++)
        if (r.fail_head[bad_seq][lh] && !r2.reranked[bad_seq][lh])
            fail_msg("seq %u layer %u head %u: a promotion failed, yet the next step reused "
                     "its selection", bad_seq, lh / H, lh % H);
    for (int step = 0; step < 6; step++)
        pfx_step(f, &ok, &r2);
    TU_OK(wait_all(f));
    check_offloaded(f, KVT_RES_DISK, false);
    verify_all(f);
    pfx_close(f);
}

static void test_read_eio_first(void **s)
{
    (void)s;
    read_fault(KVT__FAULT_EIO, 1);
}

static void test_read_eio_later(void **s)
{
    (void)s;
    read_fault(KVT__FAULT_EIO, 5);
}

static void test_read_flip_first(void **s)
{
    (void)s;
    read_fault(KVT__FAULT_FLIP, 1);
}

static void test_read_flip_later(void **s)
{
    (void)s;
    read_fault(KVT__FAULT_FLIP, 6);
}

/* The offload of the pages a step filled fails on the disk write. */
static void test_offload_write_fault(void **state)
{
    (void)state;
    /* Both sequences fill a page in every head at the first step. Every
     * step reranks, so the next one meets the page that could not be
     * offloaded outside the local window: it must stay on device (no other
     * copy), not be evicted. */
    pfx *f = open_small_host(6 * P - 1, 8 * P - 1, 1, 0x0ff);
    kvt_mover_stats m0 = {.struct_size = sizeof m0}, m1 = {.struct_size = sizeof m1};
    TU_OK(kvt_mover_stats_get(f->m, &m0));
    g_fault.write = true;
    g_fault.kind = KVT__FAULT_EIO;
    g_fault.nth = 1;
    const step_args a = {.wait_before = true, .exact_stats = true,
                         .before_finish = arm_before_finish};
    step_res r;
    pfx_step(f, &a, &r);
    int rc = wait_all(f);
    assert_true(rc == 0 || rc == KVT_EIO);
    TU_OK(kvt_mover_stats_get(f->m, &m1));
    assert_int_equal(m1.io_errors - m0.io_errors, 1); /* the fault did hit a write */
    TU_CHECK(f->p);
    verify_all(f);
    /* The pages that filled (the last full page of every stable head): six
     * pages do not fit the host, so they went to the disk alone, and the one
     * whose write failed has no copy outside the device: it keeps the device
     * copy. */
    uint32_t stuck = 0;
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t lh = 0; lh < NLH; lh++) {
            if (!is_stable(f, lh))
                continue;
            const uint32_t pg = f->t[i].n / P - 1;
            uint8_t rs;
            TU_OK(kvt_seq_block_table(f->p, f->t[i].id, lh / H, lh % H, pg, 1, NULL, NULL, &rs));
            if (!(rs & (KVT_RES_HOST | KVT_RES_DISK))) {
                stuck++;
                assert_int_equal(rs, KVT_RES_DEVICE);
            }
        }
    assert_int_equal(stuck, 1);

    /* Later steps offload it: every full stable page ends with a copy on
     * the disk (or at least the host), offloaded once, nothing lost. */
    const step_args ok = {.wait_before = true, .exact_stats = true};
    for (int step = 0; step < 4; step++)
        pfx_step(f, &ok, &r);
    TU_OK(wait_all(f));
    check_offloaded(f, KVT_RES_HOST | KVT_RES_DISK, true);
    verify_all(f);
    pfx_close(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read_eio_first),  cmocka_unit_test(test_read_eio_later),
        cmocka_unit_test(test_read_flip_first), cmocka_unit_test(test_read_flip_later),
        cmocka_unit_test(test_offload_write_fault),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
