/* kvtier-decode: the engine's use of libkvtier (see engine.h). */
#include "engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PROG "kvtier-decode"

#define CHECK(call)                                                                        \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_) {                                                                         \
            fprintf(stderr, PROG ": %s failed: %s (%s)\n", #call, kvt_err_name(rc_),       \
                    kvt_last_error());                                                     \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, PROG ": out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint32_t argmax(const float *x, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

void work_init_rows(work *w, const model_cfg *c, uint32_t rows)
{
    const size_t r = rows ? rows : 1;
    w->rows = (uint32_t)r;
    w->x = xmalloc(r * c->dim * sizeof(float));
    w->xb = xmalloc(r * (c->dim > c->hidden ? c->dim : c->hidden) * sizeof(float));
    w->q = xmalloc(r * model_qdim(c) * sizeof(float));
    w->att = xmalloc(r * model_qdim(c) * sizeof(float));
    w->k = xmalloc(r * model_kvdim(c) * sizeof(float));
    w->v = xmalloc(r * model_kvdim(c) * sizeof(float));
    w->h1 = xmalloc(r * c->hidden * sizeof(float));
    w->h3 = xmalloc(r * c->hidden * sizeof(float));
    w->logits = xmalloc(r * c->vocab * sizeof(float));
}

void work_init(work *w, const model_cfg *c)
{
    work_init_rows(w, c, 1);
}

void work_free(work *w)
{
    free(w->x);
    free(w->xb);
    free(w->q);
    free(w->att);
    free(w->k);
    free(w->v);
    free(w->h1);
    free(w->h3);
    free(w->logits);
}

void kv_open(kvcache *kc, const model *m, const engine_opts *o, int tiered, uint32_t ctx)
{
    memset(kc, 0, sizeof *kc);
    kc->tiered = tiered;
    const model_cfg *c = &m->c;
    kvt_pool_opts po;
    CHECK(kvt_pool_opts_init(&po));
    po.backend = KVT_BACKEND_CPU;
    po.geom.n_layers = c->n_layers;
    po.geom.n_kv_heads = c->n_kv_heads;
    po.geom.n_q_heads = c->n_heads;
    po.geom.head_dim = c->head_dim;
    po.geom.page_tokens = 16;
    po.geom.dtype = KVT_DTYPE_F16;
    po.n_threads = o->threads;
    po.max_seqs = 4 + o->samples;
    po.max_seq_tokens = ctx + 1;
    po.target_tokens = ctx + 1;
    po.target_seqs = 1;
    if (tiered) {
        const uint32_t P = po.geom.page_tokens, nlh = c->n_layers * c->n_kv_heads;
        if (o->policy) {
            CHECK(kvt_policy_load(o->policy, &po.geom, &kc->pol));
            if (o->interval || o->rerank_sim == o->rerank_sim) {
                fprintf(stderr, PROG ": --interval and --rerank-sim set the built-in policy; "
                        "a --policy file carries its own\n");
                exit(2);
            }
        } else {
            kvt_head_class *cls = xmalloc(nlh * sizeof *cls);
            for (uint32_t i = 0; i < nlh; i++)
                cls[i] = i % 8 == 0 ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE;
            kvt_policy_opts pol;
            CHECK(kvt_policy_opts_init(&pol));
            pol.top_k_pages = (o->budget + P - 1) / P;
            if (o->interval)
                pol.stable_interval = o->interval;
            if (o->rerank_sim == o->rerank_sim) /* not NaN: given */
                pol.rerank_similarity = o->rerank_sim;
            kvt_policy_heads ph = {.struct_size = sizeof ph, .n_heads = nlh, .head_class = cls};
            CHECK(kvt_policy_create_heads(&po.geom, &pol, &ph, &kc->pol));
            free(cls);
        }
        kvt_selector_opts so;
        CHECK(kvt_selector_opts_init(&so));
        so.method = o->method;
        if (o->method == KVT_SCORE_TOKEN)
            so.vote = KVT_VOTE_SOFTVOTE;
        CHECK(kvt_selector_create(&po.geom, &so, &kc->sel));
        po.policy = kc->pol;
        po.selector = kc->sel;
    }
    kc->sz.struct_size = sizeof kc->sz;
    CHECK(kvt_pool_sizing_get(&po, &kc->sz));
    uint64_t block;
    CHECK(kvt_geometry_block_bytes(&po.geom, &block));
    /* The device tier from the sizing, plus room for one prefill chunk of
     * new pages per (layer, KV head) before they are copied out (a step
     * plans every layer's pages at once). */
    const uint64_t chunk_room = (uint64_t)c->n_layers * c->n_kv_heads *
                                ((o->chunk > 512 ? o->chunk : 512) / 16 + 1) * block;
    po.device_bytes = kc->sz.device_bytes + chunk_room;
    /* A restore appends every page into the device tier (the placement
     * moves them out as the steps go). */
    if (o->resume)
        po.device_bytes = kc->sz.dense_bytes + chunk_room;
    /* Each further sample: its copied last pages, the pages it grows and
     * (tiered) its own selection's promotions. */
    const uint64_t per = (uint64_t)(o->gen / 16 + 2) + (tiered ? o->budget / 16 + 4 : 0);
    po.device_bytes += (uint64_t)(o->samples > 1 ? o->samples - 1 : 0) * c->n_layers *
                       c->n_kv_heads * per * block;
    if (tiered) {
        const uint64_t all = kc->sz.dense_bytes;
        po.host_bytes = o->disk ? all / 4 + 2 * block : all;
        if (o->disk) {
            po.disk_dir = o->disk;
            po.disk_bytes = all + all / 4 + (64u << 20);
        }
    }
    if (o->prefix_cache || o->remote)
        po.flags |= KVT_POOL_PREFIX_CACHE;
    po.remote = o->remote;
    CHECK(kvt_pool_create(&po, &kc->pool));
    CHECK(kvt_seq_create(kc->pool, NULL, &kc->seq));
}

void kv_close(kvcache *kc)
{
    kvt_pool_destroy(kc->pool);
    kvt_selector_destroy(kc->sel);
    kvt_policy_destroy(kc->pol);
}

/* ---- the forward pass ------------------------------------------------------------- */
static void progress(const char *what, double frac)
{
    int w = 40, fill = (int)(frac * w + 0.5);
    fprintf(stderr, "\r%-8s [%.*s%*s] %3d%%", what, fill, "########################################",
            w - fill, "", (int)(frac * 100 + 0.5));
    if (frac >= 1.0)
        fprintf(stderr, "\n");
}

/* Prefill of tokens[0..T): layer-major, every product a GEMM, the prompt's
 * own causal attention by GEMM over chunks of queries; K and V of each
 * layer go to every cache. Leaves the last position's logits in w->logits
 * and, for warm-up, the queries of the last n_obs tokens in obs
 * [L][n_obs][H][hd]. */
void engine_prefill(const model *m, const int32_t *tokens, uint32_t T, kvcache *kc, int nkc,
                    float *logits, float *obs, uint32_t n_obs, int show, uint32_t nthreads)
{
    const model_cfg *c = &m->c;
    const size_t d = c->dim, q = model_qdim(c), kv = model_kvdim(c), L = c->n_layers;
    float *X = xmalloc((size_t)T * d * sizeof *X), *XB = xmalloc((size_t)T * d * sizeof *XB);
    float *Q = xmalloc((size_t)T * q * sizeof *Q), *O = xmalloc((size_t)T * q * sizeof *O);
    float *K = xmalloc((size_t)T * kv * sizeof *K), *V = xmalloc((size_t)T * kv * sizeof *V);
    const size_t MC = 1024; /* MLP rows at a time */
    float *h1 = xmalloc(MC * c->hidden * sizeof *h1), *h3 = xmalloc(MC * c->hidden * sizeof *h3);
    for (uint32_t t = 0; t < T; t++)
        memcpy(X + (size_t)t * d, m->tok_emb + (size_t)tokens[t] * d, d * sizeof *X);
    const size_t AC = 2048; /* queries per progress tick */
    const double work_total = (double)L * T;
    for (uint32_t l = 0; l < L; l++) {
        model_rmsnorm(c, XB, X, m->rms_att + l * d, T);
        model_matmul(Q, XB, m->wq + l * q * d, m->bq ? m->bq + l * q : NULL, T, (uint32_t)q, c->dim);
        model_matmul(K, XB, m->wk + l * kv * d, m->bk ? m->bk + l * kv : NULL, T, (uint32_t)kv, c->dim);
        model_matmul(V, XB, m->wv + l * kv * d, m->bv ? m->bv + l * kv : NULL, T, (uint32_t)kv, c->dim);
        model_rope(c, Q, T, c->n_heads, 0);
        model_rope(c, K, T, c->n_kv_heads, 0);
        for (int i = 0; i < nkc; i++) {
            double t0 = now_s();
            for (uint32_t t0k = 0; t0k < T; t0k += 512) {
                const uint32_t n = T - t0k < 512 ? T - t0k : 512;
                CHECK(kvt_seq_append(kc[i].pool, kc[i].seq, l, K + (size_t)t0k * kv,
                                     V + (size_t)t0k * kv, n, KVT_DTYPE_F32, 0));
            }
            kc[i].t_prefill_kv += now_s() - t0;
        }
        if (obs)
            for (uint32_t j = 0; j < n_obs; j++)
                memcpy(obs + ((size_t)l * n_obs + j) * q, Q + (size_t)(T - n_obs + j) * q,
                       q * sizeof *obs);
        for (size_t i0 = 0; i0 < T; i0 += AC) {
            const size_t nc = T - i0 < AC ? T - i0 : AC;
            model_prefill_attention(c, Q + i0 * q, K, V, nc, (uint32_t)i0, O + i0 * q, nthreads);
            if (show)
                progress("prefill", ((double)l * T + (double)(i0 + nc)) / work_total);
        }
        model_matmul(XB, O, m->wo + l * d * q, NULL, T, c->dim, (uint32_t)q);
        for (size_t i = 0; i < (size_t)T * d; i++)
            X[i] += XB[i];
        for (size_t r0 = 0; r0 < T; r0 += MC) {
            const size_t nr = T - r0 < MC ? T - r0 : MC;
            model_mlp(m, l, X + r0 * d, nr, XB + r0 * d, h1, h3);
        }
    }
    model_rmsnorm(c, XB, X + (size_t)(T - 1) * d, m->rms_final, 1);
    model_matmul(logits, XB, m->wcls, NULL, 1, c->vocab, c->dim);
    free(X);
    free(XB);
    free(Q);
    free(O);
    free(K);
    free(V);
    free(h1);
    free(h3);
}

/* n tokens at positions pos .. pos + n - 1 through cache kc as one step
 * (kvt_step_opts.n_new = n): every product a GEMM over the n rows, and
 * kvtier's append and causal attention per layer. */
void engine_step(const model *m, kvcache *kc, const int32_t *toks, uint32_t n, uint32_t pos,
                 int dense, int all_logits, work *w, float *obs, uint32_t n_obs, uint32_t obs_from)
{
    const model_cfg *c = &m->c;
    const size_t d = c->dim, q = model_qdim(c), kv = model_kvdim(c);
    if (n == 0 || n > w->rows) {
        fprintf(stderr, PROG ": engine_step: %u rows, the buffers hold %u\n", n, w->rows);
        exit(1);
    }
    double t0 = now_s();
    for (uint32_t r = 0; r < n; r++)
        memcpy(w->x + r * d, m->tok_emb + (size_t)toks[r] * d, d * sizeof *w->x);
    kvt_step_opts so;
    CHECK(kvt_step_opts_init(&so));
    if (dense)
        so.flags = KVT_STEP_DENSE;
    if (n > 1) {
        so.n_new = &n;
        so.n_rows = n;
    }
    kvt_step *st;
    double tp = now_s();
    CHECK(kvt_step_plan(kc->pool, &kc->seq, 1, &so, &st));
    kc->t_plan += now_s() - tp;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        model_rmsnorm(c, w->xb, w->x, m->rms_att + l * d, n);
        model_matmul(w->q, w->xb, m->wq + l * q * d, m->bq ? m->bq + l * q : NULL, n, (uint32_t)q, c->dim);
        model_matmul(w->k, w->xb, m->wk + l * kv * d, m->bk ? m->bk + l * kv : NULL, n, (uint32_t)kv, c->dim);
        model_matmul(w->v, w->xb, m->wv + l * kv * d, m->bv ? m->bv + l * kv : NULL, n, (uint32_t)kv, c->dim);
        model_rope(c, w->q, n, c->n_heads, pos);
        model_rope(c, w->k, n, c->n_kv_heads, pos);
        for (uint32_t r = 0; obs && r < n; r++) /* the warm-up's observation queries */
            if (pos + r >= obs_from && pos + r - obs_from < n_obs)
                memcpy(obs + ((size_t)l * n_obs + (pos + r - obs_from)) * q, w->q + r * q,
                       q * sizeof *obs);
        double ta = now_s();
        CHECK(kvt_step_append(st, l, w->k, w->v, KVT_DTYPE_F32, 0));
        double tb = now_s();
        CHECK(kvt_step_select(st, l, w->q));
        double tc = now_s();
        CHECK(kvt_step_decode(st, l, w->q, w->att, NULL));
        double td = now_s();
        if (kc->mass_due && !dense && n == 1) { /* measured, then left out of the time */
            selmass_layer(kc, st, l, w->q, c);
            t0 += now_s() - td;
        }
        kc->t_append += tb - ta;
        kc->t_select += tc - tb;
        kc->t_attend += td - tc;
        model_matmul(w->xb, w->att, m->wo + l * d * q, NULL, n, c->dim, (uint32_t)q);
        for (size_t i = 0; i < n * d; i++)
            w->x[i] += w->xb[i];
        model_mlp(m, l, w->x, n, w->xb, w->h1, w->h3);
    }
    tp = now_s();
    CHECK(kvt_step_finish(st));
    kc->t_plan += now_s() - tp;
    const uint32_t r0 = all_logits ? 0 : n - 1, nr = n - r0;
    model_rmsnorm(c, w->xb, w->x + (size_t)r0 * d, m->rms_final, nr);
    model_matmul(w->logits, w->xb, m->wcls, NULL, nr, c->vocab, c->dim);
    kc->t_decode += now_s() - t0;
}

/* One decode token at position pos through cache kc; logits out. */
void engine_decode(const model *m, kvcache *kc, int32_t tok, uint32_t pos, work *w)
{
    engine_step(m, kc, &tok, 1, pos, !kc->tiered, 0, w, NULL, 0, 0);
}

/* Positions [from, T) of tokens through kc in dense steps of w->rows
 * tokens; kvtier's share of the time goes to t_prefill_kv, not to the
 * decode's timers. */
static void prefill_range(const model *m, const int32_t *tokens, uint32_t from, uint32_t T,
                          kvcache *kc, work *w, float *obs, uint32_t n_obs, int show,
                          double done, double total)
{
    const kvcache saved = *kc;
    for (uint32_t p0 = from; p0 < T; p0 += w->rows) {
        const uint32_t n = T - p0 < w->rows ? T - p0 : w->rows;
        engine_step(m, kc, tokens + p0, n, p0, 1, 0, w, obs, n_obs, T - n_obs);
        if (show)
            progress("prefill", (done + p0 + n - from) / total);
    }
    kc->t_prefill_kv += kc->t_plan - saved.t_plan + kc->t_append - saved.t_append +
                        kc->t_select - saved.t_select + kc->t_attend - saved.t_attend;
    kc->t_decode = saved.t_decode;
    kc->t_plan = saved.t_plan;
    kc->t_append = saved.t_append;
    kc->t_select = saved.t_select;
    kc->t_attend = saved.t_attend;
}

void engine_prefill_chunked(const model *m, const int32_t *tokens, uint32_t T, kvcache *kc,
                            int nkc, uint32_t chunk, float *logits, float *obs, uint32_t n_obs,
                            int show)
{
    const model_cfg *c = &m->c;
    work w;
    work_init_rows(&w, c, chunk < T ? chunk : T);
    for (int i = 0; i < nkc; i++)
        prefill_range(m, tokens, 0, T, &kc[i], &w, obs, n_obs, show, (double)i * T,
                      (double)nkc * T);
    memcpy(logits, w.logits, c->vocab * sizeof *logits);
    work_free(&w);
}

void engine_prefill_rest(const model *m, const int32_t *tokens, uint32_t from, uint32_t T,
                         kvcache *kc, uint32_t chunk, float *logits, float *obs, uint32_t n_obs)
{
    work w;
    work_init_rows(&w, &m->c, chunk < T - from ? chunk : T - from);
    prefill_range(m, tokens, from, T, kc, &w, obs, n_obs, 0, 0, 1);
    memcpy(logits, w.logits, m->c.vocab * sizeof *logits);
    work_free(&w);
}
