/* The remote tier's first piece (issue 26, in progress): Redis Cluster's
 * key slot of a key - CRC16 (XMODEM: polynomial 0x1021, initial value 0,
 * no reflection) of the key, or of its hash tag (the bytes between the
 * first '{' and the first '}' after it, when that is not empty), modulo
 * 16384 - as the cluster specification defines it, so that the client
 * routes each key to the node that owns its slot, and keys of one chunk
 * can share a tag to land on one node. */
#include "tier.h"

uint16_t kvt__redis_crc16(const void *buf, size_t len)
{
    /* Bit at a time: keys are short, and no table means no shared state. */
    const uint8_t *p = buf;
    uint32_t c = 0;
    for (size_t i = 0; i < len; i++) {
        c ^= (uint32_t)p[i] << 8;
        for (int b = 0; b < 8; b++)
            c = (c & 0x8000u) ? ((c << 1) ^ 0x1021u) & 0xffffu : (c << 1) & 0xffffu;
    }
    return (uint16_t)c;
}

uint32_t kvt__redis_slot(const void *key, size_t len)
{
    const char *k = key;
    size_t open = 0;
    while (open < len && k[open] != '{')
        open++;
    if (open < len) {
        size_t close = open + 1;
        while (close < len && k[close] != '}')
            close++;
        if (close < len && close > open + 1) /* a non-empty tag */
            return kvt__redis_crc16(k + open + 1, close - open - 1) & 16383u;
    }
    return kvt__redis_crc16(k, len) & 16383u;
}
