/* Pools on the CUDA backend against the CPU backend, through the public
 * calls only: the same geometry, selector, prompts and decode steps go to a
 * CPU pool and a CUDA pool (device tier and metadata store in GPU memory,
 * append/select/decode as the kernels of cuda/ on the step's stream, k/v/q
 * and outputs in device memory). Checked at every layer of every step: the
 * selection of every head (equal, or different only by a near-tie of the
 * votes, which the two backends sum in different orders), the attention
 * output and lse; at the end, every stored K/V row and every page's
 * metadata bit for bit, kvt_pool_check on both, and the CUDA pool's
 * refusals of what it does not serve. Sequences are released and created
 * mid-run (slot reuse) and grow their tables (the GPU table heap moves
 * them); forks, truncations and saved streams (test_fork_truncate_stream). Exits 77 without a CUDA device; the -emu build runs it on the
 * CPU emulation. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "internal.h"
#include "gputest.h"

#define N_LAYERS 2u
#define N_KV_HEADS 4u
#define HQ 8u
#define GQA_GROUP (HQ / N_KV_HEADS)
#define HEAD_DIM 64u
#define PAGE_TOKENS 16u
#define NS 3u
#define STEPS 20u
#define MAXPG 128u

typedef struct {
    kvt_pool *cpu, *gpu;
    kvt_selector *sel;
    kvt_seq_id ic[NS], ig[NS];
    void *stream;
    float *d_k, *d_v, *d_q, *d_out, *d_lse;
    tu_rng r;
    bool ints;
} fx;

#include "pairtest.h"

static uint32_t g_pool_flags; /* kvt_pool_opts.flags of the next fx_open */
static uint32_t g_device_blocks = 2000;

static kvt_pool_opts opts_of(kvt_backend b)
{
    kvt_pool_opts o = tu_opts(N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16,
                              g_device_blocks, 0);
    o.backend = b;
    o.flags = g_pool_flags;
    o.n_threads = 2;
    o.max_seqs = 8;
    return o;
}

/* Both pools, a selector of top_k pages reranking every `interval` steps,
 * and the engine's stream. */
static void fx_open(fx *f, uint64_t seed, uint32_t top_k, uint32_t interval)
{
    memset(f, 0, sizeof *f);
    f->r = (tu_rng){seed};
    kvt_pool_opts oc = opts_of(KVT_BACKEND_CPU), og = opts_of(KVT_BACKEND_CUDA);
    TU_OK(kvt_pool_create(&oc, &f->cpu));
    TU_OK(kvt_pool_create(&og, &f->gpu));
    kvt_geometry g = {N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, {0, 0}};
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    so.rerank_similarity = -1.0f; /* the CUDA step reranks on the interval alone */
    so.top_k_pages = top_k;
    so.rerank_interval = interval;
    TU_OK(kvt_selector_create(&g, &so, &f->sel));
    CU_OK(kvt__cu_stream_create(&f->stream, 0));
    /* A step's k, v, q, out and lse in device memory. */
    f->d_k = dev(NS * N_KV_HEADS * HEAD_DIM * sizeof(float));
    f->d_v = dev(NS * N_KV_HEADS * HEAD_DIM * sizeof(float));
    f->d_q = dev(NS * HQ * HEAD_DIM * sizeof(float));
    f->d_out = dev(NS * HQ * HEAD_DIM * sizeof(float));
    f->d_lse = dev(NS * HQ * sizeof(float));
}

static void fx_close(fx *f)
{
    void *d[] = {f->d_k, f->d_v, f->d_q, f->d_out, f->d_lse};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        kvt__cu_free(d[i]);
    kvt__cu_stream_destroy(f->stream);
    kvt_pool_destroy(f->cpu);
    kvt_pool_destroy(f->gpu);
    kvt_selector_destroy(f->sel);
}

/* One step on both pools. reselect: layer 0 is selected again after layer
 * 1 (its queued work must not be disturbed); no_stream: the CUDA step names
 * no stream (each call then waits). */
static void run_step(fx *f, uint32_t flags, bool reselect, bool no_stream, uint32_t *reranked)
{
    kvt_step *sc, *sg;
    plan_both(f, flags, no_stream, &sc, &sg);
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
        TU_OK(kvt_step_attend(sc, l, q, out, lse));
        NO_DEVICE_SYNC(kvt_step_select(sg, l, f->d_q));
        NO_DEVICE_SYNC(kvt_step_decode(sg, l, f->d_q, f->d_out, f->d_lse));
        *reranked += compare_layer(sc, sg, l, out, lse, f);
    }
    if (reselect) {
        rand_rows(&f->r, q, NS * HQ * HEAD_DIM);
        CU_OK(kvt__cu_memcpy(f->d_q, q, sizeof q));
        TU_OK(kvt_step_attend(sc, 0, q, out, lse));
        NO_DEVICE_SYNC(kvt_step_attend(sg, 0, f->d_q, f->d_out, f->d_lse));
        *reranked += compare_layer(sc, sg, 0, out, lse, f);
    }
    TU_OK(kvt_step_finish(sc));
    NO_DEVICE_SYNC(kvt_step_finish(sg));
}

static void test_pool_vs_cpu(void **state)
{
    (void)state;
    fx f;
    fx_open(&f, 0xc0da5eedull, 4, 3);
    kvt_stats st = {.struct_size = sizeof st};
    TU_OK(kvt_pool_stats_get(f.gpu, &st));
    assert_int_equal(st.backend, KVT_BACKEND_CUDA);
    kvt_geometry g = {N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, {0, 0}};
    new_seq(&f, 0, 37);
    new_seq(&f, 1, 100);
    new_seq(&f, 2, 250); /* past the first table capacity of 16 pages */
    uint32_t reranked = 0;
    for (uint32_t step = 0; step < STEPS; step++) {
        if (step == 7) { /* a sequence leaves, another takes its slot */
            TU_OK(kvt_seq_release(f.cpu, f.ic[1]));
            TU_OK(kvt_seq_release(f.gpu, f.ig[1]));
            TU_OK(kvt_seq_create(f.cpu, NULL, &f.ic[1]));
            TU_OK(kvt_seq_create(f.gpu, NULL, &f.ig[1]));
            prefill(&f, 1, 300);
        }
        if (step == 12) /* a prefill chunk while others decode: the table grows */
            prefill(&f, 0, 500);
        if (step == 17) /* a larger K for one head: the saved sets stay */
            TU_OK(kvt_selector_budget_set(f.sel, 1, 2, 7, 1, 1));
        run_step(&f, step == 15 ? KVT_STEP_DENSE : 0, step % 5 == 4, step == 10, &reranked);
        TU_CHECK(f.cpu);
        TU_CHECK(f.gpu);
    }
    printf("# %u reranked heads compared over %u steps\n", reranked, STEPS);
    assert_true(reranked > STEPS);
    same_contents(&f);

    /* kvt_pool_check compares the GPU's table copies with the host's: two
     * pages' blocks swapped on the host only (every host-side invariant
     * still holds) must be reported. */
    kvt__seq *s0;
    TU_OK(kvt__seq_lookup(f.gpu, f.ig[0], &s0));
    uint32_t *e = s0->dev_block; /* layer 0, head 0, pages 0 and 1 */
    uint32_t t0 = e[0];
    e[0] = e[1];
    e[1] = t0;
    TU_EXPECT_ERR(kvt_pool_check(f.gpu), KVT_EINTERNAL, "CUDA table copy");
    e[1] = e[0];
    e[0] = t0;
    TU_CHECK(f.gpu);

    /* What the CUDA backend does not serve in this release. */
    uint32_t pages[64], n;
    float q[GQA_GROUP * HEAD_DIM] = {0};
    TU_EXPECT_ERR(kvt_selector_select(f.sel, f.gpu, f.ig[0], 0, 0, q, pages, 64, &n, NULL), KVT_ENOTSUP,
                  "kvt_step_select");
    kvt_pool *p2 = NULL;
    kvt_pool_opts bad;
    kvt_profiler *prof;
    TU_OK(kvt_profiler_create(&g, NULL, &prof));
    kvt_step_opts po = KVT_STEP_OPTS_INIT;
    po.selector = f.sel;
    po.profiler = prof;
    kvt_step *ps = NULL;
    TU_EXPECT_ERR(kvt_step_plan(f.gpu, f.ig, NS, &po, &ps), KVT_ENOTSUP, "profiler");
    assert_null(ps);
    kvt_profiler_destroy(prof);
    bad = opts_of(KVT_BACKEND_CUDA);
    bad.cuda_device = 99;
    TU_EXPECT_ERR(kvt_pool_create(&bad, &p2), KVT_EINVAL, "cuda_device");

    fx_close(&f);
}

/* A prefill chunk right after kvt_step_finish, with the step's kernels
 * still queued on the engine's stream: a sequence leaves (its blocks go
 * back to the free list, the last freed first) and another's chunk takes
 * them, and the chunk extends the page the step's token went to. The
 * prefill runs on the pool's stream and must wait for the finished step on
 * the GPU, or it overwrites the blocks the step's decode still reads and
 * races the step's append on the shared page's metadata. Every input is in
 * device memory before the step, so nothing the test does between the
 * step and the prefill waits for the engine's stream. */
static void test_prefill_after_finish(void **state)
{
    (void)state;
    fx f;
    fx_open(&f, 0xfeedbeefull, 2, 1);
    new_seq(&f, 0, 37);
    new_seq(&f, 1, 90);
    new_seq(&f, 2, 60);
    enum { CH = 20 };
    const size_t kv = NS * N_KV_HEADS * HEAD_DIM, qn = NS * HQ * HEAD_DIM,
                 ch = (size_t)CH * N_KV_HEADS * HEAD_DIM;
    float *k = malloc(N_LAYERS * kv * 4), *v = malloc(N_LAYERS * kv * 4),
          *q = malloc(N_LAYERS * qn * 4);
    float *ck = malloc(N_LAYERS * ch * 4), *cv = malloc(N_LAYERS * ch * 4),
          *out = malloc(N_LAYERS * qn * 4);
    float *out_g = malloc(qn * 4), lse[N_LAYERS][NS * HQ], lse_g[NS * HQ];
    assert_true(k && v && q && ck && cv && out && out_g);
    rand_rows(&f.r, k, N_LAYERS * kv);
    rand_rows(&f.r, v, N_LAYERS * kv);
    rand_rows(&f.r, q, N_LAYERS * qn);
    rand_rows(&f.r, ck, N_LAYERS * ch);
    rand_rows(&f.r, cv, N_LAYERS * ch);
    float *dk = dev(N_LAYERS * kv * 4), *dv = dev(N_LAYERS * kv * 4), *dq = dev(N_LAYERS * qn * 4);
    float *dck = dev(N_LAYERS * ch * 4), *dcv = dev(N_LAYERS * ch * 4);
    float *dout = dev(N_LAYERS * qn * 4), *dlse = dev(N_LAYERS * NS * HQ * 4);
    CU_OK(kvt__cu_memcpy(dk, k, N_LAYERS * kv * 4));
    CU_OK(kvt__cu_memcpy(dv, v, N_LAYERS * kv * 4));
    CU_OK(kvt__cu_memcpy(dq, q, N_LAYERS * qn * 4));
    CU_OK(kvt__cu_memcpy(dck, ck, N_LAYERS * ch * 4));
    CU_OK(kvt__cu_memcpy(dcv, cv, N_LAYERS * ch * 4));

    kvt_step *sc, *sg;
    plan_both(&f, 0, false, &sc, &sg);
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        TU_OK(kvt_step_append(sc, l, k + l * kv, v + l * kv, KVT_DTYPE_F32, 0));
        NO_DEVICE_SYNC(kvt_step_append(sg, l, dk + l * kv, dv + l * kv, KVT_DTYPE_F32, 0));
        TU_OK(kvt_step_attend(sc, l, q + l * qn, out + l * qn, lse[l]));
        NO_DEVICE_SYNC(kvt_step_attend(sg, l, dq + l * qn, dout + l * qn, dlse + l * NS * HQ));
    }
    TU_OK(kvt_step_finish(sc));
    NO_DEVICE_SYNC(kvt_step_finish(sg));
    TU_OK(kvt_seq_release(f.cpu, f.ic[1]));
    NO_DEVICE_SYNC(kvt_seq_release(f.gpu, f.ig[1]));
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        TU_OK(kvt_seq_append(f.cpu, f.ic[0], l, ck + l * ch, cv + l * ch, CH, KVT_DTYPE_F32, 0));
        NO_DEVICE_SYNC(kvt_seq_append(f.gpu, f.ig[0], l, dck + l * ch, dcv + l * ch, CH,
                                      KVT_DTYPE_F32, 0));
    }
    CU_OK(kvt__cu_stream_sync(f.stream));
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        CU_OK(kvt__cu_memcpy(out_g, dout + l * qn, qn * 4));
        CU_OK(kvt__cu_memcpy(lse_g, dlse + l * NS * HQ, sizeof lse_g));
        for (uint32_t i = 0; i < NS; i++)
            same_rows(out_g, lse_g, out + l * qn, lse[l], l, i);
    }
    new_seq(&f, 1, 5); /* same_contents reads every slot of the fixture */
    same_contents(&f);
    TU_CHECK(f.cpu);
    TU_CHECK(f.gpu);

    void *d[] = {dk, dv, dq, dck, dcv, dout, dlse};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        kvt__cu_free(d[i]);
    free(k);
    free(v);
    free(q);
    free(ck);
    free(cv);
    free(out);
    free(out_g);
    fx_close(&f);
}

/* A step that appends layer 0 only, on both pools: both finishes name layer
 * 1 and take the appends back (the CUDA pool rebuilds the partial pages'
 * metadata and accumulators from the device rows); the pools then hold the
 * same rows and metadata, and the next full steps agree too (their appends
 * extend the restored accumulators). Lengths so that the step's token
 * opens a page (48), fills one (47) and lands inside one (37). */
static void test_partial_step_rollback(void **state)
{
    (void)state;
    fx f;
    fx_open(&f, 0x5ba11ull, 3, 2);
    const size_t kvn = NS * N_KV_HEADS * HEAD_DIM;
    new_seq(&f, 0, 37);
    new_seq(&f, 1, 47);
    new_seq(&f, 2, 48);
    float k[NS * N_KV_HEADS * HEAD_DIM], v[NS * N_KV_HEADS * HEAD_DIM];
    rand_rows(&f.r, k, kvn);
    rand_rows(&f.r, v, kvn);
    CU_OK(kvt__cu_memcpy(f.d_k, k, sizeof k));
    CU_OK(kvt__cu_memcpy(f.d_v, v, sizeof v));
    kvt_step *sc, *sg;
    plan_both(&f, 0, false, &sc, &sg);
    TU_OK(kvt_step_append(sc, 0, k, v, KVT_DTYPE_F32, 0));
    TU_OK(kvt_step_append(sg, 0, f.d_k, f.d_v, KVT_DTYPE_F32, 0));
    TU_EXPECT_ERR(kvt_step_finish(sc), KVT_ESTATE, "not layer 1");
    TU_EXPECT_ERR(kvt_step_finish(sg), KVT_ESTATE, "not layer 1");
    assert_non_null(strstr(kvt_last_error(), "taken back"));
    const uint32_t want[NS] = {37, 47, 48};
    for (uint32_t i = 0; i < NS; i++)
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            uint32_t nc, ng;
            TU_OK(kvt_seq_length_get(f.cpu, f.ic[i], l, &nc));
            TU_OK(kvt_seq_length_get(f.gpu, f.ig[i], l, &ng));
            assert_int_equal(nc, want[i]);
            assert_int_equal(ng, want[i]);
        }
    same_contents(&f);
    TU_CHECK(f.cpu);
    TU_CHECK(f.gpu);
    uint32_t reranked = 0;
    for (uint32_t step = 0; step < 3; step++)
        run_step(&f, 0, false, false, &reranked);
    same_contents(&f);
    TU_CHECK(f.cpu);
    TU_CHECK(f.gpu);
    fx_close(&f);
}

/* A growing byte buffer for kvt_seq_save / kvt_seq_restore. */
typedef struct {
    uint8_t *b;
    size_t n, at;
} membuf;

static int64_t mem_put(void *ctx, const void *buf, size_t len)
{
    membuf *m = ctx;
    uint8_t *nb = realloc(m->b, m->n + len);
    if (!nb)
        return -1;
    memcpy(nb + m->n, buf, len);
    m->b = nb;
    m->n += len;
    return (int64_t)len;
}

static int64_t mem_get(void *ctx, void *buf, size_t len)
{
    membuf *m = ctx;
    if (len > m->n - m->at)
        len = m->n - m->at;
    memcpy(buf, m->b + m->at, len);
    m->at += len;
    return (int64_t)len;
}

/* Forks, truncations and streams (issue 23) on both backends: sequence 2
 * is a fork of sequence 0 (its open pages copied in GPU memory, its
 * accumulators and kept top-K sets copied from the parent's slot), both
 * decode, the parent is cut inside the page the child shares (the CUDA
 * backend copies it and rebuilds its metadata from the GPU's rows) and the
 * other at a page boundary; the pools then hold the same rows and
 * metadata and keep deciding alike. The CUDA pool's stream of the fork is
 * the CPU pool's byte for byte; restored into both pools (the rows staged
 * in GPU memory), it decodes alike again. */
static void test_fork_truncate_stream(void **state)
{
    (void)state;
    fx f;
    fx_open(&f, 0xf02cull, 3, 2);
    new_seq(&f, 0, 70);
    new_seq(&f, 1, 47);
    new_seq(&f, 2, 20);
    uint32_t reranked = 0;
    run_step(&f, 0, false, false, &reranked); /* a selection to inherit */
    TU_OK(kvt_seq_release(f.cpu, f.ic[2])); /* its slot goes to the fork */
    TU_OK(kvt_seq_release(f.gpu, f.ig[2]));
    TU_OK(kvt_seq_fork(f.cpu, f.ic[0], NULL, &f.ic[2]));
    TU_OK(kvt_seq_fork(f.gpu, f.ig[0], NULL, &f.ig[2]));
    same_contents(&f);
    TU_CHECK(f.cpu);
    TU_CHECK(f.gpu);
    for (uint32_t step = 0; step < 4; step++)
        run_step(&f, 0, false, false, &reranked);
    same_contents(&f);
    /* 75 tokens now: a cut at 40 falls inside page 2, which the fork
     * shares; sequence 1 (52) is cut at the page boundary 48. */
    TU_OK(kvt_seq_truncate(f.cpu, f.ic[0], 40));
    TU_OK(kvt_seq_truncate(f.gpu, f.ig[0], 40));
    TU_OK(kvt_seq_truncate(f.cpu, f.ic[1], 48));
    TU_OK(kvt_seq_truncate(f.gpu, f.ig[1], 48));
    same_contents(&f);
    TU_CHECK(f.cpu);
    TU_CHECK(f.gpu);
    for (uint32_t step = 0; step < 4; step++)
        run_step(&f, 0, false, false, &reranked);
    same_contents(&f);
    /* The streams. */
    membuf sc = {0}, sg = {0};
    TU_OK(kvt_seq_save(f.cpu, f.ic[2], mem_put, &sc));
    TU_OK(kvt_seq_save(f.gpu, f.ig[2], mem_put, &sg));
    assert_int_equal(sc.n, sg.n);
    assert_memory_equal(sc.b, sg.b, sc.n);
    TU_OK(kvt_seq_release(f.cpu, f.ic[2]));
    TU_OK(kvt_seq_release(f.gpu, f.ig[2]));
    TU_OK(kvt_seq_restore(f.cpu, NULL, mem_get, &sc, &f.ic[2]));
    sc.at = 0;
    TU_OK(kvt_seq_restore(f.gpu, NULL, mem_get, &sc, &f.ig[2]));
    same_contents(&f);
    TU_CHECK(f.cpu);
    TU_CHECK(f.gpu);
    for (uint32_t step = 0; step < 3; step++)
        run_step(&f, 0, false, false, &reranked);
    same_contents(&f);
    TU_CHECK(f.cpu);
    TU_CHECK(f.gpu);
    free(sc.b);
    free(sg.b);
    fx_close(&f);
}


/* Dense steps of several tokens per sequence (kvt_step_opts.n_new: chunked
 * prefill, verification): random counts per sequence, some spanning pages;
 * the CUDA outputs (each token a causal row) against the CPU's, the stored
 * rows and metadata bit for bit. A sparse multi-token step is refused on
 * CUDA with KVT_ENOTSUP naming opts->n_new, nothing appended. */
static void test_multi_token_dense(void **state)
{
    (void)state;
    fx f;
    fx_open(&f, 0x24242424, 2, 1);
    for (uint32_t i = 0; i < NS; i++)
        new_seq(&f, i, 5 + 13 * i);
    enum { MAXR = NS * 40 };
    const size_t kvn = (size_t)MAXR * N_KV_HEADS * HEAD_DIM, qn = (size_t)MAXR * HQ * HEAD_DIM;
    float *k = malloc(kvn * 4), *v = malloc(kvn * 4), *q = malloc(qn * 4);
    float *out = malloc(qn * 4), *outg = malloc(qn * 4), *lse = malloc(MAXR * HQ * 4);
    float *lseg = malloc(MAXR * HQ * 4);
    float *dk = dev(kvn * 4), *dv = dev(kvn * 4), *dq = dev(qn * 4), *dout = dev(qn * 4);
    float *dlse = dev(MAXR * HQ * 4);
    for (int step = 0; step < 6; step++) {
        uint32_t nn[NS], rows = 0;
        for (uint32_t i = 0; i < NS; i++) {
            nn[i] = 1 + (uint32_t)(tu_next(&f.r) % (step % 2 ? 40u : 6u));
            rows += nn[i];
        }
        kvt_step_opts so = KVT_STEP_OPTS_INIT;
        so.flags = KVT_STEP_DENSE;
        so.n_new = nn;
        so.n_rows = rows;
        kvt_step_opts sgo = so;
        sgo.stream = f.stream;
        kvt_step *sc, *sg;
        TU_OK(kvt_step_plan(f.cpu, f.ic, NS, &so, &sc));
        NO_DEVICE_SYNC(kvt_step_plan(f.gpu, f.ig, NS, &sgo, &sg));
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            rand_rows(&f.r, k, (size_t)rows * N_KV_HEADS * HEAD_DIM);
            rand_rows(&f.r, v, (size_t)rows * N_KV_HEADS * HEAD_DIM);
            rand_rows(&f.r, q, (size_t)rows * HQ * HEAD_DIM);
            CU_OK(kvt__cu_memcpy(dk, k, (size_t)rows * N_KV_HEADS * HEAD_DIM * 4));
            CU_OK(kvt__cu_memcpy(dv, v, (size_t)rows * N_KV_HEADS * HEAD_DIM * 4));
            CU_OK(kvt__cu_memcpy(dq, q, (size_t)rows * HQ * HEAD_DIM * 4));
            TU_OK(kvt_step_append(sc, l, k, v, KVT_DTYPE_F32, 0));
            NO_DEVICE_SYNC(kvt_step_append(sg, l, dk, dv, KVT_DTYPE_F32, 0));
            TU_OK(kvt_step_attend(sc, l, q, out, lse));
            NO_DEVICE_SYNC(kvt_step_attend(sg, l, dq, dout, dlse));
            CU_OK(kvt__cu_stream_sync(f.stream));
            CU_OK(kvt__cu_memcpy(outg, dout, (size_t)rows * HQ * HEAD_DIM * 4));
            CU_OK(kvt__cu_memcpy(lseg, dlse, (size_t)rows * HQ * 4));
            /* Row r of the step, as same_rows compares a sequence's rows. */
            for (uint32_t r = 0; r < rows; r++)
                same_rows(outg, lseg, out, lse, l, r);
        }
        TU_OK(kvt_step_finish(sc));
        NO_DEVICE_SYNC(kvt_step_finish(sg));
        CU_OK(kvt__cu_stream_sync(f.stream));
        same_contents(&f);
    }
    TU_CHECK(f.gpu);
    /* Sparse with several tokens: not on CUDA in this release. */
    uint32_t nn[NS] = {2, 1, 1};
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.selector = f.sel;
    so.n_new = nn;
    so.n_rows = 4;
    kvt_step *st = NULL;
    uint32_t before;
    TU_OK(kvt_seq_length_get(f.gpu, f.ig[0], 0, &before));
    TU_EXPECT_ERR(kvt_step_plan(f.gpu, f.ig, NS, &so, &st), KVT_ENOTSUP, "n_new");
    assert_null(st);
    uint32_t after;
    TU_OK(kvt_seq_length_get(f.gpu, f.ig[0], 0, &after));
    assert_int_equal(before, after);
    void *d[] = {dk, dv, dq, dout, dlse};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        kvt__cu_free(d[i]);
    free(k);
    free(v);
    free(q);
    free(out);
    free(outg);
    free(lse);
    free(lseg);
    fx_close(&f);
}

/* Creates sequence i of both pools with prefix ids[n]; the tokens each
 * attached must agree. */
static uint32_t attach_both(fx *f, uint32_t i, const uint32_t *ids, uint32_t n)
{
    kvt_seq_opts so = KVT_SEQ_OPTS_INIT;
    so.prefix = ids;
    so.n_prefix = n;
    TU_OK(kvt_seq_create(f->cpu, &so, &f->ic[i]));
    TU_OK(kvt_seq_create(f->gpu, &so, &f->ig[i]));
    kvt_seq_info a = {.struct_size = sizeof a}, b = {.struct_size = sizeof b};
    TU_OK(kvt_seq_info_get(f->cpu, f->ic[i], &a));
    TU_OK(kvt_seq_info_get(f->gpu, f->ig[i], &b));
    assert_int_equal(a.prefix_tokens, b.prefix_tokens);
    return a.prefix_tokens;
}

/* The prefix cache on the CUDA backend: a released sequence's full pages
 * (GPU blocks) are attached by a later one and decode as the CPU pool's
 * do; a device tier too small for everything reclaims cached pages so
 * appends go on; rows and outputs against the CPU pool throughout. */
static void test_prefix_cache(void **state)
{
    (void)state;
    g_pool_flags = KVT_POOL_PREFIX_CACHE;
    g_device_blocks = 6 * 8 * N_LAYERS * N_KV_HEADS + 1; /* 8 pages per head per sequence */
    fx f;
    fx_open(&f, 0x9f1e5ull, 3, 1);
    g_pool_flags = 0;
    g_device_blocks = 2000;
    uint32_t ids[128];
    for (uint32_t i = 0; i < 128; i++)
        ids[i] = (uint32_t)(tu_next(&f.r) % 1000u);
    assert_int_equal(attach_both(&f, 0, ids, 72), 0);
    prefill(&f, 0, 72); /* 4 full pages keyed */
    new_seq(&f, 1, 30);
    new_seq(&f, 2, 50);
    TU_OK(kvt_seq_release(f.cpu, f.ic[0]));
    TU_OK(kvt_seq_release(f.gpu, f.ig[0]));
    TU_CHECK(f.cpu);
    TU_CHECK(f.gpu);
    assert_int_equal(attach_both(&f, 0, ids, 100), 64);
    prefill(&f, 0, 36);
    same_contents(&f);
    uint32_t reranked = 0;
    for (uint32_t step = 0; step < 4; step++)
        run_step(&f, 0, false, false, &reranked);
    same_contents(&f);
    TU_CHECK(f.cpu);
    TU_CHECK(f.gpu);
    /* Pressure: other sequences grow until the cache must give way. */
    for (uint32_t round = 0; round < 10; round++) {
        const uint32_t i = 1 + round % 2;
        TU_OK(kvt_seq_release(f.cpu, f.ic[i]));
        TU_OK(kvt_seq_release(f.gpu, f.ig[i]));
        ids[0] = 1000u + round; /* a new prompt each time */
        attach_both(&f, i, ids, 100);
        uint32_t n;
        TU_OK(kvt_seq_length_get(f.cpu, f.ic[i], 0, &n));
        prefill(&f, i, 100 - n);
        same_contents(&f);
        TU_CHECK(f.cpu);
        TU_CHECK(f.gpu);
    }
    for (uint32_t step = 0; step < 3; step++)
        run_step(&f, 0, false, false, &reranked);
    same_contents(&f);
    kvt_stats sc = {.struct_size = sizeof sc}, sg = {.struct_size = sizeof sg};
    TU_OK(kvt_pool_stats_get(f.cpu, &sc));
    TU_OK(kvt_pool_stats_get(f.gpu, &sg));
    assert_true(sg.prefix_reclaimed_pages > 0);
    assert_int_equal(sc.prefix_reclaimed_pages, sg.prefix_reclaimed_pages);
    assert_int_equal(sc.prefix_hit_pages, sg.prefix_hit_pages);
    TU_CHECK(f.gpu);
    fx_close(&f);
}

int main(void)
{
    GPU_SKIP_WITHOUT_DEVICE();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_vs_cpu),
        cmocka_unit_test(test_prefill_after_finish),
        cmocka_unit_test(test_partial_step_rollback),
        cmocka_unit_test(test_fork_truncate_stream),
        cmocka_unit_test(test_multi_token_dense),
        cmocka_unit_test(test_prefix_cache),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
