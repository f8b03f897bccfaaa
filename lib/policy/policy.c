/* The head-stability policy: construction from options or per-head arrays,
 * accessors, the device footprint it implies, and a readable summary.
 * Immutable once built: no call changes it, so it needs no locking. */
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy_int.h"

#define KVT__POLICY_OPTS_V1 32u
_Static_assert(offsetof(kvt_policy_opts, unstable_interval) + 4 == KVT__POLICY_OPTS_V1,
               "policy opts v1");
#define KVT__POLICY_HEADS_V1 (offsetof(kvt_policy_heads, rerank_interval) + sizeof(void *))
#define KVT__POLICY_HEAD_INFO_V1 32u
_Static_assert(offsetof(kvt_policy_head_info, rerank_similarity) + 4 == KVT__POLICY_HEAD_INFO_V1,
               "policy head info v1");

KVT_API int kvt_policy_opts_init(kvt_policy_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    opts->default_class = KVT_HEAD_STABLE;
    opts->top_k_pages = 64;
    opts->window = 1;
    opts->sink_pages = 1;
    opts->local_pages = 1;
    opts->stable_interval = 16;
    opts->unstable_interval = 1;
    opts->rerank_similarity = KVT_RERANK_SIMILARITY_DEFAULT;
    return 0;
}

/* One head's values; `name` and `idx` say where they came from. */
static int kvt__head_check(uint32_t cls, uint32_t k, uint32_t w, uint32_t sink, uint32_t local,
                           uint32_t iv, const char *what, uint32_t idx, uint32_t H, int code)
{
    char at[64] = "";
    if (H)
        snprintf(at, sizeof at, "[%u] (layer %u, kv_head %u)", idx, idx / H, idx % H);
    if (cls > KVT_HEAD_UNSTABLE)
        return kvt__err(code ? code : KVT_EINVAL, "%shead_class%s: %u is not a head class (stable or unstable)", what, at,
                        cls);
    if (k > KVT_SELECT_MAX_PAGES)
        return kvt__err(code ? code : KVT_ERANGE,
                        "%stop_k_pages%s: %u is above KVT_SELECT_MAX_PAGES (%u)", what, at, k,
                        KVT_SELECT_MAX_PAGES);
    if (w == 0)
        return kvt__err(code ? code : KVT_EINVAL, "%swindow%s: must be at least 1", what, at);
    if (w > KVT_POLICY_MAX_WINDOW)
        return kvt__err(code ? code : KVT_ERANGE,
                        "%swindow%s: %u is above KVT_POLICY_MAX_WINDOW (%u)", what, at, w,
                        KVT_POLICY_MAX_WINDOW);
    if (sink > KVT_SELECT_MAX_PAGES)
        return kvt__err(code ? code : KVT_ERANGE,
                        "%ssink_pages%s: %u is above KVT_SELECT_MAX_PAGES (%u)", what, at, sink,
                        KVT_SELECT_MAX_PAGES);
    if (local > KVT_SELECT_MAX_PAGES)
        return kvt__err(code ? code : KVT_ERANGE,
                        "%slocal_pages%s: %u is above KVT_SELECT_MAX_PAGES (%u)", what, at,
                        local, KVT_SELECT_MAX_PAGES);
    if (iv == 0)
        return kvt__err(code ? code : KVT_EINVAL, "%srerank_interval%s: must be at least 1",
                        what, at);
    return 0;
}

int kvt__geometry_same(const kvt_geometry *a, const kvt_geometry *b, const char *what,
                       const char *a_name, const char *b_name)
{
    static const char *const names[] = {"n_layers", "n_kv_heads", "n_q_heads",
                                        "head_dim", "page_tokens", "dtype"};
    const uint32_t x[] = {a->n_layers, a->n_kv_heads, a->n_q_heads,
                          a->head_dim, a->page_tokens, a->dtype};
    const uint32_t y[] = {b->n_layers, b->n_kv_heads, b->n_q_heads,
                          b->head_dim, b->page_tokens, b->dtype};
    for (size_t i = 0; i < sizeof x / sizeof x[0]; i++)
        if (x[i] != y[i]) {
            if (i == 5) /* dtype: by name */
                return kvt__err(KVT_EINVAL, "%s: %s's geometry has dtype %s, %s's has %s", what,
                                a_name, kvt__dtype_name(x[i]), b_name, kvt__dtype_name(y[i]));
            return kvt__err(KVT_EINVAL, "%s: %s's geometry has %s %u, %s's has %u", what,
                            a_name, names[i], x[i], b_name, y[i]);
        }
    return 0;
}

int kvt__policy_build(kvt_policy **out, const kvt_geometry *g, const uint32_t *cls,
                      const uint32_t *k, const uint32_t *window, const uint32_t *sink,
                      const uint32_t *local, const uint32_t *interval, const float *sim,
                      const char *what,
                      int code)
{
    const uint32_t n = g->n_layers * g->n_kv_heads; /* <= 4096 * 4096 */
    uint32_t n_unstable = 0;
    for (uint32_t i = 0; i < n; i++) {
        int rc = kvt__head_check(cls[i], k[i], window[i], sink[i], local[i], interval[i], what,
                                 i, g->n_kv_heads, code);
        if (rc)
            return rc;
        n_unstable += cls[i] == KVT_HEAD_UNSTABLE;
        if (!(sim[i] >= -1.0f && sim[i] <= 1.0f))
            return kvt__err(code ? code : KVT_EINVAL, "%srerank_similarity[%u] (layer %u, "
                            "kv_head %u): %g is not a cosine similarity threshold (-1 .. 1)",
                            what, i, i / g->n_kv_heads, i % g->n_kv_heads, (double)sim[i]);
    }
    kvt_policy *p = calloc(1, sizeof *p);
    uint32_t *mem = malloc((size_t)n * 6u * sizeof *mem);
    float *fs = malloc((size_t)n * sizeof *fs);
    if (!p || !mem || !fs) {
        free(p);
        free(mem);
        free(fs);
        return kvt__err(KVT_ENOMEM, "policy: cannot allocate %u head records", n);
    }
    p->sim = fs;
    memcpy(p->sim, sim, (size_t)n * sizeof *fs);
    p->g = *g;
    p->n = n;
    p->n_unstable = n_unstable;
    p->cls = mem;
    p->k = mem + n;
    p->window = mem + 2u * (size_t)n;
    p->sink = mem + 3u * (size_t)n;
    p->local = mem + 4u * (size_t)n;
    p->interval = mem + 5u * (size_t)n;
    memcpy(p->cls, cls, (size_t)n * sizeof *mem);
    memcpy(p->k, k, (size_t)n * sizeof *mem);
    memcpy(p->window, window, (size_t)n * sizeof *mem);
    memcpy(p->sink, sink, (size_t)n * sizeof *mem);
    memcpy(p->local, local, (size_t)n * sizeof *mem);
    memcpy(p->interval, interval, (size_t)n * sizeof *mem);
    *out = p;
    return 0;
}

int kvt__policy_opts_get(kvt_policy_opts *o, const kvt_policy_opts *opts, const char *name)
{
    if (opts) {
        int rc = kvt__opts_copy(o, sizeof *o, opts, KVT__POLICY_OPTS_V1, name);
        if (rc)
            return rc;
        if (opts->struct_size < offsetof(kvt_policy_opts, reserved))
            o->rerank_similarity = KVT_RERANK_SIMILARITY_DEFAULT; /* the first layout */
        o->struct_size = (uint32_t)sizeof *o; /* the copy is this library's layout */
    } else {
        kvt_policy_opts_init(o);
    }
    if (o->default_class > KVT_HEAD_UNSTABLE)
        return kvt__err(KVT_EINVAL, "%s->default_class: %u is not a head class (stable or unstable)", name,
                        o->default_class);
    if (o->stable_interval == 0)
        return kvt__err(KVT_EINVAL, "%s->stable_interval: must be at least 1", name);
    if (o->unstable_interval == 0)
        return kvt__err(KVT_EINVAL, "%s->unstable_interval: must be at least 1", name);
    char sname[48];
    snprintf(sname, sizeof sname, "%s->rerank_similarity", name);
    int rs = kvt__similarity_check(o->rerank_similarity, sname);
    if (rs)
        return rs;
    if (o->reserved)
        return kvt__err(KVT_EINVAL, "%s->reserved: must be zero", name);
    char what[40];
    snprintf(what, sizeof what, "%s->", name);
    return kvt__head_check(o->default_class, o->top_k_pages, o->window, o->sink_pages,
                           o->local_pages, 1, what, 0, 0, 0);
}

KVT_API int kvt_policy_create_heads(const kvt_geometry *geom, const kvt_policy_opts *opts,
                                    const kvt_policy_heads *heads, kvt_policy **out)
{
    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(geom);
    KVT__CHECK_NULL(heads);
    kvt_geometry g;
    int rc = kvt__geometry_resolve(geom, &g);
    if (rc)
        return rc;
    kvt_policy_opts o;
    if ((rc = kvt__policy_opts_get(&o, opts, "opts")))
        return rc;
    kvt_policy_heads hd;
    if ((rc = kvt__opts_copy(&hd, sizeof hd, heads, KVT__POLICY_HEADS_V1, "heads")))
        return rc;
    const uint32_t n = g.n_layers * g.n_kv_heads;
    if (hd.n_heads != n)
        return kvt__err(KVT_EINVAL, "heads->n_heads: %u, the geometry has n_layers * "
                        "n_kv_heads = %u", hd.n_heads, n);
    uint32_t *mem = malloc((size_t)n * 7u * sizeof *mem);
    if (!mem)
        return kvt__err(KVT_ENOMEM, "policy: cannot allocate %u head records", n);
    float *sim = (float *)(void *)(mem + 6u * (size_t)n);
    uint32_t *cls = mem, *k = mem + n, *w = mem + 2u * (size_t)n, *sink = mem + 3u * (size_t)n,
             *local = mem + 4u * (size_t)n, *iv = mem + 5u * (size_t)n;
    for (uint32_t i = 0; i < n; i++) {
        cls[i] = hd.head_class ? hd.head_class[i] : o.default_class;
        k[i] = hd.top_k_pages ? hd.top_k_pages[i] : o.top_k_pages;
        w[i] = hd.window ? hd.window[i] : o.window;
        sink[i] = hd.sink_pages ? hd.sink_pages[i] : o.sink_pages;
        local[i] = hd.local_pages ? hd.local_pages[i] : o.local_pages;
        iv[i] = hd.rerank_interval ? hd.rerank_interval[i]
                : cls[i] == KVT_HEAD_UNSTABLE ? o.unstable_interval
                                              : o.stable_interval;
        sim[i] = hd.rerank_similarity ? hd.rerank_similarity[i] : o.rerank_similarity;
    }
    rc = kvt__policy_build(out, &g, cls, k, w, sink, local, iv, sim, "heads->", 0);
    free(mem);
    return rc;
}

KVT_API int kvt_policy_create(const kvt_geometry *geom, const kvt_policy_opts *opts,
                              kvt_policy **out)
{
    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(geom);
    kvt_geometry g;
    int rc = kvt__geometry_resolve(geom, &g);
    if (rc)
        return rc;
    kvt_policy_opts o;
    if ((rc = kvt__policy_opts_get(&o, opts, "opts")))
        return rc;
    kvt_policy_heads hd;
    memset(&hd, 0, sizeof hd);
    hd.struct_size = (uint32_t)sizeof hd;
    hd.n_heads = g.n_layers * g.n_kv_heads;
    return kvt_policy_create_heads(&g, &o, &hd, out);
}

KVT_API void kvt_policy_destroy(kvt_policy *pol)
{
    if (!pol)
        return;
    free(pol->cls);
    free(pol->sim);
    free(pol);
}

static int kvt__policy_at(const kvt_policy *pol, uint32_t layer, uint32_t kv_head, size_t *i)
{
    if (layer >= pol->g.n_layers)
        return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", layer, pol->g.n_layers);
    if (kv_head >= pol->g.n_kv_heads)
        return kvt__err(KVT_EINVAL, "kv_head: %u >= n_kv_heads %u", kv_head,
                        pol->g.n_kv_heads);
    *i = (size_t)layer * pol->g.n_kv_heads + kv_head;
    return 0;
}

KVT_API int kvt_policy_head_get(const kvt_policy *pol, uint32_t layer, uint32_t kv_head,
                                kvt_policy_head_info *info)
{
    size_t i = 0, fill = 0;
    KVT__CHECK_NULL(pol);
    int rc = kvt__policy_at(pol, layer, kv_head, &i);
    if (rc)
        return rc;
    KVT__CHECK_NULL(info);
    if ((rc = kvt__out_struct(info, sizeof *info, KVT__POLICY_HEAD_INFO_V1, "info", &fill)))
        return rc;
    kvt_policy_head_info r;
    memset(&r, 0, sizeof r);
    r.struct_size = info->struct_size;
    r.head_class = pol->cls[i];
    r.top_k_pages = pol->k[i];
    r.window = pol->window[i];
    r.sink_pages = pol->sink[i];
    r.local_pages = pol->local[i];
    r.rerank_interval = pol->interval[i];
    r.rerank_similarity = pol->sim[i];
    memcpy(info, &r, fill);
    return 0;
}

KVT_API int kvt_policy_geometry_get(const kvt_policy *pol, kvt_geometry *out)
{
    KVT__CHECK_NULL(pol);
    KVT__CHECK_NULL(out);
    *out = pol->g;
    return 0;
}

KVT_API int kvt_policy_count_get(const kvt_policy *pol, kvt_head_class head_class,
                                 uint32_t *n_heads)
{
    KVT__CHECK_NULL(pol);
    KVT__CHECK_NULL(n_heads);
    if (head_class > KVT_HEAD_UNSTABLE)
        return kvt__err(KVT_EINVAL, "head_class: %u is not a head class (stable or unstable)", head_class);
    *n_heads = head_class == KVT_HEAD_UNSTABLE ? pol->n_unstable : pol->n - pol->n_unstable;
    return 0;
}

/* Device pages of one head for a sequence of np pages whose last page is
 * partial or not: the rule of kvt_selector_select (sink, local, partial last page,
 * then top-K), with top_k * window pages by score. */
static uint64_t kvt__head_device_pages(const kvt_policy *pol, size_t i, uint64_t np,
                                       bool partial)
{
    if (pol->cls[i] == KVT_HEAD_UNSTABLE)
        return np;
    /* The forced pages (lib/core/forced.h's rule, over 64-bit counts): sink,
     * a partial last page and the local full pages before it. */
    const uint64_t s = pol->sink[i] < np ? pol->sink[i] : np;
    const uint64_t want = (uint64_t)pol->local[i] + (partial && np > 0);
    const uint64_t l = want < np ? want : np;
    const uint64_t f = s + l < np ? s + l : np;
    const uint64_t kw = (uint64_t)pol->k[i] * pol->window[i];
    const uint64_t rest = np - f;
    return f + (kw < rest ? kw : rest);
}

KVT_API int kvt_policy_device_pages_get(const kvt_policy *pol, uint64_t ctx_tokens,
                                        uint64_t *device_pages, uint64_t *total_pages)
{
    KVT__CHECK_NULL(pol);
    KVT__CHECK_NULL(device_pages);
    const uint64_t P = pol->g.page_tokens;
    const uint64_t np = ctx_tokens / P + (ctx_tokens % P != 0);
    uint64_t dev = 0, total;
    if (!kvt__mul_u64(np, pol->n, &total))
        return kvt__err(KVT_EOVERFLOW, "ctx_tokens: %llu tokens over %u heads overflow a page "
                        "count", (unsigned long long)ctx_tokens, pol->n);
    for (size_t i = 0; i < pol->n; i++)
        dev += kvt__head_device_pages(pol, i, np, ctx_tokens % P != 0); /* <= total */
    *device_pages = dev;
    if (total_pages)
        *total_pages = total;
    return 0;
}

/* ---- describe ------------------------------------------------------------- */
typedef struct kvt__text {
    char *buf;
    size_t cap, len;
} kvt__text;

static void kvt__put(kvt__text *t, const char *fmt, ...) KVT__PRINTF(2, 3);
static void kvt__put(kvt__text *t, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n <= 0)
        return;
    size_t m = (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1;
    if (t->len < t->cap) {
        size_t room = t->cap - t->len;
        memcpy(t->buf + t->len, tmp, m < room ? m : room);
    }
    t->len += m;
}

/* "a" or "a-b". */
static void kvt__range(char *s, size_t n, uint32_t lo, uint32_t hi)
{
    if (lo == hi)
        snprintf(s, n, "%u", lo);
    else
        snprintf(s, n, "%u-%u", lo, hi);
}

KVT_API int kvt_policy_describe(const kvt_policy *pol, uint64_t ctx_tokens, char *buf,
                                size_t cap, size_t *needed)
{
    KVT__CHECK_NULL(pol);
    if (cap && !buf)
        return kvt__err(KVT_EINVAL, "buf: NULL with cap %zu", cap);
    uint64_t dev = 0, total = 0;
    if (ctx_tokens) {
        int rc = kvt_policy_device_pages_get(pol, ctx_tokens, &dev, &total);
        if (rc)
            return rc;
    }
    kvt__text t = {buf, cap ? cap - 1 : 0, 0};
    const kvt_geometry *g = &pol->g;
    kvt__put(&t, "policy: %u layers x %u KV heads = %u heads (%u query heads, head_dim %u, "
             "%u-token pages, %s)\n", g->n_layers, g->n_kv_heads, pol->n, g->n_q_heads,
             g->head_dim, g->page_tokens, kvt__dtype_name(g->dtype));
    for (uint32_t c = 0; c <= KVT_HEAD_UNSTABLE; c++) {
        uint32_t cnt = 0, lo[5], hi[5];
        for (int f = 0; f < 5; f++) {
            lo[f] = UINT32_MAX;
            hi[f] = 0;
        }
        for (size_t i = 0; i < pol->n; i++) {
            if (pol->cls[i] != c)
                continue;
            cnt++;
            const uint32_t v[5] = {pol->k[i], pol->window[i], pol->sink[i], pol->local[i],
                                   pol->interval[i]};
            for (int f = 0; f < 5; f++) {
                lo[f] = v[f] < lo[f] ? v[f] : lo[f];
                hi[f] = v[f] > hi[f] ? v[f] : hi[f];
            }
        }
        const char *name = c == KVT_HEAD_STABLE ? "stable:  " : "unstable:";
        kvt__put(&t, "%s %u heads (%.1f%%)", name, cnt, 100.0 * cnt / pol->n);
        if (cnt) {
            char r[5][32];
            for (int f = 0; f < 5; f++)
                kvt__range(r[f], sizeof r[f], lo[f], hi[f]);
            kvt__put(&t, ", top-K %s pages", r[0]);
            if (c == KVT_HEAD_STABLE)
                kvt__put(&t, ", window x%s", r[1]);
            kvt__put(&t, ", sink %s, local %s, rerank every %s step%s", r[2], r[3], r[4],
                     hi[4] == 1 ? "" : "s");
        }
        kvt__put(&t, "\n");
    }
    if (ctx_tokens) {
        const double bb = 2.0 * g->page_tokens * g->head_dim * (double)kvt_dtype_size(g->dtype);
        const double mb = 3.0 * g->head_dim * (double)kvt_dtype_size(g->dtype);
        kvt__put(&t, "at %llu tokens per sequence: %llu of %llu KV pages on device (%.1f%%), "
                 "%.1f of %.1f MiB; page metadata %.1f MiB (every page, device tier)\n",
                 (unsigned long long)ctx_tokens, (unsigned long long)dev,
                 (unsigned long long)total, total ? 100.0 * (double)dev / (double)total : 0.0,
                 (double)dev * bb / 1048576.0, (double)total * bb / 1048576.0,
                 (double)total * mb / 1048576.0);
    }
    if (buf)
        buf[t.len < t.cap ? t.len : t.cap] = '\0';
    if (needed)
        *needed = t.len;
    return 0;
}

/* A tiered pool's stable head: the policy's class of (layer, head) lh. */
bool kvt__stable(const kvt_pool *p, size_t lh)
{
    return p->pol && p->pol->cls[lh] == KVT_HEAD_STABLE;
}
