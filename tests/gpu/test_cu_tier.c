/* Tiered pools on the CUDA backend against the CPU backend, through the
 * public calls only.
 *
 * test_tiered_vs_cpu: the same policy (stable heads with a small budget and
 * window, one unstable head per layer), selector, prompts and decode steps
 * go to a CPU pool and a CUDA pool, each with a device tier too small for
 * every page, a pinned host tier too small for the offloaded pages and a
 * disk tier, so pages are offloaded (device -> host -> disk), the host
 * cache drops pages to the disk, and reranks promote pages from host and
 * disk into evicted pages' blocks; mid-run a sequence is forked (its pages
 * shared, in every tier) and the parent cut inside a shared page. Checked
 * at every layer of every step:
 * every head's selection equal, the attention output and lse within 2e-5,
 * and every page's device block and residency equal (the host decides the
 * placement on both backends from the same selections and votes); after
 * every step the placement counters equal and kvt_pool_check on both
 * (which on CUDA compares the GPU's table copies with the host tables). At
 * the end, every stored row bit for bit, from whichever tier holds it.
 *
 * test_ready_first_vs_cpu: the same, with the CUDA pool's copiers held
 * back 3 ms before each round (a test hook), so decodes meet promotions in
 * flight and go ready first (launch the ready sequences, wait, launch the
 * others); it checks that some did.
 *
 * test_moves_vs_cpu: a CUDA pool without a policy, with host and disk
 * tiers (its device copies by the zero-copy kernel, then again all by
 * cudaMemcpyAsync, then with the disk staging left pageable): the same
 * explicit mover batches (device -> host, host -> disk,
 * disk -> device, device -> disk, dropping sources or not) on both pools,
 * compared page by page; a decode over a page that lives only on the host
 * is refused on CUDA (KVT_ESTATE, the CPU reads the host page in place)
 * and equals the CPU once the page is back on the device.
 *
 * test_copier_rounds: one copier's rounds mixing kernel copies, large
 * copies and pageable memory, byte for byte.
 *
 * test_warmup_vs_cpu: kvt_seq_warmup on a tiered CUDA pool (importance
 * scored on the GPU: cuBLAS, or the fallback kernel with cuBLAS turned
 * off) against the CPU pool, for MINMAX and MEAN scoring and each vote.
 * Prompts and observed queries are small integers, so every score and sum
 * is exact in f32 whatever the order of the products: the importance must
 * equal the CPU's bit for bit (SUM, MAX; SOFTVOTE within 2e-5, its exp is
 * rounded differently), and so must the placement that follows from it
 * (every page's device block and residency, the counters), the first
 * selections of the steps after it, and kvt_pool_check.
 *
 * Exits 77 without a CUDA device; the -emu build runs it on the CPU
 * emulation. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"
#include "internal.h"
#include "gputest.h"

#define N_LAYERS 2u
#define N_KV_HEADS 4u
#define HQ 8u
#define GQA_GROUP (HQ / N_KV_HEADS)
#define HEAD_DIM 64u
#define PAGE_TOKENS 32u /* 8 KiB blocks of f16: one O_DIRECT slot */
#define NS 3u
#define STEPS 24u
#define NLH (N_LAYERS * N_KV_HEADS)
#define MAXPG 64u

static char g_dir[256];

typedef struct {
    kvt_pool *cpu, *gpu;
    kvt_policy *pol;
    kvt_selector *sel;
    kvt_mover_opts mo;
    kvt_seq_id ic[NS], ig[NS];
    void *stream;
    float *d_k, *d_v, *d_q, *d_out, *d_lse;
    tu_rng r;
    bool ints; /* prompts of small integers (exact scores) */
} fx;

#include "pairtest.h"

static kvt_pool_opts opts_of(fx *f, kvt_backend b, uint64_t dev_blocks, uint64_t host_blocks,
                             bool policy)
{
    TU_OK(kvt_mover_opts_init(&f->mo));
    f->mo.extent_pages = 4;
    f->mo.segment_extents = 2;
    f->mo.max_io_bytes = 4 * 8192;
    f->mo.copy_threads = 2;
    kvt_pool_opts o = tu_opts(N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16,
                              dev_blocks, host_blocks);
    o.backend = b;
    o.n_threads = 2;
    o.max_seqs = 8;
    o.mover = &f->mo;
    o.disk_dir = g_dir;
    o.disk_bytes = 4096ull * 8192;
    if (policy) {
        o.policy = f->pol;
        o.selector = f->sel;
    }
    return o;
}

/* Device blocks (blocks: their numbers; else whether there is one) and
 * residency of every page of one layer, equal. */
static void same_placement_of(const fx *f, uint32_t layer, const char *when, bool blocks)
{
    for (uint32_t i = 0; i < NS; i++) {
        uint32_t T;
        TU_OK(kvt_seq_length_get(f->cpu, f->ic[i], layer, &T));
        const uint32_t np = (T + PAGE_TOKENS - 1) / PAGE_TOKENS;
        assert_true(np <= MAXPG);
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            uint32_t da[MAXPG], db[MAXPG];
            uint8_t ra[MAXPG], rb[MAXPG];
            TU_OK(kvt_seq_block_table_get(f->cpu, f->ic[i], layer, h, 0, np, da, NULL, ra));
            TU_OK(kvt_seq_block_table_get(f->gpu, f->ig[i], layer, h, 0, np, db, NULL, rb));
            for (uint32_t pg = 0; pg < np; pg++)
                if ((blocks ? da[pg] != db[pg] : !da[pg] != !db[pg]) || ra[pg] != rb[pg])
                    fail_msg("%s: seq %u layer %u head %u page %u: CPU block %u res 0x%x, "
                             "CUDA block %u res 0x%x", when, i, layer, h, pg, da[pg], ra[pg],
                             db[pg], rb[pg]);
        }
    }
}

static void same_placement(const fx *f, uint32_t layer, const char *when)
{
    same_placement_of(f, layer, when, true);
}

/* One layer's selections and outputs, equal; returns reranked heads. */
static kvt_stats stats_of(const kvt_pool *p)
{
    kvt_stats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    TU_OK(kvt_pool_stats_get(p, &s));
    return s;
}

static void same_stats(const fx *f, uint32_t step)
{
    const kvt_stats a = stats_of(f->cpu), b = stats_of(f->gpu);
    const uint64_t va[] = {a.sel_pages, a.sel_resident, a.promoted_pages, a.recycled_blocks,
                           a.evicted_pages, a.offloaded_pages, a.reranked_heads,
                           a.tier[0].pages, a.tier[1].pages, a.tier[2].pages};
    const uint64_t vb[] = {b.sel_pages, b.sel_resident, b.promoted_pages, b.recycled_blocks,
                           b.evicted_pages, b.offloaded_pages, b.reranked_heads,
                           b.tier[0].pages, b.tier[1].pages, b.tier[2].pages};
    for (size_t j = 0; j < sizeof va / sizeof va[0]; j++)
        if (va[j] != vb[j])
            fail_msg("step %u: placement counter %zu: CPU %llu CUDA %llu", step, j,
                     (unsigned long long)va[j], (unsigned long long)vb[j]);
}

static void fx_buffers(fx *f)
{
    CU_OK(kvt__cu_stream_create(&f->stream, 0));
    f->d_k = dev(NS * N_KV_HEADS * HEAD_DIM * sizeof(float));
    f->d_v = dev(NS * N_KV_HEADS * HEAD_DIM * sizeof(float));
    f->d_q = dev(NS * HQ * HEAD_DIM * sizeof(float));
    f->d_out = dev(NS * HQ * HEAD_DIM * sizeof(float));
    f->d_lse = dev(NS * HQ * sizeof(float));
}

static void fx_free(fx *f)
{
    void *d[] = {f->d_k, f->d_v, f->d_q, f->d_out, f->d_lse};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        kvt__cu_free(d[i]);
    kvt__cu_stream_destroy(f->stream);
    kvt_pool_destroy(f->cpu);
    kvt_pool_destroy(f->gpu);
    kvt_policy_destroy(f->pol);
    kvt_selector_destroy(f->sel);
}

/* One step on both pools, every layer compared; moves settle at the end so
 * both pools start the next step from the same state. */
static void run_step(fx *f, uint32_t step, uint32_t *reranked)
{
    kvt_step *sc, *sg;
    plan_both(f, 0, false, &sc, &sg);
    float k[NS * N_KV_HEADS * HEAD_DIM], v[NS * N_KV_HEADS * HEAD_DIM], q[NS * HQ * HEAD_DIM],
        out[NS * HQ * HEAD_DIM], lse[NS * HQ];
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        rand_rows(&f->r, k, NS * N_KV_HEADS * HEAD_DIM);
        rand_rows(&f->r, v, NS * N_KV_HEADS * HEAD_DIM);
        rand_rows(&f->r, q, NS * HQ * HEAD_DIM);
        CU_OK(kvt__cu_memcpy(f->d_k, k, sizeof k));
        CU_OK(kvt__cu_memcpy(f->d_v, v, sizeof v));
        CU_OK(kvt__cu_memcpy(f->d_q, q, sizeof q));
        TU_OK(kvt_step_append(sc, l, k, v, KVT_DTYPE_F32, 0));
        NO_DEVICE_SYNC(kvt_step_append(sg, l, f->d_k, f->d_v, KVT_DTYPE_F32, 0));
        TU_OK(kvt_step_select(sc, l, q));
        TU_OK(kvt_step_decode(sc, l, q, out, lse));
        NO_DEVICE_SYNC(kvt_step_select(sg, l, f->d_q));
        NO_DEVICE_SYNC(kvt_step_decode(sg, l, f->d_q, f->d_out, f->d_lse));
        *reranked += compare_layer(sc, sg, l, out, lse, f);
        same_placement(f, l, "after the decode");
    }
    TU_OK(kvt_step_finish(sc));
    NO_DEVICE_SYNC(kvt_step_finish(sg));
    kvt_mover *mc, *mg;
    TU_OK(kvt_pool_mover_get(f->cpu, &mc));
    TU_OK(kvt_pool_mover_get(f->gpu, &mg));
    TU_OK(kvt_mover_wait(mc, KVT_FENCE_ALL, UINT64_MAX));
    NO_DEVICE_SYNC(kvt_mover_wait(mg, KVT_FENCE_ALL, UINT64_MAX));
    for (uint32_t l = 0; l < N_LAYERS; l++)
        same_placement(f, l, "after the step");
    same_stats(f, step);
    TU_CHECK(f->cpu);
    NO_DEVICE_SYNC(kvt_pool_check(f->gpu));
}

/* Stable heads with a small budget and window, one unstable head per layer. */
static void make_policy(fx *f, const kvt_geometry *g)
{
    kvt_head_class cls[NLH];
    uint32_t k[NLH], w[NLH], sink[NLH], local[NLH], iv[NLH];
    for (uint32_t b = 0; b < NLH; b++) {
        cls[b] = b % N_KV_HEADS == 3 ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE;
        k[b] = 3 + b % 2;
        w[b] = 2;
        sink[b] = 1;
        local[b] = 1;
        iv[b] = b % N_KV_HEADS == 3 ? 1 : 2 + b % 3;
    }
    kvt_policy_heads hd = {sizeof hd, NLH, cls, k, w, sink, local, iv, NULL};
    kvt_policy_opts po;
    TU_OK(kvt_policy_opts_init(&po));
    po.rerank_similarity = -1.0f; /* the CUDA step reranks on the interval alone */
    TU_OK(kvt_policy_create_heads(g, &po, &hd, &f->pol));
}

/* delay_us: the CUDA pool's copiers sleep that long before each round, so
 * a layer's promotions are still in flight when its decode comes and the
 * decode goes ready first (round 0 launched before the wait). */
/* The tiered pair: device room for the unstable heads' pages and about a
 * dozen per stable head, a host with fewer blocks than the stable heads'
 * offloaded pages, a disk; three sequences. */
static void tiered_open(fx *f, uint64_t seed)
{
    memset(f, 0, sizeof *f);
    f->r = (tu_rng){seed};
    kvt_geometry g = {N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, {0, 0}};
    make_policy(f, &g);
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.rerank_similarity = -1.0f; /* the CUDA step reranks on the interval alone */
    TU_OK(kvt_selector_create(&g, &so, &f->sel));
    kvt_pool_opts oc = opts_of(f, KVT_BACKEND_CPU, 420, 150, true);
    kvt_pool_opts og = opts_of(f, KVT_BACKEND_CUDA, 420, 150, true);
    TU_OK(kvt_pool_create(&oc, &f->cpu));
    TU_OK(kvt_pool_create(&og, &f->gpu));
    assert_int_equal(stats_of(f->gpu).backend, KVT_BACKEND_CUDA);
    fx_buffers(f);
    new_seq(f, 0, 300);
    new_seq(f, 1, 530);
    new_seq(f, 2, 700);
}

static void run_tiered(uint32_t delay_us)
{
    fx f;
    tiered_open(&f, 0x7133edull);
    for (uint32_t l = 0; l < N_LAYERS; l++)
        same_placement(&f, l, "after the prefill");
    uint32_t reranked = 0;
    const uint64_t rf0 = kvt__cuda_ready_first;
    __atomic_store_n(&kvt__cuda_mv_delay_us, delay_us, __ATOMIC_RELAXED);
    for (uint32_t step = 0; step < STEPS; step++) {
        if (step == 9) { /* a sequence leaves, another takes its slot */
            TU_OK(kvt_seq_release(f.cpu, f.ic[1]));
            TU_OK(kvt_seq_release(f.gpu, f.ig[1]));
            TU_OK(kvt_seq_create(f.cpu, NULL, &f.ic[1]));
            TU_OK(kvt_seq_create(f.gpu, NULL, &f.ig[1]));
            prefill(&f, 1, 450);
        }
        if (step == 12) { /* a short sequence replaces another */
            TU_OK(kvt_seq_release(f.cpu, f.ic[2]));
            TU_OK(kvt_seq_release(f.gpu, f.ig[2]));
            TU_OK(kvt_seq_create(f.cpu, NULL, &f.ic[2]));
            TU_OK(kvt_seq_create(f.gpu, NULL, &f.ig[2]));
            prefill(&f, 2, 100);
        }
        /* ... and gets a chunk after one step: 160 tokens, 5 full pages.
         * The chunk's trim drops the device copy of page 3 (neither forced
         * nor in the heads' top-K sets), which the heads whose budget covers
         * every page select at the next step without reranking. */
        if (step == 13)
            prefill(&f, 2, 59);
        if (step == 15) /* a prefill chunk between steps */
            prefill(&f, 0, 200);
        if (step == 5) { /* a fork of sequence 0 takes sequence 2's slot */
            TU_OK(kvt_seq_release(f.cpu, f.ic[2]));
            TU_OK(kvt_seq_release(f.gpu, f.ig[2]));
            TU_OK(kvt_seq_fork(f.cpu, f.ic[0], NULL, &f.ic[2]));
            TU_OK(kvt_seq_fork(f.gpu, f.ig[0], NULL, &f.ig[2]));
            same_contents(&f);
            TU_CHECK(f.gpu);
        }
        if (step == 7) { /* the parent is cut inside a page its fork shares */
            uint32_t n;
            TU_OK(kvt_seq_length_get(f.gpu, f.ig[0], 0, &n));
            TU_OK(kvt_seq_truncate(f.cpu, f.ic[0], n - 37));
            TU_OK(kvt_seq_truncate(f.gpu, f.ig[0], n - 37));
            same_contents(&f);
            TU_CHECK(f.cpu);
            TU_CHECK(f.gpu);
        }
        run_step(&f, step, &reranked);
    }
    __atomic_store_n(&kvt__cuda_mv_delay_us, 0u, __ATOMIC_RELAXED);
    const uint64_t split = kvt__cuda_ready_first - rf0;
    const kvt_stats st = stats_of(f.gpu);
    printf("# %u reranked heads over %u steps; CUDA pool: %llu promoted (%llu into recycled "
           "blocks), %llu evicted, %llu offloaded, %llu disk reads\n",
           reranked, STEPS, (unsigned long long)st.promoted_pages,
           (unsigned long long)st.recycled_blocks, (unsigned long long)st.evicted_pages,
           (unsigned long long)st.offloaded_pages,
           (unsigned long long)st.moved_requests[KVT_DIR_DISK_TO_HOST]);
    printf("# copier delay %u us: %llu of the CUDA decodes went ready first, %llu paused "
           "sequences\n", delay_us, (unsigned long long)split,
           (unsigned long long)st.paused_seqs);
    /* The run exercised what it is meant to: promotions into recycled
     * blocks, and pages that came back from the disk. */
    assert_true(st.recycled_blocks > 0);
    assert_true(st.promoted_pages > st.recycled_blocks / 2);
    assert_true(st.moved_requests[KVT_DIR_DISK_TO_HOST] > 0);
    /* With the copiers held back, decodes met promotions in flight and
     * launched the ready sequences first. */
    if (delay_us)
        assert_true(split > 0);
    same_contents(&f);

    /* What a tiered CUDA pool refuses: a dense step (stable heads keep most
     * pages off the device). */
    kvt_step_opts dso = KVT_STEP_OPTS_INIT;
    dso.flags = KVT_STEP_DENSE;
    dso.selector = f.sel;
    kvt_step *ds = NULL;
    TU_EXPECT_ERR(kvt_step_plan(f.gpu, f.ig, NS, &dso, &ds), KVT_ENOTSUP, "KVT_STEP_DENSE");
    assert_null(ds);
    TU_CHECK(f.gpu);
    fx_free(&f);
}

static void test_tiered_vs_cpu(void **state)
{
    (void)state;
    run_tiered(0);
}

static void test_ready_first_vs_cpu(void **state)
{
    (void)state;
    /* A timing variant of the run above (the copiers held back): left out
     * of the reduced set the compute-sanitizer stages run. */
    if (!gpu_case_kept(1))
        skip();
    run_tiered(3000);
}

/* A promotion that fails on the CUDA pool (the copy hook fails the first
 * round of copies into the device tier after it is armed): the decode
 * returns KVT_EIO, empties the sequences whose promotions failed (zeros and
 * -infinity) and serves the others exactly as the CPU pool does; the
 * layer's selection stays readable and equal to the CPU's, and a second
 * decode of the layer is refused until it is selected again. The next
 * step rescores the failed sequence's heads and runs clean. */
static void test_failed_promotion(void **state)
{
    (void)state;
    fx f;
    tiered_open(&f, 0xfa11edull);
    uint32_t reranked = 0;
    for (uint32_t step = 0; step < 2; step++)
        run_step(&f, step, &reranked);
    const size_t qn = NS * HQ * HEAD_DIM;
    float k[NS * N_KV_HEADS * HEAD_DIM], v[NS * N_KV_HEADS * HEAD_DIM], q[NS * HQ * HEAD_DIM],
        out[NS * HQ * HEAD_DIM], lse[NS * HQ];
    float *out_g = malloc(qn * sizeof(float)), lse_g[NS * HQ];
    assert_non_null(out_g);
    uint32_t hit_layer = UINT32_MAX, failed = 0, fail_seq = 0;
    __atomic_store_n(&kvt__cuda_mv_fail_rounds, 1u, __ATOMIC_RELAXED);
    for (uint32_t step = 2; step < 12 && hit_layer == UINT32_MAX; step++) {
        kvt_step *sc, *sg;
        plan_both(&f, 0, false, &sc, &sg);
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            rand_rows(&f.r, k, NS * N_KV_HEADS * HEAD_DIM);
            rand_rows(&f.r, v, NS * N_KV_HEADS * HEAD_DIM);
            rand_rows(&f.r, q, NS * HQ * HEAD_DIM);
            CU_OK(kvt__cu_memcpy(f.d_k, k, sizeof k));
            CU_OK(kvt__cu_memcpy(f.d_v, v, sizeof v));
            CU_OK(kvt__cu_memcpy(f.d_q, q, sizeof q));
            TU_OK(kvt_step_append(sc, l, k, v, KVT_DTYPE_F32, 0));
            NO_DEVICE_SYNC(kvt_step_append(sg, l, f.d_k, f.d_v, KVT_DTYPE_F32, 0));
            TU_OK(kvt_step_select(sc, l, q));
            TU_OK(kvt_step_decode(sc, l, q, out, lse));
            NO_DEVICE_SYNC(kvt_step_select(sg, l, f.d_q));
            const int rc = kvt_step_decode(sg, l, f.d_q, f.d_out, f.d_lse);
            if (hit_layer != UINT32_MAX)
                continue; /* the pools differ from the failure on */
            if (rc == 0) {
                reranked += compare_layer(sc, sg, l, out, lse, &f);
                continue;
            }
            assert_int_equal(rc, KVT_EIO);
            assert_non_null(strstr(kvt_last_error(), "test hook"));
            hit_layer = l;
            CU_OK(kvt__cu_stream_sync(f.stream));
            CU_OK(kvt__cu_memcpy(out_g, f.d_out, qn * sizeof(float)));
            CU_OK(kvt__cu_memcpy(lse_g, f.d_lse, sizeof lse_g));
            for (uint32_t i = 0; i < NS; i++) {
                bool empty = true;
                for (size_t e = (size_t)i * HQ * HEAD_DIM; e < (size_t)(i + 1) * HQ * HEAD_DIM; e++)
                    empty = empty && out_g[e] == 0.0f;
                for (size_t e = (size_t)i * HQ; e < (size_t)(i + 1) * HQ; e++)
                    empty = empty && isinf(lse_g[e]) && lse_g[e] < 0;
                if (empty) {
                    failed++;
                    fail_seq = i;
                } else {
                    same_rows(out_g, lse_g, out, lse, l, i);
                }
            }
            /* The selection stays readable, and equal to the CPU's. */
            (void)same_selections(sc, sg, l);
            TU_EXPECT_ERR(kvt_step_decode(sg, l, f.d_q, f.d_out, f.d_lse), KVT_ESTATE,
                          "select the layer again");
        }
        TU_OK(kvt_step_finish(sc));
        NO_DEVICE_SYNC(kvt_step_finish(sg));
    }
    printf("# failed promotion at layer %u: %u of %u sequences emptied\n", hit_layer, failed,
           NS);
    assert_true(hit_layer != UINT32_MAX);
    assert_true(failed >= 1 && failed < NS);
    NO_DEVICE_SYNC(kvt_pool_check(f.gpu));

    /* The next step on the CUDA pool: clean (the pages whose promotions
     * failed are not on device: the heads that selected them rescore and
     * promote them again). */
    kvt_step_opts sgo = KVT_STEP_OPTS_INIT;
    sgo.selector = f.sel;
    sgo.stream = f.stream;
    kvt_step *sg;
    NO_DEVICE_SYNC(kvt_step_plan(f.gpu, f.ig, NS, &sgo, &sg));
    uint32_t rescored = 0;
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        NO_DEVICE_SYNC(kvt_step_append(sg, l, f.d_k, f.d_v, KVT_DTYPE_F32, 0));
        NO_DEVICE_SYNC(kvt_step_select(sg, l, f.d_q));
        NO_DEVICE_SYNC(kvt_step_decode(sg, l, f.d_q, f.d_out, f.d_lse));
        for (uint32_t h = 0; l == hit_layer && h < N_KV_HEADS; h++) {
            uint32_t b[MAXPG], nb, rb;
            NO_DEVICE_SYNC(kvt_step_selection_get(sg, l, fail_seq, h, b, MAXPG, &nb, &rb));
            rescored += h != 3 && rb; /* head 3 is unstable: it rescores every step */
        }
    }
    assert_true(rescored > 0);
    NO_DEVICE_SYNC(kvt_step_finish(sg));
    NO_DEVICE_SYNC(kvt_pool_check(f.gpu));
    free(out_g);
    fx_free(&f);
}

#define NOBS 5u

/* Every stable head's importance of sequence i on both pools. */
static void same_importance(const fx *f, uint32_t i, bool exact, const char *what)
{
    kvt__seq *a, *b;
    TU_OK(kvt__seq_lookup(f->cpu, f->ic[i], &a));
    TU_OK(kvt__seq_lookup(f->gpu, f->ig[i], &b));
    for (uint32_t l = 0; l < N_LAYERS; l++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            const size_t lh = (size_t)l * N_KV_HEADS + h;
            if (h == 3) /* unstable */
                continue;
            for (uint32_t pg = 0; pg < (a->n_tokens[l] + PAGE_TOKENS - 1) / PAGE_TOKENS; pg++) {
                const float x = a->tier.imp[lh * a->cap_pages + pg], y = b->tier.imp[lh * b->cap_pages + pg];
                const bool ok = exact ? memcmp(&x, &y, sizeof x) == 0
                                      : fabsf(x - y) <= 2e-5f * (1.0f + fabsf(x));
                if (!ok)
                    fail_msg("%s: seq %u layer %u head %u page %u: importance CPU %.9g CUDA "
                             "%.9g", what, i, l, h, pg, (double)x, (double)y);
            }
        }
}

static void test_warmup_vs_cpu(void **state)
{
    (void)state;
    static const struct {
        kvt_score_method method;
        kvt_vote vote;
        int no_blas, split; /* split: a scoring budget of 1 KiB (queries in several calls) */
    } cfg[] = {{KVT_SCORE_MINMAX, KVT_VOTE_SUM, 0, 0},      {KVT_SCORE_MEAN, KVT_VOTE_MAX, 0, 1},
               {KVT_SCORE_MINMAX, KVT_VOTE_SOFTVOTE, 0, 0}, {KVT_SCORE_MINMAX, KVT_VOTE_MAX, 1, 0},
               {KVT_SCORE_MEAN, KVT_VOTE_SUM, 1, 1},        {KVT_SCORE_MEAN, KVT_VOTE_SOFTVOTE, 1, 0}};
    const size_t budget = kvt__cuda_warm_budget;
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        if (!gpu_case_kept(c))
            continue;
        char what[96];
        snprintf(what, sizeof what, "method %u vote %u%s%s", (unsigned)cfg[c].method,
                 (unsigned)cfg[c].vote, cfg[c].no_blas ? " (no cuBLAS)" : "",
                 cfg[c].split ? " (split)" : "");
        kvt__cuda_warm_budget = cfg[c].split ? 1024 : budget;
        printf("# warm-up: %s\n", what);
        fx f;
        memset(&f, 0, sizeof f);
        f.r = (tu_rng){0x3a47ull + c};
        f.ints = true;
        kvt_geometry g = {N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, {0, 0}};
        make_policy(&f, &g);
        kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
        so.rerank_similarity = -1.0f; /* the CUDA step reranks on the interval alone */
        so.method = cfg[c].method;
        so.vote = cfg[c].vote;
        so.vote_scale = 0.125f;
        TU_OK(kvt_selector_create(&g, &so, &f.sel));
        kvt__cu_blas_forbid(cfg[c].no_blas);
        kvt_pool_opts oc = opts_of(&f, KVT_BACKEND_CPU, 420, 150, true);
        kvt_pool_opts og = opts_of(&f, KVT_BACKEND_CUDA, 420, 150, true);
        TU_OK(kvt_pool_create(&oc, &f.cpu));
        TU_OK(kvt_pool_create(&og, &f.gpu));
        fx_buffers(&f);
        const uint32_t len[NS] = {300, 530, 700};
        float *obs = malloc((size_t)N_LAYERS * NOBS * HQ * HEAD_DIM * sizeof(float));
        kvt_mover *mc, *mg;
        TU_OK(kvt_pool_mover_get(f.cpu, &mc));
        TU_OK(kvt_pool_mover_get(f.gpu, &mg));
        for (uint32_t i = 0; i < NS; i++) {
            /* Each call starts from the same tiers on both pools: no
             * offload or read in flight (the host's free blocks decide
             * which host copies the warm-up keeps). */
            new_seq(&f, i, len[i]);
            TU_OK(kvt_mover_wait(mc, KVT_FENCE_ALL, UINT64_MAX));
            TU_OK(kvt_mover_wait(mg, KVT_FENCE_ALL, UINT64_MAX));
            int_rows(&f.r, obs, (size_t)N_LAYERS * NOBS * HQ * HEAD_DIM);
            TU_OK(kvt_seq_warmup(f.cpu, f.ic[i], obs, NOBS));
            TU_OK(kvt_seq_warmup(f.gpu, f.ig[i], obs, NOBS));
            same_importance(&f, i, cfg[c].vote != KVT_VOTE_SOFTVOTE, what);
            TU_OK(kvt_mover_wait(mc, KVT_FENCE_ALL, UINT64_MAX));
            TU_OK(kvt_mover_wait(mg, KVT_FENCE_ALL, UINT64_MAX));
        }
        free(obs);
        for (uint32_t l = 0; l < N_LAYERS; l++)
            same_placement(&f, l, what);
        same_stats(&f, 0);
        assert_true(stats_of(f.gpu).promoted_pages > 0);
        TU_CHECK(f.cpu);
        TU_CHECK(f.gpu);
        /* The first steps reuse the warm-up's top-K sets. */
        uint32_t reranked = 0;
        for (uint32_t step = 0; step < 3; step++)
            run_step(&f, step, &reranked);
        kvt__cu_blas_forbid(0);
        kvt__cuda_warm_budget = budget;
        fx_free(&f);
    }
}

static void move_both(fx *f, const kvt_move *mc, uint32_t n)
{
    kvt_move mg[16];
    assert_true(n <= 16);
    int32_t rc_c[16], rc_g[16];
    for (uint32_t j = 0; j < n; j++) {
        mg[j] = mc[j];
        for (uint32_t i = 0; i < NS; i++)
            if (mc[j].seq == f->ic[i])
                mg[j].seq = f->ig[i];
    }
    kvt_mover *m1, *m2;
    kvt_fence f1, f2;
    TU_OK(kvt_pool_mover_get(f->cpu, &m1));
    TU_OK(kvt_pool_mover_get(f->gpu, &m2));
    TU_OK(kvt_mover_submit(m1, mc, n, 0, rc_c, &f1));
    TU_OK(kvt_mover_submit(m2, mg, n, 0, rc_g, &f2));
    TU_OK(kvt_mover_wait(m1, f1, UINT64_MAX));
    TU_OK(kvt_mover_wait(m2, f2, UINT64_MAX));
    for (uint32_t j = 0; j < n; j++) {
        assert_int_equal(rc_c[j], 0);
        assert_int_equal(rc_g[j], 0);
    }
    /* Block numbers may differ: the sources a batch drops go back to the
     * free list in the order their copies finish, which the copy threads'
     * and the I/O thread's timing decides on either backend. */
    for (uint32_t l = 0; l < N_LAYERS; l++)
        same_placement_of(f, l, "after a batch of moves", false);
    same_contents(f);
    TU_CHECK(f->cpu);
    TU_CHECK(f->gpu);
}

/* unpinned: the I/O thread's staging is left pageable (the pin is refused),
 * so its copies to and from the device must go by cudaMemcpyAsync (the
 * emulation refuses a copy kernel over pageable memory, as a GPU would
 * fault). */
static void run_moves(size_t kernel_max, bool unpinned)
{
    kvt__cuda_copy_kernel_max = kernel_max;
    fx f;
    memset(&f, 0, sizeof f);
    f.r = (tu_rng){0x30e5ull};
    kvt_geometry g = {N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, {0, 0}};
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.rerank_similarity = -1.0f; /* the CUDA step reranks on the interval alone */
    so.top_k_pages = 2;
    so.sink_pages = 1;
    so.local_pages = 1;
    TU_OK(kvt_selector_create(&g, &so, &f.sel));
    kvt_pool_opts oc = opts_of(&f, KVT_BACKEND_CPU, 400, 64, false);
    kvt_pool_opts og = opts_of(&f, KVT_BACKEND_CUDA, 400, 64, false);
    TU_OK(kvt_pool_create(&oc, &f.cpu));
    kvt__cuda_pin_refuse = unpinned;
    TU_OK(kvt_pool_create(&og, &f.gpu));
    kvt__cuda_pin_refuse = false;
    fx_buffers(&f);
    for (uint32_t i = 0; i < NS; i++)
        new_seq(&f, i, 200 + 90 * i);
    const kvt_seq_id s0 = f.ic[0], s1 = f.ic[1];
    const uint32_t DV = KVT_TIER_DEVICE, HO = KVT_TIER_HOST, DI = KVT_TIER_DISK;
    const uint32_t DROP = KVT_MOVE_DROP_SOURCE;
    /* Out of the device (kept, then dropped), host to disk, back. */
    const kvt_move b1[] = {{s0, 0, 1, 2, DV, HO, 0},    {s0, 0, 1, 3, DV, HO, DROP},
                           {s0, 1, 2, 4, DV, HO, DROP}, {s1, 1, 0, 1, DV, DI, DROP},
                           {s1, 0, 3, 5, DV, DI, 0},    {s1, 1, 3, 2, DV, HO, DROP}};
    move_both(&f, b1, 6);
    const kvt_move b2[] = {{s0, 0, 1, 3, HO, DI, DROP}, {s0, 1, 2, 4, HO, DI, 0},
                           {s1, 1, 0, 1, DI, DV, DROP}};
    move_both(&f, b2, 3);
    const kvt_move b3[] = {{s0, 0, 1, 3, DI, DV, 0}, {s0, 1, 2, 4, DI, HO, 0}};
    move_both(&f, b3, 2);

    /* A dense decode of layer 1: page 4 of s0 head 2 and page 2 of s1 head
     * 3 live on the host only. The CPU reads them in place; CUDA refuses
     * (the output is not the attention) until they are back. */
    kvt_step_opts sc_o = KVT_STEP_OPTS_INIT;
    sc_o.selector = f.sel;
    sc_o.flags = KVT_STEP_DENSE;
    kvt_step_opts sg_o = sc_o;
    sg_o.stream = f.stream;
    float q[NS * HQ * HEAD_DIM], out[NS * HQ * HEAD_DIM], lse[NS * HQ];
    for (int round = 0; round < 2; round++) {
        kvt_step *sc, *sg;
        TU_OK(kvt_step_plan(f.cpu, f.ic, NS, &sc_o, &sc));
        TU_OK(kvt_step_plan(f.gpu, f.ig, NS, &sg_o, &sg));
        rand_rows(&f.r, q, NS * HQ * HEAD_DIM);
        CU_OK(kvt__cu_memcpy(f.d_q, q, sizeof q));
        TU_OK(kvt_step_attend(sc, 1, q, out, lse));
        if (round == 0) {
            TU_EXPECT_ERR(kvt_step_attend(sg, 1, f.d_q, f.d_out, f.d_lse), KVT_ESTATE,
                          "device tier");
            assert_non_null(strstr(kvt_last_error(), "2 selected pages"));
        } else {
            TU_OK(kvt_step_attend(sg, 1, f.d_q, f.d_out, f.d_lse));
            compare_layer(sc, sg, 1, out, lse, &f);
        }
        TU_OK(kvt_step_finish(sc));
        TU_OK(kvt_step_finish(sg));
        if (round == 0) {
            const kvt_move back[] = {{s0, 1, 2, 4, HO, DV, 0}, {s1, 1, 3, 2, HO, DV, 0}};
            move_both(&f, back, 2);
        }
    }

    /* A page copied out while the kernel that appends to it is still queued
     * on the step's stream: the copy waits for it (the batch's event), so
     * the host copy holds the new token. Checked by dropping the device
     * copy and comparing every stored row. */
    {
        uint32_t T;
        TU_OK(kvt_seq_length_get(f.cpu, s0, 0, &T));
        /* Steps until the token that fills the page. */
        const uint32_t need = PAGE_TOKENS - T % PAGE_TOKENS;
        for (uint32_t st = 0; st < need; st++) {
            kvt_step *sc, *sg;
            float k[NS * N_KV_HEADS * HEAD_DIM], v[NS * N_KV_HEADS * HEAD_DIM];
            TU_OK(kvt_step_plan(f.cpu, f.ic, NS, &sc_o, &sc));
            TU_OK(kvt_step_plan(f.gpu, f.ig, NS, &sg_o, &sg));
            rand_rows(&f.r, k, NS * N_KV_HEADS * HEAD_DIM);
            rand_rows(&f.r, v, NS * N_KV_HEADS * HEAD_DIM);
            CU_OK(kvt__cu_memcpy(f.d_k, k, sizeof k));
            CU_OK(kvt__cu_memcpy(f.d_v, v, sizeof v));
            for (uint32_t l = 0; l < N_LAYERS; l++) { /* a step appends every layer */
                TU_OK(kvt_step_append(sc, l, k, v, KVT_DTYPE_F32, 0));
                TU_OK(kvt_step_append(sg, l, f.d_k, f.d_v, KVT_DTYPE_F32, 0));
            }
            if (st + 1 == need) { /* the page is full with this step's token, still queued */
                const kvt_move out1[] = {{s0, 0, 0, T / PAGE_TOKENS, DV, HO, 0}};
                move_both(&f, out1, 1);
            }
            TU_OK(kvt_step_finish(sc));
            TU_OK(kvt_step_finish(sg));
        }
        const kvt_move drop[] = {{s0, 0, 0, T / PAGE_TOKENS, DV, HO, DROP}};
        move_both(&f, drop, 1);
    }
    fx_free(&f);
    kvt__cuda_copy_kernel_max = KVT__CU_COPY_KERNEL_MAX;
}

/* The mover's device copies by the zero-copy kernel (pages of 8 KiB are
 * below the switch), then all by cudaMemcpyAsync. */
static void test_moves_vs_cpu(void **state)
{
    (void)state;
    run_moves(KVT__CU_COPY_KERNEL_MAX, false);
    run_moves(0, false);
    run_moves(KVT__CU_COPY_KERNEL_MAX, true);
}

/* One copier's rounds, straight: 300 copies (more than a round's list
 * holds) of 1..12000 bytes at odd offsets, between device memory and pinned
 * or pageable host memory both ways, with the kernel's limit at 4 KiB, so
 * a round mixes kernel copies, large copies and pageable ones (the last two
 * by cudaMemcpyAsync). Every destination byte equals its source, and the
 * bytes no copy targets keep their fill. */
static void test_copier_rounds(void **state)
{
    (void)state;
    enum { NC = 300, MAXC = 12000 };
    fx f;
    memset(&f, 0, sizeof f);
    tu_rng r = {0xc09e5ull};
    kvt_geometry g = {N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, {0, 0}};
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.rerank_similarity = -1.0f; /* the CUDA step reranks on the interval alone */
    TU_OK(kvt_selector_create(&g, &so, &f.sel));
    kvt_pool_opts og = opts_of(&f, KVT_BACKEND_CUDA, 64, 64, false);
    TU_OK(kvt_pool_create(&og, &f.gpu));
    uint32_t size[NC], kind[NC];
    size_t off[NC], S = 0;
    for (uint32_t j = 0; j < NC; j++) {
        size[j] = 1u + (uint32_t)(tu_next(&r) % MAXC);
        kind[j] = (uint32_t)(tu_next(&r) % 4u);
        off[j] = S + (tu_next(&r) % 16u);
        S = off[j] + size[j];
    }
    /* [0, S): sources; [S, 2S): destinations. */
    uint8_t *hp = NULL, *dv = NULL;
    uint8_t *pg = malloc(2 * S), *ref_dv = malloc(S), *back = malloc(2 * S);
    assert_non_null(pg);
    assert_non_null(ref_dv);
    assert_non_null(back);
    CU_OK(kvt__cu_host_alloc((void **)&hp, 2 * S));
    CU_OK(kvt__cu_malloc((void **)&dv, 2 * S));
    for (size_t e = 0; e < S; e++) {
        hp[e] = (uint8_t)tu_next(&r);
        pg[e] = (uint8_t)tu_next(&r);
        ref_dv[e] = (uint8_t)tu_next(&r);
    }
    memset(hp + S, 0x5a, S);
    memset(pg + S, 0x5a, S);
    memset(back, 0x5a, S);
    memcpy(back + S, back, S);
    memcpy(back, ref_dv, S);
    CU_OK(kvt__cu_memcpy(dv, back, 2 * S));
    kvt__cuda_copy_kernel_max = 4096;
    void *cp = NULL;
    const kvt__backend *be = f.gpu->be;
    CU_OK(be->copier_open(f.gpu, &cp));
    for (uint32_t j = 0; j < NC; j++) {
        const size_t o = off[j];
        switch (kind[j]) {
        case 0: CU_OK(be->copy(f.gpu, cp, NULL, dv + S + o, hp + o, size[j], true)); break;
        case 1: CU_OK(be->copy(f.gpu, cp, NULL, dv + S + o, pg + o, size[j], false)); break;
        case 2: CU_OK(be->copy(f.gpu, cp, NULL, hp + S + o, dv + o, size[j], true)); break;
        default: CU_OK(be->copy(f.gpu, cp, NULL, pg + S + o, dv + o, size[j], false));
        }
    }
    CU_OK(be->copier_sync(f.gpu, cp));
    kvt__cuda_copy_kernel_max = KVT__CU_COPY_KERNEL_MAX;
    be->copier_close(cp);
    CU_OK(kvt__cu_memcpy(back, dv, 2 * S));
    /* The expected destinations, built on the host. */
    uint8_t *want_dv = malloc(S), *want_hp = malloc(S), *want_pg = malloc(S);
    assert_non_null(want_dv);
    assert_non_null(want_hp);
    assert_non_null(want_pg);
    memset(want_dv, 0x5a, S);
    memset(want_hp, 0x5a, S);
    memset(want_pg, 0x5a, S);
    uint32_t nk = 0;
    for (uint32_t j = 0; j < NC; j++) {
        const size_t o = off[j];
        nk += (kind[j] == 0 || kind[j] == 2) && size[j] <= 4096;
        switch (kind[j]) {
        case 0: memcpy(want_dv + o, hp + o, size[j]); break;
        case 1: memcpy(want_dv + o, pg + o, size[j]); break;
        case 2: memcpy(want_hp + o, ref_dv + o, size[j]); break;
        default: memcpy(want_pg + o, ref_dv + o, size[j]);
        }
    }
    assert_true(nk > 20 && nk < NC - 20); /* both paths, in the same rounds */
    assert_memory_equal(back + S, want_dv, S);
    assert_memory_equal(hp + S, want_hp, S);
    assert_memory_equal(pg + S, want_pg, S);
    assert_memory_equal(back, ref_dv, S); /* sources untouched */
    free(want_dv);
    free(want_hp);
    free(want_pg);
    free(pg);
    free(ref_dv);
    free(back);
    kvt__cu_host_free(hp);
    kvt__cu_free(dv);
    kvt_pool_destroy(f.gpu);
    kvt_selector_destroy(f.sel);
}

static int setup(void **state)
{
    (void)state;
    const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(g_dir, sizeof g_dir, "%s/kvt-cutier-XXXXXX", base);
    return mkdtemp(g_dir) ? 0 : -1;
}

/* After each test, pass or fail: the test hooks back to their defaults, so
 * a failed test does not leave them set for the next. */
static int reset_hooks(void **state)
{
    (void)state;
    __atomic_store_n(&kvt__cuda_mv_delay_us, 0u, __ATOMIC_RELAXED);
    __atomic_store_n(&kvt__cuda_mv_fail_rounds, 0u, __ATOMIC_RELAXED);
    kvt__cuda_copy_kernel_max = KVT__CU_COPY_KERNEL_MAX;
    kvt__cuda_pin_refuse = false;
    kvt__cuda_warm_budget = KVT__CU_WARM_BUDGET;
    kvt__cu_blas_forbid(0);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return rmdir(g_dir);
}

int main(void)
{
    GPU_SKIP_WITHOUT_DEVICE();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_tiered_vs_cpu, reset_hooks),
        cmocka_unit_test_teardown(test_ready_first_vs_cpu, reset_hooks),
        cmocka_unit_test_teardown(test_failed_promotion, reset_hooks),
        cmocka_unit_test_teardown(test_moves_vs_cpu, reset_hooks),
        cmocka_unit_test_teardown(test_copier_rounds, reset_hooks),
        cmocka_unit_test_teardown(test_warmup_vs_cpu, reset_hooks),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
