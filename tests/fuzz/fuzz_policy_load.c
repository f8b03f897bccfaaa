/* libFuzzer target for the profile parser (kvt_policy_load_buffer).
 *
 * Each input is parsed twice: as given, and with its last four bytes
 * replaced by the correct CRC32C, so that mutations reach the header and
 * record checks behind the checksum. Whatever parses must save back to the
 * same bytes (a version 1 input: as version 2, the default threshold in
 * every record) and reload under its own geometry; whatever fails must fail
 * with KVT_ECORRUPT, KVT_EINVAL or KVT_ENOMEM and leave *out NULL.
 * Built and run by `make fuzz` (clang, -fsanitize=fuzzer,address,undefined)
 * against the static library, which also gives it the internal CRC32C. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(const uint8_t *data, size_t size)
{
    kvt_policy *p = (kvt_policy *)(uintptr_t)1;
    int rc = kvt_policy_load_buffer(data, size, NULL, &p);
    if (rc) {
        if (p != NULL || (rc != KVT_ECORRUPT && rc != KVT_EINVAL && rc != KVT_ENOMEM))
            abort();
        return;
    }
    size_t need = 0;
    if (kvt_policy_save_buffer(p, NULL, 0, &need) || need != size)
        abort();
    uint8_t *b = malloc(need), *want = malloc(size);
    if (!b || !want)
        abort();
    memcpy(want, data, size);
    if (data[8] == 1) {
        /* Version 1 saves as version 2: each head record's threshold (the
         * default) in its bytes 24..27, the version and the checksum. */
        const float t = KVT_RERANK_SIMILARITY_DEFAULT;
        uint32_t tb;
        memcpy(&tb, &t, 4);
        for (size_t r = 64; r + 32 + 4 <= size; r += 32)
            for (int i = 0; i < 4; i++)
                want[r + 24 + i] = (uint8_t)(tb >> (8 * i));
        want[8] = 2;
        const uint32_t crc = kvt__crc32c(0, want, size - 4);
        for (int i = 0; i < 4; i++)
            want[size - 4 + i] = (uint8_t)(crc >> (8 * i));
    }
    if (kvt_policy_save_buffer(p, b, need, &need) || memcmp(b, want, size) != 0)
        abort();
    free(b);
    free(want);
    kvt_geometry g;
    kvt_policy *q = NULL;
    if (kvt_policy_geometry_get(p, &g) || kvt_policy_load_buffer(data, size, &g, &q))
        abort();
    kvt_policy_destroy(q);
    char text[256];
    uint64_t dev = 0;
    if (kvt_policy_describe(p, 32768, text, sizeof text, NULL) ||
        kvt_policy_device_pages_get(p, 32768, &dev, NULL))
        abort();
    kvt_policy_destroy(p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check(data, size);
    if (size >= 4 && size <= (1u << 20)) {
        uint8_t *c = malloc(size);
        if (!c)
            return 0;
        memcpy(c, data, size);
        const uint32_t crc = kvt__crc32c(0, c, size - 4);
        for (int i = 0; i < 4; i++)
            c[size - 4 + i] = (uint8_t)(crc >> (8 * i));
        check(c, size);
        free(c);
    }
    return 0;
}
