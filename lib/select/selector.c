/* The page selector: options, per-(layer, head) budgets, scoring + voting
 * from the metadata store, and the selection rule (forced pages + top-K). */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "../core/store.h"
#include "../attn/kernels.h"
#include "select_int.h"

#define KVT__SELECTOR_OPTS_V1 32u
_Static_assert(offsetof(kvt_selector_opts, vote_scale) + 4 == KVT__SELECTOR_OPTS_V1,
               "selector opts v1");

KVT_API int kvt_selector_opts_init(kvt_selector_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    opts->method = KVT_SCORE_MINMAX;
    opts->vote = KVT_VOTE_SUM;
    opts->top_k_pages = 64;
    opts->sink_pages = 1;
    opts->local_pages = 1;
    opts->rerank_interval = 1;
    opts->rerank_similarity = KVT_RERANK_SIMILARITY_DEFAULT;
    return 0;
}


static int kvt__budget_check(uint32_t k, uint32_t sink, uint32_t local, const char *prefix)
{
    if (k > KVT_SELECT_MAX_PAGES)
        return kvt__err(KVT_ERANGE, "%stop_k_pages: %u is above KVT_SELECT_MAX_PAGES (%u)",
                        prefix, k, KVT_SELECT_MAX_PAGES);
    if (sink > KVT_SELECT_MAX_PAGES)
        return kvt__err(KVT_ERANGE, "%ssink_pages: %u is above KVT_SELECT_MAX_PAGES (%u)",
                        prefix, sink, KVT_SELECT_MAX_PAGES);
    if (local > KVT_SELECT_MAX_PAGES)
        return kvt__err(KVT_ERANGE, "%slocal_pages: %u is above KVT_SELECT_MAX_PAGES (%u)",
                        prefix, local, KVT_SELECT_MAX_PAGES);
    return 0;
}

KVT_API int kvt_selector_create(const kvt_geometry *geom, const kvt_selector_opts *opts,
                                kvt_selector **out)
{
    kvt_selector_opts o;
    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(geom);
    if (opts) {
        int rc = kvt__opts_copy(&o, sizeof o, opts, KVT__SELECTOR_OPTS_V1, "opts");
        if (rc)
            return rc;
        if (opts->struct_size < offsetof(kvt_selector_opts, reserved))
            o.rerank_similarity = KVT_RERANK_SIMILARITY_DEFAULT; /* the first layout */
    } else {
        kvt_selector_opts_init(&o);
    }
    kvt_geometry g;
    int rc = kvt__geometry_resolve(geom, &g);
    if (rc)
        return rc;
    if (o.method > KVT_SCORE_ORACLE)
        return kvt__err(KVT_EINVAL, "opts->method: %u is not a scoring method (minmax, mean, "
                        "token or oracle)", o.method);
    if (o.vote > KVT_VOTE_SOFTVOTE)
        return kvt__err(KVT_EINVAL, "opts->vote: %u is not a vote (sum, max or softvote)",
                        o.vote);
    rc = kvt__budget_check(o.top_k_pages, o.sink_pages, o.local_pages, "opts->");
    if (rc)
        return rc;
    if (o.rerank_interval == 0)
        return kvt__err(KVT_EINVAL, "opts->rerank_interval: must be at least 1");
    if (!(o.vote_scale >= 0.0f) || isinf(o.vote_scale))
        return kvt__err(KVT_EINVAL, "opts->vote_scale: %g is not a finite value >= 0",
                        (double)o.vote_scale);
    if ((rc = kvt__similarity_check(o.rerank_similarity, "opts->rerank_similarity")))
        return rc;
    if (o.reserved)
        return kvt__err(KVT_EINVAL, "opts->reserved: must be zero");
    kvt_selector *sel = calloc(1, sizeof *sel);
    if (!sel)
        return kvt__err(KVT_ENOMEM, "kvt_selector_create: cannot allocate the selector");
    const size_t n = (size_t)g.n_layers * g.n_kv_heads;
    sel->k = malloc(n * sizeof *sel->k);
    sel->sink = malloc(n * sizeof *sel->sink);
    sel->local = malloc(n * sizeof *sel->local);
    sel->interval = malloc(n * sizeof *sel->interval);
    sel->sim = malloc(n * sizeof *sel->sim);
    if (!sel->k || !sel->sink || !sel->local || !sel->interval || !sel->sim) {
        kvt_selector_destroy(sel);
        return kvt__err(KVT_ENOMEM, "kvt_selector_create: cannot allocate %zu head budgets", n);
    }
    for (size_t i = 0; i < n; i++) {
        sel->k[i] = o.top_k_pages;
        sel->sink[i] = o.sink_pages;
        sel->local[i] = o.local_pages;
        sel->interval[i] = o.rerank_interval;
        sel->sim[i] = o.rerank_similarity;
    }
    sel->g = g;
    sel->method = o.method;
    sel->vote = o.vote;
    sel->vote_scale = o.vote_scale > 0.0f ? o.vote_scale : 1.0f / sqrtf((float)g.head_dim);
    *out = sel;
    return 0;
}

KVT_API void kvt_selector_destroy(kvt_selector *sel)
{
    if (!sel)
        return;
    free(sel->k);
    free(sel->sink);
    free(sel->local);
    free(sel->interval);
    free(sel->sim);
    free(sel);
}

/* Resolves (layer, head) with KVT_ALL into index ranges. */
static int kvt__sel_range(const kvt_selector *sel, uint32_t layer, uint32_t head, uint32_t *l0,
                          uint32_t *l1, uint32_t *h0, uint32_t *h1, bool allow_all)
{
    if (layer == KVT_ALL && allow_all) {
        *l0 = 0;
        *l1 = sel->g.n_layers;
    } else if (layer < sel->g.n_layers) {
        *l0 = layer;
        *l1 = layer + 1;
    } else {
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, sel->g.n_layers);
    }
    if (head == KVT_ALL && allow_all) {
        *h0 = 0;
        *h1 = sel->g.n_kv_heads;
    } else if (head < sel->g.n_kv_heads) {
        *h0 = head;
        *h1 = head + 1;
    } else {
        return kvt__err(KVT_EINVAL, "kv_head: %u >= n_kv_heads %u", head, sel->g.n_kv_heads);
    }
    return 0;
}

KVT_API int kvt_selector_budget_set(kvt_selector *sel, uint32_t layer, uint32_t kv_head,
                                    uint32_t top_k_pages, uint32_t sink_pages,
                                    uint32_t local_pages)
{
    uint32_t l0 = 0, l1 = 0, h0 = 0, h1 = 0;
    KVT__CHECK_NULL(sel);
    int rc = kvt__sel_range(sel, layer, kv_head, &l0, &l1, &h0, &h1, true);
    if (rc)
        return rc;
    rc = kvt__budget_check(top_k_pages, sink_pages, local_pages, "");
    if (rc)
        return rc;
    for (uint32_t l = l0; l < l1; l++)
        for (uint32_t h = h0; h < h1; h++) {
            size_t i = (size_t)l * sel->g.n_kv_heads + h;
            sel->k[i] = top_k_pages;
            sel->sink[i] = sink_pages;
            sel->local[i] = local_pages;
        }
    return 0;
}

KVT_API int kvt_selector_budget_get(const kvt_selector *sel, uint32_t layer, uint32_t kv_head,
                                    uint32_t *top_k_pages, uint32_t *sink_pages,
                                    uint32_t *local_pages)
{
    uint32_t l0 = 0, l1 = 0, h0 = 0, h1 = 0;
    KVT__CHECK_NULL(sel);
    int rc = kvt__sel_range(sel, layer, kv_head, &l0, &l1, &h0, &h1, false);
    if (rc)
        return rc;
    size_t i = (size_t)l0 * sel->g.n_kv_heads + h0;
    if (top_k_pages)
        *top_k_pages = sel->k[i];
    if (sink_pages)
        *sink_pages = sel->sink[i];
    if (local_pages)
        *local_pages = sel->local[i];
    return 0;
}

KVT_API int kvt_selector_rerank_interval_set(kvt_selector *sel, uint32_t layer,
                                             uint32_t kv_head, uint32_t interval)
{
    uint32_t l0 = 0, l1 = 0, h0 = 0, h1 = 0;
    KVT__CHECK_NULL(sel);
    int rc = kvt__sel_range(sel, layer, kv_head, &l0, &l1, &h0, &h1, true);
    if (rc)
        return rc;
    if (interval == 0)
        return kvt__err(KVT_EINVAL, "interval: must be at least 1");
    for (uint32_t l = l0; l < l1; l++)
        for (uint32_t h = h0; h < h1; h++)
            sel->interval[(size_t)l * sel->g.n_kv_heads + h] = interval;
    return 0;
}

KVT_API int kvt_selector_rerank_similarity_set(kvt_selector *sel, uint32_t layer,
                                               uint32_t kv_head, float threshold)
{
    uint32_t l0 = 0, l1 = 0, h0 = 0, h1 = 0;
    KVT__CHECK_NULL(sel);
    int rc = kvt__sel_range(sel, layer, kv_head, &l0, &l1, &h0, &h1, true);
    if (rc)
        return rc;
    if ((rc = kvt__similarity_check(threshold, "threshold")))
        return rc;
    for (uint32_t l = l0; l < l1; l++)
        for (uint32_t h = h0; h < h1; h++)
            sel->sim[(size_t)l * sel->g.n_kv_heads + h] = threshold;
    return 0;
}

int kvt__selector_match(const kvt_selector *sel, const kvt_pool *p)
{
    static const char *const names[] = {"n_layers", "n_kv_heads", "n_q_heads", "head_dim",
                                        "page_tokens"};
    const uint32_t a[] = {sel->g.n_layers, sel->g.n_kv_heads, sel->g.n_q_heads,
                          sel->g.head_dim, sel->g.page_tokens};
    const uint32_t b[] = {p->g.n_layers, p->g.n_kv_heads, p->g.n_q_heads, p->g.head_dim,
                          p->g.page_tokens};
    for (size_t i = 0; i < sizeof a / sizeof a[0]; i++)
        if (a[i] != b[i])
            return kvt__err(KVT_EINVAL, "selector: geometry %s %u does not match the pool's %u",
                            names[i], a[i], b[i]);
    return 0;
}

/* ---- scoring ------------------------------------------------------------ */
size_t kvt__sel_scratch_bytes(uint32_t G, uint32_t D, uint32_t np)
{
    size_t n = (size_t)np * sizeof(void *) + (size_t)np * sizeof(uint64_t) +
               ((size_t)G * np + np) * sizeof(float) + (size_t)np * sizeof(uint32_t) +
               3u * (size_t)G * D * sizeof(float) +
               KVT__TS_SCRATCH(G) * sizeof(float) + np;
    return (n + 63u) & ~(size_t)63u;
}

void kvt__sel_scratch_carve(kvt__sel_scratch *sc, void *mem, uint32_t G, uint32_t D,
                            uint32_t np)
{
    uint8_t *b = mem;
    sc->blk = (const uint8_t **)(void *)b; /* first: pointer-aligned */
    b += (size_t)np * sizeof(void *);
    sc->key = (uint64_t *)(void *)b;
    b += (size_t)np * sizeof(uint64_t);
    sc->qa = (float *)(void *)b;
    b += (size_t)G * D * sizeof(float);
    sc->qb = (float *)(void *)b;
    b += (size_t)G * D * sizeof(float);
    sc->qc = (float *)(void *)b;
    b += (size_t)G * D * sizeof(float);
    sc->tbuf = (float *)(void *)b;
    b += KVT__TS_SCRATCH(G) * sizeof(float);
    sc->S = (float *)(void *)b;
    b += (size_t)G * np * sizeof(float);
    sc->vote = (float *)(void *)b;
    b += (size_t)np * sizeof(float);
    sc->ntok = (uint32_t *)(void *)b;
    b += (size_t)np * sizeof(uint32_t);
    sc->mark = b;
}

/* Raw TOKEN / ORACLE scores of pages [pg0, pg1) into S (rows G apart by
 * np): from the keys where this host reads them (the device tier, or the
 * host tier on the CPU backend: the block tables name a block only once its
 * copy has landed), else from the page's MINMAX bound (ORACLE: plus
 * ln(tokens) / c, so the bound stays above the page's log-sum-exp). */
static void kvt__sel_tscore(const kvt_selector *sel, const kvt_pool *p, const kvt__seq *s,
                            uint32_t layer, uint32_t head, uint32_t G, uint32_t pg0,
                            uint32_t pg1, uint32_t np, float *S, kvt__sel_scratch *sc)
{
    const uint32_t D = p->g.head_dim, P = p->g.page_tokens, tokens = s->n_tokens[layer];
    const bool oracle = sel->method == KVT_SCORE_ORACLE;
    const float c = oracle ? sel->vote_scale : 0.0f;
    const kvt__attn_shape sh = {G, D, P, p->g.dtype};
    const size_t base = kvt__lh(p, layer, head) * s->cap_pages;
    const uint32_t *slots = s->meta_slot + base;
    for (uint32_t pg = pg0; pg < pg1; pg++) {
        const uint32_t db = s->dev_block[base + pg], hb = s->host_block[base + pg];
        sc->blk[pg] = db ? kvt__arena_block(&p->tier[KVT_TIER_DEVICE], db)
                      : hb ? kvt__arena_block(&p->tier[KVT_TIER_HOST], hb)
                           : NULL;
        const uint32_t left = tokens - pg * P;
        sc->ntok[pg] = left < P ? left : P;
    }
    for (uint32_t pg = pg0; pg < pg1;) {
        const bool keys = sc->blk[pg] != NULL;
        uint32_t j = pg + 1;
        while (j < pg1 && (sc->blk[j] != NULL) == keys)
            j++;
        if (keys) {
            p->kern->tscore(&sh, sc->qc, sc->blk + pg, sc->ntok + pg, j - pg, c, S + pg, np,
                            sc->tbuf);
        } else {
            p->kern->score(&sh, KVT_SCORE_MINMAX, sc->qa, sc->qb, p->meta.base,
                           2u * kvt__meta_row(p), slots + pg, j - pg, S + pg, np);
            for (uint32_t g = 0; oracle && g < G; g++)
                for (uint32_t x = pg; x < j; x++)
                    S[(size_t)g * np + x] += logf((float)sc->ntok[x]) / c;
        }
        pg = j;
    }
    /* A non-finite key or query element: no defined score (the vote makes
     * the page, or every page of that row, +infinity). */
    for (uint32_t pg = pg0; pg < pg1; pg++)
        if (s->res[base + pg] & KVT__RES_NONFINITE)
            for (uint32_t g = 0; g < G; g++)
                S[(size_t)g * np + pg] = NAN;
    for (uint32_t g = 0; g < G; g++) {
        bool fin = true;
        for (uint32_t d = 0; d < D; d++)
            fin = fin && isfinite(sc->qc[(size_t)g * D + d]);
        for (uint32_t pg = pg0; !fin && pg < pg1; pg++)
            S[(size_t)g * np + pg] = NAN;
    }
}

void kvt__sel_prep(const kvt_selector *sel, const kvt_pool *p, const float *q, uint32_t nq,
                   size_t qstride, kvt__sel_scratch *sc)
{
    const size_t GD1 = (size_t)(p->g.n_q_heads / p->g.n_kv_heads) * p->g.head_dim;
    const bool keys = sel->method >= KVT_SCORE_TOKEN;
    for (uint32_t j = 0; j < nq; j++) {
        const float *qj = q + (size_t)j * qstride;
        float *qa = sc->qa + j * GD1, *qb = sc->qb + j * GD1;
        if (sel->method != KVT_SCORE_MEAN) { /* TOKEN and ORACLE: for the bounds */
            for (size_t i = 0; i < GD1; i++) {
                qa[i] = qj[i] > 0.0f ? qj[i] : 0.0f;
                qb[i] = qj[i] < 0.0f ? qj[i] : 0.0f;
            }
        } else {
            memcpy(qa, qj, GD1 * sizeof(float));
        }
        if (keys)
            memcpy(sc->qc + j * GD1, qj, GD1 * sizeof(float));
    }
}

void kvt__sel_raw(const kvt_selector *sel, const kvt_pool *p, const kvt__seq *s, uint32_t layer,
                  uint32_t head, uint32_t G, uint32_t pg0, uint32_t pg1, uint32_t np, float *S,
                  kvt__sel_scratch *sc)
{
    if (sel->method >= KVT_SCORE_TOKEN) {
        kvt__sel_tscore(sel, p, s, layer, head, G, pg0, pg1, np, S, sc);
        return;
    }
    const kvt__attn_shape sh = {G, p->g.head_dim, p->g.page_tokens, p->g.dtype};
    const uint32_t *slots = s->meta_slot + kvt__lh(p, layer, head) * s->cap_pages;
    const bool mm = sel->method == KVT_SCORE_MINMAX;
    p->kern->score(&sh, sel->method, sc->qa, sc->qb, mm ? p->meta.base : kvt__meta_mean_plane(p),
                   (mm ? 2u : 1u) * kvt__meta_row(p), slots + pg0, pg1 - pg0, S + pg0, np);
}

void kvt__sel_score(const kvt_selector *sel, const kvt_pool *p, const kvt__seq *s,
                    uint32_t layer, uint32_t head, const float *q, uint32_t nq, size_t qstride,
                    uint32_t np, kvt__sel_scratch *sc)
{
    /* nq tokens' G query heads each: G' = nq x G rows vote together. */
    const uint32_t G = p->g.n_q_heads / p->g.n_kv_heads * nq;
    kvt__sel_prep(sel, p, q, nq, qstride, sc);
    kvt__sel_raw(sel, p, s, layer, head, G, 0, np, np, sc->S, sc);
    kvt__sel_vote(sel, p, sc->S, G, np, sc->vote);
}

void kvt__sel_vote(const kvt_selector *sel, const kvt_pool *p, float *S, uint32_t G,
                   uint32_t np, float *v)
{
    /* The oracle's vote is the attention mass: SOFTVOTE of its log-sum-exps. */
    switch (sel->method == KVT_SCORE_ORACLE ? KVT_VOTE_SOFTVOTE : sel->vote) {
    case KVT_VOTE_SUM:
        memcpy(v, S, np * sizeof(float));
        for (uint32_t g = 1; g < G; g++) {
            const float *r = S + (size_t)g * np;
            for (uint32_t i = 0; i < np; i++)
                v[i] += r[i];
        }
        break;
    case KVT_VOTE_MAX:
        memcpy(v, S, np * sizeof(float));
        for (uint32_t g = 1; g < G; g++) {
            const float *r = S + (size_t)g * np;
            for (uint32_t i = 0; i < np; i++)
                v[i] = r[i] > v[i] || r[i] != r[i] ? r[i] : v[i];
        }
        break;
    default: /* SOFTVOTE: sum over heads of a softmax over pages */
        memset(v, 0, np * sizeof(float));
        for (uint32_t g = 0; g < G; g++) {
            float *r = S + (size_t)g * np;
            float mx = -INFINITY;
            bool nan = false;
            for (uint32_t i = 0; i < np; i++) {
                r[i] *= sel->vote_scale;
                nan |= r[i] != r[i];
                mx = r[i] > mx ? r[i] : mx;
            }
            if (nan || isinf(mx)) {
                /* An unbounded score (a NaN key opened its page's box):
                 * that page takes the whole vote of this head. */
                for (uint32_t i = 0; i < np; i++)
                    v[i] += (r[i] != r[i] || r[i] == INFINITY) ? INFINITY : 0.0f;
                continue;
            }
            const float sum = p->kern->expsum(r, np, mx);
            const float inv = 1.0f / sum;
            for (uint32_t i = 0; i < np; i++)
                v[i] += r[i] * inv;
        }
        break;
    }
    for (uint32_t i = 0; i < np; i++)
        if (v[i] != v[i])
            v[i] = INFINITY;
}

void kvt__sel_qmean(const float *q, uint32_t G, uint32_t nn, size_t qstride, uint32_t D,
                    float *out)
{
    memset(out, 0, (size_t)D * sizeof *out);
    for (uint32_t j = 0; j < nn; j++)
        for (uint32_t g = 0; g < G; g++) {
            const float *r = q + j * qstride + (size_t)g * D;
            for (uint32_t d = 0; d < D; d++)
                out[d] += r[d];
        }
    const float inv = 1.0f / (float)(G * nn);
    for (uint32_t d = 0; d < D; d++)
        out[d] *= inv;
}

/* ---- the selection rule ----------------------------------------------- */
/* Page i's key: larger ranks first (higher vote, then lower index). The
 * vote's bits, made monotonic as an unsigned integer, above the complement
 * of the index: one integer compare per step of the selection, no lookup of
 * the vote through an index. -0 is +0 (as the comparison v[a] > v[b] sees
 * them; in integer arithmetic, so no flush-to-zero mode touches the vote),
 * and a NaN (step votes never are; the warm-up's sums of opposite
 * infinities can be) ranks as +inf, as a NaN score does in the votes. */
static inline uint64_t kvt__vkey(float v, uint32_t i)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN */
        u = 0x7f800000u;
    else if (u == 0x80000000u) /* -0 */
        u = 0;
    u = (u & 0x80000000u) ? ~u : u | 0x80000000u;
    return (uint64_t)u << 32 | (uint32_t)~i;
}

/* Moves the k largest of the distinct keys x[0..n) to x[0..k) (0 < k < n):
 * quickselect with a median-of-three pivot. */
static void kvt__topk_select(uint64_t *x, uint32_t n, uint32_t k)
{
    uint32_t lo = 0, hi = n - 1; /* the k-th largest lies in x[lo..hi] */
    const uint32_t t = k - 1;
    while (lo < hi) {
        uint64_t a = x[lo], b = x[lo + (hi - lo) / 2], c = x[hi];
        const uint64_t piv = a < b ? (b < c ? b : a < c ? c : a) : (a < c ? a : b < c ? c : b);
        uint32_t i = lo, j = hi;
        for (;;) { /* Hoare: [lo, j] >= piv >= [j + 1, hi] */
            while (x[i] > piv)
                i++;
            while (x[j] < piv)
                j--;
            if (i >= j)
                break;
            const uint64_t tmp = x[i];
            x[i++] = x[j];
            x[j--] = tmp;
        }
        if (t <= j)
            hi = j;
        else
            lo = j + 1;
    }
}

uint32_t kvt__sel_pick(uint32_t np, uint32_t tokens, uint32_t P, uint32_t k, uint32_t sink,
                       uint32_t local, const float *vote, const uint32_t *reuse_topk,
                       uint32_t n_reuse, kvt__sel_scratch *sc, uint32_t *out, uint32_t *topk,
                       uint32_t *n_topk)
{
    uint8_t *mark = sc->mark;
    memset(mark, 0, np);
    uint32_t lo, hi; /* the forced pages: [0, lo) and [hi, np) */
    kvt__forced_span(np, tokens, P, sink, local, &lo, &hi);
    for (uint32_t i = 0; i < lo; i++)
        mark[i] = 1;
    for (uint32_t i = hi > lo ? hi : lo; i < np; i++)
        mark[i] = 1;
    uint32_t nt = 0;
    if (vote) {
        uint32_t nc = 0;
        for (uint32_t i = 0; i < np; i++)
            if (!mark[i])
                sc->key[nc++] = kvt__vkey(vote[i], i);
        uint32_t take = k < nc ? k : nc;
        if (take && take < nc)
            kvt__topk_select(sc->key, nc, take);
        for (uint32_t i = 0; i < take; i++)
            mark[~(uint32_t)sc->key[i]] = 2;
        nt = take;
    } else {
        for (uint32_t i = 0; i < n_reuse; i++)
            if (reuse_topk[i] < np && !mark[reuse_topk[i]])
                mark[reuse_topk[i]] = 2;
    }
    uint32_t n = 0, m = 0;
    for (uint32_t i = 0; i < np; i++) {
        if (mark[i])
            out[n++] = i;
        if (topk && mark[i] == 2)
            topk[m++] = i;
    }
    if (n_topk)
        *n_topk = vote ? nt : m;
    return n;
}

KVT_API int kvt_selector_select(const kvt_selector *sel, const kvt_pool *pool, kvt_seq_id seq,
                                uint32_t layer, uint32_t kv_head, const float *queries,
                                uint32_t *pages, uint32_t capacity, uint32_t *n_selected,
                                float *scores)
{
    kvt__seq *s;
    KVT__CHECK_NULL(sel);
    KVT__CHECK_NULL(pool);
    int rc = kvt__selector_match(sel, pool);
    if (rc)
        return rc;
    rc = kvt__seq_lookup(pool, seq, &s);
    if (rc)
        return rc;
    if (pool->be_caps & KVT__BE_NO_HOST_SELECT)
        return kvt__err(KVT_ENOTSUP, "pool: kvt_selector_select reads the metadata store on the host; "
                        "on the CUDA backend select inside a step (kvt_step_select)");
    if (layer >= pool->g.n_layers)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, pool->g.n_layers);
    if (kv_head >= pool->g.n_kv_heads)
        return kvt__err(KVT_EINVAL, "kv_head: %u >= n_kv_heads %u", kv_head,
                        pool->g.n_kv_heads);
    KVT__CHECK_NULL(queries);
    KVT__CHECK_NULL(pages);
    KVT__CHECK_NULL(n_selected);
    const uint32_t tokens = s->n_tokens[layer];
    const uint32_t np = kvt__pages_for(pool, tokens);
    const size_t bi = (size_t)layer * sel->g.n_kv_heads + kv_head;
    const uint32_t k = sel->k[bi], sink = sel->sink[bi], local = sel->local[bi];
    if (np == 0) {
        *n_selected = 0;
        return 0;
    }
    const uint32_t G = pool->g.n_q_heads / pool->g.n_kv_heads;
    void *mem = malloc(kvt__sel_scratch_bytes(G, pool->g.head_dim, np) +
                       (size_t)np * sizeof(uint32_t));
    if (!mem)
        return kvt__err(KVT_ENOMEM, "kvt_selector_select: cannot allocate scratch for %u pages", np);
    kvt__sel_scratch sc;
    kvt__sel_scratch_carve(&sc, mem, G, pool->g.head_dim, np);
    uint32_t *tmp = (uint32_t *)((uint8_t *)mem + kvt__sel_scratch_bytes(G, pool->g.head_dim, np));
    kvt__sel_score(sel, pool, s, layer, kv_head, queries, 1, 0, np, &sc);
    uint32_t n = kvt__sel_pick(np, tokens, pool->g.page_tokens, k, sink, local, sc.vote, NULL,
                               0, &sc, tmp, NULL, NULL);
    if (n > capacity) {
        free(mem);
        return kvt__err(KVT_ERANGE, "capacity: %u entries, the selection needs %u", capacity,
                        n);
    }
    memcpy(pages, tmp, n * sizeof *pages);
    if (scores)
        memcpy(scores, sc.vote, np * sizeof *scores);
    *n_selected = n;
    free(mem);
    return 0;
}
