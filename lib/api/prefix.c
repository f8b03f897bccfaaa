/* The prefix cache's public calls: recording a sequence's token ids and
 * dropping index entries (by salt, or all). The index and the cached pages
 * are lib/tier/prefix.c and pcache.c; attaching at creation is
 * kvt_seq_create's (seq.c). */
#include "api_int.h"
#include "../tier/tier.h"

KVT_API int kvt_seq_tokens_set(kvt_pool *pool, kvt_seq_id seq, uint32_t first,
                               const uint32_t *ids, uint32_t n)
{
    KVT__CHECK_NULL(pool);
    kvt__seq *s;
    int rc = kvt__seq_lookup(pool, seq, &s);
    if (rc)
        return rc;
    if ((rc = kvt__seq_edit_ok(pool, s, "kvt_seq_tokens_set")))
        return rc;
    if ((rc = kvt__pfx_ids_set(pool, s, first, ids, n, "ids")))
        return rc;
    kvt__pfx_register(pool, s);
    return 0;
}

static int kvt__drop(kvt_pool *pool, bool all, uint64_t salt, uint64_t *n_pages)
{
    KVT__CHECK_NULL(pool);
    const uint64_t n = kvt__pfx_drop(pool, all, salt);
    if (n_pages)
        *n_pages = n;
    return 0;
}

KVT_API int kvt_prefix_drop(kvt_pool *pool, uint64_t salt, uint64_t *n_pages)
{
    return kvt__drop(pool, false, salt, n_pages);
}

KVT_API int kvt_prefix_drop_all(kvt_pool *pool, uint64_t *n_pages)
{
    return kvt__drop(pool, true, 0, n_pages);
}
