/* Finishing a step's selection on the device (kvt__cu_sel_finish,
 * cuda/selfinish.cu).
 *
 * Every check is exact (integers): the kernel's output is compared with
 *  - RERANK: the selection and top-k part of the CPU's kvt__sel_pick on the
 *    same votes (random, heavy ties, NaN / +-inf / +-0 mixes), after a real
 *    kvt__cu_topk run wrote them (P in {8, 16, 32}) or, for page sizes
 *    kvt__cu_topk does not take (P in {1, 7, 100, 1024}), after the host
 *    uploaded them; the saved copy must equal both d_topk and the CPU's
 *    top-k part, and a top-k part longer than saved_cap must give
 *    d_n_sel = UINT32_MAX with nothing else written;
 *  - REUSE: kvt__sel_pick with vote NULL and the saved list as reuse_topk,
 *    and a brute force (forced pages by their definition, saved pages
 *    marked), for saved lists that are empty, full (= saved_cap), hold
 *    entries >= np (dropped), overlap the forced pages, or lie wholly in
 *    them; sink / local covering everything; np 0, 1, small, 9000, 70000;
 *    tokens % P == 0 and != 0;
 *  - ALL: 0 .. np - 1;
 *  - every mode: d_blocks / d_ntok by brute force from the table
 *    (min(P, tokens - page P) in 64-bit) and d_attn[].n_pages, the other
 *    attention fields unchanged.
 * Nothing past any count is written (two guard entries past each region
 * capacity, stale saved entries past the new count, unused d_n_saved
 * slots). Item errors (unknown mode, n_pages != ceil(tokens / P), counts
 * above capacity, lists out of order, arrays NULL for a mode that needs
 * them) give UINT32_MAX and write nothing else. A RERANK launch followed by
 * a REUSE launch of the same heads reads back what the first saved. Bad
 * launcher arguments name themselves. */
#include "gputest.h"
#include "testutil.h"
#include "internal.h"

#define PAT 0xa5a5a5a5u
#define GUARD 2u /* entries past each region checked untouched */

static uint32_t pages_of(uint32_t T, uint32_t P)
{
    return (uint32_t)(((uint64_t)T + P - 1) / P);
}

/* tokens for np pages of P: a full or a partial last page. */
static uint32_t tokens_for(tu_rng *r, uint32_t np, uint32_t P, int partial)
{
    if (np == 0)
        return 0;
    if (P == 1 || !partial)
        return np * P;
    return (np - 1) * P + 1 + tu_below(r, P - 1);
}

/* ---- CPU references ------------------------------------------------------------------ */

/* kvt__sel_pick, the CPU backend's rule. */
static uint32_t cpu_pick(uint32_t np, uint32_t tokens, uint32_t P, uint32_t k, uint32_t sink,
                         uint32_t local, const float *vote, const uint32_t *reuse,
                         uint32_t n_reuse, uint32_t *out, uint32_t *topk, uint32_t *n_topk)
{
    void *mem = malloc(kvt__sel_scratch_bytes(1, 8, np + 1));
    assert_non_null(mem);
    kvt__sel_scratch sc;
    kvt__sel_scratch_carve(&sc, mem, 1, 8, np + 1);
    const uint32_t n = kvt__sel_pick(np, tokens, P, k, sink, local, vote, reuse, n_reuse, &sc,
                                     out, topk, n_topk);
    free(mem);
    return n;
}

/* The REUSE rule by its definition. */
static uint32_t brute_reuse(uint32_t np, uint32_t tokens, uint32_t P, uint32_t sink,
                            uint32_t local, const uint32_t *saved, uint32_t n_saved,
                            uint32_t *out)
{
    uint8_t *in = calloc(np + 1, 1);
    for (uint32_t j = 0; j < n_saved; j++)
        if (saved[j] < np)
            in[saved[j]] = 1;
    uint32_t n = 0;
    for (uint32_t i = 0; i < np; i++) {
        /* a partial last page is forced on top of the local full pages */
        const uint64_t partial = tokens % P != 0;
        const int forced = i < sink || (uint64_t)i + local + partial >= np;
        if (forced || in[i])
            out[n++] = i;
    }
    free(in);
    return n;
}

/* Vote patterns (NaN is +inf for the CPU rule, as its scorer leaves it). */
enum { V_RANDOM, V_TIES, V_SPECIAL, V_NPAT };

static void make_votes(float *v, uint32_t n, int pat, tu_rng *r)
{
    static const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f};
    for (uint32_t i = 0; i < n; i++) {
        if (pat == V_RANDOM)
            v[i] = tu_unit(r) * 100.0f;
        else if (pat == V_TIES)
            v[i] = (float)tu_below(r, 3);
        else
            v[i] = tu_below(r, 2) ? specials[tu_below(r, 7)] : tu_unit(r);
    }
}

/* ---- one launch over a batch of items, checked item by item -------------------------- */

typedef struct {
    uint32_t mode; /* KVT__CU_SF_* (or an invalid value) */
    uint32_t np, tokens, sink, local;
    /* RERANK from votes: */
    uint32_t k;
    int vpat;
    /* RERANK given as lists (given != 0; host-uploaded runs only): */
    int given;
    const uint32_t *gsel, *gtopk;
    uint32_t gn_sel, gn_topk;
    /* REUSE: the saved list (increasing; n_saved may exceed saved_cap). */
    const uint32_t *saved;
    uint32_t n_saved;
    int expect_err; /* an item error besides those the runner derives */
} sf_case;

typedef struct {
    uint32_t P, saved_cap;
    int gpu_topk; /* RERANK inputs written by kvt__cu_topk (else uploaded) */
    int null_opt; /* d_topk, d_n_topk, d_saved, d_n_saved passed as NULL */
} sf_run;

static uint32_t *u32_fill(size_t n, uint32_t v)
{
    uint32_t *p = malloc((n + 1) * 4);
    assert_non_null(p);
    for (size_t i = 0; i <= n; i++)
        p[i] = v;
    return p;
}

static uint32_t *dev_u32(const uint32_t *h, size_t n)
{
    uint32_t *d;
    TU_OK(kvt__cu_malloc((void **)&d, (n + 1) * 4));
    TU_OK(kvt__cu_memcpy(d, h, (n + 1) * 4));
    return d;
}

static void get_u32(uint32_t *h, const uint32_t *d, size_t n)
{
    TU_OK(kvt__cu_memcpy(h, d, (n + 1) * 4));
}

static void run_sf(const sf_case *cs, uint32_t n, const sf_run *run, tu_rng *r)
{
    const uint32_t P = run->P, cap = run->saved_cap;
    uint64_t *soff = malloc(n * 8), *svoff = malloc(n * 8), *toff = malloc(n * 8);
    uint64_t *voff = malloc(n * 8);
    uint32_t *sidx = malloc((n + 3) * 4);
    uint64_t stot = 0, svtot = 0, ttot = 0, vtot = 0;
    uint32_t maxp = 0;
    for (uint32_t i = 0; i < n; i++) {
        soff[i] = stot + tu_below(r, 3);
        stot = soff[i] + cs[i].np + GUARD;
        svoff[i] = svtot + tu_below(r, 2);
        svtot = svoff[i] + cap + GUARD;
        toff[i] = ttot + tu_below(r, 3);
        ttot = toff[i] + cs[i].np;
        voff[i] = vtot;
        vtot += cs[i].np;
        maxp = cs[i].np > maxp ? cs[i].np : maxp;
    }
    /* Distinct d_n_saved slots, shuffled, with 3 left unused. */
    const uint32_t nslot = n + 3;
    for (uint32_t i = 0; i < nslot; i++)
        sidx[i] = i;
    for (uint32_t i = nslot - 1; i > 0; i--) {
        const uint32_t j = tu_below(r, i + 1), t = sidx[i];
        sidx[i] = sidx[j];
        sidx[j] = t;
    }

    /* Host images of every array before the launch. */
    uint32_t *h_sel = u32_fill(stot, PAT), *h_topk = u32_fill(stot, PAT);
    uint32_t *h_nsel = u32_fill(n, PAT), *h_ntopk = u32_fill(n, PAT);
    uint32_t *h_saved = u32_fill(svtot, PAT), *h_nsaved = u32_fill(nslot, PAT);
    uint32_t *h_table = u32_fill(ttot, 0);
    for (uint64_t i = 0; i < ttot; i++)
        h_table[i] = (uint32_t)(tu_next(r) >> 33) | 1u;
    float *v = malloc((vtot + 1) * 4), *cv = malloc((vtot + 1) * 4);
    /* The RERANK inputs (CPU's rule or given), per item at soff. */
    uint32_t *in_sel = u32_fill(stot, PAT), *in_topk = u32_fill(stot, PAT);
    uint32_t *in_nsel = u32_fill(n, 0), *in_ntopk = u32_fill(n, 0);
    kvt__cu_sf_item *items = calloc(n, sizeof *items);
    kvt__cu_topk_item *titems = calloc(n, sizeof *titems);
    kvt__cu_attn_item *attn = calloc(n, sizeof *attn);
    for (uint32_t i = 0; i < n; i++) {
        const sf_case *c = &cs[i];
        kvt__cu_sf_item it = {soff[i], svoff[i], toff[i], sidx[i], c->mode,
                              c->np, c->tokens, c->sink, c->local};
        items[i] = it;
        kvt__cu_topk_item t = {voff[i], soff[i], 0, 0, 0, 0, 0, 0};
        attn[i].q_off = tu_next(r);
        attn[i].out_off = tu_next(r);
        attn[i].lse_off = tu_next(r);
        attn[i].pages_off = tu_next(r);
        attn[i].n_pages = PAT;
        attn[i].cut = (uint32_t)tu_next(r);
        if (c->mode == KVT__CU_SF_RERANK) {
            if (c->given) {
                assert_false(run->gpu_topk);
                memcpy(in_sel + soff[i], c->gsel, c->gn_sel * 4);
                memcpy(in_topk + soff[i], c->gtopk, c->gn_topk * 4);
                in_nsel[i] = c->gn_sel;
                in_ntopk[i] = c->gn_topk;
            } else {
                make_votes(v + voff[i], c->np, c->vpat, r);
                for (uint32_t j = 0; j < c->np; j++)
                    cv[voff[i] + j] = isnan(v[voff[i] + j]) ? INFINITY : v[voff[i] + j];
                in_nsel[i] = cpu_pick(c->np, c->tokens, P, c->k, c->sink, c->local,
                                      cv + voff[i], NULL, 0, in_sel + soff[i],
                                      in_topk + soff[i], &in_ntopk[i]);
                t.n_pages = c->np;
                t.tokens = c->tokens;
                t.k = c->k;
                t.sink = c->sink;
                t.local = c->local;
            }
            if (!run->gpu_topk) {
                memcpy(h_sel + soff[i], in_sel + soff[i], in_nsel[i] * 4);
                memcpy(h_topk + soff[i], in_topk + soff[i], in_ntopk[i] * 4);
                h_nsel[i] = in_nsel[i];
                h_ntopk[i] = in_ntopk[i];
            }
            for (uint32_t j = 0; j < cap; j++) /* stale entries of an older step */
                h_saved[svoff[i] + j] = (uint32_t)tu_next(r);
        } else if (c->mode == KVT__CU_SF_REUSE) {
            const uint32_t w = c->n_saved < cap ? c->n_saved : cap;
            memcpy(h_saved + svoff[i], c->saved, w * 4);
            h_nsaved[sidx[i]] = c->n_saved;
        }
        titems[i] = t;
    }

    uint32_t *d_sel = dev_u32(h_sel, stot), *d_topk = dev_u32(h_topk, stot);
    uint32_t *d_nsel = dev_u32(h_nsel, n), *d_ntopk = dev_u32(h_ntopk, n);
    uint32_t *d_saved = dev_u32(h_saved, svtot), *d_nsaved = dev_u32(h_nsaved, nslot);
    uint32_t *d_table = dev_u32(h_table, ttot);
    uint32_t *pat = u32_fill(stot, PAT);
    uint32_t *d_blocks = dev_u32(pat, stot), *d_ntok = dev_u32(pat, stot);
    kvt__cu_sf_item *d_items;
    kvt__cu_topk_item *d_titems;
    kvt__cu_attn_item *d_attn;
    float *d_v;
    TU_OK(kvt__cu_malloc((void **)&d_items, n * sizeof *items));
    TU_OK(kvt__cu_malloc((void **)&d_titems, n * sizeof *titems));
    TU_OK(kvt__cu_malloc((void **)&d_attn, n * sizeof *attn));
    TU_OK(kvt__cu_malloc((void **)&d_v, (vtot + 1) * 4));
    TU_OK(kvt__cu_memcpy(d_items, items, n * sizeof *items));
    TU_OK(kvt__cu_memcpy(d_titems, titems, n * sizeof *titems));
    TU_OK(kvt__cu_memcpy(d_attn, attn, n * sizeof *attn));
    TU_OK(kvt__cu_memcpy(d_v, v, (vtot + 1) * 4));
    void *stream;
    TU_OK(kvt__cu_stream_create(&stream, 0));

    if (run->gpu_topk) {
        /* Same item numbers as the finishing launch; other modes n_pages 0. */
        kvt__cu_topk_args ta = {0};
        ta.d_items = d_titems;
        ta.n_items = n;
        ta.P = P;
        ta.max_pages = maxp;
        ta.d_vote = d_v;
        ta.d_sel = d_sel;
        ta.d_n_sel = d_nsel;
        ta.d_topk = d_topk;
        ta.d_n_topk = d_ntopk;
        TU_OK(kvt__cu_topk(&ta, stream));
    }
    kvt__cu_sf_args a = {0};
    a.d_items = d_items;
    a.n_items = n;
    a.P = P;
    a.max_pages = maxp;
    a.saved_cap = cap;
    a.d_sel = d_sel;
    a.d_n_sel = d_nsel;
    a.d_topk = run->null_opt ? NULL : d_topk;
    a.d_n_topk = run->null_opt ? NULL : d_ntopk;
    a.d_saved = run->null_opt ? NULL : d_saved;
    a.d_n_saved = run->null_opt ? NULL : d_nsaved;
    a.d_dev_table = d_table;
    a.d_blocks = d_blocks;
    a.d_ntok = d_ntok;
    a.d_attn = d_attn;
    TU_OK(kvt__cu_sel_finish(&a, stream));
    TU_OK(kvt__cu_stream_sync(stream));

    uint32_t *sel = u32_fill(stot, 0), *topk = u32_fill(stot, 0), *nsel = u32_fill(n, 0);
    uint32_t *saved = u32_fill(svtot, 0), *nsaved = u32_fill(nslot, 0);
    uint32_t *blocks = u32_fill(stot, 0), *ntok = u32_fill(stot, 0);
    kvt__cu_attn_item *attn_out = calloc(n, sizeof *attn_out);
    get_u32(sel, d_sel, stot);
    get_u32(topk, d_topk, stot);
    get_u32(nsel, d_nsel, n);
    get_u32(saved, d_saved, svtot);
    get_u32(nsaved, d_nsaved, nslot);
    get_u32(blocks, d_blocks, stot);
    get_u32(ntok, d_ntok, stot);
    TU_OK(kvt__cu_memcpy(attn_out, d_attn, n * sizeof *attn));

    uint32_t *want = malloc((maxp + 1) * 4), *want2 = malloc((maxp + 1) * 4);
    for (uint32_t i = 0; i < n; i++) {
        const sf_case *c = &cs[i];
        const uint32_t np = c->np, mode = c->mode;
        const uint32_t *gs = sel + soff[i], *gb = blocks + soff[i], *gt = ntok + soff[i];
        int err = c->expect_err;
        if (mode == KVT__CU_SF_RERANK)
            err |= run->null_opt || in_ntopk[i] > cap;
        if (mode == KVT__CU_SF_REUSE)
            err |= run->null_opt;
        /* The attention item: only n_pages is the kernel's. */
        if (attn_out[i].q_off != attn[i].q_off || attn_out[i].out_off != attn[i].out_off ||
            attn_out[i].lse_off != attn[i].lse_off ||
            attn_out[i].pages_off != attn[i].pages_off ||
            attn_out[i].cut != attn[i].cut)
            fail_msg("item %u: attention fields other than n_pages changed", i);
        /* RERANK's inputs stay as they were: the CPU's rule (or as given). */
        if (mode == KVT__CU_SF_RERANK) {
            for (uint64_t j = 0; j < np + GUARD; j++) {
                if (topk[soff[i] + j] != in_topk[soff[i] + j])
                    fail_msg("item %u (np %u, k %u): d_topk entry %llu is %u, expected %u", i,
                             np, c->k, (unsigned long long)j, topk[soff[i] + j],
                             in_topk[soff[i] + j]);
                if (err && gs[j] != in_sel[soff[i] + j])
                    fail_msg("item %u: d_sel entry %llu changed", i, (unsigned long long)j);
            }
        } else {
            for (uint64_t j = 0; j < np + GUARD; j++)
                if (topk[soff[i] + j] != PAT)
                    fail_msg("item %u (mode %u): d_topk entry %llu written", i, mode,
                             (unsigned long long)j);
        }
        const uint32_t *sv = saved + svoff[i], *hsv = h_saved + svoff[i];
        if (err) {
            if (nsel[i] != UINT32_MAX)
                fail_msg("item %u (mode %u np %u tokens %u, top-k %u, saved_cap %u): d_n_sel "
                         "%u, expected UINT32_MAX", i, mode, np, c->tokens, in_ntopk[i], cap,
                         nsel[i]);
            if (attn_out[i].n_pages != 0)
                fail_msg("item %u: error with n_pages %u", i, attn_out[i].n_pages);
            for (uint64_t j = 0; j < np + GUARD; j++) {
                if (gb[j] != PAT || gt[j] != PAT)
                    fail_msg("item %u: error but block / ntok entry %llu written", i,
                             (unsigned long long)j);
                if (mode != KVT__CU_SF_RERANK && gs[j] != PAT)
                    fail_msg("item %u: error but d_sel entry %llu written", i,
                             (unsigned long long)j);
            }
            for (uint32_t j = 0; j < cap + GUARD; j++)
                if (sv[j] != hsv[j])
                    fail_msg("item %u: error but saved entry %u written", i, j);
            if (nsaved[sidx[i]] != h_nsaved[sidx[i]])
                fail_msg("item %u: error but d_n_saved written", i);
            continue;
        }

        /* The expected selection. */
        uint32_t wn;
        if (mode == KVT__CU_SF_RERANK) {
            wn = in_nsel[i];
            memcpy(want, in_sel + soff[i], wn * 4);
        } else if (mode == KVT__CU_SF_REUSE) {
            wn = cpu_pick(np, c->tokens, P, 0, c->sink, c->local, NULL, c->saved, c->n_saved,
                          want, NULL, NULL);
            const uint32_t bn = brute_reuse(np, c->tokens, P, c->sink, c->local, c->saved,
                                            c->n_saved, want2);
            assert_int_equal(bn, wn);
            assert_memory_equal(want, want2, (size_t)wn * 4);
        } else {
            wn = np;
            for (uint32_t j = 0; j < np; j++)
                want[j] = j;
        }
        if (nsel[i] != wn)
            fail_msg("item %u (mode %u np %u tokens %u sink %u local %u, saved %u): %u "
                     "selected, expected %u", i, mode, np, c->tokens, c->sink, c->local,
                     c->n_saved, nsel[i], wn);
        if (attn_out[i].n_pages != wn)
            fail_msg("item %u: attention n_pages %u, expected %u", i, attn_out[i].n_pages, wn);
        for (uint32_t j = 0; j < wn; j++) {
            const uint32_t page = want[j];
            const uint64_t left = (uint64_t)c->tokens - (uint64_t)page * P;
            const uint32_t wt = left < P ? (uint32_t)left : P;
            if (gs[j] != page)
                fail_msg("item %u (mode %u np %u sink %u local %u): entry %u is %u, expected "
                         "%u", i, mode, np, c->sink, c->local, j, gs[j], page);
            if (gb[j] != h_table[toff[i] + page])
                fail_msg("item %u: block of entry %u (page %u) is %u, expected %u", i, j, page,
                         gb[j], h_table[toff[i] + page]);
            if (gt[j] != wt)
                fail_msg("item %u: ntok of entry %u (page %u, tokens %u, P %u) is %u, "
                         "expected %u", i, j, page, c->tokens, P, gt[j], wt);
        }
        for (uint64_t j = wn; j < np + GUARD; j++) {
            if (mode != KVT__CU_SF_RERANK && gs[j] != PAT)
                fail_msg("item %u: d_sel entry %llu past the count written", i,
                         (unsigned long long)j);
            if (gb[j] != PAT || gt[j] != PAT)
                fail_msg("item %u: block / ntok entry %llu past the count written", i,
                         (unsigned long long)j);
        }
        /* The saved top-k part. */
        if (mode == KVT__CU_SF_RERANK) {
            const uint32_t m = in_ntopk[i];
            if (nsaved[sidx[i]] != m)
                fail_msg("item %u: d_n_saved %u, expected %u", i, nsaved[sidx[i]], m);
            for (uint32_t j = 0; j < m; j++)
                if (sv[j] != in_topk[soff[i] + j] || sv[j] != topk[soff[i] + j])
                    fail_msg("item %u: saved entry %u is %u, top-k part has %u", i, j, sv[j],
                             in_topk[soff[i] + j]);
            for (uint32_t j = m; j < cap + GUARD; j++)
                if (sv[j] != hsv[j])
                    fail_msg("item %u: saved entry %u past the count written", i, j);
        } else {
            for (uint32_t j = 0; j < cap + GUARD; j++)
                if (sv[j] != hsv[j])
                    fail_msg("item %u (mode %u): saved entry %u written", i, mode, j);
            if (nsaved[sidx[i]] != h_nsaved[sidx[i]])
                fail_msg("item %u (mode %u): d_n_saved written", i, mode);
        }
    }
    for (uint32_t s = n; s < nslot; s++)
        if (nsaved[sidx[s]] != PAT)
            fail_msg("unused d_n_saved slot %u written", sidx[s]);

    kvt__cu_stream_destroy(stream);
    uint32_t *dfree[] = {d_sel, d_topk, d_nsel, d_ntopk, d_saved, d_nsaved, d_table, d_blocks,
                         d_ntok};
    for (size_t j = 0; j < sizeof dfree / sizeof dfree[0]; j++)
        kvt__cu_free(dfree[j]);
    kvt__cu_free(d_items);
    kvt__cu_free(d_titems);
    kvt__cu_free(d_attn);
    kvt__cu_free(d_v);
    uint32_t *hfree[] = {sidx, h_sel, h_topk, h_nsel, h_ntopk, h_saved, h_nsaved, h_table,
                         in_sel, in_topk, in_nsel, in_ntopk, pat, sel, topk, nsel, saved,
                         nsaved, blocks, ntok, want, want2};
    for (size_t j = 0; j < sizeof hfree / sizeof hfree[0]; j++)
        free(hfree[j]);
    free(soff);
    free(svoff);
    free(toff);
    free(voff);
    free(v);
    free(cv);
    free(items);
    free(titems);
    free(attn);
    free(attn_out);
}

/* ---- case generators ----------------------------------------------------------------- */

/* Saved-list styles. */
enum { S_EMPTY, S_RANDOM, S_BEYOND, S_FORCED, S_FULL, S_DENSE, S_NSTYLE };

/* An increasing list of at most cap distinct entries into buf. */
static uint32_t make_saved(uint32_t *buf, uint32_t cap, const sf_case *c, int style, tu_rng *r)
{
    const uint32_t np = c->np;
    const uint32_t range = np + 1 + tu_below(r, 40);
    uint32_t n = 0;
    switch (style) {
    case S_EMPTY:
        break;
    case S_BEYOND: /* only entries >= np: all dropped */
        for (uint32_t x = np; x < np + 30 && n < cap; x += 1 + tu_below(r, 3))
            buf[n++] = x;
        break;
    case S_FORCED: /* entries inside the forced pages, and some beyond */
        for (uint32_t x = 0; x < range && n < cap; x++) {
            const int forced = x < c->sink || (x < np && (uint64_t)x + c->local >= np) ||
                               x >= np;
            if (forced && tu_below(r, 2))
                buf[n++] = x;
        }
        break;
    case S_FULL: /* exactly cap entries where possible */
        for (uint32_t x = 0; x < range && n < cap; x++)
            if (range - x <= cap - n || tu_below(r, 3) == 0)
                buf[n++] = x;
        break;
    case S_DENSE:
        for (uint32_t x = 0; x < range && n < cap; x++)
            if (tu_below(r, 8))
                buf[n++] = x;
        break;
    default: { /* about cap / 2 entries spread over the range */
        const uint32_t want = cap / 2 + 1;
        for (uint32_t x = 0; x < range && n < cap; x++)
            if (tu_below(r, range) < want)
                buf[n++] = x;
        break;
    }
    }
    return n;
}

typedef struct {
    sf_case *c;
    uint32_t **lists;
    uint32_t n;
} batch;

static batch batch_new(uint32_t n)
{
    batch b = {calloc(n, sizeof(sf_case)), calloc(n, sizeof(uint32_t *)), n};
    return b;
}

static void batch_free(batch *b)
{
    for (uint32_t i = 0; i < b->n; i++)
        free(b->lists[i]);
    free(b->c);
    free(b->lists);
}

/* A random item of the given mode with np pages. */
static void random_item(batch *b, uint32_t i, uint32_t mode, uint32_t np, uint32_t P,
                        uint32_t cap, tu_rng *r)
{
    sf_case *c = &b->c[i];
    memset(c, 0, sizeof *c);
    c->mode = mode;
    c->np = np;
    c->tokens = tokens_for(r, np, P, (int)tu_below(r, 2));
    c->sink = tu_below(r, 4) ? tu_below(r, 4) : tu_below(r, np + 2);
    c->local = tu_below(r, 4) ? tu_below(r, 4) : tu_below(r, np + 2);
    if (mode == KVT__CU_SF_RERANK) {
        const uint32_t w = tu_below(r, 6);
        c->k = w == 0 ? 0 : w == 1 ? np + tu_below(r, 5) : w == 2 ? cap + tu_below(r, 2)
                                                               : tu_below(r, np / 2 + 3);
        c->vpat = (int)tu_below(r, V_NPAT);
    } else if (mode == KVT__CU_SF_REUSE) {
        b->lists[i] = malloc(((size_t)cap + 1) * 4);
        c->n_saved = make_saved(b->lists[i], cap, c, (int)tu_below(r, S_NSTYLE), r);
        c->saved = b->lists[i];
    }
}

static void random_batches(const uint32_t *Ps, uint32_t nP, int gpu_topk, uint64_t seed,
                           int rounds)
{
    tu_rng r = {seed};
    static const uint32_t sizes[] = {0, 1, 2, 3, 5, 9, 31, 33, 100, 257, 600};
    static const uint32_t caps[] = {0, 3, 16, 64, 300};
    for (int round = 0; round < rounds; round++) {
        const uint32_t P = Ps[tu_below(&r, nP)], n = 24;
        const uint32_t cap = caps[tu_below(&r, 5)];
        batch b = batch_new(n);
        for (uint32_t i = 0; i < n; i++) {
            uint32_t np = sizes[tu_below(&r, 11)];
            if (tu_below(&r, 40) == 0)
                np = 9000 + tu_below(&r, 3);
            random_item(&b, i, tu_below(&r, 3), np, P, cap, &r);
        }
        sf_run run = {P, cap, gpu_topk, 0};
        run_sf(b.c, n, &run, &r);
        batch_free(&b);
    }
}

/* RERANK fed by kvt__cu_topk: P in {8, 16, 32}. */
static void test_random_topk(void **state)
{
    (void)state;
    static const uint32_t Ps[] = {8, 16, 32};
    random_batches(Ps, 3, 1, 0x5f1e0001ull, 14);
}

/* Page sizes kvt__cu_topk does not take: RERANK inputs uploaded. */
static void test_random_other_P(void **state)
{
    (void)state;
    static const uint32_t Ps[] = {1, 7, 100, 1024};
    random_batches(Ps, 4, 0, 0x5f1e0002ull, 10);
}

/* Fixed edges: np 0 and 1, forced pages covering everything, every saved
 * style, k = 0, top-k parts at and one past saved_cap, large page counts. */
static void test_edges(void **state)
{
    (void)state;
    tu_rng r = {0x5f1e0003ull};
    const uint32_t P = 16, cap = 40;
    typedef struct {
        uint32_t mode, np, tokens, sink, local, k;
        int style;
    } edge;
    static const edge es[] = {
        {0, 0, 0, 1, 1, 5, 0},      {1, 0, 0, 1, 1, 0, S_BEYOND}, {2, 0, 0, 0, 0, 0, 0},
        {0, 1, 16, 0, 0, 5, 0},     {0, 1, 3, 0, 0, 0, 0},      {1, 1, 16, 0, 0, 0, S_EMPTY},
        {1, 1, 16, 0, 0, 0, S_FULL}, {1, 1, 5, 0, 0, 0, S_BEYOND}, {2, 1, 9, 0, 0, 0, 0},
        {1, 2, 32, 0, 0, 0, S_DENSE}, {1, 2, 17, 0, 0, 0, S_DENSE}, {0, 10, 160, 2, 2, 0, 0},
        {0, 10, 160, 2, 2, 6, 0},   {0, 10, 155, 2, 2, 7, 0},   {1, 10, 160, 5, 5, 0, S_FULL},
        {1, 10, 160, 11, 0, 0, S_RANDOM}, {1, 10, 160, 0, 11, 0, S_RANDOM},
        {1, 10, 159, 9, 0, 0, S_FORCED}, {1, 10, 160, 9, 0, 0, S_FORCED},
        {1, 10, 160, 2, 3, 0, S_FORCED}, {1, 10, 153, 0, 0, 0, S_BEYOND},
        {1, 10, 160, 0, 0, 0, S_EMPTY}, {1, 100, 1600, 1, 1, 0, S_FULL},
        {1, 100, 1599, 0, 0, 0, S_DENSE}, {0, 100, 1600, 1, 1, 40, 0}, {0, 100, 1600, 1, 1, 41, 0},
        {0, 100, 1593, 0, 0, 40, 0}, {0, 100, 1593, 0, 0, 99, 0}, {2, 100, 1593, 3, 3, 0, 0},
        {1, 9000, 9000 * 16, 4, 64, 0, S_RANDOM}, {1, 9001, 9000 * 16 + 5, 1, 1, 0, S_FULL},
        {0, 9000, 9000 * 16 - 3, 4, 16, 39, 0}, {2, 9000, 9000 * 16, 0, 0, 0, 0},
        {1, 70000, 70000 * 16 - 1, 4, 64, 0, S_RANDOM}, {2, 70000, 70000 * 16, 0, 0, 0, 0},
        {0, 70000, 70000 * 16, 100, 100, 40, 0},
    };
    const uint32_t n = sizeof es / sizeof es[0];
    for (int pass = 0; pass < 2; pass++) {
        batch b = batch_new(n);
        for (uint32_t i = 0; i < n; i++) {
            sf_case *c = &b.c[i];
            c->mode = es[i].mode;
            c->np = es[i].np;
            c->tokens = es[i].tokens;
            c->sink = es[i].sink;
            c->local = es[i].local;
            c->k = es[i].k;
            c->vpat = pass == 0 ? V_RANDOM : V_TIES;
            assert_int_equal(pages_of(c->tokens, P), c->np);
            if (c->mode == KVT__CU_SF_REUSE) {
                b.lists[i] = malloc((cap + 1) * 4);
                c->n_saved = make_saved(b.lists[i], cap, c, es[i].style, &r);
                c->saved = b.lists[i];
                if (es[i].style == S_FULL && c->np + 1 >= cap)
                    assert_int_equal(c->n_saved, cap);
            }
        }
        sf_run run = {P, cap, 1, 0};
        run_sf(b.c, n, &run, &r);
        batch_free(&b);
    }
}

/* Item errors: each must give UINT32_MAX and write nothing else, next to
 * valid items that must still come out right. Inputs uploaded (P 16). */
static void test_item_errors(void **state)
{
    (void)state;
    tu_rng r = {0x5f1e0004ull};
    const uint32_t P = 16, cap = 5;
    static const uint32_t s_ok[] = {0, 3, 5, 9}, t_ok[] = {3, 5};
    static const uint32_t s_dup[] = {0, 3, 3, 9}, s_big[] = {0, 3, 5, 10};
    static const uint32_t s_down[] = {0, 5, 3, 9}, t_big[] = {3, 12};
    static const uint32_t t_five[] = {1, 2, 3, 5, 7}, s_five[] = {0, 1, 2, 3, 5, 7, 9};
    static const uint32_t t_six[] = {1, 2, 3, 4, 5, 7}, s_six[] = {0, 1, 2, 3, 4, 5, 7, 9};
    static const uint32_t s_long[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    static const uint32_t l_ok[] = {1, 4, 12, 30, 31}, l_over[] = {1, 4, 6, 8, 12, 13};
    static const uint32_t l_dup[] = {1, 4, 4, 8}, l_down[] = {1, 8, 4};
    sf_case cs[24];
    uint32_t n = 0;
#define RR(sel, ns, tk, nt, err)                                                            \
    cs[n] = (sf_case){.mode = KVT__CU_SF_RERANK, .np = 10, .tokens = 155, .sink = 1,          \
                      .local = 1, .given = 1, .gsel = sel, .gn_sel = ns, .gtopk = tk,          \
                      .gn_topk = nt, .expect_err = err};                                      \
    n++
    RR(s_ok, 4, t_ok, 2, 0);
    RR(s_five, 7, t_five, 5, 0); /* top-k part == saved_cap: fine */
    RR(s_six, 8, t_six, 6, 0);   /* one past: the runner expects the error */
    RR(s_ok, 0, t_ok, 0, 0);     /* nothing selected, nothing saved */
    RR(s_dup, 4, t_ok, 2, 1);    /* selection not increasing */
    RR(s_down, 4, t_ok, 2, 1);
    RR(s_big, 4, t_ok, 2, 1);    /* page >= np */
    RR(s_ok, 4, t_big, 2, 1);    /* top-k page >= np */
    RR(s_ok, 4, t_five, 5, 1);   /* d_n_topk > d_n_sel */
    RR(s_long, 11, t_ok, 2, 1);  /* d_n_sel > np */
#undef RR
#define RU(list, nl, err)                                                                   \
    cs[n] = (sf_case){.mode = KVT__CU_SF_REUSE, .np = 10, .tokens = 160, .sink = 0,           \
                      .local = 2, .saved = list, .n_saved = nl, .expect_err = err};           \
    n++
    RU(l_ok, 5, 0);   /* n_saved == saved_cap, entries beyond np */
    RU(l_over, 6, 1); /* n_saved > saved_cap */
    RU(l_dup, 4, 1);
    RU(l_down, 3, 1);
    RU(l_ok, 0, 0);
#undef RU
    /* Unknown mode; n_pages that is not ceil(tokens / P). */
    cs[n++] = (sf_case){.mode = 3, .np = 10, .tokens = 160, .expect_err = 1};
    cs[n++] = (sf_case){.mode = 0xffffffffu, .np = 0, .tokens = 0, .expect_err = 1};
    cs[n++] = (sf_case){.mode = KVT__CU_SF_ALL, .np = 11, .tokens = 160, .expect_err = 1};
    cs[n++] = (sf_case){.mode = KVT__CU_SF_ALL, .np = 9, .tokens = 160, .expect_err = 1};
    cs[n++] = (sf_case){.mode = KVT__CU_SF_ALL, .np = 0, .tokens = 1, .expect_err = 1};
    cs[n++] = (sf_case){.mode = KVT__CU_SF_ALL, .np = 1, .tokens = 0, .expect_err = 1};
    cs[n++] = (sf_case){.mode = KVT__CU_SF_REUSE, .np = 2, .tokens = 40, .saved = l_ok,
                        .n_saved = 2, .expect_err = 1};
    cs[n++] = (sf_case){.mode = KVT__CU_SF_ALL, .np = 10, .tokens = 153};
    sf_run run = {P, cap, 0, 0};
    run_sf(cs, n, &run, &r);

    /* d_topk / d_n_topk / d_saved / d_n_saved NULL: RERANK and REUSE items
     * fail, ALL items work. */
    batch b = batch_new(12);
    for (uint32_t i = 0; i < 12; i++)
        random_item(&b, i, i % 3, 1 + tu_below(&r, 50), P, 8, &r);
    sf_run nrun = {P, 8, 0, 1};
    run_sf(b.c, 12, &nrun, &r);
    batch_free(&b);
}

/* A RERANK launch saves the top-k parts; the next step's REUSE launch of the
 * same heads (tokens grown, or shrunk: entries >= np dropped) reads them
 * back: its selection must be the CPU's with the CPU's own top-k parts. */
static void test_rerank_then_reuse(void **state)
{
    (void)state;
    tu_rng r = {0x5f1e0005ull};
    const uint32_t P = 16, n = 16, cap = 48;
    kvt__cu_sf_item it1[16], it2[16];
    kvt__cu_topk_item tk[16];
    uint32_t np1[16], tok1[16], np2[16], tok2[16], sink[16], local[16], k[16];
    uint64_t voff = 0, soff1 = 0, soff2 = 0, toff = 0;
    for (uint32_t i = 0; i < n; i++) {
        np1[i] = tu_below(&r, 4) ? tu_below(&r, 200) : 2000 + tu_below(&r, 100);
        tok1[i] = tokens_for(&r, np1[i], P, (int)tu_below(&r, 2));
        tok2[i] = tu_below(&r, 4) ? tok1[i] + tu_below(&r, 3 * P)
                                  : tu_below(&r, tok1[i] + 1);
        np2[i] = pages_of(tok2[i], P);
        sink[i] = tu_below(&r, 3);
        local[i] = tu_below(&r, 5);
        k[i] = tu_below(&r, cap + 1);
        const uint32_t maxnp = np1[i] > np2[i] ? np1[i] : np2[i];
        kvt__cu_topk_item t = {voff, soff1, np1[i], tok1[i], k[i], sink[i], local[i], 0};
        tk[i] = t;
        kvt__cu_sf_item a1 = {soff1, (uint64_t)i * cap, toff, n - 1 - i, KVT__CU_SF_RERANK,
                              np1[i], tok1[i], sink[i], local[i]};
        kvt__cu_sf_item a2 = {soff2, (uint64_t)i * cap, toff, n - 1 - i, KVT__CU_SF_REUSE,
                              np2[i], tok2[i], sink[i], local[i]};
        it1[i] = a1;
        it2[i] = a2;
        voff += np1[i];
        soff1 += np1[i];
        soff2 += np2[i] + GUARD;
        toff += maxnp;
    }
    float *v = malloc((voff + 1) * 4);
    make_votes(v, (uint32_t)voff, V_TIES, &r);
    uint32_t *table = malloc((toff + 1) * 4);
    for (uint64_t j = 0; j <= toff; j++)
        table[j] = (uint32_t)tu_next(&r);
    float *d_v;
    uint32_t *d_sel1, *d_topk1, *d_ns, *d_nt, *d_saved, *d_nsaved, *d_table, *d_b1, *d_n1;
    uint32_t *d_sel2, *d_b2, *d_n2;
    kvt__cu_topk_item *d_tk;
    kvt__cu_sf_item *d_it1, *d_it2;
    kvt__cu_attn_item *d_attn;
    TU_OK(kvt__cu_malloc((void **)&d_v, (voff + 1) * 4));
    TU_OK(kvt__cu_memcpy(d_v, v, (voff + 1) * 4));
    const size_t s1 = (soff1 + 1) * 4, s2 = (soff2 + 1) * 4;
    TU_OK(kvt__cu_malloc((void **)&d_sel1, s1));
    TU_OK(kvt__cu_malloc((void **)&d_topk1, s1));
    TU_OK(kvt__cu_malloc((void **)&d_b1, s1));
    TU_OK(kvt__cu_malloc((void **)&d_n1, s1));
    TU_OK(kvt__cu_malloc((void **)&d_sel2, s2));
    TU_OK(kvt__cu_malloc((void **)&d_b2, s2));
    TU_OK(kvt__cu_malloc((void **)&d_n2, s2));
    TU_OK(kvt__cu_memset(d_sel2, 0xa5, s2));
    TU_OK(kvt__cu_memset(d_b2, 0xa5, s2));
    TU_OK(kvt__cu_memset(d_n2, 0xa5, s2));
    TU_OK(kvt__cu_malloc((void **)&d_ns, n * 4));
    TU_OK(kvt__cu_malloc((void **)&d_nt, n * 4));
    TU_OK(kvt__cu_malloc((void **)&d_saved, (size_t)n * cap * 4));
    TU_OK(kvt__cu_malloc((void **)&d_nsaved, n * 4));
    TU_OK(kvt__cu_malloc((void **)&d_table, (toff + 1) * 4));
    TU_OK(kvt__cu_memcpy(d_table, table, (toff + 1) * 4));
    TU_OK(kvt__cu_malloc((void **)&d_tk, sizeof tk));
    TU_OK(kvt__cu_malloc((void **)&d_it1, sizeof it1));
    TU_OK(kvt__cu_malloc((void **)&d_it2, sizeof it2));
    TU_OK(kvt__cu_malloc((void **)&d_attn, n * sizeof(kvt__cu_attn_item)));
    TU_OK(kvt__cu_memcpy(d_tk, tk, sizeof tk));
    TU_OK(kvt__cu_memcpy(d_it1, it1, sizeof it1));
    TU_OK(kvt__cu_memcpy(d_it2, it2, sizeof it2));
    void *stream;
    TU_OK(kvt__cu_stream_create(&stream, 0));

    kvt__cu_topk_args ta = {0};
    ta.d_items = d_tk;
    ta.n_items = n;
    ta.P = P;
    ta.max_pages = 2100;
    ta.d_vote = d_v;
    ta.d_sel = d_sel1;
    ta.d_n_sel = d_ns;
    ta.d_topk = d_topk1;
    ta.d_n_topk = d_nt;
    TU_OK(kvt__cu_topk(&ta, stream));
    kvt__cu_sf_args a = {0};
    a.d_items = d_it1;
    a.n_items = n;
    a.P = P;
    a.max_pages = 2100;
    a.saved_cap = cap;
    a.d_sel = d_sel1;
    a.d_n_sel = d_ns;
    a.d_topk = d_topk1;
    a.d_n_topk = d_nt;
    a.d_saved = d_saved;
    a.d_n_saved = d_nsaved;
    a.d_dev_table = d_table;
    a.d_blocks = d_b1;
    a.d_ntok = d_n1;
    a.d_attn = d_attn;
    TU_OK(kvt__cu_sel_finish(&a, stream));
    /* The next step, same stream: reuse into fresh selection regions. */
    a.d_items = d_it2;
    a.d_sel = d_sel2;
    a.d_blocks = d_b2;
    a.d_ntok = d_n2;
    TU_OK(kvt__cu_sel_finish(&a, stream));
    TU_OK(kvt__cu_stream_sync(stream));

    uint32_t *sel = malloc(s2), *blk = malloc(s2), *nt = malloc(s2), ns[16];
    kvt__cu_attn_item attn[16];
    TU_OK(kvt__cu_memcpy(sel, d_sel2, s2));
    TU_OK(kvt__cu_memcpy(blk, d_b2, s2));
    TU_OK(kvt__cu_memcpy(nt, d_n2, s2));
    TU_OK(kvt__cu_memcpy(ns, d_ns, sizeof ns));
    TU_OK(kvt__cu_memcpy(attn, d_attn, sizeof attn));
    uint64_t vo = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t mx = (np1[i] > np2[i] ? np1[i] : np2[i]) + 1;
        float *cv = malloc(mx * 4);
        for (uint32_t j = 0; j < np1[i]; j++)
            cv[j] = isnan(v[vo + j]) ? INFINITY : v[vo + j];
        vo += np1[i];
        uint32_t *s = malloc(mx * 4), *t = malloc(mx * 4), *w = malloc(mx * 4), m = 0;
        cpu_pick(np1[i], tok1[i], P, k[i], sink[i], local[i], cv, NULL, 0, s, t, &m);
        assert_true(m <= cap);
        const uint32_t wn = cpu_pick(np2[i], tok2[i], P, 0, sink[i], local[i], NULL, t, m, w,
                                     NULL, NULL);
        if (ns[i] != wn || attn[i].n_pages != wn)
            fail_msg("head %u (np %u -> %u): %u / %u selected, expected %u", i, np1[i], np2[i],
                     ns[i], attn[i].n_pages, wn);
        const uint64_t o = it2[i].sel_off;
        for (uint32_t j = 0; j < wn; j++) {
            const uint64_t left = (uint64_t)tok2[i] - (uint64_t)w[j] * P;
            if (sel[o + j] != w[j] || blk[o + j] != table[it2[i].table_off + w[j]] ||
                nt[o + j] != (left < P ? left : P))
                fail_msg("head %u entry %u: page %u block %u ntok %u, expected page %u", i, j,
                         sel[o + j], blk[o + j], nt[o + j], w[j]);
        }
        for (uint32_t j = wn; j < np2[i] + GUARD; j++)
            assert_int_equal(sel[o + j], PAT);
        free(cv);
        free(s);
        free(t);
        free(w);
    }
    kvt__cu_stream_destroy(stream);
    void *dfree[] = {d_v, d_sel1, d_topk1, d_ns, d_nt, d_saved, d_nsaved, d_table, d_b1, d_n1,
                     d_sel2, d_b2, d_n2, d_tk, d_it1, d_it2, d_attn};
    for (size_t j = 0; j < sizeof dfree / sizeof dfree[0]; j++)
        kvt__cu_free(dfree[j]);
    free(v);
    free(table);
    free(sel);
    free(blk);
    free(nt);
}

/* ---- bad arguments ------------------------------------------------------------------- */

static void test_bad_args(void **state)
{
    (void)state;
    static uint8_t dummy[64] __attribute__((aligned(16)));
    uint32_t *u = (uint32_t *)dummy;
    kvt__cu_sf_args ok = {0};
    ok.d_items = (const kvt__cu_sf_item *)dummy;
    ok.n_items = 1;
    ok.P = 16;
    ok.max_pages = 8;
    ok.saved_cap = 8;
    ok.d_sel = ok.d_n_sel = u;
    ok.d_topk = ok.d_n_topk = u;
    ok.d_saved = ok.d_n_saved = u;
    ok.d_dev_table = u;
    ok.d_blocks = ok.d_ntok = u;
    ok.d_attn = (kvt__cu_attn_item *)dummy;
    kvt__cu_sf_args a;
    TU_EXPECT_ERR(kvt__cu_sel_finish(NULL, NULL), KVT_EINVAL, "a");
#define BAD(field, value, needle)                                          \
    do {                                                                   \
        a = ok;                                                            \
        a.field = value;                                                   \
        TU_EXPECT_ERR(kvt__cu_sel_finish(&a, NULL), KVT_EINVAL, needle);   \
    } while (0)
    BAD(P, 0, "a->P");
    BAD(P, 1025, "a->P");
    BAD(n_items, 0x80000000u, "a->n_items");
    BAD(d_items, NULL, "a->d_items");
    BAD(d_sel, NULL, "a->d_sel");
    BAD(d_n_sel, NULL, "a->d_n_sel");
    BAD(d_topk, NULL, "a->d_n_topk");
    BAD(d_n_topk, NULL, "a->d_n_topk");
    BAD(d_saved, NULL, "a->d_n_saved");
    BAD(d_n_saved, NULL, "a->d_n_saved");
    BAD(d_dev_table, NULL, "a->d_dev_table");
    BAD(d_blocks, NULL, "a->d_blocks");
    BAD(d_ntok, NULL, "a->d_ntok");
    BAD(d_attn, NULL, "a->d_attn");
#undef BAD
    a = ok;
    a.n_items = 0;
    a.d_items = NULL;
    a.d_sel = NULL;
    TU_OK(kvt__cu_sel_finish(&a, NULL));
}

int main(void)
{
    GPU_SKIP_WITHOUT_DEVICE();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_topk),
        cmocka_unit_test(test_random_other_P),
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_item_errors),
        cmocka_unit_test(test_rerank_then_reuse),
        cmocka_unit_test(test_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
