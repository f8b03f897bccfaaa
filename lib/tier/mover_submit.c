/* The tier mover's submit side: checking a batch of moves, reserving the
 * blocks, evicting host-cache pages over the disk tier to make room, and
 * queueing the operations by priority (mover.c runs and applies them). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tier.h"
#include "../policy/policy_int.h"

static const char *const kvt__tier_name[KVT_NUM_TIERS] = {"device", "host", "disk"};

/* ---- host eviction ----------------------------------------------------------- */
typedef struct {
    float imp;
    uint32_t use;
    uint32_t blk;
    uint32_t pad;
} kvt__cand;

static int kvt__cand_cmp(const void *pa, const void *pb)
{
    const kvt__cand *a = pa, *b = pb;
    const uint32_t ka = kvt__hlru_key(a->imp), kb = kvt__hlru_key(b->imp);
    if (ka != kb)
        return ka < kb ? -1 : 1;
    if (a->use != b->use) /* older first; the clock may wrap, compare by distance */
        return (int32_t)(a->use - b->use) < 0 ? -1 : 1;
    return a->blk < b->blk ? -1 : a->blk > b->blk;
}

/* The sequence page whose host copy block b holds (*ps, *pe), or false:
 * no owner, the prefix cache's, or an owner record that no longer matches
 * (a block freed and taken again without the lists being told). */
static bool kvt__host_page(kvt_pool *p, uint32_t b, kvt__seq **ps, size_t *pe)
{
    const kvt__owner o = p->host_owner[b];
    if (o.slot == UINT32_MAX || o.slot == KVT__OWNER_PFX)
        return false;
    kvt__seq *s = &p->seqs[o.slot];
    const size_t e = (size_t)o.lh * s->cap_pages + o.page;
    if (!(s->res[e] & KVT_RES_HOST) || s->host_block[e] != b)
        return false;
    *ps = s;
    *pe = e;
    return true;
}

void kvt__host_file(kvt_pool *p, kvt__seq *s, size_t e)
{
    kvt_mover *m = p->mover;
    if (!m || !m->hlru.n || !(s->res[e] & KVT_RES_HOST))
        return;
    const uint32_t b = s->host_block[e];
    if (!m->hlru.pmark[b]) {
        m->hlru.pmark[b] = 1;
        m->hlru.pend[m->hlru.n_pend++] = b;
    }
}

void kvt__host_imp_changed(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t np)
{
    kvt_mover *m = p->mover;
    if (!m || !m->hlru.n)
        return;
    const kvt__hlru *l = &m->hlru;
    const size_t base = lh * s->cap_pages;
    const uint32_t me = (uint32_t)(s - p->seqs);
    for (uint32_t pg = 0; pg < np; pg++) {
        const size_t e = base + pg;
        if (!(s->res[e] & KVT_RES_HOST))
            continue;
        const uint32_t b = s->host_block[e];
        const uint32_t k = l->bk[b];
        /* Unlisted blocks are queued already; parked ones are filed when a
         * move of the page is applied; a rise is seen when popped. */
        if (k < KVT__HLRU_NB && p->host_owner[b].slot == me &&
            kvt__hlru_bucket(s->tier.imp[e]) < k)
            kvt__host_file(p, s, e);
    }
}

/* Filing order of queued blocks: bucket, then least recently used, then
 * block. */
static int kvt__file_cmp(const void *pa, const void *pb)
{
    const kvt__cand *a = pa, *b = pb;
    const uint32_t ka = kvt__hlru_bucket(a->imp), kb = kvt__hlru_bucket(b->imp);
    if (ka != kb)
        return ka < kb ? -1 : 1;
    if (a->use != b->use)
        return (int32_t)(a->use - b->use) < 0 ? -1 : 1;
    return a->blk < b->blk ? -1 : a->blk > b->blk;
}

/* Files the queued blocks that still hold a sequence's page. */
static void kvt__file_pending(kvt_mover *m)
{
    kvt_pool *p = m->pool;
    kvt__hlru *l = &m->hlru;
    kvt__cand *c = m->evict_scratch;
    size_t n = 0;
    for (uint32_t i = 0; i < l->n_pend; i++) {
        const uint32_t b = l->pend[i];
        kvt__seq *s;
        size_t e;
        l->pmark[b] = 0;
        if (kvt__host_page(p, b, &s, &e))
            c[n++] = (kvt__cand){s->tier.imp[e], s->tier.use[e], b, 0};
    }
    l->n_pend = 0;
    qsort(c, n, sizeof *c, kvt__file_cmp);
    for (size_t i = 0; i < n; i++)
        kvt__hlru_file(l, c[i].blk, c[i].imp, c[i].use);
}

/* Pops up to `need` host copies off the lists, lowest bucket first, each
 * validated: a block no sequence page owns leaves the lists; one whose page
 * cannot go now (no disk copy, a move in flight) is parked until a move of
 * the page is applied; one whose importance rose to a higher bucket, or
 * that was used since it was filed, goes to the tail of its bucket (a
 * second chance, as a CLOCK gives). At most 4 x need + 64 pops. Returns
 * the pages dropped. */
static uint32_t kvt__evict_listed(kvt_mover *m, uint32_t need)
{
    kvt_pool *p = m->pool;
    kvt__hlru *l = &m->hlru;
    uint32_t done = 0;
    for (uint64_t budget = 4ull * need + 64u; done < need && budget; budget--) {
        const uint32_t b = kvt__hlru_lowest(l);
        if (b == KVT__HLRU_NIL)
            break;
        kvt__seq *s;
        size_t e;
        if (!kvt__host_page(p, b, &s, &e)) {
            kvt__hlru_unlink(l, b);
            continue;
        }
        const uint8_t r = s->res[e];
        const uint32_t use = s->tier.use[e];
        if ((r & KVT__RES_BUSY) || !(r & KVT_RES_DISK)) {
            kvt__hlru_park(l, b, use);
            continue;
        }
        const float imp = s->tier.imp[e];
        if (kvt__hlru_bucket(imp) > l->bk[b] || use != l->fuse[b]) {
            kvt__hlru_file(l, b, imp, use);
            continue;
        }
        kvt__page_drop(p, s, e, KVT_TIER_HOST); /* unlinks b */
        m->evictions++;
        done++;
    }
    return done;
}

/* The lists' fallback and rebuild: every host copy that the disk also holds
 * and no move has in flight, sorted by (importance, least recently used,
 * block), is filed afresh, the rest parked. O(host blocks log). */
static void kvt__evict_rebuild(kvt_mover *m)
{
    kvt_pool *p = m->pool;
    const kvt__arena *a = &p->tier[KVT_TIER_HOST];
    kvt__cand *c = m->evict_scratch;
    size_t n = 0;
    for (uint32_t i = 0; i < m->hlru.n_pend; i++)
        m->hlru.pmark[m->hlru.pend[i]] = 0;
    m->hlru.n_pend = 0;
    for (uint32_t b = 1; b < a->n_blocks; b++) {
        kvt__seq *s;
        size_t e;
        if (!kvt__host_page(p, b, &s, &e)) {
            kvt__hlru_unlink(&m->hlru, b);
            continue;
        }
        const uint8_t r = s->res[e];
        if ((r & KVT__RES_BUSY) || !(r & KVT_RES_DISK))
            kvt__hlru_park(&m->hlru, b, s->tier.use[e]);
        else
            c[n++] = (kvt__cand){s->tier.imp[e], s->tier.use[e], b, 0};
    }
    qsort(c, n, sizeof *c, kvt__cand_cmp);
    for (size_t i = 0; i < n; i++)
        kvt__hlru_file(&m->hlru, c[i].blk, c[i].imp, c[i].use);
}

/* Drops host copies that the disk also holds, lowest importance first (to
 * within 1/8 octave; then least recently used), until `want` blocks are
 * free or nothing else can go: O(1) a page from the lists, a rebuild when
 * they fall short. */
static void kvt__evict_host(kvt_mover *m, uint32_t want)
{
    kvt_pool *p = m->pool;
    kvt__arena *a = &p->tier[KVT_TIER_HOST];
    kvt__pfx_make_room(p, KVT_TIER_HOST, want); /* cached pages no sequence holds first */
    if (!p->disk || !m->hlru.n || a->n_free >= want)
        return;
    uint32_t need = want - a->n_free;
    kvt__file_pending(m);
    need -= kvt__evict_listed(m, need);
    if (need) {
        kvt__evict_rebuild(m);
        kvt__evict_listed(m, need);
    }
}

/* ---- submit -------------------------------------------------------------- */
static int kvt__check_move(kvt_pool *p, const kvt_move *mv, uint32_t i, kvt__seq **out)
{
    kvt__seq *s;
    int rc = kvt__seq_lookup(p, mv->seq, &s);
    if (rc)
        return kvt__err(rc, "moves[%u].seq: %llu is not a live sequence of this pool", i,
                        (unsigned long long)mv->seq);
    if (mv->layer >= p->g.n_layers)
        return kvt__err(KVT_EINVAL, "moves[%u].layer: %u >= n_layers %u", i, mv->layer,
                        p->g.n_layers);
    if (mv->kv_head >= p->g.n_kv_heads)
        return kvt__err(KVT_EINVAL, "moves[%u].kv_head: %u >= n_kv_heads %u", i, mv->kv_head,
                        p->g.n_kv_heads);
    const uint32_t tokens = s->n_tokens[mv->layer];
    const uint32_t full = tokens / p->g.page_tokens;
    if (mv->page >= full)
        return kvt__err(KVT_EINVAL, "moves[%u].page: %u is %s (layer %u has %u tokens; only "
                        "full pages move)", i, mv->page,
                        mv->page < kvt__pages_for(p, tokens) ? "the partially filled last page"
                                                             : "past the last page",
                        mv->layer, tokens);
    if (mv->from >= KVT_NUM_TIERS || !kvt__has_tier(p, mv->from))
        return kvt__err(KVT_EINVAL, "moves[%u].from: %s", i,
                        mv->from >= KVT_NUM_TIERS ? "unknown tier" : "the pool has no such tier");
    if (mv->to >= KVT_NUM_TIERS || !kvt__has_tier(p, mv->to))
        return kvt__err(KVT_EINVAL, "moves[%u].to: %s", i,
                        mv->to >= KVT_NUM_TIERS ? "unknown tier" : "the pool has no such tier");
    if (mv->from == mv->to)
        return kvt__err(KVT_EINVAL, "moves[%u].to: equals from (%s)", i,
                        kvt__tier_name[mv->from]);
    if (mv->flags & ~KVT_MOVE_DROP_SOURCE)
        return kvt__err(KVT_EINVAL, "moves[%u].flags: unknown bits 0x%x", i,
                        mv->flags & ~KVT_MOVE_DROP_SOURCE);
    const size_t lh = kvt__lh(p, mv->layer, mv->kv_head), e = lh * s->cap_pages + mv->page;
    /* A pool with a policy keeps an unstable head's pages, and a stable
     * head's sink, local and last pages, on device (kvt_pool_check). */
    if (p->pol && mv->from == KVT_TIER_DEVICE && (mv->flags & KVT_MOVE_DROP_SOURCE)) {
        if (!kvt__stable(p, lh))
            return kvt__err(KVT_EINVAL, "moves[%u].flags: KVT_MOVE_DROP_SOURCE would drop the "
                            "device copy of page %u of layer %u head %u, an unstable head "
                            "(the pool's policy keeps its pages on device)", i, mv->page,
                            mv->layer, mv->kv_head);
        if (kvt__forced(mv->page, kvt__pages_for(p, tokens), tokens, p->g.page_tokens,
                        p->pol->sink[lh], p->pol->local[lh]))
            return kvt__err(KVT_EINVAL, "moves[%u].flags: KVT_MOVE_DROP_SOURCE would drop the "
                            "device copy of page %u of layer %u head %u, a sink or local page "
                            "(the pool's policy keeps them on device)", i, mv->page,
                            mv->layer, mv->kv_head);
        if (kvt__held_elsewhere(p, s, lh, mv->page, false))
            return kvt__err(KVT_EINVAL, "moves[%u].flags: KVT_MOVE_DROP_SOURCE would drop the "
                            "device copy of page %u of layer %u head %u, which another "
                            "sequence shares as a sink, local or last page", i, mv->page,
                            mv->layer, mv->kv_head);
    }
    if (s->res[e] & KVT__RES_BUSY)
        return kvt__err(KVT_EBUSY, "moves[%u]: page %u of layer %u head %u already has a move "
                        "in flight", i, mv->page, mv->layer, mv->kv_head);
    if (!(s->res[e] & (1u << mv->from)))
        return kvt__err(KVT_ESTATE, "moves[%u].from: page %u of layer %u head %u has no copy "
                        "in the %s tier", i, mv->page, mv->layer, mv->kv_head,
                        kvt__tier_name[mv->from]);
    *out = s;
    return 0;
}

static void kvt__unbusy(kvt_pool *p, kvt__batch *b, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        kvt__op *op = &b->ops[i];
        kvt__seq *s = &p->seqs[op->slot];
        kvt__page_res(p, s, op->lh, op->page, KVT__RES_BUSY | KVT__RES_INBOUND, 0);
        s->tier.busy--;
        if (op->to == KVT_TIER_DEVICE)
            s->tier.reloading--;
        if (op->dst_blk && !(op->iflags & KVT__OPF_HANDED))
            kvt__arena_free(&p->tier[op->dst_tier], op->dst_blk);
        op->dst_blk = 0;
        /* An eviction of this submit may have parked its host copy. */
        kvt__host_file(p, s, (size_t)op->lh * s->cap_pages + op->page);
    }
}

static int kvt__op_cmp(const void *a, const void *b)
{
    const kvt__op *x = *(kvt__op *const *)a, *y = *(kvt__op *const *)b;
    return x->dslot < y->dslot ? -1 : x->dslot > y->dslot;
}

KVT_API int kvt_mover_submit(kvt_mover *m, const kvt_move *moves, uint32_t n, uint32_t flags,
                             int32_t *results, kvt_fence *fence)
{
    return kvt__mover_submit(m, moves, n, flags, results, fence, NULL, 0);
}

int kvt__mover_submit(kvt_mover *m, const kvt_move *moves, uint32_t n, uint32_t flags,
                      int32_t *results, kvt_fence *fence, const uint32_t *dst_dev,
                      uint8_t iflags)
{
    KVT__CHECK_NULL(fence);
    *fence = 0;
    if (!m)
        return kvt__err(KVT_EINVAL, "mover: must not be NULL");
    if (n)
        KVT__CHECK_NULL(moves);
    if (flags & ~KVT_SUBMIT_URGENT)
        return kvt__err(KVT_EINVAL, "flags: unknown bits 0x%x", flags & ~KVT_SUBMIT_URGENT);
    if (n > (1u << 26))
        return kvt__err(KVT_EINVAL, "n: %u moves in one batch; at most %u", n, 1u << 26);
    kvt_pool *p = m->pool;
    kvt__mover_apply_done(m); /* frees what finished, so its room can be reused */

    kvt__batch *b = malloc(sizeof *b + (size_t)n * sizeof(kvt__op));
    if (!b)
        return kvt__err(KVT_ENOMEM, "kvt_mover_submit: cannot allocate a batch of %u moves", n);
    memset(b, 0, sizeof *b);
    b->n = n;
    b->results = results;
    b->urgent = (flags & KVT_SUBMIT_URGENT) != 0;
    b->detached = (iflags & KVT__OPF_DETACH) != 0;
    b->owned = (iflags & KVT__OPF_OWNED) != 0;

    /* Pass 1: check every move and mark its page busy (a page twice in one
     * batch is then KVT_EBUSY). Nothing changes if any move is refused. */
    uint32_t need_host = 0, need_dev = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvt__seq *s = NULL;
        int rc = kvt__check_move(p, &moves[i], i, &s);
        if (rc) {
            kvt__unbusy(p, b, i);
            free(b);
            return rc;
        }
        const kvt_move *mv = &moves[i];
        kvt__op *op = &b->ops[i];
        memset(op, 0, sizeof *op);
        op->batch = b;
        op->idx = i;
        op->slot = (uint32_t)(s - p->seqs);
        op->lh = (uint32_t)kvt__lh(p, mv->layer, mv->kv_head);
        op->page = mv->page;
        op->from = (uint8_t)mv->from;
        op->to = (uint8_t)mv->to;
        op->flags = (uint8_t)mv->flags;
        op->iflags = (uint8_t)(iflags & ~(KVT__OPF_HANDED | KVT__OPF_DETACH | KVT__OPF_OWNED));
        if (mv->to != KVT_TIER_HOST)
            op->iflags &= (uint8_t)~KVT__OPF_CHAIN;
        const size_t e = (size_t)op->lh * s->cap_pages + op->page;
        /* Busy in every holder's view: a shared page moves once. */
        kvt__page_res(p, s, op->lh, op->page, 0,
                      (uint8_t)(KVT__RES_BUSY |
                                (mv->to == KVT_TIER_DEVICE ? KVT__RES_INBOUND : 0)));
        s->tier.busy++;
        if (mv->to == KVT_TIER_DEVICE)
            s->tier.reloading++;
        if (s->res[e] & (1u << mv->to))
            op->kind = KVT__OP_NOP;
        else if (mv->from == KVT_TIER_DISK)
            op->kind = KVT__OP_READ;
        else if (mv->to == KVT_TIER_DISK)
            op->kind = KVT__OP_WRITE;
        else
            op->kind = KVT__OP_COPY;
        if (op->kind != KVT__OP_NOP) {
            need_host += mv->to == KVT_TIER_HOST;
            need_dev += mv->to == KVT_TIER_DEVICE && !(dst_dev && dst_dev[i]);
        }
        if (op->kind != KVT__OP_COPY || op->from != KVT_TIER_DEVICE || !p->disk)
            op->iflags &= (uint8_t)~KVT__OPF_CHAIN;
    }

    /* Pass 2: reserve destinations; the host tier first drops copies the
     * disk also holds when it is short. */
    int rc = 0;
    kvt__pfx_make_room(p, KVT_TIER_DEVICE, need_dev);
    if (need_dev > p->tier[KVT_TIER_DEVICE].n_free)
        rc = kvt__err(KVT_ENOSPC, "device tier: the batch needs %u blocks, %u are free",
                      need_dev, p->tier[KVT_TIER_DEVICE].n_free);
    if (!rc && need_host) {
        kvt__evict_host(m, need_host);
        if (need_host > p->tier[KVT_TIER_HOST].n_free)
            rc = kvt__err(KVT_ENOSPC, "host tier: the batch needs %u blocks, %u are free and "
                          "no other host page has a complete disk copy to fall back on",
                          need_host, p->tier[KVT_TIER_HOST].n_free);
    }
    p->clock++;
    for (uint32_t i = 0; i < n && !rc; i++) {
        kvt__op *op = &b->ops[i];
        kvt__seq *s = &p->seqs[op->slot];
        const size_t e = (size_t)op->lh * s->cap_pages + op->page;
        if (op->kind == KVT__OP_NOP)
            continue;
        if (op->from == KVT_TIER_DEVICE) {
            op->src_tier = KVT_TIER_DEVICE;
            op->src_blk = s->dev_block[e];
        } else if (op->from == KVT_TIER_HOST) {
            op->src_tier = KVT_TIER_HOST;
            op->src_blk = s->host_block[e];
        } else {
            op->dslot = kvt__disk_slot(p, s, op->lh, op->page);
            op->crc = p->disk->crc[op->dslot];
        }
        if (op->to == KVT_TIER_DISK) {
            /* The extent table grows with the block tables (kvt__seq_reserve). */
            rc = kvt__disk_slot_alloc(p, s, op->lh, op->page, &op->dslot);
        } else if (op->to == KVT_TIER_DEVICE && dst_dev && dst_dev[i]) {
            op->dst_tier = KVT_TIER_DEVICE; /* handed over by the caller */
            op->dst_blk = dst_dev[i];
            op->iflags |= KVT__OPF_HANDED;
        } else {
            if (op->iflags & KVT__OPF_CHAIN)
                rc = kvt__disk_slot_alloc(p, s, op->lh, op->page, &op->dslot);
            if (rc)
                break;
            op->dst_tier = op->to;
            op->dst_blk = kvt__arena_alloc(&p->tier[op->to]);
            if (!op->dst_blk) /* counted above; cannot happen */
                rc = kvt__err(KVT_EINTERNAL, "%s tier: no block left after the count",
                              kvt__tier_name[op->to]);
        }
    }
    if (rc) {
        kvt__unbusy(p, b, n);
        free(b);
        return rc;
    }

    /* Queue: disk moves sorted by slot so neighbours coalesce. */
    kvt__op **io = NULL;
    uint32_t n_io = 0;
    for (uint32_t i = 0; i < n; i++)
        n_io += b->ops[i].kind == KVT__OP_READ || b->ops[i].kind == KVT__OP_WRITE;
    if (n_io > 1) {
        io = malloc((size_t)n_io * sizeof *io);
        if (!io) {
            kvt__unbusy(p, b, n);
            free(b);
            return kvt__err(KVT_ENOMEM, "kvt_mover_submit: cannot allocate the I/O order");
        }
    }
    /* CUDA pools: the moves that read or write device blocks start on the
     * GPU after the work queued so far (appends that wrote the pages,
     * decodes that read a block now handed over). */
    bool dev_io = false;
    for (uint32_t i = 0; i < n && p->be->batch_mark && !dev_io; i++)
        dev_io = b->ops[i].kind != KVT__OP_NOP &&
                 (b->ops[i].from == KVT_TIER_DEVICE || b->ops[i].to == KVT_TIER_DEVICE);
    if (dev_io && (rc = p->be->batch_mark(p, &b->cu_ev))) {
        free(io);
        kvt__unbusy(p, b, n);
        free(b);
        return rc;
    }
    b->fence = m->next_fence++;
    *m->batches_tail = b;
    m->batches_tail = &b->next;
    if (n) {
        m->batches_in_flight++;
        m->moves_in_flight += n;
    }
    const int q = b->urgent ? 0 : 1;
    pthread_mutex_lock(&m->mu);
    uint32_t k = 0;
    bool copies = false, ios = false;
    for (uint32_t i = 0; i < n; i++) {
        kvt__op *op = &b->ops[i];
        m->pending++;
        switch (op->kind) {
        case KVT__OP_NOP:
            kvt__op_finish_locked(m, op, 0, NULL);
            break;
        case KVT__OP_COPY:
            kvt__mover_q_push(&m->cq_head[q], &m->cq_tail[q], op);
            copies = true;
            break;
        default:
            if (io)
                io[k++] = op;
            else
                kvt__mover_q_push(&m->iq_head[q], &m->iq_tail[q], op);
            ios = true;
            break;
        }
    }
    if (io) {
        qsort(io, k, sizeof *io, kvt__op_cmp);
        for (uint32_t i = 0; i < k; i++)
            kvt__mover_q_push(&m->iq_head[q], &m->iq_tail[q], io[i]);
    }
    kvt__wake_locked(m);
    if (copies)
        pthread_cond_broadcast(&m->work_cv);
    if (ios)
        pthread_cond_signal(&m->io_cv);
    pthread_mutex_unlock(&m->mu);
    free(io);
    *fence = b->fence;
    return 0;
}
