/* Redis Cluster key slots (lib/tier/rslot.c), against independent
 * references: CRC16/XMODEM's published check value and a table-driven
 * CRC16 built here from the polynomial; the cluster specification's
 * hash-tag rules, case by case. With an argument list of keys (one per
 * line on stdin, `-`), prints each key's slot instead: tests/
 * test_redis_slot.sh compares them with a redis-server's CLUSTER KEYSLOT. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "internal.h"
#include "../tier/tier.h"

/* A table-driven CRC16/XMODEM (the library computes bit by bit). */
static uint16_t crc16_table(const uint8_t *p, size_t n)
{
    static uint16_t tab[256];
    if (!tab[1])
        for (unsigned v = 0; v < 256; v++) {
            unsigned c = v << 8;
            for (int b = 0; b < 8; b++)
                c = (c & 0x8000u) ? (c << 1) ^ 0x1021u : c << 1;
            tab[v] = (uint16_t)c;
        }
    unsigned c = 0;
    for (size_t i = 0; i < n; i++)
        c = ((c << 8) ^ tab[((c >> 8) ^ p[i]) & 0xffu]) & 0xffffu;
    return (uint16_t)c;
}

static uint32_t slot_of(const char *s)
{
    return kvt__redis_slot(s, strlen(s));
}

static void test_crc16(void **state)
{
    (void)state;
    assert_int_equal(kvt__redis_crc16("123456789", 9), 0x31c3); /* the check value */
    assert_int_equal(kvt__redis_crc16("", 0), 0);
    tu_rng r = {16};
    uint8_t buf[300];
    for (int t = 0; t < 2000; t++) {
        const size_t n = tu_below(&r, sizeof buf + 1);
        for (size_t i = 0; i < n; i++)
            buf[i] = (uint8_t)tu_next(&r);
        assert_int_equal(kvt__redis_crc16(buf, n), crc16_table(buf, n));
    }
}

static void test_hash_tags(void **state)
{
    (void)state;
    const uint32_t user = kvt__redis_crc16("user1000", 8) & 16383u;
    assert_int_equal(slot_of("{user1000}.following"), user);
    assert_int_equal(slot_of("{user1000}.followers"), user);
    assert_int_equal(slot_of("foo{user1000}bar"), user);
    assert_int_equal(slot_of("foo{user1000}{bar}"), user);      /* the first tag only */
    assert_int_equal(slot_of("foo{{bar}}zap"), kvt__redis_crc16("{bar", 4) & 16383u);
    assert_int_equal(slot_of("foo{}{bar}"), kvt__redis_crc16("foo{}{bar}", 10) & 16383u);
    assert_int_equal(slot_of("foo{bar"), kvt__redis_crc16("foo{bar", 7) & 16383u);
    assert_int_equal(slot_of("foo}bar{"), kvt__redis_crc16("foo}bar{", 8) & 16383u);
    assert_int_equal(slot_of("{}"), kvt__redis_crc16("{}", 2) & 16383u);
    for (int i = 0; i < 1000; i++) {
        char k[32];
        snprintf(k, sizeof k, "key:%d", i);
        assert_true(slot_of(k) < 16384u);
    }
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "-")) { /* slots of the keys on stdin */
        char line[4096];
        while (fgets(line, sizeof line, stdin)) {
            size_t n = strcspn(line, "\n");
            printf("%u\n", kvt__redis_slot(line, n));
        }
        return 0;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc16),
        cmocka_unit_test(test_hash_tags),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
