/* What the public entry points of lib/api share among themselves. */
#ifndef KVTIER_API_INT_H
#define KVTIER_API_INT_H

#include "../core/store.h"

/* Size of the first released kvt_seq_opts (0.1): pinned, never sizeof of
 * the current struct, so that appending a field keeps old callers working. */
#define KVT__SEQ_OPTS_V1 16u

/* Lets go of s's reference to its page (lh, page): the page's blocks, disk
 * slot and metadata slot are freed when s was its last holder (share.c). */
KVT__HIDDEN void kvt__page_letgo(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page);
/* Metadata slot m's record (min, max, mean rows; meta_bytes) to or from host
 * memory, from the store's two planes (lib/core/store.h), through the backend
 * where the store is not host memory. */
KVT__HIDDEN int kvt__meta_get(const kvt_pool *p, uint32_t m, uint8_t *rec);
KVT__HIDDEN int kvt__meta_put(const kvt_pool *p, uint32_t m, const uint8_t *rec);
/* KVT_ESTATE naming `what` when an open step includes s. */
KVT__HIDDEN int kvt__seq_edit_ok(const kvt_pool *p, const kvt__seq *s, const char *what);

/* kvt_seq_append of n tokens of host rows in the pool's dtype, dense: on a
 * backend whose memory the host cannot address, through scratch memory of
 * the backend's, kept in *st for the next call (kvt_seq_restore, the remote
 * tier's landing); kvt__rows_stage_fini frees it. */
typedef struct {
    void *k, *v;
    size_t cap;
} kvt__rows_stage;
KVT__HIDDEN int kvt__append_host_rows(kvt_pool *pool, kvt_seq_id id, uint32_t layer,
                                      const void *k, const void *v, uint32_t n,
                                      kvt__rows_stage *st);
KVT__HIDDEN void kvt__rows_stage_fini(kvt_pool *pool, kvt__rows_stage *st);

/* The remote tier (remote.c): opened and closed with the pool; a created
 * sequence asks it for the pages of its prefix past the local match; a
 * released one stops waiting. */
KVT__HIDDEN int kvt__remote_open(kvt_pool *p, const kvt_pool_opts *o);
KVT__HIDDEN void kvt__remote_close(kvt_pool *p);
KVT__HIDDEN void kvt__remote_fetch(kvt_pool *p, kvt__seq *s);
KVT__HIDDEN void kvt__remote_cancel(kvt_pool *p, kvt__seq *s);

#endif /* KVTIER_API_INT_H */
