/* The remote tier's values (lib/tier/remote.h): the 128-bit chained key of
 * a page position, key names, and the self-describing, CRC32C-checked value
 * of one page position in every (layer, KV head):
 *
 *   0  magic "KVTRV1\0\0"          40 page          64 key[2]
 *   8  version (1)                 44 reserved (0)  80 parent key[2]
 *  12  header_bytes (96 + 4 P)     48 salt          96 ids[P]
 *  16  L, H, D, P, dtype, elem     56 namespace     then L * H blocks (K rows,
 *                                                   V rows), then CRC32C of it all
 *
 * Little-endian u32/u64 (the only hosts the library builds for). A value
 * is accepted only when every field is the one the reader expects: the
 * namespace (the model, the geometry, the dtype), the salt, the position,
 * its key and its parent's key, and the P token ids. */
#include <stdio.h>
#include <string.h>

#include "tier.h"

static const char kvt__rv_magic[8] = {'K', 'V', 'T', 'R', 'V', '1', 0, 0};
#define KVT__RV_VERSION 1u

static inline uint64_t kvt__rmix(uint64_t h, uint64_t m)
{
    h ^= h >> 31;
    h *= m;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return h;
}

int kvt__rgeom_init(kvt__rgeom *g, uint32_t L, uint32_t H, uint32_t D, uint32_t P,
                    uint32_t dtype, uint32_t elem, uint64_t block_bytes, const char *fingerprint,
                    const char *key_prefix)
{
    memset(g, 0, sizeof *g);
    g->L = L;
    g->H = H;
    g->D = D;
    g->P = P;
    g->dtype = dtype;
    g->elem = elem;
    g->block_bytes = block_bytes;
    const char *kp = key_prefix ? key_prefix : "kvt";
    const size_t n = strlen(kp);
    if (!n || n >= sizeof g->prefix)
        return kvt__err(KVT_EINVAL, "remote->key_prefix: must be 1..%zu characters (is %zu)",
                        sizeof g->prefix - 1u, n);
    for (size_t i = 0; i < n; i++)
        if (kp[i] <= ' ' || kp[i] == 0x7f || kp[i] == '{' || kp[i] == '}')
            return kvt__err(KVT_EINVAL, "remote->key_prefix: character %zu (0x%02x) is a space, "
                            "a control character or a hash-tag brace", i, (unsigned char)kp[i]);
    memcpy(g->prefix, kp, n + 1u);
    /* FNV-1a over the fingerprint, then the geometry mixed in. */
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *q = (const unsigned char *)fingerprint; *q; q++)
        h = (h ^ *q) * 0x100000001b3ull;
    const uint32_t geo[6] = {L, H, D, P, dtype, elem};
    for (int i = 0; i < 6; i++)
        h = kvt__rmix(h ^ geo[i], 0x94d049bb133111ebull) + 0x9e3779b97f4a7c15ull;
    g->ns = h;
    return 0;
}

kvt__rkey kvt__rkey_seed(const kvt__rgeom *g)
{
    kvt__rkey k = {{kvt__rmix(g->ns ^ 0x243f6a8885a308d3ull, 0x94d049bb133111ebull),
                    kvt__rmix(g->ns ^ 0x13198a2e03707344ull, 0xd6e8feb86659fd93ull)}};
    return k;
}

/* Two lanes with different multipliers, each over (prev, salt, ids). Not a
 * cryptographic hash: accidental collisions are out of reach (128 bits),
 * crafted ones are not - the salt is what isolates tenants. */
kvt__rkey kvt__rkey_next(const kvt__rgeom *g, kvt__rkey prev, const uint32_t *ids,
                         uint64_t salt)
{
    uint64_t a = kvt__rmix(prev.h[0] ^ salt, 0x94d049bb133111ebull);
    uint64_t b = kvt__rmix(prev.h[1] + salt * 0x9e3779b97f4a7c15ull, 0xd6e8feb86659fd93ull);
    for (uint32_t i = 0; i < g->P; i++) {
        a = kvt__rmix(a ^ (ids[i] + ((uint64_t)i << 32)), 0x94d049bb133111ebull);
        b = kvt__rmix(b + ids[i] * 0xff51afd7ed558ccdull + i, 0xd6e8feb86659fd93ull);
    }
    kvt__rkey k = {{a, b ^ a}};
    return k;
}

size_t kvt__rkey_name(const kvt__rgeom *g, kvt__rkey k, char *out)
{
    int n = snprintf(out, KVT__RKEY_MAX, "%s:%016llx:%016llx%016llx", g->prefix,
                     (unsigned long long)g->ns, (unsigned long long)k.h[0],
                     (unsigned long long)k.h[1]);
    return (size_t)n;
}

size_t kvt__rvalue_bytes(const kvt__rgeom *g)
{
    return KVT__RVALUE_HDR + 4u * (size_t)g->P + (size_t)g->L * g->H * g->block_bytes + 4u;
}

static void kvt__put32(uint8_t *v, size_t at, uint32_t x)
{
    memcpy(v + at, &x, 4);
}
static void kvt__put64(uint8_t *v, size_t at, uint64_t x)
{
    memcpy(v + at, &x, 8);
}
static uint32_t kvt__get32(const uint8_t *v, size_t at)
{
    uint32_t x;
    memcpy(&x, v + at, 4);
    return x;
}
static uint64_t kvt__get64(const uint8_t *v, size_t at)
{
    uint64_t x;
    memcpy(&x, v + at, 8);
    return x;
}

void kvt__rvalue_header(const kvt__rgeom *g, uint8_t *v, uint32_t page, uint64_t salt,
                        kvt__rkey k, kvt__rkey parent, const uint32_t *ids)
{
    memcpy(v, kvt__rv_magic, 8);
    kvt__put32(v, 8, KVT__RV_VERSION);
    kvt__put32(v, 12, KVT__RVALUE_HDR + 4u * g->P);
    const uint32_t geo[6] = {g->L, g->H, g->D, g->P, g->dtype, g->elem};
    for (int i = 0; i < 6; i++)
        kvt__put32(v, 16u + 4u * (size_t)i, geo[i]);
    kvt__put32(v, 40, page);
    kvt__put32(v, 44, 0);
    kvt__put64(v, 48, salt);
    kvt__put64(v, 56, g->ns);
    kvt__put64(v, 64, k.h[0]);
    kvt__put64(v, 72, k.h[1]);
    kvt__put64(v, 80, parent.h[0]);
    kvt__put64(v, 88, parent.h[1]);
    memcpy(v + KVT__RVALUE_HDR, ids, 4u * (size_t)g->P);
}

void kvt__rvalue_seal(const kvt__rgeom *g, uint8_t *v)
{
    const size_t n = kvt__rvalue_bytes(g) - 4u;
    kvt__put32(v, n, kvt__crc32c(0, v, n));
}

#define KVT__RV_WHY(...) (why ? snprintf(why, 160, __VA_ARGS__) : 0, KVT_ECORRUPT)

int kvt__rvalue_check(const kvt__rgeom *g, const uint8_t *v, size_t len, uint32_t page,
                      uint64_t salt, kvt__rkey k, kvt__rkey parent, const uint32_t *ids,
                      char *why)
{
    const size_t want = kvt__rvalue_bytes(g);
    if (len != want)
        return KVT__RV_WHY("%zu bytes where a value has %zu", len, want);
    if (memcmp(v, kvt__rv_magic, 8) || kvt__get32(v, 8) != KVT__RV_VERSION ||
        kvt__get32(v, 12) != KVT__RVALUE_HDR + 4u * g->P)
        return KVT__RV_WHY("not a kvtier value of version %u (magic, version or header size)",
                           KVT__RV_VERSION);
    const uint32_t crc = kvt__get32(v, want - 4u), got = kvt__crc32c(0, v, want - 4u);
    if (crc != got)
        return KVT__RV_WHY("CRC32C mismatch (stored %08x, computed %08x)", crc, got);
    const uint32_t geo[6] = {g->L, g->H, g->D, g->P, g->dtype, g->elem};
    for (int i = 0; i < 6; i++)
        if (kvt__get32(v, 16u + 4u * (size_t)i) != geo[i])
            return KVT__RV_WHY("another geometry or dtype (field %d is %u, not %u)", i,
                               kvt__get32(v, 16u + 4u * (size_t)i), geo[i]);
    if (kvt__get64(v, 56) != g->ns)
        return KVT__RV_WHY("another namespace (model fingerprint)");
    if (kvt__get32(v, 40) != page || kvt__get64(v, 48) != salt)
        return KVT__RV_WHY("page %u salt %016llx where page %u salt %016llx was asked for",
                           kvt__get32(v, 40), (unsigned long long)kvt__get64(v, 48), page,
                           (unsigned long long)salt);
    if (kvt__get64(v, 64) != k.h[0] || kvt__get64(v, 72) != k.h[1] ||
        kvt__get64(v, 80) != parent.h[0] || kvt__get64(v, 88) != parent.h[1])
        return KVT__RV_WHY("page %u: another chain (key or parent key differs)", page);
    if (memcmp(v + KVT__RVALUE_HDR, ids, 4u * (size_t)g->P))
        return KVT__RV_WHY("page %u: other token ids", page);
    return 0;
}
