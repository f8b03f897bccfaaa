/* Tier memory: arenas of fixed-size blocks with O(1) allocation, and the
 * libnuma helpers (arena.c, numa.c). */
#ifndef KVTIER_ARENA_H
#define KVTIER_ARENA_H

#include "base.h"

/* ---- arenas and block allocators (arena.c) -------------------------------
 * A tier's memory: n_blocks fixed-size blocks, block 0 = the null block
 * (zeroed, never handed out). Allocation and free are O(1) through a stack
 * of free block ids. */
typedef struct kvt__arena {
    uint8_t *base;
    size_t map_bytes;   /* bytes mapped (for unmap) */
    uint64_t block_bytes;
    uint32_t n_blocks;  /* including the null block */
    uint32_t n_free;    /* n_stack + (n_blocks - bump) */
    uint32_t bump;      /* ids >= bump were never handed out */
    uint32_t n_stack;
    uint32_t *stack;    /* freed ids (mapped lazily: untouched until used) */
    size_t stack_bytes;
    bool numa;          /* base came from libnuma */
    bool ext;           /* base is not the arena's own (CUDA device memory) */
} kvt__arena;

typedef struct kvt__arena_place {
    kvt_numa_policy numa;
    int32_t node;
    bool hugepages;
    bool use_numa; /* allocate with libnuma when it is available */
    bool no_base;  /* ids only: the caller supplies base (CUDA device memory) */
} kvt__arena_place;

KVT__HIDDEN int kvt__arena_init(kvt__arena *a, uint64_t block_bytes, uint32_t n_blocks,
                                const kvt__arena_place *place, const char *tier_name);
KVT__HIDDEN void kvt__arena_fini(kvt__arena *a);
static inline uint8_t *kvt__arena_block(const kvt__arena *a, uint32_t id)
{
    return a->base + (size_t)id * (size_t)a->block_bytes;
}
/* Returns a block id >= 1, or 0 when the arena is full. Freed ids are
 * reused first (LIFO, warm in cache); then never-used ids in order. */
static inline uint32_t kvt__arena_alloc(kvt__arena *a)
{
    if (a->n_stack) {
        a->n_free--;
        return a->stack[--a->n_stack];
    }
    if (a->bump < a->n_blocks) {
        a->n_free--;
        return a->bump++;
    }
    return 0;
}
static inline void kvt__arena_free(kvt__arena *a, uint32_t id)
{
    a->stack[a->n_stack++] = id;
    a->n_free++;
}
/* libnuma helpers (numa.c). */
KVT__HIDDEN bool kvt__numa_available(void);
/* Whether `node` exists and has memory this process may use. */
KVT__HIDDEN bool kvt__numa_node_ok(int node);
KVT__HIDDEN int kvt__numa_max_node(void);

#endif /* KVTIER_ARENA_H */
