/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every
 * page written to disk, of profile files and of the remote tier's values.
 * The SSE4.2 crc32 instruction, in three streams over large buffers;
 * machines without it use slicing-by-8 tables
 * built once (a pure function of the polynomial, so the race to build them
 * is benign and the result identical). */
#include <pthread.h>
#include <string.h>

#include "base.h"

#define KVT__CRC32C_POLY 0x82F63B78u

static uint32_t kvt__crc_tab[8][256];
static _Atomic int kvt__crc_tab_ready = 0;

static void kvt__crc_tab_build(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ ((c & 1u) ? KVT__CRC32C_POLY : 0u);
        kvt__crc_tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            kvt__crc_tab[t][i] = (kvt__crc_tab[t - 1][i] >> 8) ^
                                 kvt__crc_tab[0][kvt__crc_tab[t - 1][i] & 0xffu];
    kvt__crc_tab_ready = 1;
}

uint32_t kvt__crc32c_sw(uint32_t crc, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    if (!kvt__crc_tab_ready)
        kvt__crc_tab_build();
    crc = ~crc;
    while (n && ((uintptr_t)p & 7u)) {
        crc = (crc >> 8) ^ kvt__crc_tab[0][(crc ^ *p++) & 0xffu];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc; /* little-endian: the CRC folds into the low four bytes */
        crc = kvt__crc_tab[7][w & 0xff] ^ kvt__crc_tab[6][(w >> 8) & 0xff] ^
              kvt__crc_tab[5][(w >> 16) & 0xff] ^ kvt__crc_tab[4][(w >> 24) & 0xff] ^
              kvt__crc_tab[3][(w >> 32) & 0xff] ^ kvt__crc_tab[2][(w >> 40) & 0xff] ^
              kvt__crc_tab[1][(w >> 48) & 0xff] ^ kvt__crc_tab[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = (crc >> 8) ^ kvt__crc_tab[0][(crc ^ *p++) & 0xffu];
    return ~crc;
}

#if defined(__x86_64__)
#include <cpuid.h>
/* The crc32 instruction has a latency of 3 cycles and a throughput of 1:
 * three independent streams over three blocks of `blk` bytes keep it busy,
 * and the three results are joined by the register's linear algebra - over
 * zeros the register evolves as a fixed linear map, so a block's register
 * carried over the next n bytes is M^(8n) applied to it, and
 * crc(x, A|B) = M^|B| crc(x, A) ^ crc(0, B). A shift table applies
 * M^(8 x blk) with four byte lookups; it is built once from the
 * instruction itself. Two block sizes: 4 KiB for long buffers (a join per
 * 12 KiB), 512 B for what is left, so an 8 KiB disk page runs as three
 * streams too (one stream: 0.83 us hot on this VM; three: see
 * RESULTS.md). Under 1.5 KiB left: one stream. */
#define KVT__CRC_BLK   4096u
#define KVT__CRC_BLK_S 512u
static uint32_t kvt__crc_shift_tab[2][4][256];
static pthread_once_t kvt__crc_shift_once = PTHREAD_ONCE_INIT;

__attribute__((target("sse4.2"))) static uint32_t kvt__crc_zeros(uint32_t c, size_t n)
{
    uint64_t x = c;
    for (size_t i = 0; i < n; i += 8)
        x = __builtin_ia32_crc32di(x, 0);
    return (uint32_t)x;
}

__attribute__((target("sse4.2"))) static void kvt__crc_shift_build(void)
{
    for (uint32_t k = 0; k < 4; k++)
        for (uint32_t v = 0; v < 256; v++) {
            kvt__crc_shift_tab[0][k][v] = kvt__crc_zeros(v << (8u * k), KVT__CRC_BLK);
            kvt__crc_shift_tab[1][k][v] = kvt__crc_zeros(v << (8u * k), KVT__CRC_BLK_S);
        }
}

static inline uint32_t kvt__crc_shift(const uint32_t (*t)[256], uint32_t c)
{
    return t[0][c & 0xffu] ^ t[1][(c >> 8) & 0xffu] ^ t[2][(c >> 16) & 0xffu] ^ t[3][c >> 24];
}

/* Three streams over blocks of `blk` bytes while 3 x blk remain; `blk` is a
 * constant at each (inlined) call. With `dst` the words read are stored
 * there too (NULL: checked only; a constant, so the stores fold away). */
__attribute__((target("sse4.2"), always_inline)) static inline uint64_t
kvt__crc3(uint64_t c, const uint8_t **pp, uint8_t **dp, size_t *np, size_t blk,
          const uint32_t (*t)[256])
{
    const uint8_t *p = *pp;
    uint8_t *q = dp ? *dp : NULL;
    size_t n = *np;
    while (n >= 3u * blk) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < blk; i += 8) {
            uint64_t w0, w1, w2;
            memcpy(&w0, p + i, 8);
            memcpy(&w1, p + blk + i, 8);
            memcpy(&w2, p + 2u * blk + i, 8);
            c = __builtin_ia32_crc32di(c, w0);
            c1 = __builtin_ia32_crc32di(c1, w1);
            c2 = __builtin_ia32_crc32di(c2, w2);
            if (dp) {
                memcpy(q + i, &w0, 8);
                memcpy(q + blk + i, &w1, 8);
                memcpy(q + 2u * blk + i, &w2, 8);
            }
        }
        c = kvt__crc_shift(t, kvt__crc_shift(t, (uint32_t)c) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3u * blk;
        if (dp)
            q += 3u * blk;
        n -= 3u * blk;
    }
    *pp = p;
    if (dp)
        *dp = q;
    *np = n;
    return c;
}

__attribute__((target("sse4.2"), always_inline)) static inline uint32_t
kvt__crc32c_hw_impl(uint32_t crc, const void *buf, size_t n, uint8_t *dst)
{
    const uint8_t *p = buf;
    uint8_t **dp = dst ? &dst : NULL;
    uint64_t c = ~crc;
    while (n && ((uintptr_t)p & 7u)) {
        if (dst)
            *dst++ = *p;
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    if (n >= 3u * KVT__CRC_BLK_S) {
        pthread_once(&kvt__crc_shift_once, kvt__crc_shift_build);
        c = kvt__crc3(c, &p, dp, &n, KVT__CRC_BLK, kvt__crc_shift_tab[0]);
        c = kvt__crc3(c, &p, dp, &n, KVT__CRC_BLK_S, kvt__crc_shift_tab[1]);
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        if (dst) {
            memcpy(dst, &w, 8);
            dst += 8;
        }
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) {
        if (dst)
            *dst++ = *p;
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    }
    return ~(uint32_t)c;
}

__attribute__((target("sse4.2"))) static uint32_t kvt__crc32c_hw(uint32_t crc, const void *buf,
                                                                 size_t n)
{
    return kvt__crc32c_hw_impl(crc, buf, n, NULL);
}

__attribute__((target("sse4.2"))) static uint32_t kvt__crc32c_copy_hw(void *dst, const void *src,
                                                                      size_t n)
{
    return kvt__crc32c_hw_impl(0, src, n, dst);
}

static int kvt__has_sse42(void)
{
    static _Atomic int cached = -1;
    int v = cached;
    if (v < 0) {
        unsigned a, b, c, d;
        v = __get_cpuid(1, &a, &b, &c, &d) ? (int)((c >> 20) & 1u) : 0;
        cached = v;
    }
    return v;
}

uint32_t kvt__crc32c(uint32_t crc, const void *buf, size_t n)
{
    return kvt__has_sse42() ? kvt__crc32c_hw(crc, buf, n) : kvt__crc32c_sw(crc, buf, n);
}

uint32_t kvt__crc32c_copy(void *dst, const void *src, size_t n)
{
    if (kvt__has_sse42())
        return kvt__crc32c_copy_hw(dst, src, n);
    memcpy(dst, src, n);
    return kvt__crc32c_sw(0, dst, n);
}
#else
uint32_t kvt__crc32c(uint32_t crc, const void *buf, size_t n)
{
    return kvt__crc32c_sw(crc, buf, n);
}

uint32_t kvt__crc32c_copy(void *dst, const void *src, size_t n)
{
    memcpy(dst, src, n);
    return kvt__crc32c_sw(0, dst, n);
}
#endif
