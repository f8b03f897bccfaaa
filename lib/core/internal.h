/* Internal declarations shared across lib/ (prefix kvt__, never exported). */
#ifndef KVTIER_INTERNAL_H
#define KVTIER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtier/kvtier.h"
#include "forced.h" /* the forced-page rule (sink, local, partial last page) */

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
#define KVT__CPU_AVX512 (1u << 4) /* AVX-512 F + BW + VL */
KVT__HIDDEN uint32_t kvt__cpu_features(void);

/* ---- CRC32C (crc32c.c) --------------------------------------------------
 * Castagnoli CRC of n bytes continuing from crc (0 to start); the SSE4.2
 * instruction when the CPU has it, else slicing-by-8 tables. The _sw form is
 * always the table version (tests compare the two). */
KVT__HIDDEN uint32_t kvt__crc32c(uint32_t crc, const void *buf, size_t n);
KVT__HIDDEN uint32_t kvt__crc32c_sw(uint32_t crc, const void *buf, size_t n);

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

/* ---- backends ------------------------------------------------------------ */
/* CUDA backend (lib/backend/cuda_pool.c with nvcc, cuda_none.c otherwise):
 * the pool's device tier and metadata store in GPU memory, the per-layer
 * calls as the kernels of cuda/. Every hook but kvt__cuda_built runs only
 * for a pool whose cu is set. */
struct kvt_pool;
struct kvt_step;
struct kvt__seq;
KVT__HIDDEN bool kvt__cuda_built(void);
/* After the arenas' ids exist (bases unset): checks what the backend
 * serves, allocates device memory, sets the device and metadata bases. */
KVT__HIDDEN int kvt__cuda_pool_init(struct kvt_pool *p, const kvt_pool_opts *o);
KVT__HIDDEN void kvt__cuda_pool_fini(struct kvt_pool *p);
/* Prefill/append outside a step: the pages of [cur, cur + n) are allocated
 * in the host tables; uploads their entries, runs the append kernel on the
 * pool's stream and waits for it (k and v are the caller's). */
KVT__HIDDEN int kvt__cuda_seq_append(struct kvt_pool *p, struct kvt__seq *s, uint32_t layer,
                                     const void *k, const void *v, uint32_t n, uint32_t cur,
                                     kvt_dtype src_dtype, uint64_t token_stride);
/* kvt_pool_check's part: every placed GPU table copy equals the host table
 * for every page of every live sequence (waits). */
KVT__HIDDEN int kvt__cuda_check(const struct kvt_pool *p);
/* Copies n bytes of device memory to the host (waits). */
KVT__HIDDEN int kvt__cuda_read(const struct kvt_pool *p, void *dst, const void *dev_src, size_t n);
KVT__HIDDEN int kvt__cuda_step_plan(struct kvt_step *st, void *stream);
KVT__HIDDEN int kvt__cuda_step_append(struct kvt_step *st, uint32_t layer, const void *k,
                                      const void *v, kvt_dtype src_dtype, uint64_t seq_stride,
                                      const uint32_t *cur);
KVT__HIDDEN int kvt__cuda_step_select(struct kvt_step *st, uint32_t layer, const float *q);
/* run (NULL = every sequence, decoded): run[i] == 0 leaves sequence i
 * out of this call (its rows untouched), 1 decodes it, 2 empties it (its
 * output rows zeros, lse -infinity, and its items stay empty). One launch
 * per run of consecutive sequences in the call, all split alike. */
KVT__HIDDEN int kvt__cuda_step_decode(struct kvt_step *st, uint32_t layer, const float *q,
                                      float *out, float *lse, const uint8_t *run);
/* The selection of (sequence, head) ih of the current layer (waits). */
KVT__HIDDEN int kvt__cuda_step_selection(const struct kvt_step *st, size_t ih, uint32_t *pages,
                                         uint32_t capacity, uint32_t *n_pages);
KVT__HIDDEN int kvt__cuda_step_finish(struct kvt_step *st);
/* Pools with a host or disk tier (tiered CUDA pools): the selection of the
 * layer just launched comes back to the host (one event wait), with the
 * votes of reranked heads as the pages' importance. Returns the host copy
 * of the selection in *sel (indexed by st->sel_off, counts in
 * st->sel_cnt). */
KVT__HIDDEN int kvt__cuda_step_fetch(struct kvt_step *st, uint32_t layer, const uint32_t **sel);
/* Before the decode of the sequences with run[i] == 1 (run NULL: all),
 * once their promotions have landed: syncs the layer's changed table
 * entries to the GPU and uploads those sequences' block lists from the host
 * tables. *missing: their selected pages without a device copy (they read
 * as zeros; the decode reports them). */
KVT__HIDDEN int kvt__cuda_step_place(struct kvt_step *st, uint32_t layer, const uint8_t *run,
                                     uint32_t *missing);
/* The tier mover's side: each copy thread (and the I/O thread) has its own
 * low-priority stream; a batch touching the device tier carries an event
 * recorded on the host thread at submit time (after the kernels that wrote
 * or read its blocks), which the copies wait for on the GPU. */
/* A thread's copier: its stream and a pinned list of the copies of the
 * current round. */
KVT__HIDDEN int kvt__cuda_mv_stream(const struct kvt_pool *p, void **copier);
KVT__HIDDEN void kvt__cuda_mv_stream_free(void *copier);
KVT__HIDDEN int kvt__cuda_mv_mark(struct kvt_pool *p, void **event);
KVT__HIDDEN void kvt__cuda_mv_event_free(void *event);
/* Adds a copy of n bytes (either side device memory) to the copier's
 * round, after the event `after`; uva: the host side (if any) is pinned and
 * mapped, so the zero-copy kernel may serve it. A full list issues and
 * waits for the round first. */
KVT__HIDDEN int kvt__cuda_mv_copy(const struct kvt_pool *p, void *copier, void *after, void *dst,
                                  const void *src, size_t n, bool uva);
/* Issues the round (transfers up to kvt__cuda_copy_kernel_max bytes in one
 * launch of the zero-copy kernel, larger ones with cudaMemcpyAsync) and
 * waits for it, even after an error. */
KVT__HIDDEN int kvt__cuda_mv_sync(const struct kvt_pool *p, void *copier);
/* The mover's switch between the copy kernel and cudaMemcpyAsync (bytes;
 * default KVT__CU_COPY_KERNEL_MAX, 1 MiB; tests change it). */
KVT__HIDDEN extern size_t kvt__cuda_copy_kernel_max;
/* Test hook: each copier sleeps this long before issuing a round (0: not
 * at all), so promotions are still in flight when the decode comes. */
KVT__HIDDEN extern uint32_t kvt__cuda_mv_delay_us;
/* Test hook: the next this many copy rounds into the device tier (the
 * promotions) fail with KVT_EIO, copying nothing. */
KVT__HIDDEN extern uint32_t kvt__cuda_mv_fail_rounds;
/* Test hook: CUDA decodes that launched their ready sequences before
 * waiting for the others' promotions (lib/attn/step.c). */
KVT__HIDDEN extern uint64_t kvt__cuda_ready_first;
/* Pins host memory for the GPU in place (the I/O thread's staging);
 * unpin before it is unmapped. */
KVT__HIDDEN int kvt__cuda_host_pin(const struct kvt_pool *p, void *h, size_t bytes);
/* Test hook: kvt__cuda_host_pin fails (the staging stays pageable). */
KVT__HIDDEN extern bool kvt__cuda_pin_refuse;
KVT__HIDDEN void kvt__cuda_host_unpin(const struct kvt_pool *p, void *h);
/* kvt_seq_warmup's importance on the GPU: for every stable (layer, head)
 * lh and page j < pages of layer l, imp[lh * stride + j] = the sum over the
 * n_obs queries of the layer of the page's vote (the CPU's kvt__sel_score
 * summed in query order). Waits for earlier work and for the result;
 * scores with cuBLAS when libcublas loads, else with the fallback kernel. */
KVT__HIDDEN int kvt__cuda_warm_imp(struct kvt_pool *p, struct kvt__seq *s, const float *obs,
                                   uint32_t n_obs, float *imp, size_t stride);
/* The warm-up's first top-K sets (s->topk of the heads with topk_k set)
 * become the GPU's saved sets of the sequence, which the steps reuse. */
KVT__HIDDEN int kvt__cuda_warm_topk(struct kvt_pool *p, struct kvt__seq *s);
/* Bytes of raw scores per GPU scoring call of the warm-up (64 MiB; tests
 * lower it to split the queries into several calls). */
KVT__HIDDEN extern size_t kvt__cuda_warm_budget;


/* ---- worker threads (threads.c) ------------------------------------------ */
#include <pthread.h>
#include <stdatomic.h>
typedef void (*kvt__task_fn)(void *ctx, uint32_t task, uint32_t thread);
typedef struct kvt__tp {
    uint32_t n_threads;          /* including the calling thread */
    bool inited;
    _Atomic bool stop;
    pthread_t *th;
    void *args;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t sleepers;
    _Atomic uint32_t gen;        /* job generation */
    _Atomic uint64_t next;       /* gen << 32 | next task index */
    _Atomic uint32_t done;       /* tasks finished in this job */
    kvt__task_fn fn;
    void *ctx;
    uint32_t n_tasks;
} kvt__tp;
KVT__HIDDEN int kvt__tp_init(kvt__tp *tp, uint32_t n_threads);
KVT__HIDDEN void kvt__tp_fini(kvt__tp *tp);
/* Runs fn(ctx, task, thread) for task < n_tasks on the workers and the
 * calling thread (thread 0); returns when all are done. */
KVT__HIDDEN void kvt__tp_run(kvt__tp *tp, kvt__task_fn fn, void *ctx, uint32_t n_tasks);

/* ---- CPU kernels (lib/attn/kern_*.c) ------------------------------------- */
typedef struct kvt__attn_shape {
    uint32_t G, D, P; /* query heads per KV head, head_dim, page_tokens */
    kvt_dtype dtype;  /* storage dtype */
} kvt__attn_shape;
typedef struct kvt__kernels {
    const char *name;
    /* Online-softmax attention of G prescaled queries q [G][D] over n
     * blocks (ntok[i] valid tokens each). Updates the running maximum m[G],
     * denominator l[G] and unnormalised output acc[G][D]; sbuf holds
     * [G][P] floats of scratch. */
    void (*attn)(const kvt__attn_shape *sh, const float *q, const uint8_t *const *blocks,
                 const uint32_t *ntok, uint32_t n, float *m, float *l, float *acc,
                 float *sbuf);
    /* Scores n pages (metadata slots) for G queries into S[g * stride + i]:
     * MINMAX with qa = max(q, 0), qb = min(q, 0); MEAN with qa = q. */
    void (*score)(const kvt__attn_shape *sh, uint32_t method, const float *qa,
                  const float *qb, const uint8_t *meta_base, uint64_t meta_bytes,
                  const uint32_t *slots, uint32_t n, float *S, size_t stride);
    /* x[i] = exp(x[i] - sub); returns the sum. */
    float (*expsum)(float *x, uint32_t n, float sub);
} kvt__kernels;
KVT__HIDDEN extern const kvt__kernels kvt__kern_portable, kvt__kern_avx2, kvt__kern_avx512;
/* The best kernels this CPU runs, capped by KVTIER_SIMD when set. */
KVT__HIDDEN const kvt__kernels *kvt__kernels_select(void);

/* ---- pool and sequences (lib/api/pool.c; storage: seq.c, append.c) ------- */
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
    /* The last top-K pages chosen per (layer, head) by a step plan's rerank,
     * reused between reranks: [(layer * H + head) * topk_cap + i]. */
    uint32_t *topk;
    uint32_t *topk_n;      /* [L * H] entries used */
    uint32_t *topk_k;      /* [L * H] the K they were chosen for; 0 = none */
    uint32_t topk_cap;
    uint64_t steps;        /* step plans finished with this sequence */
    uint32_t phase;        /* rerank stagger, 0..KVT__PHASES-1 (see kvt_seq_create) */
    /* Tier mover state (lib/tier). Importance and last use of each page,
     * [(layer * H + head) * cap_pages + page], choose what the host tier
     * drops first when it is a cache over the disk. */
    float *imp;            /* last score the selector gave the page */
    uint32_t *use;         /* pool clock of the page's last selection or fetch */
    /* Disk extents of each (layer, head): [(layer * H + head) * ext_cap + i]
     * holds extent id + 1 (0 = none) for pages [i * E, (i + 1) * E). */
    uint32_t *disk_ext;
    uint32_t ext_cap;
    uint32_t busy;         /* pages with a move in flight */
    /* Tiered placement (lib/tier/place.c). */
    uint32_t reloading;    /* moves to the device tier in flight */
    uint64_t wfence;       /* warm-up's promotions (0 = none pending) */
    uint32_t *off_next;    /* [L * H] first page not yet offloaded (stable heads) */
    uint32_t *dlo, *dhi;   /* [L * H] dirty range of the device table ... */
    uint32_t *dstamp;      /* [L * H] ... valid when equal to the pool's step_id */
    /* CUDA backend: where the GPU copy of the device and metadata tables
     * lives in the pool's table heap, laid out for cu_cap pages per head
     * (0 = not uploaded). */
    uint64_t cu_off;
    uint32_t cu_cap;
    /* ... and the entries of the device table changed on the host since the
     * copy was last synced, per (layer, head) [L * H]: pages cu_lo..cu_hi
     * (cu_lo > cu_hi = none). NULL on the CPU backend. */
    uint32_t *cu_lo, *cu_hi;
} kvt__seq;

/* Internal residency bit: a move of the page is in flight (never reported). */
#define KVT__RES_BUSY 0x80u
/* Internal residency bit: the move in flight brings the page to the device
 * tier (its block is reserved). */
#define KVT__RES_INBOUND 0x40u
#define KVT__RES_TIERS (KVT_RES_DEVICE | KVT_RES_HOST | KVT_RES_DISK)

/* Which page owns a host block (for eviction); slot UINT32_MAX = none. */
typedef struct kvt__owner {
    uint32_t slot, lh, page;
} kvt__owner;

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
    const kvt__kernels *kern;
    kvt__tp tp;             /* worker threads, started by the first step plan */
    struct kvt_step *step;  /* the step workspace, reused by every plan */
    struct kvt__disk *disk; /* the disk tier (lib/tier/disk.c), NULL = none */
    struct kvt_mover *mover;/* the tier mover (lib/tier/mover.c) */
    struct kvt__cuda *cu;   /* CUDA backend state (lib/backend/cuda_pool.c), NULL = CPU */
    kvt__owner *host_owner; /* [host blocks] */
    uint32_t clock;         /* advances with every step plan and mover batch */
#define KVT__PHASES 16u
    uint32_t phase_live[KVT__PHASES]; /* live sequences per rerank phase */
    uint32_t phase_next;    /* where the search for the emptiest phase starts */
    /* Tiered placement (lib/tier/place.c): NULL policy = none. */
    const struct kvt_policy *pol;
    const struct kvt_selector *sel;
    uint32_t step_id;       /* advances with every step plan (dirty ranges) */
    /* Hook of the tiers that keep per-page state of their own: called when
     * a sequence's block tables grow to cap_pages pages per (layer, head)
     * (kvt__seq_reserve); set at pool creation (lib/api/pool.c). A failure
     * leaves the tables as they were. */
    int (*on_table_grow)(struct kvt_pool *p, struct kvt__seq *s, uint32_t cap_pages);
    struct {
        uint64_t sel_pages, sel_resident, promoted, recycled, evicted, offloaded, reranked,
            paused;
    } pst;
};

/* A tiered pool's stable head (lh = layer * H + head). */
KVT__HIDDEN bool kvt__stable(const kvt_pool *p, size_t lh);
/* Records that the device table entry (s, lh, page) changed in this step. */
static inline void kvt__dirty(const kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page)
{
    if (s->cu_lo) { /* CUDA: the GPU's table copy catches up at its next use */
        if (s->cu_lo[lh] > s->cu_hi[lh])
            s->cu_lo[lh] = s->cu_hi[lh] = page;
        else if (page < s->cu_lo[lh])
            s->cu_lo[lh] = page;
        else if (page > s->cu_hi[lh])
            s->cu_hi[lh] = page;
    }
    if (!s->dstamp)
        return;
    if (s->dstamp[lh] != p->step_id) {
        s->dstamp[lh] = p->step_id;
        s->dlo[lh] = s->dhi[lh] = page;
    } else if (page < s->dlo[lh]) {
        s->dlo[lh] = page;
    } else if (page > s->dhi[lh]) {
        s->dhi[lh] = page;
    }
}

/* A memory tier exists when its arena is mapped; the disk tier when its
 * file is open. */
static inline bool kvt__has_tier(const kvt_pool *p, uint32_t t)
{
    return t == KVT_TIER_DISK ? p->disk != NULL : p->tier[t].base != NULL;
}
/* A CUDA pool with a host or disk tier: placement runs on the host. */
static inline bool kvt__cuda_lower(const kvt_pool *p)
{
    return p->cu && (p->tier[KVT_TIER_HOST].base || p->disk);
}

/* Sequence storage (seq.c). Looks up a live sequence; KVT_ENOENT for
 * unknown or released ids. */
KVT__HIDDEN int kvt__seq_lookup(const kvt_pool *p, kvt_seq_id id, kvt__seq **out);
/* The id of slot `slot` at generation gen, and the slot an id names. */
KVT__HIDDEN kvt_seq_id kvt__seq_id_make(const kvt_pool *p, uint32_t slot, uint32_t gen);
KVT__HIDDEN uint32_t kvt__seq_id_slot(kvt_seq_id id);
/* Frees a slot's state (its pages must be freed first); keeps the
 * generation. */
KVT__HIDDEN void kvt__seq_fini(kvt__seq *s);

static inline size_t kvt__lh(const kvt_pool *p, uint32_t layer, uint32_t head)
{
    return (size_t)layer * p->g.n_kv_heads + head;
}
static inline uint32_t kvt__pages_for(const kvt_pool *p, uint32_t tokens)
{
    return (tokens + p->g.page_tokens - 1) / p->g.page_tokens;
}

/* Grows the sequence's block tables to hold `pages` pages per (layer,
 * head), and through p->on_table_grow the tiers' own tables;
 * all-or-nothing (seq.c). */
KVT__HIDDEN int kvt__seq_reserve(kvt_pool *p, kvt__seq *s, uint32_t pages);
/* Allocates the device blocks and metadata slots of the pages n_tokens more
 * tokens of one layer open (append.c); blocks are known to be available. */
KVT__HIDDEN void kvt__append_alloc(kvt_pool *p, kvt__seq *s, uint32_t layer, uint32_t n_tokens);
/* Undoes kvt__append_alloc (the sequence still holds the old length). */
KVT__HIDDEN void kvt__append_unalloc(kvt_pool *p, kvt__seq *s, uint32_t layer, uint32_t n_tokens);
/* Appends n_tokens of one layer once every argument has been checked and
 * blocks are known to be available (append.c); cannot fail. */
KVT__HIDDEN void kvt__append_checked(kvt_pool *p, kvt__seq *s, uint32_t layer, const void *k,
                                     const void *v, uint32_t n_tokens, kvt_dtype src_dtype,
                                     uint64_t token_stride);
/* The step workspace of a pool (lib/step/step.c). */
KVT__HIDDEN void kvt__step_free(struct kvt_step *st);
KVT__HIDDEN bool kvt__step_is_open(const struct kvt_step *st);
/* Makes sure a sequence can keep `cap` top-K pages per (layer, head)
 * (seq.c). */
KVT__HIDDEN int kvt__seq_topk_reserve(const kvt_pool *p, kvt__seq *s, uint32_t cap);

/* ---- selector (lib/select) ----------------------------------------------- */
struct kvt_selector {
    kvt_geometry g;
    kvt_score_method method;
    kvt_vote vote;
    float vote_scale;
    uint32_t *k, *sink, *local, *interval; /* [L * H] */
};
/* Scratch of one selection: G * np + np floats, np uint32 and np bytes,
 * plus 2 * G * D floats of query rows. */
typedef struct kvt__sel_scratch {
    float *S;       /* [G][np] raw scores */
    float *vote;    /* [np] */
    uint32_t *idx;  /* [np] */
    uint8_t *mark;  /* [np] */
    float *qa, *qb; /* [G][D] each */
} kvt__sel_scratch;
KVT__HIDDEN size_t kvt__sel_scratch_bytes(uint32_t G, uint32_t D, uint32_t np);
KVT__HIDDEN void kvt__sel_scratch_carve(kvt__sel_scratch *sc, void *mem, uint32_t G, uint32_t D,
                                        uint32_t np);
/* Checks that sel fits the pool's geometry (KVT_EINVAL naming the field). */
KVT__HIDDEN int kvt__selector_match(const kvt_selector *sel, const kvt_pool *p);
/* Voted scores of the np pages of (s, layer, head) into sc->vote. */
KVT__HIDDEN void kvt__sel_score(const kvt_selector *sel, const kvt_pool *p, const kvt__seq *s,
                                uint32_t layer, uint32_t head, const float *q, uint32_t np,
                                kvt__sel_scratch *sc);
/* The selection rule over np pages of a sequence with `tokens` tokens:
 * sink, local and a partial last page forced, then the top k of the rest
 * by (vote desc, index asc). Writes the sorted selection to out (returns its
 * count) and, when topk is not NULL, the top-k part alone to topk (sorted)
 * with its count in *n_topk. With vote == NULL, reuse_topk[n_reuse] stands
 * in for the top-k part. */
KVT__HIDDEN uint32_t kvt__sel_pick(uint32_t np, uint32_t tokens, uint32_t P, uint32_t k,
                                   uint32_t sink, uint32_t local, const float *vote,
                                   const uint32_t *reuse_topk, uint32_t n_reuse,
                                   kvt__sel_scratch *sc, uint32_t *out, uint32_t *topk,
                                   uint32_t *n_topk);
/* Upper bound of kvt__sel_pick's count. */
static inline uint32_t kvt__sel_bound(uint32_t np, uint32_t k, uint32_t sink, uint32_t local)
{
    uint64_t b = (uint64_t)k + sink + local + 1u;
    return b < np ? (uint32_t)b : np;
}

#endif /* KVTIER_INTERNAL_H */
