/* The step's call contract (issue 22), through the public calls only:
 *
 * - a failed kvt_step_plan leaves *out alone, so the open step stays
 *   reachable through the engine's variable;
 * - within a step, a layer is appended before it is selected, or the step
 *   appends nothing; a step finishes with every layer appended or none: one
 *   that appended some layers gets KVT_ESTATE naming the others, and its
 *   appends are taken back. Checked against a twin pool that never saw the
 *   step: every stored row, every page's metadata and the block counts
 *   equal byte for byte (f32 storage), then both continue with the same
 *   step and decode bit for bit alike; with f16 storage the rebuilt
 *   metadata still bounds every stored key;
 * - a finished step's handle is not the next step's: calls with it stay
 *   KVT_ESTATE for the next 15 plans and change nothing;
 * - q, out and lse of a decode may not overlap, nor the source of an
 *   append the pool's own memory (reached here through the internal
 *   header: the test links the static library);
 * - messages name enum values (f16, cpu, ...), and list the names an
 *   unknown value could have been; a struct_size far above any version is
 *   refused without reading past the caller's struct;
 * - local_pages counts full pages: a partial last page is selected on top
 *   of them (contexts of exactly k pages, k pages + 1 token, k pages - 1);
 * - NaN and infinity (CPU backend): a key with a NaN or infinite element is
 *   stored as given, and the query heads whose selection holds its page get
 *   a NaN output row and lse; a query head with a non-finite element gets
 *   a NaN row and lse; the other heads their usual result; a NaN value
 *   propagates to the output of the heads that attend it (lse finite);
 * - a decode over a page that lives only on disk (a pool without a policy)
 *   reads it from the disk tier: both sequences get their attention. */
#include <math.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "internal.h"

#define N_LAYERS 3
#define N_KV 2
#define N_Q 4
#define HEAD_DIM 8
#define PAGE 8
#define ROW (N_KV * HEAD_DIM)

/* n uniform values. */
static void fill(tu_rng *r, float *x, size_t n)
{
    for (size_t e = 0; e < n; e++)
        x[e] = tu_unit(r);
}

typedef struct {
    kvt_pool *p;
    kvt_seq_id id;
} twin;

static void twin_make(twin *t, kvt_dtype dt, const float *kv, uint32_t n_tok)
{
    kvt_pool_opts o = tu_opts(N_LAYERS, N_KV, N_Q, HEAD_DIM, PAGE, dt, 256, 0);
    TU_OK(kvt_pool_create(&o, &t->p));
    TU_OK(kvt_seq_create(t->p, NULL, &t->id));
    for (uint32_t l = 0; l < N_LAYERS; l++)
        TU_OK(kvt_seq_append(t->p, t->id, l, kv, kv + (size_t)n_tok * ROW, n_tok,
                             KVT_DTYPE_F32, 0));
}

/* Every stored row and every page's metadata of both pools, byte for byte;
 * the device blocks in use equal. */
static void twin_same(const twin *a, const twin *b, uint32_t n_tok, const char *what)
{
    size_t es = 0;
    kvt_geometry g;
    TU_OK(kvt_pool_geometry_get(a->p, &g));
    es = kvt_dtype_size(g.dtype);
    const size_t bytes = (size_t)n_tok * HEAD_DIM * es;
    uint8_t *ka = malloc(bytes), *va = malloc(bytes), *kb = malloc(bytes), *vb = malloc(bytes);
    assert_non_null(ka);
    assert_non_null(va);
    assert_non_null(kb);
    assert_non_null(vb);
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        uint32_t la, lb;
        TU_OK(kvt_seq_length_get(a->p, a->id, l, &la));
        TU_OK(kvt_seq_length_get(b->p, b->id, l, &lb));
        if (la != n_tok || lb != n_tok)
            fail_msg("%s: layer %u holds %u and %u tokens, expected %u", what, l, la, lb, n_tok);
        for (uint32_t h = 0; h < N_KV; h++) {
            TU_OK(kvt_seq_read_kv(a->p, a->id, l, h, 0, n_tok, ka, va));
            TU_OK(kvt_seq_read_kv(b->p, b->id, l, h, 0, n_tok, kb, vb));
            if (memcmp(ka, kb, bytes) || memcmp(va, vb, bytes))
                fail_msg("%s: layer %u head %u rows differ", what, l, h);
            for (uint32_t pg = 0; pg < (n_tok + PAGE - 1) / PAGE; pg++) {
                float ma[3][HEAD_DIM], mb[3][HEAD_DIM];
                TU_OK(kvt_seq_page_meta_get(a->p, a->id, l, h, pg, ma[0], ma[1], ma[2]));
                TU_OK(kvt_seq_page_meta_get(b->p, b->id, l, h, pg, mb[0], mb[1], mb[2]));
                if (memcmp(ma, mb, sizeof ma))
                    fail_msg("%s: layer %u head %u page %u metadata differs", what, l, h, pg);
            }
        }
    }
    kvt_stats sa = {.struct_size = sizeof sa}, sb = {.struct_size = sizeof sb};
    TU_OK(kvt_pool_stats_get(a->p, &sa));
    TU_OK(kvt_pool_stats_get(b->p, &sb));
    assert_int_equal(sa.tier[KVT_TIER_DEVICE].blocks_used, sb.tier[KVT_TIER_DEVICE].blocks_used);
    assert_int_equal(sa.meta_pages_used, sb.meta_pages_used);
    assert_int_equal(sa.n_tokens, sb.n_tokens);
    free(ka);
    free(va);
    free(kb);
    free(vb);
}

/* One full step (every layer appended, then attended) on a pool. */
static void full_step(twin *t, const float *kv, const float *q, float *out, float *lse)
{
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *st;
    TU_OK(kvt_step_plan(t->p, &t->id, 1, &so, &st));
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        TU_OK(kvt_step_append(st, l, kv, kv + ROW, KVT_DTYPE_F32, 0));
        TU_OK(kvt_step_attend(st, l, q, out + (size_t)l * N_Q * HEAD_DIM, lse + (size_t)l * N_Q));
    }
    TU_OK(kvt_step_finish(st));
}

/* A step that appends layers 0 and 1 (and attends layer 0) but not layer 2,
 * from contexts of n_tok tokens: the step's token fills a page (n_tok % P
 * == P - 1), opens one (== 0) or lands inside one. */
static void rollback_case(kvt_dtype dt, uint32_t n_tok)
{
    tu_rng r = {0xc0ffee00ull + n_tok + 131u * dt};
    const uint32_t cap = n_tok + 2;
    float *kv = malloc((size_t)cap * 2 * ROW * sizeof *kv);
    assert_non_null(kv);
    for (size_t e = 0; e < (size_t)cap * 2 * ROW; e++)
        kv[e] = 2.0f * tu_unit(&r) - 1.0f;
    float q[N_Q * HEAD_DIM], nkv[2 * ROW];
    fill(&r, q, sizeof q / sizeof q[0]);
    for (size_t e = 0; e < sizeof nkv / sizeof nkv[0]; e++)
        nkv[e] = 3.0f * tu_unit(&r) - 1.5f;
    twin a, b;
    twin_make(&a, dt, kv, n_tok);
    twin_make(&b, dt, kv, n_tok);

    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *st;
    float out[N_LAYERS * N_Q * HEAD_DIM], lse[N_LAYERS * N_Q];
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &st));
    TU_OK(kvt_step_append(st, 0, nkv, nkv + ROW, KVT_DTYPE_F32, 0));
    TU_OK(kvt_step_attend(st, 0, q, out, lse));
    /* Layer 2 is not appended yet: selecting it is refused, nothing moves. */
    TU_EXPECT_ERR(kvt_step_select(st, 2, q), KVT_ESTATE, "layer: 2");
    TU_OK(kvt_step_append(st, 1, nkv, nkv + ROW, KVT_DTYPE_F32, 0));
    TU_EXPECT_ERR(kvt_step_finish(st), KVT_ESTATE, "not layer 2");
    assert_non_null(strstr(kvt_last_error(), "taken back"));
    TU_EXPECT_ERR(kvt_step_finish(st), KVT_ESTATE, "already finished");
    TU_CHECK(a.p);
    char what[64];
    snprintf(what, sizeof what, "%s, %u tokens, after the rollback", kvt_dtype_size(dt) == 4 ?
             "f32" : "f16", n_tok);
    if (dt == KVT_DTYPE_F32) {
        twin_same(&a, &b, n_tok, what);
    } else {
        /* The metadata is rebuilt from the stored (rounded) keys: the box
         * still holds every stored key of the page. */
        uint16_t kh[PAGE * HEAD_DIM], vh[PAGE * HEAD_DIM];
        for (uint32_t l = 0; l < 2; l++)
            for (uint32_t h = 0; h < N_KV; h++) {
                const uint32_t pg = (n_tok - 1) / PAGE, first = pg * PAGE;
                TU_OK(kvt_seq_read_kv(a.p, a.id, l, h, first, n_tok - first, kh, vh));
                float mn[HEAD_DIM], mx[HEAD_DIM], mean[HEAD_DIM];
                TU_OK(kvt_seq_page_meta_get(a.p, a.id, l, h, pg, mn, mx, mean));
                for (uint32_t t = 0; t < n_tok - first; t++)
                    for (uint32_t d = 0; d < HEAD_DIM; d++) {
                        const double x = tu_f16_value(kh[t * HEAD_DIM + d]);
                        if (!(mn[d] <= x && x <= mx[d]))
                            fail_msg("%s: layer %u head %u dim %u: key %g outside [%g, %g]",
                                     what, l, h, d, x, (double)mn[d], (double)mx[d]);
                    }
                uint32_t len;
                TU_OK(kvt_seq_length_get(a.p, a.id, l, &len));
                assert_int_equal(len, n_tok);
            }
    }
    /* Both continue with the same full step: the same outputs. */
    float oa[N_LAYERS * N_Q * HEAD_DIM], la[N_LAYERS * N_Q];
    float ob[N_LAYERS * N_Q * HEAD_DIM], lb[N_LAYERS * N_Q];
    full_step(&a, nkv, q, oa, la);
    full_step(&b, nkv, q, ob, lb);
    assert_memory_equal(oa, ob, sizeof oa);
    assert_memory_equal(la, lb, sizeof la);
    if (dt == KVT_DTYPE_F32)
        twin_same(&a, &b, n_tok + 1, "after the next step");
    TU_CHECK(a.p);
    kvt_pool_destroy(a.p);
    kvt_pool_destroy(b.p);
    free(kv);
}

static void test_partial_step_rollback(void **state)
{
    (void)state;
    const uint32_t ctx[] = {1, 5, 7, 8, 9, 15, 16, 17, 23};
    for (size_t i = 0; i < sizeof ctx / sizeof ctx[0]; i++) {
        rollback_case(KVT_DTYPE_F32, ctx[i]);
        rollback_case(KVT_DTYPE_F16, ctx[i]);
    }
}

static void test_call_order(void **state)
{
    (void)state;
    tu_rng r = {0x0dde7ull};
    float kv[8 * 2 * ROW], q[N_Q * HEAD_DIM], out[N_Q * HEAD_DIM], lse[N_Q];
    fill(&r, kv, sizeof kv / sizeof kv[0]);
    fill(&r, q, sizeof q / sizeof q[0]);
    twin a;
    twin_make(&a, KVT_DTYPE_F32, kv, 6);
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *st;

    /* Attending before any append makes the step one that appends
     * nothing: a later append is refused and the lengths stay. */
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &st));
    TU_OK(kvt_step_attend(st, 0, q, out, lse));
    TU_EXPECT_ERR(kvt_step_append(st, 0, kv, kv + ROW, KVT_DTYPE_F32, 0), KVT_ESTATE,
                  "before any kvt_step_append");
    TU_EXPECT_ERR(kvt_step_append(st, 1, kv, kv + ROW, KVT_DTYPE_F32, 0), KVT_ESTATE,
                  "before any kvt_step_append");
    TU_OK(kvt_step_attend(st, 2, q, out, lse));
    TU_OK(kvt_step_finish(st));
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        uint32_t len;
        TU_OK(kvt_seq_length_get(a.p, a.id, l, &len));
        assert_int_equal(len, 6);
    }

    /* Once a layer is appended, selecting one not yet appended is refused. */
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &st));
    TU_OK(kvt_step_append(st, 0, kv, kv + ROW, KVT_DTYPE_F32, 0));
    TU_EXPECT_ERR(kvt_step_attend(st, 1, q, out, lse), KVT_ESTATE, "layer: 1");
    TU_EXPECT_ERR(kvt_step_select(st, 2, q), KVT_ESTATE, "layer: 2");
    TU_OK(kvt_step_attend(st, 0, q, out, lse));
    TU_OK(kvt_step_append(st, 1, kv, kv + ROW, KVT_DTYPE_F32, 0));
    TU_OK(kvt_step_append(st, 2, kv, kv + ROW, KVT_DTYPE_F32, 0));
    TU_OK(kvt_step_attend(st, 2, q, out, lse));
    TU_OK(kvt_step_finish(st));
    /* A step that appended nothing and ran nothing finishes with 0. */
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &st));
    TU_OK(kvt_step_finish(st));

    /* Layers at different lengths (a per-layer prefill not finished): a
     * step may attend over them, but its first append is refused. */
    TU_OK(kvt_seq_append(a.p, a.id, 0, kv, kv + ROW, 1, KVT_DTYPE_F32, 0));
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &st));
    TU_EXPECT_ERR(kvt_step_append(st, 0, kv, kv + ROW, KVT_DTYPE_F32, 0), KVT_ESTATE,
                  "different lengths");
    TU_OK(kvt_step_finish(st));
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &st));
    TU_OK(kvt_step_attend(st, 1, q, out, lse));
    TU_OK(kvt_step_finish(st));
    TU_CHECK(a.p);
    kvt_pool_destroy(a.p);
}

static void test_plan_failure_keeps_handle(void **state)
{
    (void)state;
    float kv[4 * 2 * ROW];
    memset(kv, 0, sizeof kv);
    twin a;
    twin_make(&a, KVT_DTYPE_F32, kv, 2);
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *st = NULL;
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &st));
    kvt_step *open = st;
    /* The engine plans into the same variable while a step is open. */
    TU_EXPECT_ERR(kvt_step_plan(a.p, &a.id, 1, &so, &st), KVT_ESTATE, "still open");
    assert_ptr_equal(st, open);
    so.flags = 0x80;
    TU_EXPECT_ERR(kvt_step_plan(a.p, &a.id, 1, &so, &st), KVT_EINVAL, "flags");
    assert_ptr_equal(st, open);
    TU_OK(kvt_step_finish(st));
    kvt_pool_destroy(a.p);
}

static void test_stale_handles(void **state)
{
    (void)state;
    tu_rng r = {0x57a1eull};
    float kv[2 * ROW], q[N_Q * HEAD_DIM], out[N_Q * HEAD_DIM], lse[N_Q];
    fill(&r, kv, sizeof kv / sizeof kv[0]);
    fill(&r, q, sizeof q / sizeof q[0]);
    twin a;
    twin_make(&a, KVT_DTYPE_F32, kv, 1);
    kvt_seq_id other;
    TU_OK(kvt_seq_create(a.p, NULL, &other));
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *old;
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &old));
    TU_OK(kvt_step_finish(old));
    /* The next 15 plans (of another sequence) hand out other handles; the
     * old one stays finished and its calls change nothing. */
    for (int i = 0; i < 15; i++) {
        kvt_step *st;
        TU_OK(kvt_step_plan(a.p, &other, 1, &so, &st));
        assert_ptr_not_equal(st, old);
        TU_EXPECT_ERR(kvt_step_append(old, 0, kv, kv + ROW, KVT_DTYPE_F32, 0), KVT_ESTATE,
                      "finished");
        TU_EXPECT_ERR(kvt_step_attend(old, 0, q, out, lse), KVT_ESTATE, "finished");
        TU_EXPECT_ERR(kvt_step_finish(old), KVT_ESTATE, "finished");
        for (uint32_t l = 0; l < N_LAYERS; l++)
            TU_OK(kvt_step_append(st, l, kv, kv + ROW, KVT_DTYPE_F32, 0));
        TU_OK(kvt_step_finish(st));
    }
    uint32_t len;
    TU_OK(kvt_seq_length_get(a.p, a.id, 0, &len));
    assert_int_equal(len, 1);
    TU_OK(kvt_seq_length_get(a.p, other, 0, &len));
    assert_int_equal(len, 15);
    TU_CHECK(a.p);
    kvt_pool_destroy(a.p);
}

static void test_aliasing(void **state)
{
    (void)state;
    tu_rng r = {0xa11a5ull};
    float kv[2 * 3 * ROW], q[N_Q * HEAD_DIM + N_Q], out[N_Q * HEAD_DIM + N_Q], lse[N_Q];
    fill(&r, kv, sizeof kv / sizeof kv[0]);
    fill(&r, q, sizeof q / sizeof q[0]);
    twin a;
    twin_make(&a, KVT_DTYPE_F32, kv, 3);
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *st;
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &st));
    /* The source of an append inside the pool's device tier. */
    const uint8_t *dev = a.p->tier[KVT_TIER_DEVICE].base;
    const size_t blk = a.p->tier[KVT_TIER_DEVICE].block_bytes;
    TU_EXPECT_ERR(kvt_step_append(st, 0, dev + blk, kv + ROW, KVT_DTYPE_F32, 0), KVT_EINVAL,
                  "k: lies in the pool's own device tier");
    TU_EXPECT_ERR(kvt_step_append(st, 0, kv, dev + 2 * blk, KVT_DTYPE_F32, 0), KVT_EINVAL,
                  "v: lies");
    TU_EXPECT_ERR(kvt_seq_append(a.p, a.id, 0, dev + blk, kv, 1, KVT_DTYPE_F32, 0), KVT_EINVAL,
                  "k: lies");
    uint32_t len;
    TU_OK(kvt_seq_length_get(a.p, a.id, 0, &len));
    assert_int_equal(len, 3);
    for (uint32_t l = 0; l < N_LAYERS; l++)
        TU_OK(kvt_step_append(st, l, kv, kv + ROW, KVT_DTYPE_F32, 0));
    /* q, out and lse: out == q, out shifted by one row, lse inside q or out. */
    TU_EXPECT_ERR(kvt_step_attend(st, 0, q, q, lse), KVT_EINVAL, "out: overlaps q");
    TU_EXPECT_ERR(kvt_step_attend(st, 0, q, q + HEAD_DIM, lse), KVT_EINVAL, "out: overlaps q");
    TU_EXPECT_ERR(kvt_step_attend(st, 0, q, out, q + 2), KVT_EINVAL, "lse: overlaps q");
    TU_EXPECT_ERR(kvt_step_attend(st, 0, q, out, out + N_Q * HEAD_DIM - 1), KVT_EINVAL,
                  "lse: overlaps out");
    TU_OK(kvt_step_select(st, 0, q));
    TU_EXPECT_ERR(kvt_step_decode(st, 0, q, q, NULL), KVT_EINVAL, "out: overlaps q");
    /* Adjacent is not overlapping. */
    TU_OK(kvt_step_decode(st, 0, q, out, out + N_Q * HEAD_DIM));
    TU_OK(kvt_step_finish(st));
    kvt_pool_destroy(a.p);
}

static void test_enum_names(void **state)
{
    (void)state;
    float kv[2 * ROW];
    memset(kv, 0, sizeof kv);
    twin a;
    twin_make(&a, KVT_DTYPE_F32, kv, 1);
    kvt_geometry g;
    TU_OK(kvt_pool_geometry_get(a.p, &g));
    g.dtype = KVT_DTYPE_F16;
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&g, NULL, &sel));
    kvt_policy *pol;
    TU_OK(kvt_policy_create(&g, NULL, &pol));
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.selector = sel;
    so.policy = pol;
    kvt_step *st = NULL;
    TU_EXPECT_ERR(kvt_step_plan(a.p, &a.id, 1, &so, &st), KVT_EINVAL,
                  "the policy's geometry has dtype f16, the pool's has f32");
    TU_EXPECT_ERR(kvt_seq_append(a.p, a.id, 0, kv, kv, 1, KVT_DTYPE_DEFAULT, 0), KVT_EINVAL,
                  "src_dtype: default names no source type");
    TU_EXPECT_ERR(kvt_seq_append(a.p, a.id, 0, kv, kv, 1, 9u, 0), KVT_EINVAL,
                  "src_dtype: 9 is not a dtype (f16, bf16 or f32)");
    kvt_pool_opts o = tu_opts(1, 1, 1, 8, 8, KVT_DTYPE_F32, 16, 0);
    o.backend = 5;
    kvt_pool *p2;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p2), KVT_EINVAL, "5 is not a backend (auto, cpu or cuda)");
    o.backend = KVT_BACKEND_CPU;
    o.geom.dtype = 7;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p2), KVT_EINVAL, "7 is not a dtype");
    kvt_selector_opts sopt = KVT_SELECTOR_OPTS_INIT;
    sopt.vote = 4;
    kvt_selector *s2;
    TU_EXPECT_ERR(kvt_selector_create(&g, &sopt, &s2), KVT_EINVAL, "(sum, max or softvote)");
    kvt_policy_destroy(pol);
    kvt_selector_destroy(sel);
    kvt_pool_destroy(a.p);
}

static void test_struct_size_cap(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(1, 1, 1, 8, 8, KVT_DTYPE_F32, 16, 0);
    o.struct_size = 1u << 30; /* the struct is ~136 bytes: nothing past it is read */
    kvt_pool *p;
    TU_EXPECT_ERR(kvt_pool_create(&o, &p), KVT_EINVAL, "struct_size: 1073741824 is above");
    o.struct_size = sizeof o;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_stats s = {.struct_size = 0xffffffffu};
    TU_EXPECT_ERR(kvt_pool_stats_get(p, &s), KVT_EINVAL, "struct_size");
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.struct_size = 100000;
    so.flags = KVT_STEP_DENSE;
    kvt_seq_id id;
    TU_OK(kvt_seq_create(p, NULL, &id));
    kvt_step *st = NULL;
    TU_EXPECT_ERR(kvt_step_plan(p, &id, 1, &so, &st), KVT_EINVAL, "struct_size");
    assert_null(st);
    kvt_pool_destroy(p);
}

static void test_disk_only_decode(void **state)
{
    (void)state;
    char dir[] = "/tmp/kvt-contract-XXXXXX";
    assert_non_null(mkdtemp(dir));
    kvt_pool_opts o = tu_opts(N_LAYERS, N_KV, N_Q, HEAD_DIM, PAGE, KVT_DTYPE_F32, 64, 16);
    o.disk_dir = dir;
    o.disk_bytes = 64ull << 20;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {0xd15cull};
    enum { T = 20 };
    float kv[2 * T * ROW], q[2 * N_Q * HEAD_DIM], out[2 * N_Q * HEAD_DIM], lse[2 * N_Q];
    fill(&r, kv, sizeof kv / sizeof kv[0]);
    fill(&r, q, sizeof q / sizeof q[0]);
    kvt_seq_id ids[2];
    for (int i = 0; i < 2; i++) {
        TU_OK(kvt_seq_create(p, NULL, &ids[i]));
        for (uint32_t l = 0; l < N_LAYERS; l++)
            TU_OK(kvt_seq_append(p, ids[i], l, kv, kv + T * ROW, T, KVT_DTYPE_F32, 0));
    }
    /* Page 0 of (layer 0, head 1) of the second sequence to the disk alone. */
    kvt_mover *m;
    TU_OK(kvt_pool_mover_get(p, &m));
    const kvt_move mv = {ids[1], 0, 1, 0, KVT_TIER_DEVICE, KVT_TIER_DISK, KVT_MOVE_DROP_SOURCE};
    int32_t res;
    kvt_fence f;
    TU_OK(kvt_mover_submit(m, &mv, 1, 0, &res, &f));
    TU_OK(kvt_mover_wait(m, f, UINT64_MAX));
    assert_int_equal(res, 0);
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *st;
    TU_OK(kvt_step_plan(p, ids, 2, &so, &st));
    for (size_t e = 0; e < sizeof out / sizeof out[0]; e++)
        out[e] = 7.0f;
    /* The page on disk alone is read (verified against its CRC) into the
     * decode's bounce block: both sequences get their attention over every
     * token. */
    TU_OK(kvt_step_attend(st, 0, q, out, lse));
    double kd[T * HEAD_DIM], vd[T * HEAD_DIM], ref[(N_Q / N_KV) * HEAD_DIM], rl[N_Q / N_KV];
    double kap[N_Q / N_KV], vmax;
    for (uint32_t i = 0; i < 2; i++)
        for (uint32_t h = 0; h < N_KV; h++) {
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t d = 0; d < HEAD_DIM; d++) {
                    kd[t * HEAD_DIM + d] = kv[t * ROW + h * HEAD_DIM + d];
                    vd[t * HEAD_DIM + d] = kv[(T + t) * ROW + h * HEAD_DIM + d];
                }
            const size_t r0 = (size_t)i * N_Q + h * (N_Q / N_KV);
            tu_ref_attention(q + r0 * HEAD_DIM, N_Q / N_KV, HEAD_DIM, kd, vd, T,
                             1.0 / sqrt((double)HEAD_DIM), ref, rl, kap, &vmax);
            for (uint32_t e = 0; e < (N_Q / N_KV) * HEAD_DIM; e++)
                assert_true(fabs(out[r0 * HEAD_DIM + e] - ref[e]) < 1e-5);
            for (uint32_t g = 0; g < N_Q / N_KV; g++)
                assert_true(fabs(lse[r0 + g] - rl[g]) < 1e-5 * (1 + fabs(rl[g])));
        }
    TU_OK(kvt_step_finish(st));
    kvt_pool_destroy(p);
    rmdir(dir);
}

static void test_local_pages_boundary(void **state)
{
    (void)state;
    const uint32_t T[] = {3 * PAGE, 3 * PAGE + 1, 3 * PAGE - 1, 1, PAGE};
    /* sink 0, top-K 0: only the forced pages; local 1 and 2. */
    const uint32_t want1[][3] = {{2, 0, 0}, {2, 3, 0}, {1, 2, 0}, {0, 0, 0}, {0, 0, 0}};
    const uint32_t n1[] = {1, 2, 2, 1, 1};
    const uint32_t want2[][3] = {{1, 2, 0}, {1, 2, 3}, {0, 1, 2}, {0, 0, 0}, {0, 0, 0}};
    const uint32_t n2[] = {2, 3, 3, 1, 1};
    float kv[2 * (3 * PAGE + 1) * ROW] = {0}, q[N_Q * HEAD_DIM] = {0};
    for (size_t c = 0; c < sizeof T / sizeof T[0]; c++) {
        twin a;
        twin_make(&a, KVT_DTYPE_F32, kv, T[c]);
        kvt_geometry g;
        TU_OK(kvt_pool_geometry_get(a.p, &g));
        kvt_selector *sel;
        TU_OK(kvt_selector_create(&g, NULL, &sel));
        for (uint32_t local = 1; local <= 2; local++) {
            TU_OK(kvt_selector_budget_set(sel, 0, 0, 0, 0, local));
            uint32_t pages[8], n;
            TU_OK(kvt_selector_select(sel, a.p, a.id, 0, 0, q, pages, 8, &n, NULL));
            const uint32_t wn = local == 1 ? n1[c] : n2[c];
            const uint32_t *w = local == 1 ? want1[c] : want2[c];
            if (n != wn || memcmp(pages, w, wn * sizeof *w))
                fail_msg("T %u local %u: %u pages selected (first %u), expected %u", T[c],
                         local, n, n ? pages[0] : 0, wn);
        }
        kvt_selector_destroy(sel);
        kvt_pool_destroy(a.p);
    }
}

static void test_nonfinite(void **state)
{
    (void)state;
    tu_rng r = {0x7a7aull};
    enum { T = 10 };
    float kv[2 * T * ROW], q[N_Q * HEAD_DIM], q2[N_Q * HEAD_DIM];
    float out[N_Q * HEAD_DIM], lse[N_Q], out2[N_Q * HEAD_DIM], lse2[N_Q];
    fill(&r, kv, sizeof kv / sizeof kv[0]);
    fill(&r, q, sizeof q / sizeof q[0]);
    twin a;
    twin_make(&a, KVT_DTYPE_F32, kv, T);
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.flags = KVT_STEP_DENSE;
    kvt_step *st;
    TU_OK(kvt_step_plan(a.p, &a.id, 1, &so, &st));
    /* A NaN value in the step's token of head 1: the query heads of KV head
     * 1 attend it. */
    float vn[2 * ROW];
    memcpy(vn, kv, sizeof vn);
    vn[ROW + HEAD_DIM + 2] = NAN;
    for (uint32_t l = 0; l < N_LAYERS; l++)
        TU_OK(kvt_step_append(st, l, vn, l == 1 ? vn + ROW : kv + ROW, KVT_DTYPE_F32, 0));
    /* Query head 1 gets an infinity: only its row turns NaN. */
    memcpy(q2, q, sizeof q);
    q2[1 * HEAD_DIM + 4] = INFINITY;
    TU_OK(kvt_step_attend(st, 0, q, out, lse));
    TU_OK(kvt_step_attend(st, 2, q2, out2, lse2));
    for (uint32_t j = 0; j < N_Q; j++)
        for (uint32_t d = 0; d < HEAD_DIM; d++) {
            const float x = out2[j * HEAD_DIM + d], y = out[j * HEAD_DIM + d];
            if (j == 1)
                assert_true(isnan(x));
            else
                assert_true(x == y); /* layers 0 and 2 hold the same keys and values */
        }
    assert_true(isnan(lse2[1]));
    assert_true(lse2[0] == lse[0] && isfinite(lse[0]));
    /* Layer 1: the NaN value reaches the heads of KV head 1 (query heads 2
     * and 3), their lse stays finite; KV head 0's heads are finite. */
    TU_OK(kvt_step_attend(st, 1, q, out2, lse2));
    for (uint32_t j = 0; j < N_Q; j++) {
        assert_true(isfinite(lse2[j]));
        const int has_nan = isnan(out2[j * HEAD_DIM + 2]);
        assert_int_equal(has_nan, j >= N_Q / N_KV);
    }
    TU_OK(kvt_step_finish(st));

    /* Keys: a NaN in head 1 of layer 0 (by kvt_seq_append, on a twin of
     * the others' lengths), an infinity in head 0 of layer 2 (by a step):
     * stored as given, and the heads that attend them report NaN. */
    twin b;
    twin_make(&b, KVT_DTYPE_F32, kv, T);
    float kb[2 * ROW];
    memcpy(kb, kv, sizeof kb);
    kb[HEAD_DIM + 3] = NAN;
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        float kl[2 * ROW];
        memcpy(kl, l == 0 ? kb : kv, sizeof kl);
        if (l == 2)
            kl[5] = INFINITY;
        TU_OK(kvt_seq_append(b.p, b.id, l, kl, kv + ROW, 1, KVT_DTYPE_F32, 0));
    }
    float krow[HEAD_DIM], vrow[HEAD_DIM];
    TU_OK(kvt_seq_read_kv(b.p, b.id, 0, 1, T, 1, krow, vrow));
    assert_true(isnan(krow[3]) && krow[2] == kv[HEAD_DIM + 2]); /* stored as given */
    TU_CHECK(b.p);
    TU_OK(kvt_step_plan(b.p, &b.id, 1, &so, &st));
    for (uint32_t l = 0; l < N_LAYERS; l++)
        TU_OK(kvt_step_append(st, l, kv, kv + ROW, KVT_DTYPE_F32, 0));
    for (uint32_t l = 0; l < N_LAYERS; l += 2) {
        TU_OK(kvt_step_attend(st, l, q, out2, lse2));
        const uint32_t badkv = l == 0 ? 1 : 0; /* the KV head holding the bad key */
        for (uint32_t j = 0; j < N_Q; j++) {
            const bool want_nan = j / (N_Q / N_KV) == badkv;
            assert_int_equal(isnan(lse2[j]) != 0, want_nan);
            assert_int_equal(isnan(out2[j * HEAD_DIM]) != 0, want_nan);
        }
    }
    TU_OK(kvt_step_attend(st, 1, q, out2, lse2));
    for (uint32_t j = 0; j < N_Q; j++)
        assert_true(isfinite(lse2[j]) && isfinite(out2[j * HEAD_DIM]));
    TU_OK(kvt_step_finish(st));
    TU_CHECK(b.p);
    kvt_pool_destroy(b.p);
    kvt_pool_destroy(a.p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_partial_step_rollback),
        cmocka_unit_test(test_call_order),
        cmocka_unit_test(test_plan_failure_keeps_handle),
        cmocka_unit_test(test_stale_handles),
        cmocka_unit_test(test_aliasing),
        cmocka_unit_test(test_enum_names),
        cmocka_unit_test(test_struct_size_cap),
        cmocka_unit_test(test_disk_only_decode),
        cmocka_unit_test(test_local_pages_boundary),
        cmocka_unit_test(test_nonfinite),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
