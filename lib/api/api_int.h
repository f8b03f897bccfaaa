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
/* Copies the block of page (lh, page) of s, from the fastest tier that holds
 * it, into buf (block_bytes; host memory). A disk copy is checked against
 * its CRC (KVT_ECORRUPT, KVT_EIO). */
KVT__HIDDEN int kvt__page_read(const kvt_pool *p, const kvt__seq *s, size_t lh, uint32_t page,
                               uint8_t *buf);
/* KVT_ESTATE naming `what` when an open step includes s. */
KVT__HIDDEN int kvt__seq_edit_ok(const kvt_pool *p, const kvt__seq *s, const char *what);

#endif /* KVTIER_API_INT_H */
