/* CRC32C (internal helper) against a bit-at-a-time reference written from
 * the polynomial, and the published check value of "123456789". */
#include <stdlib.h>

#include "testutil.h"

#include "internal.h"

/* One bit at a time, straight from the definition (reflected 0x82F63B78). */
static uint32_t ref_crc32c(uint32_t crc, const uint8_t *p, size_t n)
{
    crc = ~crc;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++)
            crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
    return ~crc;
}

static void test_check_value(void **state)
{
    (void)state;
    const char *s = "123456789";
    assert_int_equal(ref_crc32c(0, (const uint8_t *)s, 9), 0xE3069283u);
    assert_int_equal(kvt__crc32c(0, s, 9), 0xE3069283u);
    assert_int_equal(kvt__crc32c_sw(0, s, 9), 0xE3069283u);
    assert_int_equal(kvt__crc32c(0, s, 0), 0u);
}

/* Every length 0..300 at every alignment 0..7, continued in two parts. */
static void test_random_buffers(void **state)
{
    (void)state;
    tu_rng r = {0x1234567};
    uint8_t buf[320];
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (uint8_t)tu_next(&r);
    for (size_t off = 0; off < 8; off++)
        for (size_t n = 0; n <= 300; n++) {
            uint32_t want = ref_crc32c(0, buf + off, n);
            assert_int_equal(kvt__crc32c(0, buf + off, n), want);
            assert_int_equal(kvt__crc32c_sw(0, buf + off, n), want);
            size_t h = n / 3;
            uint32_t part = kvt__crc32c(0, buf + off, h);
            assert_int_equal(kvt__crc32c(part, buf + off + h, n - h), want);
            part = kvt__crc32c_sw(0, buf + off, h);
            assert_int_equal(kvt__crc32c_sw(part, buf + off + h, n - h), want);
        }
}

/* Buffers past three 512 B or three 4 KiB blocks (the three-stream paths
 * of the hardware CRC): lengths around the block multiples (an 8 KiB page,
 * both sizes in one buffer), every alignment, split at random points,
 * against the bitwise reference. */
static void test_large_buffers(void **state)
{
    (void)state;
    tu_rng r = {0xc0ffee};
    const size_t cap = 3 * 3 * 4096 + 64;
    uint8_t *buf = malloc(cap);
    for (size_t i = 0; i < cap; i++)
        buf[i] = (uint8_t)tu_next(&r);
    const size_t lens[] = {3 * 512 - 1, 3 * 512, 3 * 512 + 9, 6 * 512 + 511, 8192, 8192 + 3,
                           3 * 4096 - 1, 3 * 4096, 3 * 4096 + 1, 3 * 4096 + 7, 6 * 4096 - 8,
                           6 * 4096, 6 * 4096 + 13, 9 * 4096, 9 * 4096 + 40,
                           3 * 4096 + 3 * 512, 3 * 4096 + 5 * 512 + 100};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
        for (size_t off = 0; off < 8; off++) {
            const size_t n = lens[li];
            const uint32_t want = ref_crc32c(0, buf + off, n);
            assert_int_equal(kvt__crc32c(0, buf + off, n), want);
            assert_int_equal(kvt__crc32c_sw(0, buf + off, n), want);
            const size_t h = tu_below(&r, (uint32_t)n);
            assert_int_equal(kvt__crc32c(kvt__crc32c(0, buf + off, h), buf + off + h, n - h),
                             want);
            assert_int_equal(kvt__crc32c(0x12345678u, buf + off, n),
                             ref_crc32c(0x12345678u, buf + off, n));
        }
    free(buf);
}

/* A page-sized buffer: one flipped bit anywhere changes the CRC. */
static void test_bit_flip_detected(void **state)
{
    (void)state;
    tu_rng r = {99};
    static uint8_t page[8192];
    for (size_t i = 0; i < sizeof page; i++)
        page[i] = (uint8_t)tu_next(&r);
    uint32_t c0 = kvt__crc32c(0, page, sizeof page);
    assert_int_equal(c0, ref_crc32c(0, page, sizeof page));
    for (int t = 0; t < 200; t++) {
        size_t at = tu_below(&r, sizeof page);
        uint8_t bit = (uint8_t)(1u << tu_below(&r, 8));
        page[at] ^= bit;
        assert_int_not_equal(kvt__crc32c(0, page, sizeof page), c0);
        page[at] ^= bit;
    }
}

/* Copy and check in one pass: the destination is a byte-exact copy, the
 * bytes around it are untouched, and the CRC is the bitwise reference's
 * over the source; every length class (bytes, words, both block sizes) at
 * source and destination alignments 0..7. */
static void test_copy(void **state)
{
    (void)state;
    tu_rng r = {0xfeed};
    const size_t cap = 3 * 4096 + 3 * 512 + 200;
    uint8_t *src = malloc(cap + 8), *dst = malloc(cap + 32);
    for (size_t i = 0; i < cap + 8; i++)
        src[i] = (uint8_t)tu_next(&r);
    const size_t lens[] = {0, 1, 7, 8, 9, 300, 3 * 512 - 1, 3 * 512, 8192, 8192 + 5,
                           3 * 4096 + 3 * 512 + 100};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
        for (size_t so = 0; so < 8; so++)
            for (size_t dof = 0; dof < 8; dof += 3) {
                const size_t n = lens[li];
                memset(dst, 0xa5, cap + 32);
                const uint32_t c = kvt__crc32c_copy(dst + 8 + dof, src + so, n);
                assert_int_equal(c, ref_crc32c(0, src + so, n));
                assert_memory_equal(dst + 8 + dof, src + so, n);
                for (size_t i = 0; i < 8 + dof; i++)
                    assert_int_equal(dst[i], 0xa5);
                for (size_t i = 8 + dof + n; i < cap + 32; i++)
                    assert_int_equal(dst[i], 0xa5);
            }
    free(src);
    free(dst);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_value),
        cmocka_unit_test(test_random_buffers),
        cmocka_unit_test(test_large_buffers),
        cmocka_unit_test(test_bit_flip_detected),
        cmocka_unit_test(test_copy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
