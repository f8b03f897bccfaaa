/* The prefix cache tests' helpers (prefixtest.h). */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prefixtest.h"

/* ---- rows as a function of the token prefix ------------------------------- */

static uint64_t mix(uint64_t h)
{
    h ^= h >> 31;
    h *= 0x7fb5d329728ea185ull;
    h ^= h >> 27;
    h *= 0x81dadef4bc2dd44dull;
    h ^= h >> 33;
    return h;
}

/* A finite f16 of moderate magnitude (2^-6 .. 2^2, either sign) from h. */
static uint16_t f16_of(uint64_t h)
{
    return (uint16_t)((h & 0x8000u) | ((9u + (h >> 16) % 8u) << 10) | ((h >> 32) & 0x3ffu));
}

/* The rows of positions [from, to) of token sequence ids (salted: another
 * salt is another model), layer l: k/v [to - from][H][D]. */
void rows_of(const uint32_t *ids, uint64_t salt, uint32_t from, uint32_t to, uint32_t l,
             uint16_t *k, uint16_t *v)
{
    uint64_t c = mix(salt + 1u);
    for (uint32_t t = 0; t < to; t++) {
        c = mix(c ^ (ids[t] + 0x9e3779b97f4a7c15ull));
        if (t < from)
            continue;
        for (uint32_t x = 0; x < H * D; x++) {
            const uint64_t b = mix(c + l * 0x10001ull + x * 0x3c6ef372fe94f82bull);
            k[((size_t)(t - from)) * H * D + x] = f16_of(b);
            v[((size_t)(t - from)) * H * D + x] = f16_of(mix(b));
        }
    }
}

/* ---- conversations: a sequence and its token ids ----------------------------- */



/* The model of the index: every whole-page run some sequence keyed. A
 * sequence's keyed pages are those all layers hold full with ids known; the
 * model records (salt, ids of the run) when it sees them keyed. */
#define MAXRUN 256
typedef struct {
    uint64_t salt;
    uint32_t n;
    uint32_t ids[CTOK];
} run;
static run g_runs[MAXRUN];
static uint32_t g_nruns;

void model_reset(void)
{
    g_nruns = 0;
}

void model_key(const conv *c)
{
    const uint32_t full = c->n / P * P;
    if (!full)
        return;
    for (uint32_t i = 0; i < g_nruns; i++)
        if (g_runs[i].salt == c->salt && g_runs[i].n >= full &&
            !memcmp(g_runs[i].ids, c->ids, full * sizeof *c->ids))
            return;
    run *r = g_nruns < MAXRUN ? &g_runs[g_nruns++] : &g_runs[mix(full) % MAXRUN];
    r->salt = c->salt;
    r->n = full;
    memcpy(r->ids, c->ids, full * sizeof *c->ids);
}

/* The most tokens a prefix of n ids can match: whole pages of some keyed run. */
uint32_t model_best(const uint32_t *ids, uint32_t n, uint64_t salt)
{
    uint32_t best = 0;
    for (uint32_t i = 0; i < g_nruns; i++) {
        if (g_runs[i].salt != salt)
            continue;
        uint32_t m = 0;
        const uint32_t lim = g_runs[i].n < n ? g_runs[i].n : n;
        while (m < lim && g_runs[i].ids[m] == ids[m])
            m++;
        m = m / P * P;
        best = m > best ? m : best;
    }
    return best;
}

/* Appends ids[c->n .. c->n + n) (already in c->ids) through kvt_seq_append,
 * recording the ids with kvt_seq_tokens_set first (ids before rows). */
void conv_append(kvt_pool *p, conv *c, uint32_t n)
{
    uint16_t *k = malloc((size_t)n * H * D * 2), *v = malloc((size_t)n * H * D * 2);
    TU_OK(kvt_seq_tokens_set(p, c->id, c->n, c->ids + c->n, n));
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        rows_of(c->ids, c->salt, c->n, c->n + n, l, k, v);
        TU_OK(kvt_seq_append(p, c->id, l, k, v, n, KVT_DTYPE_F16, 0));
    }
    c->n += n;
    free(k);
    free(v);
    model_key(c);
}

/* Creates c with prefix ids c->ids[0..n_prefix) under c->salt; returns the
 * tokens matched, checked against the model (exact: no reclaim possible). */
uint32_t conv_create(kvt_pool *p, conv *c, uint32_t n_prefix, bool exact)
{
    kvt_seq_opts so;
    TU_OK(kvt_seq_opts_init(&so));
    so.salt = c->salt;
    so.prefix = c->ids;
    so.n_prefix = n_prefix;
    TU_OK(kvt_seq_create(p, &so, &c->id));
    c->live = true;
    kvt_seq_info si = {.struct_size = sizeof si};
    TU_OK(kvt_seq_info_get(p, c->id, &si));
    const uint32_t want = model_best(c->ids, n_prefix, c->salt);
    if (exact)
        assert_int_equal(si.prefix_tokens, want);
    else
        assert_true(si.prefix_tokens <= want);
    assert_int_equal(si.prefix_tokens % P, 0);
    assert_int_equal(si.n_tokens, si.prefix_tokens);
    assert_int_equal(si.token_ids, n_prefix);
    assert_true(si.salt == c->salt);
    c->n = si.prefix_tokens;
    return si.prefix_tokens;
}

/* Every row of c reads back equal to the rows of its ids. */
void conv_verify(const kvt_pool *p, const conv *c)
{
    if (!c->n)
        return;
    uint16_t *k = malloc((size_t)c->n * H * D * 2), *v = malloc((size_t)c->n * H * D * 2);
    uint16_t *gk = malloc((size_t)c->n * D * 2), *gv = malloc((size_t)c->n * D * 2);
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        rows_of(c->ids, c->salt, 0, c->n, l, k, v);
        for (uint32_t h = 0; h < H; h++) {
            TU_OK(kvt_seq_read_kv(p, c->id, l, h, 0, c->n, gk, gv));
            for (uint32_t t = 0; t < c->n; t++)
                if (memcmp(gk + (size_t)t * D, k + ((size_t)t * H + h) * D, D * 2) ||
                    memcmp(gv + (size_t)t * D, v + ((size_t)t * H + h) * D, D * 2))
                    fail_msg("layer %u head %u token %u of %u: rows differ from the rows of "
                             "its ids", l, h, t, c->n);
        }
    }
    free(k);
    free(v);
    free(gk);
    free(gv);
}

void conv_release(kvt_pool *p, conv *c)
{
    TU_OK(kvt_seq_release(p, c->id));
    c->live = false;
    c->id = KVT_SEQ_NONE;
}

/* One dense step: sequences cs[0..n) each append nn[i] tokens (ids from
 * their c->ids, passed as token_ids) and query them causally; every output
 * row against double-precision attention over the rows of the ids. */
void conv_step(kvt_pool *p, conv **cs, uint32_t n, const uint32_t *nn, tu_rng *r)
{
    kvt_seq_id sid[MAXC];
    uint32_t rows = 0, row0[MAXC];
    for (uint32_t i = 0; i < n; i++) {
        sid[i] = cs[i]->id;
        row0[i] = rows;
        rows += nn[i];
    }
    uint32_t *tok = malloc(rows * sizeof *tok);
    for (uint32_t i = 0; i < n; i++)
        memcpy(tok + row0[i], cs[i]->ids + cs[i]->n, nn[i] * sizeof *tok);
    kvt_step_opts so;
    TU_OK(kvt_step_opts_init(&so));
    so.flags = KVT_STEP_DENSE;
    so.n_new = nn;
    so.n_rows = rows;
    so.token_ids = tok;
    so.n_token_ids = rows;
    kvt_step *st;
    TU_OK(kvt_step_plan(p, sid, n, &so, &st));
    uint16_t *k = malloc((size_t)rows * H * D * 2), *v = malloc((size_t)rows * H * D * 2);
    float *q = malloc((size_t)rows * H * G * D * 4), *out = malloc((size_t)rows * H * G * D * 4);
    float *lse = malloc((size_t)rows * H * G * 4);
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        for (uint32_t i = 0; i < n; i++)
            rows_of(cs[i]->ids, cs[i]->salt, cs[i]->n, cs[i]->n + nn[i], l,
                    k + (size_t)row0[i] * H * D, v + (size_t)row0[i] * H * D);
        TU_OK(kvt_step_append(st, l, k, v, KVT_DTYPE_F16, 0));
        for (size_t x = 0; x < (size_t)rows * H * G * D; x++)
            q[x] = (float)(0.05 * tu_unit(r));
        TU_OK(kvt_step_attend(st, l, q, out, lse));
        for (uint32_t i = 0; i < n; i++) {
            const uint32_t T = cs[i]->n + nn[i];
            uint16_t *rk = malloc((size_t)T * H * D * 2), *rv = malloc((size_t)T * H * D * 2);
            double *kd = malloc((size_t)T * D * 8), *vd = malloc((size_t)T * D * 8);
            rows_of(cs[i]->ids, cs[i]->salt, 0, T, l, rk, rv);
            for (uint32_t h = 0; h < H; h++) {
                for (uint32_t t = 0; t < T; t++)
                    for (uint32_t d = 0; d < D; d++) {
                        kd[t * D + d] = tu_f16_value(rk[((size_t)t * H + h) * D + d]);
                        vd[t * D + d] = tu_f16_value(rv[((size_t)t * H + h) * D + d]);
                    }
                for (uint32_t j = 0; j < nn[i]; j++) { /* token j sees T - nn + j + 1 rows */
                    const size_t row = row0[i] + j;
                    double ro[G * HEAD_DIM], rl[G], kap[G], vmax;
                    const float *qh = q + (row * H + h) * G * D;
                    tu_ref_attention(qh, G, D, kd, vd, T - nn[i] + j + 1, 1.0 / sqrt((double)D),
                                     ro, rl, kap, &vmax);
                    for (uint32_t gd = 0; gd < G * D; gd++) {
                        const double got = out[(row * H + h) * G * D + gd];
                        if (fabs(got - ro[gd]) > 1e-3 * vmax + 1e-5)
                            fail_msg("seq %u layer %u head %u row %u: %g, reference %g", i, l,
                                     h, j, got, ro[gd]);
                    }
                    for (uint32_t g = 0; g < G; g++)
                        assert_true(fabs(lse[(row * H + h) * G + g] - rl[g]) <
                                    1e-3 * (1.0 + fabs(rl[g])));
                }
            }
            free(rk);
            free(rv);
            free(kd);
            free(vd);
        }
    }
    TU_OK(kvt_step_finish(st));
    for (uint32_t i = 0; i < n; i++) {
        cs[i]->n += nn[i];
        model_key(cs[i]);
    }
    free(tok);
    free(k);
    free(v);
    free(q);
    free(out);
    free(lse);
}

void rand_ids(uint32_t *ids, uint32_t n, tu_rng *r)
{
    for (uint32_t i = 0; i < n; i++)
        ids[i] = (uint32_t)tu_below(r, 50000);
}

kvt_pool_opts cache_opts(uint32_t dev, uint32_t host)
{
    kvt_pool_opts o =
        tu_opts(N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, dev, host);
    o.flags |= KVT_POOL_PREFIX_CACHE;
    o.n_threads = 2;
    return o;
}

uint64_t dev_used(const kvt_pool *p)
{
    return p->tier[KVT_TIER_DEVICE].n_blocks - 1u - p->tier[KVT_TIER_DEVICE].n_free;
}

