/* The host cache's eviction lists (lib/tier/hostlru.c) on their own: the
 * importance bucket against a model computed in double (octave and eighth
 * of it, mirrored for negative values; -0 as +0; NaN as +inf), and the
 * lists against a plain array model under random files, parks and unlinks
 * (the lowest non-empty bucket's head, each bucket in filing order). */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "internal.h"
#include "../tier/tier.h"

/* The documented ranking of a normal float: octave and eighth of it,
 * mirrored below zero; zero (either sign) is 0. Order-equivalent to the
 * bucket. (Subnormals: see test_bucket_order.) */
static double rank8(float x)
{
    if (x == 0)
        return 0;
    if (isinf(x))
        return x > 0 ? 1e9 : -1e9;
    int e;
    const double m = frexp(fabs((double)x), &e);
    const double r = 2000.0 + e * 8.0 + floor((m * 2.0 - 1.0) * 8.0);
    return x > 0 ? r : -r;
}

static float rand_float(tu_rng *r)
{
    switch (tu_below(r, 8)) {
    case 0:
        return (float)tu_unit(r) * 1e-30f;
    case 1:
        return (float)tu_unit(r) * 1e30f;
    case 2:
        return (float)(int)tu_below(r, 5) - 2.0f; /* exact small integers, zeros */
    default:
        return (float)tu_unit(r) * (float)(1u << tu_below(r, 20)) * 1e-3f;
    }
}

static void test_bucket_order(void **state)
{
    (void)state;
    tu_rng r = {0x5eed};
    assert_int_equal(kvt__hlru_bucket(-0.0f), kvt__hlru_bucket(0.0f));
    assert_int_equal(kvt__hlru_bucket(NAN), kvt__hlru_bucket(INFINITY)); /* NaN as +inf */
    assert_int_equal(kvt__hlru_bucket(-NAN), kvt__hlru_bucket(INFINITY));
    assert_true(kvt__hlru_bucket(FLT_MAX) < kvt__hlru_bucket(INFINITY));
    assert_true(kvt__hlru_bucket(-INFINITY) < kvt__hlru_bucket(-1e30f));
    /* Subnormals lie between zero's bucket and the smallest normal's. */
    assert_true(kvt__hlru_bucket(1e-40f) >= kvt__hlru_bucket(0.0f));
    assert_true(kvt__hlru_bucket(1e-40f) < kvt__hlru_bucket(FLT_MIN));
    assert_true(kvt__hlru_bucket(-1e-40f) <= kvt__hlru_bucket(0.0f));
    assert_true(kvt__hlru_bucket(-1e-40f) > kvt__hlru_bucket(-FLT_MIN));
    for (int i = 0; i < 200000; i++) {
        const float a = rand_float(&r), b = rand_float(&r);
        const uint32_t ba = kvt__hlru_bucket(a), bb = kvt__hlru_bucket(b);
        assert_true(ba < KVT__HLRU_NB && bb < KVT__HLRU_NB);
        /* Monotone, and equal exactly when the model's ranks are equal. */
        if (rank8(a) < rank8(b))
            assert_true(ba < bb);
        else if (rank8(a) > rank8(b))
            assert_true(ba > bb);
        else
            assert_int_equal(ba, bb);
    }
}

#define NBLK 64u
static void test_lists_model(void **state)
{
    (void)state;
    tu_rng r = {0x11};
    kvt__hlru l;
    assert_int_equal(kvt__hlru_init(&l, NBLK), 0);
    /* Model: each block's bucket (-1 none, NB parked) and filing serial. */
    int bk[NBLK];
    uint64_t ser[NBLK], next = 1;
    for (uint32_t b = 0; b < NBLK; b++)
        bk[b] = -1;
    const float vals[] = {0.0f, 1.0f, 1.1f, 2.0f, -3.0f, 1e-3f};
    for (int it = 0; it < 20000; it++) {
        const uint32_t b = tu_below(&r, NBLK), op = tu_below(&r, 4);
        if (op == 0 || op == 1) {
            const float v = vals[tu_below(&r, 6)];
            kvt__hlru_file(&l, b, v, (uint32_t)it);
            bk[b] = (int)kvt__hlru_bucket(v);
            ser[b] = next++;
            assert_int_equal(l.fuse[b], (uint32_t)it);
        } else if (op == 2) {
            kvt__hlru_park(&l, b, 0);
            bk[b] = (int)KVT__HLRU_NB;
            ser[b] = next++;
        } else {
            kvt__hlru_unlink(&l, b);
            bk[b] = -1;
        }
        /* The lowest non-empty bucket's oldest filing, parked ones never. */
        uint32_t want = KVT__HLRU_NIL;
        for (uint32_t x = 0; x < NBLK; x++)
            if (bk[x] >= 0 && bk[x] < (int)KVT__HLRU_NB &&
                (want == KVT__HLRU_NIL || bk[x] < bk[want] ||
                 (bk[x] == bk[want] && ser[x] < ser[want])))
                want = x;
        assert_int_equal(kvt__hlru_lowest(&l), want);
    }
    kvt__hlru_fini(&l);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bucket_order),
        cmocka_unit_test(test_lists_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
