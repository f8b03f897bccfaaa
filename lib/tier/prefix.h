/* The prefix cache (lib/tier/prefix.c: keys, the index, token ids,
 * registration, attach; pcache.c: cached pages no sequence holds, their
 * reclaim and the drops). Included by tier.h. */
#ifndef KVTIER_PREFIX_INT_H
#define KVTIER_PREFIX_INT_H

#include "../core/store.h"
#include "remote.h"

/* One index entry: the content of one page position (key, salt, the P token
 * ids, the previous page's entry) and its physical page in every (layer, KV
 * head). */
typedef struct kvt__pent {
    uint64_t key, salt;
    uint64_t parent;      /* reference of the previous page's entry; 0 for page 0 */
    uint32_t gen;         /* bumped each time the entry is freed */
    uint32_t page;        /* the page's index in the sequences that hold it */
    uint32_t next;        /* hash chain, or free list: entry + 1; 0 = end */
    uint32_t lru_prev, lru_next; /* entry + 1; the LRU list of unheld entries */
    uint32_t n_held;      /* its (layer, head) pages some sequence holds */
    uint32_t cnt[KVT_NUM_TIERS]; /* copies per tier of its pages no sequence holds */
    uint8_t live, in_lru;
    kvt__rkey rk;         /* its remote key (pools with a remote tier) */
} kvt__pent;

typedef struct kvt__pfx {
    uint32_t LH, P;
    uint32_t n_ent;       /* entries (one per LH physical pages of the store) */
    kvt__pent *e;
    uint32_t *ids;        /* [n_ent * P] */
    uint32_t *meta;       /* [n_ent * LH] the physical pages (metadata slots) */
    /* A page no sequence holds: its blocks and residency, [n_ent * LH]
     * (while held, the holders' tables are the truth). */
    uint32_t *dev, *host;
    uint8_t *res;
    uint32_t *bucket;     /* [mask + 1] hash heads: entry + 1 */
    uint32_t mask;
    uint32_t free_head;   /* entry + 1 */
    uint32_t lru_head, lru_tail; /* entry + 1: head = most recently used */
    uint32_t *pg_key;     /* [metadata slots] entry * LH + lh + 1; 0 = not indexed */
    uint64_t cap[KVT_NUM_TIERS];    /* copies of unheld pages each tier may keep */
    uint64_t cached[KVT_NUM_TIERS]; /* ... and keeps now */
    uint32_t epoch;       /* bumped by the drops: sequences recheck their pages */
    uint32_t pin;         /* entry + 1 a reclaim is working on: no nested reclaim takes it */
    uint64_t lookups, hit_tokens, miss_tokens, hit_pages, keyed, reclaimed, dropped;
#ifdef KVT_FAULT_INJECTION
    uint64_t key_mask;    /* test builds: keys are ANDed with it (0 = all equal) */
#endif
} kvt__pfx;

/* The key of a page: a chained hash of (prev, the P ids, salt). */
KVT__HIDDEN uint64_t kvt__pfx_key(const kvt__pfx *x, uint64_t prev, const uint32_t *ids,
                                  uint64_t salt);
KVT__HIDDEN int kvt__pfx_create(kvt_pool *p, const uint64_t cap_bytes[KVT_NUM_TIERS]);
KVT__HIDDEN void kvt__pfx_destroy(kvt_pool *p);
/* Records ids of positions [first, first + n) of s (kvt_seq_tokens_set's
 * rules; `what` names the argument in messages); nothing recorded on error. */
KVT__HIDDEN int kvt__pfx_ids_set(kvt_pool *p, kvt__seq *s, uint32_t first, const uint32_t *ids,
                                 uint32_t n, const char *what);
/* Indexes the pages of s that every layer holds full and whose ids are known. */
KVT__HIDDEN void kvt__pfx_register(kvt_pool *p, kvt__seq *s);
/* Queues the value of every keyed page position of s for the remote tier
 * (pools with one); returns the values queued. */
KVT__HIDDEN uint32_t kvt__pfx_remote_push(kvt_pool *p, kvt__seq *s);
/* A fork: the child c takes s's ids, keys and entries. */
KVT__HIDDEN int kvt__pfx_seq_fork(const kvt_pool *p, const kvt__seq *s, kvt__seq *c);
/* A truncation of s to n tokens. */
KVT__HIDDEN void kvt__pfx_seq_cut(const kvt_pool *p, kvt__seq *s, uint32_t n);
/* kvt_seq_create with a prefix: records ids[n] as s's and (attach) attaches
 * to the new, empty s the longest run of cached whole pages matching them
 * under s's salt and sets its lengths; *matched = tokens attached. A
 * tiered pool then brings the pages its placement keeps on device there
 * (KVT_ENOSPC, KVT_EIO, KVT_ECORRUPT: the caller releases s). */
KVT__HIDDEN int kvt__pfx_attach(kvt_pool *p, kvt__seq *s, kvt_seq_id id, const uint32_t *ids,
                                uint32_t n, bool attach, uint32_t *matched);
static inline bool kvt__pfx_indexed(const kvt_pool *p, uint32_t meta)
{
    return p->pfx && p->pfx->pg_key[meta] != 0;
}
/* The entry reference (generation << 32 | entry + 1) and its validity. */
static inline uint64_t kvt__pfx_ref(const kvt__pfx *x, uint32_t i)
{
    return ((uint64_t)x->e[i].gen << 32) | (i + 1u);
}
static inline bool kvt__pfx_valid(const kvt__pfx *x, uint64_t ref)
{
    const uint32_t i = (uint32_t)ref - 1u;
    return ref && (uint32_t)ref <= x->n_ent && x->e[i].live && x->e[i].gen == (uint32_t)(ref >> 32);
}

/* ---- pcache.c ---- */
/* s, the last holder of the indexed page (s, lh, page), lets it go: the page
 * stays cached, no sequence holding it; s's view is cleared. */
KVT__HIDDEN void kvt__pfx_detach(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page);
/* s takes entry i's page lh at (lh, page) of its tables (held or not). */
KVT__HIDDEN void kvt__pfx_adopt(kvt_pool *p, kvt__seq *s, uint32_t i, size_t lh,
                                uint32_t page);
/* Reclaims cached pages no sequence holds until `tier` (KVT_TIER_* or
 * KVT_NUM_TIERS: the metadata store) has `need` free blocks, or none is
 * left to reclaim. */
KVT__HIDDEN void kvt__pfx_make_room(kvt_pool *p, uint32_t tier, uint64_t need);
/* A free entry (reclaiming the least recently used one if none is free);
 * UINT32_MAX when every entry is held. */
KVT__HIDDEN uint32_t kvt__pfx_entry_new(kvt_pool *p);
/* Frees entry i: its unheld pages in every tier; its held pages stay the
 * holders', unindexed. Returns the physical pages freed. */
KVT__HIDDEN uint64_t kvt__pfx_entry_free(kvt_pool *p, uint32_t i);
/* Frees the entries of `salt` (all: every entry); returns the physical pages
 * dropped from the index. */
KVT__HIDDEN uint64_t kvt__pfx_drop(kvt_pool *p, bool all, uint64_t salt);
/* The disk tier is full: frees the disk copies of one unheld entry (false
 * when none has any). */
KVT__HIDDEN bool kvt__pfx_disk_room(kvt_pool *p);
/* Moves entry i to the most recently used end of the LRU list (unheld). */
KVT__HIDDEN void kvt__pfx_lru_push(kvt__pfx *x, uint32_t i);
KVT__HIDDEN void kvt__pfx_lru_unlink(kvt__pfx *x, uint32_t i);
/* kvt_pool_check's walk: every entry's pages live, their tokens matching,
 * unheld pages' blocks claimed through mark(ctx, tier, blk) (tier
 * KVT_NUM_TIERS: the metadata slot), copies counted into pages[]. */
KVT__HIDDEN int kvt__pfx_check(const kvt_pool *p, void (*mark)(void *, uint32_t, uint32_t),
                               void *ctx, uint64_t pages[KVT_NUM_TIERS]);

#endif /* KVTIER_PREFIX_INT_H */
