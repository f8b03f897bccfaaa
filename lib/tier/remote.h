/* The remote tier (kvtier/remote.h), below the pool: rslot.c (Redis Cluster
 * key slots), rvalue.c (the chained key of a page position, key names, the
 * self-describing value and its checks), rclient.c (hiredis: connections,
 * the cluster's slot map, MOVED/ASK, back-off, the threads, the write-behind
 * queue and the fetches; rclient_none.c in a build without hiredis). None
 * of it knows the pool: tier/prefix.c writes, api/remote.c reads and lands.
 * Included by tier.h. */
#ifndef KVTIER_REMOTE_INT_H
#define KVTIER_REMOTE_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtier/remote.h"
#include "../core/base.h"

/* CRC16 as Redis Cluster computes it (XMODEM), and the cluster key slot of
 * a key (0 .. 16383; the hash tag's when the key has a non-empty one). */
KVT__HIDDEN uint16_t kvt__redis_crc16(const void *buf, size_t len);
KVT__HIDDEN uint32_t kvt__redis_slot(const void *key, size_t len);

/* ---- rvalue.c ---- */
/* A page position's remote key: a 128-bit chained hash of the namespace,
 * the salt and every token id from position 0 to the page's end. */
typedef struct kvt__rkey {
    uint64_t h[2];
} kvt__rkey;

/* What every value of a pool describes (fixed at creation). */
typedef struct kvt__rgeom {
    uint32_t L, H, D, P, dtype, elem;
    uint64_t block_bytes;
    uint64_t ns;             /* hash of the fingerprint, the geometry and dtype */
    char prefix[64];         /* key_prefix */
} kvt__rgeom;

#define KVT__RKEY_MAX 120u   /* a key name, NUL included */
#define KVT__RVALUE_HDR 96u  /* the fixed part of a value's header */

KVT__HIDDEN int kvt__rgeom_init(kvt__rgeom *g, uint32_t L, uint32_t H, uint32_t D, uint32_t P,
                                uint32_t dtype, uint32_t elem, uint64_t block_bytes,
                                const char *fingerprint, const char *key_prefix);
/* The key before position 0 (the chain's seed) and the key of the page
 * after `prev` with ids[P] under salt. */
KVT__HIDDEN kvt__rkey kvt__rkey_seed(const kvt__rgeom *g);
KVT__HIDDEN kvt__rkey kvt__rkey_next(const kvt__rgeom *g, kvt__rkey prev, const uint32_t *ids,
                                     uint64_t salt);
/* PREFIX:NAMESPACE:KEY, NUL-terminated, into out[KVT__RKEY_MAX]; returns
 * its length. */
KVT__HIDDEN size_t kvt__rkey_name(const kvt__rgeom *g, kvt__rkey k, char *out);
/* Bytes of one value: header, ids, L * H blocks, CRC32C. */
KVT__HIDDEN size_t kvt__rvalue_bytes(const kvt__rgeom *g);
/* Writes the header of the value of page `page` (key `k`, its parent key
 * `parent`, ids[P]) into v; the caller fills kvt__rvalue_block(g, v, lh)
 * for every (layer, head), then seals it (the CRC32C). */
KVT__HIDDEN void kvt__rvalue_header(const kvt__rgeom *g, uint8_t *v, uint32_t page,
                                    uint64_t salt, kvt__rkey k, kvt__rkey parent,
                                    const uint32_t *ids);
KVT__HIDDEN void kvt__rvalue_seal(const kvt__rgeom *g, uint8_t *v);
static inline uint8_t *kvt__rvalue_block(const kvt__rgeom *g, uint8_t *v, size_t lh)
{
    return v + KVT__RVALUE_HDR + 4u * (size_t)g->P + lh * g->block_bytes;
}
/* 0 when v[len] is the value of exactly that page; otherwise KVT_ECORRUPT
 * with why (may be NULL; 160 bytes) saying which check failed. Never trusts
 * a length or an offset it has not checked. */
KVT__HIDDEN int kvt__rvalue_check(const kvt__rgeom *g, const uint8_t *v, size_t len,
                                  uint32_t page, uint64_t salt, kvt__rkey k, kvt__rkey parent,
                                  const uint32_t *ids, char *why);

/* ---- rclient.c / rclient_none.c ---- */
typedef struct kvt__rclient kvt__rclient;
typedef struct kvt__rfetch kvt__rfetch;

/* Whether this build has the client (hiredis). */
KVT__HIDDEN extern const bool kvt__rclient_built;

/* Checks the options (KVT_EINVAL naming the field), copies them, reads
 * the endpoints' slot map (or finds a single node; none answering is not
 * an error: the tier retries later) and starts the threads. KVT_ENOTSUP
 * in a build without hiredis. */
KVT__HIDDEN int kvt__rclient_create(kvt__rclient **out, const kvt_remote_opts *o,
                                    const kvt__rgeom *g);
/* Writes what is queued (each node's faults bounding it), stops the threads. */
KVT__HIDDEN void kvt__rclient_destroy(kvt__rclient *c);
KVT__HIDDEN const kvt__rgeom *kvt__rclient_geom(const kvt__rclient *c);
KVT__HIDDEN uint32_t kvt__rclient_flags(const kvt__rclient *c);
/* A buffer of one value's size (kvt__rvalue_bytes): a used one when the
 * client keeps one (up to queue_bytes of them are kept for reuse: fresh
 * memory costs a page fault per 4 KiB), else new; NULL when out of memory.
 * kvt__rclient_buf_free gives it back. */
KVT__HIDDEN uint8_t *kvt__rclient_buf(kvt__rclient *c);
KVT__HIDDEN void kvt__rclient_buf_free(kvt__rclient *c, uint8_t *b);
/* Queues val[len] (from kvt__rclient_buf; the client gives it back) for
 * SET under key. false: not queued (the queue is full), val given back,
 * counted as dropped. */
KVT__HIDDEN bool kvt__rclient_put(kvt__rclient *c, const char *key, uint8_t *val, size_t len);
/* Waits until the queue is empty and no write is in flight. */
KVT__HIDDEN int kvt__rclient_flush(kvt__rclient *c, uint32_t timeout_ms);
/* Asks for the values of pages first .. first + n - 1 (ids[n * P], their
 * token ids; parent: the key of page first - 1, or the seed) under salt.
 * The threads check each value against what it must be. */
KVT__HIDDEN int kvt__rfetch_start(kvt__rclient *c, uint32_t first, uint32_t n,
                                  const uint32_t *ids, uint64_t salt, kvt__rkey parent,
                                  kvt__rfetch **out);
/* 0 when every answer is in, KVT_ETIMEDOUT after timeout_ms. */
KVT__HIDDEN int kvt__rfetch_wait(kvt__rfetch *f, uint32_t timeout_ms);
/* After a successful wait: the length of the leading run of valid values,
 * and value i (< that) of it: the value of page first + i, checked. */
KVT__HIDDEN uint32_t kvt__rfetch_hits(const kvt__rfetch *f);
KVT__HIDDEN const uint8_t *kvt__rfetch_value(const kvt__rfetch *f, uint32_t i);
/* Counts what the caller made of a fetch (landed, and asked but not landed). */
KVT__HIDDEN void kvt__rfetch_account(kvt__rfetch *f, uint32_t landed);
/* Cancels what is not asked yet, waits for what is in flight, frees. */
KVT__HIDDEN void kvt__rfetch_free(kvt__rfetch *f);
/* Reports a line through the log callback (printf-style). */
KVT__HIDDEN void kvt__rclient_log(kvt__rclient *c, const char *fmt, ...)
    KVT__PRINTF(2, 3);

typedef struct kvt__rstats {
    uint64_t fetches, fetch_ns, hit_values, miss_values, get_bytes, put_values, put_bytes,
        put_dropped, errors, corrupt, redirects, queue_bytes;
} kvt__rstats;
KVT__HIDDEN void kvt__rclient_stats(kvt__rclient *c, kvt__rstats *s);

#endif /* KVTIER_REMOTE_INT_H */
