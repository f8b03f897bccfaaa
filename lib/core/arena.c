/* Tier arenas: one big mapping cut into fixed-size blocks, with an O(1)
 * free-id stack. Memory comes from mmap (pages are touched lazily) or, for
 * a NUMA placement, from libnuma, which binds the mapping to a node. */
#include <errno.h>
#include <numa.h>
#include <string.h>
#include <sys/mman.h>

#include "arena.h"

static void *kvt__map(size_t bytes, const kvt__arena_place *pl, bool *numa)
{
    *numa = false;
    if (pl && pl->use_numa && kvt__numa_available()) {
        void *p = NULL;
        switch (pl->numa) {
        case KVT_NUMA_NODE:
            p = numa_alloc_onnode(bytes, pl->node);
            break;
        case KVT_NUMA_INTERLEAVE:
            p = numa_alloc_interleaved(bytes);
            break;
        default:
            p = numa_alloc_local(bytes);
            break;
        }
        if (p) {
            *numa = true;
            return p;
        }
        /* libnuma could not place it (a node without free memory, a
         * restricted cpuset): plain pages, placed by the kernel's default
         * policy, rather than no host tier at all. */
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

int kvt__arena_init(kvt__arena *a, uint64_t block_bytes, uint32_t n_blocks,
                    const kvt__arena_place *pl, const char *tier_name)
{
    uint64_t bytes;
    memset(a, 0, sizeof *a);
    if (n_blocks < 2)
        return kvt__err(KVT_EINVAL, "%s: room for %u blocks; at least 2 are needed "
                        "(block 0 is the null block)", tier_name, n_blocks);
    if (!kvt__mul_u64(block_bytes, n_blocks, &bytes) || bytes > SIZE_MAX / 2)
        return kvt__err(KVT_EOVERFLOW, "%s: %u blocks of %llu bytes overflow", tier_name,
                        n_blocks, (unsigned long long)block_bytes);
    a->stack_bytes = (size_t)n_blocks * sizeof(uint32_t);
    void *st = mmap(NULL, a->stack_bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (st == MAP_FAILED)
        return kvt__err(KVT_ENOMEM, "%s: cannot map the free list of %u blocks: %s",
                        tier_name, n_blocks, strerror(errno));
    a->stack = st;
    if (pl && pl->no_base) {
        a->ext = true; /* the caller sets base */
    } else if (!(a->base = kvt__map((size_t)bytes, pl, &a->numa))) {
        int e = errno;
        munmap(a->stack, a->stack_bytes);
        a->stack = NULL;
        return kvt__err(KVT_ENOMEM, "%s: cannot map %llu bytes (%u blocks): %s", tier_name,
                        (unsigned long long)bytes, n_blocks, strerror(e));
    }
    a->map_bytes = (size_t)bytes;
    a->block_bytes = block_bytes;
    a->n_blocks = n_blocks;
    if (pl && pl->hugepages && a->base)
        (void)madvise(a->base, a->map_bytes, MADV_HUGEPAGE); /* a hint; fine if refused */
    /* O(1): nothing is touched; ids are handed out from `bump` upward, so a
     * fresh pool's pages are in address order. */
    a->bump = 1;
    a->n_stack = 0;
    a->n_free = n_blocks - 1u;
    return 0;
}

void kvt__arena_fini(kvt__arena *a)
{
    if (a->base && !a->ext) {
        if (a->numa)
            numa_free(a->base, a->map_bytes);
        else
            munmap(a->base, a->map_bytes);
    }
    if (a->stack)
        munmap(a->stack, a->stack_bytes);
    memset(a, 0, sizeof *a);
}
