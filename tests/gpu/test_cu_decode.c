/* Sparse flash-decode (kvt__cu_attn, cuda/decode.cu).
 *
 * Each case builds an arena of a few hundred random blocks (K in [-2, 2), V
 * in [-1, 1), stored in the pool dtype) and up to 12 items (GQA groups),
 * each attending over pages scattered through the arena: no pages, one
 * page, several; the last page partially filled, now and then a partial
 * page in the middle too. Items sit at shuffled offsets in every array with
 * gaps between them (the gaps must stay untouched). Every case runs with
 * several split_pages (auto, 1, 2, 3, one split) and is compared with two
 * independent references:
 *  - softmax attention in double (tu_ref_attention) over the stored values
 *    widened by the IEEE definitions (tu_f16_value / tu_bf16_value);
 *  - the CPU backend's portable kernel kvt__kern_portable.attn over the same
 *    host arena, merged as lib/attn/step.c does (out = acc / l, lse = m +
 *    log l).
 * Tolerances. Both sides accumulate in f32. A score scale * q.k carries an
 * error of order 2^-24 * sqrt(D) * kappa (kappa = scale * max_t sum_d
 * |q_d k_td|, at most 2 * 256 / 16 = 32 in these data), which moves the
 * softmax weights by that much relatively and so the output by that times
 * max |v|; the weighted sum of the values adds a few ulps of max |v|. So
 * outputs: |out - ref| <= 2e-5 * (1 + max |v|) + 8 * 2^-24 * sqrt(D) *
 * kappa * max |v| (the second term is below 2.5e-4 here and dominated by the
 * first for the usual 1 / sqrt(D) scale; observed errors are ~1e-6);
 * lse: |lse - ref| <= 1e-5 * (1 + |ref|) + the same score term. Results for
 * different split counts are not bit-identical (the merge reassociates the
 * sums); each is held to these bounds. Items with no pages: exact zeros and
 * -inf. Also: the G = 64 / D = 256 / f32 shape that needs more than 48 KiB
 * of shared memory, pages larger than a tile (P = 100, chunked), an item
 * with more pages than max_pages promised, d_lse NULL, and every bad
 * argument (KVT_EINVAL naming it). test_sub_launch: launches over runs of
 * the items with the whole launch's split give its rows bit for bit. */
#include "internal.h"
#include "gputest.h"
#include "testutil.h"

#define MAX_ITEMS 12u
#define GAP 3u /* elements between consecutive items' areas */
#define SENT 12345.0f

typedef struct {
    uint32_t G, D, P;
    kvt_dtype dt;
    uint32_t n_items;    /* 0 = random 1..MAX_ITEMS */
    uint32_t max_np;     /* most pages of an item */
    uint32_t n_blocks;   /* arena blocks */
    float scale_mul;     /* scale = scale_mul / sqrt(D) */
    int lse_null;        /* d_lse = NULL */
    int understate;      /* max_pages below the longest item's page count */
} shape;

static double elem_value(const uint8_t *row, kvt_dtype dt, size_t i)
{
    if (dt == KVT_DTYPE_F32) {
        float f;
        memcpy(&f, row + 4 * i, 4);
        return (double)f;
    }
    uint16_t h;
    memcpy(&h, row + 2 * i, 2);
    return dt == KVT_DTYPE_F16 ? tu_f16_value(h) : tu_bf16_value(h);
}

static void store_elem(uint8_t *row, kvt_dtype dt, size_t i, float f)
{
    if (dt == KVT_DTYPE_F32) {
        memcpy(row + 4 * i, &f, 4);
        return;
    }
    uint16_t h = dt == KVT_DTYPE_F16 ? kvt__f32_to_f16(f, KVT__RN) : kvt__f32_to_bf16(f, KVT__RN);
    memcpy(row + 2 * i, &h, 2);
}

static const char *dt_name(kvt_dtype dt)
{
    return dt == KVT_DTYPE_F16 ? "f16" : dt == KVT_DTYPE_BF16 ? "bf16" : "f32";
}

typedef struct {
    double err, lerr; /* worst observed errors over the tolerance's base */
} worst;
static worst g_worst;

/* Compares rows out[G][D] / lse[G] of one item with a reference. */
static void check_item(const float *out, const float *lse, const double *ref,
                       const double *ref_lse, const double *kappa, double vmax, uint32_t G,
                       uint32_t D, int empty, const char *what, uint32_t item)
{
    for (uint32_t g = 0; g < G; g++) {
        const float *o = out + (size_t)g * D;
        if (empty) {
            for (uint32_t d = 0; d < D; d++)
                if (o[d] != 0.0f || signbit(o[d]))
                    fail_msg("%s item %u row %u: no pages, out[%u] = %g, expected 0", what, item,
                             g, d, (double)o[d]);
            if (lse && !(isinf(lse[g]) && lse[g] < 0))
                fail_msg("%s item %u row %u: no pages, lse %g, expected -inf", what, item, g,
                         (double)lse[g]);
            continue;
        }
        const double serr = 8.0 * 0x1p-24 * sqrt((double)D) * kappa[g];
        const double otol = 2e-5 * (1.0 + vmax) + serr * vmax;
        double err = 0;
        for (uint32_t d = 0; d < D; d++) {
            const double e = fabs((double)o[d] - ref[(size_t)g * D + d]);
            if (!(e <= err)) /* NaN propagates */
                err = e;
        }
        if (!(err <= otol))
            fail_msg("%s item %u row %u: max |out - ref| %.3g > tolerance %.3g", what, item, g,
                     err, otol);
        if (err / (1.0 + vmax) > g_worst.err)
            g_worst.err = err / (1.0 + vmax);
        if (lse) {
            const double le = fabs((double)lse[g] - ref_lse[g]);
            if (!(le <= 1e-5 * (1.0 + fabs(ref_lse[g])) + serr))
                fail_msg("%s item %u row %u: lse %.9g, reference %.9g", what, item, g,
                         (double)lse[g], ref_lse[g]);
            if (le / (1.0 + fabs(ref_lse[g])) > g_worst.lerr)
                g_worst.lerr = le / (1.0 + fabs(ref_lse[g]));
        }
    }
}

static void shuffle(uint32_t *v, uint32_t n, tu_rng *r)
{
    for (uint32_t i = n; i > 1; i--) {
        const uint32_t j = tu_below(r, i), t = v[i - 1];
        v[i - 1] = v[j];
        v[j] = t;
    }
}

static void run_shape(const shape *sh, uint64_t seed)
{
    const uint32_t G = sh->G, D = sh->D, P = sh->P, NB = sh->n_blocks;
    const kvt_dtype dt = sh->dt;
    const size_t es = kvt_dtype_size(dt), row = (size_t)D * es, bb = 2 * (size_t)P * row;
    const float scale = sh->scale_mul / sqrtf((float)D);
    tu_rng r = {seed * 0x9e3779b97f4a7c15ull + 7};
    char what[160];
    snprintf(what, sizeof what, "%s G %u D %u P %u seed %llu", dt_name(dt), G, D, P,
             (unsigned long long)seed);

    /* the arena: block 0 is the null block, never referenced */
    uint8_t *arena = malloc(NB * bb);
    assert_non_null(arena);
    memset(arena, 0, bb);
    for (size_t b = 1; b < NB; b++)
        for (size_t e = 0; e < (size_t)P * D; e++) {
            store_elem(arena + b * bb, dt, e, 2.0f * tu_unit(&r));
            store_elem(arena + b * bb + (size_t)P * row, dt, e, tu_unit(&r));
        }

    /* items: page counts, blocks, token counts, shuffled placement */
    const uint32_t n = sh->n_items ? sh->n_items : 1 + tu_below(&r, MAX_ITEMS);
    uint32_t np[MAX_ITEMS], order[MAX_ITEMS], max_np = 0, total_pages = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t cls = i < 2 ? i : tu_below(&r, 4); /* items 0 and 1: 0 and 1 page */
        np[i] = cls == 0 ? 0 : cls == 1 ? 1 : 2 + tu_below(&r, sh->max_np - 1);
        if (cls >= 2 && tu_below(&r, 3) == 0)
            np[i] = sh->max_np;
        max_np = np[i] > max_np ? np[i] : max_np;
        total_pages += np[i];
        order[i] = i;
    }
    shuffle(order, n, &r);
    kvt__cu_attn_item items[MAX_ITEMS];
    const size_t n_list = total_pages + (size_t)GAP * (n + 1);
    uint32_t *blocks = calloc(n_list, sizeof *blocks), *ntok = calloc(n_list, sizeof *ntok);
    const size_t qn = ((size_t)G * D + GAP) * n + GAP, ln = ((size_t)G + GAP) * n + GAP;
    float *q = malloc(qn * sizeof *q), *out = malloc(qn * sizeof *out);
    float *lse = malloc(ln * sizeof *lse), *sent_o = malloc(qn * sizeof *sent_o);
    float *sent_l = malloc(ln * sizeof *sent_l);
    for (size_t e = 0; e < qn; e++) {
        q[e] = tu_unit(&r);
        sent_o[e] = SENT;
    }
    for (size_t e = 0; e < ln; e++)
        sent_l[e] = SENT;
    size_t poff = GAP;
    for (uint32_t k = 0; k < n; k++) {
        const uint32_t i = order[k]; /* pages in shuffled order */
        items[i].pages_off = poff;
        items[i].n_pages = np[i];
        items[i].cut = 0;
        for (uint32_t j = 0; j < np[i]; j++) {
            uint32_t b;
            int dup;
            do { /* distinct blocks within an item */
                b = 1 + tu_below(&r, NB - 1);
                dup = 0;
                for (uint32_t u = 0; u < j; u++)
                    dup |= blocks[poff + u] == b;
            } while (dup);
            blocks[poff + j] = b;
            ntok[poff + j] = P;
            if (j + 1 == np[i] && tu_below(&r, 4) != 0)
                ntok[poff + j] = 1 + tu_below(&r, P); /* partial last page */
            else if (j + 1 < np[i] && tu_below(&r, 8) == 0)
                ntok[poff + j] = 1 + tu_below(&r, P); /* a hole in the middle */
        }
        poff += np[i] + GAP;
    }
    for (uint32_t i = 0; i < n; i++) { /* q, out, lse areas: forward, reversed, shuffled */
        items[i].q_off = GAP + (size_t)i * ((size_t)G * D + GAP);
        items[i].out_off = GAP + (size_t)(n - 1 - i) * ((size_t)G * D + GAP);
        items[i].lse_off = GAP + (size_t)order[i] * (G + GAP);
    }

    /* references */
    double *ref = malloc((size_t)n * G * D * sizeof *ref), *ref_lse = malloc(n * G * sizeof *ref_lse);
    double *kappa = malloc(n * G * sizeof *kappa), vmax[MAX_ITEMS];
    float *cpu = malloc((size_t)n * G * D * sizeof *cpu), *cpu_lse = malloc(n * G * sizeof *cpu_lse);
    {
        const size_t maxtok = (size_t)sh->max_np * P;
        double *kd = malloc((maxtok * D + 1) * sizeof *kd), *vd = malloc((maxtok * D + 1) * sizeof *vd);
        float *qs = malloc((size_t)G * D * sizeof *qs), *sbuf = malloc((size_t)G * P * sizeof *sbuf);
        float *m = malloc(G * sizeof *m), *l = malloc(G * sizeof *l);
        float *acc = malloc((size_t)G * D * sizeof *acc);
        const uint8_t **bp = malloc((sh->max_np + 1) * sizeof *bp);
        for (uint32_t i = 0; i < n; i++) {
            const float *qi = q + items[i].q_off;
            size_t t = 0;
            for (uint32_t j = 0; j < np[i]; j++) {
                const uint8_t *blk = arena + (size_t)blocks[items[i].pages_off + j] * bb;
                const uint32_t nt = ntok[items[i].pages_off + j];
                bp[j] = blk;
                for (size_t e = 0; e < (size_t)nt * D; e++) {
                    kd[t * D + e] = elem_value(blk, dt, e);
                    vd[t * D + e] = elem_value(blk + (size_t)P * row, dt, e);
                }
                t += nt;
            }
            tu_ref_attention(qi, G, D, kd, vd, (uint32_t)t, scale, ref + (size_t)i * G * D,
                             ref_lse + (size_t)i * G, kappa + (size_t)i * G, &vmax[i]);
            /* the CPU backend: prescaled queries, one run over every page */
            for (size_t e = 0; e < (size_t)G * D; e++)
                qs[e] = qi[e] * scale;
            for (uint32_t g = 0; g < G; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            memset(acc, 0, (size_t)G * D * sizeof *acc);
            const kvt__attn_shape ash = {G, D, P, dt};
            if (np[i])
                kvt__kern_portable.attn(&ash, qs, bp, ntok + items[i].pages_off, NULL, NULL, np[i], m, l, acc,
                                        sbuf);
            for (uint32_t g = 0; g < G; g++) {
                for (uint32_t d = 0; d < D; d++)
                    cpu[((size_t)i * G + g) * D + d] =
                        l[g] > 0.0f ? acc[(size_t)g * D + d] * (1.0f / l[g]) : 0.0f;
                cpu_lse[(size_t)i * G + g] = l[g] > 0.0f ? m[g] + logf(l[g]) : -INFINITY;
            }
        }
        free(kd);
        free(vd);
        free(qs);
        free(sbuf);
        free(m);
        free(l);
        free(acc);
        free(bp);
    }

    /* device copies */
    void *d_arena, *d_items, *d_blocks, *d_ntok, *d_q, *d_out, *d_lse, *stream;
    TU_OK(kvt__cu_malloc(&d_arena, NB * bb));
    TU_OK(kvt__cu_malloc(&d_items, n * sizeof *items));
    TU_OK(kvt__cu_malloc(&d_blocks, n_list * sizeof *blocks));
    TU_OK(kvt__cu_malloc(&d_ntok, n_list * sizeof *ntok));
    TU_OK(kvt__cu_malloc(&d_q, qn * sizeof *q));
    TU_OK(kvt__cu_malloc(&d_out, qn * sizeof *out));
    TU_OK(kvt__cu_malloc(&d_lse, ln * sizeof *lse));
    TU_OK(kvt__cu_memcpy(d_arena, arena, NB * bb));
    TU_OK(kvt__cu_memcpy(d_items, items, n * sizeof *items));
    TU_OK(kvt__cu_memcpy(d_blocks, blocks, n_list * sizeof *blocks));
    TU_OK(kvt__cu_memcpy(d_ntok, ntok, n_list * sizeof *ntok));
    TU_OK(kvt__cu_memcpy(d_q, q, qn * sizeof *q));
    TU_OK(kvt__cu_stream_create(&stream, 0));

    /* split settings: auto, 1, 2, 3, a single split */
    const uint32_t splits[] = {0, 1, 2, 3, max_np ? max_np : 1};
    for (size_t si = 0; si < sizeof splits / sizeof *splits; si++) {
        kvt__cu_attn_args a = {
            .d_items = d_items,
            .n_items = n,
            .G = G,
            .D = D,
            .P = P,
            .dtype = dt,
            .scale = scale,
            .max_pages = sh->understate && max_np > 1 ? max_np / 2 : max_np,
            .split_pages = splits[si],
            .d_q = d_q,
            .d_out = d_out,
            .d_lse = sh->lse_null ? NULL : d_lse,
            .d_blocks = d_blocks,
            .d_ntok = d_ntok,
            .d_dev_base = d_arena,
            .block_bytes = bb,
        };
        char w2[200];
        snprintf(w2, sizeof w2, "%s split_pages %u max_pages %u", what, a.split_pages,
                 a.max_pages);
        TU_OK(kvt__cu_memcpy(d_out, sent_o, qn * sizeof *out));
        TU_OK(kvt__cu_memcpy(d_lse, sent_l, ln * sizeof *lse));
        const size_t ws = kvt__cu_attn_workspace_bytes(&a);
        void *d_work = NULL;
        if (ws)
            TU_OK(kvt__cu_malloc(&d_work, ws));
        a.d_work = d_work;
        TU_OK(kvt__cu_attn(&a, stream));
        TU_OK(kvt__cu_stream_sync(stream));
        TU_OK(kvt__cu_memcpy(out, d_out, qn * sizeof *out));
        TU_OK(kvt__cu_memcpy(lse, d_lse, ln * sizeof *lse));
        if (d_work)
            kvt__cu_free(d_work);

        /* every item's rows against both references, gaps untouched */
        uint8_t *cov_o = calloc(qn, 1), *cov_l = calloc(ln, 1);
        for (uint32_t i = 0; i < n; i++) {
            const float *o = out + items[i].out_off;
            const float *lg = sh->lse_null ? NULL : lse + items[i].lse_off;
            check_item(o, lg, ref + (size_t)i * G * D, ref_lse + (size_t)i * G,
                       kappa + (size_t)i * G, vmax[i], G, D, np[i] == 0, w2, i);
            /* the CPU kernel's rows, held to the same bound as the double reference */
            double *cd = malloc(((size_t)G * D + G) * sizeof *cd);
            for (size_t e = 0; e < (size_t)G * D; e++)
                cd[e] = cpu[(size_t)i * G * D + e];
            for (uint32_t g = 0; g < G; g++)
                cd[(size_t)G * D + g] = cpu_lse[(size_t)i * G + g];
            char w3[240];
            snprintf(w3, sizeof w3, "%s (vs the CPU kernel)", w2);
            check_item(o, lg, cd, cd + (size_t)G * D, kappa + (size_t)i * G, vmax[i], G, D,
                       np[i] == 0, w3, i);
            free(cd);
            memset(cov_o + items[i].out_off, 1, (size_t)G * D);
            memset(cov_l + items[i].lse_off, 1, G);
        }
        for (size_t e = 0; e < qn; e++)
            if (!cov_o[e] && out[e] != SENT)
                fail_msg("%s: out[%zu] outside every item was written (%g)", w2, e,
                         (double)out[e]);
        for (size_t e = 0; e < ln; e++)
            if ((sh->lse_null || !cov_l[e]) && lse[e] != SENT)
                fail_msg("%s: lse[%zu] was written (%g)%s", w2, e, (double)lse[e],
                         sh->lse_null ? " with d_lse NULL" : " outside every item");
        free(cov_o);
        free(cov_l);
    }

    kvt__cu_stream_destroy(stream);
    kvt__cu_free(d_arena);
    kvt__cu_free(d_items);
    kvt__cu_free(d_blocks);
    kvt__cu_free(d_ntok);
    kvt__cu_free(d_q);
    kvt__cu_free(d_out);
    kvt__cu_free(d_lse);
    free(arena);
    free(blocks);
    free(ntok);
    free(q);
    free(out);
    free(lse);
    free(sent_o);
    free(sent_l);
    free(ref);
    free(ref_lse);
    free(kappa);
    free(cpu);
    free(cpu_lse);
}

/* Every dtype x head_dim (64, 128, 24: 16-byte rows with a partial lane
 * group; 36: rows not 16-byte aligned at 2 bytes, plain loads) x P (16,
 * 32), G cycling through 1, 2, 4, 8, scale 1 or 3 / sqrt(D). */
static void test_shapes(void **state)
{
    (void)state;
    static const uint32_t Ds[] = {64, 128, 24, 36}, Ps[] = {16, 32}, Gs[] = {1, 2, 4, 8};
    static const kvt_dtype dts[] = {KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_F32};
    uint32_t c = 0;
    for (uint32_t di = 0; di < 4; di++)
        for (uint32_t ti = 0; ti < 3; ti++)
            for (uint32_t pi = 0; pi < 2; pi++, c++) {
                shape sh = {.G = Gs[(c + c / 4) % 4],
                            .D = Ds[di],
                            .P = Ps[pi],
                            .dt = dts[ti],
                            .max_np = 7,
                            .n_blocks = 300,
                            .scale_mul = c % 3 == 2 ? 3.0f : 1.0f};
                if (gpu_case_kept(c))
                    run_shape(&sh, 100 + c);
            }
    printf("worst |out - ref| / (1 + max|v|) %.3g, |lse - ref| / (1 + |lse|) %.3g\n",
           g_worst.err, g_worst.lerr);
}

/* Shapes at the edges: odd G (3: token-parallel accumulators that do not
 * divide the lanes), G = 64 x D = 256 x f32 (over 48 KiB of shared memory),
 * P = 100 (pages chunked into tiles) with 12 items, D = 5 (f32 rows not
 * 16-byte aligned), an understated max_pages, d_lse NULL. */
static void test_edges(void **state)
{
    (void)state;
    const shape shapes[] = {
        {.G = 3, .D = 64, .P = 16, .dt = KVT_DTYPE_F16, .max_np = 9, .n_blocks = 200, .scale_mul = 1},
        {.G = 64, .D = 256, .P = 16, .dt = KVT_DTYPE_F32, .n_items = 2, .max_np = 3, .n_blocks = 24,
         .scale_mul = 1},
        {.G = 2, .D = 128, .P = 100, .dt = KVT_DTYPE_BF16, .n_items = 12, .max_np = 4,
         .n_blocks = 100, .scale_mul = 1},
        {.G = 4, .D = 5, .P = 32, .dt = KVT_DTYPE_F32, .max_np = 6, .n_blocks = 200, .scale_mul = 1},
        {.G = 1, .D = 128, .P = 16, .dt = KVT_DTYPE_F16, .n_items = 5, .max_np = 9,
         .n_blocks = 200, .scale_mul = 1, .understate = 1},
        {.G = 8, .D = 64, .P = 32, .dt = KVT_DTYPE_BF16, .max_np = 5, .n_blocks = 200,
         .scale_mul = 1, .lse_null = 1},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        run_shape(&shapes[i], 900 + i);
}

/* A launch over part of the items (the CUDA pool's ready-first decode
 * launches runs of sequences) with the split_pages the whole batch's launch
 * chose (kvt__cu_attn_split_pages) gives those items bit for bit the
 * whole launch's rows, and needs no more workspace. The shape is one where
 * a half launch left to choose its own split would choose another (so the
 * pages would be split, and the sums associated, differently). */
static void test_sub_launch(void **state)
{
    (void)state;
    enum { N = 12, NP = 256, NB = 64, G = 2, D = 64, P = 16 };
    const kvt_dtype dt = KVT_DTYPE_F16;
    const size_t row = (size_t)D * 2, bb = 2 * (size_t)P * row;
    tu_rng r = {0x5b1a7ull};
    uint8_t *arena = malloc(NB * bb);
    uint32_t *blocks = malloc((size_t)N * NP * sizeof *blocks);
    uint32_t *ntok = malloc((size_t)N * NP * sizeof *ntok);
    float *q = malloc((size_t)N * G * D * sizeof *q);
    float *out_full = malloc((size_t)N * G * D * sizeof(float));
    float *out_part = malloc((size_t)N * G * D * sizeof(float));
    float lse_full[N * G], lse_part[N * G];
    assert_true(arena && blocks && ntok && q && out_full && out_part);
    for (size_t b = 0; b < NB; b++)
        for (size_t e = 0; e < (size_t)P * D; e++) {
            store_elem(arena + b * bb, dt, e, 2.0f * tu_unit(&r));
            store_elem(arena + b * bb + (size_t)P * row, dt, e, tu_unit(&r));
        }
    kvt__cu_attn_item items[N];
    for (uint32_t i = 0; i < N; i++) {
        const uint32_t np = NP / 2 + tu_below(&r, NP / 2 + 1);
        items[i] = (kvt__cu_attn_item){(uint64_t)i * G * D, (uint64_t)i * G * D,
                                       (uint64_t)i * G, (uint64_t)i * NP, np, 0};
        for (uint32_t j = 0; j < NP; j++) {
            blocks[(size_t)i * NP + j] = 1 + tu_below(&r, NB - 1);
            ntok[(size_t)i * NP + j] = j + 1 == np ? 1 + tu_below(&r, P) : P;
        }
    }
    for (size_t e = 0; e < (size_t)N * G * D; e++)
        q[e] = tu_unit(&r);
    void *d_arena, *d_items, *d_blocks, *d_ntok, *d_q, *d_out, *d_lse, *d_work = NULL, *stream;
    TU_OK(kvt__cu_malloc(&d_arena, NB * bb));
    TU_OK(kvt__cu_malloc(&d_items, sizeof items));
    TU_OK(kvt__cu_malloc(&d_blocks, (size_t)N * NP * sizeof *blocks));
    TU_OK(kvt__cu_malloc(&d_ntok, (size_t)N * NP * sizeof *ntok));
    TU_OK(kvt__cu_malloc(&d_q, (size_t)N * G * D * sizeof *q));
    TU_OK(kvt__cu_malloc(&d_out, (size_t)N * G * D * sizeof(float)));
    TU_OK(kvt__cu_malloc(&d_lse, sizeof lse_full));
    TU_OK(kvt__cu_memcpy(d_arena, arena, NB * bb));
    TU_OK(kvt__cu_memcpy(d_items, items, sizeof items));
    TU_OK(kvt__cu_memcpy(d_blocks, blocks, (size_t)N * NP * sizeof *blocks));
    TU_OK(kvt__cu_memcpy(d_ntok, ntok, (size_t)N * NP * sizeof *ntok));
    TU_OK(kvt__cu_memcpy(d_q, q, (size_t)N * G * D * sizeof *q));
    TU_OK(kvt__cu_stream_create(&stream, 0));
    kvt__cu_attn_args a = {d_items, N, G, D, P, dt, 1.0f / sqrtf((float)D), NP, 0, d_q, d_out,
                           d_lse, d_blocks, d_ntok, d_arena, bb, NULL};
    const size_t ws = kvt__cu_attn_workspace_bytes(&a);
    const uint32_t sp = kvt__cu_attn_split_pages(&a);
    assert_true(ws > 0 && sp > 0 && sp < NP);
    TU_OK(kvt__cu_malloc(&d_work, ws));
    a.d_work = d_work;
    TU_OK(kvt__cu_attn(&a, stream));
    TU_OK(kvt__cu_stream_sync(stream));
    TU_OK(kvt__cu_memcpy(out_full, d_out, (size_t)N * G * D * sizeof(float)));
    TU_OK(kvt__cu_memcpy(lse_full, d_lse, sizeof lse_full));
    TU_OK(kvt__cu_memset(d_out, 0xff, (size_t)N * G * D * sizeof(float)));
    TU_OK(kvt__cu_memset(d_lse, 0xff, sizeof lse_full));
    /* Runs of 5, 1 and 6 items. */
    const uint32_t cut[] = {0, 5, 6, N};
    for (uint32_t c = 0; c + 1 < sizeof cut / sizeof *cut; c++) {
        kvt__cu_attn_args b = a;
        b.d_items = (const kvt__cu_attn_item *)d_items + cut[c];
        b.n_items = cut[c + 1] - cut[c];
        b.split_pages = 0;
        if (b.n_items > 1) /* the shape does what it is meant to */
            assert_int_not_equal(kvt__cu_attn_split_pages(&b), sp);
        b.split_pages = sp;
        assert_int_equal(kvt__cu_attn_split_pages(&b), sp);
        assert_true(kvt__cu_attn_workspace_bytes(&b) <= ws);
        TU_OK(kvt__cu_attn(&b, stream));
    }
    TU_OK(kvt__cu_stream_sync(stream));
    TU_OK(kvt__cu_memcpy(out_part, d_out, (size_t)N * G * D * sizeof(float)));
    TU_OK(kvt__cu_memcpy(lse_part, d_lse, sizeof lse_part));
    assert_memory_equal(out_part, out_full, (size_t)N * G * D * sizeof(float));
    assert_memory_equal(lse_part, lse_full, sizeof lse_full);
    kvt__cu_stream_destroy(stream);
    void *d[] = {d_arena, d_items, d_blocks, d_ntok, d_q, d_out, d_lse, d_work};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++)
        kvt__cu_free(d[i]);
    free(arena);
    free(blocks);
    free(ntok);
    free(q);
    free(out_full);
    free(out_part);
}

static void test_bad_args(void **state)
{
    (void)state;
    void *d_buf;
    TU_OK(kvt__cu_malloc(&d_buf, 1 << 16));
    kvt__cu_attn_item it = {.q_off = 0, .out_off = 0, .lse_off = 0, .pages_off = 0, .n_pages = 4};
    TU_OK(kvt__cu_memcpy(d_buf, &it, sizeof it));
    const kvt__cu_attn_args good = {
        .d_items = d_buf,
        .n_items = 1,
        .G = 8,
        .D = 128,
        .P = 16,
        .dtype = KVT_DTYPE_F16,
        .scale = 0.125f,
        .max_pages = 4,
        .split_pages = 1,
        .d_q = d_buf,
        .d_out = d_buf,
        .d_lse = NULL,
        .d_blocks = d_buf,
        .d_ntok = d_buf,
        .d_dev_base = d_buf,
        .block_bytes = 2 * 16 * 128 * 2,
        .d_work = NULL,
    };
    kvt__cu_attn_args a;
    TU_EXPECT_ERR(kvt__cu_attn(NULL, NULL), KVT_EINVAL, "a");
    assert_int_equal(kvt__cu_attn_workspace_bytes(NULL), 0);
#define BAD(field, value, needle)                                  \
    do {                                                           \
        a = good;                                                  \
        a.field = value;                                           \
        TU_EXPECT_ERR(kvt__cu_attn(&a, NULL), KVT_EINVAL, needle); \
    } while (0)
    BAD(G, 0, "a->G");
    BAD(G, 65, "a->G");
    BAD(D, 0, "a->D");
    BAD(D, 257, "a->D");
    BAD(P, 0, "a->P");
    BAD(P, 1025, "a->P");
    BAD(dtype, KVT_DTYPE_DEFAULT, "a->dtype");
    BAD(dtype, 9, "a->dtype");
    BAD(scale, NAN, "a->scale");
    BAD(scale, INFINITY, "a->scale");
    BAD(block_bytes, 2 * 16 * 128 * 2 - 2, "a->block_bytes");
    BAD(d_items, NULL, "a->d_items");
    BAD(d_q, NULL, "a->d_q");
    BAD(d_out, NULL, "a->d_out");
    BAD(d_blocks, NULL, "a->d_blocks");
    BAD(d_ntok, NULL, "a->d_ntok");
    BAD(d_dev_base, NULL, "a->d_dev_base");
    /* four splits of one page need a workspace */
    a = good;
    assert_true(kvt__cu_attn_workspace_bytes(&a) >= 4u * 8u * 130u * 4u);
    BAD(d_work, NULL, "a->d_work");
    /* a bad shape has no workspace */
    a = good;
    a.G = 0;
    assert_int_equal(kvt__cu_attn_workspace_bytes(&a), 0);
    /* one split needs none; no items: nothing to do, no pointers needed */
    a = good;
    a.split_pages = 0;
    a.max_pages = 1;
    a.n_items = 1;
    assert_int_equal(kvt__cu_attn_workspace_bytes(&a), 0);
    a = good;
    a.n_items = 0;
    a.d_items = NULL;
    a.d_q = NULL;
    a.d_out = NULL;
    TU_OK(kvt__cu_attn(&a, NULL));
    assert_int_equal(kvt__cu_attn_workspace_bytes(&a), 0);
#undef BAD
    kvt__cu_free(d_buf);
}

int main(void)
{
    GPU_SKIP_WITHOUT_DEVICE();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_shapes),
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_sub_launch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
