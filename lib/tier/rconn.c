/* The remote tier's nodes (lib/tier/rclient_int.h): the endpoints, a
 * connection to a node (AUTH, timeouts), a node's faults and back-off, the
 * cluster's slot map (CLUSTER SLOTS; a node with cluster support off makes
 * the tier a single node) and the route of a key. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rclient_int.h"

int64_t kvt__rnow(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

struct timeval kvt__rtv(uint32_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000u), (suseconds_t)(ms % 1000u) * 1000};
    return tv;
}

void kvt__rclient_log(kvt__rclient *c, const char *fmt, ...)
{
    if (!c->o.log)
        return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&c->log_mu);
    c->o.log(c->o.log_ctx, msg);
    pthread_mutex_unlock(&c->log_mu);
}

const char *kvt__rnode_name(const kvt__rnode *n, char *buf, size_t len)
{
    if (n->port)
        snprintf(buf, len, "%s:%d", n->host, n->port);
    else
        snprintf(buf, len, "unix:%s", n->host);
    return buf;
}

/* A node's fault: counted, logged, and no connection to it before the
 * back-off (retry_ms, doubling with each fault in a row, up to 64 x). */
void kvt__rnode_fault(kvt__rclient *c, uint32_t i, const char *why)
{
    kvt__rnode *n = &c->node[i];
    const uint32_t f = atomic_fetch_add(&n->fails, 1u);
    const uint64_t ms = (uint64_t)c->o.retry_ms << (f < 6u ? f : 6u);
    atomic_store(&n->down_until, kvt__rnow() + (int64_t)ms * 1000000);
    atomic_fetch_add(&c->st_errors, 1u);
    char nm[300];
    kvt__rclient_log(c, "kvtier remote: %s: %s; not tried again for %llu ms",
                     kvt__rnode_name(n, nm, sizeof nm), why, (unsigned long long)ms);
}

void kvt__rnode_ok(kvt__rclient *c, uint32_t i)
{
    kvt__rnode *n = &c->node[i];
    if (atomic_load_explicit(&n->fails, memory_order_relaxed) &&
        atomic_exchange(&n->fails, 0u)) {
        char nm[300];
        kvt__rclient_log(c, "kvtier remote: %s answers again", kvt__rnode_name(n, nm, sizeof nm));
    }
}

/* The node named host:port, added when new (under mu); -1 when the list is full. */
int kvt__rnode_find(kvt__rclient *c, const char *host, size_t hlen, int port)
{
    const uint32_t n = atomic_load(&c->n_node);
    for (uint32_t i = 0; i < n; i++)
        if (c->node[i].port == port && strlen(c->node[i].host) == hlen &&
            !memcmp(c->node[i].host, host, hlen))
            return (int)i;
    if (n == KVT__RMAX_NODES || hlen >= sizeof c->node[0].host)
        return -1;
    memcpy(c->node[n].host, host, hlen);
    c->node[n].host[hlen] = 0;
    c->node[n].port = port;
    atomic_store(&c->node[n].down_until, 0);
    atomic_store(&c->node[n].fails, 0u);
    atomic_store(&c->n_node, n + 1u);
    return (int)n;
}

/* A connection to node i, authenticated, with the io timeout; NULL (and
 * the fault recorded) when it cannot be had or the node is backing off. */
redisContext *kvt__rconnect(kvt__rclient *c, uint32_t i)
{
    kvt__rnode *n = &c->node[i];
    if (atomic_load(&n->down_until) > kvt__rnow())
        return NULL;
    const struct timeval ct = kvt__rtv(c->o.connect_timeout_ms);
    redisContext *r = n->port ? redisConnectWithTimeout(n->host, n->port, ct)
                              : redisConnectUnixWithTimeout(n->host, ct);
    char why[200];
    if (!r || r->err) {
        snprintf(why, sizeof why, "cannot connect (%s)", r ? r->errstr : "out of memory");
        redisFree(r);
        kvt__rnode_fault(c, i, why);
        return NULL;
    }
    if (redisSetTimeout(r, kvt__rtv(c->o.io_timeout_ms)) != REDIS_OK) {
        redisFree(r);
        kvt__rnode_fault(c, i, "cannot set the io timeout");
        return NULL;
    }
    if (c->password) {
        redisReply *a = c->user ? redisCommand(r, "AUTH %s %s", c->user, c->password)
                                : redisCommand(r, "AUTH %s", c->password);
        if (!a || a->type == REDIS_REPLY_ERROR) {
            snprintf(why, sizeof why, "AUTH refused (%s)",
                     a ? a->str : r->errstr);
            if (a)
                freeReplyObject(a);
            redisFree(r);
            kvt__rnode_fault(c, i, why);
            return NULL;
        }
        freeReplyObject(a);
    }
    return r;
}

/* Reads the slot map from the first node that answers (the endpoints,
 * then the nodes learnt since); a node with cluster support off makes this
 * a single-node tier. Rate-limited to one read per retry_ms. */
void kvt__rmap_read(kvt__rclient *c)
{
    pthread_mutex_lock(&c->map_mu);
    pthread_mutex_lock(&c->mu);
    const int64_t now = kvt__rnow();
    const bool due = now >= c->map_next;
    if (due)
        c->map_next = now + (int64_t)c->o.retry_ms * 1000000;
    pthread_mutex_unlock(&c->mu);
    for (uint32_t i = 0; due && i < atomic_load(&c->n_node); i++) {
        redisContext *r = kvt__rconnect(c, i);
        if (!r)
            continue;
        redisReply *m = redisCommand(r, "CLUSTER SLOTS");
        if (!m) {
            kvt__rnode_fault(c, i, r->errstr);
            redisFree(r);
            continue;
        }
        kvt__rnode_ok(c, i);
        if (m->type == REDIS_REPLY_ERROR && !strstr(m->str, "cluster support disabled")) {
            /* NOPERM, LOADING, CLUSTERDOWN...: this node cannot say; the next may */
            char why[200];
            snprintf(why, sizeof why, "CLUSTER SLOTS: %s", m->str);
            freeReplyObject(m);
            redisFree(r);
            kvt__rnode_fault(c, i, why);
            continue;
        }
        char nm[300];
        int was, now_mode;
        pthread_mutex_lock(&c->mu);
        was = c->cluster;
        if (m->type == REDIS_REPLY_ERROR) { /* cluster support disabled: one node */
            c->cluster = 0;
            for (uint32_t s = 0; s < KVT__RSLOTS; s++)
                c->slot[s] = (uint16_t)i;
        } else if (m->type == REDIS_REPLY_ARRAY) {
            for (uint32_t s = 0; s < KVT__RSLOTS; s++)
                c->slot[s] = KVT__RNO_NODE;
            for (size_t e = 0; e < m->elements; e++) {
                const redisReply *x = m->element[e];
                if (x->type != REDIS_REPLY_ARRAY || x->elements < 3 ||
                    x->element[0]->type != REDIS_REPLY_INTEGER ||
                    x->element[1]->type != REDIS_REPLY_INTEGER ||
                    x->element[2]->type != REDIS_REPLY_ARRAY || x->element[2]->elements < 2 ||
                    x->element[2]->element[0]->type != REDIS_REPLY_STRING ||
                    x->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
                    continue;
                const redisReply *h = x->element[2]->element[0];
                const long long port = x->element[2]->element[1]->integer;
                if (port < 1 || port > 65535) /* (port 0 would name a unix socket) */
                    continue;
                /* An empty address means "the node you asked". */
                const int node = h->len ? kvt__rnode_find(c, h->str, h->len, (int)port) : (int)i;
                const long long lo = x->element[0]->integer, hi = x->element[1]->integer;
                for (long long s = lo; node >= 0 && s <= hi && s >= 0 && s < KVT__RSLOTS; s++)
                    c->slot[s] = (uint16_t)node;
            }
            c->cluster = 1;
        }
        now_mode = c->cluster;
        const uint32_t n_known = atomic_load(&c->n_node);
        pthread_mutex_unlock(&c->mu);
        /* (logged outside mu: the callback may take its time) */
        if (now_mode == 0 && was != 0)
            kvt__rclient_log(c, "kvtier remote: %s is a single node (%s)",
                             kvt__rnode_name(&c->node[i], nm, sizeof nm), m->str);
        if (now_mode == 1 && was != 1)
            kvt__rclient_log(c, "kvtier remote: a cluster of %u known nodes", n_known);
        freeReplyObject(m);
        redisFree(r);
        break;
    }
    pthread_mutex_unlock(&c->map_mu);
}

/* The node of a key; -1 when no node is known for it (after one map read). */
int kvt__rroute(kvt__rclient *c, const char *key, size_t klen)
{
    const uint32_t s = kvt__redis_slot(key, klen);
    for (int pass = 0; pass < 2; pass++) {
        pthread_mutex_lock(&c->mu);
        const int node = c->cluster < 0 ? -1 : c->slot[s] == KVT__RNO_NODE ? -1 : c->slot[s];
        pthread_mutex_unlock(&c->mu);
        if (node >= 0 || pass)
            return node;
        kvt__rmap_read(c);
    }
    return -1;
}

char *kvt__rdup(const char *s)
{
    return s ? strdup(s) : NULL;
}

/* Adds the endpoints as the seed nodes. */
int kvt__rendpoints(kvt__rclient *c)
{
    char *save = NULL;
    for (char *e = strtok_r(c->endpoints, ",", &save); e; e = strtok_r(NULL, ",", &save)) {
        while (*e == ' ')
            e++;
        char b[KVT__BRIEF_MAX];
        int node;
        if (!strncmp(e, "unix:", 5)) {
            const char *path = e + 5;
            while (path[0] == '/' && path[1] == '/') /* unix:///path */
                path++;
            if (!*path)
                return kvt__err(KVT_EINVAL, "remote->endpoints: '%s' names no socket path",
                                kvt__brief(e, b));
            node = kvt__rnode_find(c, path, strlen(path), 0);
        } else {
            const char *h = !strncmp(e, "redis://", 8) ? e + 8 : e;
            const char *colon = strrchr(h, ':');
            char *end = NULL;
            const long port = colon ? strtol(colon + 1, &end, 10) : 6379;
            if (strchr(h, '@') || strchr(h, '/') || (colon && (*end || port < 1 || port > 65535)) ||
                (colon ? colon == h : !*h))
                return kvt__err(KVT_EINVAL, "remote->endpoints: '%s' is not redis://host:port "
                                "or unix:/path (credentials go in remote->user and "
                                "remote->password)", kvt__brief(e, b));
            node = kvt__rnode_find(c, h, colon ? (size_t)(colon - h) : strlen(h), (int)port);
        }
        if (node < 0)
            return kvt__err(KVT_EINVAL, "remote->endpoints: more than %u endpoints, or a name "
                            "longer than 255 characters", KVT__RMAX_NODES);
    }
    if (!atomic_load(&c->n_node))
        return kvt__err(KVT_EINVAL, "remote->endpoints: names no endpoint");
    c->n_seed = atomic_load(&c->n_node);
    return 0;
}
