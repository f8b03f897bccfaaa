/* The remote tier's client, inside (lib/tier/rconn.c: nodes, connections,
 * back-off, the slot map and routing; rclient.c: the threads, the queue,
 * the fetches). Built only with hiredis. */
#ifndef KVTIER_RCLIENT_INT_H
#define KVTIER_RCLIENT_INT_H

#include <hiredis.h>
#include <pthread.h>
#include <stdatomic.h>

#include "tier.h"

#define KVT__RMAX_NODES 64u
#define KVT__RSLOTS 16384u
#define KVT__RNO_NODE 0xffffu
#define KVT__RHOPS 3 /* MOVED/ASK redirections followed per command */

typedef struct {
    char host[256];          /* host name or address; the socket path when port == 0 */
    int port;
    _Atomic int64_t down_until; /* CLOCK_MONOTONIC ns: no connection before it */
    _Atomic uint32_t fails;  /* faults in a row */
} kvt__rnode;

typedef struct kvt__rput {
    struct kvt__rput *next;
    char key[KVT__RKEY_MAX];
    size_t klen, len;
    uint8_t *val;
} kvt__rput;

struct kvt__rfetch {
    kvt__rclient *c;
    struct kvt__rfetch *next_q; /* the client's list of fetches with commands to give */
    uint32_t first, n;
    uint64_t salt;
    uint32_t *ids;           /* [n * P] */
    kvt__rkey *key;          /* [n + 1]: key[0] = the parent of page first */
    char (*name)[KVT__RKEY_MAX];
    size_t *nlen;
    uint8_t **val;           /* the values kept (valid ones) */
    uint8_t *st;             /* KVT__RV_* per value */
    uint32_t given;          /* values handed to workers (under mu) */
    uint32_t done;           /* values answered (under mu) */
    _Atomic uint32_t miss_at; /* lowest value that is not valid; n = none */
    int64_t t0;
    pthread_cond_t cv;
};

struct kvt__rclient {
    kvt__rgeom g;
    kvt_remote_opts o;
    char *endpoints, *user, *password; /* copies */
    kvt__rnode node[KVT__RMAX_NODES];
    _Atomic uint32_t n_node;
    uint32_t n_seed;         /* the first n_seed nodes are the endpoints */
    int cluster;             /* -1 unknown (nobody answered yet), 0 single node, 1 cluster */
    uint16_t *slot;          /* [KVT__RSLOTS] node of each slot */
    int64_t map_next;        /* no slot map read before it (ns) */
    pthread_mutex_t mu;      /* everything below, the slot map and the node list */
    pthread_mutex_t map_mu;  /* one slot map read at a time */
    pthread_mutex_t log_mu;
    pthread_mutex_t buf_mu;  /* the value buffers kept for reuse: */
    void *buf_free;          /* a list through their first 8 bytes */
    uint64_t buf_n, buf_cap;
    pthread_cond_t work, idle;
    kvt__rput *put_head, *put_tail;
    uint64_t queued_bytes;
    uint32_t puts_in_flight;
    kvt__rfetch *fq;         /* fetches with values not yet given out */
    int stop;
    pthread_t th[64];
    uint32_t n_th;
    _Atomic uint64_t st_fetches, st_fetch_ns, st_hit, st_miss, st_get_bytes, st_put,
        st_put_bytes, st_dropped, st_errors, st_corrupt, st_redirects;
};

/* A value's outcome. */
enum { KVT__RV_PENDING, KVT__RV_OK, KVT__RV_MISS, KVT__RV_FAULT, KVT__RV_BAD, KVT__RV_SKIP };

/* ---- rreply.c ---- */
/* A connection's read buffer (the manual reads of GET replies). */
typedef struct {
    size_t at, n;
    char b[65536];
} kvt__rrb;
/* A reply: REDIS_REPLY_* type; str (malloc'd) holds a value of the size
 * asked for, or an error or status line; NULL for a bulk string of another
 * size (drained), a nil, an integer. */
typedef struct {
    int type;
    char *str;
    size_t len;
} kvt__rrep;
/* Reads one reply from fd through rb; a bulk string of `want` bytes goes
 * into dst (want bytes; out->str = dst), any other is drained (dst NULL:
 * drained too).
 * -1: the connection is unusable (closed, timed out, not RESP). */
KVT__HIDDEN int kvt__rread(int fd, kvt__rrb *rb, size_t want, uint8_t *dst, kvt__rrep *out);

/* ---- rconn.c ---- */
KVT__HIDDEN int64_t kvt__rnow(void);
KVT__HIDDEN struct timeval kvt__rtv(uint32_t ms);
KVT__HIDDEN const char *kvt__rnode_name(const kvt__rnode *n, char *buf, size_t len);
/* A node's fault: counted, logged, and no connection to it before the
 * back-off (retry_ms, doubling with each fault in a row, up to 64 x). */
KVT__HIDDEN void kvt__rnode_fault(kvt__rclient *c, uint32_t i, const char *why);
KVT__HIDDEN void kvt__rnode_ok(kvt__rclient *c, uint32_t i);
/* The node named host:port, added when new (under mu); -1 when the list is full. */
KVT__HIDDEN int kvt__rnode_find(kvt__rclient *c, const char *host, size_t hlen, int port);
/* A connection to node i, authenticated, with the io timeout; NULL (and
 * the fault recorded) when it cannot be had or the node is backing off. */
KVT__HIDDEN redisContext *kvt__rconnect(kvt__rclient *c, uint32_t i);
/* Reads the slot map from the first node that answers; rate-limited. */
KVT__HIDDEN void kvt__rmap_read(kvt__rclient *c);
/* The node of a key; -1 when no node is known for it (after one map read). */
KVT__HIDDEN int kvt__rroute(kvt__rclient *c, const char *key, size_t klen);
KVT__HIDDEN char *kvt__rdup(const char *s);
/* Adds the endpoints (c->endpoints, tokenised in place) as the seed nodes. */
KVT__HIDDEN int kvt__rendpoints(kvt__rclient *c);

#endif /* KVTIER_RCLIENT_INT_H */
