/* Element conversions (internal helpers) against value-table references:
 * every f16/bf16 encoding, and f32 inputs rounded three ways. */
#include "testutil.h"

#include "internal.h"

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

static void test_f16_decode_all(void **state)
{
    (void)state;
    for (uint32_t b = 0; b < 65536; b++) {
        double ref = tu_f16_value((uint16_t)b);
        float got = kvt__f16_to_f32((uint16_t)b);
        if (isnan(ref)) {
            assert_true(isnan(got));
            continue;
        }
        if ((double)got != ref || !signbit(got) != !signbit(ref))
            fail_msg("f16 0x%04x: got %a, want %a", b, (double)got, ref);
    }
    /* The batch path (F16C where the CPU has it) must agree bit for bit. */
    uint16_t in[65536];
    float out[65536];
    for (uint32_t b = 0; b < 65536; b++)
        in[b] = (uint16_t)b;
    kvt__load_f32(out, in, KVT_DTYPE_F16, 65536);
    for (uint32_t b = 0; b < 65536; b++) {
        float one = kvt__f16_to_f32((uint16_t)b);
        if (isnan(one))
            assert_true(isnan(out[b]));
        else
            assert_memory_equal(&one, &out[b], sizeof one);
    }
}

/* Interesting f32 inputs: table values, midpoints and their neighbours,
 * the overflow edges, subnormals, and random values of every magnitude. */
static size_t make_inputs(const tu_table *t, float *x, size_t cap, tu_rng *r)
{
    size_t n = 0;
    for (size_t i = 0; i + 1 < t->n && n + 5 < cap; i += 7) {
        double a = t->e[i].v, b = t->e[i + 1].v, mid = (a + b) / 2;
        x[n++] = (float)a;
        x[n++] = (float)mid;
        x[n++] = nextafterf((float)mid, INFINITY);
        x[n++] = nextafterf((float)mid, -INFINITY);
    }
    const float edges[] = {65504.0f, 65519.0f, 65520.0f, 65535.0f, 65536.0f, 1e9f, -65520.0f,
                           -65519.99f, 3.4e38f, -3.4e38f, 0x1p-24f, 0x1p-25f, 0x1.8p-25f,
                           0x1p-30f, -0x1p-30f, 0.0f, -0.0f, 1e-40f, -1e-40f};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0] && n < cap; i++)
        x[n++] = edges[i];
    while (n < cap) {
        uint32_t u = (uint32_t)tu_next(r);
        float f;
        memcpy(&f, &u, 4);
        if (isnan(f) || isinf(f))
            continue;
        x[n++] = f;
    }
    return n;
}

static void check_round(const tu_table *t, int man_bits, uint16_t (*fn)(float, kvt__round),
                        kvt_dtype dt, const char *name)
{
    enum { N = 200000 };
    float *x = malloc(N * sizeof *x);
    uint16_t *batch = malloc(N * sizeof *batch);
    tu_rng r = {0x1234567ull};
    size_t n = make_inputs(t, x, N, &r);
    const kvt__round modes[3] = {KVT__RN, KVT__RD, KVT__RU};
    for (int m = 0; m < 3; m++) {
        kvt__store_f32(batch, dt, x, n, modes[m]);
        for (size_t i = 0; i < n; i++) {
            uint16_t want = tu_round(t, (double)x[i], m, man_bits);
            uint16_t got = fn(x[i], modes[m]);
            if (got != want)
                fail_msg("%s mode %d: %a -> 0x%04x, want 0x%04x", name, m, (double)x[i], got,
                         want);
            if (batch[i] != want)
                fail_msg("%s batch mode %d: %a -> 0x%04x, want 0x%04x", name, m,
                         (double)x[i], batch[i], want);
        }
    }
    /* Specials. */
    for (int m = 0; m < 3; m++) {
        assert_true(isnan(t == &f16t ? tu_f16_value(fn(NAN, modes[m]))
                                     : tu_bf16_value(fn(NAN, modes[m]))));
        assert_int_equal(fn(INFINITY, modes[m]), t->pos_inf);
        assert_int_equal(fn(-INFINITY, modes[m]), t->neg_inf);
    }
    free(x);
    free(batch);
}

static void test_f16_round(void **state)
{
    (void)state;
    check_round(&f16t, 10, kvt__f32_to_f16, KVT_DTYPE_F16, "f16");
}

static void test_bf16_round(void **state)
{
    (void)state;
    check_round(&bf16t, 7, kvt__f32_to_bf16, KVT_DTYPE_BF16, "bf16");
    for (uint32_t b = 0; b < 65536; b++) {
        double ref = tu_bf16_value((uint16_t)b);
        float got = kvt__bf16_to_f32((uint16_t)b);
        if (!isnan(ref))
            assert_true((double)got == ref);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_decode_all),
        cmocka_unit_test(test_f16_round),
        cmocka_unit_test(test_bf16_round),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
