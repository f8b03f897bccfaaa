/* The remote tier's replies (lib/tier/rclient_int.h), read here from the
 * connection's socket rather than by hiredis: hiredis 0.14 reads a reply 16
 * KiB at a time into its own buffer, copies it twice more before the caller
 * sees it, and allocates whatever size or element count a server
 * announces. Replies to GET, SET and ASKING (the commands the workers
 * pipeline) are a line, or a bulk string: the line goes through a small
 * buffer, a value with large recv(2) calls straight into its final buffer,
 * whose size the reader knows (a value's size follows from the geometry;
 * any other bulk is drained, never allocated), a used one where the client
 * has one. hiredis keeps the connection set-up (connect, AUTH) and CLUSTER
 * SLOTS, before any pipelined command, and the commands' encoding and
 * writes. The socket's receive timeout (hiredis's redisSetTimeout) bounds
 * every read (each one: a server answering slowly but steadily is not cut
 * off). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "rclient_int.h"

static int kvt__rrecv(int fd, void *dst, size_t len, size_t *got)
{
    for (;;) {
        const ssize_t k = recv(fd, dst, len, 0);
        if (k > 0) {
            *got = (size_t)k;
            return 0;
        }
        if (k < 0 && errno == EINTR)
            continue;
        return -1; /* closed, timed out (EAGAIN) or broken */
    }
}

/* More bytes into rb (what it holds moved to its front first). */
static int kvt__rfill(int fd, kvt__rrb *rb)
{
    if (rb->at) {
        memmove(rb->b, rb->b + rb->at, rb->n - rb->at);
        rb->n -= rb->at;
        rb->at = 0;
    }
    size_t got;
    if (rb->n == sizeof rb->b || kvt__rrecv(fd, rb->b + rb->n, sizeof rb->b - rb->n, &got))
        return -1;
    rb->n += got;
    return 0;
}

/* A CRLF-terminated line, without its CRLF, into line[cap]. */
static int kvt__rline(int fd, kvt__rrb *rb, char *line, size_t cap)
{
    for (;;) {
        const char *s = rb->b + rb->at, *e = memchr(s, '\n', rb->n - rb->at);
        if (e) {
            const size_t len = (size_t)(e - s);
            if (len == 0 || e[-1] != '\r' || len - 1u >= cap)
                return -1;
            memcpy(line, s, len - 1u);
            line[len - 1u] = 0;
            rb->at += len + 1u;
            return 0;
        }
        if (rb->n - rb->at > cap || kvt__rfill(fd, rb))
            return -1;
    }
}

/* len bytes into dst (NULL: dropped): what rb holds first, then straight
 * from the socket. */
static int kvt__rbytes(int fd, kvt__rrb *rb, uint8_t *dst, size_t len)
{
    size_t have = rb->n - rb->at < len ? rb->n - rb->at : len;
    if (dst) {
        memcpy(dst, rb->b + rb->at, have);
        dst += have;
    }
    rb->at += have;
    len -= have;
    while (len) {
        size_t got;
        if (dst && len >= sizeof rb->b / 4) { /* a large rest: no copy through rb */
            if (kvt__rrecv(fd, dst, len, &got))
                return -1;
            dst += got;
            len -= got;
            continue;
        }
        rb->at = rb->n = 0;
        if (kvt__rfill(fd, rb))
            return -1;
        have = rb->n < len ? rb->n : len;
        if (dst) {
            memcpy(dst, rb->b, have);
            dst += have;
        }
        rb->at = have;
        len -= have;
    }
    return 0;
}

int kvt__rread(int fd, kvt__rrb *rb, size_t want, uint8_t *dst, kvt__rrep *out)
{
    memset(out, 0, sizeof *out);
    char line[512];
    if (kvt__rline(fd, rb, line, sizeof line))
        return -1;
    char *end = NULL;
    switch (line[0]) {
    case '$': {
        const long long n = strtoll(line + 1, &end, 10);
        if (end == line + 1 || *end)
            return -1;
        if (n < 0) {
            out->type = REDIS_REPLY_NIL;
            return 0;
        }
        out->type = REDIS_REPLY_STRING;
        out->len = (size_t)n;
        uint8_t crlf[2];
        if ((size_t)n == want && dst) {
            out->str = (char *)dst;
            if (kvt__rbytes(fd, rb, dst, want))
                return -1;
        } else if (kvt__rbytes(fd, rb, NULL, (size_t)n)) { /* not a value: drained */
            return -1;
        } else if ((size_t)n == want && want) { /* no buffer for it (out of memory) */
            out->type = REDIS_REPLY_NIL; /* a miss, not a damaged value */
        }
        return kvt__rbytes(fd, rb, crlf, 2) || crlf[0] != '\r' || crlf[1] != '\n' ? -1 : 0;
    }
    case '-':
    case '+':
        out->type = line[0] == '-' ? REDIS_REPLY_ERROR : REDIS_REPLY_STATUS;
        out->len = strlen(line + 1);
        return (out->str = strdup(line + 1)) ? 0 : -1;
    case ':':
        out->type = REDIS_REPLY_INTEGER;
        return 0;
    default:
        return -1; /* arrays or garbage: not a reply to GET, ASKING or SET */
    }
}
