/* Profile files: a policy in a versioned little-endian binary format with a
 * CRC32C trailer (kvtier-profile(5)). The parser trusts nothing: sizes are
 * checked against the buffer before anything is allocated, the checksum
 * before any field is read, and every field before a policy is built.
 *
 *   0   8  magic "KVTPROF\0"
 *   8   4  version (2; 1 is still read)
 *  12   4  header bytes (64)
 *  16   4  record bytes (32)
 *  20   4  records (n_layers * n_kv_heads)
 *  24  24  n_layers, n_kv_heads, n_q_heads, head_dim, page_tokens, dtype
 *  48  16  reserved, zero
 *  64  32  per head, layer-major: class, top_k_pages, window, sink_pages,
 *          local_pages, rerank_interval, rerank_similarity (an IEEE-754
 *          binary32, -1 .. 1; version 2), reserved (zero). Version 1 has
 *          zero in place of rerank_similarity and reads as
 *          KVT_RERANK_SIMILARITY_DEFAULT.
 * end   4  CRC32C of every byte before it (in every version: the checksum is
 *          checked before the version is read)
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "policy_int.h"

#define KVT__PROF_MAGIC "KVTPROF\0"
#define KVT__PROF_VERSION 2u
#define KVT__PROF_HEADER 64u
#define KVT__PROF_RECORD 32u
#define KVT__PROF_TRAILER 4u
/* The largest valid file: 4096 x 4096 heads. */
#define KVT__PROF_MAX_BYTES \
    ((uint64_t)KVT__PROF_HEADER + (uint64_t)KVT__PROF_RECORD * 4096u * 4096u + KVT__PROF_TRAILER)

static void kvt__put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t kvt__get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

KVT_API int kvt_policy_save_buffer(const kvt_policy *pol, void *buf, size_t cap,
                                   size_t *needed)
{
    KVT__CHECK_NULL(pol);
    KVT__CHECK_NULL(needed);
    const size_t size = KVT__PROF_HEADER + (size_t)KVT__PROF_RECORD * pol->n + KVT__PROF_TRAILER;
    *needed = size;
    if (!buf && cap == 0)
        return 0;
    KVT__CHECK_NULL(buf);
    if (cap < size)
        return kvt__err(KVT_ERANGE, "cap: %zu bytes, the profile needs %zu", cap, size);
    uint8_t *b = buf;
    memset(b, 0, size);
    memcpy(b, KVT__PROF_MAGIC, 8);
    kvt__put32(b + 8, KVT__PROF_VERSION);
    kvt__put32(b + 12, KVT__PROF_HEADER);
    kvt__put32(b + 16, KVT__PROF_RECORD);
    kvt__put32(b + 20, pol->n);
    const kvt_geometry *g = &pol->g;
    const uint32_t geo[6] = {g->n_layers, g->n_kv_heads, g->n_q_heads,
                             g->head_dim, g->page_tokens, g->dtype};
    for (int i = 0; i < 6; i++)
        kvt__put32(b + 24 + 4 * i, geo[i]);
    for (uint32_t i = 0; i < pol->n; i++) {
        uint8_t *r = b + KVT__PROF_HEADER + (size_t)KVT__PROF_RECORD * i;
        kvt__put32(r, pol->cls[i]);
        kvt__put32(r + 4, pol->k[i]);
        kvt__put32(r + 8, pol->window[i]);
        kvt__put32(r + 12, pol->sink[i]);
        kvt__put32(r + 16, pol->local[i]);
        kvt__put32(r + 20, pol->interval[i]);
        uint32_t fb;
        memcpy(&fb, &pol->sim[i], sizeof fb);
        kvt__put32(r + 24, fb);
    }
    kvt__put32(b + size - KVT__PROF_TRAILER, kvt__crc32c(0, b, size - KVT__PROF_TRAILER));
    return 0;
}

static int kvt__zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

KVT_API int kvt_policy_load_buffer(const void *data, size_t size, const kvt_geometry *expect,
                                   kvt_policy **out)
{
    KVT__CHECK_NULL(out);
    *out = NULL;
    if (size)
        KVT__CHECK_NULL(data);
    const uint8_t *b = data;
    if (size < 8)
        return kvt__err(KVT_ECORRUPT, "data: %zu bytes, truncated before the end of the "
                        "magic", size);
    if (memcmp(b, KVT__PROF_MAGIC, 8) != 0)
        return kvt__err(KVT_ECORRUPT, "data: not a kvtier profile (bad magic)");
    if (size < 12 + KVT__PROF_TRAILER)
        return kvt__err(KVT_ECORRUPT, "data: %zu bytes, truncated before the version and "
                        "checksum", size);
    const uint32_t crc = kvt__get32(b + size - KVT__PROF_TRAILER);
    const uint32_t calc = kvt__crc32c(0, b, size - KVT__PROF_TRAILER);
    if (crc != calc)
        return kvt__err(KVT_ECORRUPT, "data: checksum mismatch (stored 0x%08x, computed "
                        "0x%08x over %zu bytes): the profile is damaged or truncated", crc,
                        calc, size - KVT__PROF_TRAILER);
    const uint32_t version = kvt__get32(b + 8);
    if (version == 0)
        return kvt__err(KVT_ECORRUPT, "data: format version 0 does not exist");
    if (version > KVT__PROF_VERSION)
        return kvt__err(KVT_EINVAL, "data: format version %u is newer than the version %u "
                        "this library reads", version, KVT__PROF_VERSION);
    if (size < KVT__PROF_HEADER + KVT__PROF_TRAILER)
        return kvt__err(KVT_ECORRUPT, "data: %zu bytes, shorter than the %u-byte header and "
                        "checksum", size, KVT__PROF_HEADER + KVT__PROF_TRAILER);
    const uint32_t hbytes = kvt__get32(b + 12), rbytes = kvt__get32(b + 16);
    const uint32_t n = kvt__get32(b + 20);
    if (hbytes != KVT__PROF_HEADER)
        return kvt__err(KVT_ECORRUPT, "data: header size %u, version %u has %u", hbytes,
                        version, KVT__PROF_HEADER);
    if (rbytes != KVT__PROF_RECORD)
        return kvt__err(KVT_ECORRUPT, "data: record size %u, version %u has %u", rbytes,
                        version, KVT__PROF_RECORD);
    const uint64_t want = (uint64_t)KVT__PROF_HEADER + (uint64_t)KVT__PROF_RECORD * n +
                          KVT__PROF_TRAILER;
    if (want != size)
        return kvt__err(KVT_ECORRUPT, "data: %zu bytes, the header describes %u records in "
                        "%llu bytes", size, n, (unsigned long long)want);
    if (!kvt__zero(b + 48, 16))
        return kvt__err(KVT_ECORRUPT, "data: reserved header bytes are not zero");
    kvt_geometry fg;
    memset(&fg, 0, sizeof fg);
    fg.n_layers = kvt__get32(b + 24);
    fg.n_kv_heads = kvt__get32(b + 28);
    fg.n_q_heads = kvt__get32(b + 32);
    fg.head_dim = kvt__get32(b + 36);
    fg.page_tokens = kvt__get32(b + 40);
    fg.dtype = kvt__get32(b + 44);
    kvt_geometry rg;
    if (kvt__geometry_resolve(&fg, &rg)) {
        char why[256];
        snprintf(why, sizeof why, "%s", kvt_last_error());
        return kvt__err(KVT_ECORRUPT, "data: the profile's geometry is invalid (%s)", why);
    }
    if (fg.n_q_heads == 0 || fg.page_tokens == 0 || fg.dtype == 0)
        return kvt__err(KVT_ECORRUPT, "data: the profile's geometry leaves a field at its "
                        "default (0); profiles store resolved geometries");
    if ((uint64_t)fg.n_layers * fg.n_kv_heads != n)
        return kvt__err(KVT_ECORRUPT, "data: %u records, the geometry has %u x %u heads", n,
                        fg.n_layers, fg.n_kv_heads);
    if (expect) {
        kvt_geometry eg;
        char why[256];
        if (kvt__geometry_resolve(expect, &eg)) {
            snprintf(why, sizeof why, "%s", kvt_last_error());
            return kvt__err(KVT_EINVAL, "expect: %s", why);
        }
        int rc = kvt__geometry_same(&rg, &eg, "expect", "the profile", "the expected");
        if (rc)
            return rc;
    }
    uint32_t *mem = malloc((size_t)n * 7u * sizeof *mem);
    if (!mem)
        return kvt__err(KVT_ENOMEM, "kvt_policy_load: cannot allocate %u head records", n);
    float *sim = (float *)(void *)(mem + 6u * (size_t)n);
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *r = b + KVT__PROF_HEADER + (size_t)KVT__PROF_RECORD * i;
        /* Version 1: the threshold's bytes are reserved (zero). */
        const uint32_t from = version >= 2 ? 28u : 24u;
        if (!kvt__zero(r + from, 32u - from)) {
            free(mem);
            return kvt__err(KVT_ECORRUPT, "data: record %u (layer %u, kv_head %u): reserved "
                            "fields are not zero", i, i / fg.n_kv_heads, i % fg.n_kv_heads);
        }
        for (uint32_t f = 0; f < 6; f++)
            mem[(size_t)f * n + i] = kvt__get32(r + 4 * f);
        if (version >= 2) {
            const uint32_t fb = kvt__get32(r + 24);
            memcpy(&sim[i], &fb, sizeof fb);
        } else {
            sim[i] = KVT_RERANK_SIMILARITY_DEFAULT;
        }
    }
    int rc = kvt__policy_build(out, &rg, mem, mem + n, mem + 2u * (size_t)n,
                               mem + 3u * (size_t)n, mem + 4u * (size_t)n, mem + 5u * (size_t)n,
                               sim, "data: ", KVT_ECORRUPT);
    free(mem);
    return rc;
}

KVT_API int kvt_policy_save(const kvt_policy *pol, const char *path)
{
    KVT__CHECK_NULL(pol);
    KVT__CHECK_NULL(path);
    size_t size;
    int rc = kvt_policy_save_buffer(pol, NULL, 0, &size);
    if (rc)
        return rc;
    uint8_t *b = malloc(size);
    if (!b)
        return kvt__err(KVT_ENOMEM, "kvt_policy_save: cannot allocate %zu bytes", size);
    if ((rc = kvt_policy_save_buffer(pol, b, size, &size))) {
        free(b);
        return rc;
    }
    const size_t plen = strlen(path);
    char *tmp = malloc(plen + 32);
    if (!tmp) {
        free(b);
        return kvt__err(KVT_ENOMEM, "kvt_policy_save: cannot allocate a path");
    }
    snprintf(tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = kvt__err(KVT_EIO, "path: cannot create '%s': %s", tmp, strerror(errno));
        goto out;
    }
    for (size_t done = 0; done < size;) {
        ssize_t w = write(fd, b + done, size - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            rc = kvt__err(KVT_EIO, "path: writing '%s': %s", tmp,
                          w < 0 ? strerror(errno) : "no progress");
            break;
        }
        done += (size_t)w;
    }
    if (!rc && fsync(fd) != 0)
        rc = kvt__err(KVT_EIO, "path: fsync of '%s': %s", tmp, strerror(errno));
    if (close(fd) != 0 && !rc)
        rc = kvt__err(KVT_EIO, "path: closing '%s': %s", tmp, strerror(errno));
    if (!rc && rename(tmp, path) != 0)
        rc = kvt__err(KVT_EIO, "path: renaming '%s' to '%s': %s", tmp, path, strerror(errno));
    if (rc)
        unlink(tmp);
out:
    free(tmp);
    free(b);
    return rc;
}

KVT_API int kvt_policy_load(const char *path, const kvt_geometry *expect, kvt_policy **out)
{
    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvt__err(errno == ENOENT ? KVT_ENOENT : KVT_EIO, "path: cannot open '%s': %s",
                        path, strerror(errno));
    struct stat sb;
    int rc = 0;
    uint8_t *b = NULL;
    if (fstat(fd, &sb) != 0) {
        rc = kvt__err(KVT_EIO, "path: cannot stat '%s': %s", path, strerror(errno));
        goto out;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = kvt__err(KVT_EINVAL, "path: '%s' is not a regular file", path);
        goto out;
    }
    if ((uint64_t)sb.st_size > KVT__PROF_MAX_BYTES) {
        rc = kvt__err(KVT_ECORRUPT, "path: '%s' has %lld bytes, more than any profile",
                      path, (long long)sb.st_size);
        goto out;
    }
    const size_t size = (size_t)sb.st_size;
    b = malloc(size ? size : 1u);
    if (!b) {
        rc = kvt__err(KVT_ENOMEM, "kvt_policy_load: cannot allocate %zu bytes", size);
        goto out;
    }
    size_t got = 0;
    while (got < size) {
        ssize_t r = read(fd, b + got, size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = kvt__err(KVT_EIO, "path: reading '%s': %s", path, strerror(errno));
            goto out;
        }
        if (r == 0)
            break; /* shrank under us: parse what is there */
        got += (size_t)r;
    }
    rc = kvt_policy_load_buffer(b, got, expect, out);
    if (rc) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvt_last_error());
        kvt__err(rc, "%s (file '%s')", why, path);
    }
out:
    free(b);
    close(fd);
    return rc;
}
