/* Sequence storage (the page store's per-sequence half): ids with
 * generations and a pool tag, the lookup, the per-(layer, KV head) block
 * tables and their growth, the top-K memory, and freeing a slot's state.
 * The public sequence calls are lib/api/seq.c. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "store.h"

kvt_seq_id kvt__seq_id_make(const kvt_pool *p, uint32_t slot, uint32_t gen)
{
    return ((uint64_t)gen << 32) | ((uint64_t)p->tag << KVT__ID_SLOT_BITS) |
           (uint64_t)(slot + 1u);
}

uint32_t kvt__seq_id_slot(kvt_seq_id id)
{
    return (uint32_t)(id & ((1u << KVT__ID_SLOT_BITS) - 1u)) - 1u;
}

int kvt__seq_lookup(const kvt_pool *p, kvt_seq_id id, kvt__seq **out)
{
    uint64_t low = id & ((1u << KVT__ID_SLOT_BITS) - 1u);
    uint32_t tag = (uint32_t)(id >> KVT__ID_SLOT_BITS) & ((1u << KVT__ID_TAG_BITS) - 1u);
    uint32_t gen = (uint32_t)(id >> 32);
    if (low == 0 || low > p->max_seqs || tag != p->tag)
        return kvt__err(KVT_ENOENT, "seq: id 0x%llx names no sequence of this pool",
                        (unsigned long long)id);
    kvt__seq *s = &p->seqs[low - 1];
    if (!s->live || s->gen != gen)
        return kvt__err(KVT_ENOENT, "seq: id 0x%llx was released (or never created)",
                        (unsigned long long)id);
    *out = s;
    return 0;
}

void kvt__seq_fini(kvt__seq *s)
{
    free(s->n_tokens);
    free(s->dev_block);
    free(s->host_block);
    free(s->meta_slot);
    free(s->res);
    free(s->share);
    free(s->acc);
    free(s->sel.topk);
    free(s->sel.topk_n);
    free(s->sel.topk_k);
    free(s->sel.qref);
    free(s->tier.imp);
    free(s->tier.use);
    free(s->tier.disk_ext);
    free(s->tier.off_next);
    free(s->tier.dlo);
    free(s->tier.dhi);
    free(s->tier.dstamp);
    free(s->pfx.ids);
    free(s->pfx.key);
    free(s->pfx.ent);
    free(s->be.cu_lo);
    free(s->be.cu_hi);
    uint32_t gen = s->gen;
    memset(s, 0, sizeof *s);
    s->gen = gen;
}

/* Grows the sequence's tables so every (layer, head) holds `pages` entries.
 * All-or-nothing: on failure the old tables are untouched. */
int kvt__seq_reserve(kvt_pool *p, kvt__seq *s, uint32_t pages)
{
    if (pages <= s->cap_pages)
        return 0;
    uint32_t limit = kvt__pages_for(p, s->max_tokens);
    uint64_t cap = s->cap_pages ? (uint64_t)s->cap_pages * 2u : 16u;
    if (cap < pages)
        cap = pages;
    if (cap > limit)
        cap = limit;
    size_t lh = (size_t)p->g.n_layers * p->g.n_kv_heads;
    uint64_t n;
    if (!kvt__mul_u64(lh, cap, &n) || n > SIZE_MAX / sizeof(uint32_t))
        return kvt__err(KVT_EOVERFLOW, "block table: %zu heads x %llu pages overflow", lh,
                        (unsigned long long)cap);
    uint32_t *dev = calloc((size_t)n, sizeof *dev);
    uint32_t *host = calloc((size_t)n, sizeof *host);
    uint32_t *meta = calloc((size_t)n, sizeof *meta);
    uint8_t *res = calloc((size_t)n, 1);
    float *imp = calloc((size_t)n, sizeof *imp);
    uint32_t *use = calloc((size_t)n, sizeof *use);
    uint32_t *share = calloc((size_t)n, sizeof *share);
    /* The tiers that keep per-page state of their own (the disk tier's
     * extent table) grow with the tables, through the pool's hook. */
    int rc = (dev && host && meta && res && imp && use && share)
                 ? (p->on_table_grow ? p->on_table_grow(p, s, (uint32_t)cap) : 0)
                 : KVT_ENOMEM;
    if (rc) {
        free(dev);
        free(host);
        free(meta);
        free(res);
        free(imp);
        free(use);
        free(share);
        if (rc != KVT_ENOMEM)
            return rc;
        return kvt__err(KVT_ENOMEM, "block table: cannot grow to %llu pages per head",
                        (unsigned long long)cap);
    }
    for (size_t i = 0; i < lh && s->cap_pages; i++) {
        size_t from = i * s->cap_pages, to = i * (size_t)cap;
        memcpy(dev + to, s->dev_block + from, s->cap_pages * sizeof *dev);
        memcpy(host + to, s->host_block + from, s->cap_pages * sizeof *host);
        memcpy(meta + to, s->meta_slot + from, s->cap_pages * sizeof *meta);
        memcpy(res + to, s->res + from, s->cap_pages);
        memcpy(imp + to, s->tier.imp + from, s->cap_pages * sizeof *imp);
        memcpy(use + to, s->tier.use + from, s->cap_pages * sizeof *use);
        memcpy(share + to, s->share + from, s->cap_pages * sizeof *share);
    }
    free(s->dev_block);
    free(s->host_block);
    free(s->meta_slot);
    free(s->res);
    free(s->tier.imp);
    free(s->tier.use);
    free(s->share);
    s->dev_block = dev;
    s->host_block = host;
    s->meta_slot = meta;
    s->res = res;
    s->tier.imp = imp;
    s->tier.use = use;
    s->share = share;
    s->cap_pages = (uint32_t)cap;
    return 0;
}

/* Makes sure a sequence can keep its last top-K pages per (layer, head);
 * growing keeps what was recorded, so the rerank schedule is unaffected. */
int kvt__seq_topk_reserve(const kvt_pool *p, kvt__seq *s, uint32_t cap)
{
    if (s->sel.topk && cap <= s->sel.topk_cap)
        return 0;
    const size_t lh = (size_t)p->g.n_layers * p->g.n_kv_heads;
    const size_t c = cap ? cap : 1u;
    if (lh > SIZE_MAX / sizeof(uint32_t) / c)
        return kvt__err(KVT_EOVERFLOW, "seq: top-K storage of %zu heads x %u pages overflows",
                        lh, cap);
    uint32_t *t = malloc(lh * c * sizeof *t);
    uint32_t *n = s->sel.topk_n ? s->sel.topk_n : calloc(lh, sizeof *n);
    uint32_t *k = s->sel.topk_k ? s->sel.topk_k : calloc(lh, sizeof *k);
    float *qr = s->sel.qref ? s->sel.qref : calloc(lh * p->g.head_dim, sizeof *qr);
    if (!t || !n || !k || !qr) {
        free(t);
        if (n != s->sel.topk_n)
            free(n);
        if (k != s->sel.topk_k)
            free(k);
        if (qr != s->sel.qref)
            free(qr);
        return kvt__err(KVT_ENOMEM, "step: cannot allocate top-K storage (%u pages per head)",
                        cap);
    }
    if (s->sel.topk)
        for (size_t b = 0; b < lh; b++)
            memcpy(t + b * c, s->sel.topk + b * s->sel.topk_cap, n[b] * sizeof *t);
    free(s->sel.topk);
    s->sel.topk = t;
    s->sel.topk_n = n;
    s->sel.topk_k = k;
    s->sel.qref = qr;
    s->sel.topk_cap = (uint32_t)c;
    return 0;
}
