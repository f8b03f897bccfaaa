/* The CPU backend: the library's own host code. Its device tier is a DRAM
 * arena the other areas address directly, so it serves only the append
 * through the table; every other entry is NULL (the calling area's host
 * path: the step's thread-pool kernels, memcpy in the mover, the warm-up's
 * host scoring). */
#include "backend.h"

static int kvt__cpu_seq_append(kvt_pool *p, kvt__seq *s, uint32_t layer, const void *k,
                               const void *v, uint32_t n, kvt_dtype src_dtype,
                               uint64_t token_stride)
{
    kvt__append_checked(p, s, layer, k, v, n, src_dtype, token_stride);
    return 0;
}

const kvt__backend kvt__backend_cpu = {
    .version = KVT__BACKEND_V1,
    .name = "cpu",
    .built = true,
    .caps = 0,
    .seq_append = kvt__cpu_seq_append,
};
