/* Internal declarations shared across lib/ (prefix kvt__, never exported). */
#ifndef KVTIER_INTERNAL_H
#define KVTIER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtier/kvtier.h"

#define KVT__HIDDEN __attribute__((visibility("hidden")))
#define KVT__PRINTF(a, b) __attribute__((format(printf, a, b)))

/* ---- errors (error.c) ---------------------------------------------------
 * Records the thread's detail message and returns code, so call sites read
 * `return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", l, n);`. */
KVT__HIDDEN int kvt__err(int code, const char *fmt, ...) KVT__PRINTF(2, 3);

#define KVT__CHECK_NULL(p)                                                    \
    do {                                                                      \
        if ((p) == NULL)                                                      \
            return kvt__err(KVT_EINVAL, "%s: must not be NULL", #p);          \
    } while (0)

/* ---- options structs (opts.c) -------------------------------------------
 * Copies a caller's options struct of any size >= min_size into dst (size
 * ours, zero-filled first). Rejects a size below min_size and non-zero
 * bytes past ours (a newer caller asking for something we lack). */
KVT__HIDDEN int kvt__opts_copy(void *dst, size_t ours, const void *src, size_t min_size,
                               const char *what);
/* Output struct variant: validates *struct_size at dst, reports how many
 * bytes to fill and zeroes the caller's tail beyond ours. */
KVT__HIDDEN int kvt__out_struct(void *dst, size_t ours, size_t min_size, const char *what,
                                size_t *fill);

/* ---- overflow-checked arithmetic ---------------------------------------- */
static inline bool kvt__mul_u64(uint64_t a, uint64_t b, uint64_t *r)
{
    return !__builtin_mul_overflow(a, b, r);
}
static inline bool kvt__add_u64(uint64_t a, uint64_t b, uint64_t *r)
{
    return !__builtin_add_overflow(a, b, r);
}

/* ---- geometry (geometry.c) ---------------------------------------------- */
/* Validates *g and writes the resolved geometry (defaults applied). */
KVT__HIDDEN int kvt__geometry_resolve(const kvt_geometry *g, kvt_geometry *out);

/* ---- CPU features (cpu.c) ------------------------------------------------ */
#define KVT__CPU_AVX    (1u << 0)
#define KVT__CPU_F16C   (1u << 1)
#define KVT__CPU_FMA    (1u << 2)
#define KVT__CPU_AVX2   (1u << 3)
#define KVT__CPU_AVX512 (1u << 4) /* AVX-512 F + BW */
KVT__HIDDEN uint32_t kvt__cpu_features(void);

/* ---- element conversion (convert.c) ------------------------------------- */
typedef enum { KVT__RN = 0, KVT__RD = 1, KVT__RU = 2 } kvt__round;
KVT__HIDDEN float kvt__f16_to_f32(uint16_t h);
KVT__HIDDEN float kvt__bf16_to_f32(uint16_t h);
KVT__HIDDEN uint16_t kvt__f32_to_f16(float f, kvt__round mode);
KVT__HIDDEN uint16_t kvt__f32_to_bf16(float f, kvt__round mode);
/* n elements of type src -> f32. */
KVT__HIDDEN void kvt__load_f32(float *dst, const void *src, kvt_dtype src_dtype, size_t n);
/* n f32 -> elements of type dst, rounding as given. */
KVT__HIDDEN void kvt__store_f32(void *dst, kvt_dtype dst_dtype, const float *src, size_t n,
                                kvt__round mode);

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
} kvt__arena;

typedef struct kvt__arena_place {
    kvt_numa_policy numa;
    int32_t node;
    bool hugepages;
    bool use_numa; /* allocate with libnuma when it is available */
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

/* ---- backends ------------------------------------------------------------ */
/* CUDA glue (cuda/ when built with nvcc, lib/backend/cuda_none.c otherwise).
 * Returns KVT_ENOTSUP with a message until the CUDA backend's kernels land. */
KVT__HIDDEN int kvt__cuda_pool_init(int32_t device);
KVT__HIDDEN bool kvt__cuda_built(void);

/* ---- pool and sequences (pool.c, seq.c) ---------------------------------- */
typedef struct kvt__seq {
    uint32_t gen;          /* generation of this slot when live */
    bool live;
    uint32_t max_tokens;
    uint64_t user_data;
    uint32_t cap_pages;    /* capacity of each (layer, head) table */
    uint32_t *n_tokens;    /* [L] tokens appended per layer */
    /* Tables indexed [(layer * H + head) * cap_pages + page]. */
    uint32_t *dev_block;   /* device block, 0 = null block */
    uint32_t *host_block;  /* host block, 0 = none */
    uint32_t *meta_slot;   /* metadata slot (every page has one) */
    uint8_t *res;          /* KVT_RES_* bits */
    /* f32 accumulators of the partially filled last page of each
     * (layer, head): [(layer * H + head)][3][D] = min, max, sum. */
    float *acc;
    uint64_t pages_in_tier[KVT_NUM_TIERS];
} kvt__seq;

/* Sequence ids: generation (32 bits) | pool tag (11) | slot + 1 (21). The
 * tag makes an id from one pool unknown to every other live pool. */
#define KVT__ID_SLOT_BITS 21
#define KVT__ID_TAG_BITS 11

struct kvt_pool {
    kvt_backend backend;
    uint32_t tag;           /* 1..2047, from a process-wide counter */
    kvt_geometry g;
    uint32_t n_q_heads;
    size_t elem;            /* bytes per element */
    uint64_t block_bytes;
    uint64_t meta_bytes;    /* bytes of one page's metadata: 3 * D * elem */
    uint32_t max_seqs;
    uint32_t max_seq_tokens;
    uint32_t n_threads;
    uint32_t flags;
    kvt__arena tier[KVT_NUM_TIERS];
    kvt__arena meta;        /* metadata store, device tier; block = one page's meta */
    kvt__seq *seqs;         /* [max_seqs] slots */
    uint32_t *free_seq;     /* stack of free slot indexes */
    uint32_t n_free_seq;
    uint32_t n_live;
    uint64_t pages_in_tier[KVT_NUM_TIERS];
    uint64_t moved_bytes[KVT_NUM_DIRS];
    uint64_t moved_requests[KVT_NUM_DIRS];
    float *scratch;         /* append scratch: [page_tokens][D] f32, plus [D] */
};

/* A tier exists when its arena is mapped. */
static inline bool kvt__has_tier(const kvt_pool *p, uint32_t t)
{
    return p->tier[t].base != NULL;
}

/* Looks up a live sequence; KVT_ENOENT for unknown or released ids. */
KVT__HIDDEN int kvt__seq_lookup(const kvt_pool *p, kvt_seq_id id, kvt__seq **out);
KVT__HIDDEN void kvt__seq_free_pages(kvt_pool *p, kvt__seq *s);
KVT__HIDDEN void kvt__seq_fini(kvt__seq *s);

static inline size_t kvt__lh(const kvt_pool *p, uint32_t layer, uint32_t head)
{
    return (size_t)layer * p->g.n_kv_heads + head;
}
static inline uint32_t kvt__pages_for(const kvt_pool *p, uint32_t tokens)
{
    return (tokens + p->g.page_tokens - 1) / p->g.page_tokens;
}

#endif /* KVTIER_INTERNAL_H */
