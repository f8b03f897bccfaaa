/* Paged append: byte-exact storage for every (pool dtype, source dtype)
 * pair with strided (fused QKV) sources, per-page metadata against a
 * double-precision reference with directed rounding, limits, and
 * all-or-nothing failure. */
#include "testutil.h"

static tu_table f16t, bf16t;

static int setup(void **state)
{
    (void)state;
    tu_table_build(&f16t, tu_f16_value, 0x7c00);
    tu_table_build(&bf16t, tu_bf16_value, 0x7f80);
    return 0;
}
static int teardown(void **state)
{
    (void)state;
    tu_table_free(&f16t);
    tu_table_free(&bf16t);
    return 0;
}

/* Value of element i of a buffer of dtype dt, by the definitions. */
static double elem_value(const void *buf, kvt_dtype dt, size_t i)
{
    if (dt == KVT_DTYPE_F32)
        return (double)((const float *)buf)[i];
    uint16_t h = ((const uint16_t *)buf)[i];
    return dt == KVT_DTYPE_F16 ? tu_f16_value(h) : tu_bf16_value(h);
}

/* Writes value x (exactly representable or rounded to nearest) as dt. */
static void elem_store(void *buf, kvt_dtype dt, size_t i, double x)
{
    if (dt == KVT_DTYPE_F32)
        ((float *)buf)[i] = (float)x;
    else
        ((uint16_t *)buf)[i] = tu_round(dt == KVT_DTYPE_F16 ? &f16t : &bf16t, x, 0,
                                        dt == KVT_DTYPE_F16 ? 10 : 7);
}

/* Expected stored encoding of source value x in pool dtype pdt (bytes). */
static void expect_bytes(kvt_dtype pdt, double x, uint8_t *out)
{
    if (pdt == KVT_DTYPE_F32) {
        float f = (float)x;
        memcpy(out, &f, 4);
    } else {
        uint16_t h = tu_round(pdt == KVT_DTYPE_F16 ? &f16t : &bf16t, x, 0,
                              pdt == KVT_DTYPE_F16 ? 10 : 7);
        memcpy(out, &h, 2);
    }
}

typedef struct {
    uint32_t L, H, Hq, D, P;
} shape;

/* A fused QKV activation buffer [T][(Hq + 2H) * D] of dtype dt. */
static void *make_qkv(const shape *s, uint32_t T, kvt_dtype dt, tu_rng *r, double scale)
{
    size_t row = (size_t)(s->Hq + 2 * s->H) * s->D, n = (size_t)T * row;
    void *b = malloc(n * kvt_dtype_size(dt));
    for (size_t i = 0; i < n; i++)
        elem_store(b, dt, i, scale * tu_unit(r));
    return b;
}

static void check_layer(kvt_pool *p, kvt_seq_id seq, const shape *s, uint32_t layer,
                        kvt_dtype pdt, void *const *chunks, const uint32_t *chunk_T,
                        int n_chunks, kvt_dtype sdt)
{
    const size_t pe = kvt_dtype_size(pdt), row = (size_t)(s->Hq + 2 * s->H) * s->D;
    uint32_t total = 0;
    for (int c = 0; c < n_chunks; c++)
        total += chunk_T[c];
    uint32_t n;
    TU_OK(kvt_seq_length_get(p, seq, layer, &n));
    assert_int_equal(n, total);
    uint8_t *k = malloc((size_t)total * s->D * pe), *v = malloc((size_t)total * s->D * pe);
    uint8_t want[4];
    for (uint32_t h = 0; h < s->H; h++) {
        TU_OK(kvt_seq_read_kv(p, seq, layer, h, 0, total, k, v));
        uint32_t t0 = 0;
        for (int c = 0; c < n_chunks; c++) {
            for (uint32_t t = 0; t < chunk_T[c]; t++)
                for (uint32_t d = 0; d < s->D; d++) {
                    size_t src_k = (size_t)t * row + (size_t)s->Hq * s->D + (size_t)h * s->D + d;
                    size_t src_v = src_k + (size_t)s->H * s->D;
                    size_t dst = ((size_t)(t0 + t) * s->D + d) * pe;
                    expect_bytes(pdt, elem_value(chunks[c], sdt, src_k), want);
                    if (memcmp(k + dst, want, pe) != 0)
                        fail_msg("K layer %u head %u token %u dim %u differs", layer, h,
                                 t0 + t, d);
                    expect_bytes(pdt, elem_value(chunks[c], sdt, src_v), want);
                    if (memcmp(v + dst, want, pe) != 0)
                        fail_msg("V layer %u head %u token %u dim %u differs", layer, h,
                                 t0 + t, d);
                }
            t0 += chunk_T[c];
        }
    }
    free(k);
    free(v);
}

/* Appends chunk c of layer l from a fused buffer: K after the Hq query rows. */
static int append_fused(kvt_pool *p, kvt_seq_id seq, const shape *s, uint32_t l, void *buf,
                        uint32_t T, kvt_dtype sdt)
{
    size_t e = kvt_dtype_size(sdt), row = (size_t)(s->Hq + 2 * s->H) * s->D;
    const uint8_t *k = (const uint8_t *)buf + (size_t)s->Hq * s->D * e;
    const uint8_t *v = k + (size_t)s->H * s->D * e;
    return kvt_seq_append(p, seq, l, k, v, T, sdt, row);
}

static void test_roundtrip_all_dtypes(void **state)
{
    (void)state;
    const shape s = {2, 2, 4, 16, 8};
    for (kvt_dtype pdt = 1; pdt <= 3; pdt++)
        for (kvt_dtype sdt = 1; sdt <= 3; sdt++) {
            kvt_pool_opts o = tu_opts(s.L, s.H, s.Hq, s.D, s.P, pdt, 256, 0);
            kvt_pool *p;
            kvt_seq_id seq;
            tu_rng r = {0x9e3779b97f4a7c15ull + pdt * 7 + sdt};
            TU_OK(kvt_pool_create(&o, &p));
            TU_OK(kvt_seq_create(p, NULL, &seq));
            /* Prefill of 37 tokens (not a page multiple), then 5 decode steps. */
            uint32_t T[6] = {37, 1, 1, 1, 1, 1};
            void *chunks[2][6];
            for (int c = 0; c < 6; c++)
                for (uint32_t l = 0; l < s.L; l++) {
                    chunks[l][c] = make_qkv(&s, T[c], sdt, &r, 3.0);
                    TU_OK(append_fused(p, seq, &s, l, chunks[l][c], T[c], sdt));
                    TU_CHECK(p);
                }
            for (uint32_t l = 0; l < s.L; l++) {
                check_layer(p, seq, &s, l, pdt, chunks[l], T, 6, sdt);
                for (int c = 0; c < 6; c++)
                    free(chunks[l][c]);
            }
            kvt_pool_destroy(p);
        }
}

static void test_dense_default_stride(void **state)
{
    (void)state;
    /* token_stride 0 = dense [T][H][D]; same dtype = a byte-exact copy. */
    kvt_pool_opts o = tu_opts(1, 3, 3, 8, 8, KVT_DTYPE_BF16, 64, 0);
    kvt_pool *p;
    kvt_seq_id seq;
    TU_OK(kvt_pool_create(&o, &p));
    TU_OK(kvt_seq_create(p, NULL, &seq));
    enum { T = 21 };
    uint16_t k[T * 3 * 8], v[T * 3 * 8], out_k[T * 8], out_v[T * 8];
    tu_rng r = {77};
    for (size_t i = 0; i < sizeof k / 2; i++) {
        k[i] = (uint16_t)tu_next(&r);
        v[i] = (uint16_t)tu_next(&r);
    }
    TU_OK(kvt_seq_append(p, seq, 0, k, v, T, KVT_DTYPE_BF16, 0));
    for (uint32_t h = 0; h < 3; h++) {
        TU_OK(kvt_seq_read_kv(p, seq, 0, h, 0, T, out_k, out_v));
        for (uint32_t t = 0; t < T; t++) {
            assert_memory_equal(out_k + t * 8, k + (t * 3 + h) * 8, 16);
            assert_memory_equal(out_v + t * 8, v + (t * 3 + h) * 8, 16);
        }
    }
    /* A sub-range read, and V only. */
    TU_OK(kvt_seq_read_kv(p, seq, 0, 2, 9, 3, NULL, out_v));
    assert_memory_equal(out_v, v + (9 * 3 + 2) * 8, 16);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

static void check_meta(kvt_pool *p, kvt_seq_id seq, uint32_t H, uint32_t D, uint32_t P,
                       kvt_dtype pdt, const float *k, uint32_t n_tok, tu_rng *r)
{
    float mn[64], mx[64], me[64];
    const tu_table *t = pdt == KVT_DTYPE_F16 ? &f16t : &bf16t;
    const int mb = pdt == KVT_DTYPE_F16 ? 10 : 7;
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t pg = 0; pg * P < n_tok; pg++) {
            TU_OK(kvt_seq_page_meta_get(p, seq, 0, h, pg, mn, mx, me));
            uint32_t t0 = pg * P, t1 = t0 + P < n_tok ? t0 + P : n_tok;
            for (uint32_t d = 0; d < D; d++) {
                /* The box bounds the keys as stored (rounded to nearest in
                 * the pool's dtype), so that it can be rebuilt from them. */
                double lo = INFINITY, hi = -INFINITY, sum = 0;
                for (uint32_t tk = t0; tk < t1; tk++) {
                    double x = k[((size_t)tk * H + h) * D + d];
                    if (pdt != KVT_DTYPE_F32) {
                        uint16_t b = tu_round(t, x, 0, mb);
                        x = pdt == KVT_DTYPE_F16 ? tu_f16_value(b) : tu_bf16_value(b);
                    }
                    lo = x < lo ? x : lo;
                    hi = x > hi ? x : hi;
                    sum += x;
                }
                double mean = sum / (t1 - t0), want_lo, want_hi, tol;
                if (pdt == KVT_DTYPE_F32) {
                    want_lo = lo;
                    want_hi = hi;
                    tol = 1e-6;
                } else {
                    uint16_t blo = tu_round(t, lo, 1, mb), bhi = tu_round(t, hi, 2, mb);
                    want_lo = pdt == KVT_DTYPE_F16 ? tu_f16_value(blo) : tu_bf16_value(blo);
                    want_hi = pdt == KVT_DTYPE_F16 ? tu_f16_value(bhi) : tu_bf16_value(bhi);
                    tol = ldexp(fabs(mean) > 0x1p-14 ? fabs(mean) : 0x1p-14, -mb) * 1.01;
                }
                if ((double)mn[d] != want_lo || (double)mx[d] != want_hi)
                    fail_msg("head %u page %u dim %u: min %a max %a, want %a %a", h, pg, d,
                             (double)mn[d], (double)mx[d], want_lo, want_hi);
                if (fabs((double)me[d] - mean) > tol + 1e-6 * fabs(mean))
                    fail_msg("head %u page %u dim %u: mean %.9g, want %.9g", h, pg, d,
                             (double)me[d], mean);
            }
            /* The bound scoring relies on: for any q, sum_d max(q*min, q*max)
             * >= q.k for every stored key of the page. */
            for (int trial = 0; trial < 4; trial++) {
                double q[64], bound = 0;
                for (uint32_t d = 0; d < D; d++) {
                    q[d] = 4.0 * tu_unit(r);
                    double a = q[d] * mn[d], b = q[d] * mx[d];
                    bound += a > b ? a : b;
                }
                uint8_t kb[64 * 4];
                for (uint32_t tk = t0; tk < t1; tk++) {
                    TU_OK(kvt_seq_read_kv(p, seq, 0, h, tk, 1, kb, NULL));
                    double dot = 0;
                    for (uint32_t d = 0; d < D; d++)
                        dot += q[d] * elem_value(kb, pdt, d);
                    assert_true(dot <= bound + 1e-9 * fabs(bound));
                }
            }
        }
}

static void test_metadata(void **state)
{
    (void)state;
    enum { H = 2, D = 16, P = 16, T = 53 };
    for (kvt_dtype pdt = 1; pdt <= 3; pdt++) {
        kvt_pool_opts o = tu_opts(1, H, H, D, P, pdt, 64, 0);
        kvt_pool *p;
        kvt_seq_id seq;
        tu_rng r = {1000 + pdt};
        TU_OK(kvt_pool_create(&o, &p));
        TU_OK(kvt_seq_create(p, NULL, &seq));
        static float k[T * H * D], v[T * H * D];
        for (size_t i = 0; i < (size_t)T * H * D; i++) {
            /* f32 keys that are not representable in 16 bits, so directed
             * rounding of min/max actually moves them. */
            k[i] = 5.0f * tu_unit(&r) + 1e-4f * tu_unit(&r);
            v[i] = tu_unit(&r);
        }
        /* Prefill 20, then decode one by one, checking after each step. */
        TU_OK(kvt_seq_append(p, seq, 0, k, v, 20, KVT_DTYPE_F32, 0));
        check_meta(p, seq, H, D, P, pdt, k, 20, &r);
        for (uint32_t t = 20; t < T; t++) {
            TU_OK(kvt_seq_append(p, seq, 0, k + (size_t)t * H * D, v + (size_t)t * H * D, 1,
                                 KVT_DTYPE_F32, 0));
            if (t % 5 == 0 || t == T - 1)
                check_meta(p, seq, H, D, P, pdt, k, t + 1, &r);
        }
        float m[D];
        TU_EXPECT_ERR(kvt_seq_page_meta_get(p, seq, 0, 0, 4, m, NULL, NULL), KVT_ERANGE, "page");
        TU_EXPECT_ERR(kvt_seq_page_meta_get(p, seq, 0, 2, 0, m, NULL, NULL), KVT_EINVAL, "kv_head");
        TU_EXPECT_ERR(kvt_seq_page_meta_get(p, seq, 1, 0, 0, m, NULL, NULL), KVT_EINVAL, "layer");
        TU_CHECK(p);
        kvt_pool_destroy(p);
    }
}

/* A NaN key must not leave a box that excludes a stored key: its
 * dimension's box opens to [-inf, +inf]; other dimensions are unaffected. */
static void test_nan_key_metadata(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(1, 1, 1, 8, 8, KVT_DTYPE_F32, 8, 0);
    kvt_pool *p;
    kvt_seq_id seq;
    TU_OK(kvt_pool_create(&o, &p));
    TU_OK(kvt_seq_create(p, NULL, &seq));
    float k[2][8], v[2][8] = {{0}};
    for (int t = 0; t < 2; t++)
        for (int d = 0; d < 8; d++)
            k[t][d] = (float)(t * 8 + d) - 3.0f;
    k[0][3] = NAN;
    k[1][3] = NAN;
    k[1][5] = NAN;
    TU_OK(kvt_seq_append(p, seq, 0, k, v, 2, KVT_DTYPE_F32, 0));
    float mn[8], mx[8];
    TU_OK(kvt_seq_page_meta_get(p, seq, 0, 0, 0, mn, mx, NULL));
    for (int d = 0; d < 8; d++) {
        if (d == 3 || d == 5) {
            assert_true(isinf(mn[d]) && mn[d] < 0);
            assert_true(isinf(mx[d]) && mx[d] > 0);
        } else {
            assert_true(mn[d] == k[0][d]);
            assert_true(mx[d] == k[1][d]);
        }
    }
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

static void test_layers_and_tables(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(3, 2, 2, 8, 8, KVT_DTYPE_F16, 128, 0);
    kvt_pool *p;
    kvt_seq_id a, b;
    TU_OK(kvt_pool_create(&o, &p));
    TU_OK(kvt_seq_create(p, NULL, &a));
    kvt_seq_opts so = KVT_SEQ_OPTS_INIT;
    so.user_data = 0xfeedull;
    TU_OK(kvt_seq_create(p, &so, &b));
    uint16_t kv[40 * 2 * 8] = {0};
    TU_OK(kvt_seq_append(p, a, 0, kv, kv, 17, KVT_DTYPE_F16, 0));
    TU_OK(kvt_seq_append(p, a, 1, kv, kv, 9, KVT_DTYPE_F16, 0));
    TU_OK(kvt_seq_append(p, b, 2, kv, kv, 40, KVT_DTYPE_F16, 0));
    uint32_t n;
    TU_OK(kvt_seq_length_get(p, a, 0, &n));
    assert_int_equal(n, 17);
    TU_OK(kvt_seq_length_get(p, a, 2, &n));
    assert_int_equal(n, 0);
    kvt_seq_info in = {.struct_size = sizeof in};
    TU_OK(kvt_seq_info_get(p, a, &in));
    assert_int_equal(in.n_tokens, 0);
    assert_int_equal(in.n_tokens_max, 17);
    assert_int_equal(in.pages, (3 + 2) * 2);
    assert_int_equal(in.pages_in_tier[KVT_TIER_DEVICE], 10);
    assert_int_equal(in.max_tokens, KVT_MAX_SEQ_TOKENS_DEFAULT);
    TU_OK(kvt_seq_info_get(p, b, &in));
    assert_int_equal(in.user_data, 0xfeed);
    assert_int_equal(in.pages, 5 * 2);

    /* Block tables: distinct real blocks, never the null block, DEVICE only. */
    uint8_t seen[128] = {0};
    kvt_seq_id ids[2] = {a, b};
    for (int i = 0; i < 2; i++)
        for (uint32_t l = 0; l < 3; l++)
            for (uint32_t h = 0; h < 2; h++) {
                TU_OK(kvt_seq_length_get(p, ids[i], l, &n));
                uint32_t pages = (n + 7) / 8, dev[8], host[8];
                uint8_t res[8];
                TU_OK(kvt_seq_block_table_get(p, ids[i], l, h, 0, pages, dev, host, res));
                for (uint32_t pg = 0; pg < pages; pg++) {
                    assert_true(dev[pg] >= 1 && dev[pg] < 128);
                    assert_int_equal(seen[dev[pg]], 0);
                    seen[dev[pg]] = 1;
                    assert_int_equal(host[pg], 0);
                    assert_int_equal(res[pg], KVT_RES_DEVICE);
                }
                TU_EXPECT_ERR(kvt_seq_block_table_get(p, ids[i], l, h, 0, pages + 1, dev, NULL,
                                                      NULL), KVT_ERANGE, "n_pages");
            }
    uint32_t one;
    TU_EXPECT_ERR(kvt_seq_block_table_get(p, a, 3, 0, 0, 1, &one, NULL, NULL), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_seq_block_table_get(NULL, a, 0, 0, 0, 1, &one, NULL, NULL), KVT_EINVAL,
                  "pool");
    TU_EXPECT_ERR(kvt_seq_read_kv(p, a, 0, 0, 10, 8, kv, NULL), KVT_ERANGE, "n_tokens");
    TU_EXPECT_ERR(kvt_seq_length_get(p, a, 3, &n), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_seq_length_get(p, a, 0, NULL), KVT_EINVAL, "n_tokens");
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

static void test_append_bad(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(2, 2, 2, 8, 8, KVT_DTYPE_F16, 64, 0);
    kvt_pool *p;
    kvt_seq_id s;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_seq_opts so = KVT_SEQ_OPTS_INIT;
    so.max_tokens = 20;
    TU_OK(kvt_seq_create(p, &so, &s));
    uint16_t kv[32 * 2 * 8];
    for (size_t i = 0; i < sizeof kv / 2; i++)
        kv[i] = (uint16_t)(0x3c00 + i % 512);
    TU_OK(kvt_seq_append(p, s, 0, kv, kv, 16, KVT_DTYPE_F16, 0));
    kvt_stats before = {.struct_size = sizeof before}, after = {.struct_size = sizeof after};
    TU_OK(kvt_pool_stats_get(p, &before));

    TU_EXPECT_ERR(kvt_seq_append(NULL, s, 0, kv, kv, 1, KVT_DTYPE_F16, 0), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, NULL, kv, 1, KVT_DTYPE_F16, 0), KVT_EINVAL, "k");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, kv, NULL, 1, KVT_DTYPE_F16, 0), KVT_EINVAL, "v");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 2, kv, kv, 1, KVT_DTYPE_F16, 0), KVT_EINVAL, "layer");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, kv, kv, 0, KVT_DTYPE_F16, 0), KVT_EINVAL, "n_tokens");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, kv, kv, 1, 0, 0), KVT_EINVAL, "src_dtype");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, kv, kv, 1, 42, 0), KVT_EINVAL, "src_dtype");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, kv, kv, 1, KVT_DTYPE_F16, 15), KVT_EINVAL,
                  "token_stride");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, kv, kv, 0xffffffffu, KVT_DTYPE_F32,
                                 UINT64_MAX / 8), KVT_EOVERFLOW, "n_tokens");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, kv, kv, 5, KVT_DTYPE_F16, 0), KVT_ERANGE, "n_tokens");
    TU_EXPECT_ERR(kvt_seq_append(p, s, 1, kv, kv, 21, KVT_DTYPE_F16, 0), KVT_ERANGE,
                  "n_tokens");
    TU_EXPECT_ERR(kvt_seq_append(p, KVT_SEQ_NONE, 0, kv, kv, 1, KVT_DTYPE_F16, 0), KVT_ENOENT,
                  "seq");
    TU_EXPECT_ERR(kvt_seq_append(p, s + 1, 0, kv, kv, 1, KVT_DTYPE_F16, 0), KVT_ENOENT, "seq");
    /* Nothing of the failed calls was stored. */
    TU_OK(kvt_pool_stats_get(p, &after));
    assert_memory_equal(&before, &after, sizeof before);
    uint32_t n;
    TU_OK(kvt_seq_length_get(p, s, 0, &n));
    assert_int_equal(n, 16);
    TU_OK(kvt_seq_length_get(p, s, 1, &n));
    assert_int_equal(n, 0);
    TU_CHECK(p);
    /* Up to the limit exactly is fine. */
    TU_OK(kvt_seq_append(p, s, 0, kv, kv, 4, KVT_DTYPE_F16, 0));
    TU_EXPECT_ERR(kvt_seq_append(p, s, 0, kv, kv, 1, KVT_DTYPE_F16, 0), KVT_ERANGE, "limit");
    uint16_t back[20 * 8];
    TU_OK(kvt_seq_read_kv(p, s, 0, 1, 0, 20, back, NULL));
    for (uint32_t t = 0; t < 16; t++)
        assert_memory_equal(back + t * 8, kv + (t * 2 + 1) * 8, 16);
    for (uint32_t t = 16; t < 20; t++)
        assert_memory_equal(back + t * 8, kv + ((t - 16) * 2 + 1) * 8, 16);
    /* A sequence limit above the pool's is refused. */
    kvt_seq_id s2;
    so.max_tokens = KVT_MAX_SEQ_TOKENS_DEFAULT + 1;
    TU_EXPECT_ERR(kvt_seq_create(p, &so, &s2), KVT_EINVAL, "max_tokens");
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_all_dtypes),
        cmocka_unit_test(test_dense_default_stride),
        cmocka_unit_test(test_metadata),
        cmocka_unit_test(test_layers_and_tables),
        cmocka_unit_test(test_append_bad),
        cmocka_unit_test(test_nan_key_metadata),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
