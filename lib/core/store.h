/* The page store: the pool, its sequences' storage (ids, block tables,
 * residency, page metadata slots, dirty ranges) and the helpers every
 * layer above reads them with. The pool's members that other areas own
 * (step, mover, disk, CUDA state, kernels) are opaque pointers here. */
#ifndef KVTIER_STORE_H
#define KVTIER_STORE_H

#include "arena.h"
#include "forced.h" /* the forced-page rule (sink, local, partial last page) */
#include "threads.h"

struct kvt__kernels;
struct kvt_step;
struct kvt__disk;
struct kvt_mover;
struct kvt__cuda;
struct kvt_policy;

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
    uint32_t *meta_slot;   /* metadata slot (every page has one): the physical
                            * page's id, shared by every table that holds it */
    uint8_t *res;          /* KVT_RES_* bits */
    /* Sharing (share.c): the next sequence whose table holds the same
     * physical page at the same (layer, head, page), as its slot + 1, in a
     * ring through every holder; 0 = this table alone holds it. The tables
     * above are each holder's view of the page, kept equal by the writers
     * (kvt__page_* in share.c). */
    uint32_t *share;
    /* f32 accumulators of the partially filled last page of each
     * (layer, head): [(layer * H + head)][3][D] = min, max, sum. */
    float *acc;
    uint64_t pages_in_tier[KVT_NUM_TIERS];
    /* Selection state (lib/select, lib/step): the last top-K pages chosen per
     * (layer, head) by a step plan's rerank, reused between reranks:
     * [(layer * H + head) * topk_cap + i], and the rerank schedule. */
    struct kvt__seq_sel {
        uint32_t *topk;
        uint32_t *topk_n;  /* [L * H] entries used */
        uint32_t *topk_k;  /* [L * H] the K they were chosen for; 0 = none */
        uint32_t topk_cap;
        /* [L * H][D] the query (group mean) of each head's last rerank on
         * the CPU backend, for the selection cache; allocated with topk. */
        float *qref;
        uint32_t phase;    /* rerank stagger, 0..KVT__PHASES-1 (see kvt_seq_create) */
        uint64_t steps;    /* step plans finished with this sequence */
    } sel;
    /* Tier state (lib/tier): the mover, the disk tier and the placement. */
    struct kvt__seq_tier {
        /* Importance and last use of each page, [(layer * H + head) *
         * cap_pages + page], choose what the host tier drops first when it
         * is a cache over the disk. */
        float *imp;        /* last score the selector gave the page */
        uint32_t *use;     /* pool clock of the page's last selection or fetch */
        /* Disk extents of each (layer, head): [(layer * H + head) * ext_cap
         * + i] holds extent id + 1 (0 = none) for pages [i * E, (i + 1) * E). */
        uint32_t *disk_ext;
        uint32_t ext_cap;
        uint32_t busy;     /* pages with a move in flight */
        uint32_t reloading; /* moves to the device tier in flight */
        uint64_t wfence;   /* warm-up's promotions (0 = none pending) */
        uint32_t *off_next; /* [L * H] first page not yet offloaded (stable heads) */
        uint32_t *dlo, *dhi; /* [L * H] dirty range of the device table ... */
        uint32_t *dstamp;  /* [L * H] ... valid when equal to the pool's step_id */
        struct kvt__rfetch *rfetch; /* remote pages awaited (the sequence is loading) */
    } tier;
    /* Prefix cache state (lib/tier/prefix.c): the sequence's salt, the token
     * ids of positions 0 .. n_ids - 1, and per page the chain key and the
     * index entry holding that content (a reference: generation << 32 |
     * entry + 1; 0 = none), valid for pages 0 .. n_reg - 1 as of the
     * index's epoch `epoch`. */
    struct kvt__seq_pfx {
        uint64_t salt;
        uint32_t *ids;
        uint32_t n_ids, cap_ids;   /* cap_ids: a multiple of the page size */
        uint64_t *key, *ent;       /* [cap_ids / page_tokens] */
        uint32_t n_reg, epoch;
        uint32_t n_key;            /* pages whose key is computed (valid until a cut) */
        uint32_t matched;          /* tokens attached at creation (local and remote) */
        uint32_t rhave;            /* pages below it came from the remote tier: not written back */
        uint32_t rtokens;          /* tokens landed from the remote tier */
        bool dropped;              /* its salt was dropped: its pages are never keyed again */
    } pfx;
    /* Backend state (lib/backend; the CUDA backend): where the GPU copy of
     * the device and metadata tables lives in the pool's table heap, laid
     * out for cu_cap pages per head (0 = not uploaded), and the entries of
     * the device table changed on the host since the copy was last synced,
     * per (layer, head) [L * H]: pages cu_lo..cu_hi (cu_lo > cu_hi = none).
     * Zero on the CPU backend. */
    struct kvt__seq_be {
        uint64_t cu_off;
        uint32_t cu_cap;
        uint32_t *cu_lo, *cu_hi;
    } be;
} kvt__seq;

/* Internal residency bit: a move of the page is in flight (never reported). */
#define KVT__RES_BUSY 0x80u
/* Internal residency bit: the move in flight brings the page to the device
 * tier (its block is reserved). */
#define KVT__RES_INBOUND 0x40u
#define KVT__RES_TIERS (KVT_RES_DEVICE | KVT_RES_HOST | KVT_RES_DISK)
/* Internal residency bit: the page holds a NaN or infinite key (set by the
 * CPU backend's append): a decode that attends the page reports NaN. */
#define KVT__RES_NONFINITE 0x20u

/* Which page owns a host block (for eviction); slot UINT32_MAX = none,
 * KVT__OWNER_PFX = a cached page no sequence holds (lh = its entry's page
 * index in the prefix cache, lib/tier/prefix.c). */
#define KVT__OWNER_PFX (UINT32_MAX - 1u)
typedef struct kvt__owner {
    uint32_t slot, lh, page;
} kvt__owner;

/* Sequence ids: generation (32 bits) | pool tag (11) | slot + 1 (21). The
 * tag makes an id from one pool unknown to every other live pool. */
#define KVT__ID_SLOT_BITS 21
#define KVT__ID_TAG_BITS 11

/* Backend capabilities and refusals (kvt__backend.caps, lib/backend). */
#define KVT__BE_DEVICE_REMOTE   (1u << 0) /* device tier and metadata not in host memory */
#define KVT__BE_NO_PROFILER     (1u << 1) /* steps do not feed a profiler */
#define KVT__BE_NO_DENSE_TIERED (1u << 2) /* no KVT_STEP_DENSE in a pool with a policy */
#define KVT__BE_NO_HOST_SELECT  (1u << 3) /* no kvt_selector_select (it reads metadata on the host) */
#define KVT__BE_NO_MULTI_SPARSE (1u << 4) /* several tokens per sequence in dense steps only */

struct kvt__backend;
struct kvt_pool {
    kvt_backend backend;
    const struct kvt__backend *be; /* the backend's table (lib/backend/backend.h) */
    uint32_t be_caps;       /* be->caps */
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
    kvt__arena meta;        /* metadata store, device tier: slot ids, and the two planes
                             * of kvt__meta_mm / kvt__meta_mean in its memory */
    kvt__seq *seqs;         /* [max_seqs] slots */
    uint32_t *free_seq;     /* stack of free slot indexes */
    uint32_t n_free_seq;
    uint32_t n_live;
    uint64_t pages_in_tier[KVT_NUM_TIERS];
    uint64_t moved_bytes[KVT_NUM_DIRS];
    uint64_t moved_requests[KVT_NUM_DIRS];
    float *scratch;         /* append scratch: [page_tokens][D] f32, plus [D] */
    const struct kvt__kernels *kern;
    kvt__tp tp;             /* worker threads, started by the first step plan */
    /* Step handles, used in turn by the plans (lib/step/plan.c), so that a
     * finished step's handle stays KVT_ESTATE for the next KVT__STEP_RING - 1
     * plans instead of naming the next step; the workspace moves to the
     * handle in use. step: the latest (open or finished). */
    struct kvt_step *step;
    struct kvt_step *step_ring[16];
    uint32_t step_next;
    struct kvt__disk *disk; /* the disk tier (lib/tier/disk.c), NULL = none */
    struct kvt_mover *mover;/* the tier mover (lib/tier/mover.c) */
    struct kvt__cuda *cu;   /* CUDA backend state (lib/backend/cuda_pool.c), NULL = CPU */
    kvt__owner *host_owner; /* [host blocks]: one holder of the page */
    uint32_t *pg_ref;       /* [metadata slots] tables holding the physical page */
    uint32_t *pg_mark;      /* [metadata slots] round that last claimed the page */
    uint32_t *pg_hold;      /* [metadata slots] slot + 1 of one holder; 0 = none */
    struct kvt__pfx *pfx;   /* the prefix cache (lib/tier/prefix.c), NULL = off */
    struct kvt__rclient *remote; /* the remote tier (lib/tier/rclient.c), NULL = none */
    uint32_t mark_round;    /* kvt__page_claim_round */
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
            paused, sel_heads, sim_reranked;
    } pst;
};

/* Records that the device table entry (s, lh, page) changed in this step. */
static inline void kvt__dirty(const kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page)
{
    if (s->be.cu_lo) { /* CUDA: the GPU's table copy catches up at its next use */
        if (s->be.cu_lo[lh] > s->be.cu_hi[lh])
            s->be.cu_lo[lh] = s->be.cu_hi[lh] = page;
        else if (page < s->be.cu_lo[lh])
            s->be.cu_lo[lh] = page;
        else if (page > s->be.cu_hi[lh])
            s->be.cu_hi[lh] = page;
    }
    if (!s->tier.dstamp)
        return;
    if (s->tier.dstamp[lh] != p->step_id) {
        s->tier.dstamp[lh] = p->step_id;
        s->tier.dlo[lh] = s->tier.dhi[lh] = page;
    } else if (page < s->tier.dlo[lh]) {
        s->tier.dlo[lh] = page;
    } else if (page > s->tier.dhi[lh]) {
        s->tier.dhi[lh] = page;
    }
}

/* A memory tier exists when its arena is mapped; the disk tier when its
 * file is open. */
/* KVT_EAGAIN naming `what` while s awaits its remote pages (kvtier/remote.h:
 * kvt_seq_prefix_wait lands them; until then its length is not known). */
static inline int kvt__seq_loading_err(const kvt__seq *s, const char *what)
{
    return s->tier.rfetch ? kvt__err(KVT_EAGAIN, "%s: the sequence is loading its prefix from "
                                     "the remote tier; call kvt_seq_prefix_wait first", what)
                          : 0;
}

static inline bool kvt__has_tier(const kvt_pool *p, uint32_t t)
{
    return t == KVT_TIER_DISK ? p->disk != NULL : p->tier[t].base != NULL;
}
/* A pool whose backend keeps the device tier in its own memory
 * (KVT__BE_DEVICE_REMOTE) and that has a host or disk tier: the placement
 * runs on the host, and the selection comes back to it. */
static inline bool kvt__lower_on_host(const kvt_pool *p)
{
    return (p->be_caps & KVT__BE_DEVICE_REMOTE) && (p->tier[KVT_TIER_HOST].base || p->disk);
}

/* ---- shared pages (share.c) ------------------------------------------------
 * A physical page (its blocks, disk slot and metadata slot) may sit in the
 * tables of several sequences, always at the same (layer, head, page): a
 * fork shares a prefix, and a prefix holds its pages at the same indexes.
 * Shared pages are full. Every holder's table entries are a view of the
 * one page; whatever changes the page (its blocks, residency, busy bits,
 * counts) goes through kvt__page_* so that every view changes with it. */
static inline kvt__seq *kvt__share_nx(kvt_pool *p, kvt__seq *t, size_t lh, uint32_t page)
{
    const uint32_t v = t->share ? t->share[lh * t->cap_pages + page] : 0;
    return v ? &p->seqs[v - 1u] : t;
}
/* Runs the statement after it once for every holder t of (s, lh, page),
 * s first. */
#define KVT__HOLDERS(p, s, lh, page, t)                                                  \
    for (kvt__seq *t = (s), *t##_0 = NULL; t != t##_0;                                    \
         t##_0 = (s), t = kvt__share_nx((p), t, (lh), (page)))
static inline bool kvt__page_shared(const kvt__seq *s, size_t e)
{
    return s->share && s->share[e] != 0;
}
/* The residency bits of every view: cleared, then set. */
KVT__HIDDEN void kvt__page_res(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page,
                               uint8_t clear, uint8_t set);
/* The device (host) block of every view (device: marked dirty in each). */
KVT__HIDDEN void kvt__page_dev(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page,
                               uint32_t blk);
KVT__HIDDEN void kvt__page_host(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page,
                                uint32_t blk);
/* Counts a copy gained (+1) or lost (-1) in `tier`: once in the pool, once
 * in every holder. */
KVT__HIDDEN void kvt__page_count(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page,
                                 uint32_t tier, int delta);
/* Adds t's table entry (lh, page) to the holders of s's page there: t's
 * view becomes a copy of s's and the reference count grows. */
KVT__HIDDEN void kvt__page_share(kvt_pool *p, kvt__seq *s, kvt__seq *t, size_t lh,
                                 uint32_t page);
/* Starts a round of claims: within it, kvt__page_claim returns true once per
 * physical page, so a pass over several holders' tables (the offload's
 * collection) names a shared page once. */
KVT__HIDDEN void kvt__page_claim_round(kvt_pool *p);
KVT__HIDDEN bool kvt__page_claim(kvt_pool *p, const kvt__seq *s, size_t e);
/* Takes s's entry (lh, page) out of its page's holders and clears it;
 * returns true when s was the last holder (the caller frees the page's
 * blocks, disk slot and metadata slot: kvt__page_free). */
KVT__HIDDEN bool kvt__page_unshare(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page);

/* Sequence storage (seq.c). Looks up a live sequence; KVT_ENOENT for
 * unknown or released ids. */
KVT__HIDDEN int kvt__seq_lookup(const kvt_pool *p, kvt_seq_id id, kvt__seq **out);
/* The id of slot `slot` at generation gen, and the slot an id names. */
KVT__HIDDEN kvt_seq_id kvt__seq_id_make(const kvt_pool *p, uint32_t slot, uint32_t gen);
KVT__HIDDEN uint32_t kvt__seq_id_slot(kvt_seq_id id);
/* Frees a slot's state (its pages must be freed first); keeps the
 * generation. */
KVT__HIDDEN void kvt__seq_fini(kvt__seq *s);

/* The metadata store's memory is two planes (n = meta.n_blocks slots, row =
 * D * elem bytes): [n][min row, max row], then [n][mean row], so that a bound
 * scorer (MINMAX) streams only min and max and a landmark scorer (MEAN) only
 * the mean. Slot 0 (the null slot) is zero in both. A page's metadata outside
 * the store (save files, kvt_seq_page_meta_get, copies through host memory,
 * kvt__page_rebuild's output) is one record: min, max, mean. Addresses are
 * the store's own (device memory on a remote backend). */
static inline size_t kvt__meta_row(const kvt_pool *p)
{
    return (size_t)p->meta_bytes / 3u;
}
static inline uint8_t *kvt__meta_mm(const kvt_pool *p, uint32_t slot)
{
    return p->meta.base + (size_t)slot * 2u * kvt__meta_row(p);
}
static inline uint8_t *kvt__meta_mean_plane(const kvt_pool *p)
{
    return p->meta.base + (size_t)p->meta.n_blocks * 2u * kvt__meta_row(p);
}
static inline uint8_t *kvt__meta_mean(const kvt_pool *p, uint32_t slot)
{
    return kvt__meta_mean_plane(p) + (size_t)slot * kvt__meta_row(p);
}

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
/* KVT_EINVAL naming `what` when [ptr, ptr + bytes) overlaps memory of the
 * pool's own tiers or metadata store (the source of an append may not be
 * the pool's own storage, which the append rewrites). */
KVT__HIDDEN int kvt__not_in_pool(const kvt_pool *p, const void *ptr, size_t bytes,
                                 const char *what);
KVT__HIDDEN void kvt__append_unalloc(kvt_pool *p, kvt__seq *s, uint32_t layer, uint32_t n_tokens);
/* Takes back the last token of `layer` (host-addressable device tier; the
 * page holding it is on the device and no move of it is in flight): a page
 * it opened goes back, else the page's metadata is rebuilt from the keys
 * still stored (bounds of the stored values, so still bounds). */
KVT__HIDDEN void kvt__append_pop(kvt_pool *p, kvt__seq *s, uint32_t layer);
/* The accumulators (acc[3 * D]: min, max, sum) and metadata (mm: the min and
 * max rows, mean: the mean row, the pool's dtype; a record passes rec and
 * rec + 2 rows) of a page from its first `count` key rows (host memory, the
 * pool's dtype); returns whether a key has a NaN or infinite element. */
KVT__HIDDEN bool kvt__page_rebuild(const kvt_pool *p, const uint8_t *krows, uint32_t count,
                                   float *acc, uint8_t *mm, uint8_t *mean);
/* Appends n_tokens of one layer once every argument has been checked and
 * blocks are known to be available (append.c); cannot fail. */
KVT__HIDDEN void kvt__append_checked(kvt_pool *p, kvt__seq *s, uint32_t layer, const void *k,
                                     const void *v, uint32_t n_tokens, kvt_dtype src_dtype,
                                     uint64_t token_stride);
/* Makes sure a sequence can keep `cap` top-K pages per (layer, head)
 * (seq.c). */
KVT__HIDDEN int kvt__seq_topk_reserve(const kvt_pool *p, kvt__seq *s, uint32_t cap);

#endif /* KVTIER_STORE_H */
