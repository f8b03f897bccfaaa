/* kvt_seq_save and kvt_seq_restore: one sequence as a byte stream through
 * caller callbacks, in the format of kvtier-seq(5): a CRC-checked header
 * that describes the pool's geometry, one CRC-checked record per page
 * (its rows and metadata), a trailer. Little-endian hosts (the only ones
 * the library builds for). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_int.h"
#include "../backend/backend.h"
#include "../tier/tier.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvtier-seq(5) streams are little-endian; this host is not"
#endif

static const char kvt__seq_magic[8] = {'K', 'V', 'T', 'S', 'E', 'Q', 0, 0};
static const char kvt__seq_end[8] = {'K', 'V', 'T', 'S', 'E', 'Q', 'Z', 0};
#define KVT__SEQ_VERSION 1u
#define KVT__SEQ_HDR_FIXED 56u /* magic .. user_data */
#define KVT__SEQ_MAX_LAYERS 65536u

/* The fixed header (56 bytes, no padding). */
typedef struct {
    char magic[8];
    uint32_t version, header_bytes, n_layers, n_kv_heads, head_dim, page_tokens, dtype,
        elem_bytes, max_tokens, reserved;
    uint64_t user_data;
} kvt__seq_hdr;
_Static_assert(sizeof(kvt__seq_hdr) == KVT__SEQ_HDR_FIXED, "kvtier-seq header layout");

typedef struct {
    kvt_write_fn fn;
    void *ctx;
    uint64_t at;
} kvt__wr;

static int kvt__wr_put(kvt__wr *w, const void *buf, size_t len)
{
    const uint8_t *b = buf;
    while (len) {
        int64_t n = w->fn(w->ctx, b, len);
        if (n <= 0 || (uint64_t)n > len)
            return kvt__err(KVT_EIO, "write: the callback returned %lld for %zu bytes at "
                            "stream offset %llu", (long long)n, len, (unsigned long long)w->at);
        b += n;
        len -= (size_t)n;
        w->at += (uint64_t)n;
    }
    return 0;
}

typedef struct {
    kvt_read_fn fn;
    void *ctx;
    uint64_t at;
} kvt__rd;

/* Exactly len bytes; an early end is KVT_ECORRUPT (truncated stream). */
static int kvt__rd_get(kvt__rd *r, void *buf, size_t len, const char *what)
{
    uint8_t *b = buf;
    while (len) {
        int64_t n = r->fn(r->ctx, b, len);
        if (n < 0 || (uint64_t)n > len)
            return kvt__err(KVT_EIO, "read: the callback returned %lld for %zu bytes at "
                            "stream offset %llu (%s)", (long long)n, len,
                            (unsigned long long)r->at, what);
        if (n == 0)
            return kvt__err(KVT_ECORRUPT, "stream: ends at offset %llu inside the %s "
                            "(truncated)", (unsigned long long)r->at, what);
        b += n;
        len -= (size_t)n;
        r->at += (uint64_t)n;
    }
    return 0;
}

/* CRC32C of a page record: its position, then its bytes. */
static uint32_t kvt__rec_crc(uint32_t l, uint32_t pg, uint32_t h, const uint8_t *rec, size_t n)
{
    const uint32_t pos[3] = {l, pg, h};
    return kvt__crc32c(kvt__crc32c(0, pos, sizeof pos), rec, n);
}

KVT_API int kvt_seq_save(const kvt_pool *pool, kvt_seq_id seq, kvt_write_fn write, void *ctx)
{
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(write);
    kvt__seq *s;
    int rc = kvt__seq_lookup(pool, seq, &s);
    if (rc)
        return rc;
    if ((rc = kvt__seq_edit_ok(pool, s, "kvt_seq_save")))
        return rc;
    const uint32_t L = pool->g.n_layers, H = pool->g.n_kv_heads, P = pool->g.page_tokens;
    const size_t row = (size_t)pool->g.head_dim * pool->elem;
    kvt__seq_hdr hd;
    memset(&hd, 0, sizeof hd);
    memcpy(hd.magic, kvt__seq_magic, 8);
    hd.version = KVT__SEQ_VERSION;
    hd.header_bytes = KVT__SEQ_HDR_FIXED + 4u * L + 4u;
    hd.n_layers = L;
    hd.n_kv_heads = H;
    hd.head_dim = pool->g.head_dim;
    hd.page_tokens = P;
    hd.dtype = (uint32_t)pool->g.dtype;
    hd.elem_bytes = (uint32_t)pool->elem;
    hd.max_tokens = s->max_tokens;
    hd.user_data = s->user_data;
    kvt__wr w = {write, ctx, 0};
    uint32_t crc = kvt__crc32c(kvt__crc32c(0, &hd, sizeof hd), s->n_tokens, 4u * L);
    if ((rc = kvt__wr_put(&w, &hd, sizeof hd)) || (rc = kvt__wr_put(&w, s->n_tokens, 4u * L)) ||
        (rc = kvt__wr_put(&w, &crc, 4)))
        return rc;
    /* One page record: K rows, V rows, metadata, CRC. */
    uint8_t *blk = malloc(pool->block_bytes + 2u * (size_t)P * row + pool->meta_bytes);
    if (!blk)
        return kvt__err(KVT_ENOMEM, "kvt_seq_save: cannot allocate a page buffer");
    uint8_t *rec = blk + pool->block_bytes;
    uint64_t n_rec = 0;
    for (uint32_t l = 0; l < L && !rc; l++) {
        const uint32_t n = s->n_tokens[l], np = kvt__pages_for(pool, n);
        for (uint32_t pg = 0; pg < np && !rc; pg++) {
            const uint32_t count = pg + 1u < np || n % P == 0 ? P : n % P;
            for (uint32_t h = 0; h < H && !rc; h++) {
                const size_t lh = kvt__lh(pool, l, h);
                if ((rc = kvt__page_read(pool, s, lh, pg, blk)))
                    break;
                memcpy(rec, blk, count * row);
                memcpy(rec + count * row, blk + (size_t)P * row, count * row);
                if ((rc = kvt__meta_get(pool, s->meta_slot[lh * s->cap_pages + pg],
                                        rec + 2u * count * row)))
                    break;
                const size_t len = 2u * count * row + pool->meta_bytes;
                crc = kvt__rec_crc(l, pg, h, rec, len);
                if (!(rc = kvt__wr_put(&w, rec, len)))
                    rc = kvt__wr_put(&w, &crc, 4);
                n_rec++;
            }
        }
    }
    free(blk);
    if (rc)
        return rc;
    uint8_t tr[20];
    memcpy(tr, kvt__seq_end, 8);
    memcpy(tr + 8, &n_rec, 8);
    crc = kvt__crc32c(0, tr, 16);
    memcpy(tr + 16, &crc, 4);
    return kvt__wr_put(&w, tr, sizeof tr);
}

/* The header of a stream, checked against the pool. */
static int kvt__restore_header(const kvt_pool *pool, kvt__rd *r, kvt__seq_hdr *hd,
                               uint32_t **n_tokens)
{
    int rc = kvt__rd_get(r, hd, sizeof *hd, "header");
    if (rc)
        return rc;
    if (memcmp(hd->magic, kvt__seq_magic, 8))
        return kvt__err(KVT_ECORRUPT, "stream: does not start with a kvtier-seq(5) header "
                        "(magic)");
    if (hd->n_layers == 0 || hd->n_layers > KVT__SEQ_MAX_LAYERS ||
        hd->header_bytes != KVT__SEQ_HDR_FIXED + 4u * hd->n_layers + 4u)
        return kvt__err(KVT_ECORRUPT, "stream header: %u layers in %u bytes is inconsistent",
                        hd->n_layers, hd->header_bytes);
    uint32_t *nt = malloc(4u * (size_t)hd->n_layers + 4u);
    if (!nt)
        return kvt__err(KVT_ENOMEM, "kvt_seq_restore: cannot allocate %u layer lengths",
                        hd->n_layers);
    if ((rc = kvt__rd_get(r, nt, 4u * (size_t)hd->n_layers + 4u, "header"))) {
        free(nt);
        return rc;
    }
    uint32_t crc = kvt__crc32c(kvt__crc32c(0, hd, sizeof *hd), nt, 4u * hd->n_layers);
    if (crc != nt[hd->n_layers]) {
        free(nt);
        return kvt__err(KVT_ECORRUPT, "stream header: CRC32C mismatch");
    }
    *n_tokens = nt;
    if (hd->version != KVT__SEQ_VERSION)
        return kvt__err(KVT_ENOTSUP, "stream version: %u; this library reads version %u",
                        hd->version, KVT__SEQ_VERSION);
    const struct {
        const char *name;
        uint32_t have, want;
    } f[] = {{"n_layers", hd->n_layers, pool->g.n_layers},
             {"n_kv_heads", hd->n_kv_heads, pool->g.n_kv_heads},
             {"head_dim", hd->head_dim, pool->g.head_dim},
             {"page_tokens", hd->page_tokens, pool->g.page_tokens},
             {"elem_bytes", hd->elem_bytes, (uint32_t)pool->elem}};
    if (hd->dtype != (uint32_t)pool->g.dtype)
        return kvt__err(KVT_EINVAL, "stream dtype: %s, the pool stores %s",
                        kvt__dtype_name(hd->dtype), kvt__dtype_name(pool->g.dtype));
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].have != f[i].want)
            return kvt__err(KVT_EINVAL, "stream %s: %u, the pool has %u", f[i].name, f[i].have,
                            f[i].want);
    return 0;
}

/* Reads the page records into sequence s (appends, then checks each page's
 * metadata against the saved bytes), then the trailer. */
static int kvt__restore_pages(kvt_pool *pool, kvt_seq_id id, kvt__seq *s, kvt__rd *r,
                              const uint32_t *n_tokens)
{
    const uint32_t L = pool->g.n_layers, H = pool->g.n_kv_heads, P = pool->g.page_tokens;
    const size_t row = (size_t)pool->g.head_dim * pool->elem, mb = pool->meta_bytes;
    const size_t rec_max = 2u * (size_t)P * row + mb;
    /* A page-row of every head: K and V as [count][H][D], and their metadata. */
    const size_t kvb = (size_t)P * H * row;
    uint8_t *k = malloc(kvb), *v = malloc(kvb);
    uint8_t *meta = malloc((size_t)H * mb), *rec = malloc(rec_max + 4u), *got = malloc(mb);
    int rc = 0;
    uint64_t n_rec = 0;
    if (!k || !v || !meta || !rec || !got)
        rc = kvt__err(KVT_ENOMEM, "kvt_seq_restore: cannot allocate page buffers");
    kvt__rows_stage stage = {0};
    for (uint32_t l = 0; l < L && !rc; l++) {
        const uint32_t n = n_tokens[l], np = kvt__pages_for(pool, n);
        for (uint32_t pg = 0; pg < np && !rc; pg++) {
            const uint32_t count = pg + 1u < np || n % P == 0 ? P : n % P;
            const size_t len = 2u * count * row + mb;
            for (uint32_t h = 0; h < H && !rc; h++) {
                if ((rc = kvt__rd_get(r, rec, len + 4u, "page records")))
                    break;
                uint32_t crc;
                memcpy(&crc, rec + len, 4);
                if (crc != kvt__rec_crc(l, pg, h, rec, len)) {
                    rc = kvt__err(KVT_ECORRUPT, "stream: layer %u page %u head %u: CRC32C "
                                  "mismatch", l, pg, h);
                    break;
                }
                for (uint32_t t = 0; t < count; t++) {
                    memcpy(k + ((size_t)t * H + h) * row, rec + (size_t)t * row, row);
                    memcpy(v + ((size_t)t * H + h) * row, rec + (size_t)(count + t) * row, row);
                }
                memcpy(meta + (size_t)h * mb, rec + 2u * count * row, mb);
                n_rec++;
            }
            if (rc)
                break;
            if ((rc = kvt__append_host_rows(pool, id, l, k, v, count, &stage)))
                break;
            for (uint32_t h = 0; h < H && !rc; h++) {
                const size_t e = kvt__lh(pool, l, h) * s->cap_pages + pg;
                if ((rc = kvt__meta_get(pool, s->meta_slot[e], got)))
                    break;
                if (memcmp(got, meta + (size_t)h * mb, mb))
                    rc = kvt__err(KVT_ECORRUPT, "stream: layer %u page %u head %u: the saved "
                                  "metadata does not describe the saved keys", l, pg, h);
            }
        }
    }
    uint8_t tr[20];
    if (!rc && !(rc = kvt__rd_get(r, tr, sizeof tr, "trailer"))) {
        uint32_t crc;
        uint64_t want;
        memcpy(&crc, tr + 16, 4);
        memcpy(&want, tr + 8, 8);
        if (memcmp(tr, kvt__seq_end, 8) || crc != kvt__crc32c(0, tr, 16) || want != n_rec)
            rc = kvt__err(KVT_ECORRUPT, "stream: the trailer is damaged or counts %llu pages "
                          "where %llu were read", (unsigned long long)want,
                          (unsigned long long)n_rec);
    }
    kvt__rows_stage_fini(pool, &stage);
    free(k);
    free(v);
    free(meta);
    free(rec);
    free(got);
    return rc;
}

KVT_API int kvt_seq_restore(kvt_pool *pool, const kvt_seq_opts *opts, kvt_read_fn read,
                            void *ctx, kvt_seq_id *out)
{
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(out);
    *out = KVT_SEQ_NONE;
    KVT__CHECK_NULL(read);
    kvt_seq_opts o;
    int rc;
    if (opts) {
        if ((rc = kvt__opts_copy(&o, sizeof o, opts, KVT__SEQ_OPTS_V1, "opts")))
            return rc;
        if (o.prefix || o.n_prefix)
            return kvt__err(KVT_EINVAL, "opts->prefix: a restored sequence's rows come from "
                            "the stream (set prefix NULL and n_prefix 0)");
    } else {
        kvt_seq_opts_init(&o);
    }
    kvt__rd r = {read, ctx, 0};
    kvt__seq_hdr hd;
    uint32_t *n_tokens = NULL;
    if ((rc = kvt__restore_header(pool, &r, &hd, &n_tokens))) {
        free(n_tokens);
        return rc;
    }
    if (!o.max_tokens) /* the saved limit, within the pool's (0: the pool's) */
        o.max_tokens = hd.max_tokens && hd.max_tokens < pool->max_seq_tokens
                           ? hd.max_tokens : pool->max_seq_tokens;
    for (uint32_t l = 0; l < hd.n_layers; l++)
        if (n_tokens[l] > o.max_tokens) {
            rc = kvt__err(KVT_ERANGE, "stream n_tokens[%u]: %u is above the restored "
                          "sequence's limit %u", l, n_tokens[l], o.max_tokens);
            free(n_tokens);
            return rc;
        }
    kvt_seq_id id;
    if ((rc = kvt_seq_create(pool, &o, &id))) {
        free(n_tokens);
        return rc;
    }
    kvt__seq *s = &pool->seqs[kvt__seq_id_slot(id)];
    rc = kvt__restore_pages(pool, id, s, &r, n_tokens);
    free(n_tokens);
    if (rc) {
        char msg[512]; /* the release must not replace the reason */
        snprintf(msg, sizeof msg, "%s", kvt_last_error());
        kvt_seq_release(pool, id);
        return kvt__err(rc, "%s", msg);
    }
    *out = id;
    return 0;
}
