/* Helpers of the tiered-placement tests (test_place, test_place_faults): a
 * tiered pool (a policy and a selector in the pool options) over tiertest.h's
 * geometry with two query heads per KV head, sequences whose K/V the test
 * keeps (f16 bit patterns, the reference), and one decode step driven through
 * kvt_step_plan / kvt_append / kvt_rerank_recycle / kvt_sparse_decode /
 * kvt_step_finish with every per-layer result checked against independent
 * references:
 *   - the output against a double-precision attention over exactly the pages
 *     kvt_step_selection reports, from the kept K/V;
 *   - a rescored selection against the MINMAX/SUM scores recomputed in
 *     double from kvt_seq_page_meta, a reused one against the head's last
 *     top-K set plus today's forced pages;
 *   - the device tier against the placement rules (block tables and
 *     residency before and after the rerank): selected pages are on device
 *     after the decode, evicted pages were neither selected nor forced and
 *     have another copy, promoted pages take evicted pages' blocks, and -
 *     when every move had finished before the plan - exactly the
 *     highest-scoring evictable pages stay (lookahead eviction);
 *   - the placement counters of kvt_stats against what the tables show;
 *   - kvt_step_dirty against the device tables snapshotted at the plan.
 * The pool passes kvt_pool_check after every step. */
#ifndef KVT_PLACETEST_H
#define KVT_PLACETEST_H

#include "tiertest.h"

#define HQ (2 * H) /* query heads: GQA groups of two */
#define G (HQ / H)
#define NLH (L * H) /* (layer, kv head) pairs, index layer * H + head */
#define MAXS 6
#define MAXPG (MAXTOK / P)

/* ---- values ------------------------------------------------------------------ */

/* A random f16 of moderate magnitude (2^-6 .. 4, either sign), so that the
 * attention reference's tolerance stays meaningful. */
static inline uint16_t f16_moderate(tu_rng *r)
{
    uint16_t e = (uint16_t)(9 + tu_below(r, 8)), m = (uint16_t)tu_below(r, 1024);
    return (uint16_t)((tu_below(r, 2) << 15) | (e << 10) | m);
}

/* The f16 encoding of x, which must be exactly representable (a normal
 * number or zero); checked against testutil's value table. */
static inline uint16_t f16_exact(double x)
{
    if (x == 0)
        return 0;
    uint16_t sign = x < 0 ? 0x8000 : 0;
    int e;
    double m = frexp(fabs(x), &e); /* |x| = m * 2^e, m in [0.5, 1) */
    int E = e - 1 + 15;
    double f = (2 * m - 1) * 1024;
    assert_true(E >= 1 && E <= 30 && f == floor(f));
    uint16_t h = (uint16_t)(sign | (E << 10) | (uint16_t)f);
    assert_true(tu_f16_value(h) == x);
    return h;
}

static inline uint32_t pages_of(uint32_t T)
{
    return (T + P - 1) / P;
}

/* ---- the fixture ---------------------------------------------------------------- */

/* Per-head policy values, [layer * H + head]. */
typedef struct {
    uint32_t cls[NLH], k[NLH], w[NLH], sink[NLH], local[NLH], iv[NLH];
} pheads;

/* Every head stable with these values; unstable heads (set afterwards)
 * take interval 1. */
static inline pheads ph_uniform(uint32_t k, uint32_t w, uint32_t sink, uint32_t local,
                                uint32_t iv)
{
    pheads ph;
    for (uint32_t b = 0; b < NLH; b++) {
        ph.cls[b] = KVT_HEAD_STABLE;
        ph.k[b] = k;
        ph.w[b] = w;
        ph.sink[b] = sink;
        ph.local[b] = local;
        ph.iv[b] = iv;
    }
    return ph;
}

static inline void ph_unstable(pheads *ph, uint32_t layer, uint32_t head)
{
    ph->cls[layer * H + head] = KVT_HEAD_UNSTABLE;
    ph->iv[layer * H + head] = 1;
}

typedef struct {
    kvt_pool *p;
    kvt_mover *m;
    kvt_policy *pol;
    kvt_selector *sel;
    kvt_geometry g;
    kvt_mover_opts mo;
    pheads ph;
    bool disk;
    uint32_t ns;
    tseq t[MAXS];
    tu_rng r;
    /* The last top-K set (selection minus forced pages) of every head. */
    uint32_t topk[MAXS][NLH][MAXPG], ntopk[MAXS][NLH];
    /* Designed keys (design_key): page pg of a designed sequence has, in
     * every token, key dim 0 = s[..][pg], dim 1 + pg = 1, the rest 0. */
    bool designed[MAXS];
    double s[MAXS][NLH][MAXPG];
    /* Warm-up copies of the sequence may still be in flight (set by the
     * test after kvt_seq_warmup; cleared once the test knows they landed:
     * it waited for every move, or kvt_step_ready said 1, or a step ran). */
    bool warm_pending[MAXS];
    /* offloaded_pages of sequences already released. */
    uint64_t off_base;
} pfx;

static inline kvt_geometry pgeom(void)
{
    return (kvt_geometry){L, H, HQ, D, P, KVT_DTYPE_F16, {0, 0}};
}

/* A policy from per-head values and a MINMAX/SUM selector. */
static inline kvt_policy *policy_of(const pheads *ph)
{
    kvt_geometry g = pgeom();
    kvt_policy_heads hd = {sizeof hd, NLH, ph->cls, ph->k, ph->w, ph->sink, ph->local, ph->iv};
    kvt_policy *pol;
    TU_OK(kvt_policy_create_heads(&pol, &g, NULL, &hd));
    return pol;
}

static inline kvt_selector *selector_of(void)
{
    kvt_geometry g = pgeom();
    kvt_selector_opts so = KVT_SELECTOR_OPTS_INIT; /* MINMAX, SUM */
    kvt_selector *sel;
    TU_OK(kvt_selector_create(&sel, &g, &so));
    return sel;
}

/* Pool options of a tiered pool (device and host in blocks; disk_bytes 0 =
 * no disk tier). One page per disk request, so fault counts name pages. */
static inline kvt_pool_opts pfx_opts(pfx *f, uint64_t dev, uint64_t host, uint64_t disk_bytes)
{
    TU_OK(kvt_mover_opts_init(&f->mo));
    f->mo.extent_pages = 4;
    f->mo.segment_extents = 2;
    f->mo.max_io_bytes = 8192;
    kvt_pool_opts o = tu_opts(L, H, HQ, D, P, KVT_DTYPE_F16, dev, host);
    o.policy = f->pol;
    o.selector = f->sel;
    o.n_threads = 2;
    o.mover = &f->mo;
    if (disk_bytes) {
        o.disk_dir = g_dir;
        o.disk_bytes = disk_bytes;
    }
    return o;
}

static inline pfx *pfx_new(const pheads *ph, uint64_t seed)
{
    pfx *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->ph = *ph;
    f->g = pgeom();
    f->pol = policy_of(ph);
    f->sel = selector_of();
    f->r = (tu_rng){seed};
    return f;
}

static inline pfx *pfx_open(const pheads *ph, uint64_t dev, uint64_t host, uint64_t disk_bytes,
                            uint64_t seed)
{
    pfx *f = pfx_new(ph, seed);
    kvt_pool_opts o = pfx_opts(f, dev, host, disk_bytes);
    TU_OK(kvt_pool_create(&f->p, &o));
    f->m = mover_of(f->p);
    f->disk = disk_bytes != 0;
    return f;
}

static inline void pfx_close(pfx *f)
{
    if (f->p)
        TU_CHECK(f->p);
    kvt_pool_destroy(f->p);
    for (uint32_t i = 0; i < f->ns; i++)
        tseq_free(&f->t[i]);
    kvt_policy_destroy(f->pol);
    kvt_selector_destroy(f->sel);
    free(f);
}

static inline bool is_stable(const pfx *f, uint32_t lh)
{
    return f->ph.cls[lh] == KVT_HEAD_STABLE;
}

/* Waits for every move; the code the wait returns must be 0 unless a fault
 * was injected. */
static inline int wait_all(pfx *f)
{
    return kvt_mover_wait(f->m, KVT_FENCE_ALL, UINT64_MAX);
}

static inline kvt_stats pstats(const kvt_pool *p)
{
    kvt_stats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    TU_OK(kvt_pool_stats(p, &s));
    return s;
}

/* Key of token tok, (layer, head) lh, dim d of a designed sequence. */
static inline uint16_t design_key(const pfx *f, uint32_t i, uint32_t lh, uint32_t tok, uint32_t d)
{
    const uint32_t pg = tok / P;
    if (d == 0)
        return f16_exact(f->s[i][lh][pg]);
    return d == 1 + pg % (D - 1) ? 0x3c00 /* 1.0 */ : 0;
}

/* Appends n tokens to every layer of sequence i through kvt_seq_append (the
 * prefill): designed keys when the sequence is designed, else random. */
static inline void pfx_prefill(pfx *f, uint32_t i, uint32_t n)
{
    tseq *t = &f->t[i];
    assert_true(t->n + n <= MAXTOK);
    for (uint32_t l = 0; l < L; l++) {
        uint16_t *k = t->k[l] + (size_t)t->n * H * D, *v = t->v[l] + (size_t)t->n * H * D;
        for (uint32_t tk = 0; tk < n; tk++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++) {
                    size_t e = ((size_t)tk * H + h) * D + d;
                    k[e] = f->designed[i] ? design_key(f, i, l * H + h, t->n + tk, d)
                                          : f16_moderate(&f->r);
                    v[e] = f16_moderate(&f->r);
                }
        TU_OK(kvt_seq_append(f->p, t->id, l, k, v, n, KVT_DTYPE_F16, 0));
    }
    t->n += n;
}

/* A new sequence with n prefilled tokens. Designed: page pg of head lh gets
 * score weight s = (perm(pg) + 1) / 128 + lh / 512 (distinct over the
 * sequence, exact in f16); flat: every page the same weight 1/4 (ties
 * everywhere). */
#define KEYS_RANDOM 0
#define KEYS_DESIGNED 1
#define KEYS_FLAT 2
static inline uint32_t pfx_add(pfx *f, uint32_t n, int keys)
{
    const bool designed = keys != KEYS_RANDOM;
    assert_true(f->ns < MAXS);
    const uint32_t i = f->ns++;
    tseq_init(&f->t[i]);
    TU_OK(kvt_seq_create(f->p, NULL, &f->t[i].id));
    f->designed[i] = designed;
    f->warm_pending[i] = false;
    memset(f->ntopk[i], 0, sizeof f->ntopk[i]);
    if (designed) {
        const uint32_t np = pages_of(n);
        assert_true(np < 128 && np < D - 1);
        for (uint32_t lh = 0; lh < NLH; lh++) {
            uint32_t perm[128];
            for (uint32_t j = 0; j < np; j++)
                perm[j] = j;
            for (uint32_t j = np; j > 1; j--) {
                uint32_t x = tu_below(&f->r, j), tmp = perm[j - 1];
                perm[j - 1] = perm[x];
                perm[x] = tmp;
            }
            for (uint32_t j = 0; j < np; j++)
                f->s[i][lh][j] = keys == KEYS_FLAT ? 0.25 : (perm[j] + 1) / 128.0 + lh / 512.0;
        }
    }
    pfx_prefill(f, i, n);
    return i;
}

/* Releases sequence i; the later ones move down one index. */
static inline void pfx_release(pfx *f, uint32_t i)
{
    TU_OK(kvt_seq_release(f->p, f->t[i].id));
    tseq_free(&f->t[i]);
    for (uint32_t j = i; j + 1 < f->ns; j++) {
        f->t[j] = f->t[j + 1];
        f->designed[j] = f->designed[j + 1];
        f->warm_pending[j] = f->warm_pending[j + 1];
        memcpy(f->topk[j], f->topk[j + 1], sizeof f->topk[j]);
        memcpy(f->ntopk[j], f->ntopk[j + 1], sizeof f->ntopk[j]);
        memcpy(f->s[j], f->s[j + 1], sizeof f->s[j]);
    }
    f->ns--;
}

/* Device blocks and residency of pages [0, np) of (seq i, layer, head). */
static inline void table(const pfx *f, uint32_t i, uint32_t l, uint32_t h, uint32_t np,
                         uint32_t *blk, uint8_t *res)
{
    if (np)
        TU_OK(kvt_seq_block_table(f->p, f->t[i].id, l, h, 0, np, blk, NULL, res));
}

static inline uint32_t seq_len(const pfx *f, uint32_t i, uint32_t l)
{
    uint32_t T;
    TU_OK(kvt_seq_length(f->p, f->t[i].id, l, &T));
    return T;
}

/* ---- references ------------------------------------------------------------------- */

/* Marks the forced pages of a head with T tokens: sink, local, partial last. */
static inline void forced_pages(uint8_t *forced, uint32_t T, uint32_t sink, uint32_t local)
{
    tu_forced_pages(forced, T, P, sink, local);
}

/* Reference MINMAX/SUM scores of pages [0, np) for the G queries q[G][D], in
 * double from the page metadata, with a per-page rounding allowance. */
static inline void ref_scores(const pfx *f, uint32_t i, uint32_t l, uint32_t h, uint32_t np,
                              const float *q, double *ref, double *tol)
{
    float mn[D], mx[D];
    for (uint32_t pg = 0; pg < np; pg++) {
        TU_OK(kvt_seq_page_meta(f->p, f->t[i].id, l, h, pg, mn, mx, NULL));
        double sum = 0, mag = 0;
        for (uint32_t g = 0; g < G; g++)
            for (uint32_t d = 0; d < D; d++) {
                double qd = q[(size_t)g * D + d];
                double t = qd * mn[d] > qd * mx[d] ? qd * mn[d] : qd * mx[d];
                sum += t;
                mag += fabs(t);
            }
        ref[pg] = sum;
        if (tol)
            tol[pg] = 1e-4 * fabs(sum) + 1e-5 * mag;
    }
}

/* Marks in `chosen` the n non-forced pages of highest score (ties: lower
 * page index first). */
static inline void top_n(const double *score, const uint8_t *forced, uint32_t np, uint32_t n,
                         uint8_t *chosen)
{
    memset(chosen, 0, np ? np : 1);
    for (uint32_t c = 0; c < n; c++) {
        int best = -1;
        for (uint32_t pg = 0; pg < np; pg++)
            if (!forced[pg] && !chosen[pg] && (best < 0 || score[pg] > score[best]))
                best = (int)pg;
        if (best < 0)
            break;
        chosen[best] = 1;
    }
}


/* Double-precision attention of q[G][D] over the tokens of `pages` of
 * (seq i, layer, head) with T tokens, from the kept K/V: out[G][D], lse[G],
 * the score magnitude kappa[G] and max |v| (test_step.c's reference). */
static inline void ref_attn(const pfx *f, uint32_t i, uint32_t l, uint32_t h, uint32_t T,
                            const uint32_t *pages, uint32_t np, const float *q, double *out,
                            double *lse, double *kappa, double *vmax)
{
    const tseq *t = &f->t[i];
    const double scale = 1.0 / sqrt((double)D);
    double *kd = malloc(((size_t)np * P * D + 1) * sizeof *kd);
    double *vd = malloc(((size_t)np * P * D + 1) * sizeof *vd);
    uint32_t n = 0;
    for (uint32_t j = 0; j < np; j++) {
        assert_true(pages[j] * P < T);
        const uint32_t t0 = pages[j] * P, cnt = T - t0 < P ? T - t0 : P;
        for (uint32_t tk = t0; tk < t0 + cnt; tk++, n++)
            for (uint32_t d = 0; d < D; d++) {
                size_t e = ((size_t)tk * H + h) * D + d;
                kd[(size_t)n * D + d] = tu_f16_value(t->k[l][e]);
                vd[(size_t)n * D + d] = tu_f16_value(t->v[l][e]);
            }
    }
    tu_ref_attention(q, G, D, kd, vd, n, scale, out, lse, kappa, vmax);
    free(kd);
    free(vd);
}

/* The library's out[G][D] / lse[G] against the reference (tolerance as in
 * test_step.c / test_decode.c). */
static inline void check_rows(const float *out, const float *lse, const double *ref,
                              const double *ref_lse, const double *kappa, double vmax,
                              const char *what)
{
    for (uint32_t g = 0; g < G; g++) {
        const float *o = out + (size_t)g * D;
        const double *rf = ref + (size_t)g * D;
        double err = 0, norm = 0;
        for (uint32_t d = 0; d < D; d++) {
            double e = fabs((double)o[d] - rf[d]);
            if (!(e <= err))
                err = e;
            norm = fabs(rf[d]) > norm ? fabs(rf[d]) : norm;
        }
        const double serr = 8.0 * 0x1p-24 * sqrt((double)D) * kappa[g];
        const double tol = 1e-4 * (norm > 1e-2 ? norm : 1e-2) + serr * vmax;
        if (!(err <= tol))
            fail_msg("%s q head %u: max |out - ref| %.3g, max |ref| %.3g, tolerance %.3g", what,
                     g, err, norm, tol);
        if (!(fabs((double)lse[g] - ref_lse[g]) <= 1e-5 * (1 + fabs(ref_lse[g])) + serr))
            fail_msg("%s q head %u: lse %.9g, reference %.9g", what, g, (double)lse[g],
                     ref_lse[g]);
    }
}

/* ---- one decode step ------------------------------------------------------------------ */

typedef struct {
    bool wait_before;     /* wait for every move before the plan: the
                             lookahead eviction model is checked exactly */
    bool wait_after_plan; /* wait for every move after the plan: every
                             sequence must then be ready */
    bool wait_after_rerank; /* ... and after each rerank: no decode pauses */
    bool exact_stats;     /* no warm-up copy can land behind the test's back:
                             the placement counters are checked exactly */
    bool faulty;          /* a fault is armed: a decode may fail */
    /* The queries of `layer`, [ns][HQ][D]; NULL = random in [-2, 2). */
    void (*make_q)(pfx *f, uint32_t layer, float *q);
    /* Called after the plan, before each layer's kvt_rerank_recycle, and
     * before kvt_step_finish. */
    void (*after_plan)(pfx *f, kvt_step *st);
    void (*before_rerank)(pfx *f, uint32_t layer);
    void (*before_finish)(pfx *f);
} step_args;

typedef struct {
    int rc[L];                      /* kvt_sparse_decode's code */
    uint32_t failed[L];             /* bit i: sequence i came back zeroed */
    uint8_t fail_head[MAXS][NLH];   /* selected pages missing after a failed decode */
    uint8_t reranked[MAXS][NLH];
    uint32_t evicted, promoted, recycled, not_ready;
    uint32_t dirty_heads, clean_heads; /* heads whose device table changed / did not */
} step_res;

/* The G queries of (sequence i, kv head h) in q[ns][HQ][D]. */
static inline const float *q_of(const float *q, uint32_t i, uint32_t h)
{
    return q + ((size_t)i * HQ + (size_t)h * G) * D;
}

static inline void pfx_step(pfx *f, const step_args *a, step_res *res)
{
    static uint32_t plan_blk[MAXS][NLH][MAXPG], plan_np[MAXS][NLH];
    static uint32_t blk_b[MAXS][H][MAXPG], blk_a[MAXS][H][MAXPG];
    static uint8_t res_b[MAXS][H][MAXPG], res_a[MAXS][H][MAXPG];
    static uint32_t sel[MAXS][H][MAXPG], nsel[MAXS][H];
    static double sc[MAXS][H][MAXPG], tl[MAXS][H][MAXPG];
    static float q[MAXS * HQ * D], out[MAXS * HQ * D], lse[MAXS * HQ];
    static uint16_t kn[MAXS * H * D], vn[MAXS * H * D];
    const uint32_t ns = f->ns;
    kvt_seq_id ids[MAXS];
    memset(res, 0, sizeof *res);
    for (uint32_t i = 0; i < ns; i++)
        ids[i] = f->t[i].id;
    if (a->wait_before) {
        TU_OK(wait_all(f));
        memset(f->warm_pending, 0, sizeof f->warm_pending);
    }

    kvt_step_opts so = KVT_STEP_OPTS_INIT; /* the pool's selector and policy */
    kvt_step *st;
    TU_OK(kvt_step_plan(f->p, ids, ns, &so, &st));
    for (uint32_t i = 0; i < ns; i++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t h = 0; h < H; h++) {
                plan_np[i][l * H + h] = pages_of(seq_len(f, i, l));
                table(f, i, l, h, plan_np[i][l * H + h], plan_blk[i][l * H + h], NULL);
            }
    if (a->after_plan)
        a->after_plan(f, st);
    if (a->wait_after_plan) {
        TU_OK(wait_all(f));
        memset(f->warm_pending, 0, sizeof f->warm_pending);
        for (uint32_t i = 0; i < ns; i++) {
            uint32_t ready = 9;
            TU_OK(kvt_step_ready(st, i, &ready));
            if (ready != 1)
                fail_msg("seq %u not ready after every move was waited for", i);
        }
    }

    for (uint32_t l = 0; l < L; l++) {
        /* One new token per sequence, kept as the reference. */
        for (uint32_t i = 0; i < ns; i++)
            for (uint32_t e = 0; e < H * D; e++) {
                kn[i * H * D + e] = f16_moderate(&f->r);
                vn[i * H * D + e] = f16_moderate(&f->r);
                f->t[i].k[l][(size_t)f->t[i].n * H * D + e] = kn[i * H * D + e];
                f->t[i].v[l][(size_t)f->t[i].n * H * D + e] = vn[i * H * D + e];
            }
        TU_OK(kvt_append(st, l, kn, vn, KVT_DTYPE_F16, 0));
        if (a->make_q)
            a->make_q(f, l, q);
        else
            for (uint32_t e = 0; e < ns * HQ * D; e++)
                q[e] = 2.0f * tu_unit(&f->r);
        /* The device tier before the rerank, and the reference scores. */
        for (uint32_t i = 0; i < ns; i++)
            for (uint32_t h = 0; h < H; h++) {
                const uint32_t T = seq_len(f, i, l), np = pages_of(T);
                assert_int_equal(T, f->t[i].n + 1);
                table(f, i, l, h, np, blk_b[i][h], res_b[i][h]);
                ref_scores(f, i, l, h, np, q_of(q, i, h), sc[i][h], tl[i][h]);
            }
        const kvt_stats sa = pstats(f->p);
        if (a->before_rerank)
            a->before_rerank(f, l);
        TU_OK(kvt_rerank_recycle(st, l, q));
        for (uint32_t i = 0; i < ns; i++)
            for (uint32_t h = 0; h < H; h++) {
                uint32_t rr = 9;
                TU_OK(kvt_step_selection(st, l, i, h, sel[i][h], MAXPG, &nsel[i][h], &rr));
                assert_true(rr <= 1);
                res->reranked[i][l * H + h] = (uint8_t)rr;
            }
        /* Ready: nothing of the layer is still on its way, so every selected
         * page must be on device already. A sequence that is ready now and
         * had no warm-up copy in flight at the rerank never has to wait:
         * may_pause bounds paused_seqs. (A sequence whose warm-up copies
         * were in flight may wait for them in the rerank and again in the
         * decode; the library counts both.) */
        uint32_t not_ready = 0, may_pause = 0;
        for (uint32_t i = 0; i < ns && !a->faulty; i++) {
            uint32_t ready = 9;
            TU_OK(kvt_step_ready(st, i, &ready));
            assert_true(ready <= 1);
            not_ready += !ready;
            may_pause += !ready + f->warm_pending[i];
            if (a->wait_after_rerank && !ready) {
                TU_OK(wait_all(f));
                TU_OK(kvt_step_ready(st, i, &ready));
                if (ready != 1)
                    fail_msg("layer %u seq %u not ready after every move was waited for", l, i);
                not_ready--;
                may_pause--;
            }
            for (uint32_t h = 0; ready && h < H; h++) {
                uint8_t rs[MAXPG];
                table(f, i, l, h, pages_of(f->t[i].n + 1), NULL, rs);
                for (uint32_t j = 0; j < nsel[i][h]; j++)
                    if (!(rs[sel[i][h][j]] & KVT_RES_DEVICE))
                        fail_msg("layer %u seq %u head %u: ready, but selected page %u is "
                                 "not on device (residency %#x)", l, i, h, sel[i][h][j],
                                 rs[sel[i][h][j]]);
            }
        }
        res->not_ready += not_ready;
        for (size_t e = 0; e < (size_t)ns * HQ * D; e++)
            out[e] = NAN;
        const int rc = kvt_sparse_decode(st, l, q, out, lse);
        res->rc[l] = rc;
        if (rc && !(a->faulty && (rc == KVT_EIO || rc == KVT_ECORRUPT)))
            fail_msg("layer %u: kvt_sparse_decode returned %d (%s): %s", l, rc,
                     kvt_err_name(rc), kvt_last_error());
        const kvt_stats sb = pstats(f->p);

        /* Failed sequences: every row zero, lse -infinity. */
        for (uint32_t i = 0; i < ns; i++) {
            bool inf = true;
            for (uint32_t j = 0; j < HQ; j++)
                inf &= isinf(lse[i * HQ + j]) && lse[i * HQ + j] < 0;
            if (!inf)
                continue;
            if (!rc)
                fail_msg("layer %u seq %u: lse -inf but the decode succeeded", l, i);
            res->failed[l] |= 1u << i;
            for (size_t e = 0; e < (size_t)HQ * D; e++)
                if (out[(size_t)i * HQ * D + e] != 0.0f)
                    fail_msg("layer %u seq %u failed: out[%zu] = %g, not 0", l, i, e,
                             (double)out[(size_t)i * HQ * D + e]);
        }
        if (rc && !res->failed[l])
            fail_msg("layer %u: decode returned %s but no sequence came back zeroed", l,
                     kvt_err_name(rc));

        uint64_t want_sel = 0, want_res = 0, want_rr = 0;
        uint32_t ev_sum = 0, pr_sum = 0, rc_sum = 0;
        for (uint32_t i = 0; i < ns; i++)
            for (uint32_t h = 0; h < H; h++) {
                const uint32_t lh = l * H + h, T = f->t[i].n + 1, np = pages_of(T);
                const uint32_t K = f->ph.k[lh], W = f->ph.w[lh];
                const uint32_t *sp = sel[i][h], n = nsel[i][h];
                const bool stable = is_stable(f, lh), failed = (res->failed[l] >> i) & 1;
                const bool rr = res->reranked[i][lh];
                char what[128];
                snprintf(what, sizeof what, "layer %u seq %u head %u (%s, T %u, %s)", l, i, h,
                         stable ? "stable" : "unstable", T, rr ? "rescored" : "reused");
                uint8_t forced[MAXPG], in[MAXPG] = {0};
                forced_pages(forced, T, f->ph.sink[lh], f->ph.local[lh]);
                for (uint32_t j = 0; j < n; j++)
                    in[sp[j]] = 1;
                table(f, i, l, h, np, blk_a[i][h], res_a[i][h]);
                const uint8_t *rb = res_b[i][h], *ra = res_a[i][h];

                /* The selection. */
                if (rr) {
                    tu_check_selection(sp, n, T, P, K, f->ph.sink[lh], f->ph.local[lh], sc[i][h],
                                   tl[i][h], what);
                    f->ntopk[i][lh] = 0;
                    for (uint32_t j = 0; j < n; j++)
                        if (!forced[sp[j]])
                            f->topk[i][lh][f->ntopk[i][lh]++] = sp[j];
                } else {
                    if (!stable)
                        fail_msg("%s: an unstable head must rerank every step", what);
                    uint8_t want[MAXPG];
                    memcpy(want, forced, np);
                    for (uint32_t j = 0; j < f->ntopk[i][lh]; j++)
                        want[f->topk[i][lh][j]] = 1;
                    uint32_t nw = 0;
                    for (uint32_t pg = 0; pg < np; pg++)
                        if (want[pg]) {
                            if (nw >= n || sp[nw] != pg)
                                fail_msg("%s: page %u (last top-K or forced) expected at "
                                         "entry %u", what, pg, nw);
                            nw++;
                        }
                    if (n != nw)
                        fail_msg("%s: %u pages selected, expected %u", what, n, nw);
                }
                want_rr += rr;

                /* After the decode every selected page is on device, and the
                 * output is attention over exactly those pages. */
                if (failed) {
                    for (uint32_t j = 0; j < n; j++)
                        if (!(ra[sp[j]] & KVT_RES_DEVICE))
                            res->fail_head[i][lh] = 1;
                } else {
                    for (uint32_t j = 0; j < n; j++)
                        if (!(ra[sp[j]] & KVT_RES_DEVICE))
                            fail_msg("%s: selected page %u not on device after the decode "
                                     "(residency %#x)", what, sp[j], ra[sp[j]]);
                    double ref[G * D], rl[G], kap[G], vmax;
                    ref_attn(f, i, l, h, T, sp, n, q_of(q, i, h), ref, rl, kap, &vmax);
                    const size_t ob = (size_t)i * HQ + (size_t)h * G;
                    check_rows(out + ob * D, lse + ob, ref, rl, kap, vmax, what);
                }

                /* Placement. */
                if (!stable) {
                    for (uint32_t pg = 0; pg < np; pg++)
                        if (ra[pg] != KVT_RES_DEVICE)
                            fail_msg("%s: page %u residency %#x, an unstable head keeps "
                                     "every page on device only", what, pg, ra[pg]);
                    continue;
                }
                uint32_t ev = 0, pr = 0, reused = 0, dev_nf = 0;
                for (uint32_t pg = 0; pg < np; pg++) {
                    const bool was = rb[pg] & KVT_RES_DEVICE, is = ra[pg] & KVT_RES_DEVICE;
                    dev_nf += is && !forced[pg];
                    if (in[pg]) {
                        want_sel++;
                        want_res += was;
                        pr += !was;
                    }
                    if (was && !is) {
                        ev++;
                        if (in[pg] || forced[pg])
                            fail_msg("%s: page %u evicted but %s", what, pg,
                                     in[pg] ? "selected" : "forced");
                        if (!(rb[pg] & (KVT_RES_HOST | KVT_RES_DISK)))
                            fail_msg("%s: page %u evicted without a copy elsewhere "
                                     "(residency before %#x)", what, pg, rb[pg]);
                    }
                    /* (A warm-up copy may land behind the test's back.) */
                    if (!was && is && !in[pg] && a->exact_stats)
                        fail_msg("%s: page %u came to the device unselected", what, pg);
                }
                if (!rr && (ev || pr) && a->exact_stats)
                    fail_msg("%s: not due, yet %u evicted, %u promoted", what, ev, pr);
                /* Recycling: promoted pages take the evicted pages' blocks. */
                for (uint32_t pg = 0; pg < np && !failed && a->exact_stats; pg++) {
                    if (!in[pg] || (rb[pg] & KVT_RES_DEVICE))
                        continue;
                    for (uint32_t e = 0; e < np; e++)
                        if ((rb[e] & KVT_RES_DEVICE) && !(ra[e] & KVT_RES_DEVICE) &&
                            blk_b[i][h][e] == blk_a[i][h][pg]) {
                            reused++;
                            break;
                        }
                }
                if (!failed && a->exact_stats && reused != (ev < pr ? ev : pr))
                    fail_msg("%s: %u evicted, %u promoted, but %u promoted pages took an "
                             "evicted page's block", what, ev, pr, reused);
                ev_sum += ev;
                pr_sum += pr;
                rc_sum += ev < pr ? ev : pr;

                /* Lookahead eviction, exact when nothing was in flight at the
                 * rerank and every unforced device page had another copy. */
                if (a->wait_before && rr && !failed) {
                    uint32_t n_snf = 0, n_e = 0, n_ne = 0, kept = 0;
                    double lo = INFINITY, hi = -INFINITY;
                    for (uint32_t pg = 0; pg < np; pg++) {
                        if (forced[pg])
                            continue;
                        if (in[pg]) {
                            n_snf++;
                        } else if (rb[pg] & KVT_RES_DEVICE) {
                            if (!(rb[pg] & (KVT_RES_HOST | KVT_RES_DISK))) {
                                n_ne++;
                                continue;
                            }
                            n_e++;
                            const double s = sc[i][h][pg], t = tl[i][h][pg];
                            if (ra[pg] & KVT_RES_DEVICE) {
                                kept++;
                                lo = s + t < lo ? s + t : lo;
                            } else {
                                hi = s - t > hi ? s - t : hi;
                            }
                        }
                    }
                    if (!n_ne) {
                        const uint32_t room = K * W > n_snf ? K * W - n_snf : 0;
                        const uint32_t want_kept = n_e < room ? n_e : room;
                        if (kept != want_kept)
                            fail_msg("%s: %u evictable pages, %u kept on device, expected %u "
                                     "(K %u x window %u, %u selected)", what, n_e, kept,
                                     want_kept, K, W, n_snf);
                        if (lo < hi)
                            fail_msg("%s: an evicted page scored %.9g, above a kept one "
                                     "(%.9g)", what, hi, lo);
                        if (dev_nf > K * W)
                            fail_msg("%s: %u unforced pages on device, above K %u x "
                                     "window %u", what, dev_nf, K, W);
                    }
                }
            }
        res->evicted += ev_sum;
        res->promoted += pr_sum;
        res->recycled += rc_sum;

        /* The counters. */
        assert_true(sb.sel_pages >= sa.sel_pages && sb.sel_resident >= sa.sel_resident &&
                    sb.promoted_pages >= sa.promoted_pages && sb.paused_seqs >= sa.paused_seqs &&
                    sb.recycled_blocks >= sa.recycled_blocks &&
                    sb.evicted_pages >= sa.evicted_pages &&
                    sb.reranked_heads >= sa.reranked_heads);
        if (!a->faulty && sb.paused_seqs - sa.paused_seqs > may_pause)
            fail_msg("layer %u: paused_seqs grew by %llu, but only %u of %u sequences could "
                     "have waited (%u not ready after the rerank)", l,
                     (unsigned long long)(sb.paused_seqs - sa.paused_seqs), may_pause, ns,
                     not_ready);
        memset(f->warm_pending, 0, sizeof f->warm_pending); /* the step took them */
        if (a->exact_stats && !a->faulty) {
#define PT_DELTA(field, want)                                                              \
    do {                                                                                   \
        if (sb.field - sa.field != (uint64_t)(want))                                       \
            fail_msg("layer %u: kvt_stats." #field " grew by %llu, expected %llu", l,      \
                     (unsigned long long)(sb.field - sa.field), (unsigned long long)(want)); \
    } while (0)
            PT_DELTA(sel_pages, want_sel);
            PT_DELTA(sel_resident, want_res);
            PT_DELTA(promoted_pages, pr_sum);
            PT_DELTA(evicted_pages, ev_sum);
            PT_DELTA(recycled_blocks, rc_sum);
            PT_DELTA(reranked_heads, want_rr);
            PT_DELTA(moved_requests[KVT_DIR_HOST_TO_DEVICE], pr_sum);
#undef PT_DELTA
        }
    }

    /* Dirty ranges: every device entry that differs from the plan's lies in
     * the reported range; nothing changed = an empty range. */
    for (uint32_t i = 0; i < ns; i++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t h = 0; h < H; h++) {
                const uint32_t lh = l * H + h, np = pages_of(f->t[i].n + 1);
                uint32_t now[MAXPG], first = 7777, n = 7777;
                table(f, i, l, h, np, now, NULL);
                TU_OK(kvt_step_dirty(st, l, i, h, &first, &n));
                uint32_t changed = 0;
                for (uint32_t pg = 0; pg < np; pg++) {
                    const uint32_t was = pg < plan_np[i][lh] ? plan_blk[i][lh][pg] : 0;
                    if (now[pg] == was)
                        continue;
                    changed++;
                    if (pg < first || pg - first >= n)
                        fail_msg("layer %u seq %u head %u: entry %u changed (%u -> %u) outside "
                                 "the dirty range [%u, %u)", l, i, h, pg, was, now[pg], first,
                                 first + n);
                }
                if (changed) {
                    res->dirty_heads++;
                } else {
                    res->clean_heads++;
                    if (n != 0 && !a->faulty)
                        fail_msg("layer %u seq %u head %u: nothing changed, dirty range "
                                 "[%u, +%u)", l, i, h, first, n);
                }
            }
    if (a->before_finish)
        a->before_finish(f);
    TU_OK(kvt_step_finish(st));
    for (uint32_t i = 0; i < ns; i++)
        f->t[i].n++;
    TU_CHECK(f->p);
}

/* ---- placement at rest ------------------------------------------------------------ */

/* Pages with a device copy, over every live sequence: the device tier's
 * page count. */
static inline void check_device_count(const pfx *f)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t h = 0; h < H; h++) {
                uint8_t rs[MAXPG];
                const uint32_t np = pages_of(f->t[i].n);
                table(f, i, l, h, np, NULL, rs);
                for (uint32_t pg = 0; pg < np; pg++)
                    n += (rs[pg] & KVT_RES_DEVICE) != 0;
            }
    kvt_stats s = pstats(f->p);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].pages, n);
}

/* With every move finished: each full page of a stable head was offloaded
 * (its residency has every bit of `want`, or, with `any`, one of them),
 * unstable heads' pages are on device only, partial pages never left the
 * device, and offloaded_pages counts the stable full pages. Returns that
 * count. */
static inline uint64_t check_offloaded(const pfx *f, uint8_t want, bool any)
{
    uint64_t full = 0;
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t h = 0; h < H; h++) {
                const uint32_t lh = l * H + h, T = f->t[i].n, np = pages_of(T);
                uint8_t rs[MAXPG];
                table(f, i, l, h, np, NULL, rs);
                for (uint32_t pg = 0; pg < np; pg++) {
                    if (!is_stable(f, lh)) {
                        if (rs[pg] != KVT_RES_DEVICE)
                            fail_msg("seq %u layer %u head %u (unstable) page %u: residency "
                                     "%#x", i, l, h, pg, rs[pg]);
                    } else if ((pg + 1) * P <= T) {
                        full++;
                        if (any ? !(rs[pg] & want) : (rs[pg] & want) != want)
                            fail_msg("seq %u layer %u head %u page %u (full, stable): residency "
                                     "%#x, expected %#x in it", i, l, h, pg, rs[pg], want);
                    } else if (rs[pg] != KVT_RES_DEVICE) {
                        fail_msg("seq %u layer %u head %u page %u (partial): residency %#x", i,
                                 l, h, pg, rs[pg]);
                    }
                }
            }
    kvt_stats s = pstats(f->p);
    if (s.offloaded_pages - f->off_base != full)
        fail_msg("offloaded_pages %llu (%llu before of released sequences), but %llu full "
                 "pages of stable heads", (unsigned long long)s.offloaded_pages,
                 (unsigned long long)f->off_base, (unsigned long long)full);
    check_device_count(f);
    return full;
}

/* Reads every sequence back and compares with the kept copy. */
static inline void verify_all(const pfx *f)
{
    for (uint32_t i = 0; i < f->ns; i++)
        tseq_verify(f->p, &f->t[i]);
}

#endif /* KVT_PLACETEST_H */
