/* The prefix cache's index: page keys (a chained hash of the previous
 * page's key, the page's token ids and the salt), the pool-wide map from
 * key to entry, the token ids a sequence records, keying a sequence's full
 * pages, and attaching the longest cached prefix to a new sequence. What
 * becomes of pages no sequence holds is pcache.c. */
#include <stdlib.h>
#include <string.h>

#include "tier.h"

static inline uint64_t kvt__mix(uint64_t h)
{
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ull;
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ull;
    h ^= h >> 32;
    return h;
}

uint64_t kvt__pfx_key(const kvt__pfx *x, uint64_t prev, const uint32_t *ids, uint64_t salt)
{
    uint64_t h = kvt__mix(prev ^ 0x9e3779b97f4a7c15ull) ^ kvt__mix(salt + 0x632be59bd9b4e019ull);
    uint32_t i = 0;
    for (; i + 1 < x->P; i += 2)
        h = kvt__mix(h ^ (ids[i] | (uint64_t)ids[i + 1] << 32)) + 0x9e3779b97f4a7c15ull;
    if (i < x->P)
        h = kvt__mix(h ^ ids[i] ^ 0xff51afd7ed558ccdull);
#ifdef KVT_FAULT_INJECTION
    h &= x->key_mask;
#endif
    return h;
}

int kvt__pfx_create(kvt_pool *p, const uint64_t cap_bytes[KVT_NUM_TIERS])
{
    kvt__pfx *x = calloc(1, sizeof *x);
    if (!x)
        return kvt__err(KVT_ENOMEM, "prefix cache: cannot allocate its state");
    p->pfx = x;
    x->LH = p->g.n_layers * p->g.n_kv_heads;
    x->P = p->g.page_tokens;
    x->n_ent = p->meta.n_blocks / x->LH + 1u;
    uint32_t nb = 1;
    while (nb < x->n_ent && nb < (1u << 30))
        nb <<= 1;
    x->mask = nb - 1u;
    const size_t n = x->n_ent, nlh = n * x->LH;
    x->e = calloc(n, sizeof *x->e);
    x->ids = malloc(n * x->P * sizeof *x->ids);
    x->meta = calloc(nlh, sizeof *x->meta);
    x->dev = calloc(nlh, sizeof *x->dev);
    x->host = calloc(nlh, sizeof *x->host);
    x->res = calloc(nlh, 1);
    x->bucket = calloc((size_t)nb, sizeof *x->bucket);
    x->pg_key = calloc(p->meta.n_blocks, sizeof *x->pg_key);
    if (!x->e || !x->ids || !x->meta || !x->dev || !x->host || !x->res || !x->bucket ||
        !x->pg_key)
        return kvt__err(KVT_ENOMEM, "prefix cache: cannot allocate the index of %u entries",
                        x->n_ent);
    for (uint32_t i = x->n_ent; i-- > 0;) {
        x->e[i].next = x->free_head;
        x->free_head = i + 1u;
    }
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
        x->cap[t] = cap_bytes[t] ? cap_bytes[t] / p->block_bytes : UINT64_MAX;
    x->epoch = 1;
#ifdef KVT_FAULT_INJECTION
    x->key_mask = UINT64_MAX;
#endif
    return 0;
}

void kvt__pfx_destroy(kvt_pool *p)
{
    kvt__pfx *x = p->pfx;
    if (!x)
        return;
    free(x->e);
    free(x->ids);
    free(x->meta);
    free(x->dev);
    free(x->host);
    free(x->res);
    free(x->bucket);
    free(x->pg_key);
    free(x);
    p->pfx = NULL;
}

/* The entry holding page `page` of the chain with that key, salt, parent and
 * ids (confirmed by comparing all of them); UINT32_MAX = none. */
static uint32_t kvt__pfx_find(const kvt__pfx *x, uint64_t key, uint64_t salt, uint32_t page,
                              uint64_t parent, const uint32_t *ids)
{
    for (uint32_t v = x->bucket[key & x->mask]; v; v = x->e[v - 1u].next) {
        const kvt__pent *e = &x->e[v - 1u];
        if (e->key == key && e->salt == salt && e->page == page && e->parent == parent &&
            !memcmp(x->ids + (size_t)(v - 1u) * x->P, ids, x->P * sizeof *ids))
            return v - 1u;
    }
    return UINT32_MAX;
}

/* Grows s's id, key and entry arrays to hold `need` positions. */
static int kvt__pfx_grow(const kvt_pool *p, kvt__seq *s, uint32_t need)
{
    struct kvt__seq_pfx *f = &s->pfx;
    if (need <= f->cap_ids)
        return 0;
    const uint32_t P = p->g.page_tokens;
    const uint64_t lim = (uint64_t)kvt__pages_for(p, s->max_tokens) * P;
    uint64_t cap = f->cap_ids ? (uint64_t)f->cap_ids * 2u : 16u * P;
    cap = cap < need ? need : cap;
    cap = (cap + P - 1u) / P * P;
    cap = cap > lim ? lim : cap;
    uint32_t *ids = realloc(f->ids, (size_t)cap * sizeof *ids);
    if (ids)
        f->ids = ids;
    uint64_t *key = ids ? realloc(f->key, (size_t)(cap / P) * sizeof *key) : NULL;
    if (key)
        f->key = key;
    uint64_t *ent = key ? realloc(f->ent, (size_t)(cap / P) * sizeof *ent) : NULL;
    if (!ent)
        return kvt__err(KVT_ENOMEM, "token ids: cannot grow to %llu positions",
                        (unsigned long long)cap);
    f->ent = ent;
    memset(ent + f->cap_ids / P, 0, (size_t)(cap / P - f->cap_ids / P) * sizeof *ent);
    f->cap_ids = (uint32_t)cap;
    return 0;
}

int kvt__pfx_ids_set(kvt_pool *p, kvt__seq *s, uint32_t first, const uint32_t *ids, uint32_t n,
                     const char *what)
{
    struct kvt__seq_pfx *f = &s->pfx;
    if (first > f->n_ids)
        return kvt__err(KVT_EINVAL, "%s: starts at position %u, but only the first %u "
                        "positions have ids (they are recorded in order)", what, first, f->n_ids);
    if ((uint64_t)first + n > s->max_tokens)
        return kvt__err(KVT_EINVAL, "%s: positions %u..%llu are past the sequence's "
                        "max_tokens %u", what, first, (unsigned long long)first + n,
                        s->max_tokens);
    if (n && !ids)
        return kvt__err(KVT_EINVAL, "%s: NULL with %u ids", what, n);
    for (uint32_t j = 0; first + j < f->n_ids && j < n; j++)
        if (f->ids[first + j] != ids[j])
            return kvt__err(KVT_EINVAL, "%s: position %u has id %u, but %u is recorded there "
                            "(truncate first to change it)", what, first + j, ids[j],
                            f->ids[first + j]);
    int rc = kvt__pfx_grow(p, s, first + n);
    if (rc)
        return rc;
    if (first + n > f->n_ids) {
        memcpy(f->ids + f->n_ids, ids + (f->n_ids - first),
               (size_t)(first + n - f->n_ids) * sizeof *ids);
        f->n_ids = first + n;
    }
    return 0;
}

/* Write-behind: page pg of s, in every (layer, head), as one value into the
 * remote tier's queue (a copy: the threads never read the pool). A page
 * that cannot be read is not written (the tier is a cache). */
static bool kvt__pfx_remote_put(const kvt_pool *p, const kvt__seq *s, uint32_t pg,
                                const kvt__pent *e, kvt__rkey parent, const uint32_t *ids)
{
    const kvt__rgeom *g = kvt__rclient_geom(p->remote);
    const size_t n = kvt__rvalue_bytes(g);
    uint8_t *v = kvt__rclient_buf(p->remote);
    if (v) {
        kvt__rvalue_header(g, v, pg, e->salt, e->rk, parent, ids);
        for (size_t lh = 0; lh < (size_t)g->L * g->H; lh++)
            if (kvt__page_read(p, s, lh, pg, kvt__rvalue_block(g, v, lh))) {
                kvt__rclient_log(p->remote, "kvtier remote: page %u not written: %s", pg,
                                 kvt_last_error());
                kvt_clear_error();
                kvt__rclient_buf_free(p->remote, v);
                v = NULL;
                break;
            }
    }
    char key[KVT__RKEY_MAX];
    kvt__rkey_name(g, e->rk, key);
    if (v)
        kvt__rvalue_seal(g, v);
    return kvt__rclient_put(p->remote, key, v, v ? n : 0); /* (NULL: counted as dropped) */
}

uint32_t kvt__pfx_remote_push(kvt_pool *p, kvt__seq *s)
{
    kvt__pfx *x = p->pfx;
    const struct kvt__seq_pfx *f = &s->pfx;
    if (!p->remote || !x || f->epoch != x->epoch)
        return 0;
    const kvt__rgeom *g = kvt__rclient_geom(p->remote);
    uint32_t n = 0;
    for (uint32_t pg = 0; pg < f->n_reg; pg++) {
        if (!kvt__pfx_valid(x, f->ent[pg]))
            break; /* (a chain is keyed from its start: nothing after it either) */
        const kvt__pent *e = &x->e[(uint32_t)f->ent[pg] - 1u];
        const kvt__rkey up = pg ? x->e[(uint32_t)f->ent[pg - 1u] - 1u].rk : kvt__rkey_seed(g);
        n += kvt__pfx_remote_put(p, s, pg, e, up, f->ids + (size_t)pg * x->P);
    }
    return n;
}

void kvt__pfx_register(kvt_pool *p, kvt__seq *s)
{
    kvt__pfx *x = p->pfx;
    struct kvt__seq_pfx *f = &s->pfx;
    if (!x || !f->ids || f->dropped)
        return;
    const uint32_t P = x->P, H = p->g.n_kv_heads;
    uint32_t full = UINT32_MAX;
    for (uint32_t l = 0; l < p->g.n_layers; l++)
        full = s->n_tokens[l] / P < full ? s->n_tokens[l] / P : full;
    full = f->n_ids / P < full ? f->n_ids / P : full;
    if (f->epoch != x->epoch) { /* a drop: the entries named may be gone */
        f->epoch = x->epoch;
        f->n_reg = 0;
    }
    uint32_t pg = f->n_reg;
    for (; pg < full; pg++) {
        const uint32_t *id = f->ids + (size_t)pg * P;
        const uint64_t parent = pg ? f->ent[pg - 1u] : 0;
        if (pg && !kvt__pfx_valid(x, parent))
            break; /* the chain before it is not indexed: nor can it be */
        if (pg >= f->n_key) { /* keys stay valid until a truncation */
            f->key[pg] = kvt__pfx_key(x, pg ? f->key[pg - 1u] : 0, id, f->salt);
            f->n_key = pg + 1u;
        }
        if (kvt__pfx_valid(x, f->ent[pg]) && x->e[(uint32_t)f->ent[pg] - 1u].parent == parent)
            continue;
        uint32_t i = kvt__pfx_find(x, f->key[pg], f->salt, pg, parent, id);
        if (i != UINT32_MAX) { /* the content is indexed (maybe another page of it) */
            f->ent[pg] = kvt__pfx_ref(x, i);
            continue;
        }
        /* Index s's own pages, unless one of them is indexed already (under
         * other content: a page a restore or an older chain keyed). */
        bool free_pages = true;
        for (uint32_t l = 0; l < p->g.n_layers && free_pages; l++)
            for (uint32_t h = 0; h < H; h++) {
                const size_t e = kvt__lh(p, l, h) * s->cap_pages + pg;
                free_pages &= !x->pg_key[s->meta_slot[e]];
            }
        if (!free_pages || (i = kvt__pfx_entry_new(p)) == UINT32_MAX)
            break;
        if (pg && !kvt__pfx_valid(x, parent)) {
            /* entry_new reclaimed the parent (an unheld entry whose content
             * this sequence computed again): nothing to chain to. */
            x->e[i].next = x->free_head;
            x->free_head = i + 1u;
            break;
        }
        kvt__pent *e = &x->e[i];
        e->key = f->key[pg];
        e->salt = f->salt;
        e->parent = parent;
        e->page = pg;
        e->n_held = x->LH;
        e->live = 1;
        e->in_lru = 0;
        memcpy(x->ids + (size_t)i * P, id, P * sizeof *id);
        for (uint32_t lh = 0; lh < x->LH; lh++) {
            const uint32_t m = s->meta_slot[(size_t)lh * s->cap_pages + pg];
            x->meta[(size_t)i * x->LH + lh] = m;
            x->pg_key[m] = i * x->LH + lh + 1u;
        }
        e->next = x->bucket[e->key & x->mask];
        x->bucket[e->key & x->mask] = i + 1u;
        x->keyed += x->LH;
        f->ent[pg] = kvt__pfx_ref(x, i);
        if (p->remote) { /* a position new to this pool: the remote tier gets it */
            const kvt__rgeom *g = kvt__rclient_geom(p->remote);
            const kvt__rkey up = pg ? x->e[(uint32_t)parent - 1u].rk : kvt__rkey_seed(g);
            e->rk = kvt__rkey_next(g, up, id, f->salt);
            if (pg >= f->rhave && !(kvt__rclient_flags(p->remote) & KVT_REMOTE_NO_PUT))
                kvt__pfx_remote_put(p, s, pg, e, up, id);
        }
    }
    f->n_reg = pg;
}

int kvt__pfx_seq_fork(const kvt_pool *p, const kvt__seq *s, kvt__seq *c)
{
    const struct kvt__seq_pfx *f = &s->pfx;
    struct kvt__seq_pfx *g = &c->pfx;
    g->salt = f->salt;
    g->dropped = f->dropped;
    g->n_reg = f->n_reg;
    g->n_key = f->n_key;
    g->epoch = f->epoch;
    if (!f->ids)
        return 0;
    const size_t np = f->cap_ids / p->g.page_tokens;
    g->ids = malloc((size_t)f->cap_ids * sizeof *g->ids);
    g->key = malloc(np * sizeof *g->key);
    g->ent = malloc(np * sizeof *g->ent);
    if (!g->ids || !g->key || !g->ent)
        return kvt__err(KVT_ENOMEM, "kvt_seq_fork: cannot copy %u token ids", f->n_ids);
    memcpy(g->ids, f->ids, (size_t)f->n_ids * sizeof *g->ids);
    memcpy(g->key, f->key, np * sizeof *g->key);
    memcpy(g->ent, f->ent, np * sizeof *g->ent);
    g->cap_ids = f->cap_ids;
    g->n_ids = f->n_ids < c->max_tokens ? f->n_ids : c->max_tokens; /* (a smaller limit) */
    return 0;
}

void kvt__pfx_seq_cut(const kvt_pool *p, kvt__seq *s, uint32_t n)
{
    struct kvt__seq_pfx *f = &s->pfx;
    f->n_ids = f->n_ids < n ? f->n_ids : n;
    const uint32_t full = n / p->g.page_tokens, kept = f->n_ids / p->g.page_tokens;
    f->n_reg = f->n_reg < full ? f->n_reg : full;
    f->rhave = f->rhave < full ? f->rhave : full; /* pages keyed again are new here */
    f->n_key = f->n_key < kept ? f->n_key : kept;
    for (uint32_t pg = full; f->ent && pg < f->cap_ids / p->g.page_tokens; pg++)
        f->ent[pg] = 0;
}

int kvt__pfx_attach(kvt_pool *p, kvt__seq *s, kvt_seq_id id, const uint32_t *ids, uint32_t n,
                    bool attach, uint32_t *matched)
{
    kvt__pfx *x = p->pfx;
    struct kvt__seq_pfx *f = &s->pfx;
    *matched = 0;
    int rc = kvt__pfx_ids_set(p, s, 0, ids, n, "opts->prefix");
    if (rc || !x)
        return rc;
    if (!attach) { /* the ids only */
        x->lookups++;
        x->miss_tokens += n;
        return 0;
    }
    const uint32_t P = x->P, full = n / P;
    uint32_t m = 0;
    if (f->epoch != x->epoch) {
        f->epoch = x->epoch;
        f->n_reg = 0;
    }
    for (; m < full; m++) {
        const uint64_t parent = m ? f->ent[m - 1u] : 0;
        f->key[m] = kvt__pfx_key(x, m ? f->key[m - 1u] : 0, ids + (size_t)m * P, f->salt);
        const uint32_t i = kvt__pfx_find(x, f->key[m], f->salt, m, parent, ids + (size_t)m * P);
        if (i == UINT32_MAX)
            break;
        f->ent[m] = kvt__pfx_ref(x, i);
        f->n_key = m + 1u;
    }
    f->n_key = f->n_key > m ? m : f->n_key;
    if (!m) {
        x->lookups++;
        x->miss_tokens += n;
        return 0;
    }
    if ((rc = kvt__seq_reserve(p, s, m)))
        return rc;
    /* Deepest first, so that the entries of the chain that were unheld leave
     * the LRU list (and are held from now on) in one pass. */
    for (uint32_t pg = m; pg-- > 0;) {
        const uint32_t i = (uint32_t)f->ent[pg] - 1u;
        for (uint32_t lh = 0; lh < x->LH; lh++)
            kvt__pfx_adopt(p, s, i, lh, pg);
    }
    for (uint32_t l = 0; l < p->g.n_layers; l++)
        s->n_tokens[l] = m * P;
    f->n_reg = m;
    /* A tiered pool keeps its forced pages on device: bring them in (after
     * the moves other holders have in flight on them land). */
    if (p->pol) {
        uint64_t need = 0;
        kvt__place_attach_in(p, s, id, &need);
        kvt__pfx_make_room(p, KVT_TIER_DEVICE, need);
        if (p->tier[KVT_TIER_DEVICE].n_free < need)
            return kvt__err(KVT_ENOSPC, "opts->prefix: %u tokens matched, but the %llu pages "
                            "the placement keeps on device do not fit (%u blocks free)", m * P,
                            (unsigned long long)need, p->tier[KVT_TIER_DEVICE].n_free);
        if ((rc = kvt__place_attach_in(p, s, id, NULL)))
            return rc;
    }
    f->matched = m * P;
    *matched = m * P;
    x->lookups++;
    x->hit_tokens += (uint64_t)m * P;
    x->miss_tokens += n - m * P;
    x->hit_pages += (uint64_t)m * x->LH;
    return 0;
}
