/* The head-stability profiler.
 *
 * Per (stream, layer, head) it keeps what the measures need, no trace:
 *  - stability: steps are cut into windows of W records; the first set of
 *    a window is its anchor, and TS = the mean random-corrected overlap
 *    (RCO) of the anchor with each of the W - 1 later sets (FlexiCache).
 *    Once every head of a stream has completed its window w, the heads are
 *    ranked by that window's TS and the lowest bottom_fraction of them
 *    count one "bottom" each; instability = bottoms / ranked windows.
 *  - reload benefit: a recency stack of the distinct pages selected (most
 *    recent first). A page of the new set found at depth d would have been
 *    on the device with a window of w * K pages when d < w * K (K = the new
 *    set's size), w = 1..4; the stack is cut at 4 * (largest K so far).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "policy_int.h"

#define KVT__PROFILER_OPTS_V1 32u
_Static_assert(offsetof(kvt_profiler_opts, reserved) + 4 == KVT__PROFILER_OPTS_V1,
               "profiler opts v1");
#define KVT__PROFILER_STATS_V1 96u
_Static_assert(offsetof(kvt_profiler_head_stats, benefit) + 4 * 8 == KVT__PROFILER_STATS_V1,
               "profiler head stats v1");

#define KVT__W KVT_PROFILER_WINDOWS
/* Knapsack cells above which build_policy uses the greedy solver. */
#define KVT__DP_MAX_CELLS (1ull << 22)

typedef struct kvt__phead {
    uint64_t n_rec;
    uint32_t k_max;
    uint32_t cap_k;          /* anchor capacity; the stack holds 4 * cap_k */
    uint32_t *anchor;        /* [cap_k] */
    uint32_t anchor_n;
    uint32_t stack_n;
    uint32_t *stack;         /* [4 * cap_k], most recent first */
    double rco_sum;          /* over the current window */
    double ts_sum;
    uint64_t n_ts;
    double *pend;            /* TS of complete windows not ranked yet (FIFO) */
    uint32_t pend_n, pend_cap;
    uint64_t bottom;
    uint64_t demand;
    uint64_t hits[KVT__W];
} kvt__phead;

typedef struct kvt__pstream {
    uint64_t id;
    uint64_t ranked;         /* windows ranked */
    uint32_t n_ready;        /* heads with n_ts > ranked */
    kvt__phead *h;           /* [nh] */
} kvt__pstream;

typedef struct kvt__rank {
    double ts;
    uint32_t h;
} kvt__rank;

struct kvt_profiler {
    kvt_geometry g;
    uint32_t nh, W, max_streams, n_bottom;
    double unstable_fraction, bottom_fraction;
    kvt__pstream *streams;
    uint32_t n_streams, cap_streams;
    uint32_t *map;           /* stream index + 1, 0 = empty; open addressing */
    uint32_t map_bits;
    uint64_t ranked_total;
    kvt__rank *rank;         /* [nh] */
    uint64_t *keys;          /* [cap_sc] */
    uint8_t *mark;           /* [cap_sc] */
    uint32_t *tmp;           /* [cap_sc] */
    size_t cap_sc;
};

KVT_API int kvt_profiler_opts_init(kvt_profiler_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    opts->window_steps = 16;
    opts->unstable_fraction = 0.25;
    opts->bottom_fraction = 0.25;
    opts->max_streams = 1024;
    return 0;
}

static uint32_t kvt__round_share(double f, uint32_t n)
{
    double x = floor(f * n + 0.5);
    return x >= n ? n : (uint32_t)x;
}

KVT_API int kvt_profiler_create(const kvt_geometry *geom, const kvt_profiler_opts *opts,
                                kvt_profiler **out)
{
    kvt_profiler_opts o;
    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(geom);
    int rc;
    if (opts) {
        if ((rc = kvt__opts_copy(&o, sizeof o, opts, KVT__PROFILER_OPTS_V1, "opts")))
            return rc;
    } else {
        kvt_profiler_opts_init(&o);
    }
    kvt_geometry g;
    if ((rc = kvt__geometry_resolve(geom, &g)))
        return rc;
    if (o.window_steps < 2 || o.window_steps > 65536)
        return kvt__err(KVT_EINVAL, "opts->window_steps: %u is outside 2..65536",
                        o.window_steps);
    if (!(o.unstable_fraction >= 0.0 && o.unstable_fraction <= 1.0))
        return kvt__err(KVT_EINVAL, "opts->unstable_fraction: %g is outside 0..1",
                        o.unstable_fraction);
    if (!(o.bottom_fraction >= 0.0 && o.bottom_fraction <= 1.0))
        return kvt__err(KVT_EINVAL, "opts->bottom_fraction: %g is outside 0..1",
                        o.bottom_fraction);
    if (o.max_streams == 0 || o.max_streams > (1u << 20))
        return kvt__err(KVT_EINVAL, "opts->max_streams: %u is outside 1..1048576",
                        o.max_streams);
    if (o.reserved)
        return kvt__err(KVT_EINVAL, "opts->reserved: must be zero");
    kvt_profiler *p = calloc(1, sizeof *p);
    if (!p)
        return kvt__err(KVT_ENOMEM, "kvt_profiler_create: cannot allocate the profiler");
    p->g = g;
    p->nh = g.n_layers * g.n_kv_heads;
    p->W = o.window_steps;
    p->max_streams = o.max_streams;
    p->unstable_fraction = o.unstable_fraction;
    p->bottom_fraction = o.bottom_fraction;
    p->n_bottom = kvt__round_share(o.bottom_fraction, p->nh);
    p->rank = malloc((size_t)p->nh * sizeof *p->rank);
    if (!p->rank) {
        const uint32_t nh = p->nh;
        free(p);
        return kvt__err(KVT_ENOMEM, "kvt_profiler_create: cannot allocate for %u heads", nh);
    }
    *out = p;
    return 0;
}

static void kvt__phead_fini(kvt__phead *h)
{
    free(h->anchor);
    free(h->stack);
    free(h->pend);
}

KVT_API void kvt_profiler_destroy(kvt_profiler *prof)
{
    if (!prof)
        return;
    for (uint32_t s = 0; s < prof->n_streams; s++) {
        for (uint32_t i = 0; i < prof->nh; i++)
            kvt__phead_fini(&prof->streams[s].h[i]);
        free(prof->streams[s].h);
    }
    free(prof->streams);
    free(prof->map);
    free(prof->rank);
    free(prof->keys);
    free(prof->mark);
    free(prof->tmp);
    free(prof);
}

const kvt_geometry *kvt__profiler_geometry(const kvt_profiler *prof)
{
    return &prof->g;
}

/* ---- streams ---------------------------------------------------------------- */
static uint32_t kvt__slot_of(uint64_t id, uint32_t bits)
{
    return (uint32_t)((id * 0x9e3779b97f4a7c15ull) >> (64 - bits));
}

static kvt__pstream *kvt__stream_find(const kvt_profiler *p, uint64_t id)
{
    if (!p->map)
        return NULL;
    const uint32_t mask = (1u << p->map_bits) - 1u;
    for (uint32_t i = kvt__slot_of(id, p->map_bits);; i = (i + 1u) & mask) {
        const uint32_t e = p->map[i];
        if (!e)
            return NULL;
        if (p->streams[e - 1].id == id)
            return &p->streams[e - 1];
    }
}

static void kvt__map_put(uint32_t *map, uint32_t bits, uint64_t id, uint32_t idx1)
{
    const uint32_t mask = (1u << bits) - 1u;
    uint32_t i = kvt__slot_of(id, bits);
    while (map[i])
        i = (i + 1u) & mask;
    map[i] = idx1;
}

static int kvt__stream_get(kvt_profiler *p, uint64_t id, kvt__pstream **out)
{
    kvt__pstream *s = kvt__stream_find(p, id);
    if (s) {
        *out = s;
        return 0;
    }
    if (p->n_streams >= p->max_streams)
        return kvt__err(KVT_ENOSPC, "stream: 0x%llx would be stream %u, above max_streams %u",
                        (unsigned long long)id, p->n_streams + 1u, p->max_streams);
    if (p->n_streams == p->cap_streams) {
        uint32_t c = p->cap_streams ? p->cap_streams * 2u : 4u;
        c = c > p->max_streams ? p->max_streams : c;
        kvt__pstream *ns = realloc(p->streams, (size_t)c * sizeof *ns);
        if (!ns)
            return kvt__err(KVT_ENOMEM, "profiler: cannot allocate %u streams", c);
        p->streams = ns;
        p->cap_streams = c;
    }
    /* Keep the map at most half full. */
    if (2u * ((size_t)p->n_streams + 1u) > (p->map ? (size_t)1u << p->map_bits : 0u)) {
        uint32_t bits = p->map_bits ? p->map_bits + 1u : 4u;
        while (((size_t)1u << bits) < 2u * ((size_t)p->n_streams + 1u))
            bits++;
        uint32_t *nm = calloc((size_t)1u << bits, sizeof *nm);
        if (!nm)
            return kvt__err(KVT_ENOMEM, "profiler: cannot allocate the stream map");
        for (uint32_t i = 0; i < p->n_streams; i++)
            kvt__map_put(nm, bits, p->streams[i].id, i + 1u);
        free(p->map);
        p->map = nm;
        p->map_bits = bits;
    }
    kvt__phead *h = calloc(p->nh, sizeof *h);
    if (!h)
        return kvt__err(KVT_ENOMEM, "profiler: cannot allocate stream state for %u heads",
                        p->nh);
    s = &p->streams[p->n_streams];
    memset(s, 0, sizeof *s);
    s->id = id;
    s->h = h;
    p->n_streams++;
    kvt__map_put(p->map, p->map_bits, id, p->n_streams);
    *out = s;
    return 0;
}

/* Room for a set of k pages in head h and the scratch, and for one more
 * pending TS. */
static int kvt__head_reserve(kvt_profiler *p, kvt__phead *h, uint32_t k)
{
    if (k > h->cap_k || !h->anchor) {
        uint32_t c = h->cap_k > k ? h->cap_k : k;
        c = c ? c : 1u;
        if (c > UINT32_MAX / 4u)
            return kvt__err(KVT_EOVERFLOW, "profiler: a set of %u pages is too large", k);
        uint32_t *a = malloc((size_t)c * sizeof *a), *st = malloc(4u * (size_t)c * sizeof *st);
        if (!a || !st) {
            free(a);
            free(st);
            return kvt__err(KVT_ENOMEM, "profiler: cannot allocate for sets of %u pages", c);
        }
        if (h->anchor) {
            memcpy(a, h->anchor, (size_t)h->anchor_n * sizeof *a);
            memcpy(st, h->stack, (size_t)h->stack_n * sizeof *st);
        }
        free(h->anchor);
        free(h->stack);
        h->anchor = a;
        h->stack = st;
        h->cap_k = c;
    }
    if (h->pend_n == h->pend_cap) {
        uint32_t c = h->pend_cap ? h->pend_cap * 2u : 2u;
        double *np = realloc(h->pend, (size_t)c * sizeof *np);
        if (!np)
            return kvt__err(KVT_ENOMEM, "profiler: cannot allocate window scores");
        h->pend = np;
        h->pend_cap = c;
    }
    const size_t need = 5u * (size_t)h->cap_k;
    if (need > p->cap_sc) {
        uint64_t *keys = malloc(need * sizeof *keys);
        uint8_t *mark = malloc(need);
        uint32_t *tmp = malloc(need * sizeof *tmp);
        if (!keys || !mark || !tmp) {
            free(keys);
            free(mark);
            free(tmp);
            return kvt__err(KVT_ENOMEM, "profiler: cannot allocate scratch for %zu pages",
                            need);
        }
        free(p->keys);
        free(p->mark);
        free(p->tmp);
        p->keys = keys;
        p->mark = mark;
        p->tmp = tmp;
        p->cap_sc = need;
    }
    return 0;
}

int kvt__profiler_reserve(kvt_profiler *prof, uint64_t stream, uint32_t kcap)
{
    kvt__pstream *s;
    int rc = kvt__stream_get(prof, stream, &s);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < prof->nh; i++)
        if ((rc = kvt__head_reserve(prof, &s->h[i], kcap)))
            return rc;
    return 0;
}

/* ---- measures ----------------------------------------------------------------- */
double kvt__rco(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb,
                uint32_t n_candidates)
{
    if (nb == 0 || nb >= n_candidates)
        return 1.0;
    uint32_t i = 0, j = 0, both = 0;
    while (i < na && j < nb) {
        if (a[i] < b[j])
            i++;
        else if (a[i] > b[j])
            j++;
        else {
            both++;
            i++;
            j++;
        }
    }
    const double K = nb, chance = K / n_candidates;
    const double r = ((double)both / K - chance) / (1.0 - chance);
    return r > 0.0 ? r : 0.0;
}

static int kvt__cmp_u64(const void *x, const void *y)
{
    const uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return (a > b) - (a < b);
}

static int kvt__cmp_rank(const void *x, const void *y)
{
    const kvt__rank *a = x, *b = y;
    if (a->ts != b->ts)
        return a->ts < b->ts ? -1 : 1;
    return (a->h > b->h) - (a->h < b->h);
}

/* Ranks every window of s that all heads have completed. */
static void kvt__rank_ready(kvt_profiler *p, kvt__pstream *s)
{
    while (s->n_ready == p->nh) {
        for (uint32_t i = 0; i < p->nh; i++) {
            kvt__phead *h = &s->h[i];
            p->rank[i].ts = h->pend[0];
            p->rank[i].h = i;
            h->pend_n--;
            memmove(h->pend, h->pend + 1, (size_t)h->pend_n * sizeof *h->pend);
        }
        qsort(p->rank, p->nh, sizeof *p->rank, kvt__cmp_rank);
        for (uint32_t r = 0; r < p->n_bottom; r++)
            s->h[p->rank[r].h].bottom++;
        s->ranked++;
        p->ranked_total++;
        s->n_ready = 0;
        for (uint32_t i = 0; i < p->nh; i++)
            s->n_ready += s->h[i].n_ts > s->ranked;
    }
}

int kvt__profiler_add(kvt_profiler *prof, uint64_t stream, uint32_t layer, uint32_t kv_head,
                      const uint32_t *pages, uint32_t n, uint32_t n_candidates)
{
    kvt__pstream *s;
    int rc = kvt__stream_get(prof, stream, &s);
    if (rc)
        return rc;
    kvt__phead *h = &s->h[(size_t)layer * prof->g.n_kv_heads + kv_head];
    if ((rc = kvt__head_reserve(prof, h, n)))
        return rc;

    /* Reload benefit against the recency stack, then the new stack. */
    const uint32_t sn = h->stack_n;
    if (h->n_rec > 0) {
        for (uint32_t d = 0; d < sn; d++)
            prof->keys[d] = (uint64_t)h->stack[d] << 32 | d;
        qsort(prof->keys, sn, sizeof *prof->keys, kvt__cmp_u64);
        memset(prof->mark, 0, sn);
        uint32_t i = 0, j = 0;
        while (i < sn && j < n) {
            const uint32_t pg = (uint32_t)(prof->keys[i] >> 32);
            if (pg < pages[j]) {
                i++;
            } else if (pg > pages[j]) {
                j++;
            } else {
                const uint32_t d = (uint32_t)prof->keys[i];
                prof->mark[d] = 1;
                for (uint32_t w = 1; w <= KVT__W; w++)
                    h->hits[w - 1] += (uint64_t)d < (uint64_t)w * n;
                i++;
                j++;
            }
        }
        h->demand += n;
    } else {
        memset(prof->mark, 0, sn);
    }
    {
        const uint32_t cap = 4u * h->cap_k;
        uint32_t m = 0;
        for (uint32_t j = 0; j < n && m < cap; j++)
            prof->tmp[m++] = pages[j];
        for (uint32_t d = 0; d < sn && m < cap; d++)
            if (!prof->mark[d])
                prof->tmp[m++] = h->stack[d];
        /* Pages of the stack that the new set holds were marked only when
         * there was an earlier set; with none, the stack is empty. */
        memcpy(h->stack, prof->tmp, (size_t)m * sizeof *h->stack);
        h->stack_n = m;
    }

    /* Stability windows. */
    const uint32_t pos = (uint32_t)(h->n_rec % prof->W);
    if (pos == 0) {
        if (n) /* pages may be NULL for an empty set */
            memcpy(h->anchor, pages, (size_t)n * sizeof *pages);
        h->anchor_n = n;
        h->rco_sum = 0.0;
    } else {
        h->rco_sum += kvt__rco(h->anchor, h->anchor_n, pages, n, n_candidates);
        if (pos == prof->W - 1) {
            const double ts = h->rco_sum / (double)(prof->W - 1);
            h->pend[h->pend_n++] = ts; /* room was reserved */
            h->ts_sum += ts;
            h->n_ts++;
            if (h->n_ts == s->ranked + 1u)
                s->n_ready++;
            kvt__rank_ready(prof, s);
        }
    }
    h->n_rec++;
    h->k_max = n > h->k_max ? n : h->k_max;
    return 0;
}

KVT_API int kvt_profiler_record(kvt_profiler *prof, uint64_t stream, uint32_t layer,
                                uint32_t kv_head, const uint32_t *pages, uint32_t n_pages,
                                uint32_t n_candidates)
{
    KVT__CHECK_NULL(prof);
    if (layer >= prof->g.n_layers)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, prof->g.n_layers);
    if (kv_head >= prof->g.n_kv_heads)
        return kvt__err(KVT_EINVAL, "kv_head: %u >= n_kv_heads %u", kv_head,
                        prof->g.n_kv_heads);
    if (n_pages)
        KVT__CHECK_NULL(pages);
    if (n_pages > n_candidates)
        return kvt__err(KVT_EINVAL, "n_pages: %u is above n_candidates %u", n_pages,
                        n_candidates);
    for (uint32_t i = 1; i < n_pages; i++)
        if (pages[i] <= pages[i - 1])
            return kvt__err(KVT_EINVAL, "pages[%u]: %u after %u; the pages must be strictly "
                            "increasing", i, pages[i], pages[i - 1]);
    return kvt__profiler_add(prof, stream, layer, kv_head, pages, n_pages, n_candidates);
}

/* Sums of one head over the streams. */
static void kvt__head_sum(const kvt_profiler *p, size_t hi, kvt_profiler_head_stats *r,
                          double *ts_sum)
{
    *ts_sum = 0.0;
    for (uint32_t s = 0; s < p->n_streams; s++) {
        const kvt__phead *h = &p->streams[s].h[hi];
        r->k_max = h->k_max > r->k_max ? h->k_max : r->k_max;
        r->records += h->n_rec;
        r->windows += h->n_ts;
        r->bottom += h->bottom;
        r->demand += h->demand;
        for (uint32_t w = 0; w < KVT__W; w++)
            r->benefit[w] += h->hits[w];
        *ts_sum += h->ts_sum;
    }
    r->ranked_windows = p->ranked_total;
    r->mean_ts = r->windows ? *ts_sum / (double)r->windows : 0.0;
    r->instability = p->ranked_total ? (double)r->bottom / (double)p->ranked_total : 0.0;
}

KVT_API int kvt_profiler_head_get(const kvt_profiler *prof, uint32_t layer, uint32_t kv_head,
                                  kvt_profiler_head_stats *stats)
{
    size_t fill;
    KVT__CHECK_NULL(prof);
    if (layer >= prof->g.n_layers)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, prof->g.n_layers);
    if (kv_head >= prof->g.n_kv_heads)
        return kvt__err(KVT_EINVAL, "kv_head: %u >= n_kv_heads %u", kv_head,
                        prof->g.n_kv_heads);
    KVT__CHECK_NULL(stats);
    int rc = kvt__out_struct(stats, sizeof *stats, KVT__PROFILER_STATS_V1, "stats", &fill);
    if (rc)
        return rc;
    kvt_profiler_head_stats r;
    memset(&r, 0, sizeof r);
    r.struct_size = stats->struct_size;
    double ts_sum;
    kvt__head_sum(prof, (size_t)layer * prof->g.n_kv_heads + kv_head, &r, &ts_sum);
    memcpy(stats, &r, fill);
    return 0;
}

/* ---- building a policy --------------------------------------------------------- */
typedef struct kvt__hrank {
    double inst, ts;
    uint32_t h;
} kvt__hrank;

/* Least stable first: instability desc, mean TS asc, index asc. */
static int kvt__cmp_hrank(const void *x, const void *y)
{
    const kvt__hrank *a = x, *b = y;
    if (a->inst != b->inst)
        return a->inst > b->inst ? -1 : 1;
    if (a->ts != b->ts)
        return a->ts < b->ts ? -1 : 1;
    return (a->h > b->h) - (a->h < b->h);
}

KVT_API int kvt_profiler_build_policy(const kvt_profiler *prof, const kvt_policy_opts *base,
                                      uint64_t device_page_budget, kvt_policy **out)
{
    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(prof);
    kvt_policy_opts o;
    int rc = kvt__policy_opts_get(&o, base, "base");
    if (rc)
        return rc;
    if (prof->ranked_total == 0)
        return kvt__err(KVT_ESTATE, "prof: no window is complete for every head of a stream "
                        "yet (record at least window_steps %u sets of every head)", prof->W);
    const uint32_t nh = prof->nh;
    kvt__hrank *hr = malloc((size_t)nh * sizeof *hr);
    uint32_t *mem = malloc((size_t)nh * 7u * sizeof *mem);
    uint32_t *stable = malloc((size_t)nh * sizeof *stable);
    uint64_t *cost = malloc((size_t)nh * KVT__W * sizeof *cost);
    double *value = malloc((size_t)nh * KVT__W * sizeof *value);
    double *gval = malloc((size_t)nh * KVT__W * sizeof *gval);
    uint32_t *choice = malloc((size_t)nh * sizeof *choice);
    if (!hr || !mem || !stable || !cost || !value || !gval || !choice) {
        rc = kvt__err(KVT_ENOMEM, "kvt_profiler_build_policy: cannot allocate for %u heads",
                      nh);
        goto out;
    }
    uint32_t *cls = mem, *k = mem + nh, *win = mem + 2u * (size_t)nh,
             *sink = mem + 3u * (size_t)nh, *local = mem + 4u * (size_t)nh,
             *iv = mem + 5u * (size_t)nh;
    float *sim = (float *)(void *)(mem + 6u * (size_t)nh);
    for (uint32_t i = 0; i < nh; i++) {
        kvt_profiler_head_stats r;
        double ts_sum;
        memset(&r, 0, sizeof r);
        kvt__head_sum(prof, i, &r, &ts_sum);
        hr[i].inst = r.instability;
        hr[i].ts = r.mean_ts;
        hr[i].h = i;
        for (uint32_t w = 0; w < KVT__W; w++)
            value[(size_t)i * KVT__W + w] = (double)r.benefit[w];
    }
    qsort(hr, nh, sizeof *hr, kvt__cmp_hrank);
    const uint32_t n_unstable = kvt__round_share(prof->unstable_fraction, nh);
    for (uint32_t i = 0; i < nh; i++) {
        cls[i] = KVT_HEAD_STABLE;
        k[i] = o.top_k_pages;
        win[i] = o.window;
        sink[i] = o.sink_pages;
        local[i] = o.local_pages;
    }
    for (uint32_t r = 0; r < n_unstable; r++)
        cls[hr[r].h] = KVT_HEAD_UNSTABLE;
    uint32_t ns = 0;
    for (uint32_t i = 0; i < nh; i++) {
        iv[i] = cls[i] == KVT_HEAD_UNSTABLE ? o.unstable_interval : o.stable_interval;
        sim[i] = o.rerank_similarity;
        if (cls[i] == KVT_HEAD_STABLE)
            stable[ns++] = i;
    }
    if (device_page_budget) {
        const uint64_t need = (uint64_t)ns * o.top_k_pages; /* < 2^24 * 2^26 */
        if (device_page_budget < need) {
            rc = kvt__err(KVT_ERANGE, "device_page_budget: %llu pages, the %u stable heads "
                          "need %llu at window 1 (top_k_pages %u each)",
                          (unsigned long long)device_page_budget, ns,
                          (unsigned long long)need, o.top_k_pages);
            goto out;
        }
        /* Group j = stable head stable[j]; choice w - 1 = window w. */
        for (uint32_t j = 0; j < ns; j++)
            for (uint32_t w = 1; w <= KVT__W; w++) {
                cost[(size_t)j * KVT__W + w - 1] = (uint64_t)w * o.top_k_pages;
                gval[(size_t)j * KVT__W + w - 1] = value[(size_t)stable[j] * KVT__W + w - 1];
            }
        double total;
        rc = kvt__mckp_dp(ns, KVT__W, cost, gval, device_page_budget, KVT__DP_MAX_CELLS,
                          choice, &total);
        if (rc == KVT_EOVERFLOW)
            rc = kvt__mckp_greedy(ns, KVT__W, cost, gval, device_page_budget, choice, &total);
        if (rc)
            goto out;
        for (uint32_t j = 0; j < ns; j++)
            win[stable[j]] = choice[j] + 1u;
    }
    rc = kvt__policy_build(out, &prof->g, cls, k, win, sink, local, iv, sim, "base->", 0);
out:
    free(hr);
    free(mem);
    free(stable);
    free(cost);
    free(value);
    free(gval);
    free(choice);
    return rc;
}
