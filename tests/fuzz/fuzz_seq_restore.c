/* libFuzzer target for the sequence stream reader (kvt_seq_restore,
 * kvtier-seq(5)).
 *
 * One small pool (2 layers, 2 KV heads, head_dim 8, pages of 8 tokens, f16)
 * lives for the whole run. Each input is restored twice: as given, and
 * with every checksum it holds recomputed (header, page records, trailer,
 * walking the format as kvtier-seq(5) describes it), so that mutations
 * reach the checks behind the checksums. Whatever restores must save back
 * to the same records and trailer, byte for byte, and release cleanly;
 * whatever fails must fail with one of the documented codes and leave *out
 * KVT_SEQ_NONE. Either way the pool must pass kvt_pool_check and hold no
 * sequence afterwards. Built and run by `make fuzz` against the static
 * library, which also gives it the internal CRC32C. The seed corpus is
 * written by gen_seq_corpus.c at fuzz time (no binary files in the tree). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FZ_L 2u
#define FZ_H 2u
#define FZ_D 8u
#define FZ_P 8u
#define FZ_HDR (56u + 4u * FZ_L + 4u)

static kvt_pool *g_pool;

typedef struct {
    const uint8_t *b;
    size_t n, at;
} rd;

static int64_t rd_fn(void *ctx, void *buf, size_t len)
{
    rd *r = ctx;
    if (len > r->n - r->at)
        len = r->n - r->at;
    memcpy(buf, r->b + r->at, len);
    r->at += len;
    return (int64_t)len;
}

typedef struct {
    uint8_t *b;
    size_t n, cap;
} wr;

static int64_t wr_fn(void *ctx, const void *buf, size_t len)
{
    wr *w = ctx;
    if (w->n + len > w->cap) {
        w->cap = (w->n + len) * 2;
        w->b = realloc(w->b, w->cap);
        if (!w->b)
            abort();
    }
    memcpy(w->b + w->n, buf, len);
    w->n += len;
    return (int64_t)len;
}

static void check(const uint8_t *data, size_t size)
{
    if (!g_pool) {
        kvt_pool_opts o;
        kvt_pool_opts_init(&o);
        o.backend = KVT_BACKEND_CPU;
        o.geom.n_layers = FZ_L;
        o.geom.n_kv_heads = FZ_H;
        o.geom.n_q_heads = FZ_H;
        o.geom.head_dim = FZ_D;
        o.geom.page_tokens = FZ_P;
        o.geom.dtype = KVT_DTYPE_F16;
        o.device_bytes = 256ull * 2u * FZ_P * FZ_D * 2u;
        o.max_seq_tokens = 512;
        if (kvt_pool_create(&o, &g_pool))
            abort();
    }
    rd r = {data, size, 0};
    kvt_seq_id id = 77;
    int rc = kvt_seq_restore(g_pool, NULL, rd_fn, &r, &id);
    if (rc) {
        if (id != KVT_SEQ_NONE ||
            (rc != KVT_ECORRUPT && rc != KVT_EINVAL && rc != KVT_ENOTSUP && rc != KVT_ERANGE &&
             rc != KVT_ENOSPC && rc != KVT_ENOMEM))
            abort();
    } else {
        wr w = {NULL, 0, 0};
        if (kvt_seq_save(g_pool, id, wr_fn, &w) || w.n != r.at || w.n < FZ_HDR ||
            memcmp(w.b + FZ_HDR, data + FZ_HDR, w.n - FZ_HDR) != 0)
            abort();
        free(w.b);
        if (kvt_seq_release(g_pool, id))
            abort();
    }
    kvt_stats st;
    st.struct_size = sizeof st;
    if (kvt_pool_check(g_pool) || kvt_pool_stats_get(g_pool, &st) || st.n_seqs != 0)
        abort();
}

/* Recomputes every checksum of a stream in place, following the format:
 * the header's, each page record's (over its position and bytes), the
 * trailer's. Stops where the data ends. */
static void fix_crcs(uint8_t *b, size_t n)
{
    if (n < FZ_HDR)
        return;
    uint32_t nt[FZ_L], crc = kvt__crc32c(0, b, FZ_HDR - 4);
    memcpy(b + FZ_HDR - 4, &crc, 4);
    memcpy(nt, b + 56, sizeof nt);
    size_t at = FZ_HDR;
    uint64_t recs = 0;
    for (uint32_t l = 0; l < FZ_L; l++) {
        const uint32_t tok = nt[l] > 512 ? 512 : nt[l], np = (tok + FZ_P - 1) / FZ_P;
        for (uint32_t pg = 0; pg < np; pg++) {
            const uint32_t count = pg + 1 < np || tok % FZ_P == 0 ? FZ_P : tok % FZ_P;
            const size_t len = (2u * count + 3u) * FZ_D * 2u;
            for (uint32_t h = 0; h < FZ_H; h++) {
                if (at + len + 4 > n)
                    return;
                const uint32_t pos[3] = {l, pg, h};
                crc = kvt__crc32c(kvt__crc32c(0, pos, sizeof pos), b + at, len);
                memcpy(b + at + len, &crc, 4);
                at += len + 4;
                recs++;
            }
        }
    }
    if (at + 20 > n)
        return;
    memcpy(b + at + 8, &recs, 8);
    crc = kvt__crc32c(0, b + at, 16);
    memcpy(b + at + 16, &crc, 4);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check(data, size);
    if (size >= FZ_HDR && size <= (1u << 20)) {
        uint8_t *c = malloc(size);
        if (!c)
            abort();
        memcpy(c, data, size);
        fix_crcs(c, size);
        check(c, size);
        free(c);
    }
    return 0;
}
