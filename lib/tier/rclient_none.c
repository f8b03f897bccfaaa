/* The remote tier's client in a build without hiredis: a pool cannot have
 * a remote tier (KVT_ENOTSUP); nothing else is ever called. */
#include <stdlib.h>
#include <string.h>

#include "tier.h"

const bool kvt__rclient_built = false;

int kvt__rclient_create(kvt__rclient **out, const kvt_remote_opts *o, const kvt__rgeom *g)
{
    (void)o;
    (void)g;
    *out = NULL;
    return kvt__err(KVT_ENOTSUP, "opts->remote: this libkvtier was built without hiredis "
                    "(libhiredis-dev): no remote tier");
}

void kvt__rclient_destroy(kvt__rclient *c)
{
    (void)c;
}

const kvt__rgeom *kvt__rclient_geom(const kvt__rclient *c)
{
    (void)c;
    return NULL;
}

uint32_t kvt__rclient_flags(const kvt__rclient *c)
{
    (void)c;
    return 0;
}

uint8_t *kvt__rclient_buf(kvt__rclient *c)
{
    (void)c;
    return NULL;
}

void kvt__rclient_buf_free(kvt__rclient *c, uint8_t *b)
{
    (void)c;
    free(b);
}

bool kvt__rclient_put(kvt__rclient *c, const char *key, uint8_t *val, size_t len)
{
    (void)c;
    (void)key;
    (void)len;
    free(val);
    return false;
}

int kvt__rclient_flush(kvt__rclient *c, uint32_t timeout_ms)
{
    (void)c;
    (void)timeout_ms;
    return 0;
}

int kvt__rfetch_start(kvt__rclient *c, uint32_t first, uint32_t n, const uint32_t *ids,
                      uint64_t salt, kvt__rkey parent, kvt__rfetch **out)
{
    (void)c;
    (void)first;
    (void)n;
    (void)ids;
    (void)salt;
    (void)parent;
    *out = NULL;
    return KVT_ENOTSUP;
}

int kvt__rfetch_wait(kvt__rfetch *f, uint32_t timeout_ms)
{
    (void)f;
    (void)timeout_ms;
    return 0;
}

uint32_t kvt__rfetch_hits(const kvt__rfetch *f)
{
    (void)f;
    return 0;
}

const uint8_t *kvt__rfetch_value(const kvt__rfetch *f, uint32_t i)
{
    (void)f;
    (void)i;
    return NULL;
}

void kvt__rfetch_account(kvt__rfetch *f, uint32_t landed)
{
    (void)f;
    (void)landed;
}

void kvt__rfetch_free(kvt__rfetch *f)
{
    (void)f;
}

void kvt__rclient_log(kvt__rclient *c, const char *fmt, ...)
{
    (void)c;
    (void)fmt;
}

void kvt__rclient_stats(kvt__rclient *c, kvt__rstats *s)
{
    (void)c;
    memset(s, 0, sizeof *s);
}
