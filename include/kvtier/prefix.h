/* libkvtier - the prefix cache: pages reused across requests by their
 * token content.
 *
 * In a pool created with KVT_POOL_PREFIX_CACHE, a full page whose P token
 * ids are all known gets a key, a chained hash of (the previous page's key,
 * its P ids, the sequence's salt), and goes into a pool-wide index that
 * maps the key to the physical page of every (layer, KV head). A sequence
 * created with a prefix (kvt_seq_opts.prefix, .salt) attaches the longest
 * run of indexed pages that matches it, page by page from the first; a
 * match is confirmed by comparing the stored token ids, the salt, the
 * position and the previous page's entry, never by the key alone. When the
 * last sequence holding an indexed page lets it go, the page stays cached
 * in whatever tiers hold it. Cached pages that no sequence holds are
 * reclaimed only when room is needed (an append, a promotion, an offload, a
 * tier over its kvt_pool_opts.prefix_cache_bytes cap), least recently used
 * first and tier by tier: a device copy goes first when another tier holds
 * the page (else it moves to the host tier when that has room), a host copy
 * next (written to the disk tier when there is one), then the page itself.
 * A page is always reclaimed with the other (layer, KV head) pages of its
 * entry, normally after the entries that extend it (chains go deepest first).
 *
 * Token ids reach a sequence three ways: kvt_seq_opts.prefix at creation,
 * kvt_step_opts.token_ids with a step's rows, and kvt_seq_tokens_set.
 * Ids may be given before the rows (a prompt's ids before its prefill);
 * a page is keyed once every layer holds its P rows and its P ids are
 * known. A fork inherits its parent's ids; a truncation forgets the ids
 * past the cut; kvt_seq_restore restores no ids (its pages are keyed once
 * kvt_seq_tokens_set gives them).
 *
 * Thread safety: as the pool's (one thread at a time).
 */
#ifndef KVTIER_PREFIX_H
#define KVTIER_PREFIX_H

#include "kvtier/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records the token ids of positions [first, first + n) of the sequence.
 * first may not be past the positions already known (ids are contiguous
 * from position 0); ids of positions already known must equal the recorded
 * ones (KVT_EINVAL naming the position and both ids, nothing recorded);
 * first + n may not exceed the sequence's max_tokens. Pages that become
 * keyable are indexed (pools with KVT_POOL_PREFIX_CACHE; without it the
 * ids are only recorded). KVT_ESTATE while a step that includes the
 * sequence is open. */
KVT_API int kvt_seq_tokens_set(kvt_pool *pool, kvt_seq_id seq, uint32_t first,
                               const uint32_t *ids, uint32_t n);

/* Drops every index entry keyed with `salt` (a tenant leaving): cached
 * pages no sequence holds are freed in every tier; pages sequences hold
 * stay theirs, unindexed, and are freed when the last holder lets go; the
 * live sequences of the salt (and their later forks) are never keyed
 * again. Nothing keyed with another salt changes. *n_pages (may be NULL) =
 * the physical pages dropped from the index. */
KVT_API int kvt_prefix_drop(kvt_pool *pool, uint64_t salt, uint64_t *n_pages);

/* The same for every salt: the index is empty afterwards, and no sequence
 * live now is keyed again. */
KVT_API int kvt_prefix_drop_all(kvt_pool *pool, uint64_t *n_pages);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_PREFIX_H */
