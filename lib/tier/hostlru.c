/* The host cache's eviction order: host blocks in lists by importance
 * bucket, each list in filing order, so that eviction pops candidates in
 * O(1) each instead of scanning the host tier.
 *
 * A bucket is the page's importance (the last vote the selector gave it)
 * to within 1/8 octave: the top 12 bits of the float's order-preserving
 * key (sign, exponent, 3 mantissa bits); -0 is +0, NaN ranks highest (as
 * the top-K ranks a NaN vote). A block is queued when a move that touches
 * its page is applied (arrival in the host tier, a disk copy's arrival, the
 * end of a move in flight); the queue is filed at the next eviction, sorted
 * by (bucket, last use, block), so the order does not depend on the order
 * in which moves completed. A selection that lowers a listed page's
 * importance below its bucket queues it too (kvt__host_imp_changed); a
 * popped candidate whose importance rose, or that was used since it was
 * filed, is filed again. The lists are a hint, validated at every
 * pop against the pool's ground truth (owner, residency, importance,
 * recency); mover_submit.c falls back to a full scan when they cannot
 * supply enough candidates. Caller-thread state, like host_owner. */
#include <stdlib.h>
#include <string.h>

#include "tier.h"

int kvt__hlru_init(kvt__hlru *l, uint32_t n)
{
    memset(l, 0, sizeof *l);
    l->prev = malloc((size_t)n * sizeof *l->prev);
    l->next = malloc((size_t)n * sizeof *l->next);
    l->fuse = malloc((size_t)n * sizeof *l->fuse);
    l->bk = malloc((size_t)n * sizeof *l->bk);
    l->pend = malloc((size_t)n * sizeof *l->pend);
    l->pmark = calloc(n, 1);
    if (!l->prev || !l->next || !l->fuse || !l->bk || !l->pend || !l->pmark) {
        kvt__hlru_fini(l);
        return kvt__err(KVT_ENOMEM, "mover: cannot allocate the host cache's lists (%u blocks)",
                        n);
    }
    l->n = n;
    for (uint32_t b = 0; b < n; b++)
        l->bk[b] = KVT__HLRU_NONE;
    for (uint32_t k = 0; k <= KVT__HLRU_NB; k++)
        l->head[k] = l->tail[k] = KVT__HLRU_NIL;
    return 0;
}

void kvt__hlru_fini(kvt__hlru *l)
{
    free(l->prev);
    free(l->next);
    free(l->fuse);
    free(l->bk);
    free(l->pend);
    free(l->pmark);
    memset(l, 0, sizeof *l);
}

uint32_t kvt__hlru_key(float imp)
{
    uint32_t u;
    memcpy(&u, &imp, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u = 0x7f800000u; /* NaN: as +inf */
    if (u == 0x80000000u)
        u = 0; /* -0 as +0 */
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

uint32_t kvt__hlru_bucket(float imp)
{
    return kvt__hlru_key(imp) >> (32u - KVT__HLRU_BITS);
}

void kvt__hlru_unlink(kvt__hlru *l, uint32_t b)
{
    const uint32_t k = l->bk[b];
    if (k == KVT__HLRU_NONE)
        return;
    const uint32_t pv = l->prev[b], nx = l->next[b];
    if (pv != KVT__HLRU_NIL)
        l->next[pv] = nx;
    else
        l->head[k] = nx;
    if (nx != KVT__HLRU_NIL)
        l->prev[nx] = pv;
    else
        l->tail[k] = pv;
    if (l->head[k] == KVT__HLRU_NIL && k < KVT__HLRU_NB) {
        l->bits[k >> 6] &= ~(1ull << (k & 63u));
        if (!l->bits[k >> 6])
            l->sum &= ~(1ull << (k >> 6));
    }
    l->bk[b] = KVT__HLRU_NONE;
}

/* Appends b to bucket k's list (k == KVT__HLRU_NB: the parked list, blocks
 * that cannot go now: no disk copy, or a move in flight). */
static void kvt__hlru_append(kvt__hlru *l, uint32_t b, uint32_t k, uint32_t use)
{
    kvt__hlru_unlink(l, b);
    l->bk[b] = (uint16_t)k;
    l->fuse[b] = use;
    l->next[b] = KVT__HLRU_NIL;
    l->prev[b] = l->tail[k];
    if (l->tail[k] != KVT__HLRU_NIL)
        l->next[l->tail[k]] = b;
    else
        l->head[k] = b;
    l->tail[k] = b;
    if (k < KVT__HLRU_NB) {
        l->bits[k >> 6] |= 1ull << (k & 63u);
        l->sum |= 1ull << (k >> 6);
    }
}

void kvt__hlru_file(kvt__hlru *l, uint32_t b, float imp, uint32_t use)
{
    kvt__hlru_append(l, b, kvt__hlru_bucket(imp), use);
}

void kvt__hlru_park(kvt__hlru *l, uint32_t b, uint32_t use)
{
    kvt__hlru_append(l, b, KVT__HLRU_NB, use);
}

uint32_t kvt__hlru_lowest(const kvt__hlru *l)
{
    if (!l->sum)
        return KVT__HLRU_NIL;
    const uint32_t w = (uint32_t)__builtin_ctzll(l->sum);
    const uint32_t k = (w << 6) | (uint32_t)__builtin_ctzll(l->bits[w]);
    return l->head[k];
}
