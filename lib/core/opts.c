/* Versioned options structs: struct_size first, fields only appended. */
#include <string.h>

#include "base.h"

static int kvt__tail_zero(const uint8_t *p, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++)
        if (p[i] != 0)
            return 0;
    return 1;
}

/* The largest struct_size accepted: a newer header may have grown a struct,
 * not by megabytes; a size above this is a garbage field, and reading that
 * far past the caller's struct would leave it. */
#define KVT__STRUCT_SIZE_MAX 4096u

int kvt__opts_copy(void *dst, size_t ours, const void *src, size_t min_size, const char *what)
{
    uint32_t size;
    memcpy(&size, src, sizeof size);
    if (size > KVT__STRUCT_SIZE_MAX)
        return kvt__err(KVT_EINVAL, "%s->struct_size: %u is above %u (not a size this or a "
                        "later version of the struct can have)", what, size,
                        KVT__STRUCT_SIZE_MAX);
    if (size < min_size)
        return kvt__err(KVT_EINVAL, "%s->struct_size: %u is below the first version's %zu",
                        what, size, min_size);
    if (size > ours && !kvt__tail_zero(src, ours, size))
        return kvt__err(KVT_EINVAL,
                        "%s->struct_size: %u bytes with non-zero fields past the %zu this "
                        "library knows (a newer caller asking for an unknown option)",
                        what, size, ours);
    memset(dst, 0, ours);
    memcpy(dst, src, size < ours ? size : ours);
    return 0;
}

int kvt__out_struct(void *dst, size_t ours, size_t min_size, const char *what, size_t *fill)
{
    uint32_t size;
    memcpy(&size, dst, sizeof size);
    if (size > KVT__STRUCT_SIZE_MAX)
        return kvt__err(KVT_EINVAL, "%s->struct_size: %u is above %u (not a size this or a "
                        "later version of the struct can have)", what, size,
                        KVT__STRUCT_SIZE_MAX);
    if (size < min_size)
        return kvt__err(KVT_EINVAL, "%s->struct_size: %u is below the first version's %zu",
                        what, size, min_size);
    if (size > ours)
        memset((uint8_t *)dst + ours, 0, size - ours);
    *fill = size < ours ? size : ours;
    return 0;
}
int kvt__similarity_check(float t, const char *name)
{
    if (!(t >= -1.0f && t <= 1.0f))
        return kvt__err(KVT_EINVAL, "%s: %g is not a cosine similarity threshold (-1 .. 1; "
                        "-1 = never rerank on similarity)", name, (double)t);
    return 0;
}
