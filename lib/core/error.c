/* Error codes, their names and descriptions, and the per-thread detail. */
#include <string.h>
#include <stdarg.h>
#include <stdio.h>

#include "base.h"

#define KVT__ERRMSG_MAX 512

/* Per thread so that concurrent pools report independently. */
static _Thread_local char kvt__errmsg[KVT__ERRMSG_MAX];

struct kvt__errdesc {
    int code;
    const char *name;
    const char *text;
};

static const struct kvt__errdesc kvt__errs[] = {
    {KVT_OK, "KVT_OK", "success"},
    {KVT_EINVAL, "KVT_EINVAL", "invalid argument"},
    {KVT_ENOMEM, "KVT_ENOMEM", "out of memory"},
    {KVT_ENOSPC, "KVT_ENOSPC", "no free block left in the tier"},
    {KVT_ENOTSUP, "KVT_ENOTSUP", "not supported by this build or backend"},
    {KVT_EIO, "KVT_EIO", "input/output error"},
    {KVT_ECORRUPT, "KVT_ECORRUPT", "checksum or format check failed"},
    {KVT_ENOENT, "KVT_ENOENT", "no such object"},
    {KVT_ERANGE, "KVT_ERANGE", "value out of range"},
    {KVT_EOVERFLOW, "KVT_EOVERFLOW", "size computation overflows"},
    {KVT_ESTATE, "KVT_ESTATE", "call not valid in the current state"},
    {KVT_EBUSY, "KVT_EBUSY", "object is busy"},
    {KVT_ETIMEDOUT, "KVT_ETIMEDOUT", "timed out"},
    {KVT_EAGAIN, "KVT_EAGAIN", "not ready, try again"},
    {KVT_EINTERNAL, "KVT_EINTERNAL", "internal invariant violated"},
};

static const struct kvt__errdesc *kvt__find(int code)
{
    for (size_t i = 0; i < sizeof kvt__errs / sizeof kvt__errs[0]; i++)
        if (kvt__errs[i].code == code)
            return &kvt__errs[i];
    return NULL;
}

KVT_API const char *kvt_strerror(int code)
{
    const struct kvt__errdesc *d = kvt__find(code);
    return d ? d->text : "unknown error code";
}

KVT_API const char *kvt_err_name(int code)
{
    const struct kvt__errdesc *d = kvt__find(code);
    return d ? d->name : "KVT_E?";
}

KVT_API const char *kvt_last_error(void)
{
    return kvt__errmsg;
}

KVT_API void kvt_clear_error(void)
{
    kvt__errmsg[0] = '\0';
}

const char *kvt__brief(const char *path, char *buf)
{
    const size_t n = strlen(path);
    if (n < KVT__BRIEF_MAX)
        return path;
    const size_t head = 60, tail = KVT__BRIEF_MAX - head - 4;
    memcpy(buf, path, head);
    memcpy(buf + head, "...", 3);
    memcpy(buf + head + 3, path + n - tail, tail);
    buf[head + 3 + tail] = '\0';
    return buf;
}

int kvt__err(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kvt__errmsg, sizeof kvt__errmsg, fmt, ap);
    va_end(ap);
    return code;
}
