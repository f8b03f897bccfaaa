/* Fused recycle (kvt__cu_recycle, cuda/recycle.cu) against a brute-force
 * host reference written here straight from the rule in kvt_cuda.h:
 * classify every page, room = max(0, k * window - (selected unforced +
 * stuck)), qsort the evictable pages by (importance desc with NaN as
 * +infinity, page asc), keep the first `room`, hand the evicted pages'
 * blocks to the promoted pages in page order and then the free list, drop
 * the rest.
 *
 * Random tables mix every residency a page can have (device with host /
 * disk / both / no other copy, busy, inbound with and without busy,
 * host-only, disk-only, busy off device), importances with many ties
 * (small integers, -0 and +0, infinities, NaN), selections from a
 * brute-force top-K (forced sink / local / partial last page plus the k best
 * votes), windows 1..3, free lists short, exact, one short, and long. The
 * whole updated tables (padding between items included), the copy lists
 * (as multisets, then in exact order), freed blocks, staged pages, counts
 * and status must match exactly; entries past the counts stay untouched. */
#include "gputest.h"
#include "testutil.h"

#define R_DEV KVT_RES_DEVICE
#define R_HOST KVT_RES_HOST
#define R_DISK KVT_RES_DISK
#define R_BUSY 0x80u
#define R_INB 0x40u
#define PAD 5                 /* table entries between items */
#define SENT 0xa5a5a5a5u      /* untouched output entries */
#define BLOCK_BYTES 8192u

/* ---- the reference ------------------------------------------------------------ */

typedef struct {
    float imp;
    uint32_t page;
} ev_t;

static double imp_rank(float f)
{
    return isnan(f) ? INFINITY : (double)f;
}

static int ev_cmp(const void *a, const void *b)
{
    const ev_t *x = a, *y = b;
    const double ix = imp_rank(x->imp), iy = imp_rank(y->imp);
    if (ix != iy)
        return ix > iy ? -1 : 1;
    return (x->page > y->page) - (x->page < y->page);
}

static int forced_page(uint32_t pg, uint32_t np, uint32_t tokens, uint32_t P, uint32_t sink,
                       uint32_t local)
{
    /* a partial last page is forced on top of the local (full) pages */
    return pg < sink || (uint64_t)pg + local + (tokens % P != 0) >= np;
}

typedef struct {
    uint32_t *dev;   /* the item's entries, updated */
    uint8_t *res;
    kvt__cu_copy *copies;
    uint32_t *freed, *stage;
    uint32_t counts[4], status;
    uint32_t deficit; /* blocks needed from the free list */
} ref_out;

/* What the checked items exercised (status 0 items), so a test can insist
 * that its random cases reached every path. */
typedef struct {
    uint32_t partial_keep;  /* 0 < room < evictable */
    uint32_t all_evicted;   /* room 0 with evictable pages */
    uint32_t recycled_free; /* evicted blocks and free blocks both handed */
    uint32_t dropped;       /* evicted pages beyond the promoted ones */
    uint32_t staged, copied;
    uint32_t tie_evicted;   /* an evicted page tying on importance with a kept one */
    uint32_t nan_evict;     /* a NaN importance among the evictable pages */
} cov_t;
static cov_t cov;

/* Applies the header's rule to one item (dev/res updated in place in out). */
static void ref_recycle(const kvt__cu_recycle_item *it, uint32_t P, uint32_t max_pages,
                        const uint32_t *sel, uint32_t nsel, const uint32_t *host,
                        const float *imp, const uint32_t *freel, uint64_t host_base,
                        uint64_t dev_base, ref_out *o)
{
    const uint32_t np = it->n_pages;
    memset(o->counts, 0, sizeof o->counts);
    o->deficit = 0;
    if (np > max_pages) {
        o->status = 2;
        return;
    }
    uint8_t *selected = calloc(np + 1, 1);
    for (uint32_t j = 0; j < nsel; j++)
        if (sel[j] < np)
            selected[sel[j]] = 1;
    ev_t *ev = malloc((np + 1) * sizeof *ev);
    uint32_t *pro = malloc((np + 1) * sizeof *pro);
    uint32_t nev = 0, npro = 0, ntop = 0, stuck = 0;
    for (uint32_t pg = 0; pg < np; pg++) {
        const uint32_t r = o->res[pg];
        const int f = forced_page(pg, np, it->tokens, P, it->sink, it->local);
        if (selected[pg]) {
            ntop += !f;
            if (!(r & R_DEV) && !(r & (R_BUSY | R_INB)))
                pro[npro++] = pg;
        } else if ((r & R_DEV) && !f) {
            if (!(r & R_BUSY) && (r & (R_HOST | R_DISK)))
                ev[nev++] = (ev_t){imp[pg], pg};
            else
                stuck++;
        }
    }
    const uint64_t kw = (uint64_t)it->k * it->window, used = (uint64_t)ntop + stuck;
    const uint64_t room = kw > used ? kw - used : 0;
    qsort(ev, nev, sizeof *ev, ev_cmp);
    const uint32_t keep = room < nev ? (uint32_t)room : nev, nevict = nev - keep;
    o->deficit = npro > nevict ? npro - nevict : 0;
    if (o->deficit > it->n_free) {
        o->status = 1;
    } else {
        cov.partial_keep += keep > 0 && nevict > 0;
        cov.all_evicted += keep == 0 && nevict > 0;
        cov.recycled_free += nevict > 0 && npro > nevict;
        cov.dropped += nevict > npro;
        cov.tie_evicted += keep > 0 && nevict > 0 &&
                           imp_rank(ev[keep - 1].imp) == imp_rank(ev[keep].imp);
        for (uint32_t x = 0; x < nev; x++)
            if (isnan(ev[x].imp)) {
                cov.nan_evict++;
                break;
            }
        o->status = 0;
        uint32_t nc = 0, ns = 0, nf = 0;
        for (uint32_t x = 0; x < npro; x++) {
            const uint32_t pg = pro[x];
            uint32_t blk;
            if (x < nevict) {
                const uint32_t e = ev[keep + x].page;
                blk = o->dev[e];
                o->dev[e] = 0;
                o->res[e] &= (uint8_t)~R_DEV;
            } else {
                blk = freel[x - nevict];
            }
            o->dev[pg] = blk;
            o->res[pg] |= (uint8_t)(R_BUSY | R_INB);
            if (o->res[pg] & R_HOST)
                o->copies[nc++] = (kvt__cu_copy){host_base + (uint64_t)host[pg] * BLOCK_BYTES,
                                                 dev_base + (uint64_t)blk * BLOCK_BYTES,
                                                 BLOCK_BYTES};
            else
                o->stage[ns++] = pg;
        }
        for (uint32_t x = npro; x < nevict; x++) {
            const uint32_t e = ev[keep + x].page;
            o->freed[nf++] = o->dev[e];
            o->dev[e] = 0;
            o->res[e] &= (uint8_t)~R_DEV;
        }
        cov.copied += nc;
        cov.staged += ns;
        o->counts[0] = nc;
        o->counts[1] = nevict;
        o->counts[2] = nf;
        o->counts[3] = ns;
    }
    free(selected);
    free(ev);
    free(pro);
}

/* ---- random cases ----------------------------------------------------------------- */

/* Residency states, with their weights in a "device-heavy" and a
 * "host-heavy" mix. */
static const struct {
    uint8_t res;
    uint8_t w_dev, w_host;
} states[] = {
    {R_DEV | R_HOST, 30, 8},
    {R_DEV | R_DISK, 10, 3},
    {R_DEV | R_HOST | R_DISK, 10, 3},
    {R_DEV, 5, 2},                          /* no other copy: stuck */
    {R_DEV | R_HOST | R_BUSY, 4, 2},        /* moving: stuck */
    {R_DEV | R_HOST | R_INB | R_BUSY, 3, 2}, /* arriving, busy */
    {R_DEV | R_HOST | R_INB, 3, 2},         /* arriving, not busy: evictable */
    {R_HOST, 12, 40},
    {R_DISK, 6, 15},
    {R_HOST | R_DISK, 6, 15},
    {R_HOST | R_BUSY, 3, 4},                /* moving between other tiers */
    {R_DISK | R_BUSY | R_INB, 2, 3},        /* on its way to device */
    {R_HOST | R_INB, 1, 2},                 /* inbound bit alone also blocks promotion */
};
#define N_STATES (sizeof states / sizeof states[0])

static uint8_t pick_state(tu_rng *r, int host_heavy)
{
    uint32_t total = 0;
    for (size_t i = 0; i < N_STATES; i++)
        total += host_heavy ? states[i].w_host : states[i].w_dev;
    uint32_t x = tu_below(r, total);
    for (size_t i = 0; i < N_STATES; i++) {
        const uint32_t w = host_heavy ? states[i].w_host : states[i].w_dev;
        if (x < w)
            return states[i].res;
        x -= w;
    }
    return R_HOST;
}

static float pick_imp(tu_rng *r, int distinct)
{
    if (distinct)
        return tu_unit(r) * 100.0f;
    static const float vals[] = {-2.0f, -1.0f, -0.0f, 0.0f, 0.5f, 1.0f, 2.0f, 3.0f};
    const uint32_t x = tu_below(r, 40);
    if (x == 0)
        return NAN;
    if (x == 1)
        return INFINITY;
    if (x == 2)
        return -INFINITY;
    return vals[x % 8];
}

typedef struct {
    uint32_t P, n_items, max_pages;
    uint32_t n_dev_blocks, n_host_blocks; /* block numbers in use are below these */
    kvt__cu_recycle_item *items;
    uint64_t n_tab, n_sel_tot, n_free_tot, n_out;
    uint32_t *dev, *host, *sel, *n_sel, *freel;
    uint8_t *res;
    float *imp;
} rc_case;

static void case_free(rc_case *c)
{
    free(c->items);
    free(c->dev);
    free(c->host);
    free(c->sel);
    free(c->n_sel);
    free(c->freel);
    free(c->res);
    free(c->imp);
}

typedef struct {
    uint32_t tokens_max;  /* tokens drawn in 0..tokens_max */
    uint32_t force_np;    /* > 0: this many pages exactly (every item) */
    int free_mode;        /* -1 random per item, else 0 short, 1 exact, 2 one short, 3 long */
} gen_opts;

/* One launch's worth of items. Blocks: device blocks and free blocks are
 * distinct numbers from one counter, host blocks from another. */
static void make_case(rc_case *c, tu_rng *r, uint32_t n_items, uint32_t P, const gen_opts *g)
{
    memset(c, 0, sizeof *c);
    c->P = P;
    c->n_items = n_items;
    c->items = calloc(n_items, sizeof *c->items);
    uint32_t *np = malloc(n_items * sizeof *np), *tokens = malloc(n_items * sizeof *tokens);
    for (uint32_t i = 0; i < n_items; i++) {
        uint32_t T;
        if (g->force_np)
            T = (g->force_np - 1) * P + 1 + tu_below(r, P);
        else
            T = tu_below(r, 5) == 0 ? tu_below(r, 2 * P + 1) : tu_below(r, g->tokens_max + 1);
        tokens[i] = T;
        np[i] = (T + P - 1) / P;
        c->max_pages = np[i] > c->max_pages ? np[i] : c->max_pages;
    }
    /* Offsets, with padding between items. */
    uint64_t toff = PAD, soff = 0, ooff = 0, foff = 0;
    for (uint32_t i = 0; i < n_items; i++) {
        kvt__cu_recycle_item *it = &c->items[i];
        it->n_pages = np[i];
        it->tokens = tokens[i];
        it->table_off = toff;
        it->sel_off = soff;
        it->copy_off = ooff;
        it->free_off = foff;
        toff += np[i] + PAD;
        soff += np[i] + 1;
        ooff += np[i] + 1;
        foff += np[i] + 4;
    }
    c->n_tab = toff;
    c->n_sel_tot = soff;
    c->n_out = ooff;
    c->n_free_tot = foff;
    c->dev = malloc(c->n_tab * sizeof *c->dev);
    c->host = malloc(c->n_tab * sizeof *c->host);
    c->res = malloc(c->n_tab);
    c->imp = malloc(c->n_tab * sizeof *c->imp);
    c->sel = malloc((c->n_sel_tot + 1) * sizeof *c->sel);
    c->n_sel = calloc(n_items, sizeof *c->n_sel);
    c->freel = malloc((c->n_free_tot + 1) * sizeof *c->freel);
    /* Padding: garbage that must survive. */
    for (uint64_t e = 0; e < c->n_tab; e++) {
        c->dev[e] = 0xdead0000u | (uint32_t)(e & 0xffff);
        c->host[e] = 0xbeef0000u;
        c->res[e] = 0xff;
        c->imp[e] = -1e30f;
    }
    for (uint64_t e = 0; e <= c->n_sel_tot; e++)
        c->sel[e] = 0xfffffff0u;
    uint32_t next_dev = 1, next_host = 1;
    for (uint32_t i = 0; i < n_items; i++) {
        kvt__cu_recycle_item *it = &c->items[i];
        const uint32_t n = np[i];
        const int host_heavy = tu_below(r, 2), imp_mode = (int)tu_below(r, 6);
        const int distinct = imp_mode < 2; /* 4: all equal, else ties from a small set */
        it->window = 1 + tu_below(r, 3);
        it->k = tu_below(r, n / 2 + 3);
        it->sink = tu_below(r, 4);
        it->local = tu_below(r, 4);
        uint32_t *dev = c->dev + it->table_off, *host = c->host + it->table_off;
        uint8_t *res = c->res + it->table_off;
        float *imp = c->imp + it->table_off;
        float *vote = malloc((n + 1) * sizeof *vote);
        for (uint32_t pg = 0; pg < n; pg++) {
            res[pg] = pick_state(r, host_heavy);
            dev[pg] = (res[pg] & R_DEV) ? next_dev++ : 0;
            host[pg] = (res[pg] & R_HOST) ? next_host++ : 0;
            imp[pg] = imp_mode == 4 ? 1.0f : pick_imp(r, distinct);
            /* The selection's votes: the importance itself (the usual case:
             * importance is the last score) or independent. */
            vote[pg] = tu_below(r, 2) ? imp[pg] : pick_imp(r, 0);
            if (isnan(vote[pg]))
                vote[pg] = INFINITY;
        }
        /* Brute-force top-K: forced pages + the k best unforced pages by
         * (vote desc, page asc), listed in page order. */
        uint8_t *in = calloc(n + 1, 1);
        for (uint32_t pg = 0; pg < n; pg++)
            in[pg] = (uint8_t)forced_page(pg, n, it->tokens, P, it->sink, it->local);
        for (uint32_t got = 0; got < it->k; got++) {
            int best = -1;
            for (uint32_t pg = 0; pg < n; pg++)
                if (!in[pg] && (best < 0 || vote[pg] > vote[best]))
                    best = (int)pg;
            if (best < 0)
                break;
            in[best] = 2;
        }
        uint32_t *sel = c->sel + it->sel_off, ns = 0;
        for (uint32_t pg = 0; pg < n; pg++)
            if (in[pg])
                sel[ns++] = pg;
        c->n_sel[i] = ns;
        free(in);
        free(vote);
    }
    /* Free lists: the reference's deficit with an unlimited list decides
     * the boundary sizes. */
    for (uint32_t i = 0; i < n_items; i++) {
        kvt__cu_recycle_item *it = &c->items[i];
        const uint32_t n = np[i];
        it->n_free = UINT32_MAX;
        uint32_t *dev = malloc((n + 1) * sizeof *dev);
        uint8_t *res = malloc(n + 1);
        memcpy(dev, c->dev + it->table_off, n * sizeof *dev);
        memcpy(res, c->res + it->table_off, n);
        kvt__cu_copy *cp = malloc((n + 1) * sizeof *cp);
        uint32_t *fr = malloc((n + 1) * sizeof *fr), *st = malloc((n + 1) * sizeof *st);
        uint32_t *fake = malloc((n + 1) * sizeof *fake);
        for (uint32_t x = 0; x <= n; x++)
            fake[x] = x + 1;
        ref_out o = {dev, res, cp, fr, st, {0}, 0, 0};
        const cov_t saved = cov; /* this run only sizes the free list */
        ref_recycle(it, P, UINT32_MAX, c->sel + it->sel_off, c->n_sel[i],
                    c->host + it->table_off, c->imp + it->table_off, fake, 0, 0, &o);
        cov = saved;
        const int mode = g->free_mode >= 0 ? g->free_mode : (int)tu_below(r, 4);
        uint32_t nf;
        switch (mode) {
        case 0: nf = tu_below(r, 3); break;
        case 1: nf = o.deficit; break;
        case 2: nf = o.deficit ? o.deficit - 1 : 0; break;
        default: nf = n + 4; break;
        }
        nf = nf > n + 4 ? n + 4 : nf;
        it->n_free = nf;
        for (uint32_t x = 0; x < n + 4; x++)
            c->freel[it->free_off + x] = x < nf ? next_dev++ : 0xfeedu;
        free(dev);
        free(res);
        free(cp);
        free(fr);
        free(st);
        free(fake);
    }
    c->n_dev_blocks = next_dev;
    c->n_host_blocks = next_host;
    free(np);
    free(tokens);
}

static int copy_cmp(const void *a, const void *b)
{
    const kvt__cu_copy *x = a, *y = b;
    if (x->src != y->src)
        return x->src < y->src ? -1 : 1;
    if (x->dst != y->dst)
        return x->dst < y->dst ? -1 : 1;
    return (x->bytes > y->bytes) - (x->bytes < y->bytes);
}

/* Byte i of host block b in the data check. */
static uint8_t block_byte(uint32_t b, uint32_t i)
{
    return (uint8_t)((b * 2654435761u) >> 24 ^ i * 31u ^ i >> 8);
}

/* Runs one case on the device (args.max_pages = the case's max_pages, or
 * max_pages_override when non-zero) and checks everything against the
 * reference. with_data: real arenas behind the bases, and the copy list
 * then goes through kvt__cu_copy_kernel, as the mover would run it; every
 * promoted page's device block must then hold its host block. */
static void run_case_data(const rc_case *c, uint32_t max_pages_override, int with_data,
                          const char *what)
{
    const uint32_t max_pages = max_pages_override ? max_pages_override : c->max_pages;
    const uint32_t n = c->n_items;
    void *stream;
    TU_OK(kvt__cu_stream_create(&stream, 0));
    /* Device copies of everything. */
    kvt__cu_recycle_item *d_items;
    uint32_t *d_dev, *d_host, *d_sel, *d_nsel, *d_free, *d_freed, *d_stage, *d_counts, *d_status;
    uint8_t *d_res, *d_base;
    float *d_imp;
    kvt__cu_copy *d_copies;
    void *h_base;
#define UP(d, h, bytes)                                   \
    do {                                                  \
        TU_OK(kvt__cu_malloc((void **)&(d), (bytes)));    \
        TU_OK(kvt__cu_memcpy((d), (h), (bytes)));         \
    } while (0)
    UP(d_items, c->items, n * sizeof *c->items);
    UP(d_dev, c->dev, c->n_tab * sizeof *c->dev);
    UP(d_host, c->host, c->n_tab * sizeof *c->host);
    UP(d_res, c->res, c->n_tab);
    UP(d_imp, c->imp, c->n_tab * sizeof *c->imp);
    UP(d_sel, c->sel, (c->n_sel_tot + 1) * sizeof *c->sel);
    UP(d_nsel, c->n_sel, n * sizeof *c->n_sel);
    UP(d_free, c->freel, (c->n_free_tot + 1) * sizeof *c->freel);
#undef UP
    const size_t n_out = c->n_out + 1;
    TU_OK(kvt__cu_malloc((void **)&d_copies, n_out * sizeof(kvt__cu_copy)));
    TU_OK(kvt__cu_malloc((void **)&d_freed, n_out * sizeof(uint32_t)));
    TU_OK(kvt__cu_malloc((void **)&d_stage, n_out * sizeof(uint32_t)));
    TU_OK(kvt__cu_malloc((void **)&d_counts, 4 * n * sizeof(uint32_t)));
    TU_OK(kvt__cu_malloc((void **)&d_status, n * sizeof(uint32_t)));
    TU_OK(kvt__cu_memset(d_copies, 0xa5, n_out * sizeof(kvt__cu_copy)));
    TU_OK(kvt__cu_memset(d_freed, 0xa5, n_out * sizeof(uint32_t)));
    TU_OK(kvt__cu_memset(d_stage, 0xa5, n_out * sizeof(uint32_t)));
    TU_OK(kvt__cu_memset(d_counts, 0xa5, 4 * n * sizeof(uint32_t)));
    TU_OK(kvt__cu_memset(d_status, 0xa5, n * sizeof(uint32_t)));
    const size_t dev_arena = with_data ? (size_t)c->n_dev_blocks * BLOCK_BYTES : 64;
    const size_t host_arena = with_data ? (size_t)c->n_host_blocks * BLOCK_BYTES : 64;
    TU_OK(kvt__cu_malloc((void **)&d_base, dev_arena));
    TU_OK(kvt__cu_host_alloc(&h_base, host_arena));
    if (with_data) {
        TU_OK(kvt__cu_memset(d_base, 0, dev_arena));
        for (uint32_t b = 0; b < c->n_host_blocks; b++)
            for (uint32_t i = 0; i < BLOCK_BYTES; i++)
                ((uint8_t *)h_base)[(size_t)b * BLOCK_BYTES + i] = block_byte(b, i);
    }
    const uint8_t *h_base_d = kvt__cu_host_device_ptr(h_base);
    assert_non_null(h_base_d);

    kvt__cu_recycle_args a = {
        .d_items = d_items, .n_items = n, .P = c->P, .max_pages = max_pages,
        .d_dev_table = d_dev, .d_host_table = d_host, .d_res = d_res, .d_imp = d_imp,
        .d_sel = d_sel, .d_n_sel = d_nsel, .d_free = d_free, .d_dev_base = d_base,
        .h_host_base = h_base_d, .block_bytes = BLOCK_BYTES, .d_copies = d_copies,
        .d_freed = d_freed, .d_stage = d_stage, .d_counts = d_counts, .d_status = d_status,
    };
    TU_OK(kvt__cu_recycle(&a, stream));
    TU_OK(kvt__cu_stream_sync(stream));

    /* Results back. */
    uint32_t *g_dev = malloc(c->n_tab * sizeof *g_dev), *g_freed = malloc(n_out * 4),
             *g_stage = malloc(n_out * 4), *g_counts = malloc(16 * n), *g_status = malloc(4 * n);
    uint8_t *g_res = malloc(c->n_tab);
    kvt__cu_copy *g_copies = malloc(n_out * sizeof *g_copies);
    TU_OK(kvt__cu_memcpy(g_dev, d_dev, c->n_tab * sizeof *g_dev));
    TU_OK(kvt__cu_memcpy(g_res, d_res, c->n_tab));
    TU_OK(kvt__cu_memcpy(g_copies, d_copies, n_out * sizeof *g_copies));
    TU_OK(kvt__cu_memcpy(g_freed, d_freed, n_out * 4));
    TU_OK(kvt__cu_memcpy(g_stage, d_stage, n_out * 4));
    TU_OK(kvt__cu_memcpy(g_counts, d_counts, 16 * n));
    TU_OK(kvt__cu_memcpy(g_status, d_status, 4 * n));

    /* The reference, on copies of the tables. */
    uint32_t *e_dev = malloc(c->n_tab * sizeof *e_dev);
    uint8_t *e_res = malloc(c->n_tab);
    memcpy(e_dev, c->dev, c->n_tab * sizeof *e_dev);
    memcpy(e_res, c->res, c->n_tab);
    kvt__cu_copy *e_copies = malloc(n_out * sizeof *e_copies);
    uint32_t *e_freed = malloc(n_out * 4), *e_stage = malloc(n_out * 4);
    memset(e_copies, 0xa5, n_out * sizeof *e_copies);
    memset(e_freed, 0xa5, n_out * 4);
    memset(e_stage, 0xa5, n_out * 4);
    uint32_t hist[3] = {0, 0, 0};
    for (uint32_t i = 0; i < n; i++) {
        const kvt__cu_recycle_item *it = &c->items[i];
        ref_out o = {e_dev + it->table_off, e_res + it->table_off, e_copies + it->copy_off,
                     e_freed + it->copy_off, e_stage + it->copy_off, {0}, 0, 0};
        ref_recycle(it, c->P, max_pages, c->sel + it->sel_off, c->n_sel[i],
                    c->host + it->table_off, c->imp + it->table_off, c->freel + it->free_off,
                    (uint64_t)(uintptr_t)h_base_d, (uint64_t)(uintptr_t)d_base, &o);
        hist[o.status]++;
        if (g_status[i] != o.status)
            fail_msg("%s: item %u (%u pages): status %u, expected %u", what, i, it->n_pages,
                     g_status[i], o.status);
        for (int q = 0; q < 4; q++)
            if (g_counts[4 * i + q] != o.counts[q])
                fail_msg("%s: item %u (%u pages, k %u x %u): counts[%d] = %u, expected %u",
                         what, i, it->n_pages, it->k, it->window, q, g_counts[4 * i + q],
                         o.counts[q]);
        /* The copies as a multiset first (a clearer message), then in order. */
        const uint32_t nc = o.counts[0];
        kvt__cu_copy *sa = malloc((nc + 1) * sizeof *sa), *sb = malloc((nc + 1) * sizeof *sb);
        memcpy(sa, g_copies + it->copy_off, nc * sizeof *sa);
        memcpy(sb, e_copies + it->copy_off, nc * sizeof *sb);
        qsort(sa, nc, sizeof *sa, copy_cmp);
        qsort(sb, nc, sizeof *sb, copy_cmp);
        if (memcmp(sa, sb, nc * sizeof *sa))
            fail_msg("%s: item %u: the %u copies differ as a set", what, i, nc);
        free(sa);
        free(sb);
    }
    for (uint64_t x = 0; x < n_out; x++) {
        if (memcmp(&g_copies[x], &e_copies[x], sizeof g_copies[x]))
            fail_msg("%s: copy slot %llu: src %#llx dst %#llx bytes %llu, expected src %#llx "
                     "dst %#llx bytes %llu", what, (unsigned long long)x,
                     (unsigned long long)g_copies[x].src, (unsigned long long)g_copies[x].dst,
                     (unsigned long long)g_copies[x].bytes, (unsigned long long)e_copies[x].src,
                     (unsigned long long)e_copies[x].dst, (unsigned long long)e_copies[x].bytes);
        if (g_freed[x] != e_freed[x])
            fail_msg("%s: freed slot %llu: %#x, expected %#x", what, (unsigned long long)x,
                     g_freed[x], e_freed[x]);
        if (g_stage[x] != e_stage[x])
            fail_msg("%s: stage slot %llu: %#x, expected %#x", what, (unsigned long long)x,
                     g_stage[x], e_stage[x]);
    }
    for (uint64_t e = 0; e < c->n_tab; e++) {
        if (g_dev[e] != e_dev[e])
            fail_msg("%s: device table entry %llu: %u, expected %u (was %u)", what,
                     (unsigned long long)e, g_dev[e], e_dev[e], c->dev[e]);
        if (g_res[e] != e_res[e])
            fail_msg("%s: residency entry %llu: %#x, expected %#x (was %#x)", what,
                     (unsigned long long)e, g_res[e], e_res[e], c->res[e]);
    }
    if (with_data) {
        /* The copies each item listed, through the zero-copy kernel. */
        uint8_t *arena = malloc(dev_arena);
        for (uint32_t i = 0; i < n; i++)
            TU_OK(kvt__cu_copy_kernel(d_copies + c->items[i].copy_off, g_counts[4 * i], 3, 0,
                                      stream));
        TU_OK(kvt__cu_stream_sync(stream));
        TU_OK(kvt__cu_memcpy(arena, d_base, dev_arena));
        uint32_t checked = 0;
        for (uint32_t i = 0; i < n; i++) {
            const kvt__cu_recycle_item *it = &c->items[i];
            for (uint32_t pg = 0; g_status[i] == 0 && pg < it->n_pages; pg++) {
                const uint64_t e = it->table_off + pg;
                if ((c->res[e] & (R_DEV | R_INB)) || !(g_res[e] & R_INB) || !(c->res[e] & R_HOST))
                    continue; /* not promoted from host */
                const uint8_t *blk = arena + (size_t)g_dev[e] * BLOCK_BYTES;
                for (uint32_t x = 0; x < BLOCK_BYTES; x++)
                    if (blk[x] != block_byte(c->host[e], x))
                        fail_msg("%s: item %u page %u: device block %u byte %u is %u, expected "
                                 "%u (host block %u)", what, i, pg, g_dev[e], x, blk[x],
                                 block_byte(c->host[e], x), c->host[e]);
                checked++;
            }
        }
        assert_true(checked > 0);
        free(arena);
    }
    /* The inputs the kernel only reads. */
    uint32_t *g_host = malloc(c->n_tab * sizeof *g_host);
    TU_OK(kvt__cu_memcpy(g_host, d_host, c->n_tab * sizeof *g_host));
    assert_memory_equal(g_host, c->host, c->n_tab * sizeof *g_host);
    free(g_host);
    print_message("%s: %u items (max %u pages): %u ok, %u out of blocks, %u too long\n", what,
                  n, max_pages, hist[0], hist[1], hist[2]);

    free(g_dev);
    free(g_res);
    free(g_copies);
    free(g_freed);
    free(g_stage);
    free(g_counts);
    free(g_status);
    free(e_dev);
    free(e_res);
    free(e_copies);
    free(e_freed);
    free(e_stage);
    kvt__cu_free(d_items);
    kvt__cu_free(d_dev);
    kvt__cu_free(d_host);
    kvt__cu_free(d_res);
    kvt__cu_free(d_imp);
    kvt__cu_free(d_sel);
    kvt__cu_free(d_nsel);
    kvt__cu_free(d_free);
    kvt__cu_free(d_copies);
    kvt__cu_free(d_freed);
    kvt__cu_free(d_stage);
    kvt__cu_free(d_counts);
    kvt__cu_free(d_status);
    kvt__cu_free(d_base);
    kvt__cu_host_free(h_base);
    kvt__cu_stream_destroy(stream);
}

/* ---- tests ------------------------------------------------------------------------ */

static void run_case(const rc_case *c, uint32_t max_pages_override, const char *what)
{
    run_case_data(c, max_pages_override, 0, what);
}

static void test_recycle_random(void **state)
{
    (void)state;
    tu_rng r = {0x2ecc1e5ull};
    for (int round = 0; round < 40; round++) {
        const uint32_t P = round & 1 ? 32 : 16;
        const gen_opts g = {round < 20 ? 12 * P : 150 * P, 0, -1};
        rc_case c;
        make_case(&c, &r, 3 + tu_below(&r, 10), P, &g);
        char what[64];
        snprintf(what, sizeof what, "random round %d (P %u)", round, P);
        run_case(&c, 0, what);
        case_free(&c);
    }
    print_message("coverage: %u partial keeps, %u all evicted, %u recycled + free, %u dropped, "
                  "%u ties at the cut, %u with NaN, %u copies, %u staged\n", cov.partial_keep,
                  cov.all_evicted, cov.recycled_free, cov.dropped, cov.tie_evicted,
                  cov.nan_evict, cov.copied, cov.staged);
    assert_true(cov.partial_keep >= 10 && cov.all_evicted >= 10 && cov.recycled_free >= 8 &&
                cov.dropped >= 10 && cov.tie_evicted >= 5 && cov.nan_evict >= 5 &&
                cov.copied >= 200 && cov.staged >= 80);
}

/* Each free-list mode alone: short, exactly the deficit, one short, long. */
static void test_recycle_free_lists(void **state)
{
    (void)state;
    tu_rng r = {0xf4eeull};
    for (int mode = 0; mode < 4; mode++) {
        const gen_opts g = {64 * 16, 0, mode};
        rc_case c;
        make_case(&c, &r, 12, 16, &g);
        char what[64];
        snprintf(what, sizeof what, "free-list mode %d", mode);
        run_case(&c, 0, what);
        case_free(&c);
    }
}

/* Long items: 8192 pages, the size the header promises, and the 16384
 * limit; a max_pages above the items' sizes too. */
static void test_recycle_long(void **state)
{
    (void)state;
    tu_rng r = {0x10a9ull};
    const gen_opts g8 = {0, 8192, -1};
    rc_case c;
    make_case(&c, &r, 2, 16, &g8);
    run_case(&c, 0, "8192 pages");
    case_free(&c);
    const gen_opts g16 = {0, 16384, 3};
    make_case(&c, &r, 1, 32, &g16);
    run_case(&c, 0, "16384 pages");
    case_free(&c);
    const gen_opts gs = {40 * 16, 0, -1};
    make_case(&c, &r, 4, 16, &gs);
    run_case(&c, 9000, "small items, max_pages 9000");
    case_free(&c);
}

/* Items longer than max_pages fail alone (status 2) and change nothing. */
static void test_recycle_too_long(void **state)
{
    (void)state;
    tu_rng r = {0x7001ull};
    const gen_opts g = {80 * 16, 0, 3};
    rc_case c;
    make_case(&c, &r, 8, 16, &g);
    run_case(&c, c.max_pages > 2 ? c.max_pages / 2 : 1, "max_pages below some items");
    case_free(&c);
}

/* The pipeline the mover runs: recycle, then its copy list through
 * kvt__cu_copy_kernel from a pinned host arena into the device arena. */
static void test_recycle_then_copy(void **state)
{
    (void)state;
    tu_rng r = {0xc09eull};
    const gen_opts g = {30 * 16, 0, 3};
    rc_case c;
    make_case(&c, &r, 8, 16, &g);
    run_case_data(&c, 0, 1, "recycle then copy");
    case_free(&c);
}

static void test_recycle_bad_args(void **state)
{
    (void)state;
    void *stream;
    TU_OK(kvt__cu_stream_create(&stream, 0));
    void *d;
    TU_OK(kvt__cu_malloc(&d, 4096));
    const kvt__cu_recycle_args good = {
        .d_items = d, .n_items = 1, .P = 16, .max_pages = 64, .d_dev_table = d,
        .d_host_table = d, .d_res = d, .d_imp = d, .d_sel = d, .d_n_sel = d, .d_free = d,
        .d_dev_base = d, .h_host_base = d, .block_bytes = 4096, .d_copies = d, .d_freed = d,
        .d_stage = d, .d_counts = d, .d_status = d,
    };
    kvt__cu_recycle_args a;
    TU_EXPECT_ERR(kvt__cu_recycle(NULL, stream), KVT_EINVAL, "a");
#define NULLED(field)                                                                 \
    do {                                                                              \
        a = good;                                                                     \
        a.field = NULL;                                                               \
        TU_EXPECT_ERR(kvt__cu_recycle(&a, stream), KVT_EINVAL, "a->" #field);         \
    } while (0)
    NULLED(d_items);
    NULLED(d_dev_table);
    NULLED(d_host_table);
    NULLED(d_res);
    NULLED(d_imp);
    NULLED(d_sel);
    NULLED(d_n_sel);
    NULLED(d_free);
    NULLED(d_dev_base);
    NULLED(h_host_base);
    NULLED(d_copies);
    NULLED(d_freed);
    NULLED(d_stage);
    NULLED(d_counts);
    NULLED(d_status);
#undef NULLED
    a = good;
    a.P = 0;
    TU_EXPECT_ERR(kvt__cu_recycle(&a, stream), KVT_EINVAL, "a->P");
    a = good;
    a.block_bytes = 0;
    TU_EXPECT_ERR(kvt__cu_recycle(&a, stream), KVT_EINVAL, "a->block_bytes");
    a = good;
    a.max_pages = 16385;
    TU_EXPECT_ERR(kvt__cu_recycle(&a, stream), KVT_EINVAL, "a->max_pages");
    a = good;
    a.max_pages = UINT32_MAX;
    TU_EXPECT_ERR(kvt__cu_recycle(&a, stream), KVT_EINVAL, "a->max_pages");
    a = good;
    a.n_items = 0x80000000u;
    TU_EXPECT_ERR(kvt__cu_recycle(&a, stream), KVT_EINVAL, "a->n_items");
    /* No items: nothing launched, pointers not looked at. */
    kvt__cu_recycle_args empty = {0};
    TU_OK(kvt__cu_recycle(&empty, stream));
    TU_OK(kvt__cu_stream_sync(stream));
    kvt__cu_free(d);
    kvt__cu_stream_destroy(stream);
}

int main(void)
{
    GPU_SKIP_WITHOUT_DEVICE();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_recycle_random),
        cmocka_unit_test(test_recycle_free_lists),
        cmocka_unit_test(test_recycle_long),
        cmocka_unit_test(test_recycle_too_long),
        cmocka_unit_test(test_recycle_then_copy),
        cmocka_unit_test(test_recycle_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
