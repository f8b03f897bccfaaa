/* Page scoring (kvt__cu_score) and the per-head selection rule (kvt__cu_topk),
 * cuda/select.cu.
 *
 * Scoring is compared with the CPU scorer: a CPU pool holds the same keys
 * (appended with kvt_seq_append, NaN keys and keys past f16's range
 * included, so boxes open to +-inf) and kvt_selector_select returns the voted score
 * of every page; the kernel reads the same metadata (kvt_seq_page_meta_get, laid
 * out here in shuffled device slots of a two-plane store - min and max rows,
 * then mean rows - whose unused bytes are NaN) for every method x vote, G from 1 to
 * 40 (register tiles of 8 heads, queries staged in shared memory or read
 * from global memory when they do not fit), D in {64, 128, 40, 512}, every
 * dtype, P in {16, 32, 8}, page counts including 0, 1 and partial last pages.
 * Non-finite CPU votes (+inf from opened boxes, -inf) must be matched
 * exactly. Finite votes differ only by f32 summation order: SUM within
 * 1e-5 of the sum over heads of the magnitude sum_d |q_d k_d| (the f32 dot
 * products' rounding bound for these D is below 1e-5 relative to it, with
 * room), MAX within 1e-5 of the largest head magnitude, SOFTVOTE within
 * sum_g p_g (2e-5 scale M_g + 1e-5) + 1e-9, where p_g is the page's
 * probability under head g (double reference) and M_g the head's largest
 * page magnitude: a softmax shifts by at most twice the largest score error
 * times p, plus expf and summation rounding. The GPU's selection over its
 * own votes is then checked with tu_check_selection at those tolerances.
 *
 * TOKEN and ORACLE (kvt__cu_score_ex) are compared with a double reference
 * computed here from the key encodings the test wrote (test_score_keys: every
 * dtype, G 1 to 40, D 8 to 256, P 8 to 64, partial last pages, pages with no
 * device block scored by their MINMAX bound, +ln(ntok)/c for ORACLE, every
 * vote, ORACLE always SOFTVOTE; an infinite key or a NaN query element gives
 * NaN scores, +inf votes); runs with a workspace and with a low max_pages
 * hint must give the same bits.
 *
 * Top-K is exact: the kernel's selection and top-k list are compared with a
 * brute force (sort every competitor by vote desc, index asc; NaN = +inf,
 * -0 = +0) and with the CPU's kvt__sel_pick, for random votes, heavy ties,
 * all-equal votes, NaN / +-inf / +-0 mixes, k = 0, k >= competitors, sink
 * and local covering everything, np = 0 and 1, tokens % P != 0, and page
 * counts from 0 to 70000 (the shared-memory key cache up to 8192 pages, the
 * global path above it, also with max_pages understated). Nothing past the
 * selection's count is written. Bad arguments name themselves. */
#include "gputest.h"
#include "testutil.h"
#include "internal.h"

#define PATTERN 0xa5a5a5a5u

static uint32_t pages_of(uint32_t T, uint32_t P)
{
    return (T + P - 1) / P;
}

/* ---- scoring --------------------------------------------------------------------- */

typedef struct {
    uint32_t G, D, P, H, S; /* heads per group, head_dim, page_tokens, KV heads, sequences */
    kvt_dtype dt;
    uint32_t max_full;      /* up to this many full pages per sequence */
    int nan_q;              /* one query element NaN */
    int neg;                /* every key -1e6 (f16: mean -inf, MEAN scores all -inf) and
                               positive queries */
} score_cfg;

/* Writes f (a value of the pool dtype, widened) as element i of dtype dt. */
static void put_dt(uint8_t *row, kvt_dtype dt, uint32_t i, float f)
{
    if (dt == KVT_DTYPE_F32)
        memcpy(row + 4u * i, &f, 4);
    else if (dt == KVT_DTYPE_F16)
        ((uint16_t *)row)[i] = kvt__f32_to_f16(f, KVT__RN); /* exact: f came from f16 */
    else
        ((uint16_t *)row)[i] = kvt__f32_to_bf16(f, KVT__RN);
}

static void run_score(const score_cfg *c, uint64_t seed)
{
    tu_rng r = {seed};
    const uint32_t G = c->G, D = c->D, P = c->P, H = c->H, S = c->S;
    const size_t pe = kvt_dtype_size(c->dt);
    uint32_t *T = calloc(S, sizeof *T), maxp = 0;
    uint64_t blocks = 4;
    for (uint32_t s = 0; s < S; s++) {
        const uint32_t full = tu_below(&r, c->max_full + 1);
        const uint32_t part = tu_below(&r, 2) ? tu_below(&r, P) : 0;
        T[s] = full * P + part;
        if (s == 1 && S > 2)
            T[s] = tu_below(&r, 2) ? 0 : 1 + tu_below(&r, P); /* np 0 or 1 */
        maxp = pages_of(T[s], P) > maxp ? pages_of(T[s], P) : maxp;
        blocks += (uint64_t)pages_of(T[s], P) * H;
    }
    kvt_pool_opts o = tu_opts(1, H, H * G, D, P, c->dt, blocks, 0);
    o.n_threads = 1;
    kvt_pool *pool;
    TU_OK(kvt_pool_create(&o, &pool));
    kvt_seq_id *ids = calloc(S, sizeof *ids);
    for (uint32_t s = 0; s < S; s++) {
        TU_OK(kvt_seq_create(pool, NULL, &ids[s]));
        if (!T[s])
            continue;
        const size_t n = (size_t)T[s] * H * D;
        float *k = malloc(n * 4), *v = malloc(n * 4);
        for (size_t i = 0; i < n; i++) {
            k[i] = c->neg ? -1e6f : 2.0f * tu_unit(&r);
            v[i] = tu_unit(&r);
        }
        /* A few pages with a NaN key (box opened to +-inf), with a key past
         * f16's range (bound +-inf in f16) or a -0 key. */
        for (uint32_t x = 0; !c->neg && x < 1 + T[s] / (4 * P); x++) {
            const size_t at = (size_t)tu_below(&r, T[s]) * H * D + tu_below(&r, H * D);
            const uint32_t what = tu_below(&r, 3);
            k[at] = what == 0 ? NAN : what == 1 ? (tu_below(&r, 2) ? 1e6f : -1e6f) : -0.0f;
        }
        TU_OK(kvt_seq_append(pool, ids[s], 0, k, v, T[s], KVT_DTYPE_F32, 0));
        free(k);
        free(v);
    }

    /* Metadata in shuffled device slots of the two-plane store (kvt_cuda.h):
     * slot m's min and max rows at m * 2 row, its mean row at nslot * 2 row +
     * m * row. Everything else is NaN (all-ones bits in every dtype), so a
     * read of the wrong plane or slot shows in the votes. */
    const uint64_t mb = 3ull * D * pe, row = (uint64_t)D * pe;
    const uint32_t nent = S * H * (maxp + 1), nslot = nent + 1;
    uint32_t *tab = malloc(nent * 4), *perm = malloc(nslot * 4);
    for (uint32_t i = 0; i < nslot; i++)
        perm[i] = i;
    for (uint32_t i = nslot - 1; i > 0; i--) {
        uint32_t j = tu_below(&r, i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (uint32_t i = 0; i < nent; i++)
        tab[i] = perm[i];
    uint8_t *meta = malloc((size_t)nslot * mb);
    memset(meta, 0xff, (size_t)nslot * mb);
    float *mn = malloc(D * 4), *mx = malloc(D * 4), *me = malloc(D * 4);
    /* Per (seq, head, page): f32 rows for the double reference. */
    float *rows = malloc((size_t)S * H * (maxp + 1) * 3 * D * 4);
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t pg = 0; pg < pages_of(T[s], P); pg++) {
                const size_t e = (size_t)(s * H + h) * (maxp + 1) + pg;
                TU_OK(kvt_seq_page_meta_get(pool, ids[s], 0, h, pg, mn, mx, me));
                uint8_t *m = meta + tab[e] * 2 * row;
                uint8_t *mmean = meta + (uint64_t)nslot * 2 * row + tab[e] * row;
                for (uint32_t d = 0; d < D; d++) {
                    put_dt(m, c->dt, d, mn[d]);
                    put_dt(m, c->dt, D + d, mx[d]);
                    put_dt(mmean, c->dt, d, me[d]);
                }
                memcpy(rows + e * 3 * D, mn, D * 4);
                memcpy(rows + e * 3 * D + D, mx, D * 4);
                memcpy(rows + e * 3 * D + 2 * D, me, D * 4);
            }
    uint8_t *d_meta;
    uint32_t *d_tab;
    TU_OK(kvt__cu_malloc((void **)&d_meta, nslot * mb));
    TU_OK(kvt__cu_malloc((void **)&d_tab, nent * 4));
    TU_OK(kvt__cu_memcpy(d_meta, meta, nslot * mb));
    TU_OK(kvt__cu_memcpy(d_tab, tab, nent * 4));

    /* Queries: one [G][D] block per (seq, head), some zeros and -0. */
    const size_t nq = (size_t)S * H * G * D;
    float *q = malloc(nq * 4);
    for (size_t i = 0; i < nq; i++) {
        const uint32_t w = tu_below(&r, 20);
        q[i] = w == 0 ? 0.0f : w == 1 ? -0.0f : tu_unit(&r);
        if (c->neg)
            q[i] = 0.5f + 0.5f * fabsf(tu_unit(&r));
    }
    if (c->nan_q)
        q[tu_below(&r, (uint32_t)nq)] = NAN;
    float *d_q, *d_vote;
    TU_OK(kvt__cu_malloc((void **)&d_q, nq * 4));
    TU_OK(kvt__cu_memcpy(d_q, q, nq * 4));
    const uint32_t ni = S * H, vstride = maxp + 3;
    TU_OK(kvt__cu_malloc((void **)&d_vote, (size_t)ni * vstride * 4));
    kvt__cu_score_item *items = malloc(ni * sizeof *items), *d_items;
    TU_OK(kvt__cu_malloc((void **)&d_items, ni * sizeof *items));
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t h = 0; h < H; h++) {
            kvt__cu_score_item *it = &items[s * H + h];
            it->q_off = (uint64_t)(s * H + h) * G * D;
            it->table_off = (uint64_t)(s * H + h) * (maxp + 1);
            it->vote_off = (uint64_t)(s * H + h) * vstride + 1;
            it->n_pages = pages_of(T[s], P);
            it->tokens = 0;
        }
    TU_OK(kvt__cu_memcpy(d_items, items, ni * sizeof *items));
    void *stream;
    TU_OK(kvt__cu_stream_create(&stream, 0));

    float *gv = malloc((size_t)ni * vstride * 4), *cv = malloc((maxp + 1) * 4);
    uint32_t *cpages = malloc((maxp + 1) * 4);
    double *raw = malloc((size_t)G * (maxp + 1) * 8), *mag = malloc((size_t)G * (maxp + 1) * 8);
    double *tol = malloc((maxp + 1) * 8), *ref = malloc((maxp + 1) * 8);
    const float def_scale = 1.0f / sqrtf((float)D);

    for (uint32_t method = 0; method <= KVT_SCORE_MEAN; method++)
        for (uint32_t vote = 0; vote <= KVT_VOTE_SOFTVOTE; vote++) {
            const float user_scale = vote == KVT_VOTE_SOFTVOTE && tu_below(&r, 2) ? 0.37f : 0.0f;
            const float scale = user_scale > 0.0f ? user_scale : def_scale;
            kvt_selector_opts so;
            kvt_selector_opts_init(&so);
            so.method = method;
            so.vote = vote;
            so.vote_scale = user_scale;
            so.top_k_pages = 1 + tu_below(&r, 6);
            so.sink_pages = tu_below(&r, 2);
            so.local_pages = tu_below(&r, 3);
            kvt_selector *sel;
            TU_OK(kvt_selector_create(&o.geom, &so, &sel));

            TU_OK(kvt__cu_memset(d_vote, 0xa5, (size_t)ni * vstride * 4));
            kvt__cu_score_args a = {0};
            a.d_items = d_items;
            a.n_items = ni;
            a.G = G;
            a.D = D;
            a.dtype = c->dt;
            a.method = method;
            a.vote = vote;
            a.vote_scale = scale;
            a.max_pages = (method + vote) % 2 ? maxp : maxp / 4; /* a low hint: blocks stride */
            a.d_q = d_q;
            a.d_meta_table = d_tab;
            a.d_meta_base = d_meta;
            a.meta_bytes = mb;
            a.meta_slots = nslot;
            a.d_vote = d_vote;
            assert_int_equal(kvt__cu_score_workspace_bytes(&a), 0);
            TU_OK(kvt__cu_score(&a, stream));
            TU_OK(kvt__cu_stream_sync(stream));
            TU_OK(kvt__cu_memcpy(gv, d_vote, (size_t)ni * vstride * 4));

            for (uint32_t s = 0; s < S; s++)
                for (uint32_t h = 0; h < H; h++) {
                    const uint32_t np = pages_of(T[s], P), it = s * H + h;
                    const float *g = gv + (size_t)it * vstride + 1;
                    /* Untouched around the item's votes. */
                    uint32_t pat;
                    memcpy(&pat, g - 1, 4);
                    assert_int_equal(pat, PATTERN);
                    memcpy(&pat, g + np, 4);
                    assert_int_equal(pat, PATTERN);
                    if (np == 0)
                        continue;
                    uint32_t n_sel;
                    TU_OK(kvt_selector_select(sel, pool, ids[s], 0, h, q + (size_t)it * G * D, cpages,
                                              maxp + 1, &n_sel, cv));
                    /* The double reference: raw scores and magnitudes. */
                    const float *qg = q + (size_t)it * G * D;
                    for (uint32_t j = 0; j < G; j++)
                        for (uint32_t pg = 0; pg < np; pg++) {
                            const float *m = rows + ((size_t)it * (maxp + 1) + pg) * 3 * D;
                            double sum = 0, am = 0;
                            for (uint32_t d = 0; d < D; d++) {
                                const double x = qg[(size_t)j * D + d];
                                double t;
                                if (method == KVT_SCORE_MINMAX)
                                    t = (x > 0 ? x : 0) * m[D + d] + (x < 0 ? x : 0) * m[d];
                                else
                                    t = x * m[2 * D + d];
                                sum += t;
                                am += fabs(t);
                            }
                            raw[(size_t)j * np + pg] = sum;
                            mag[(size_t)j * np + pg] = am;
                        }
                    for (uint32_t pg = 0; pg < np; pg++)
                        tol[pg] = 1e-30;
                    for (uint32_t j = 0; j < G; j++) {
                        const double *rj = raw + (size_t)j * np, *mj = mag + (size_t)j * np;
                        double mmax = 0, smax = -INFINITY, z = 0;
                        int special = 0; /* the head's vote is exact: +inf or 0 */
                        for (uint32_t pg = 0; pg < np; pg++) {
                            special |= isnan(rj[pg]) || rj[pg] == INFINITY;
                            if (isfinite(mj[pg]))
                                mmax = mj[pg] > mmax ? mj[pg] : mmax;
                            smax = scale * rj[pg] > smax ? scale * rj[pg] : smax;
                        }
                        special |= !isfinite(smax);
                        for (uint32_t pg = 0; pg < np && !special; pg++)
                            z += exp(scale * rj[pg] - smax);
                        for (uint32_t pg = 0; pg < np; pg++) {
                            if (vote == KVT_VOTE_SUM)
                                tol[pg] += 1e-5 * mj[pg];
                            else if (vote == KVT_VOTE_MAX)
                                tol[pg] = 1e-5 * mj[pg] > tol[pg] ? 1e-5 * mj[pg] : tol[pg];
                            else if (!special)
                                tol[pg] += exp(scale * rj[pg] - smax) / z *
                                           (2e-5 * scale * mmax + 1e-5);
                        }
                    }
                    if (vote == KVT_VOTE_SOFTVOTE)
                        for (uint32_t pg = 0; pg < np; pg++)
                            tol[pg] += 1e-9;
                    for (uint32_t pg = 0; pg < np; pg++) {
                        if (isnan(g[pg]))
                            fail_msg("%u/%u seq %u head %u page %u: NaN vote", method, vote, s,
                                     h, pg);
                        if (!isfinite(cv[pg]) || !isfinite(g[pg])) {
                            if (cv[pg] != g[pg])
                                fail_msg("method %u vote %u G %u seq %u head %u page %u: CPU "
                                         "%g, GPU %g", method, vote, G, s, h, pg,
                                         (double)cv[pg], (double)g[pg]);
                            continue;
                        }
                        if (!(fabs((double)g[pg] - (double)cv[pg]) <= tol[pg]))
                            fail_msg("method %u vote %u G %u D %u seq %u head %u page %u: "
                                     "CPU %.9g, GPU %.9g, tolerance %.3g", method, vote, G,
                                     D, s, h, pg, (double)cv[pg], (double)g[pg], tol[pg]);
                        ref[pg] = cv[pg];
                    }
                    for (uint32_t pg = 0; pg < np; pg++)
                        if (!isfinite(cv[pg])) {
                            ref[pg] = cv[pg];
                            tol[pg] = 0;
                        }

                    /* The GPU's selection over its own votes. */
                    uint32_t K, sink, local;
                    TU_OK(kvt_selector_budget_get(sel, 0, h, &K, &sink, &local));
                    kvt__cu_topk_item ti = {(uint64_t)it * vstride + 1, 0, np, T[s], K, sink,
                                            local, 0};
                    kvt__cu_topk_item *d_ti;
                    uint32_t *d_sel, *d_cnt, sel_out[64], cnt[2];
                    TU_OK(kvt__cu_malloc((void **)&d_ti, sizeof ti));
                    TU_OK(kvt__cu_malloc((void **)&d_sel, (np + 1) * 4));
                    TU_OK(kvt__cu_malloc((void **)&d_cnt, 8));
                    TU_OK(kvt__cu_memcpy(d_ti, &ti, sizeof ti));
                    kvt__cu_topk_args ta = {0};
                    ta.d_items = d_ti;
                    ta.n_items = 1;
                    ta.P = P;
                    ta.max_pages = np;
                    ta.d_vote = d_vote;
                    ta.d_sel = d_sel;
                    ta.d_n_sel = d_cnt;
                    TU_OK(kvt__cu_topk(&ta, stream));
                    TU_OK(kvt__cu_stream_sync(stream));
                    TU_OK(kvt__cu_memcpy(cnt, d_cnt, 4));
                    assert_true(cnt[0] <= 64 && cnt[0] <= np);
                    TU_OK(kvt__cu_memcpy(sel_out, d_sel, cnt[0] * 4));
                    tu_check_selection(sel_out, cnt[0], T[s], P, K, sink, local, ref, tol,
                                       "GPU selection over GPU votes");
                    kvt__cu_free(d_ti);
                    kvt__cu_free(d_sel);
                    kvt__cu_free(d_cnt);
                }
            kvt_selector_destroy(sel);
        }

    kvt__cu_stream_destroy(stream);
    kvt__cu_free(d_meta);
    kvt__cu_free(d_tab);
    kvt__cu_free(d_q);
    kvt__cu_free(d_vote);
    kvt__cu_free(d_items);
    kvt_pool_destroy(pool);
    free(T);
    free(ids);
    free(tab);
    free(perm);
    free(meta);
    free(mn);
    free(mx);
    free(me);
    free(rows);
    free(q);
    free(items);
    free(gv);
    free(cv);
    free(cpages);
    free(raw);
    free(mag);
    free(tol);
    free(ref);
}

static void test_score_shapes(void **state)
{
    (void)state;
    static const score_cfg cfgs[] = {
        {1, 64, 16, 2, 3, KVT_DTYPE_F16, 30, 0, 0},
        {4, 128, 32, 2, 3, KVT_DTYPE_BF16, 25, 0, 0},
        {8, 64, 16, 1, 2, KVT_DTYPE_F32, 40, 0, 0},
        {2, 128, 32, 2, 2, KVT_DTYPE_F32, 20, 0, 0},
        {12, 40, 8, 2, 3, KVT_DTYPE_F16, 45, 0, 0},  /* two head tiles, odd D */
        {3, 128, 16, 1, 2, KVT_DTYPE_F32, 300, 0, 0}, /* pages over several blocks */
        {5, 64, 16, 1, 2, KVT_DTYPE_BF16, 12, 1, 0},  /* a NaN query element */
        {40, 128, 16, 1, 2, KVT_DTYPE_F16, 10, 0, 0}, /* queries too big to stage */
        {9, 512, 8, 1, 2, KVT_DTYPE_BF16, 8, 0, 0},   /* queries too big to stage, wide D */
        {3, 64, 16, 2, 3, KVT_DTYPE_F16, 5, 0, 1},   /* every MEAN score -inf, MINMAX NaN */
    };
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
        run_score(&cfgs[i], 0xc0ffee00u + i);
}

/* ---- TOKEN and ORACLE: scoring from the keys ------------------------------------------ */

/* Items whose pages are device blocks laid out here (K[P][D] then V[P][D] in
 * the pool dtype; the K rows past a page's tokens, the V rows and the null
 * block 0 hold NaN, as does the metadata of every page on the device, so
 * reading any of them shows as a NaN score) or, for `away` percent of the
 * pages, no block (table entry 0): those are scored by their MINMAX bound
 * from metadata written here (the exact min and max key elements). Keys are
 * random dtype encodings decoded by tu_f16_value / tu_bf16_value; the
 * reference is computed in double from them. Raw score tolerance: e_dot =
 * 1.2e-7 D mag (twice the f32 rounding bound D u of a dot product, mag =
 * the largest sum_d |q_d k_d| of the page), 3 e_dot + (P + 16) 1.2e-7 / c
 * for ORACLE (the max's error, the exp arguments' and the sum's), plus 2e-7
 * of the magnitude of the score; votes as in run_score. */
typedef struct {
    uint32_t G, D, P, S;    /* heads per group, head_dim, page_tokens, items */
    kvt_dtype dt;
    uint32_t max_full;      /* up to this many full pages per item */
    uint32_t away;          /* percent of pages with no device block */
    int special;            /* 1: an infinite key element on a device page;
                               2: a NaN query element */
} key_cfg;

static void put_bits(uint8_t *row, kvt_dtype dt, uint32_t i, uint32_t bits)
{
    if (dt == KVT_DTYPE_F32)
        memcpy(row + 4u * i, &bits, 4);
    else
        ((uint16_t *)row)[i] = (uint16_t)bits;
}

static uint32_t nan_bits(kvt_dtype dt)
{
    return dt == KVT_DTYPE_F32 ? 0x7fc00000u : dt == KVT_DTYPE_F16 ? 0x7e00u : 0x7fc0u;
}

static uint32_t inf_bits(kvt_dtype dt)
{
    return dt == KVT_DTYPE_F32 ? 0x7f800000u : dt == KVT_DTYPE_F16 ? 0x7c00u : 0x7f80u;
}

/* A random finite key element of dtype dt, |x| in about [2^-5, 2] or 0:
 * its encoding, and its value in *x. */
static uint32_t rnd_key(tu_rng *r, kvt_dtype dt, double *x)
{
    const uint32_t sign = tu_below(r, 2);
    if (tu_below(r, 16) == 0) {
        *x = sign ? -0.0 : 0.0;
        return dt == KVT_DTYPE_F32 ? sign << 31 : sign << 15;
    }
    if (dt == KVT_DTYPE_F32) {
        const float f = 2.0f * tu_unit(r);
        uint32_t u;
        memcpy(&u, &f, 4);
        *x = f;
        return u;
    }
    if (dt == KVT_DTYPE_F16) {
        const uint16_t h = (uint16_t)(sign << 15 | (10u + tu_below(r, 7)) << 10 | tu_below(r, 1024));
        *x = tu_f16_value(h);
        return h;
    }
    const uint16_t h = (uint16_t)(sign << 15 | (122u + tu_below(r, 7)) << 7 | tu_below(r, 128));
    *x = tu_bf16_value(h);
    return h;
}

static void run_keys(const key_cfg *c, uint64_t seed)
{
    tu_rng r = {seed};
    const uint32_t G = c->G, D = c->D, P = c->P, S = c->S;
    const kvt_dtype dt = c->dt;
    const size_t pe = kvt_dtype_size(dt), row = (size_t)D * pe;
    const uint64_t bb = 2ull * P * row + 16; /* blocks padded to 16 bytes more */
    const uint64_t mb = 3ull * row; /* the two-plane store: no padding */
    uint32_t *T = calloc(S, sizeof *T), maxp = 0, npages = 0;
    for (uint32_t s = 0; s < S; s++) {
        const uint32_t full = tu_below(&r, c->max_full + 1);
        const uint32_t part = tu_below(&r, 2) ? 1 + tu_below(&r, P - 1) : 0;
        T[s] = full * P + part;
        if (s == 1 && S > 2)
            T[s] = tu_below(&r, 2) ? 0 : 1 + tu_below(&r, P); /* np 0 or 1 */
        if (s == 2 && S > 3)
            T[s] = 2 * P + 1 + tu_below(&r, P - 1); /* a partial last page */
        maxp = pages_of(T[s], P) > maxp ? pages_of(T[s], P) : maxp;
        npages += pages_of(T[s], P);
    }
    /* Per (item, page): tokens, keys [P][D] as values, device block (0 = none). */
    const uint32_t pstride = maxp + 1, ntab = S * pstride + 3;
    double *kv = calloc((size_t)S * pstride * P * D, sizeof *kv);
    uint32_t *kb = calloc((size_t)S * pstride * P * D, sizeof *kb);
    uint32_t *dtab = calloc(ntab, 4), *mtab = calloc(ntab, 4);
    uint8_t *inf_page = calloc((size_t)S * pstride, 1);
    const uint32_t nblk = npages + 2, nslot = ntab + 1;
    uint32_t *bperm = malloc(nblk * 4), *sperm = malloc(nslot * 4);
    for (uint32_t i = 0; i < nblk; i++)
        bperm[i] = i;
    for (uint32_t i = 0; i < nslot; i++)
        sperm[i] = i;
    for (uint32_t i = nblk - 1; i > 1; i--) { /* blocks 1 .. nblk-1 shuffled */
        uint32_t j = 1 + tu_below(&r, i), t = bperm[i];
        bperm[i] = bperm[j];
        bperm[j] = t;
    }
    for (uint32_t i = nslot - 1; i > 0; i--) {
        uint32_t j = tu_below(&r, i + 1), t = sperm[i];
        sperm[i] = sperm[j];
        sperm[j] = t;
    }
    uint8_t *arena = malloc(nblk * bb), *meta = malloc(nslot * mb);
    for (uint64_t i = 0; i < nblk * bb / pe; i++)
        put_bits(arena, dt, (uint32_t)i, nan_bits(dt));
    for (uint64_t i = 0; i < nslot * mb / pe; i++)
        put_bits(meta, dt, (uint32_t)i, nan_bits(dt));
    uint32_t nb = 1;
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t pg = 0; pg < pages_of(T[s], P); pg++) {
            const size_t e = (size_t)s * pstride + pg, te = (size_t)s * pstride + 1 + pg;
            const uint32_t ntok = T[s] - pg * P < P ? T[s] - pg * P : P;
            double *kx = kv + e * P * D;
            uint32_t *kbits = kb + e * P * D;
            for (uint32_t t = 0; t < ntok * D; t++)
                kbits[t] = rnd_key(&r, dt, &kx[t]);
            const int on = tu_below(&r, 100) >= c->away;
            mtab[te] = sperm[te];
            dtab[te] = on ? bperm[nb++] : 0;
            if (on && c->special == 1 && tu_below(&r, 3) == 0) {
                const uint32_t at = tu_below(&r, ntok * D);
                kbits[at] = inf_bits(dt) | (tu_below(&r, 2) ? (pe == 4 ? 0x80000000u : 0x8000u) : 0);
                kx[at] = kbits[at] & (pe == 4 ? 0x80000000u : 0x8000u) ? -INFINITY : INFINITY;
                inf_page[e] = 1;
            }
            if (on) {
                uint8_t *blk = arena + dtab[te] * bb;
                for (uint32_t t = 0; t < ntok * D; t++)
                    put_bits(blk, dt, t, kbits[t]);
                continue;
            }
            /* Away: the bound's metadata, the exact extremes in plane 1 (the
             * mean row in plane 2 stays NaN). */
            uint8_t *m = meta + mtab[te] * 2 * row;
            for (uint32_t d = 0; d < D; d++) {
                uint32_t lo = d, hi = d;
                for (uint32_t t = 1; t < ntok; t++) {
                    lo = kx[t * D + d] < kx[lo] ? t * D + d : lo;
                    hi = kx[t * D + d] > kx[hi] ? t * D + d : hi;
                }
                put_bits(m, dt, d, kbits[lo]);
                put_bits(m, dt, D + d, kbits[hi]);
            }
        }
    uint8_t *d_arena, *d_meta;
    uint32_t *d_dtab, *d_mtab;
    TU_OK(kvt__cu_malloc((void **)&d_arena, nblk * bb));
    TU_OK(kvt__cu_malloc((void **)&d_meta, nslot * mb));
    TU_OK(kvt__cu_malloc((void **)&d_dtab, ntab * 4));
    TU_OK(kvt__cu_malloc((void **)&d_mtab, ntab * 4));
    TU_OK(kvt__cu_memcpy(d_arena, arena, nblk * bb));
    TU_OK(kvt__cu_memcpy(d_meta, meta, nslot * mb));
    TU_OK(kvt__cu_memcpy(d_dtab, dtab, ntab * 4));
    TU_OK(kvt__cu_memcpy(d_mtab, mtab, ntab * 4));

    const size_t nq = (size_t)S * G * D;
    float *q = malloc(nq * 4);
    for (size_t i = 0; i < nq; i++) {
        const uint32_t w = tu_below(&r, 20);
        q[i] = w == 0 ? 0.0f : w == 1 ? -0.0f : tu_unit(&r);
    }
    if (c->special == 2)
        q[tu_below(&r, (uint32_t)nq)] = NAN;
    float *d_q, *d_vote;
    TU_OK(kvt__cu_malloc((void **)&d_q, nq * 4));
    TU_OK(kvt__cu_memcpy(d_q, q, nq * 4));
    const uint32_t vstride = maxp + 3;
    TU_OK(kvt__cu_malloc((void **)&d_vote, (size_t)S * vstride * 4));
    kvt__cu_score_item *items = calloc(S, sizeof *items), *d_items;
    TU_OK(kvt__cu_malloc((void **)&d_items, S * sizeof *items));
    for (uint32_t s = 0; s < S; s++) {
        items[s].q_off = (uint64_t)s * G * D;
        items[s].table_off = (uint64_t)s * pstride + 1;
        items[s].vote_off = (uint64_t)s * vstride + 1;
        items[s].n_pages = pages_of(T[s], P);
        items[s].tokens = T[s];
    }
    TU_OK(kvt__cu_memcpy(d_items, items, S * sizeof *items));
    void *stream;
    TU_OK(kvt__cu_stream_create(&stream, 0));

    /* Reference votes [S][vstride] (item s's page pg at s * vstride + 1 + pg). */
    double *raw = malloc((size_t)G * pstride * 8), *err = malloc((size_t)G * pstride * 8);
    double *ref = malloc((size_t)S * vstride * 8), *tol = malloc((size_t)S * vstride * 8);
    float *gv = malloc((size_t)S * vstride * 4), *g0v = malloc((size_t)S * vstride * 4);
    const float scales[] = {1.0f / sqrtf((float)D), 0.37f, 1.3f};
    for (uint32_t method = KVT_SCORE_TOKEN; method <= KVT_SCORE_ORACLE; method++)
        for (uint32_t vote = 0; vote <= KVT_VOTE_SOFTVOTE; vote++) {
            const int oracle = method == KVT_SCORE_ORACLE;
            const int sv = oracle || vote == KVT_VOTE_SOFTVOTE; /* ORACLE: always SOFTVOTE */
            const float scale = scales[tu_below(&r, 3)];
            for (uint32_t s = 0; s < S; s++) {
                const uint32_t np = pages_of(T[s], P);
                double *rf = ref + (size_t)s * vstride + 1, *tl = tol + (size_t)s * vstride + 1;
                for (uint32_t g = 0; g < G; g++) {
                    const float *qg = q + ((size_t)s * G + g) * D;
                    int qbad = 0;
                    for (uint32_t d = 0; d < D; d++)
                        qbad |= !isfinite(qg[d]);
                    for (uint32_t pg = 0; pg < np; pg++) {
                        const size_t e = (size_t)s * pstride + pg;
                        const uint32_t ntok = T[s] - pg * P < P ? T[s] - pg * P : P;
                        const double *kx = kv + e * P * D;
                        double v, mag = 0;
                        if (dtab[e + 1]) { /* on the device: exact, from the keys */
                            double m = -INFINITY, z = 0, dots[256];
                            for (uint32_t t = 0; t < ntok; t++) {
                                double dot = 0, am = 0;
                                for (uint32_t d = 0; d < D; d++) {
                                    dot += (double)qg[d] * kx[t * D + d];
                                    am += fabs((double)qg[d] * kx[t * D + d]);
                                }
                                dots[t] = dot;
                                m = dot > m ? dot : m;
                                mag = am > mag ? am : mag;
                            }
                            for (uint32_t t = 0; t < ntok; t++)
                                z += exp(scale * (dots[t] - m));
                            v = oracle ? m + log(z) / scale : m;
                            if (inf_page[e])
                                v = NAN;
                        } else { /* away: the MINMAX bound (+ ln(ntok) / c) */
                            double b = 0;
                            for (uint32_t d = 0; d < D; d++) {
                                double lo = INFINITY, hi = -INFINITY;
                                for (uint32_t t = 0; t < ntok; t++) {
                                    lo = kx[t * D + d] < lo ? kx[t * D + d] : lo;
                                    hi = kx[t * D + d] > hi ? kx[t * D + d] : hi;
                                }
                                const double x = qg[d];
                                const double u = (x > 0 ? x : 0) * hi + (x < 0 ? x : 0) * lo;
                                b += u;
                                mag += fabs(u);
                            }
                            v = oracle ? b + log((double)ntok) / scale : b;
                        }
                        if (qbad)
                            v = NAN;
                        const double edot = 1.2e-7 * D * mag;
                        raw[(size_t)g * np + pg] = v;
                        err[(size_t)g * np + pg] =
                            (oracle ? 3 * edot + (P + 16) * 1.2e-7 / scale : edot) +
                            (isfinite(v) ? 2e-7 * fabs(v) : 0) + 1e-30;
                    }
                }
                for (uint32_t pg = 0; pg < np; pg++) {
                    rf[pg] = sv ? 0 : raw[pg];
                    tl[pg] = sv ? 1e-9 : err[pg];
                }
                for (uint32_t g = sv ? 0 : 1; g < G; g++) {
                    const double *rg = raw + (size_t)g * np, *eg = err + (size_t)g * np;
                    if (!sv) {
                        for (uint32_t pg = 0; pg < np; pg++) {
                            if (vote == KVT_VOTE_SUM) {
                                rf[pg] += rg[pg];
                                tl[pg] += eg[pg] + 1.2e-7 * fabs(rf[pg]);
                            } else {
                                rf[pg] = rg[pg] > rf[pg] || isnan(rg[pg]) ? rg[pg] : rf[pg];
                                tl[pg] = eg[pg] > tl[pg] ? eg[pg] : tl[pg];
                            }
                        }
                        continue;
                    }
                    double mx = -INFINITY, emax = 0, zs = 0;
                    int special = 0; /* a NaN score takes the head's whole vote */
                    for (uint32_t pg = 0; pg < np; pg++) {
                        special |= isnan(rg[pg]) || rg[pg] == INFINITY;
                        mx = scale * rg[pg] > mx ? scale * rg[pg] : mx;
                        emax = eg[pg] > emax ? eg[pg] : emax;
                    }
                    if (special) {
                        for (uint32_t pg = 0; pg < np; pg++)
                            rf[pg] += isnan(rg[pg]) || rg[pg] == INFINITY ? INFINITY : 0;
                        continue;
                    }
                    for (uint32_t pg = 0; pg < np; pg++)
                        zs += exp(scale * rg[pg] - mx);
                    for (uint32_t pg = 0; pg < np; pg++) {
                        const double p = exp(scale * rg[pg] - mx) / zs;
                        rf[pg] += p;
                        tl[pg] += p * (2 * scale * emax + 1e-5);
                    }
                }
                for (uint32_t pg = 0; pg < np; pg++)
                    if (isnan(rf[pg]))
                        rf[pg] = INFINITY;
            }

            /* Run 0: the reference check; runs 1 and 2 (a workspace, a low
             * max_pages hint: items above it recompute) must give the same
             * bits. */
            for (int run = 0; run < 3; run++) {
                kvt__cu_score_args a = {0};
                a.d_items = d_items;
                a.n_items = S;
                a.G = G;
                a.D = D;
                a.dtype = dt;
                a.method = method;
                a.vote = vote;
                a.vote_scale = scale;
                a.max_pages = run == 2 ? maxp / 2 : maxp;
                a.d_q = d_q;
                a.d_meta_table = d_mtab;
                a.d_meta_base = d_meta;
                a.meta_bytes = mb;
                a.meta_slots = nslot;
                a.d_vote = d_vote;
                kvt__cu_score_keys k = {0};
                k.d_dev_table = d_dtab;
                k.d_dev_base = d_arena;
                k.block_bytes = bb;
                k.P = P;
                const size_t wsb = kvt__cu_score_workspace_bytes(&a);
                assert_int_equal(wsb, sv ? (size_t)S * a.max_pages * G * 4 : 0);
                float *d_work = NULL;
                if (run > 0 && wsb) {
                    TU_OK(kvt__cu_malloc((void **)&d_work, wsb));
                    TU_OK(kvt__cu_memset(d_work, 0xff, wsb));
                }
                k.d_work = d_work;
                TU_OK(kvt__cu_memset(d_vote, 0xa5, (size_t)S * vstride * 4));
                TU_OK(kvt__cu_score_ex(&a, &k, stream));
                TU_OK(kvt__cu_stream_sync(stream));
                TU_OK(kvt__cu_memcpy(gv, d_vote, (size_t)S * vstride * 4));
                const int had_ws = d_work != NULL;
                kvt__cu_free(d_work);
                if (run > 0) {
                    if (memcmp(gv, g0v, (size_t)S * vstride * 4) != 0)
                        fail_msg("method %u vote %u G %u D %u: run %d (workspace %d, max_pages "
                                 "%u) differs from run 0", method, vote, G, D, run, had_ws,
                                 a.max_pages);
                    continue;
                }
                memcpy(g0v, gv, (size_t)S * vstride * 4);
                for (uint32_t s = 0; s < S; s++) {
                    const uint32_t np = pages_of(T[s], P);
                    const float *g = gv + (size_t)s * vstride + 1;
                    const double *rf = ref + (size_t)s * vstride + 1;
                    const double *tl = tol + (size_t)s * vstride + 1;
                    uint32_t pat;
                    memcpy(&pat, g - 1, 4);
                    assert_int_equal(pat, PATTERN);
                    memcpy(&pat, g + np, 4);
                    assert_int_equal(pat, PATTERN);
                    for (uint32_t pg = 0; pg < np; pg++) {
                        const int ok = isinf(rf[pg]) || isinf(g[pg])
                                           ? (double)g[pg] == rf[pg]
                                           : fabs((double)g[pg] - rf[pg]) <= tl[pg];
                        if (!ok)
                            fail_msg("method %u vote %u G %u D %u P %u dtype %u item %u page "
                                     "%u/%u (%s): GPU %.9g, reference %.9g, tolerance %.3g",
                                     method, vote, G, D, P, dt, s, pg, np,
                                     dtab[s * pstride + 1 + pg] ? "device" : "away",
                                     (double)g[pg], rf[pg], tl[pg]);
                    }
                }
            }
        }

    kvt__cu_stream_destroy(stream);
    kvt__cu_free(d_arena);
    kvt__cu_free(d_meta);
    kvt__cu_free(d_dtab);
    kvt__cu_free(d_mtab);
    kvt__cu_free(d_q);
    kvt__cu_free(d_vote);
    kvt__cu_free(d_items);
    free(T);
    free(kv);
    free(kb);
    free(dtab);
    free(mtab);
    free(inf_page);
    free(bperm);
    free(sperm);
    free(arena);
    free(meta);
    free(q);
    free(items);
    free(raw);
    free(err);
    free(ref);
    free(tol);
    free(gv);
    free(g0v);
}

static void test_score_keys(void **state)
{
    (void)state;
    static const key_cfg cfgs[] = {
        {1, 64, 16, 6, KVT_DTYPE_F16, 20, 30, 0},
        {4, 128, 32, 5, KVT_DTYPE_BF16, 12, 30, 0},
        {8, 8, 8, 6, KVT_DTYPE_F32, 40, 30, 0},
        {8, 128, 16, 4, KVT_DTYPE_F16, 10, 0, 0},   /* every page on the device */
        {4, 64, 16, 4, KVT_DTYPE_F32, 10, 100, 0},  /* none: bounds only */
        {1, 8, 64, 4, KVT_DTYPE_BF16, 6, 50, 0},
        {4, 8, 16, 4, KVT_DTYPE_F16, 12, 30, 0},
        {1, 128, 8, 4, KVT_DTYPE_F32, 16, 30, 0},
        {8, 64, 32, 4, KVT_DTYPE_BF16, 8, 30, 0},
        {12, 64, 16, 3, KVT_DTYPE_F16, 8, 30, 0},   /* two head tiles */
        {40, 256, 8, 2, KVT_DTYPE_BF16, 6, 30, 0},  /* queries too big to stage */
        {8, 128, 16, 2, KVT_DTYPE_F32, 150, 30, 0}, /* pages over several blocks / rounds */
        {4, 64, 16, 4, KVT_DTYPE_F16, 8, 30, 1},    /* infinite keys: NaN scores, +inf votes */
        {4, 64, 16, 4, KVT_DTYPE_BF16, 8, 30, 2},   /* a NaN query element */
    };
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
        if (gpu_case_kept(i))
            run_keys(&cfgs[i], 0x70c3e500u + i);
}

/* ---- top-K --------------------------------------------------------------------------- */

typedef struct {
    uint32_t np, tokens, k, sink, local;
} tk_case;

/* The rule by brute force: forced pages, then competitors sorted by (vote
 * desc, index asc) with NaN = +inf (and -0 == +0 by float comparison). */
static const float *bf_v;
static int bf_cmp(const void *x, const void *y)
{
    const uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    const float va = isnan(bf_v[a]) ? INFINITY : bf_v[a], vb = isnan(bf_v[b]) ? INFINITY : bf_v[b];
    if (va > vb)
        return -1;
    if (va < vb)
        return 1;
    return (a > b) - (a < b);
}

static uint32_t brute(const float *v, const tk_case *c, uint32_t P, uint32_t *sel, uint32_t *topk,
                      uint32_t *n_topk)
{
    const uint32_t np = c->np;
    uint8_t *mark = calloc(np + 1, 1);
    uint32_t *idx = malloc((np + 1) * 4), nc = 0;
    for (uint32_t i = 0; i < np && i < c->sink; i++)
        mark[i] = 1;
    const uint32_t partial = c->tokens % P != 0; /* forced on top of the local pages */
    for (uint32_t i = 0; i < np && i < c->local + partial; i++)
        mark[np - 1 - i] = 1;
    for (uint32_t i = 0; i < np; i++)
        if (!mark[i])
            idx[nc++] = i;
    bf_v = v;
    qsort(idx, nc, 4, bf_cmp);
    const uint32_t take = c->k < nc ? c->k : nc;
    for (uint32_t i = 0; i < take; i++)
        mark[idx[i]] = 2;
    uint32_t n = 0, m = 0;
    for (uint32_t i = 0; i < np; i++) {
        if (mark[i])
            sel[n++] = i;
        if (mark[i] == 2)
            topk[m++] = i;
    }
    *n_topk = m;
    free(mark);
    free(idx);
    return n;
}

/* Vote patterns. */
enum { V_RANDOM, V_TIES, V_EQUAL, V_SPECIAL, V_ZEROS, V_SORTED, V_NPAT };

static void make_votes(float *v, uint32_t n, int pat, tu_rng *r)
{
    static const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f,
                                     3.4028235e38f, -3.4028235e38f, 1e-45f, -1e-45f};
    for (uint32_t i = 0; i < n; i++) {
        switch (pat) {
        case V_RANDOM:
            v[i] = tu_unit(r) * 100.0f;
            break;
        case V_TIES:
            v[i] = (float)tu_below(r, 4) - 1.5f;
            break;
        case V_EQUAL:
            v[i] = 0.25f;
            break;
        case V_SPECIAL:
            v[i] = tu_below(r, 3) ? specials[tu_below(r, 12)] : tu_unit(r);
            break;
        case V_ZEROS: /* +0 and -0 tie */
            v[i] = specials[4 + tu_below(r, 4)] * (tu_below(r, 4) ? 0.0f : 1.0f);
            if (tu_below(r, 2))
                v[i] = -v[i];
            break;
        default: /* increasing with plateaus */
            v[i] = (float)(i / 7);
            break;
        }
    }
}

/* Runs a batch of cases through one launch and checks every item. */
static void run_topk(const tk_case *cs, uint32_t n, uint32_t P, const int *pat, int with_topk,
                     int understate, tu_rng *r)
{
    uint64_t vtot = 0, stot = 0;
    uint64_t *voff = malloc(n * 8), *soff = malloc(n * 8), *cap = malloc(n * 8);
    uint32_t maxp = 0;
    for (uint32_t i = 0; i < n; i++) {
        voff[i] = vtot + tu_below(r, 3);
        vtot = voff[i] + cs[i].np;
        cap[i] = kvt__sel_bound(cs[i].np, cs[i].k, cs[i].sink, cs[i].local);
        soff[i] = stot + tu_below(r, 3);
        stot = soff[i] + cap[i] + 2; /* 2 spare entries checked untouched */
        maxp = cs[i].np > maxp ? cs[i].np : maxp;
    }
    float *v = malloc((vtot + 1) * 4);
    for (uint32_t i = 0; i < n; i++)
        make_votes(v + voff[i], cs[i].np, pat[i], r);
    kvt__cu_topk_item *items = malloc(n * sizeof *items);
    for (uint32_t i = 0; i < n; i++) {
        kvt__cu_topk_item t = {voff[i], soff[i], cs[i].np, cs[i].tokens, cs[i].k, cs[i].sink,
                               cs[i].local, 0};
        items[i] = t;
    }
    float *d_v;
    uint32_t *d_sel, *d_topk, *d_ns, *d_nt;
    kvt__cu_topk_item *d_items;
    TU_OK(kvt__cu_malloc((void **)&d_v, (vtot + 1) * 4));
    TU_OK(kvt__cu_malloc((void **)&d_sel, (stot + 1) * 4));
    TU_OK(kvt__cu_malloc((void **)&d_topk, (stot + 1) * 4));
    TU_OK(kvt__cu_malloc((void **)&d_ns, n * 4));
    TU_OK(kvt__cu_malloc((void **)&d_nt, n * 4));
    TU_OK(kvt__cu_malloc((void **)&d_items, n * sizeof *items));
    TU_OK(kvt__cu_memcpy(d_v, v, (vtot + 1) * 4));
    TU_OK(kvt__cu_memcpy(d_items, items, n * sizeof *items));
    TU_OK(kvt__cu_memset(d_sel, 0xa5, (stot + 1) * 4));
    TU_OK(kvt__cu_memset(d_topk, 0xa5, (stot + 1) * 4));
    TU_OK(kvt__cu_memset(d_ns, 0xa5, n * 4));
    TU_OK(kvt__cu_memset(d_nt, 0xa5, n * 4));
    void *stream;
    TU_OK(kvt__cu_stream_create(&stream, 0));
    kvt__cu_topk_args a = {0};
    a.d_items = d_items;
    a.n_items = n;
    a.P = P;
    a.max_pages = understate ? maxp / 3 : maxp;
    a.d_vote = d_v;
    a.d_sel = d_sel;
    a.d_n_sel = d_ns;
    a.d_topk = with_topk ? d_topk : NULL;
    a.d_n_topk = with_topk ? d_nt : NULL;
    TU_OK(kvt__cu_topk(&a, stream));
    TU_OK(kvt__cu_stream_sync(stream));
    uint32_t *sel = malloc((stot + 1) * 4), *topk = malloc((stot + 1) * 4);
    uint32_t *ns = malloc(n * 4), *nt = malloc(n * 4);
    TU_OK(kvt__cu_memcpy(sel, d_sel, (stot + 1) * 4));
    TU_OK(kvt__cu_memcpy(topk, d_topk, (stot + 1) * 4));
    TU_OK(kvt__cu_memcpy(ns, d_ns, n * 4));
    TU_OK(kvt__cu_memcpy(nt, d_nt, n * 4));

    for (uint32_t i = 0; i < n; i++) {
        const tk_case *c = &cs[i];
        const uint32_t np = c->np;
        uint32_t *ws = malloc((np + 1) * 4), *wt = malloc((np + 1) * 4), wnt;
        const uint32_t wns = brute(v + voff[i], c, P, ws, wt, &wnt);
        /* The CPU's rule (votes as its scorer leaves them: NaN -> +inf). */
        float *cv = malloc((np + 1) * 4);
        for (uint32_t j = 0; j < np; j++)
            cv[j] = isnan(v[voff[i] + j]) ? INFINITY : v[voff[i] + j];
        void *mem = malloc(kvt__sel_scratch_bytes(1, 8, np + 1));
        kvt__sel_scratch sc;
        kvt__sel_scratch_carve(&sc, mem, 1, 8, np + 1);
        uint32_t *ps = malloc((np + 1) * 4), *pt = malloc((np + 1) * 4), pnt = 0;
        const uint32_t pns = kvt__sel_pick(np, c->tokens, P, c->k, c->sink, c->local, cv, NULL,
                                           0, &sc, ps, pt, &pnt);
        assert_int_equal(pns, wns);
        assert_int_equal(pnt, wnt);
        for (uint32_t j = 0; j < wns; j++)
            assert_int_equal(ps[j], ws[j]);
        for (uint32_t j = 0; j < wnt; j++)
            assert_int_equal(pt[j], wt[j]);

        if (ns[i] != wns)
            fail_msg("item %u (np %u tokens %u k %u sink %u local %u, votes %d): %u selected, "
                     "expected %u", i, np, c->tokens, c->k, c->sink, c->local, pat[i], ns[i],
                     wns);
        for (uint32_t j = 0; j < wns; j++)
            if (sel[soff[i] + j] != ws[j])
                fail_msg("item %u (np %u k %u sink %u local %u, votes %d): entry %u is %u, "
                         "expected %u", i, np, c->k, c->sink, c->local, pat[i], j,
                         sel[soff[i] + j], ws[j]);
        for (uint64_t j = wns; j < cap[i] + 2; j++)
            if (sel[soff[i] + j] != PATTERN)
                fail_msg("item %u: selection entry %llu past the count written", i,
                         (unsigned long long)j);
        if (with_topk) {
            if (nt[i] != wnt)
                fail_msg("item %u: %u top-k pages, expected %u", i, nt[i], wnt);
            for (uint32_t j = 0; j < wnt; j++)
                if (topk[soff[i] + j] != wt[j])
                    fail_msg("item %u (np %u k %u, votes %d): top-k entry %u is %u, expected %u",
                             i, np, c->k, pat[i], j, topk[soff[i] + j], wt[j]);
            for (uint64_t j = wnt; j < cap[i] + 2; j++)
                if (topk[soff[i] + j] != PATTERN)
                    fail_msg("item %u: top-k entry %llu past the count written", i,
                             (unsigned long long)j);
        } else {
            assert_int_equal(nt[i], PATTERN);
            assert_int_equal(topk[soff[i]], PATTERN);
        }
        free(ws);
        free(wt);
        free(cv);
        free(mem);
        free(ps);
        free(pt);
    }
    kvt__cu_stream_destroy(stream);
    kvt__cu_free(d_v);
    kvt__cu_free(d_sel);
    kvt__cu_free(d_topk);
    kvt__cu_free(d_ns);
    kvt__cu_free(d_nt);
    kvt__cu_free(d_items);
    free(voff);
    free(soff);
    free(cap);
    free(v);
    free(items);
    free(sel);
    free(topk);
    free(ns);
    free(nt);
}

static tk_case random_case(tu_rng *r, uint32_t np, uint32_t P)
{
    tk_case c;
    c.np = np;
    c.tokens = np == 0 ? 0 : (tu_below(r, 2) ? np * P : (np - 1) * P + 1 + tu_below(r, P - 1));
    const uint32_t w = tu_below(r, 8);
    c.k = w == 0 ? 0 : w == 1 ? np + tu_below(r, 5) : w == 2 ? KVT_SELECT_MAX_PAGES
                                                            : tu_below(r, np / 2 + 3);
    c.sink = tu_below(r, 4) ? tu_below(r, 4) : tu_below(r, np + 2);
    c.local = tu_below(r, 4) ? tu_below(r, 4) : tu_below(r, np + 2);
    return c;
}

static void test_topk_small(void **state)
{
    (void)state;
    tu_rng r = {0x70b4ull};
    for (int round = 0; round < 12; round++) {
        const uint32_t P = 8u << tu_below(&r, 3), n = 16;
        tk_case cs[16];
        int pat[16];
        for (uint32_t i = 0; i < n; i++) {
            static const uint32_t sizes[] = {0, 1, 2, 3, 5, 9, 31, 32, 33, 64, 100, 257, 600};
            cs[i] = random_case(&r, sizes[tu_below(&r, 13)], P);
            pat[i] = (int)tu_below(&r, V_NPAT);
        }
        run_topk(cs, n, P, pat, round % 3 != 2, round % 4 == 3, &r);
    }
}

/* Forced pages covering everything, k = 0, k >= competitors, fixed. */
static void test_topk_edges(void **state)
{
    (void)state;
    tu_rng r = {0xed6eull};
    const tk_case cs[] = {
        {0, 0, 5, 1, 1},    {1, 16, 5, 0, 0},   {1, 3, 5, 0, 0},    {1, 16, 0, 0, 0},
        {2, 32, 1, 0, 0},   {2, 17, 1, 0, 0},   {10, 160, 0, 2, 2}, {10, 160, 6, 2, 2},
        {10, 155, 7, 2, 2}, {10, 155, 5, 2, 2}, {10, 160, 3, 5, 5}, {10, 160, 3, 11, 0},
        {10, 160, 3, 0, 11}, {10, 159, 3, 9, 0}, {10, 160, 3, 9, 0}, {40, 640, 1, 0, 0},
        {40, 640, 39, 0, 0}, {40, 640, 40, 0, 0}, {40, 630, 38, 1, 1}, {7, 112, 2, 3, 3},
    };
    const uint32_t n = sizeof cs / sizeof cs[0];
    for (int p = 0; p < V_NPAT; p++) {
        int pat[sizeof cs / sizeof cs[0]];
        for (uint32_t i = 0; i < n; i++)
            pat[i] = p;
        run_topk(cs, n, 16, pat, 1, 0, &r);
    }
}

/* Large page counts: the cached path up to 8192 pages, the global one above
 * it (9000, 70000 pages = more than 1M tokens of 16). */
static void test_topk_large(void **state)
{
    (void)state;
    tu_rng r = {0x1a26eull};
    const tk_case cs[] = {
        {8192, 8192 * 16, 64, 1, 1},   {8192, 8192 * 16 - 3, 2000, 4, 16},
        {9000, 9000 * 16, 100, 1, 1},  {70000, 70000 * 16, 256, 4, 64},
        {70000, 70000 * 16 - 1, 1, 0, 0}, {70000, 70000 * 16, 69000, 100, 100},
    };
    const uint32_t n = sizeof cs / sizeof cs[0];
    for (int p = 0; p < V_NPAT; p++) {
        int pat[sizeof cs / sizeof cs[0]];
        for (uint32_t i = 0; i < n; i++)
            pat[i] = p;
        run_topk(cs, n, 16, pat, 1, p == V_TIES, &r);
    }
}

/* ---- bad arguments ----------------------------------------------------------------- */

static void test_bad_args(void **state)
{
    (void)state;
    static uint8_t dummy[64] __attribute__((aligned(16)));
    kvt__cu_score_args ok = {0};
    ok.d_items = (const kvt__cu_score_item *)dummy;
    ok.n_items = 1;
    ok.G = 4;
    ok.D = 128;
    ok.dtype = KVT_DTYPE_F16;
    ok.method = KVT_SCORE_MINMAX;
    ok.vote = KVT_VOTE_SOFTVOTE;
    ok.vote_scale = 0.1f;
    ok.max_pages = 8;
    ok.d_q = (const float *)dummy;
    ok.d_meta_table = (const uint32_t *)dummy;
    ok.d_meta_base = dummy;
    ok.meta_bytes = 3 * 128 * 2;
    ok.meta_slots = 2;
    ok.d_vote = (float *)dummy;
    kvt__cu_score_args a;
    TU_EXPECT_ERR(kvt__cu_score(NULL, NULL), KVT_EINVAL, "a");
#define BAD(field, value, needle)                                    \
    do {                                                             \
        a = ok;                                                      \
        a.field = value;                                             \
        TU_EXPECT_ERR(kvt__cu_score(&a, NULL), KVT_EINVAL, needle);  \
    } while (0)
    BAD(G, 0, "a->G");
    BAD(G, 257, "a->G");
    BAD(D, 0, "a->D");
    BAD(D, 100, "a->D");
    BAD(D, 2048, "a->D");
    BAD(dtype, 0, "a->dtype");
    BAD(dtype, 9, "a->dtype");
    BAD(method, 4, "a->method");
    BAD(vote, 3, "a->vote");
    BAD(vote_scale, -1.0f, "a->vote_scale");
    BAD(vote_scale, INFINITY, "a->vote_scale");
    BAD(vote_scale, NAN, "a->vote_scale");
    BAD(meta_bytes, 3 * 128 * 2 - 16, "a->meta_bytes");
    BAD(meta_bytes, 3 * 128 * 2 + 8, "a->meta_bytes");
    BAD(meta_bytes, 3 * 128 * 2 + 48, "a->meta_bytes"); /* the planes have no padding */
    BAD(meta_bytes, 3 * 128 * 4, "a->meta_bytes");      /* f32's rows for an f16 pool */
    BAD(meta_slots, 0, "a->meta_slots");
    BAD(n_items, 0x80000000u, "a->n_items");
    BAD(d_items, NULL, "a->d_items");
    BAD(d_q, NULL, "a->d_q");
    BAD(d_meta_table, NULL, "a->d_meta_table");
    BAD(d_meta_base, NULL, "a->d_meta_base");
    BAD(d_meta_base, dummy + 8, "a->d_meta_base");
    BAD(d_vote, NULL, "a->d_vote");
#undef BAD
    a = ok;
    a.n_items = 0;
    a.d_items = NULL;
    TU_OK(kvt__cu_score(&a, NULL));

    /* TOKEN and ORACLE: the keys' arguments. */
    kvt__cu_score_keys kok = {0};
    kok.d_dev_table = (const uint32_t *)dummy;
    kok.d_dev_base = dummy;
    kok.block_bytes = 2 * 16 * 128 * 2;
    kok.P = 16;
    kvt__cu_score_keys k;
    for (uint32_t method = KVT_SCORE_TOKEN; method <= KVT_SCORE_ORACLE; method++) {
        a = ok;
        a.method = method;
        TU_EXPECT_ERR(kvt__cu_score(&a, NULL), KVT_EINVAL, "k: TOKEN");
        TU_EXPECT_ERR(kvt__cu_score_ex(&a, NULL, NULL), KVT_EINVAL, "k: TOKEN");
#define BADK(field, value, needle)                                          \
    do {                                                                    \
        k = kok;                                                            \
        k.field = value;                                                    \
        TU_EXPECT_ERR(kvt__cu_score_ex(&a, &k, NULL), KVT_EINVAL, needle);  \
    } while (0)
        BADK(P, 0, "k->P");
        BADK(P, 12, "k->P");
        BADK(P, 512, "k->P");
        BADK(block_bytes, 2 * 16 * 128 * 2 - 16, "k->block_bytes");
        BADK(block_bytes, 2 * 16 * 128 * 2 + 8, "k->block_bytes");
        BADK(reserved, 1, "k->reserved");
        BADK(d_dev_table, NULL, "k->d_dev_table");
        BADK(d_dev_base, NULL, "k->d_dev_base");
        BADK(d_dev_base, dummy + 8, "k->d_dev_base");
#undef BADK
        a.vote_scale = 0.0f; /* SOFTVOTE accepts 0; ORACLE's c must be > 0 */
        if (method == KVT_SCORE_ORACLE)
            TU_EXPECT_ERR(kvt__cu_score_ex(&a, &kok, NULL), KVT_EINVAL, "a->vote_scale");
        a.vote = KVT_VOTE_SUM;
        a.vote_scale = method == KVT_SCORE_ORACLE ? -1.0f : NAN;
        if (method == KVT_SCORE_ORACLE)
            TU_EXPECT_ERR(kvt__cu_score_ex(&a, &kok, NULL), KVT_EINVAL, "a->vote_scale");
        a.n_items = 0; /* nothing to do: valid */
        a.d_items = NULL;
        a.vote_scale = 0.5f;
        TU_OK(kvt__cu_score_ex(&a, &kok, NULL));
    }
    /* MINMAX and MEAN ignore the keys. */
    a = ok;
    a.n_items = 0;
    a.d_items = NULL;
    k = kok;
    k.P = 0;
    TU_OK(kvt__cu_score_ex(&a, &k, NULL));

    kvt__cu_topk_args tok = {0};
    tok.d_items = (const kvt__cu_topk_item *)dummy;
    tok.n_items = 1;
    tok.P = 16;
    tok.max_pages = 8;
    tok.d_vote = (const float *)dummy;
    tok.d_sel = tok.d_n_sel = (uint32_t *)dummy;
    kvt__cu_topk_args t;
    TU_EXPECT_ERR(kvt__cu_topk(NULL, NULL), KVT_EINVAL, "a");
#define BAD(field, value, needle)                                   \
    do {                                                            \
        t = tok;                                                    \
        t.field = value;                                            \
        TU_EXPECT_ERR(kvt__cu_topk(&t, NULL), KVT_EINVAL, needle);  \
    } while (0)
    BAD(P, 0, "a->P");
    BAD(P, 12, "a->P");
    BAD(P, 512, "a->P");
    BAD(n_items, 0x80000000u, "a->n_items");
    BAD(d_items, NULL, "a->d_items");
    BAD(d_vote, NULL, "a->d_vote");
    BAD(d_sel, NULL, "a->d_sel");
    BAD(d_n_sel, NULL, "a->d_n_sel");
#undef BAD
    t = tok;
    t.n_items = 0;
    t.d_items = NULL;
    TU_OK(kvt__cu_topk(&t, NULL));
}

int main(void)
{
    GPU_SKIP_WITHOUT_DEVICE();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_score_shapes),
        cmocka_unit_test(test_score_keys),
        cmocka_unit_test(test_topk_small),
        cmocka_unit_test(test_topk_edges),
        cmocka_unit_test(test_topk_large),
        cmocka_unit_test(test_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
