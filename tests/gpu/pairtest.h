/* Shared by the tests that feed a CPU pool and a CUDA pool the same work
 * through the public calls (test_cu_pool, test_cu_tier): prompts into both
 * pools, and the comparisons of their stored rows, selections and outputs.
 *
 * The includer defines N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, NS
 * (layers, KV heads, query heads, head_dim, page tokens, sequences), MAXPG (the most pages a head's
 * selection may hold) and the type fx with at least: kvt_pool *cpu, *gpu;
 * kvt_selector *sel; kvt_seq_id ic[NS], ig[NS]; void *stream; float *d_out, *d_lse; tu_rng r;
 * bool ints (prompt keys of small integers, for exact scores). */
#ifndef KVT_PAIRTEST_H
#define KVT_PAIRTEST_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gputest.h"

/* A CUDA pool's call that must succeed without synchronising the device
 * (counted under the emulation; on a GPU, the test helpers' syncs only). */
#define NO_DEVICE_SYNC(call)                                                              \
    do {                                                                                  \
        const uint64_t ds_ = kvt__cu_device_sync_count();                                 \
        TU_OK(call);                                                                      \
        if (kvt__cu_device_sync_count() != ds_)                                           \
            fail_msg("%s synchronised the device", #call);                                \
    } while (0)

static inline void *dev(size_t bytes)
{
    void *d;
    CU_OK(kvt__cu_malloc(&d, bytes));
    return d;
}

static inline void rand_rows(tu_rng *r, float *x, size_t n)
{
    for (size_t e = 0; e < n; e++)
        x[e] = tu_unit(r);
}

/* Integers -3 .. 3. */
static inline void int_rows(tu_rng *r, float *x, size_t n)
{
    for (size_t e = 0; e < n; e++)
        x[e] = (float)(tu_next(r) % 7u) - 3.0f;
}

/* Prefill of n tokens into sequence i of both pools. */
static inline void prefill(fx *f, uint32_t i, uint32_t n)
{
    const size_t rows = (size_t)n * N_KV_HEADS * HEAD_DIM;
    float *k = malloc(rows * sizeof(float)), *v = malloc(rows * sizeof(float));
    float *dk = dev(rows * sizeof(float)), *dv = dev(rows * sizeof(float));
    assert_non_null(k);
    assert_non_null(v);
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        (f->ints ? int_rows : rand_rows)(&f->r, k, rows);
        rand_rows(&f->r, v, rows);
        CU_OK(kvt__cu_memcpy(dk, k, rows * sizeof(float)));
        CU_OK(kvt__cu_memcpy(dv, v, rows * sizeof(float)));
        TU_OK(kvt_seq_append(f->cpu, f->ic[i], l, k, v, n, KVT_DTYPE_F32, 0));
        NO_DEVICE_SYNC(kvt_seq_append(f->gpu, f->ig[i], l, dk, dv, n, KVT_DTYPE_F32, 0));
    }
    kvt__cu_free(dk);
    kvt__cu_free(dv);
    free(k);
    free(v);
}

static inline void new_seq(fx *f, uint32_t i, uint32_t n)
{
    TU_OK(kvt_seq_create(f->cpu, NULL, &f->ic[i]));
    TU_OK(kvt_seq_create(f->gpu, NULL, &f->ig[i]));
    prefill(f, i, n);
}

/* Every stored row (from whichever tier holds it) and every page's
 * metadata, bit for bit. */
static inline void same_contents(const fx *f)
{
    for (uint32_t i = 0; i < NS; i++)
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            uint32_t T, T2;
            TU_OK(kvt_seq_length_get(f->cpu, f->ic[i], l, &T));
            TU_OK(kvt_seq_length_get(f->gpu, f->ig[i], l, &T2));
            assert_int_equal(T, T2);
            uint16_t *a = malloc((size_t)T * HEAD_DIM * 2 * 2),
                     *b = malloc((size_t)T * HEAD_DIM * 2 * 2);
            assert_non_null(a);
            assert_non_null(b);
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                TU_OK(kvt_seq_read_kv(f->cpu, f->ic[i], l, h, 0, T, a, a + (size_t)T * HEAD_DIM));
                TU_OK(kvt_seq_read_kv(f->gpu, f->ig[i], l, h, 0, T, b, b + (size_t)T * HEAD_DIM));
                if (memcmp(a, b, (size_t)T * HEAD_DIM * 2 * 2))
                    fail_msg("seq %u layer %u head %u: stored K/V differ", i, l, h);
                for (uint32_t pg = 0; pg < (T + PAGE_TOKENS - 1) / PAGE_TOKENS; pg++) {
                    float m1[3 * HEAD_DIM], m2[3 * HEAD_DIM];
                    TU_OK(kvt_seq_page_meta_get(f->cpu, f->ic[i], l, h, pg, m1, m1 + HEAD_DIM,
                                                m1 + 2 * HEAD_DIM));
                    TU_OK(kvt_seq_page_meta_get(f->gpu, f->ig[i], l, h, pg, m2, m2 + HEAD_DIM,
                                                m2 + 2 * HEAD_DIM));
                    if (memcmp(m1, m2, sizeof m1))
                        fail_msg("seq %u layer %u head %u page %u: metadata differ", i, l, h, pg);
                }
            }
            free(a);
            free(b);
        }
}

/* A step of all NS sequences on both pools, with the fixture's selector
 * (f->sel) and flags; the CUDA step on f->stream, or on none. */
static inline void plan_both(fx *f, uint32_t flags, bool no_stream, kvt_step **sc, kvt_step **sg)
{
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = flags;
    so.selector = f->sel;
    kvt_step_opts sgo = so;
    sgo.stream = no_stream ? NULL : f->stream;
    TU_OK(kvt_step_plan(f->cpu, f->ic, NS, &so, sc));
    NO_DEVICE_SYNC(kvt_step_plan(f->gpu, f->ig, NS, &sgo, sg));
}

/* Every head's selection of `layer` equal on both steps (kvt_step_selection_get
 * of the CUDA step synchronises no device). Returns the heads reranked. */
static inline uint32_t same_selections(kvt_step *sc, kvt_step *sg, uint32_t layer)
{
    uint32_t reranked = 0;
    for (uint32_t i = 0; i < NS; i++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            uint32_t a[MAXPG], b[MAXPG], na, nb, ra, rb;
            TU_OK(kvt_step_selection_get(sc, layer, i, h, a, MAXPG, &na, &ra));
            NO_DEVICE_SYNC(kvt_step_selection_get(sg, layer, i, h, b, MAXPG, &nb, &rb));
            assert_int_equal(ra, rb);
            reranked += ra;
            if (na != nb || memcmp(a, b, na * 4))
                fail_msg("layer %u seq %u head %u: selections differ (%u vs %u pages)", layer,
                         i, h, na, nb);
        }
    return reranked;
}

/* Sequence i's rows of a layer's output and lse, CUDA (host copies) against
 * the CPU's: within 2e-5 (both accumulate f32 over the same f16 rows, in
 * different orders). */
static inline void same_rows(const float *out_g, const float *lse_g, const float *out_c,
                             const float *lse_c, uint32_t layer, uint32_t i)
{
    const size_t o = (size_t)i * HQ * HEAD_DIM;
    for (size_t e = o; e < o + (size_t)HQ * HEAD_DIM; e++)
        if (!(fabsf(out_g[e] - out_c[e]) <= 2e-5f))
            fail_msg("layer %u seq %u: out[%zu] CUDA %.9g CPU %.9g", layer, i, e,
                     (double)out_g[e], (double)out_c[e]);
    for (size_t e = (size_t)i * HQ; e < (size_t)(i + 1) * HQ; e++)
        if (!(fabsf(lse_g[e] - lse_c[e]) <= 2e-5f * (1.0f + fabsf(lse_c[e]))))
            fail_msg("layer %u seq %u: lse[%zu] CUDA %.9g CPU %.9g", layer, i, e,
                     (double)lse_g[e], (double)lse_c[e]);
}

/* One layer of the two steps: every head's selection equal, and the CUDA
 * output and lse (in f->d_out, f->d_lse once f->stream is done) as
 * same_rows against the CPU's out_c, lse_c. Returns the heads reranked. */
static inline uint32_t compare_layer(kvt_step *sc, kvt_step *sg, uint32_t layer,
                                     const float *out_c, const float *lse_c, const fx *f)
{
    const uint32_t reranked = same_selections(sc, sg, layer);
    float *out = malloc(NS * HQ * HEAD_DIM * sizeof(float)), lse[NS * HQ];
    assert_non_null(out);
    CU_OK(kvt__cu_stream_sync(f->stream));
    CU_OK(kvt__cu_memcpy(out, f->d_out, NS * HQ * HEAD_DIM * sizeof(float)));
    CU_OK(kvt__cu_memcpy(lse, f->d_lse, sizeof lse));
    for (uint32_t i = 0; i < NS; i++)
        same_rows(out, lse, out_c, lse_c, layer, i);
    free(out);
    return reranked;
}

#endif /* KVT_PAIRTEST_H */
