/* Fault injection into the disk I/O under tiered placement (test build of
 * the library): a disk tier with a host too small to cache the offloaded
 * pages, so promotions read from the disk.
 *   - A read fault (EIO, or a flipped byte caught by the CRC: ECORRUPT)
 *     during a step's promotions: kvt_step_decode returns the code after
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
    pfx *f = open_small_host(6 * PAGE_TOKENS + 5, 8 * PAGE_TOKENS + 3, 4, 300 + kind * 7 + nth);
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
    for (uint32_t l = 0; l < N_LAYERS; l++) {
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
                     "its selection", bad_seq, lh / N_KV_HEADS, lh % N_KV_HEADS);
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
    pfx *f = open_small_host(6 * PAGE_TOKENS - 1, 8 * PAGE_TOKENS - 1, 1, 0x0ff);
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
            const uint32_t pg = f->t[i].n / PAGE_TOKENS - 1;
            uint8_t rs;
            TU_OK(kvt_seq_block_table_get(f->p, f->t[i].id, lh / N_KV_HEADS, lh % N_KV_HEADS, pg, 1,
                                          NULL, NULL, &rs));
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


/* A warm-up whose disk read fails: layer 0 (unstable heads) reports the
 * error for the sequence, and the stable heads of layer 1, which the plan
 * did not mark due, must not reuse the warm-up's selection (it names a page
 * that never arrived): they rescore in the same step, and every page they
 * select is on the device before the decode reads it. Found in review. */
static void test_warmup_read_fault_later_layers(void **state)
{
    (void)state;
    kvt_geometry g = {N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, {0, 0}};
    kvt_head_class cls[NLH];
    uint32_t k[NLH], iv[NLH];
    for (uint32_t b = 0; b < NLH; b++) {
        cls[b] = b < N_KV_HEADS ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE; /* layer 0 unstable */
        k[b] = 2;
        iv[b] = b < N_KV_HEADS ? 1 : 16;
    }
    kvt_policy_heads hd = {sizeof hd, NLH, cls, k, NULL, NULL, NULL, iv, NULL};
    kvt_policy *pol;
    kvt_selector *sel;
    TU_OK(kvt_policy_create_heads(&g, NULL, &hd, &pol));
    TU_OK(kvt_selector_create(&g, NULL, &sel));
    kvt_mover_opts mo;
    TU_OK(kvt_mover_opts_init(&mo));
    mo.extent_pages = 4;
    mo.segment_extents = 2;
    mo.max_io_bytes = 8192; /* one page per request: the first read is one page */
    kvt_pool_opts o = disk_opts(256, 256, 16u << 20, &mo);
    o.geom = g;
    o.policy = pol;
    o.selector = sel;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_mover *m;
    TU_OK(kvt_pool_mover_get(p, &m));
    /* A sequence on rerank phase 1: with interval 16 its stable heads are
     * not due at its first step. */
    kvt_seq_id dummy, a;
    TU_OK(kvt_seq_create(p, NULL, &dummy));
    TU_OK(kvt_seq_create(p, NULL, &a));
    TU_OK(kvt_seq_release(p, dummy));
    tu_rng r = {7};
    const uint32_t n = 8 * PAGE_TOKENS + 5;
    uint16_t *kk = malloc((size_t)n * N_KV_HEADS * HEAD_DIM * 2),
             *vv = malloc((size_t)n * N_KV_HEADS * HEAD_DIM * 2);
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        for (size_t i = 0; i < (size_t)n * N_KV_HEADS * HEAD_DIM; i++) {
            kk[i] = rand_f16(&r);
            vv[i] = rand_f16(&r);
        }
        TU_OK(kvt_seq_append(p, a, l, kk, vv, n, KVT_DTYPE_F16, 0));
    }
    TU_OK(kvt_mover_wait(m, KVT_FENCE_ALL, UINT64_MAX));
    /* Layer 1's offloaded pages become disk-only, so warm-up reads them. */
    kvt_move mv[64];
    uint32_t nm = 0;
    for (uint32_t h = 0; h < N_KV_HEADS; h++)
        for (uint32_t pg = 1; pg < 8; pg++)
            if (residency(p, a, 1, h, pg) == (KVT_RES_HOST | KVT_RES_DISK))
                mv[nm++] = (kvt_move){a, 1, h, pg, KVT_TIER_HOST, KVT_TIER_DISK,
                                      KVT_MOVE_DROP_SOURCE};
    assert_true(nm > 0);
    kvt_fence fe;
    TU_OK(kvt_mover_submit(m, mv, nm, 0, NULL, &fe));
    TU_OK(kvt_mover_wait(m, fe, UINT64_MAX));
    float q[HQ * HEAD_DIM], out[HQ * HEAD_DIM], lse[HQ], kf[N_KV_HEADS * HEAD_DIM],
        vf[N_KV_HEADS * HEAD_DIM];
    float *obs = malloc((size_t)N_LAYERS * HQ * HEAD_DIM * sizeof *obs);
    for (size_t i = 0; i < (size_t)N_LAYERS * HQ * HEAD_DIM; i++)
        obs[i] = tu_unit(&r) * 2 - 1;
    TU_OK(kvt__mover_fault(m, false, KVT__FAULT_EIO, 1));
    TU_OK(kvt_seq_warmup(p, a, obs, 1));
    kvt_step *st;
    TU_OK(kvt_step_plan(p, &a, 1, NULL, &st));
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        for (int i = 0; i < N_KV_HEADS * HEAD_DIM; i++) {
            kf[i] = tu_unit(&r) - 0.5f;
            vf[i] = tu_unit(&r) - 0.5f;
        }
        for (int i = 0; i < HQ * HEAD_DIM; i++)
            q[i] = tu_unit(&r) * 2 - 1;
        TU_OK(kvt_step_append(st, l, kf, vf, KVT_DTYPE_F32, 0));
        TU_OK(kvt_step_select(st, l, q));
        const int rc = kvt_step_decode(st, l, q, out, lse);
        if (l == 0) {
            assert_int_equal(rc, KVT_EIO); /* the warm-up's failure, reported once */
            for (int g2 = 0; g2 < HQ; g2++)
                assert_true(isinf(lse[g2]) && lse[g2] < 0);
            continue;
        }
        TU_OK(rc);
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            uint32_t pages[64], cnt, rr;
            TU_OK(kvt_step_selection_get(st, l, 0, h, pages, 64, &cnt, &rr));
            assert_int_equal(rr, 1); /* rescored, not the warm-up's selection */
            for (uint32_t j = 0; j < cnt; j++)
                assert_true(residency(p, a, l, h, pages[j]) & KVT_RES_DEVICE);
        }
        for (int g2 = 0; g2 < HQ; g2++)
            assert_true(isfinite(lse[g2]));
    }
    TU_OK(kvt_step_finish(st));
    TU_CHECK(p);
    kvt_pool_destroy(p);
    kvt_policy_destroy(pol);
    kvt_selector_destroy(sel);
    free(kk);
    free(vv);
    free(obs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read_eio_first),  cmocka_unit_test(test_read_eio_later),
        cmocka_unit_test(test_read_flip_first), cmocka_unit_test(test_read_flip_later),
        cmocka_unit_test(test_offload_write_fault),
        cmocka_unit_test(test_warmup_read_fault_later_layers),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
