/* The GGUF reader of kvtier-decode (examples/decode/gguf.c), against files
 * written by a small GGUF writer of its own below (into memory): metadata of
 * every value type, arrays of strings and numbers, the tensor directory and
 * the data section's alignment (default and general.alignment), widening of
 * F32 / F16 / BF16 / Q8_0 against values computed here from the format
 * definitions, gguf_open on a real file, and malformed inputs: every prefix
 * of a valid file, bad magic and versions, absurd counts and lengths,
 * overflowing dims, data past the end, bad alignments, duplicate names. Every
 * failure must leave *g zeroed and a message naming what is wrong. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

#include <cmocka.h>

#include "../examples/decode/gguf.h"
#include "gguf_writer.h"

typedef struct {
    const char *name;
    uint32_t n_dims;
    uint64_t dims[4];
    uint32_t type;
    const void *data;
    size_t nbytes;
    uint64_t offset; /* filled by w_file */
} tspec;

/* A whole file: the header, the n_kv entries already encoded in kv, the
 * tensor infos with offsets laid out at multiples of align, the padding and
 * the data. Returns the data section's offset. */
static size_t w_file(wb *w, uint32_t version, const wb *kv, uint64_t n_kv, tspec *ts, size_t nt,
                     uint64_t align)
{
    w_hdr(w, version, nt, n_kv);
    if (kv)
        wb_put(w, kv->p, kv->n);
    uint64_t off = 0;
    for (size_t i = 0; i < nt; i++) {
        ts[i].offset = off;
        off += ts[i].nbytes;
        off = (off + align - 1) / align * align;
        w_str(w, ts[i].name);
        w_u32(w, ts[i].n_dims);
        for (uint32_t d = 0; d < ts[i].n_dims; d++)
            w_u64(w, ts[i].dims[d]);
        w_u32(w, ts[i].type);
        w_u64(w, ts[i].offset);
    }
    w_pad(w, align);
    size_t data_start = w->n;
    for (size_t i = 0; i < nt; i++) {
        assert_int_equal(w->n - data_start, ts[i].offset);
        wb_put(w, ts[i].data, ts[i].nbytes);
        if (i + 1 < nt)
            w_pad(w, align);
    }
    return data_start;
}

/* ---- references from the format definitions --------------------------------- */
static double ref_f16(uint16_t h)
{
    int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0)
        v = ldexp((double)m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexp(1024.0 + m, e - 25);
    return sign ? -v : v;
}
static double ref_bf16(uint16_t h)
{
    int sign = h >> 15, e = (h >> 7) & 255, m = h & 127;
    double v;
    if (e == 0)
        v = ldexp((double)m, -133);
    else if (e == 255)
        v = m ? NAN : INFINITY;
    else
        v = ldexp(128.0 + m, e - 134);
    return sign ? -v : v;
}

static uint64_t rng_s = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void)
{
    rng_s ^= rng_s >> 12;
    rng_s ^= rng_s << 25;
    rng_s ^= rng_s >> 27;
    return rng_s * 0x2545F4914F6CDD1Dull;
}

static void assert_same_float(float got, double want, size_t i)
{
    if (isnan(want)) {
        if (!isnan(got))
            fail_msg("element %zu: got %g, expected NaN", i, (double)got);
        return;
    }
    float w = (float)want;
    if (memcmp(&got, &w, 4) != 0)
        fail_msg("element %zu: got %a, expected %a", i, (double)got, (double)w);
}

/* ---- helpers --------------------------------------------------------------------- */
static int is_zero(const gguf *g)
{
    static const gguf z;
    return memcmp(g, &z, sizeof z) == 0;
}

/* Parses a private copy of exactly n bytes (so ASan sees any over-read) and
 * expects failure with a message containing needle. */
static void expect_fail_n(const uint8_t *p, size_t n, const char *needle, int line)
{
    uint8_t *c = malloc(n ? n : 1);
    assert_non_null(c);
    if (n)
        memcpy(c, p, n);
    gguf g;
    char err[256];
    memset(err, 'x', sizeof err);
    err[sizeof err - 1] = 0;
    int rc = gguf_parse(c, n, &g, err, sizeof err);
    if (rc != -1)
        fail_msg("line %d: parse of %zu bytes succeeded, expected failure with '%s'", line, n,
                 needle ? needle : "");
    if (!is_zero(&g))
        fail_msg("line %d: *g not zeroed after failure", line);
    if (err[0] == 0 || strncmp(err, "gguf: ", 6) != 0)
        fail_msg("line %d: no message (got '%s')", line, err);
    if (needle && strstr(err, needle) == NULL)
        fail_msg("line %d: message '%s' does not name '%s'", line, err, needle);
    free(c);
}
#define EXPECT_FAIL(w, needle) expect_fail_n((w)->p, (w)->n, (needle), __LINE__)

static void parse_ok(const wb *w, gguf *g)
{
    char err[256] = "";
    if (gguf_parse(w->p, w->n, g, err, sizeof err) != 0)
        fail_msg("parse failed: %s", err);
}

/* ---- metadata ---------------------------------------------------------------------- */
static void test_metadata_types(void **state)
{
    (void)state;
    wb kv = {0}, f = {0};
    uint64_t n = 0;
    w_key(&kv, "u8", GGUF_T_U8), w_u8(&kv, 200), n++;
    w_key(&kv, "i8", GGUF_T_I8), w_u8(&kv, (uint8_t)-5), n++;
    w_key(&kv, "u16", GGUF_T_U16), w_u16(&kv, 60000), n++;
    w_key(&kv, "i16", GGUF_T_I16), w_u16(&kv, (uint16_t)-30000), n++;
    w_key(&kv, "u32", GGUF_T_U32), w_u32(&kv, 4000000000u), n++;
    w_key(&kv, "i32", GGUF_T_I32), w_u32(&kv, (uint32_t)-2000000000), n++;
    w_key(&kv, "i32pos", GGUF_T_I32), w_u32(&kv, 77), n++;
    w_key(&kv, "f32", GGUF_T_F32), w_f32(&kv, 1.5f), n++;
    w_key(&kv, "bool", GGUF_T_BOOL), w_u8(&kv, 1), n++;
    w_key(&kv, "str", GGUF_T_STRING), w_str(&kv, "hello"), n++;
    w_key(&kv, "empty", GGUF_T_STRING), w_str(&kv, ""), n++;
    w_key(&kv, "u64", GGUF_T_U64), w_u64(&kv, (1ull << 63) + 5), n++;
    w_key(&kv, "i64", GGUF_T_I64), w_u64(&kv, (uint64_t)-(1ll << 40)), n++;
    w_key(&kv, "f64", GGUF_T_F64), w_f64(&kv, 0.1), n++;
    w_arr(&kv, "a.str", GGUF_T_STRING, 3), w_str(&kv, "a"), w_str(&kv, ""), w_str(&kv, "xyz"), n++;
    w_arr(&kv, "a.i32", GGUF_T_I32, 3), w_u32(&kv, 1), w_u32(&kv, (uint32_t)-2), w_u32(&kv, 3), n++;
    w_arr(&kv, "a.u8", GGUF_T_U8, 2), w_u8(&kv, 255), w_u8(&kv, 0), n++;
    w_arr(&kv, "a.i16", GGUF_T_I16, 1), w_u16(&kv, (uint16_t)-7), n++;
    w_arr(&kv, "a.f32", GGUF_T_F32, 2), w_f32(&kv, 0.5f), w_f32(&kv, -2.25f), n++;
    w_arr(&kv, "a.f64", GGUF_T_F64, 1), w_f64(&kv, 3.0), n++;
    w_arr(&kv, "a.u64", GGUF_T_U64, 2), w_u64(&kv, 9), w_u64(&kv, UINT64_MAX), n++;
    w_arr(&kv, "a.bool", GGUF_T_BOOL, 2), w_u8(&kv, 0), w_u8(&kv, 1), n++;
    w_arr(&kv, "a.empty", GGUF_T_STRING, 0), n++;
    w_key(&kv, "last", GGUF_T_U32), w_u32(&kv, 42), n++;
    w_file(&f, 3, &kv, n, NULL, 0, 32);

    gguf g;
    parse_ok(&f, &g);
    assert_int_equal(g.version, 3);
    assert_int_equal(g.n_kv, n);
    assert_int_equal(g.n_tensors, 0);
    assert_int_equal(g.alignment, 32);
    assert_ptr_equal(g.base, f.p);
    assert_int_equal(g.size, f.n);

    static const struct {
        const char *k;
        uint32_t t;
    } types[] = {{"u8", GGUF_T_U8},     {"i8", GGUF_T_I8},       {"u16", GGUF_T_U16},
                 {"i16", GGUF_T_I16},   {"u32", GGUF_T_U32},     {"i32", GGUF_T_I32},
                 {"f32", GGUF_T_F32},   {"bool", GGUF_T_BOOL},   {"str", GGUF_T_STRING},
                 {"u64", GGUF_T_U64},   {"i64", GGUF_T_I64},     {"f64", GGUF_T_F64},
                 {"a.str", GGUF_T_ARRAY}};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const gguf_kv *e = gguf_find(&g, types[i].k);
        assert_non_null(e);
        assert_true(gguf_str_eq(e->key, types[i].k));
        assert_int_equal(e->type, types[i].t);
    }
    assert_null(gguf_find(&g, "nope"));
    assert_null(gguf_find(&g, "u"));  /* a prefix of a key */
    assert_null(gguf_find(&g, "u88")); /* a key is a prefix */

    /* Raw values point into the file. */
    assert_int_equal(gguf_find(&g, "u8")->val[0], 200);
    assert_int_equal((int8_t)gguf_find(&g, "i8")->val[0], -5);
    assert_int_equal(gguf_find(&g, "bool")->val[0], 1);
    double d;
    memcpy(&d, gguf_find(&g, "f64")->val, 8);
    assert_true(d == 0.1);

    uint64_t u;
    assert_int_equal(gguf_get_u64(&g, "u8", &u), 0), assert_int_equal(u, 200);
    assert_int_equal(gguf_get_u64(&g, "u16", &u), 0), assert_int_equal(u, 60000);
    assert_int_equal(gguf_get_u64(&g, "u32", &u), 0), assert_int_equal(u, 4000000000u);
    assert_int_equal(gguf_get_u64(&g, "i32pos", &u), 0), assert_int_equal(u, 77);
    assert_int_equal(gguf_get_u64(&g, "u64", &u), 0), assert_true(u == (1ull << 63) + 5);
    assert_int_equal(gguf_get_u64(&g, "last", &u), 0), assert_int_equal(u, 42);
    u = 12345;
    assert_int_equal(gguf_get_u64(&g, "i8", &u), -1); /* negative */
    assert_int_equal(gguf_get_u64(&g, "i16", &u), -1);
    assert_int_equal(gguf_get_u64(&g, "i32", &u), -1);
    assert_int_equal(gguf_get_u64(&g, "i64", &u), -1);
    assert_int_equal(gguf_get_u64(&g, "f32", &u), -1); /* not integers */
    assert_int_equal(gguf_get_u64(&g, "bool", &u), -1);
    assert_int_equal(gguf_get_u64(&g, "str", &u), -1);
    assert_int_equal(gguf_get_u64(&g, "a.i32", &u), -1);
    assert_int_equal(gguf_get_u64(&g, "nope", &u), -1);
    assert_int_equal(u, 12345);

    float fl;
    assert_int_equal(gguf_get_f32(&g, "f32", &fl), 0), assert_true(fl == 1.5f);
    assert_int_equal(gguf_get_f32(&g, "f64", &fl), 0), assert_true(fl == (float)0.1);
    assert_int_equal(gguf_get_f32(&g, "u32", &fl), -1);
    assert_int_equal(gguf_get_f32(&g, "nope", &fl), -1);

    gguf_str s;
    assert_int_equal(gguf_get_str(&g, "str", &s), 0);
    assert_int_equal(s.n, 5), assert_memory_equal(s.p, "hello", 5);
    assert_true(gguf_str_eq(s, "hello"));
    assert_false(gguf_str_eq(s, "hell"));
    assert_false(gguf_str_eq(s, "hello!"));
    assert_int_equal(gguf_get_str(&g, "empty", &s), 0), assert_int_equal(s.n, 0);
    assert_true(gguf_str_eq(s, ""));
    assert_int_equal(gguf_get_str(&g, "u8", &s), -1);
    assert_int_equal(gguf_get_str(&g, "a.str", &s), -1);
    assert_int_equal(gguf_get_str(&g, "nope", &s), -1);

    /* Arrays. */
    const gguf_kv *a = gguf_find(&g, "a.str");
    assert_int_equal(a->arr_type, GGUF_T_STRING), assert_int_equal(a->arr_n, 3);
    gguf_arr_iter it;
    gguf_arr_begin(&it, &g, a);
    assert_int_equal(gguf_arr_next_str(&it, &s), 0), assert_true(gguf_str_eq(s, "a"));
    assert_int_equal(gguf_arr_next_str(&it, &s), 0), assert_true(gguf_str_eq(s, ""));
    assert_int_equal(gguf_arr_next_str(&it, &s), 0), assert_true(gguf_str_eq(s, "xyz"));
    assert_int_equal(gguf_arr_next_str(&it, &s), -1);
    assert_int_equal(gguf_arr_next_str(&it, &s), -1);
    gguf_arr_begin(&it, &g, a);
    int64_t iv;
    assert_int_equal(gguf_arr_next_i64(&it, &iv), -1); /* wrong element type */
    assert_int_equal(gguf_arr_next_f32(&it, &fl), -1);

    gguf_arr_begin(&it, &g, gguf_find(&g, "a.i32"));
    assert_int_equal(gguf_arr_next_i64(&it, &iv), 0), assert_int_equal(iv, 1);
    assert_int_equal(gguf_arr_next_i64(&it, &iv), 0), assert_int_equal(iv, -2);
    assert_int_equal(gguf_arr_next_i64(&it, &iv), 0), assert_int_equal(iv, 3);
    assert_int_equal(gguf_arr_next_i64(&it, &iv), -1);
    gguf_arr_begin(&it, &g, gguf_find(&g, "a.i32"));
    assert_int_equal(gguf_arr_next_str(&it, &s), -1);
    assert_int_equal(gguf_arr_next_f32(&it, &fl), -1);

    gguf_arr_begin(&it, &g, gguf_find(&g, "a.u8"));
    assert_int_equal(gguf_arr_next_i64(&it, &iv), 0), assert_int_equal(iv, 255);
    assert_int_equal(gguf_arr_next_i64(&it, &iv), 0), assert_int_equal(iv, 0);
    assert_int_equal(gguf_arr_next_i64(&it, &iv), -1);
    gguf_arr_begin(&it, &g, gguf_find(&g, "a.i16"));
    assert_int_equal(gguf_arr_next_i64(&it, &iv), 0), assert_int_equal(iv, -7);
    assert_int_equal(gguf_arr_next_i64(&it, &iv), -1);

    gguf_arr_begin(&it, &g, gguf_find(&g, "a.f32"));
    assert_int_equal(gguf_arr_next_f32(&it, &fl), 0), assert_true(fl == 0.5f);
    assert_int_equal(gguf_arr_next_f32(&it, &fl), 0), assert_true(fl == -2.25f);
    assert_int_equal(gguf_arr_next_f32(&it, &fl), -1);
    gguf_arr_begin(&it, &g, gguf_find(&g, "a.f32"));
    assert_int_equal(gguf_arr_next_i64(&it, &iv), -1);
    gguf_arr_begin(&it, &g, gguf_find(&g, "a.f64"));
    assert_int_equal(gguf_arr_next_f32(&it, &fl), 0), assert_true(fl == 3.0f);

    a = gguf_find(&g, "a.u64");
    assert_int_equal(a->arr_n, 2);
    gguf_arr_begin(&it, &g, a);
    assert_int_equal(gguf_arr_next_i64(&it, &iv), 0), assert_int_equal(iv, 9);
    assert_int_equal(gguf_arr_next_i64(&it, &iv), -1); /* UINT64_MAX does not fit */

    a = gguf_find(&g, "a.bool");
    assert_int_equal(a->arr_type, GGUF_T_BOOL), assert_int_equal(a->arr_n, 2);
    assert_int_equal(a->val[0], 0), assert_int_equal(a->val[1], 1);
    gguf_arr_begin(&it, &g, a);
    assert_int_equal(gguf_arr_next_i64(&it, &iv), -1); /* bool is not an integer */

    a = gguf_find(&g, "a.empty");
    assert_int_equal(a->arr_n, 0);
    gguf_arr_begin(&it, &g, a);
    assert_int_equal(gguf_arr_next_str(&it, &s), -1);

    /* Iterating a scalar or nothing ends at once. */
    gguf_arr_begin(&it, &g, gguf_find(&g, "u32"));
    assert_int_equal(gguf_arr_next_i64(&it, &iv), -1);
    gguf_arr_begin(&it, &g, NULL);
    assert_int_equal(gguf_arr_next_str(&it, &s), -1);

    gguf_close(&g);
    assert_true(is_zero(&g));
    gguf_close(&g); /* a zeroed struct */

    /* Version 2 reads the same. */
    wb f2 = {0};
    w_file(&f2, 2, &kv, n, NULL, 0, 32);
    parse_ok(&f2, &g);
    assert_int_equal(g.version, 2);
    assert_int_equal(gguf_get_str(&g, "str", &s), 0), assert_true(gguf_str_eq(s, "hello"));
    gguf_close(&g);
    wb_free(&f2);
    wb_free(&kv);
    wb_free(&f);
}

/* ---- tensors ---------------------------------------------------------------------- */
typedef struct {
    float f32[6];
    uint16_t f16[65536];
    uint16_t bf16[4096];
    uint8_t q8[6 * 34];
    wb fp[4]; /* little-endian encodings */
} tdata;

static void make_tdata(tdata *d, tspec ts[4])
{
    memset(d->fp, 0, sizeof d->fp);
    for (int i = 0; i < 6; i++)
        d->f32[i] = (float)((double)(int64_t)(rng() >> 40) / 3.0 - 1e5);
    d->f32[5] = -0.0f;
    for (uint32_t i = 0; i < 6; i++)
        w_f32(&d->fp[0], d->f32[i]);
    for (uint32_t i = 0; i < 65536; i++) /* every f16 encoding */
        d->f16[i] = (uint16_t)i, w_u16(&d->fp[1], (uint16_t)i);
    static const uint16_t bs[] = {0x0000, 0x8000, 0x0001, 0x807f, 0x0080, 0x3f80, 0xbf80,
                                  0x7f7f, 0x7f80, 0xff80, 0x7fc0, 0x4049};
    for (uint32_t i = 0; i < 4096; i++) {
        d->bf16[i] = i < sizeof bs / sizeof bs[0] ? bs[i] : (uint16_t)rng();
        w_u16(&d->fp[2], d->bf16[i]);
    }
    static const uint16_t scales[6] = {0x3c00, 0xb800, 0x0001, 0x0000, 0x7bff, 0x2e66};
    for (int b = 0; b < 6; b++) {
        uint8_t *q = d->q8 + 34 * b;
        q[0] = (uint8_t)scales[b], q[1] = (uint8_t)(scales[b] >> 8);
        for (int k = 0; k < 32; k++)
            q[2 + k] = (uint8_t)rng();
        if (b == 0)
            q[2] = 0x80, q[3] = 0x7f, q[4] = 0xff, q[5] = 0; /* -128 127 -1 0 */
    }
    wb_put(&d->fp[3], d->q8, sizeof d->q8);
    tspec t[4] = {
        {"blk.0.w_f32", 2, {3, 2}, GGML_F32, d->fp[0].p, d->fp[0].n, 0},
        {"f16.all", 2, {256, 256}, GGML_F16, d->fp[1].p, d->fp[1].n, 0},
        {"bf16", 3, {16, 16, 16}, GGML_BF16, d->fp[2].p, d->fp[2].n, 0},
        {"token_embd.weight", 2, {64, 3}, GGML_Q8_0, d->fp[3].p, d->fp[3].n, 0},
    };
    memcpy(ts, t, sizeof t);
}

static void check_tensors(const gguf *g, const tspec *ts, size_t data_start, const tdata *d)
{
    assert_int_equal(g->n_tensors, 4);
    static const uint64_t elems[4] = {6, 65536, 4096, 192};
    for (int i = 0; i < 4; i++) {
        const gguf_tensor *t = &g->tensors[i];
        assert_true(gguf_str_eq(t->name, ts[i].name));
        assert_ptr_equal(gguf_tensor_find(g, ts[i].name), t);
        assert_int_equal(t->n_dims, ts[i].n_dims);
        for (uint32_t k = 0; k < 4; k++)
            assert_int_equal(t->dims[k], k < ts[i].n_dims ? ts[i].dims[k] : 1);
        assert_int_equal(t->type, ts[i].type);
        assert_int_equal(t->n_elems, elems[i]);
        assert_int_equal(t->n_bytes, ts[i].nbytes);
        assert_ptr_equal(t->data, g->base + data_start + ts[i].offset);
        assert_int_equal(ts[i].offset % g->alignment, 0);
    }
    assert_null(gguf_tensor_find(g, "blk.0"));
    assert_null(gguf_tensor_find(g, "nope"));

    float *out = malloc(65536 * sizeof *out);
    char err[128] = "";
    assert_int_equal(gguf_tensor_f32(&g->tensors[0], out, err, sizeof err), 0);
    for (size_t i = 0; i < 6; i++)
        assert_same_float(out[i], (double)d->f32[i], i);
    assert_int_equal(gguf_tensor_f32(&g->tensors[1], out, err, sizeof err), 0);
    for (size_t i = 0; i < 65536; i++)
        assert_same_float(out[i], ref_f16(d->f16[i]), i);
    assert_int_equal(gguf_tensor_f32(&g->tensors[2], out, err, sizeof err), 0);
    for (size_t i = 0; i < 4096; i++)
        assert_same_float(out[i], ref_bf16(d->bf16[i]), i);
    assert_int_equal(gguf_tensor_f32(&g->tensors[3], out, err, sizeof err), 0);
    for (size_t b = 0; b < 6; b++) {
        const uint8_t *q = d->q8 + 34 * b;
        double scale = ref_f16((uint16_t)(q[0] | q[1] << 8));
        for (size_t k = 0; k < 32; k++) /* d * q is exact in float */
            assert_same_float(out[32 * b + k], scale * (double)(int8_t)q[2 + k], 32 * b + k);
    }
    assert_true(out[0] == -128.0f && out[1] == 127.0f && out[2] == -1.0f && out[3] == 0.0f);
    free(out);
}

static void test_tensors_default_alignment(void **state)
{
    (void)state;
    tdata *d = calloc(1, sizeof *d);
    tspec ts[4];
    make_tdata(d, ts);
    wb kv = {0}, f = {0};
    w_key(&kv, "general.architecture", GGUF_T_STRING), w_str(&kv, "llama");
    size_t data_start = w_file(&f, 3, &kv, 1, ts, 4, 32);
    assert_int_equal(data_start % 32, 0);
    assert_true(ts[1].offset == 32); /* 24 bytes of f32 padded to 32 */
    gguf g;
    parse_ok(&f, &g);
    assert_int_equal(g.alignment, 32);
    check_tensors(&g, ts, data_start, d);
    gguf_close(&g);
    wb_free(&f);
    wb_free(&kv);
    for (int i = 0; i < 4; i++)
        wb_free(&d->fp[i]);
    free(d);
}

static void test_tensors_custom_alignment(void **state)
{
    (void)state;
    tdata *d = calloc(1, sizeof *d);
    tspec ts[4];
    make_tdata(d, ts);
    static const struct {
        uint32_t type;
        uint64_t align;
    } cases[] = {{GGUF_T_U32, 64}, {GGUF_T_U32, 1}, {GGUF_T_U64, 4096}, {GGUF_T_U16, 8}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        wb kv = {0}, f = {0};
        w_key(&kv, "general.name", GGUF_T_STRING), w_str(&kv, "x");
        w_key(&kv, "general.alignment", cases[c].type);
        w_le(&kv, cases[c].align, cases[c].type == GGUF_T_U64 ? 8 : cases[c].type == GGUF_T_U32 ? 4 : 2);
        size_t data_start = w_file(&f, 3, &kv, 2, ts, 4, cases[c].align);
        assert_int_equal(data_start % cases[c].align, 0);
        gguf g;
        parse_ok(&f, &g);
        assert_int_equal(g.alignment, cases[c].align);
        check_tensors(&g, ts, data_start, d);
        gguf_close(&g);
        wb_free(&f);
        wb_free(&kv);
    }
    /* With alignment 64 the default layout (offsets at multiples of 32 and
     * data start padded to 32) must not parse: the first offset that is only
     * a multiple of 32 is rejected. */
    {
        wb kv = {0}, f = {0};
        w_key(&kv, "general.alignment", GGUF_T_U32), w_u32(&kv, 64);
        w_hdr(&f, 3, 2, 1);
        wb_put(&f, kv.p, kv.n);
        w_str(&f, "a"), w_u32(&f, 1), w_u64(&f, 8), w_u32(&f, GGML_F32), w_u64(&f, 0);
        w_str(&f, "b"), w_u32(&f, 1), w_u64(&f, 8), w_u32(&f, GGML_F32), w_u64(&f, 32);
        w_pad(&f, 64);
        for (int i = 0; i < 128; i++)
            w_u8(&f, 0);
        EXPECT_FAIL(&f, "not a multiple of the alignment 64");
        wb_free(&f);
        wb_free(&kv);
    }
    for (int i = 0; i < 4; i++)
        wb_free(&d->fp[i]);
    free(d);
}

static void test_bad_alignment(void **state)
{
    (void)state;
    static const uint32_t bad[] = {0, 48, 3, 1u << 31};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        wb f = {0};
        w_hdr(&f, 3, 0, 1);
        w_key(&f, "general.alignment", GGUF_T_U32), w_u32(&f, bad[i]);
        EXPECT_FAIL(&f, "general.alignment");
        wb_free(&f);
    }
    wb f = {0};
    w_hdr(&f, 3, 0, 1);
    w_key(&f, "general.alignment", GGUF_T_STRING), w_str(&f, "32");
    EXPECT_FAIL(&f, "general.alignment has type string");
    wb_free(&f);
    w_hdr(&f, 3, 0, 1);
    w_key(&f, "general.alignment", GGUF_T_I32), w_u32(&f, (uint32_t)-32);
    EXPECT_FAIL(&f, "general.alignment is negative");
    wb_free(&f);
    /* A tensor offset that is not a multiple of the default 32. */
    float x[8] = {0};
    w_hdr(&f, 3, 1, 0);
    w_str(&f, "t"), w_u32(&f, 1), w_u64(&f, 4), w_u32(&f, GGML_F32), w_u64(&f, 16);
    w_pad(&f, 32);
    wb_put(&f, x, sizeof x);
    EXPECT_FAIL(&f, "tensor 't' offset 16 is not a multiple of the alignment 32");
    wb_free(&f);
}

/* ---- malformed ------------------------------------------------------------------ */
/* A small valid file whose last bytes are tensor data, so that every proper
 * prefix is invalid. */
static void small_file(wb *f)
{
    wb kv = {0};
    w_key(&kv, "general.architecture", GGUF_T_STRING), w_str(&kv, "llama");
    w_key(&kv, "llama.context_length", GGUF_T_U32), w_u32(&kv, 4096);
    w_key(&kv, "llama.rope.freq_base", GGUF_T_F32), w_f32(&kv, 10000.0f);
    w_arr(&kv, "tokenizer.ggml.tokens", GGUF_T_STRING, 3);
    w_str(&kv, "<s>"), w_str(&kv, "a"), w_str(&kv, "bc");
    w_arr(&kv, "tokenizer.ggml.scores", GGUF_T_F32, 3);
    w_f32(&kv, 0), w_f32(&kv, -1), w_f32(&kv, -2);
    w_key(&kv, "general.alignment", GGUF_T_U32), w_u32(&kv, 16);
    static const float v[3] = {1, 2, 3};
    static uint8_t q[34];
    q[0] = 0x00, q[1] = 0x3c;
    for (int i = 0; i < 32; i++)
        q[2 + i] = (uint8_t)(i * 7 + 1);
    tspec ts[2] = {{"output_norm.weight", 1, {3}, GGML_F32, v, sizeof v, 0},
                   {"output.weight", 1, {32}, GGML_Q8_0, q, sizeof q, 0}};
    w_file(f, 3, &kv, 6, ts, 2, 16);
    wb_free(&kv);
}

static void test_truncated_everywhere(void **state)
{
    (void)state;
    wb f = {0};
    small_file(&f);
    gguf g;
    parse_ok(&f, &g);
    assert_int_equal(g.n_kv, 6), assert_int_equal(g.n_tensors, 2);
    assert_int_equal(g.alignment, 16);
    gguf_close(&g);
    for (size_t n = 0; n < f.n; n++)
        expect_fail_n(f.p, n, NULL, __LINE__);
    /* A few prefixes name what they cut. */
    expect_fail_n(f.p, 10, "too small", __LINE__);
    expect_fail_n(f.p, 30, "n_kv 6 too large", __LINE__);
    expect_fail_n(f.p, 110, "truncated: metadata key (#2) at offset 105 needs 8 bytes", __LINE__);
    expect_fail_n(f.p, 120, "metadata key (#2) at offset 105 has length 20, past the end", __LINE__);
    expect_fail_n(f.p, f.n - 1, "runs past the end", __LINE__);
    wb_free(&f);
}

static void test_magic_version(void **state)
{
    (void)state;
    wb f = {0};
    small_file(&f);
    uint8_t *c = malloc(f.n);
    memcpy(c, f.p, f.n);
    c[3] = 'G';
    expect_fail_n(c, f.n, "bad magic 47 47 55 47", __LINE__);
    memcpy(c, "GGML", 4);
    expect_fail_n(c, f.n, "magic", __LINE__);
    static const uint32_t versions[] = {0, 1, 4, 0xffffffffu};
    for (size_t i = 0; i < 4; i++) {
        memcpy(c, f.p, f.n);
        for (int k = 0; k < 4; k++)
            c[4 + k] = (uint8_t)(versions[i] >> (8 * k));
        char needle[64];
        snprintf(needle, sizeof needle, "unsupported version %u", versions[i]);
        expect_fail_n(c, f.n, needle, __LINE__);
    }
    /* Version 2 of the same bytes is fine. */
    memcpy(c, f.p, f.n);
    c[4] = 2;
    gguf g;
    char err[128];
    assert_int_equal(gguf_parse(c, f.n, &g, err, sizeof err), 0);
    gguf_close(&g);
    free(c);
    wb_free(&f);
}

static void test_absurd_counts(void **state)
{
    (void)state;
    static const uint64_t big[] = {1ull << 62, UINT64_MAX, 1ull << 32, 1000};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        wb f = {0};
        w_hdr(&f, 3, 0, big[i]);
        w_key(&f, "a", GGUF_T_U8), w_u8(&f, 1);
        EXPECT_FAIL(&f, "n_kv");
        wb_free(&f);

        w_hdr(&f, 3, big[i], 0);
        for (int k = 0; k < 40; k++)
            w_u8(&f, 0);
        EXPECT_FAIL(&f, "n_tensors");
        wb_free(&f);

        /* n_tensors fits the bytes after the header but not after the kv. */
        w_hdr(&f, 3, 2, 1);
        w_key(&f, "k", GGUF_T_STRING), w_u64(&f, 80);
        for (int k = 0; k < 80; k++)
            w_u8(&f, 'x');
        EXPECT_FAIL(&f, "n_tensors 2 too large for the 0 bytes after the metadata");
        wb_free(&f);

        w_hdr(&f, 3, 0, 1);
        w_u64(&f, big[i]); /* key length */
        w_u32(&f, GGUF_T_U8), w_u8(&f, 0);
        EXPECT_FAIL(&f, "metadata key (#0)");
        wb_free(&f);

        w_hdr(&f, 3, 0, 1);
        w_key(&f, "s", GGUF_T_STRING), w_u64(&f, big[i]), w_u64(&f, 0);
        EXPECT_FAIL(&f, "metadata string value");
        wb_free(&f);

        w_hdr(&f, 3, 0, 1);
        w_arr(&f, "arr8", GGUF_T_U8, big[i]), w_u64(&f, 0);
        EXPECT_FAIL(&f, "'arr8': array count");
        wb_free(&f);

        w_hdr(&f, 3, 0, 1);
        w_arr(&f, "arr64", GGUF_T_U64, big[i] / 4 + 1), w_u64(&f, 0), w_u64(&f, 0);
        EXPECT_FAIL(&f, "'arr64': array count");
        wb_free(&f);

        w_hdr(&f, 3, 0, 1);
        w_arr(&f, "arrs", GGUF_T_STRING, big[i]), w_u64(&f, 0);
        EXPECT_FAIL(&f, "'arrs': array count");
        wb_free(&f);

        w_hdr(&f, 3, 0, 1);
        w_arr(&f, "arrs", GGUF_T_STRING, 2), w_str(&f, "ok"), w_u64(&f, big[i]);
        w_u64(&f, 0);
        EXPECT_FAIL(&f, "string array element (#1)");
        wb_free(&f);

        w_hdr(&f, 3, 1, 0);
        w_u64(&f, big[i]); /* name length */
        w_u32(&f, 1), w_u64(&f, 1), w_u32(&f, GGML_F32), w_u64(&f, 0);
        EXPECT_FAIL(&f, "tensor name (#0)");
        wb_free(&f);
    }
}

static void test_bad_values(void **state)
{
    (void)state;
    wb f = {0};
    w_hdr(&f, 3, 0, 1);
    w_key(&f, "t13", 13), w_u64(&f, 0);
    EXPECT_FAIL(&f, "'t13' has unknown value type 13");
    wb_free(&f);
    w_hdr(&f, 3, 0, 1);
    w_arr(&f, "nested", GGUF_T_ARRAY, 1), w_u32(&f, GGUF_T_U8), w_u64(&f, 1), w_u8(&f, 0);
    for (int k = 0; k < 16; k++)
        w_u8(&f, 0);
    EXPECT_FAIL(&f, "'nested' is an array of arrays");
    wb_free(&f);
    w_hdr(&f, 3, 0, 1);
    w_arr(&f, "au", 99, 1), w_u64(&f, 0);
    EXPECT_FAIL(&f, "'au' is an array of unknown type 99");
    wb_free(&f);
    /* Duplicate keys. */
    w_hdr(&f, 3, 0, 3);
    w_key(&f, "dup", GGUF_T_U8), w_u8(&f, 0);
    w_key(&f, "other", GGUF_T_U8), w_u8(&f, 0);
    w_key(&f, "dup", GGUF_T_U32), w_u32(&f, 0);
    EXPECT_FAIL(&f, "duplicate metadata key 'dup'");
    wb_free(&f);
}

/* One tensor info with the given fields, then padding and nbytes of data. */
static void one_tensor(wb *f, const char *name, uint32_t n_dims, const uint64_t *dims,
                       uint32_t type, uint64_t offset, size_t nbytes)
{
    w_hdr(f, 3, 1, 0);
    w_str(f, name), w_u32(f, n_dims);
    for (uint32_t d = 0; d < n_dims; d++)
        w_u64(f, dims[d]);
    w_u32(f, type), w_u64(f, offset);
    w_pad(f, 32);
    for (size_t i = 0; i < nbytes; i++)
        w_u8(f, (uint8_t)i);
}

static void test_bad_tensors(void **state)
{
    (void)state;
    wb f = {0};
    uint64_t d1[5] = {4, 1, 1, 1, 1};
    one_tensor(&f, "t", 1, d1, GGML_F32, 0, 16);
    gguf g;
    parse_ok(&f, &g); /* the baseline parses */
    gguf_close(&g);
    wb_free(&f);

    one_tensor(&f, "t", 5, d1, GGML_F32, 0, 16);
    EXPECT_FAIL(&f, "tensor 't' has n_dims 5");
    wb_free(&f);
    one_tensor(&f, "t", 0, d1, GGML_F32, 0, 16);
    EXPECT_FAIL(&f, "tensor 't' has n_dims 0");
    wb_free(&f);

    /* Data past the end: one element too many; a huge offset; an offset
     * that overflows with the size. */
    uint64_t d5[1] = {5};
    one_tensor(&f, "t", 1, d5, GGML_F32, 0, 16);
    EXPECT_FAIL(&f, "tensor 't' data (offset 0, 20 bytes) runs past the end");
    wb_free(&f);
    one_tensor(&f, "t", 1, d1, GGML_F32, 32, 16);
    EXPECT_FAIL(&f, "runs past the end");
    wb_free(&f);
    one_tensor(&f, "t", 1, d1, GGML_F32, UINT64_MAX - 31, 16);
    EXPECT_FAIL(&f, "runs past the end");
    wb_free(&f);
    /* Infos that end past the file (no room for the data section). */
    w_hdr(&f, 3, 1, 0);
    w_str(&f, "t"), w_u32(&f, 1), w_u64(&f, 0), w_u32(&f, GGML_F32), w_u64(&f, 0);
    EXPECT_FAIL(&f, "data section would start at offset");
    wb_free(&f);

    /* Dims whose product overflows, dims beyond INT64_MAX, byte counts that
     * overflow. */
    uint64_t o1[3] = {1ull << 32, 1ull << 32, 2};
    one_tensor(&f, "big", 3, o1, GGML_F32, 0, 16);
    EXPECT_FAIL(&f, "tensor 'big': element count overflows");
    wb_free(&f);
    uint64_t o2[4] = {3, 3, 1ull << 62, 1};
    one_tensor(&f, "big", 4, o2, GGML_F16, 0, 16);
    EXPECT_FAIL(&f, "element count overflows");
    wb_free(&f);
    uint64_t o3[1] = {1ull << 63};
    one_tensor(&f, "neg", 1, o3, GGML_F32, 0, 16);
    EXPECT_FAIL(&f, "tensor 'neg' dim 0 is 9223372036854775808");
    wb_free(&f);
    uint64_t o4[2] = {1ull << 31, 1ull << 31}; /* 2^62 elements, 2^64 bytes */
    one_tensor(&f, "wide", 2, o4, GGML_F32, 0, 16);
    EXPECT_FAIL(&f, "tensor 'wide': byte size overflows");
    wb_free(&f);
    uint64_t o5[2] = {1ull << 31, 1ull << 30}; /* fits, but not in the file */
    one_tensor(&f, "wide", 2, o5, GGML_F32, 0, 16);
    EXPECT_FAIL(&f, "runs past the end");
    wb_free(&f);

    /* Types: unknown ones fail the parse; Q8_0 rows must be whole blocks. */
    one_tensor(&f, "t", 1, d1, 4, 0, 16); /* Q4_2, removed from ggml */
    EXPECT_FAIL(&f, "tensor 't' has unknown ggml type 4");
    wb_free(&f);
    one_tensor(&f, "t", 1, d1, 1000, 0, 16);
    EXPECT_FAIL(&f, "unknown ggml type 1000");
    wb_free(&f);
    uint64_t q48[2] = {48, 2};
    one_tensor(&f, "q", 2, q48, GGML_Q8_0, 0, 102);
    EXPECT_FAIL(&f, "tensor 'q' of type Q8_0: dims[0] 48 is not a multiple of the block size 32");
    wb_free(&f);

    /* A Q4_0 tensor is in the directory (sized as ggml does: 18 bytes per
     * 32) but cannot be widened. */
    uint64_t q64[1] = {64};
    one_tensor(&f, "q4", 1, q64, 2, 0, 36);
    parse_ok(&f, &g);
    assert_int_equal(g.tensors[0].n_bytes, 36);
    assert_int_equal(g.tensors[0].n_elems, 64);
    float out[64];
    char err[256] = "";
    assert_int_equal(gguf_tensor_f32(&g.tensors[0], out, err, sizeof err), -1);
    assert_non_null(strstr(err, "tensor 'q4' has type Q4_0 (2)"));
    gguf_close(&g);
    wb_free(&f);
    /* Q4_0 one byte short. */
    one_tensor(&f, "q4", 1, q64, 2, 0, 35);
    EXPECT_FAIL(&f, "runs past the end");
    wb_free(&f);

    /* Duplicate tensor names. */
    w_hdr(&f, 3, 3, 0);
    const char *names[3] = {"x", "y", "x"};
    for (int i = 0; i < 3; i++)
        w_str(&f, names[i]), w_u32(&f, 1), w_u64(&f, 8), w_u32(&f, GGML_F32),
            w_u64(&f, (uint64_t)i * 32);
    w_pad(&f, 32);
    for (int i = 0; i < 96; i++)
        w_u8(&f, 0);
    EXPECT_FAIL(&f, "duplicate tensor name 'x'");
    wb_free(&f);
}

static void test_open(void **state)
{
    (void)state;
    wb f = {0};
    small_file(&f);
    char path[] = "/tmp/test_gguf_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, f.p, f.n), (ssize_t)f.n);
    close(fd);
    gguf g;
    char err[512] = "";
    if (gguf_open(path, &g, err, sizeof err) != 0)
        fail_msg("gguf_open: %s", err);
    assert_non_null(g.map);
    assert_int_equal(g.map_size, f.n);
    assert_ptr_equal(g.base, g.map);
    gguf_str s;
    assert_int_equal(gguf_get_str(&g, "general.architecture", &s), 0);
    assert_true(gguf_str_eq(s, "llama"));
    const gguf_tensor *t = gguf_tensor_find(&g, "output.weight");
    assert_non_null(t);
    float out[32];
    assert_int_equal(gguf_tensor_f32(t, out, err, sizeof err), 0);
    for (int i = 0; i < 32; i++)
        assert_true(out[i] == (float)(int8_t)(uint8_t)(i * 7 + 1));
    gguf_close(&g);
    assert_true(is_zero(&g));

    /* Bad magic through a file: the message names the file. */
    f.p[0] = 'X';
    fd = open(path, O_WRONLY | O_TRUNC);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, f.p, f.n), (ssize_t)f.n);
    close(fd);
    assert_int_equal(gguf_open(path, &g, err, sizeof err), -1);
    assert_non_null(strstr(err, path)), assert_non_null(strstr(err, "bad magic"));
    assert_true(is_zero(&g));
    /* Too small. */
    fd = open(path, O_WRONLY | O_TRUNC);
    assert_int_equal(write(fd, "GGUF", 4), 4);
    close(fd);
    assert_int_equal(gguf_open(path, &g, err, sizeof err), -1);
    assert_non_null(strstr(err, "too small"));
    unlink(path);
    /* Missing, a directory. */
    assert_int_equal(gguf_open(path, &g, err, sizeof err), -1);
    assert_non_null(strstr(err, "cannot open"));
    assert_true(is_zero(&g));
    assert_int_equal(gguf_open("/tmp", &g, err, sizeof err), -1);
    assert_non_null(strstr(err, "not a regular file"));
    /* A tiny error buffer is not overrun; NULL is accepted. */
    char tiny[8];
    assert_int_equal(gguf_open("/tmp", &g, tiny, sizeof tiny), -1);
    assert_int_equal(strlen(tiny), 7);
    assert_int_equal(gguf_open("/tmp", &g, NULL, 0), -1);
    wb_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_metadata_types),
        cmocka_unit_test(test_tensors_default_alignment),
        cmocka_unit_test(test_tensors_custom_alignment),
        cmocka_unit_test(test_bad_alignment),
        cmocka_unit_test(test_truncated_everywhere),
        cmocka_unit_test(test_magic_version),
        cmocka_unit_test(test_absurd_counts),
        cmocka_unit_test(test_bad_values),
        cmocka_unit_test(test_bad_tensors),
        cmocka_unit_test(test_open),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
