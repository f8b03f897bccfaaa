/* A full tiered decode loop, the CPU backend against the CUDA kernels, step
 * by step. A tiered CPU pool (stable and unstable heads, a small device
 * tier so pages are evicted, promoted and recycled) runs prefill, warm-up and
 * decode steps through the public calls. A GPU mirror follows it the way the
 * CUDA backend is meant to: after the plan's appends and after each
 * rerank/recycle it copies only the block-table ranges kvt_step_dirty_get
 * reports (kvt__cu_table_sync reading a pinned host table through UVA),
 * brings each page that arrived in the device table from the pool's host
 * tier with the zero-copy kernel (kvt__cu_copy_kernel), appends the step's
 * token with kvt__cu_append, scores and selects with kvt__cu_score and
 * kvt__cu_topk, and decodes the CPU's selection with kvt__cu_attn over the
 * mirrored table. Checked at every layer of every step:
 *  - the mirrored device table equals the pool's table (every page of every
 *    head): the dirty ranges miss nothing;
 *  - the metadata of the page each append touched is bit-identical;
 *  - the GPU's selection of every reranked head equals the CPU's (a
 *    difference must be a near-tie of the votes);
 *  - the GPU's attention output and lse match the CPU backend's.
 * The pool passes kvt_pool_check after every step. Exits 77 without a
 * CUDA device (the -emu build runs it on the CPU emulation). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"
#include "internal.h"
#include "gputest.h"

#define N_LAYERS 2u
#define N_KV_HEADS 4u
#define HQ 8u
#define GQA_GROUP (HQ / N_KV_HEADS)
#define HEAD_DIM 64u
#define PAGE_TOKENS 16u
#define NS 2u
#define CAP 64u            /* pages per (sequence, layer, head) */
#define MAXTOK (CAP * PAGE_TOKENS)
#define PROMPT (37u * PAGE_TOKENS + 5u)
#define STEPS 24u
#define NOBS 4u
#define LH (N_LAYERS * N_KV_HEADS)
#define TAB ((size_t)NS * LH * CAP)

typedef struct {
    kvt_pool *p;
    kvt_policy *pol;
    kvt_selector *sel;
    kvt_seq_id id[NS];
    kvt__seq *s[NS];
    uint64_t bb;           /* block bytes */
    /* GPU mirror */
    uint8_t *d_dev, *d_meta;
    float *d_acc;
    uint32_t *d_devtab, *d_metatab;
    uint32_t *h_devtab, *h_metatab; /* pinned: what the planner publishes */
    uint32_t *g_devtab;             /* host copy of what the GPU holds */
    kvt__cu_range *h_ranges;        /* pinned */
    kvt__cu_copy *h_copies;         /* pinned */
    kvt__cu_append_item *h_app;     /* pinned */
    kvt__cu_score_item *h_sc;
    kvt__cu_topk_item *h_tk;
    kvt__cu_attn_item *h_at;
    float *d_kv, *d_q, *d_vote, *d_out, *d_lse;
    uint32_t *d_sel, *d_nsel, *d_topk, *d_ntopk, *d_blocks, *d_ntok;
    void *d_work;
    size_t work_bytes;
    void *stream;
    tu_rng r;
} fx;

static size_t tidx(uint32_t i, uint32_t lh, uint32_t pg)
{
    return ((size_t)i * LH + lh) * CAP + pg;
}

static void *pinned(size_t bytes)
{
    void *h;
    CU_OK(kvt__cu_host_alloc(&h, bytes));
    memset(h, 0, bytes);
    return h;
}

static void *dev(size_t bytes)
{
    void *d;
    CU_OK(kvt__cu_malloc(&d, bytes));
    return d;
}

static void fx_open(fx *f)
{
    memset(f, 0, sizeof *f);
    f->r = (tu_rng){0x5eed1234ull};
    kvt_geometry g = {N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, {0, 0}};
    kvt_head_class cls[LH];
    uint32_t k[LH], w[LH], iv[LH];
    for (uint32_t b = 0; b < LH; b++) {
        cls[b] = (b == 1 || b == 7) ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE;
        k[b] = 4;
        w[b] = 1 + b % 2;
        iv[b] = cls[b] == KVT_HEAD_UNSTABLE ? 1 : 3;
    }
    kvt_policy_heads hd = {sizeof hd, LH, cls, k, w, NULL, NULL, iv, NULL};
    TU_OK(kvt_policy_create_heads(&g, NULL, &hd, &f->pol));
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT;
    TU_OK(kvt_selector_create(&g, &so, &f->sel));
    kvt_pool_opts o =
        tu_opts(N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, 420, 1400);
    o.policy = f->pol;
    o.selector = f->sel;
    o.n_threads = 2;
    TU_OK(kvt_pool_create(&o, &f->p));
    f->bb = f->p->block_bytes;
    for (uint32_t i = 0; i < NS; i++) {
        kvt_seq_opts sq = KVT_SEQ_OPTS_INIT;
        sq.max_tokens = MAXTOK;
        TU_OK(kvt_seq_create(f->p, &sq, &f->id[i]));
        TU_OK(kvt__seq_lookup(f->p, f->id[i], &f->s[i]));
    }
    const kvt__arena *dv = &f->p->tier[KVT_TIER_DEVICE], *hs = &f->p->tier[KVT_TIER_HOST];
    f->d_dev = dev((size_t)dv->n_blocks * f->bb);
    f->d_meta = dev((size_t)f->p->meta.n_blocks * f->p->meta.block_bytes);
    f->d_acc = dev((size_t)NS * LH * 3 * HEAD_DIM * sizeof(float));
    f->d_devtab = dev(TAB * 4);
    f->d_metatab = dev(TAB * 4);
    CU_OK(kvt__cu_memset(f->d_devtab, 0, TAB * 4));
    CU_OK(kvt__cu_memset(f->d_metatab, 0, TAB * 4));
    f->h_devtab = pinned(TAB * 4);
    f->h_metatab = pinned(TAB * 4);
    f->g_devtab = calloc(TAB, 4);
    f->h_ranges = pinned(NS * N_KV_HEADS * sizeof(kvt__cu_range));
    f->h_copies = pinned(NS * N_KV_HEADS * CAP * sizeof(kvt__cu_copy));
    f->h_app = pinned(NS * N_KV_HEADS * sizeof(kvt__cu_append_item));
    f->h_sc = pinned(NS * N_KV_HEADS * sizeof(kvt__cu_score_item));
    f->h_tk = pinned(NS * N_KV_HEADS * sizeof(kvt__cu_topk_item));
    f->h_at = pinned(NS * N_KV_HEADS * sizeof(kvt__cu_attn_item));
    f->d_kv = dev(2 * NS * N_KV_HEADS * HEAD_DIM * sizeof(float));
    f->d_q = dev(NS * HQ * HEAD_DIM * sizeof(float));
    f->d_vote = dev(NS * N_KV_HEADS * CAP * sizeof(float));
    f->d_out = dev(NS * HQ * HEAD_DIM * sizeof(float));
    f->d_lse = dev(NS * HQ * sizeof(float));
    f->d_sel = dev(NS * N_KV_HEADS * CAP * 4);
    f->d_topk = dev(NS * N_KV_HEADS * CAP * 4);
    f->d_nsel = dev(NS * N_KV_HEADS * 4);
    f->d_ntopk = dev(NS * N_KV_HEADS * 4);
    f->d_blocks = dev(NS * N_KV_HEADS * CAP * 4);
    f->d_ntok = dev(NS * N_KV_HEADS * CAP * 4);
    CU_OK(kvt__cu_host_register(hs->base, hs->map_bytes));
    CU_OK(kvt__cu_stream_create(&f->stream, 0));
}

static void fx_close(fx *f)
{
    CU_OK(kvt__cu_stream_sync(f->stream));
    kvt__cu_stream_destroy(f->stream);
    kvt__cu_host_unregister(f->p->tier[KVT_TIER_HOST].base);
    void *d[] = {f->d_dev, f->d_meta, f->d_acc, f->d_devtab, f->d_metatab, f->d_kv, f->d_q,
                 f->d_vote, f->d_out, f->d_lse, f->d_sel, f->d_topk, f->d_nsel, f->d_ntopk,
                 f->d_blocks, f->d_ntok, f->d_work};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        kvt__cu_free(d[i]);
    void *h[] = {f->h_devtab, f->h_metatab, f->h_ranges, f->h_copies, f->h_app,
                 f->h_sc, f->h_tk, f->h_at};
    for (size_t i = 0; i < sizeof h / sizeof h[0]; i++)
        kvt__cu_host_free(h[i]);
    free(f->g_devtab);
    TU_CHECK(f->p);
    kvt_pool_destroy(f->p);
    kvt_policy_destroy(f->pol);
    kvt_selector_destroy(f->sel);
}

static void rand_rows(tu_rng *r, float *x, size_t n, float amp)
{
    for (size_t e = 0; e < n; e++)
        x[e] = amp * tu_unit(r);
}

/* Prefill and warm-up through the public calls, then the first plan; once
 * the warm-up's copies have landed, the mirror starts as a full copy of the
 * device tier, the metadata store, the open pages' accumulators and the
 * tables (the one time anything is copied whole). */
static kvt_step *fx_start(fx *f, const kvt_step_opts *so)
{
    float *kv = malloc((size_t)PROMPT * N_KV_HEADS * HEAD_DIM * 2 * sizeof(float));
    float *obs = malloc((size_t)N_LAYERS * NOBS * HQ * HEAD_DIM * sizeof(float));
    for (uint32_t i = 0; i < NS; i++) {
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            rand_rows(&f->r, kv, (size_t)PROMPT * N_KV_HEADS * HEAD_DIM * 2, 1.0f);
            TU_OK(kvt_seq_append(f->p, f->id[i], l, kv, kv + (size_t)PROMPT * N_KV_HEADS * HEAD_DIM,
                                 PROMPT - i, KVT_DTYPE_F32, 0));
        }
        rand_rows(&f->r, obs, (size_t)N_LAYERS * NOBS * HQ * HEAD_DIM, 1.0f);
        TU_OK(kvt_seq_warmup(f->p, f->id[i], obs, NOBS));
    }
    free(kv);
    free(obs);
    kvt_step *st;
    TU_OK(kvt_step_plan(f->p, f->id, NS, so, &st));
    for (int spin = 0;; spin++) {
        uint32_t all = 1, rd;
        for (uint32_t i = 0; i < NS; i++) {
            TU_OK(kvt_step_ready_get(st, i, &rd));
            all &= rd;
        }
        if (all)
            break;
        assert_true(spin < 20000);
        usleep(500);
    }
    const kvt__arena *dv = &f->p->tier[KVT_TIER_DEVICE];
    CU_OK(kvt__cu_memcpy(f->d_dev, dv->base, (size_t)dv->n_blocks * f->bb));
    CU_OK(kvt__cu_memcpy(f->d_meta, f->p->meta.base,
                         (size_t)f->p->meta.n_blocks * f->p->meta.block_bytes));
    for (uint32_t i = 0; i < NS; i++) {
        const kvt__seq *s = f->s[i];
        CU_OK(kvt__cu_memcpy(f->d_acc + (size_t)i * LH * 3 * HEAD_DIM, s->acc,
                             (size_t)LH * 3 * HEAD_DIM * sizeof(float)));
        for (uint32_t lh = 0; lh < LH; lh++)
            for (uint32_t pg = 0; pg < CAP && pg < s->cap_pages; pg++) {
                f->h_devtab[tidx(i, lh, pg)] = s->dev_block[lh * s->cap_pages + pg];
                f->h_metatab[tidx(i, lh, pg)] = s->meta_slot[lh * s->cap_pages + pg];
            }
    }
    CU_OK(kvt__cu_memcpy(f->d_devtab, f->h_devtab, TAB * 4));
    CU_OK(kvt__cu_memcpy(f->d_metatab, f->h_metatab, TAB * 4));
    memcpy(f->g_devtab, f->h_devtab, TAB * 4);
    return st;
}

/* Publishes the dirty ranges of `layer` into the pinned tables, syncs them
 * to the GPU by the UVA kernel and copies every page that newly arrived in
 * the device table (and has a host copy) from the host tier. Then checks
 * the GPU's whole table of the layer against the pool's. */
static void fx_sync(fx *f, kvt_step *st, uint32_t layer)
{
    uint32_t nr = 0, nc = 0;
    const uint8_t *hbase = f->p->tier[KVT_TIER_HOST].base;
    for (uint32_t i = 0; i < NS; i++) {
        const kvt__seq *s = f->s[i];
        assert_true(s->cap_pages <= CAP);
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            uint32_t first, n;
            TU_OK(kvt_step_dirty_get(st, layer, i, h, &first, &n));
            if (!n)
                continue;
            const uint32_t lh = layer * N_KV_HEADS + h;
            assert_true(first + n <= s->cap_pages);
            for (uint32_t pg = first; pg < first + n; pg++) {
                const size_t e = (size_t)lh * s->cap_pages + pg, t = tidx(i, lh, pg);
                const uint32_t blk = s->dev_block[e];
                f->h_devtab[t] = blk;
                f->h_metatab[t] = s->meta_slot[e];
                if (blk && blk != f->g_devtab[t] && s->host_block[e]) {
                    f->h_copies[nc++] = (kvt__cu_copy){
                        (uint64_t)(uintptr_t)(hbase + (size_t)s->host_block[e] * f->bb),
                        (uint64_t)(uintptr_t)(f->d_dev + (size_t)blk * f->bb), f->bb};
                }
                f->g_devtab[t] = blk;
            }
            f->h_ranges[nr++] = (kvt__cu_range){tidx(i, lh, first), tidx(i, lh, first), n, 0};
        }
    }
    if (nr) {
        CU_OK(kvt__cu_table_sync(f->h_devtab, f->d_devtab, f->h_ranges, nr, f->stream));
        CU_OK(kvt__cu_table_sync(f->h_metatab, f->d_metatab, f->h_ranges, nr, f->stream));
    }
    if (nc)
        CU_OK(kvt__cu_copy_kernel(f->h_copies, nc, 0, 0, f->stream));
    CU_OK(kvt__cu_stream_sync(f->stream));
    /* The mirror misses nothing: the GPU table equals the pool's. */
    uint32_t *back = malloc(TAB * 4);
    CU_OK(kvt__cu_memcpy(back, f->d_devtab, TAB * 4));
    for (uint32_t i = 0; i < NS; i++) {
        const kvt__seq *s = f->s[i];
        const uint32_t np = (s->n_tokens[layer] + PAGE_TOKENS - 1) / PAGE_TOKENS;
        for (uint32_t h = 0; h < N_KV_HEADS; h++)
            for (uint32_t pg = 0; pg < np; pg++) {
                const uint32_t lh = layer * N_KV_HEADS + h;
                const uint32_t want = s->dev_block[(size_t)lh * s->cap_pages + pg];
                if (back[tidx(i, lh, pg)] != want)
                    fail_msg("layer %u seq %u head %u page %u: GPU table has block %u, the "
                             "pool %u (a change kvt_step_dirty_get did not report)",
                             layer, i, h, pg, back[tidx(i, lh, pg)], want);
            }
    }
    free(back);
}

static void fx_append(fx *f, uint32_t layer, const float *k, const float *v)
{
    const size_t rows = (size_t)NS * N_KV_HEADS * HEAD_DIM;
    CU_OK(kvt__cu_memcpy(f->d_kv, k, rows * sizeof(float)));
    CU_OK(kvt__cu_memcpy(f->d_kv + rows, v, rows * sizeof(float)));
    for (uint32_t i = 0; i < NS; i++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            const uint32_t lh = layer * N_KV_HEADS + h;
            f->h_app[i * N_KV_HEADS + h] = (kvt__cu_append_item){
                ((size_t)i * N_KV_HEADS + h) * HEAD_DIM, 0, tidx(i, lh, 0),
                ((size_t)i * LH + lh) * 3 * HEAD_DIM, f->s[i]->n_tokens[layer] - 1, 1};
        }
    kvt__cu_append_args a = {
        .d_items = f->h_app, .n_items = NS * N_KV_HEADS, .D = HEAD_DIM, .P = PAGE_TOKENS,
        .dtype = KVT_DTYPE_F16, .src_dtype = KVT_DTYPE_F32, .d_k = f->d_kv, .d_v = f->d_kv + rows,
        .d_dev_table = f->d_devtab, .d_meta_table = f->d_metatab, .d_dev_base = f->d_dev,
        .block_bytes = f->bb, .d_meta_base = f->d_meta, .meta_bytes = f->p->meta.block_bytes,
        .meta_slots = f->p->meta.n_blocks, .d_acc = f->d_acc, .max_tokens = 1};
    CU_OK(kvt__cu_append(&a, f->stream));
    CU_OK(kvt__cu_stream_sync(f->stream));
    /* The metadata of each appended page is the CPU's, bit for bit: its min
     * and max rows (plane 1 of the store) and its mean row (plane 2), at the
     * same offsets in the GPU's copy of the store as in the pool's. */
    const size_t row = kvt__meta_row(f->p);
    const uint8_t *base = f->p->meta.base;
    uint8_t *m = malloc(3 * row);
    for (uint32_t i = 0; i < NS; i++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            const kvt__seq *s = f->s[i];
            const uint32_t lh = layer * N_KV_HEADS + h, pg = (s->n_tokens[layer] - 1) / PAGE_TOKENS;
            const uint32_t slot = s->meta_slot[(size_t)lh * s->cap_pages + pg];
            const uint8_t *mm = kvt__meta_mm(f->p, slot), *mean = kvt__meta_mean(f->p, slot);
            CU_OK(kvt__cu_memcpy(m, f->d_meta + (mm - base), 2 * row));
            CU_OK(kvt__cu_memcpy(m + 2 * row, f->d_meta + (mean - base), row));
            if (memcmp(m, mm, 2 * row) != 0 || memcmp(m + 2 * row, mean, row) != 0)
                fail_msg("layer %u seq %u head %u page %u: GPU metadata differs", layer, i, h, pg);
        }
    free(m);
}

/* Scores and selects on the GPU; every head the CPU reranked must have the
 * same selection, up to near-ties of the votes. */
static uint32_t fx_select(fx *f, kvt_step *st, uint32_t layer, const float *q,
                          const kvt_policy *pol)
{
    CU_OK(kvt__cu_memcpy(f->d_q, q, (size_t)NS * HQ * HEAD_DIM * sizeof(float)));
    uint32_t n = 0, checked = 0;
    for (uint32_t i = 0; i < NS; i++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++, n++) {
            const kvt__seq *s = f->s[i];
            const uint32_t lh = layer * N_KV_HEADS + h, T = s->n_tokens[layer],
                           np = (T + PAGE_TOKENS - 1) / PAGE_TOKENS;
            kvt_policy_head_info hi = {.struct_size = sizeof hi};
            TU_OK(kvt_policy_head_get(pol, layer, h, &hi));
            f->h_sc[n] = (kvt__cu_score_item){((size_t)i * HQ + h * GQA_GROUP) * HEAD_DIM,
                                              tidx(i, lh, 0), (size_t)n * CAP, np, 0};
            f->h_tk[n] = (kvt__cu_topk_item){(size_t)n * CAP, (size_t)n * CAP, np, T,
                                             hi.top_k_pages, hi.sink_pages, hi.local_pages, 0};
        }
    kvt__cu_score_args sa = {
        .d_items = f->h_sc, .n_items = n, .G = GQA_GROUP, .D = HEAD_DIM, .dtype = KVT_DTYPE_F16,
        .method = KVT_SCORE_MINMAX, .vote = KVT_VOTE_SUM, .vote_scale = 1.0f, .max_pages = CAP,
        .d_q = f->d_q, .d_meta_table = f->d_metatab, .d_meta_base = f->d_meta,
        .meta_bytes = f->p->meta.block_bytes, .meta_slots = f->p->meta.n_blocks,
        .d_vote = f->d_vote};
    CU_OK(kvt__cu_score(&sa, f->stream));
    kvt__cu_topk_args ta = {f->h_tk, n, PAGE_TOKENS, CAP, f->d_vote, f->d_sel, f->d_nsel, f->d_topk,
                            f->d_ntopk};
    CU_OK(kvt__cu_topk(&ta, f->stream));
    CU_OK(kvt__cu_stream_sync(f->stream));
    uint32_t *sel = malloc(NS * N_KV_HEADS * CAP * 4), *nsel = malloc(NS * N_KV_HEADS * 4);
    float *vote = malloc(NS * N_KV_HEADS * CAP * sizeof(float));
    CU_OK(kvt__cu_memcpy(sel, f->d_sel, NS * N_KV_HEADS * CAP * 4));
    CU_OK(kvt__cu_memcpy(nsel, f->d_nsel, NS * N_KV_HEADS * 4));
    CU_OK(kvt__cu_memcpy(vote, f->d_vote, NS * N_KV_HEADS * CAP * sizeof(float)));
    for (uint32_t i = 0; i < NS; i++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            const uint32_t it = i * N_KV_HEADS + h;
            uint32_t cpu[CAP], nc, rr;
            TU_OK(kvt_step_selection_get(st, layer, i, h, cpu, CAP, &nc, &rr));
            if (!rr)
                continue;
            checked++;
            const uint32_t *gpu = sel + (size_t)it * CAP;
            if (nc == nsel[it] && memcmp(cpu, gpu, nc * 4) == 0)
                continue;
            /* A difference must be a near-tie: the best vote left out by
             * either side is within rounding of the worst vote taken. */
            uint8_t in_c[CAP] = {0}, in_g[CAP] = {0};
            for (uint32_t j = 0; j < nc; j++)
                in_c[cpu[j]] = 1;
            for (uint32_t j = 0; j < nsel[it]; j++)
                in_g[gpu[j]] = 1;
            const float *vt = vote + (size_t)it * CAP;
            float lo = INFINITY, hi = -INFINITY, mag = 0;
            for (uint32_t pg = 0; pg < CAP; pg++) {
                if (in_c[pg] != in_g[pg]) {
                    lo = fminf(lo, vt[pg]);
                    hi = fmaxf(hi, vt[pg]);
                }
                mag = fmaxf(mag, fabsf(vt[pg]));
            }
            if (!(hi - lo <= 1e-5f * (1.0f + mag)))
                fail_msg("layer %u seq %u head %u: GPU selection differs from the CPU's beyond a "
                         "near-tie (votes %g..%g)", layer, i, h, (double)lo, (double)hi);
        }
    free(sel);
    free(nsel);
    free(vote);
    return checked;
}

/* Decodes the CPU's selection on the GPU over the mirrored table and
 * compares with the CPU backend's output. */
static void fx_decode(fx *f, kvt_step *st, uint32_t layer, const float *cpu_out,
                      const float *cpu_lse)
{
    uint32_t *blocks = malloc(NS * N_KV_HEADS * CAP * 4), *ntok = malloc(NS * N_KV_HEADS * CAP * 4);
    uint32_t *tab = malloc(TAB * 4);
    CU_OK(kvt__cu_memcpy(tab, f->d_devtab, TAB * 4));
    uint32_t maxp = 0;
    for (uint32_t i = 0; i < NS; i++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            const uint32_t it = i * N_KV_HEADS + h, lh = layer * N_KV_HEADS + h,
                           T = f->s[i]->n_tokens[layer];
            uint32_t pages[CAP], n;
            TU_OK(kvt_step_selection_get(st, layer, i, h, pages, CAP, &n, NULL));
            for (uint32_t j = 0; j < n; j++) {
                blocks[it * CAP + j] = tab[tidx(i, lh, pages[j])];
                assert_int_not_equal(blocks[it * CAP + j], 0);
                const uint32_t end = (pages[j] + 1) * PAGE_TOKENS;
                ntok[it * CAP + j] = end <= T ? PAGE_TOKENS : T - pages[j] * PAGE_TOKENS;
            }
            maxp = n > maxp ? n : maxp;
            f->h_at[it] = (kvt__cu_attn_item){((size_t)i * HQ + h * GQA_GROUP) * HEAD_DIM,
                                              ((size_t)i * HQ + h * GQA_GROUP) * HEAD_DIM,
                                              (size_t)i * HQ + h * GQA_GROUP, (size_t)it * CAP,
                                              n, 0};
        }
    CU_OK(kvt__cu_memcpy(f->d_blocks, blocks, NS * N_KV_HEADS * CAP * 4));
    CU_OK(kvt__cu_memcpy(f->d_ntok, ntok, NS * N_KV_HEADS * CAP * 4));
    kvt__cu_attn_args a = {f->h_at, NS * N_KV_HEADS, GQA_GROUP, HEAD_DIM, PAGE_TOKENS,
                           KVT_DTYPE_F16, 1.0f / sqrtf((float)HEAD_DIM), CAP, 0,
                           f->d_q, f->d_out, f->d_lse, f->d_blocks, f->d_ntok, f->d_dev,
                           f->bb, NULL};
    const size_t wb = kvt__cu_attn_workspace_bytes(&a);
    if (wb > f->work_bytes) {
        kvt__cu_free(f->d_work);
        f->d_work = dev(wb);
        f->work_bytes = wb;
    }
    a.d_work = f->d_work;
    CU_OK(kvt__cu_attn(&a, f->stream));
    CU_OK(kvt__cu_stream_sync(f->stream));
    float *out = malloc(NS * HQ * HEAD_DIM * sizeof(float)), *lse = malloc(NS * HQ * sizeof(float));
    CU_OK(kvt__cu_memcpy(out, f->d_out, NS * HQ * HEAD_DIM * sizeof(float)));
    CU_OK(kvt__cu_memcpy(lse, f->d_lse, NS * HQ * sizeof(float)));
    /* Both sides accumulate in f32 over the same f16 rows, in different
     * orders: values up to ~1 (|v| < 1 here), so 2e-5 absolute. */
    for (size_t e = 0; e < (size_t)NS * HQ * HEAD_DIM; e++)
        if (!(fabsf(out[e] - cpu_out[e]) <= 2e-5f))
            fail_msg("layer %u: out[%zu] GPU %.9g CPU %.9g", layer, e, (double)out[e],
                     (double)cpu_out[e]);
    for (size_t e = 0; e < (size_t)NS * HQ; e++)
        if (!(fabsf(lse[e] - cpu_lse[e]) <= 2e-5f * (1.0f + fabsf(cpu_lse[e]))))
            fail_msg("layer %u: lse[%zu] GPU %.9g CPU %.9g", layer, e, (double)lse[e],
                     (double)cpu_lse[e]);
    free(out);
    free(lse);
    free(blocks);
    free(ntok);
    free(tab);
}

static void test_tiered_loop(void **state)
{
    (void)state;
    fx f;
    fx_open(&f);
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    so.stream = f.stream;
    kvt_step *st = fx_start(&f, &so);
    float *k = malloc(NS * N_KV_HEADS * HEAD_DIM * sizeof(float)),
          *v = malloc(NS * N_KV_HEADS * HEAD_DIM * sizeof(float));
    float *q = malloc(NS * HQ * HEAD_DIM * sizeof(float));
    float *out = malloc(NS * HQ * HEAD_DIM * sizeof(float)), *lse = malloc(NS * HQ * sizeof(float));
    uint32_t reranked = 0;
    for (uint32_t step = 0; step < STEPS; step++) {
        if (step)
            TU_OK(kvt_step_plan(f.p, f.id, NS, &so, &st));
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            rand_rows(&f.r, k, NS * N_KV_HEADS * HEAD_DIM, 1.0f);
            rand_rows(&f.r, v, NS * N_KV_HEADS * HEAD_DIM, 1.0f);
            rand_rows(&f.r, q, NS * HQ * HEAD_DIM, 1.0f);
            TU_OK(kvt_step_append(st, l, k, v, KVT_DTYPE_F32, 0));
            fx_sync(&f, st, l);
            fx_append(&f, l, k, v);
            TU_OK(kvt_step_select(st, l, q));
            TU_OK(kvt_step_decode(st, l, q, out, lse));
            fx_sync(&f, st, l);
            reranked += fx_select(&f, st, l, q, f.pol);
            fx_decode(&f, st, l, out, lse);
        }
        TU_OK(kvt_step_finish(st));
        TU_CHECK(f.p);
    }
    /* The loop exercised what it claims to: reranks, promotions, recycling. */
    kvt_stats s = {.struct_size = sizeof s};
    TU_OK(kvt_pool_stats_get(f.p, &s));
    printf("# %u reranked heads compared, %llu promoted, %llu recycled, %llu evicted pages\n",
           reranked, (unsigned long long)s.promoted_pages, (unsigned long long)s.recycled_blocks,
           (unsigned long long)s.evicted_pages);
    assert_true(reranked > STEPS);
    assert_true(s.promoted_pages > 0);
    assert_true(s.recycled_blocks > 0);
    free(k);
    free(v);
    free(q);
    free(out);
    free(lse);
    fx_close(&f);
}

int main(void)
{
    GPU_SKIP_WITHOUT_DEVICE();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiered_loop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
