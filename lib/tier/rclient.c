/* The remote tier's client (lib/tier/remote.h) on hiredis: endpoints, one
 * connection per (thread, node), the cluster's slot map (CLUSTER SLOTS,
 * refreshed on MOVED, ASK followed without updating it), a back-off per
 * node after a fault, the write-behind queue and the fetches.
 *
 * Threads: n_connections workers. Each takes work under the client's
 * mutex - a range of up to `pipeline` GETs of a fetch (fetches first: a
 * request waits on them), else up to `pipeline` queued SETs - then sends
 * the commands to every node they route to before reading any reply (the
 * nodes answer in parallel), outside the mutex. A fetch's answers are
 * checked on the worker (kvt__rvalue_check), so the caller's thread only
 * copies valid values in. Every fault (no route, a node in back-off, a
 * refused or lost connection, a timeout, an error reply, AUTH) makes the
 * command a miss or a dropped write, and is counted and logged. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rclient_int.h"

const bool kvt__rclient_built = true;

/* One command of a worker's batch. */
typedef struct {
    kvt__rfetch *f;          /* a GET of value idx of f; NULL: the SET of put */
    uint32_t idx;
    kvt__rput *put;
    const char *key;
    size_t klen;
    int node;                /* where it was sent; -1 = not sent */
    char *moved;             /* a MOVED or ASK error, followed after the batch */
} kvt__rop;

/* ---- a worker ---- */
typedef struct {
    kvt__rclient *c;
    redisContext *conn[KVT__RMAX_NODES];
    kvt__rrb *rb[KVT__RMAX_NODES]; /* the GET replies' read buffers */
    kvt__rop *op;
} kvt__rworker;

static redisContext *kvt__rconn(kvt__rworker *w, uint32_t node)
{
    if (!w->conn[node]) {
        if (!w->rb[node] && !(w->rb[node] = malloc(sizeof *w->rb[node])))
            return NULL;
        w->rb[node]->at = w->rb[node]->n = 0;
        w->conn[node] = kvt__rconnect(w->c, node);
    }
    return w->conn[node];
}

static void kvt__rconn_lost(kvt__rworker *w, uint32_t node)
{
    char why[200];
    snprintf(why, sizeof why, "connection lost (%s)",
             w->conn[node] && w->conn[node]->errstr[0] ? w->conn[node]->errstr
                                                        : "no reply, or not one of RESP");
    redisFree(w->conn[node]);
    w->conn[node] = NULL;
    kvt__rnode_fault(w->c, node, why);
    if (w->c->cluster == 1)
        kvt__rmap_read(w->c);
}

static int kvt__rappend(kvt__rworker *w, redisContext *r, const kvt__rop *op)
{
    const kvt__rclient *c = w->c;
    if (op->f) {
        const char *argv[2] = {"GET", op->key};
        const size_t argl[2] = {3, op->klen};
        return redisAppendCommandArgv(r, 2, argv, argl);
    }
    char ttl[16];
    const char *argv[5] = {"SET", op->key, (const char *)op->put->val, "EX", ttl};
    size_t argl[5] = {3, op->klen, op->put->len, 2, 0};
    int argc = 3;
    if (c->o.ttl_s) {
        argl[4] = (size_t)snprintf(ttl, sizeof ttl, "%u", c->o.ttl_s);
        argc = 5;
    }
    return redisAppendCommandArgv(r, argc, argv, argl);
}

/* Writes what hiredis holds for r (the socket's send timeout bounds it). */
static int kvt__rflush(redisContext *r)
{
    int done = 0;
    while (!done)
        if (redisBufferWrite(r, &done) != REDIS_OK)
            return -1;
    return 0;
}

/* The next reply on node's connection, read here for GET, SET and ASKING
 * alike (hiredis's reader allocates whatever sizes a server announces; this
 * one keeps only a value of the expected size, in a buffer of the client's).
 * -1: the connection is unusable; *rep is then empty. */
static int kvt__rreply(kvt__rworker *w, uint32_t node, const kvt__rop *op, kvt__rrep *rep)
{
    redisContext *r = w->conn[node];
    uint8_t *dst = op->f ? kvt__rclient_buf(w->c) : NULL;
    int rc = kvt__rflush(r);
    if (!rc)
        rc = kvt__rread(r->fd, w->rb[node], op->f ? kvt__rvalue_bytes(&w->c->g) : 0, dst, rep);
    else
        memset(rep, 0, sizeof *rep);
    if (rc || rep->str != (char *)dst)
        kvt__rclient_buf_free(w->c, dst);
    if (rc) {
        if (rep->str != (char *)dst)
            free(rep->str);
        memset(rep, 0, sizeof *rep);
    }
    return rc;
}

/* The outcome of a command's reply (its value kept, or freed here). */
static void kvt__rdone(kvt__rworker *w, kvt__rop *op, kvt__rrep *rep, int st)
{
    kvt__rclient *c = w->c;
    if (!op->f) {
        if (st == KVT__RV_OK && rep->type == REDIS_REPLY_STATUS) {
            atomic_fetch_add(&c->st_put, 1u);
            atomic_fetch_add(&c->st_put_bytes, op->put->len);
        } else {
            if (st == KVT__RV_OK && rep->type == REDIS_REPLY_ERROR) {
                atomic_fetch_add(&c->st_errors, 1u);
                kvt__rclient_log(c, "kvtier remote: SET %s: %s", op->key,
                                 rep->str ? rep->str : "error");
            }
            atomic_fetch_add(&c->st_dropped, 1u);
        }
        free(rep->str);
        kvt__rclient_buf_free(c, op->put->val);
        free(op->put);
        return;
    }
    kvt__rfetch *f = op->f;
    const uint32_t i = op->idx;
    if (st == KVT__RV_OK) {
        if (rep->type == REDIS_REPLY_NIL) {
            st = KVT__RV_MISS;
        } else if (rep->type == REDIS_REPLY_ERROR) {
            atomic_fetch_add(&c->st_errors, 1u);
            kvt__rclient_log(c, "kvtier remote: GET %s: %s", op->key,
                             rep->str ? rep->str : "error");
            st = KVT__RV_FAULT;
        } else if (rep->type != REDIS_REPLY_STRING || !rep->str) {
            atomic_fetch_add(&c->st_corrupt, 1u);
            kvt__rclient_log(c, "kvtier remote: %s: rejected: %zu bytes where a value has %zu",
                             op->key, rep->len, kvt__rvalue_bytes(&c->g));
            st = KVT__RV_BAD;
        } else {
            char why[160];
            atomic_fetch_add(&c->st_get_bytes, rep->len);
            if (kvt__rvalue_check(&c->g, (const uint8_t *)rep->str, rep->len, f->first + i,
                                  f->salt, f->key[i + 1u], f->key[i],
                                  f->ids + (size_t)i * c->g.P, why)) {
                atomic_fetch_add(&c->st_corrupt, 1u);
                kvt__rclient_log(c, "kvtier remote: %s: rejected: %s", op->key, why);
                st = KVT__RV_BAD;
            }
        }
    }
    if (st == KVT__RV_OK)
        f->val[i] = (uint8_t *)rep->str;
    else if (rep->type == REDIS_REPLY_STRING) /* a value's buffer */
        kvt__rclient_buf_free(c, (uint8_t *)rep->str);
    else
        free(rep->str);
    f->st[i] = (uint8_t)st;
    if (st != KVT__RV_OK) { /* values past a miss are not asked for any more */
        uint32_t m = atomic_load(&f->miss_at);
        while (i < m && !atomic_compare_exchange_weak(&f->miss_at, &m, i))
            ;
    }
}

/* A redirected command, synchronously: MOVED updates the slot map, ASK
 * asks the named node once (ASKING first). err: the MOVED/ASK line (freed
 * here). 0 and the final reply, or -1 (a fault). */
static int kvt__rredirect(kvt__rworker *w, kvt__rop *op, char *err, kvt__rrep *rep)
{
    uint32_t from = (uint32_t)op->node;
    kvt__rclient *c = w->c;
    memset(rep, 0, sizeof *rep);
    rep->type = REDIS_REPLY_ERROR;
    rep->str = err;
    for (int hop = 0; hop < KVT__RHOPS && rep->type == REDIS_REPLY_ERROR && rep->str; hop++) {
        const bool moved = !strncmp(rep->str, "MOVED ", 6), ask = !strncmp(rep->str, "ASK ", 4);
        if (!moved && !ask)
            return 0;
        /* "MOVED slot host:port" (host may be an IPv6 address, or empty:
         * the node that answered) */
        char *end = NULL;
        const unsigned long slot = strtoul(rep->str + (moved ? 6 : 4), &end, 10);
        const char *hp = end && *end == ' ' ? end + 1 : NULL, *colon = hp ? strrchr(hp, ':') : NULL;
        const long port = colon ? strtol(colon + 1, &end, 10) : 0;
        char host[256];
        const size_t hl = colon ? (size_t)(colon - hp) : 0;
        if (!colon || *end || port < 1 || port > 65535 || slot >= KVT__RSLOTS || hl >= sizeof host)
            return 0;
        if (hl) {
            memcpy(host, hp, hl);
            host[hl] = 0;
        } else {
            snprintf(host, sizeof host, "%s", c->node[from].host);
        }
        atomic_fetch_add(&c->st_redirects, 1u);
        pthread_mutex_lock(&c->mu);
        const int node = kvt__rnode_find(c, host, strlen(host), (int)port);
        if (moved && node >= 0)
            c->slot[slot] = (uint16_t)node;
        pthread_mutex_unlock(&c->mu);
        free(rep->str);
        memset(rep, 0, sizeof *rep);
        redisContext *r = node >= 0 ? kvt__rconn(w, (uint32_t)node) : NULL;
        if (!r)
            return -1;
        kvt__rrep ok;
        const kvt__rop asking = {.f = op->f}; /* read as the command is */
        if ((ask && redisAppendCommand(r, "ASKING") != REDIS_OK) ||
            kvt__rappend(w, r, op) != REDIS_OK ||
            (ask && (kvt__rreply(w, (uint32_t)node, &asking, &ok) || (free(ok.str), 0))) ||
            kvt__rreply(w, (uint32_t)node, op, rep)) {
            kvt__rconn_lost(w, (uint32_t)node);
            return -1;
        }
        kvt__rnode_ok(c, (uint32_t)node);
        from = (uint32_t)node;
    }
    return 0;
}

/* Sends ops[n] (all GETs or all SETs) to their nodes, all before any reply
 * is read, reads the replies node by node, then follows redirections. */
static void kvt__rbatch(kvt__rworker *w, kvt__rop *ops, uint32_t n)
{
    kvt__rclient *c = w->c;
    uint32_t used[KVT__RMAX_NODES], n_used = 0;
    kvt__rrep none = {0, NULL, 0};
    for (uint32_t i = 0; i < n; i++) {
        kvt__rop *op = &ops[i];
        op->node = -1;
        const int node = kvt__rroute(c, op->key, op->klen);
        redisContext *r = node >= 0 ? kvt__rconn(w, (uint32_t)node) : NULL;
        if (!r || kvt__rappend(w, r, op) != REDIS_OK) {
            kvt__rdone(w, op, &none, KVT__RV_FAULT);
            continue;
        }
        op->node = node;
        bool seen = false;
        for (uint32_t u = 0; u < n_used; u++)
            seen |= used[u] == (uint32_t)node;
        if (!seen)
            used[n_used++] = (uint32_t)node;
    }
    for (uint32_t u = 0; u < n_used; u++) /* every node gets its commands first */
        (void)kvt__rflush(w->conn[used[u]]); /* (a failure: the node's first read says so) */
    for (uint32_t u = 0; u < n_used; u++) {
        const uint32_t node = used[u];
        bool lost = false;
        for (uint32_t i = 0; i < n; i++) {
            kvt__rop *op = &ops[i];
            if (op->node != (int)node)
                continue;
            kvt__rrep rep;
            if (lost || kvt__rreply(w, node, op, &rep)) {
                if (!lost)
                    kvt__rconn_lost(w, node);
                lost = true;
                kvt__rdone(w, op, &none, KVT__RV_FAULT);
                continue;
            }
            kvt__rnode_ok(c, node);
            if (rep.type == REDIS_REPLY_ERROR && rep.str &&
                (!strncmp(rep.str, "MOVED ", 6) || !strncmp(rep.str, "ASK ", 4)))
                op->moved = rep.str; /* once every pipelined reply is read */
            else
                kvt__rdone(w, op, &rep, KVT__RV_OK);
        }
    }
    for (uint32_t i = 0; i < n; i++)
        if (ops[i].moved) {
            kvt__rrep rep;
            const int rc = kvt__rredirect(w, &ops[i], ops[i].moved, &rep);
            ops[i].moved = NULL;
            kvt__rdone(w, &ops[i], &rep, rc ? KVT__RV_FAULT : KVT__RV_OK);
        }
}

static void kvt__rfetch_finish(kvt__rclient *c, kvt__rfetch *f, uint32_t k)
{
    f->done += k;
    if (k && f->done == f->n) {
        atomic_fetch_add(&c->st_fetch_ns, (uint64_t)(kvt__rnow() - f->t0));
        pthread_cond_broadcast(&f->cv);
    }
}

static void *kvt__rworker_main(void *arg)
{
    kvt__rworker *w = arg;
    kvt__rclient *c = w->c;
    const uint32_t depth = c->o.pipeline;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        kvt__rfetch *f = c->fq;
        if (f) { /* GETs first: a request waits on them */
            const uint32_t a = f->given, b = a + depth < f->n ? a + depth : f->n;
            f->given = b;
            if (b == f->n)
                c->fq = f->next_q;
            pthread_mutex_unlock(&c->mu);
            uint32_t k = 0;
            const uint32_t miss = atomic_load(&f->miss_at);
            for (uint32_t i = a; i < b; i++) {
                if (i > miss) {
                    f->st[i] = KVT__RV_SKIP;
                    continue;
                }
                w->op[k] = (kvt__rop){.f = f, .idx = i, .key = f->name[i], .klen = f->nlen[i]};
                k++;
            }
            kvt__rbatch(w, w->op, k);
            pthread_mutex_lock(&c->mu);
            kvt__rfetch_finish(c, f, b - a);
            continue;
        }
        if (c->put_head) {
            uint32_t k = 0;
            while (c->put_head && k < depth) {
                kvt__rput *q = c->put_head;
                c->put_head = q->next;
                c->queued_bytes -= q->len;
                w->op[k++] = (kvt__rop){.put = q, .key = q->key, .klen = q->klen};
            }
            if (!c->put_head)
                c->put_tail = NULL;
            c->puts_in_flight += k;
            pthread_mutex_unlock(&c->mu);
            kvt__rbatch(w, w->op, k);
            pthread_mutex_lock(&c->mu);
            c->puts_in_flight -= k;
            if (!c->put_head && !c->puts_in_flight)
                pthread_cond_broadcast(&c->idle);
            continue;
        }
        if (c->stop)
            break;
        pthread_cond_wait(&c->work, &c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    for (uint32_t i = 0; i < KVT__RMAX_NODES; i++) {
        redisFree(w->conn[i]);
        free(w->rb[i]);
    }
    free(w->op);
    free(w);
    return NULL;
}

/* ---- creation ---- */
void kvt__rclient_destroy(kvt__rclient *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->mu);
    for (uint32_t i = 0; i < c->n_th; i++)
        pthread_join(c->th[i], NULL);
    for (kvt__rput *q = c->put_head, *nx; q; q = nx) { /* (none: the workers drained it) */
        nx = q->next;
        free(q->val);
        free(q);
    }
    for (void *b = c->buf_free, *nx; b; b = nx) {
        memcpy(&nx, b, sizeof nx);
        free(b);
    }
    pthread_mutex_destroy(&c->buf_mu);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->map_mu);
    pthread_mutex_destroy(&c->log_mu);
    pthread_cond_destroy(&c->work);
    pthread_cond_destroy(&c->idle);
    free(c->slot);
    free(c->endpoints);
    free(c->user);
    free(c->password);
    free(c);
}

int kvt__rclient_create(kvt__rclient **out, const kvt_remote_opts *o, const kvt__rgeom *g)
{
    *out = NULL;
    kvt__rclient *c = calloc(1, sizeof *c);
    if (!c)
        return kvt__err(KVT_ENOMEM, "remote: cannot allocate the client");
    c->g = *g;
    c->o = *o;
    c->o.connect_timeout_ms = o->connect_timeout_ms ? o->connect_timeout_ms : 1000u;
    c->o.io_timeout_ms = o->io_timeout_ms ? o->io_timeout_ms : 1000u;
    c->o.retry_ms = o->retry_ms ? o->retry_ms : 500u;
    c->o.n_connections = o->n_connections ? o->n_connections : 2u;
    /* Depth in bytes is what matters: a worker sends a batch and reads all
     * of it before the next, so deep batches of large values leave the
     * server idle between them. */
    const uint64_t vb = kvt__rvalue_bytes(g), auto_depth = ((4ull << 20) + vb / 2u) / vb;
    c->o.pipeline = o->pipeline ? o->pipeline
                                : (uint32_t)(auto_depth < 1u ? 1u : auto_depth > 32u ? 32u
                                                                                    : auto_depth);
    c->o.queue_bytes = o->queue_bytes ? o->queue_bytes : 256ull << 20;
    c->cluster = -1;
    c->buf_cap = c->o.queue_bytes / kvt__rvalue_bytes(g) + 1u;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->map_mu, NULL);
    pthread_mutex_init(&c->log_mu, NULL);
    pthread_mutex_init(&c->buf_mu, NULL);
    pthread_cond_init(&c->work, NULL);
    pthread_cond_init(&c->idle, NULL);
    c->endpoints = kvt__rdup(o->endpoints);
    c->user = kvt__rdup(o->user);
    c->password = kvt__rdup(o->password);
    c->slot = malloc(KVT__RSLOTS * sizeof *c->slot);
    int rc = 0;
    if (!c->endpoints || !c->slot || (o->user && !c->user) || (o->password && !c->password))
        rc = kvt__err(KVT_ENOMEM, "remote: cannot copy the options");
    if (!rc && o->user && !o->password)
        rc = kvt__err(KVT_EINVAL, "remote->user: '%s' without remote->password", o->user);
    if (!rc)
        rc = kvt__rendpoints(c);
    if (rc) {
        kvt__rclient_destroy(c);
        return rc;
    }
    for (uint32_t s = 0; s < KVT__RSLOTS; s++)
        c->slot[s] = KVT__RNO_NODE;
    /* The workers read the slot map at their first command (nobody
     * answering is not an error: they retry). hiredis writes with write(2):
     * the workers block SIGPIPE (a peer gone is EPIPE, not the process's
     * death), inheriting the mask set around their creation. */
    sigset_t pipe, old;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &old);
    for (uint32_t i = 0; i < c->o.n_connections; i++) {
        kvt__rworker *w = calloc(1, sizeof *w);
        if (w) {
            w->c = c;
            w->op = malloc(c->o.pipeline * sizeof *w->op);
        }
        if (!w || !w->op || pthread_create(&c->th[i], NULL, kvt__rworker_main, w)) {
            if (w)
                free(w->op);
            free(w);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            kvt__rclient_destroy(c);
            return kvt__err(KVT_ENOMEM, "remote: cannot start thread %u of %u", i + 1u,
                            c->o.n_connections);
        }
        c->n_th++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    *out = c;
    return 0;
}

const kvt__rgeom *kvt__rclient_geom(const kvt__rclient *c)
{
    return &c->g;
}

uint32_t kvt__rclient_flags(const kvt__rclient *c)
{
    return c->o.flags;
}

/* ---- value buffers ---- */
uint8_t *kvt__rclient_buf(kvt__rclient *c)
{
    pthread_mutex_lock(&c->buf_mu);
    void *b = c->buf_free;
    if (b) {
        memcpy(&c->buf_free, b, sizeof c->buf_free);
        c->buf_n--;
    }
    pthread_mutex_unlock(&c->buf_mu);
    return b ? b : malloc(kvt__rvalue_bytes(&c->g));
}

void kvt__rclient_buf_free(kvt__rclient *c, uint8_t *b)
{
    if (!b)
        return;
    pthread_mutex_lock(&c->buf_mu);
    const bool keep = c->buf_n < c->buf_cap;
    if (keep) {
        memcpy(b, &c->buf_free, sizeof c->buf_free);
        c->buf_free = b;
        c->buf_n++;
    }
    pthread_mutex_unlock(&c->buf_mu);
    if (!keep)
        free(b);
}

/* ---- writes ---- */
bool kvt__rclient_put(kvt__rclient *c, const char *key, uint8_t *val, size_t len)
{
    kvt__rput *q = val ? malloc(sizeof *q) : NULL;
    pthread_mutex_lock(&c->mu);
    const bool fits = q && c->queued_bytes + len <= c->o.queue_bytes && !c->stop;
    if (fits) {
        q->next = NULL;
        q->klen = strlen(key);
        memcpy(q->key, key, q->klen + 1u);
        q->val = val;
        q->len = len;
        if (c->put_tail)
            c->put_tail->next = q;
        else
            c->put_head = q;
        c->put_tail = q;
        c->queued_bytes += len;
        pthread_cond_signal(&c->work);
    }
    pthread_mutex_unlock(&c->mu);
    if (!fits) {
        free(q);
        kvt__rclient_buf_free(c, val);
        atomic_fetch_add(&c->st_dropped, 1u);
    }
    return fits;
}

static void kvt__rdeadline(struct timespec *t, uint32_t ms)
{
    clock_gettime(CLOCK_REALTIME, t);
    t->tv_sec += ms / 1000u;
    t->tv_nsec += (long)(ms % 1000u) * 1000000L;
    if (t->tv_nsec >= 1000000000L) {
        t->tv_sec++;
        t->tv_nsec -= 1000000000L;
    }
}

int kvt__rclient_flush(kvt__rclient *c, uint32_t timeout_ms)
{
    struct timespec t;
    kvt__rdeadline(&t, timeout_ms);
    int rc = 0;
    pthread_mutex_lock(&c->mu);
    while ((c->put_head || c->puts_in_flight) && !rc)
        if (pthread_cond_timedwait(&c->idle, &c->mu, &t) == ETIMEDOUT &&
            (c->put_head || c->puts_in_flight))
            rc = kvt__err(KVT_ETIMEDOUT, "kvt_remote_flush: %llu bytes still queued and %u "
                          "writes in flight after %u ms", (unsigned long long)c->queued_bytes,
                          c->puts_in_flight, timeout_ms);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* ---- fetches ---- */
/* Frees f and its arrays (any of them may be NULL; f too). */
static void kvt__rfetch_arrays_free(kvt__rfetch *f)
{
    if (!f)
        return;
    free(f->ids);
    free(f->key);
    free(f->name);
    free(f->nlen);
    free(f->val);
    free(f->st);
    free(f);
}

int kvt__rfetch_start(kvt__rclient *c, uint32_t first, uint32_t n, const uint32_t *ids,
                      uint64_t salt, kvt__rkey parent, kvt__rfetch **out)
{
    *out = NULL;
    kvt__rfetch *f = calloc(1, sizeof *f);
    const size_t P = c->g.P;
    if (f) {
        f->ids = malloc((size_t)n * P * sizeof *f->ids);
        f->key = malloc(((size_t)n + 1u) * sizeof *f->key);
        f->name = malloc((size_t)n * sizeof *f->name);
        f->nlen = malloc((size_t)n * sizeof *f->nlen);
        f->val = calloc(n, sizeof *f->val);
        f->st = calloc(n, 1);
    }
    if (!f || !f->ids || !f->key || !f->name || !f->nlen || !f->val || !f->st) {
        kvt__rfetch_arrays_free(f);
        return kvt__err(KVT_ENOMEM, "remote: cannot allocate a fetch of %u values", n);
    }
    f->c = c;
    f->first = first;
    f->n = n;
    f->salt = salt;
    memcpy(f->ids, ids, (size_t)n * P * sizeof *ids);
    f->key[0] = parent;
    for (uint32_t i = 0; i < n; i++) {
        f->key[i + 1u] = kvt__rkey_next(&c->g, f->key[i], ids + i * P, salt);
        f->nlen[i] = kvt__rkey_name(&c->g, f->key[i + 1u], f->name[i]);
    }
    atomic_store(&f->miss_at, n);
    pthread_cond_init(&f->cv, NULL);
    f->t0 = kvt__rnow();
    atomic_fetch_add(&c->st_fetches, 1u);
    pthread_mutex_lock(&c->mu);
    kvt__rfetch **tail = &c->fq;
    while (*tail)
        tail = &(*tail)->next_q;
    *tail = f;
    pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->mu);
    *out = f;
    return 0;
}

int kvt__rfetch_wait(kvt__rfetch *f, uint32_t timeout_ms)
{
    kvt__rclient *c = f->c;
    struct timespec t;
    kvt__rdeadline(&t, timeout_ms);
    pthread_mutex_lock(&c->mu);
    while (f->done < f->n)
        if (pthread_cond_timedwait(&f->cv, &c->mu, &t) == ETIMEDOUT)
            break;
    const bool done = f->done == f->n;
    pthread_mutex_unlock(&c->mu);
    return done ? 0 : KVT_ETIMEDOUT;
}

uint32_t kvt__rfetch_hits(const kvt__rfetch *f)
{
    uint32_t h = 0;
    while (h < f->n && f->st[h] == KVT__RV_OK)
        h++;
    return h;
}

const uint8_t *kvt__rfetch_value(const kvt__rfetch *f, uint32_t i)
{
    return f->val[i];
}

void kvt__rfetch_account(kvt__rfetch *f, uint32_t landed)
{
    atomic_fetch_add(&f->c->st_hit, landed);
    atomic_fetch_add(&f->c->st_miss, f->n - landed);
}

void kvt__rfetch_free(kvt__rfetch *f)
{
    if (!f)
        return;
    kvt__rclient *c = f->c;
    pthread_mutex_lock(&c->mu);
    for (kvt__rfetch **q = &c->fq; *q; q = &(*q)->next_q)
        if (*q == f) {
            *q = f->next_q;
            break;
        }
    kvt__rfetch_finish(c, f, f->n - f->given); /* what no worker took: not asked */
    f->given = f->n;
    while (f->done < f->n) /* what workers took: answered within the io timeout */
        pthread_cond_wait(&f->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    for (uint32_t i = 0; i < f->n; i++)
        kvt__rclient_buf_free(c, f->val[i]);
    pthread_cond_destroy(&f->cv);
    kvt__rfetch_arrays_free(f);
}

void kvt__rclient_stats(kvt__rclient *c, kvt__rstats *s)
{
    s->fetches = atomic_load(&c->st_fetches);
    s->fetch_ns = atomic_load(&c->st_fetch_ns);
    s->hit_values = atomic_load(&c->st_hit);
    s->miss_values = atomic_load(&c->st_miss);
    s->get_bytes = atomic_load(&c->st_get_bytes);
    s->put_values = atomic_load(&c->st_put);
    s->put_bytes = atomic_load(&c->st_put_bytes);
    s->put_dropped = atomic_load(&c->st_dropped);
    s->errors = atomic_load(&c->st_errors);
    s->corrupt = atomic_load(&c->st_corrupt);
    s->redirects = atomic_load(&c->st_redirects);
    pthread_mutex_lock(&c->mu);
    s->queue_bytes = c->queued_bytes;
    pthread_mutex_unlock(&c->mu);
}
