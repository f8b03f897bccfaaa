/* Tiered placement by head class (kvt_pool_opts.policy) through the public
 * API: where pages live after a prefill and across decode steps, exactness of
 * the sparse decode over promoted pages, lookahead eviction with a window,
 * block recycling, readiness and pauses, the importance-guided warm-up,
 * KVT_ENOSPC leaving the pool unchanged, kvt_pool_sizing_get, dirty ranges,
 * bad input and a disk tier under a small host. The references are the K/V
 * bit patterns the test appended (placetest.h: attention in double over the
 * pages kvt_step_selection_get reports, scores in double from the page metadata,
 * and keys designed so that the score order is known in advance). */
#include "placetest.h"

/* Everything the placement decides, for every live sequence of f: the
 * counters, lengths, and each head's device/host blocks and residency. */
typedef struct {
    size_t n;
    uint8_t *b;
} snap;

static void snap_take(snap *sn, const pfx *f)
{
    size_t cap = 1 << 16, n = 0;
    uint8_t *b = malloc(cap);
#define PUT(ptr, len)                                                                    \
    do {                                                                                 \
        while (n + (len) > cap)                                                          \
            b = realloc(b, cap *= 2);                                                    \
        memcpy(b + n, (ptr), (len));                                                     \
        n += (len);                                                                      \
    } while (0)
    kvt_stats st = pstats(f->p);
    PUT(&st, sizeof st);
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            uint32_t T = seq_len(f, i, l), np = pages_of(T);
            PUT(&T, sizeof T);
            for (uint32_t h = 0; h < N_KV_HEADS && np; h++) {
                uint32_t dev[MAXPG], host[MAXPG];
                uint8_t res[MAXPG];
                TU_OK(kvt_seq_block_table_get(f->p, f->t[i].id, l, h, 0, np, dev, host, res));
                PUT(dev, np * sizeof *dev);
                PUT(host, np * sizeof *host);
                PUT(res, np);
            }
        }
#undef PUT
    sn->n = n;
    sn->b = b;
}

static void snap_same(snap *a, const pfx *f, const char *after)
{
    snap b;
    snap_take(&b, f);
    if (a->n != b.n || memcmp(a->b, b.b, a->n) != 0)
        fail_msg("the pool changed after %s", after);
    free(b.b);
    TU_CHECK(f->p);
}

/* ---- 1. placement by head class ------------------------------------------------ */

/* Right after the prefill (no step yet, no selection): a stable head's full
 * pages are on the host, its device pages are exactly the forced ones; an
 * unstable head's pages are on device only. */
static void check_after_prefill(const pfx *f)
{
    uint64_t full = 0;
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t l = 0; l < N_LAYERS; l++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                const uint32_t lh = l * N_KV_HEADS + h, T = f->t[i].n, np = pages_of(T);
                uint8_t rs[MAXPG], forced[MAXPG];
                table(f, i, l, h, np, NULL, rs);
                forced_pages(forced, T, f->ph.sink[lh], f->ph.local[lh]);
                for (uint32_t pg = 0; pg < np; pg++) {
                    const bool isfull = (pg + 1) * PAGE_TOKENS <= T;
                    uint8_t want = KVT_RES_DEVICE;
                    if (is_stable(f, lh)) {
                        want = (uint8_t)((forced[pg] ? KVT_RES_DEVICE : 0) |
                                         (isfull ? KVT_RES_HOST : 0));
                        full += isfull;
                    }
                    if (rs[pg] != want)
                        fail_msg("after prefill: seq %u layer %u head %u (%s) page %u%s: "
                                 "residency %#x, expected %#x", i, l, h,
                                 is_stable(f, lh) ? "stable" : "unstable", pg,
                                 forced[pg] ? " (forced)" : "", rs[pg], want);
                }
            }
    kvt_stats s = pstats(f->p);
    assert_int_equal(s.offloaded_pages, full);
    assert_int_equal(s.moved_requests[KVT_DIR_DEVICE_TO_HOST], full);
    assert_int_equal(s.moved_bytes[KVT_DIR_DEVICE_TO_HOST], full * s.block_bytes);
    assert_int_equal(s.promoted_pages, 0);
    check_device_count(f);
}

static void test_class_placement(void **state)
{
    (void)state;
    pheads ph = ph_uniform(2, 2, 1, 1, 4);
    ph_unstable(&ph, 1, 0);
    pfx *f = pfx_open(&ph, 400, 400, 0, 0x91ace);
    pfx_add(f, 10 * PAGE_TOKENS + 5, KEYS_RANDOM); /* a partial last page */
    pfx_add(f, 12 * PAGE_TOKENS, KEYS_RANDOM);     /* a full last page: local, on device and host */
    check_after_prefill(f);

    /* Steps, each after every move finished, so the rules are exact: after
     * a due rerank a stable head keeps forced + selected + at most K x w
     * unforced pages (checked in pfx_step). */
    const step_args a = {.wait_before = true, .exact_stats = true};
    uint32_t evicted = 0, promoted = 0, rr_stable = 0;
    for (int step = 0; step < 12; step++) {
        step_res r;
        pfx_step(f, &a, &r);
        evicted += r.evicted;
        promoted += r.promoted;
        for (uint32_t i = 0; i < f->ns; i++)
            for (uint32_t lh = 0; lh < NLH; lh++)
                rr_stable += is_stable(f, lh) && r.reranked[i][lh];
        /* The bound again, here directly: unforced device pages of each
         * stable head reranked this step. */
        for (uint32_t i = 0; i < f->ns; i++)
            for (uint32_t l = 0; l < N_LAYERS; l++)
                for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                    const uint32_t lh = l * N_KV_HEADS + h, T = f->t[i].n, np = pages_of(T);
                    if (!is_stable(f, lh) || !r.reranked[i][lh])
                        continue;
                    uint8_t rs[MAXPG], forced[MAXPG];
                    table(f, i, l, h, np, NULL, rs);
                    forced_pages(forced, T, f->ph.sink[lh], f->ph.local[lh]);
                    uint32_t nf = 0;
                    for (uint32_t pg = 0; pg < np; pg++)
                        nf += (rs[pg] & KVT_RES_DEVICE) && !forced[pg];
                    if (nf > f->ph.k[lh] * f->ph.w[lh])
                        fail_msg("step %d seq %u layer %u head %u: %u unforced device pages", step,
                                 i, l, h, nf);
                }
    }
    /* Not vacuous: pages came and went. */
    assert_true(promoted > 0 && evicted > 0 && rr_stable > 0);
    /* Every full page of a stable head went to the host exactly once. */
    TU_OK(wait_all(f));
    uint64_t full = check_offloaded(f, KVT_RES_HOST, false);
    kvt_stats s = pstats(f->p);
    assert_int_equal(s.moved_requests[KVT_DIR_DEVICE_TO_HOST], full);
    verify_all(f);
    pfx_close(f);
}

/* ---- 2. exactness of a random decode loop ------------------------------------------ */

/* A prefill chunk appended between steps (kvt_seq_append) to sequence i:
 * the full pages of stable heads that were not offloaded yet go out (and
 * are waited for), and their device copies stay only when forced or in the
 * head's top-K set. Pages offloaded before keep their host copy; their
 * device copy may go too (the library also trims the pages that left the
 * local window), but never a forced or top-K page's. */
static void chunk_between_steps(pfx *f, uint32_t i, uint32_t n)
{
    static uint8_t before[NLH][MAXPG];
    const uint32_t T0 = f->t[i].n;
    for (uint32_t lh = 0; lh < NLH; lh++)
        table(f, i, lh / N_KV_HEADS, lh % N_KV_HEADS, pages_of(T0), NULL, before[lh]);
    pfx_prefill(f, i, n);
    TU_CHECK(f->p);
    const uint32_t T = f->t[i].n, np = pages_of(T);
    for (uint32_t lh = 0; lh < NLH; lh++) {
        uint8_t rs[MAXPG], forced[MAXPG], top[MAXPG] = {0};
        table(f, i, lh / N_KV_HEADS, lh % N_KV_HEADS, np, NULL, rs);
        forced_pages(forced, T, f->ph.sink[lh], f->ph.local[lh]);
        for (uint32_t j = 0; j < f->ntopk[i][lh]; j++)
            top[f->topk[i][lh][j]] = 1;
        for (uint32_t pg = 0; pg < np; pg++) {
            const bool isfull = (pg + 1) * PAGE_TOKENS <= T, old = pg < pages_of(T0);
            const uint8_t was = old ? before[lh][pg] : 0;
            uint8_t want;
            if (!is_stable(f, lh))
                want = KVT_RES_DEVICE;
            else if (!isfull)
                want = KVT_RES_DEVICE;
            else if ((was & KVT_RES_HOST) && !forced[pg] && !top[pg] &&
                     rs[pg] == KVT_RES_HOST)
                want = KVT_RES_HOST; /* offloaded before, device copy trimmed */
            else if (was & KVT_RES_HOST)
                want = was; /* offloaded before: kept */
            else
                want = (uint8_t)(KVT_RES_HOST | (forced[pg] || top[pg] ? KVT_RES_DEVICE : 0));
            if (rs[pg] != want)
                fail_msg("chunk of %u tokens (T %u -> %u): seq %u layer %u head %u page %u: "
                         "residency %#x, expected %#x (before %#x%s%s)",
                         n, T0, T, i, lh / N_KV_HEADS, lh % N_KV_HEADS, pg, rs[pg], want, was,
                         forced[pg] ? ", forced" : "", top[pg] ? ", top-K" : "");
        }
    }
}

static void exact_loop(uint32_t window, uint64_t seed)
{
    /* Heads: (0,0) K 2; (0,1) unstable; (1,0) K 1 with two sink pages and
     * no local page (a page that fills is not forced: until its offload
     * lands it has no other copy and must not be evicted); (1,1) K 3 with
     * two local pages and interval 3. */
    pheads ph = ph_uniform(2, window, 1, 1, 4);
    ph_unstable(&ph, 0, 1);
    ph.k[2] = 1;
    ph.sink[2] = 2;
    ph.local[2] = 0;
    ph.k[3] = 3;
    ph.local[3] = 2;
    ph.iv[3] = 3;
    pfx *f = pfx_open(&ph, 600, 600, 0, seed);
    pfx_add(f, 5 * PAGE_TOKENS - 3, KEYS_RANDOM);
    pfx_add(f, 7 * PAGE_TOKENS + 10, KEYS_RANDOM);
    pfx_add(f, 9 * PAGE_TOKENS - 1, KEYS_RANDOM);
    pfx_add(f, 3, KEYS_RANDOM); /* no full page yet */
    uint32_t promoted = 0, evicted = 0;
    for (uint32_t step = 0; step < 36; step++) {
        /* Every other step waits for the moves (exact eviction model); the
         * others run with offloads still in flight. */
        const step_args a = {.wait_before = step % 2 == 0, .exact_stats = true};
        step_res r;
        pfx_step(f, &a, &r);
        promoted += r.promoted;
        evicted += r.evicted;
        check_device_count(f);
        if (step == 17) { /* a prefill chunk in the middle of the decode */
            TU_OK(wait_all(f));
            chunk_between_steps(f, 1, 2 * PAGE_TOKENS + 3);
            chunk_between_steps(f, 3, PAGE_TOKENS);
        }
        if (step == 21) {
            /* A chunk into a short sequence: 2 pages become 4. Its trim
             * drops full pages that were last or local before; the heads
             * whose budget covers all 4 pages select every page at the
             * next step, so they rerank and promote them (not due by
             * their interval, they would select pages off device). */
            TU_OK(wait_all(f));
            chunk_between_steps(f, 3, 2 * PAGE_TOKENS + 5);
        }
    }
    assert_true(promoted > 0 && evicted > 0);
    verify_all(f);
    TU_OK(wait_all(f));
    check_offloaded(f, KVT_RES_HOST, false);
    verify_all(f);
    pfx_close(f);
}

static void test_exact_window1(void **state)
{
    (void)state;
    exact_loop(1, 0xe1);
}

static void test_exact_window2(void **state)
{
    (void)state;
    exact_loop(2, 0xe2);
}

/* ---- 3./4. designed scores: lookahead eviction and recycling ------------------------ */

/* The pages each head's query points at this step: score of page j =
 * GQA_GROUP * (s_j + 10 * [j picked]) with designed keys (placetest.h). */
static uint32_t g_pick[MAXS][NLH][2];

static void designed_q(pfx *f, uint32_t layer, float *q)
{
    memset(q, 0, (size_t)f->ns * HQ * HEAD_DIM * sizeof *q);
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++)
            for (uint32_t g = 0; g < GQA_GROUP; g++) {
                float *qg = q + ((size_t)i * HQ + (size_t)h * GQA_GROUP + g) * HEAD_DIM;
                qg[0] = 1.0f;
                qg[1 + g_pick[i][layer * N_KV_HEADS + h][0]] = 10.0f;
                qg[1 + g_pick[i][layer * N_KV_HEADS + h][1]] = 10.0f;
            }
}

/* Device pages of every head, as a bit set, from the block tables. */
static uint64_t device_set(const pfx *f, uint32_t i, uint32_t lh)
{
    const uint32_t np = pages_of(f->t[i].n);
    uint8_t rs[MAXPG];
    assert_true(np <= 64);
    table(f, i, lh / N_KV_HEADS, lh % N_KV_HEADS, np, NULL, rs);
    uint64_t m = 0;
    for (uint32_t pg = 0; pg < np; pg++)
        if (rs[pg] & KVT_RES_DEVICE)
            m |= 1ull << pg;
    return m;
}

/* The designed sequences have T = n_full * PAGE_TOKENS + 1 during the
 * test: forced pages are page 0 (sink) and the partial last page;
 * candidates 1..np-2. */
static void test_lookahead_eviction(void **state)
{
    (void)state;
    const uint32_t K = 2, W = 2;
    pheads ph = ph_uniform(K, W, 1, 0, 1); /* rerank every step; no local page */
    pfx *f = pfx_open(&ph, 300, 300, 0, 0x100c);
    pfx_add(f, 16 * PAGE_TOKENS + 1, KEYS_DESIGNED);
    pfx_add(f, 11 * PAGE_TOKENS + 1, KEYS_DESIGNED);
    pfx_add(f, 12 * PAGE_TOKENS + 1, KEYS_FLAT); /* equal scores: the lower page index stays */
    const kvt_stats s0 = pstats(f->p);
    /* The model: unforced device pages per head, from the design alone. */
    uint64_t model[MAXS][NLH] = {{0}};
    uint32_t model_ev = 0, model_pr = 0;
    for (uint32_t step = 0; step < 14; step++) {
        for (uint32_t i = 0; i < f->ns; i++)
            for (uint32_t lh = 0; lh < NLH; lh++) {
                const uint32_t nc = pages_of(f->t[i].n) - 2; /* candidates 1..nc */
                uint32_t a = 1 + tu_below(&f->r, nc), b;
                do
                    b = 1 + tu_below(&f->r, nc);
                while (b == a);
                g_pick[i][lh][0] = a;
                g_pick[i][lh][1] = b;
                /* Selected: a and b (score >= 10 GQA_GROUP, every other
                 * below GQA_GROUP / 2). Evictable: the other device pages;
                 * the K*W - K of highest s stay, the rest leave. */
                const uint64_t sel = (1ull << a) | (1ull << b);
                uint64_t e = model[i][lh] & ~sel, keep = 0;
                for (uint32_t c = 0; c < K * W - K; c++) {
                    int best = -1;
                    for (uint32_t pg = 1; pg <= nc; pg++)
                        if (((e & ~keep) >> pg & 1) &&
                            (best < 0 || f->s[i][lh][pg] > f->s[i][lh][best]))
                            best = (int)pg;
                    if (best >= 0)
                        keep |= 1ull << best;
                }
                model_ev += (uint32_t)__builtin_popcountll(e & ~keep);
                model_pr += (uint32_t)__builtin_popcountll(sel & ~model[i][lh]);
                model[i][lh] = sel | keep;
            }
        const step_args a = {.wait_before = true, .exact_stats = true, .make_q = designed_q};
        step_res r;
        pfx_step(f, &a, &r);
        for (uint32_t i = 0; i < f->ns; i++)
            for (uint32_t lh = 0; lh < NLH; lh++) {
                const uint32_t np = pages_of(f->t[i].n);
                const uint64_t want = model[i][lh] | 1ull | (1ull << (np - 1));
                const uint64_t got = device_set(f, i, lh);
                if (got != want)
                    fail_msg("step %u seq %u layer %u head %u: device pages %#llx, expected "
                             "%#llx (picked %u, %u)", step, i, lh / N_KV_HEADS, lh % N_KV_HEADS,
                             (unsigned long long)got, (unsigned long long)want,
                             g_pick[i][lh][0], g_pick[i][lh][1]);
            }
        check_device_count(f);
    }
    kvt_stats s = pstats(f->p);
    assert_int_equal(s.evicted_pages - s0.evicted_pages, model_ev);
    assert_int_equal(s.promoted_pages - s0.promoted_pages, model_pr);
    assert_true(model_ev > 20); /* the window really overflowed, many times */
    verify_all(f);
    pfx_close(f);
}

/* Window 1: a rerank that swaps pages hands the evicted blocks to the
 * promoted pages; the device tier does not grow. */
static void test_recycling(void **state)
{
    (void)state;
    pheads ph = ph_uniform(2, 1, 1, 0, 1); /* forced: sink and the partial page */
    pfx *f = pfx_open(&ph, 300, 300, 0, 0x2ec);
    pfx_add(f, 14 * PAGE_TOKENS + 1, KEYS_DESIGNED);
    pfx_add(f, 9 * PAGE_TOKENS + 1, KEYS_DESIGNED);
    uint32_t prev[MAXS][NLH][2] = {{{0}}};
    for (uint32_t step = 0; step < 10; step++) {
        /* Step 0: first pair. Odd steps: a pair disjoint from the last (two
         * swaps per head); even steps: one page kept, one swapped. */
        uint32_t swaps = 0;
        for (uint32_t i = 0; i < f->ns; i++)
            for (uint32_t lh = 0; lh < NLH; lh++) {
                const uint32_t nc = pages_of(f->t[i].n) - 2;
                uint32_t a, b;
                do {
                    a = 1 + tu_below(&f->r, nc);
                    b = 1 + tu_below(&f->r, nc);
                    if (step && step % 2 == 0)
                        a = prev[i][lh][0];
                } while (a == b || (step && (b == prev[i][lh][0] || b == prev[i][lh][1])) ||
                         (step % 2 == 1 && (a == prev[i][lh][0] || a == prev[i][lh][1])));
                swaps += step == 0 ? 0 : step % 2 ? 2 : 1;
                g_pick[i][lh][0] = prev[i][lh][0] = a;
                g_pick[i][lh][1] = prev[i][lh][1] = b;
            }
        TU_OK(wait_all(f));
        const kvt_stats s0 = pstats(f->p);
        const step_args a = {.wait_before = true, .exact_stats = true, .make_q = designed_q};
        step_res r;
        pfx_step(f, &a, &r);
        TU_OK(wait_all(f));
        const kvt_stats s1 = pstats(f->p);
        if (step == 0) {
            assert_int_equal(r.promoted, 2 * f->ns * NLH);
            assert_int_equal(r.evicted, 0);
            continue;
        }
        assert_int_equal(r.evicted, swaps);
        assert_int_equal(r.promoted, swaps);
        assert_int_equal(s1.recycled_blocks - s0.recycled_blocks, swaps);
        assert_int_equal(s1.evicted_pages - s0.evicted_pages, swaps);
        assert_int_equal(s1.promoted_pages - s0.promoted_pages, swaps);
        /* No new page this step (the last page stays partial): the device
         * tier holds as many blocks as before. */
        assert_int_equal(s1.tier[KVT_TIER_DEVICE].blocks_used,
                         s0.tier[KVT_TIER_DEVICE].blocks_used);
        assert_int_equal(s1.tier[KVT_TIER_DEVICE].pages, s0.tier[KVT_TIER_DEVICE].pages);
    }
    verify_all(f);
    pfx_close(f);
}

/* ---- 5./6. warm-up, readiness, pauses ------------------------------------------------ */

/* The device set and first top-K set kvt_seq_warmup must give each stable
 * head: importance = sum over the obs queries of the MINMAX/SUM score (in
 * double, from the page metadata). */
static uint8_t g_wset[MAXS][NLH][MAXPG], g_wtop[MAXS][NLH][MAXPG];

static void warm_expect(pfx *f, uint32_t i, const float *obs, uint32_t n_obs)
{
    const uint32_t T = f->t[i].n, np = pages_of(T);
    for (uint32_t l = 0; l < N_LAYERS; l++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            const uint32_t lh = l * N_KV_HEADS + h;
            double imp[MAXPG] = {0}, sc[MAXPG];
            for (uint32_t o = 0; o < n_obs; o++) {
                ref_scores(f, i, l, h, np,
                           obs + (((size_t)l * n_obs + o) * HQ + h * GQA_GROUP) * HEAD_DIM, sc,
                           NULL);
                for (uint32_t pg = 0; pg < np; pg++)
                    imp[pg] += sc[pg];
            }
            uint8_t forced[MAXPG];
            forced_pages(forced, T, f->ph.sink[lh], f->ph.local[lh]);
            top_n(imp, forced, np, f->ph.k[lh] * f->ph.w[lh], g_wset[i][lh]);
            top_n(imp, forced, np, f->ph.k[lh], g_wtop[i][lh]);
            /* The head's first top-K set: a step that does not rescore it
             * reuses these (pfx_step compares with f->topk). */
            f->ntopk[i][lh] = 0;
            for (uint32_t pg = 0; pg < np; pg++) {
                g_wset[i][lh][pg] |= forced[pg];
                if (g_wtop[i][lh][pg])
                    f->topk[i][lh][f->ntopk[i][lh]++] = pg;
            }
        }
}

static float *random_obs(pfx *f, uint32_t n_obs)
{
    float *obs = malloc((size_t)N_LAYERS * n_obs * HQ * HEAD_DIM * sizeof *obs);
    for (size_t e = 0; e < (size_t)N_LAYERS * n_obs * HQ * HEAD_DIM; e++)
        obs[e] = 2.0f * tu_unit(&f->r);
    return obs;
}

/* After the plan: a ready sequence has every page of its warm-up device set
 * on device already. */
static void ready_after_warmup(pfx *f, kvt_step *st)
{
    for (uint32_t i = 0; i < f->ns; i++) {
        uint32_t ready = 9;
        TU_OK(kvt_step_ready_get(st, i, &ready));
        assert_true(ready <= 1);
        f->warm_pending[i] = !ready;
        for (uint32_t lh = 0; ready && lh < NLH; lh++) {
            uint8_t rs[MAXPG];
            const uint32_t np = pages_of(f->t[i].n);
            table(f, i, lh / N_KV_HEADS, lh % N_KV_HEADS, np, NULL, rs);
            for (uint32_t pg = 0; pg < np; pg++)
                if (g_wset[i][lh][pg] && !(rs[pg] & KVT_RES_DEVICE))
                    fail_msg("seq %u ready after the plan, but warm-up page %u of layer %u head "
                             "%u is not on device", i, pg, lh / N_KV_HEADS, lh % N_KV_HEADS);
        }
    }
}

static void test_ready_pause(void **state)
{
    (void)state;
    pheads ph = ph_uniform(2, 2, 1, 1, 4);
    ph_unstable(&ph, 0, 0);
    pfx *f = pfx_open(&ph, 500, 500, 0, 0x5ead);
    const uint32_t lens[3] = {9 * PAGE_TOKENS + 3, 11 * PAGE_TOKENS + 7, 6 * PAGE_TOKENS + 20};
    for (uint32_t round = 0; round < 2; round++) {
        for (uint32_t j = 0; j < 3; j++) {
            const uint32_t i = pfx_add(f, lens[j] + round, KEYS_RANDOM);
            float *obs = random_obs(f, 2);
            warm_expect(f, i, obs, 2);
            TU_OK(kvt_seq_warmup(f->p, f->t[i].id, obs, 2));
            f->warm_pending[i] = true;
            free(obs);
            TU_CHECK(f->p);
        }
        /* Steps right away, the warm-up copies possibly still in flight:
         * readiness implies residency (at the first plan, of the warm-up's
         * device set; after each rerank, of the selection); the decode waits
         * for the rest. */
        const step_args a0 = {.after_plan = ready_after_warmup}, a = {0};
        const kvt_stats s0 = pstats(f->p);
        step_res r;
        pfx_step(f, &a0, &r);
        pfx_step(f, &a, &r);
        /* Waiting for every move makes every sequence ready, and then no
         * decode pauses (pfx_step checks paused_seqs against the count of
         * sequences not ready). */
        const step_args w = {.wait_after_plan = true, .wait_after_rerank = true};
        pfx_step(f, &w, &r);
        assert_int_equal(r.not_ready, 0);
        pfx_step(f, &w, &r);
        const kvt_stats s1 = pstats(f->p);
        assert_true(s1.sel_pages > s0.sel_pages && s1.sel_resident >= s0.sel_resident);
        assert_true(s1.sel_resident <= s1.sel_pages);
        assert_true(s1.paused_seqs >= s0.paused_seqs);
        /* Paused (sequence, layer) decodes: at most one per sequence, layer
         * and step. */
        assert_true(s1.paused_seqs - s0.paused_seqs <= 2u * f->ns * N_LAYERS);
        verify_all(f);
        if (round == 0) {
            TU_OK(wait_all(f));
            check_offloaded(f, KVT_RES_HOST, false);
            while (f->ns)
                pfx_release(f, 0);
            f->off_base = pstats(f->p).offloaded_pages;
        }
    }
    TU_OK(wait_all(f));
    check_offloaded(f, KVT_RES_HOST, false);
    pfx_close(f);
}

/* Obs queries for a designed sequence i, [N_LAYERS][nobs][HQ][HEAD_DIM]:
 * obs o of head lh points at two random candidate pages, so that the
 * importance of page pg is GQA_GROUP * (nobs * s_pg + 10 * votes_pg),
 * computed here from the design alone into imp[lh][pg]. */
static float *designed_obs(pfx *f, uint32_t i, uint32_t nobs, double imp[NLH][MAXPG])
{
    const uint32_t np = pages_of(f->t[i].n), nc = np - 2;
    float *obs = calloc((size_t)N_LAYERS * nobs * HQ * HEAD_DIM, sizeof *obs);
    for (uint32_t lh = 0; lh < NLH; lh++) {
        for (uint32_t pg = 0; pg < np; pg++)
            imp[lh][pg] = GQA_GROUP * nobs * f->s[i][lh][pg];
        for (uint32_t o = 0; o < nobs; o++) {
            uint32_t a = 1 + tu_below(&f->r, nc), b;
            do
                b = 1 + tu_below(&f->r, nc);
            while (b == a);
            for (uint32_t g = 0; g < GQA_GROUP; g++) {
                const uint32_t l = lh / N_KV_HEADS, h = lh % N_KV_HEADS;
                float *q = obs + (((size_t)l * nobs + o) * HQ + h * GQA_GROUP + g) * HEAD_DIM;
                q[0] = 1.0f;
                q[1 + a] = q[1 + b] = 10.0f;
            }
            imp[lh][a] += GQA_GROUP * 10.0;
            imp[lh][b] += GQA_GROUP * 10.0;
        }
    }
    return obs;
}

/* Warm-up with designed keys and obs queries: importance order known from
 * the design (and recomputed from the page metadata). */
static void test_warmup_importance(void **state)
{
    (void)state;
    enum { NOBS = 3 };
    pheads ph = ph_uniform(2, 2, 1, 1, 8);
    ph_unstable(&ph, 1, 1);
    pfx *f = pfx_open(&ph, 300, 300, 0, 0x3a7);
    pfx_add(f, 16 * PAGE_TOKENS + 1, KEYS_DESIGNED);
    pfx_add(f, 13 * PAGE_TOKENS + 1, KEYS_DESIGNED);
    const kvt_stats s0 = pstats(f->p);
    uint64_t want_promoted = 0;
    for (uint32_t i = 0; i < f->ns; i++) {
        const uint32_t np = pages_of(f->t[i].n);
        uint8_t dset[NLH][MAXPG], top[NLH][MAXPG];
        static double imp[NLH][MAXPG];
        float *obs = designed_obs(f, i, NOBS, imp);
        for (uint32_t lh = 0; lh < NLH; lh++) {
            uint8_t forced[MAXPG];
            forced_pages(forced, f->t[i].n, 1, 1);
            top_n(imp[lh], forced, np, 2 * 2, dset[lh]); /* K x w */
            top_n(imp[lh], forced, np, 2, top[lh]);      /* K */
            for (uint32_t pg = 0; pg < np; pg++)
                dset[lh][pg] |= forced[pg];
        }
        /* The same sets from the page metadata, in double (warm_expect
         * fills g_wset / g_wtop): the design holds. */
        warm_expect(f, i, obs, NOBS);
        for (uint32_t lh = 0; lh < NLH; lh++)
            if (memcmp(g_wset[i][lh], dset[lh], np) || memcmp(g_wtop[i][lh], top[lh], np))
                fail_msg("test design: seq %u head %u: importance from the metadata differs "
                         "from the design", i, lh);
        TU_OK(kvt_seq_warmup(f->p, f->t[i].id, obs, NOBS));
        free(obs);
        for (uint32_t lh = 0; lh < NLH; lh++)
            want_promoted += is_stable(f, lh) ? 4 : 0;
    }
    /* Once the copies land: each stable head's device set is its forced
     * pages plus the K x w most important; the host has every full page. */
    TU_OK(wait_all(f));
    TU_OK(kvt_mover_poll(f->m, KVT_FENCE_ALL));
    TU_CHECK(f->p);
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t lh = 0; lh < NLH; lh++) {
            const uint32_t np = pages_of(f->t[i].n);
            uint8_t rs[MAXPG];
            table(f, i, lh / N_KV_HEADS, lh % N_KV_HEADS, np, NULL, rs);
            for (uint32_t pg = 0; pg < np; pg++) {
                const bool want = !is_stable(f, lh) || g_wset[i][lh][pg];
                if (((rs[pg] & KVT_RES_DEVICE) != 0) != want)
                    fail_msg("after warm-up: seq %u layer %u head %u page %u: residency %#x, "
                             "%s on device", i, lh / N_KV_HEADS, lh % N_KV_HEADS, pg, rs[pg],
                             want ? "expected" : "not expected");
            }
        }
    kvt_stats s1 = pstats(f->p);
    assert_int_equal(s1.promoted_pages - s0.promoted_pages, want_promoted);
    assert_int_equal(s1.evicted_pages - s0.evicted_pages, 0);
    check_offloaded(f, KVT_RES_HOST, false);

    /* The first step: a head that is not due reuses the warm-up's top-K
     * (pfx_step compares a reused selection with f->topk, which
     * warm_expect set to the K most important pages). */
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t lh = 0; lh < NLH; lh++)
            assert_int_equal(f->ntopk[i][lh], 2);
    const step_args a = {.wait_before = true, .exact_stats = true};
    step_res r;
    pfx_step(f, &a, &r);
    uint32_t reused = 0;
    for (uint32_t i = 0; i < f->ns; i++)
        for (uint32_t lh = 0; lh < NLH; lh++)
            reused += is_stable(f, lh) && !r.reranked[i][lh];
    /* Two sequences get different rerank phases (interval 8): at least one
     * of them is not due at its first step. */
    if (reused == 0)
        fail_msg("every stable head rescored at the first step after warm-up; the warm-up's "
                 "top-K set was never used");
    for (int step = 0; step < 6; step++)
        pfx_step(f, &a, &r);
    verify_all(f);
    pfx_close(f);
}

/* With a disk tier and a host that cannot hold the sequence's pages, the
 * warm-up leaves the most important pages on the host: among the full pages
 * of stable heads that the warm-up did not promote (those are in flight to
 * the device; their host copies are left alone), every page with a host
 * copy is more important than every page without one, and the host is
 * used up to its capacity. */
static void test_warmup_host_cache(void **state)
{
    (void)state;
    enum { NOBS = 2 };
    pheads ph = ph_uniform(2, 2, 1, 1, 8);
    ph_unstable(&ph, 0, 1);
    pfx *f = pfx_open(&ph, 300, 11, 8u << 20, 0x4c);
    const uint32_t i = pfx_add(f, 16 * PAGE_TOKENS + 1, KEYS_DESIGNED), np = 17;
    TU_OK(wait_all(f));
    check_offloaded(f, KVT_RES_DISK, false);
    static double imp[NLH][MAXPG];
    float *obs = designed_obs(f, i, NOBS, imp);
    warm_expect(f, i, obs, NOBS); /* g_wset: forced + K x w per stable head */
    uint8_t before[NLH][MAXPG];
    for (uint32_t lh = 0; lh < NLH; lh++)
        table(f, i, lh / N_KV_HEADS, lh % N_KV_HEADS, np, NULL, before[lh]);
    TU_OK(kvt_seq_warmup(f->p, f->t[i].id, obs, NOBS));
    free(obs);
    TU_OK(wait_all(f));
    TU_CHECK(f->p);
    const kvt_stats s = pstats(f->p);
    const uint64_t host_total = s.tier[KVT_TIER_HOST].blocks_total;
    double lo = INFINITY, hi = -INFINITY;
    uint32_t n_rest = 0, n_rest_host = 0, n_busy_host = 0;
    for (uint32_t lh = 0; lh < NLH; lh++) {
        if (!is_stable(f, lh))
            continue;
        uint8_t rs[MAXPG], forced[MAXPG];
        table(f, i, lh / N_KV_HEADS, lh % N_KV_HEADS, np, NULL, rs);
        forced_pages(forced, f->t[i].n, 1, 1);
        for (uint32_t pg = 0; pg + 1 < np; pg++) { /* the full pages */
            const bool promoted = g_wset[i][lh][pg] && !forced[pg];
            const bool host = (rs[pg] & KVT_RES_HOST) != 0;
            if (!(rs[pg] & KVT_RES_DISK))
                fail_msg("head %u page %u: residency %#x, no disk copy", lh, pg, rs[pg]);
            if (promoted) {
                n_busy_host += host;
                continue;
            }
            n_rest++;
            n_rest_host += host;
            if (host)
                lo = imp[lh][pg] < lo ? imp[lh][pg] : lo;
            else
                hi = imp[lh][pg] > hi ? imp[lh][pg] : hi;
        }
    }
    if (lo < hi)
        fail_msg("the host keeps a page of importance %g but not one of %g", lo, hi);
    const uint64_t room = host_total - n_busy_host;
    assert_int_equal(n_rest_host, n_rest < room ? n_rest : room);
    assert_true(n_rest_host > 0 && n_rest_host < n_rest); /* the cache was really full */
    /* The sequence decodes exactly from here. */
    const step_args a = {.wait_before = true, .exact_stats = true};
    for (int step = 0; step < 4; step++) {
        step_res r;
        pfx_step(f, &a, &r);
    }
    verify_all(f);
    pfx_close(f);
}

/* ---- 7. KVT_ENOSPC leaves the pool unchanged ----------------------------------------- */

static void test_enospc(void **state)
{
    (void)state;
    /* 24 usable device blocks. Sequence A (8 full pages + 1 token): its
     * prefill holds 9 pages of both heads of a layer at once (18 + the 4
     * forced blocks of layer 0), then keeps 2 forced pages per head (8
     * blocks). Four one-token fillers take 4 blocks each: none is left. */
    pheads ph = ph_uniform(2, 1, 1, 0, 4); /* forced: sink and the partial page */
    pfx *f = pfx_open(&ph, 1 + 24, 200, 0, 0xe05);
    pfx_add(f, 8 * PAGE_TOKENS + 1, KEYS_RANDOM);
    for (int j = 0; j < 4; j++)
        pfx_add(f, 1, KEYS_RANDOM);
    TU_OK(wait_all(f));
    kvt_stats s = pstats(f->p);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].blocks_total, 24);
    assert_int_equal(s.tier[KVT_TIER_DEVICE].blocks_free, 0);
    snap s0;
    snap_take(&s0, f);

    /* A step of A: every stable head is due (nothing selected yet) and must
     * promote K pages, with no free block. */
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    kvt_step *st = (kvt_step *)&so;
    kvt_clear_error();
    int rc = kvt_step_plan(f->p, &f->t[0].id, 1, &so, &st);
    if (rc != KVT_ENOSPC)
        fail_msg("kvt_step_plan with no free device block and 4 due heads: %s (%s)",
                 kvt_err_name(rc), kvt_last_error());
    assert_ptr_equal(st, (kvt_step *)&so); /* untouched on failure */
    snap_same(&s0, f, "a plan refused with KVT_ENOSPC");

    /* A prefill that needs new pages (one per head) does not fit either. */
    static uint16_t k[PAGE_TOKENS * N_KV_HEADS * HEAD_DIM], v[PAGE_TOKENS * N_KV_HEADS * HEAD_DIM];
    for (size_t e = 0; e < (size_t)PAGE_TOKENS * N_KV_HEADS * HEAD_DIM; e++) {
        k[e] = f16_moderate(&f->r);
        v[e] = f16_moderate(&f->r);
    }
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        kvt_clear_error();
        rc = kvt_seq_append(f->p, f->t[1].id, l, k, v, PAGE_TOKENS, KVT_DTYPE_F16, 0);
        if (rc != KVT_ENOSPC)
            fail_msg("kvt_seq_append of %u tokens into a full device tier: %s (%s)", PAGE_TOKENS,
                     kvt_err_name(rc), kvt_last_error());
        snap_same(&s0, f, "an append refused with KVT_ENOSPC");
    }
    verify_all(f);

    /* With the fillers gone there is room (16 blocks for at most 8
     * promotions): the step runs and is exact. */
    while (f->ns > 1)
        pfx_release(f, f->ns - 1);
    const step_args a = {.wait_before = true, .exact_stats = true};
    step_res r;
    pfx_step(f, &a, &r);
    assert_int_equal(r.promoted, 2 * NLH);
    pfx_step(f, &a, &r);
    verify_all(f);
    free(s0.b);
    pfx_close(f);
}

/* ---- 8. sizing ---------------------------------------------------------------------- */

/* The spec's formula, from the per-head values the test chose (ph NULL = no
 * policy). */
static kvt_pool_sizing want_sizing(const pheads *ph, uint64_t T, uint32_t S)
{
    const uint64_t Sx = S ? S : 1, np = (T + PAGE_TOKENS - 1) / PAGE_TOKENS,
                   block = 2ull * PAGE_TOKENS * HEAD_DIM * 2, meta = 3ull * HEAD_DIM * 2;
    uint64_t dev = 0, nstable = 0;
    for (uint32_t b = 0; b < NLH; b++) {
        if (ph && ph->cls[b] == KVT_HEAD_STABLE) {
            uint64_t want = ph->sink[b] + ph->local[b] + 1 + (uint64_t)ph->k[b] * ph->w[b] +
                            (ph->iv[b] + PAGE_TOKENS - 1) / PAGE_TOKENS + 1;
            dev += want < np ? want : np;
            nstable++;
        } else {
            dev += np;
        }
    }
    kvt_pool_sizing w;
    memset(&w, 0, sizeof w);
    w.struct_size = sizeof w;
    w.device_pages = Sx * dev;
    w.device_bytes = (w.device_pages + 1) * block;
    w.dense_pages = Sx * NLH * np;
    w.dense_bytes = (w.dense_pages + 1) * block;
    w.host_bytes = (Sx * nstable * (T / PAGE_TOKENS) + 1) * block;
    w.meta_bytes = Sx * NLH * np * meta;
    return w;
}

static void test_sizing(void **state)
{
    (void)state;
    pheads pa = ph_uniform(3, 2, 1, 2, 16);
    pheads pb = ph_uniform(2, 1, 1, 1, 4);
    ph_unstable(&pb, 0, 1);
    pb.k[2] = 4;
    pb.w[2] = 3;
    pb.sink[2] = 0;
    pb.iv[2] = 40;
    pb.k[3] = 1;
    pb.w[3] = 2;
    pb.sink[3] = 2;
    pb.local[3] = 3;
    pb.iv[3] = 70;
    const pheads *pols[3] = {&pa, &pb, NULL};
    const uint64_t Ts[4] = {1000, 50, 7, 5000};
    const uint32_t Ss[3] = {0, 1, 3};
    for (int pi = 0; pi < 3; pi++) {
        kvt_policy *pol = pols[pi] ? policy_of(pols[pi]) : NULL;
        for (int ti = 0; ti < 4; ti++)
            for (int si = 0; si < 3; si++) {
                kvt_pool_opts o =
                    tu_opts(N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, 0, 2);
                o.policy = pol;
                o.target_tokens = Ts[ti];
                o.target_seqs = Ss[si];
                kvt_pool_sizing got;
                memset(&got, 0xee, sizeof got);
                got.struct_size = sizeof got;
                got.reserved = 0;
                TU_OK(kvt_pool_sizing_get(&o, &got));
                kvt_pool_sizing want = want_sizing(pols[pi], Ts[ti], Ss[si]);
                char what[96];
                snprintf(what, sizeof what, "policy %d, T %llu, S %u", pi,
                         (unsigned long long)Ts[ti], Ss[si]);
#define SZ(field)                                                                        \
    if (got.field != want.field)                                                         \
        fail_msg("%s: " #field " %llu, expected %llu", what, (unsigned long long)got.field, \
                 (unsigned long long)want.field)
                SZ(device_pages);
                SZ(device_bytes);
                SZ(dense_pages);
                SZ(dense_bytes);
                SZ(meta_bytes);
                if (pol)
                    SZ(host_bytes);
#undef SZ
                if (!pol && (got.device_bytes != got.dense_bytes ||
                             got.device_pages != got.dense_pages))
                    fail_msg("%s: without a policy device != dense", what);
            }
        kvt_policy_destroy(pol);
    }

    /* A pool sized by its targets: device_bytes 0, 2 sequences of 16 pages.
     * A prefill and a decode up to exactly the target never run out. */
    pheads pc = ph_uniform(2, 2, 1, 1, 4);
    ph_unstable(&pc, 1, 0);
    pfx *f = pfx_new(&pc, 0x512e);
    kvt_pool_opts o = pfx_opts(f, 0, 2, 0);
    o.target_tokens = 16 * PAGE_TOKENS;
    o.target_seqs = 2;
    kvt_pool_sizing sz = {.struct_size = sizeof sz};
    TU_OK(kvt_pool_sizing_get(&o, &sz));
    kvt_pool_sizing want = want_sizing(&pc, 16 * PAGE_TOKENS, 2);
    assert_int_equal(sz.device_pages, want.device_pages);
    o.host_bytes = sz.host_bytes;
    TU_OK(kvt_pool_create(&o, &f->p));
    f->m = mover_of(f->p);
    kvt_stats s = pstats(f->p);
    assert_true(s.tier[KVT_TIER_DEVICE].blocks_total >= sz.device_pages);
    assert_true(s.tier[KVT_TIER_DEVICE].blocks_total < sz.dense_pages);
    pfx_add(f, 13 * PAGE_TOKENS + 5, KEYS_RANDOM);
    pfx_add(f, 13 * PAGE_TOKENS + 5, KEYS_RANDOM);
    const step_args a = {.exact_stats = true};
    while (f->t[0].n < 16 * PAGE_TOKENS) {
        step_res r;
        pfx_step(f, &a, &r); /* fails on KVT_ENOSPC */
    }
    assert_int_equal(seq_len(f, 0, N_LAYERS - 1), 16 * PAGE_TOKENS);
    TU_OK(wait_all(f));
    check_offloaded(f, KVT_RES_HOST, false);
    verify_all(f);
    pfx_close(f);
}

/* ---- 9. dirty ranges ------------------------------------------------------------------- */

static void test_dirty_ranges(void **state)
{
    (void)state;
    pheads ph = ph_uniform(2, 2, 1, 1, 3);
    ph_unstable(&ph, 1, 1);
    pfx *f = pfx_open(&ph, 400, 400, 0, 0xd1);
    pfx_add(f, 7 * PAGE_TOKENS - 4, KEYS_RANDOM); /* fills a page during the test */
    pfx_add(f, 10 * PAGE_TOKENS + 9, KEYS_RANDOM);
    uint32_t dirty = 0, clean = 0;
    for (uint32_t step = 0; step < 14; step++) {
        /* pfx_step compares every (layer, sequence, head)'s device table with
         * the plan's and checks the reported range covers each change, and
         * that an unchanged head reports an empty range. */
        const step_args a = {.wait_before = step % 2 == 1, .exact_stats = true};
        step_res r;
        pfx_step(f, &a, &r);
        dirty += r.dirty_heads;
        clean += r.clean_heads;
    }
    /* Both kinds were seen: reranks that moved pages (and appends opening a
     * page), and heads that reused their pages. */
    assert_true(dirty > 0 && clean > 0);
    pfx_close(f);
}

/* ---- 10. bad input ---------------------------------------------------------------------- */

static void test_bad_input(void **state)
{
    (void)state;
    char report[4096] = "";
    size_t used = 0;
#define EXPECT(call, code, needle)                                                         \
    do {                                                                                   \
        kvt_clear_error();                                                                 \
        int rc_ = (call);                                                                  \
        if ((rc_ != (code) || !strstr(kvt_last_error(), (needle))) && used < sizeof report) \
            used += (size_t)snprintf(report + used, sizeof report - used,                  \
                                     "\n  %s: %s '%s' (expected %s naming '%s')", #call,    \
                                     kvt_err_name(rc_), kvt_last_error(), #code, (needle)); \
    } while (0)
    pheads ph = ph_uniform(2, 1, 1, 1, 4);
    ph_unstable(&ph, 1, 1);
    pfx *f = pfx_open(&ph, 200, 200, 0, 0xbad);
    pfx_add(f, 5 * PAGE_TOKENS + 3, KEYS_RANDOM);
    pfx_add(f, 2 * PAGE_TOKENS, KEYS_RANDOM);
    kvt_seq_id gone;
    TU_OK(kvt_seq_create(f->p, NULL, &gone));
    TU_OK(kvt_seq_release(f->p, gone));
    float *obs = random_obs(f, 2), q[2 * HQ * HEAD_DIM];
    for (size_t e = 0; e < 2 * HQ * HEAD_DIM; e++)
        q[e] = tu_unit(&f->r);
    TU_OK(wait_all(f));
    snap s0;
    snap_take(&s0, f);

    /* The per-step calls. */
    kvt_step_opts so = KVT_STEP_OPTS_INIT;
    kvt_step *st;
    kvt_seq_id ids[2] = {f->t[0].id, f->t[1].id};
    TU_OK(kvt_step_plan(f->p, ids, 2, &so, &st));
    uint32_t ready = 0, first = 0, n = 0;
    EXPECT(kvt_step_select(NULL, 0, q), KVT_EINVAL, "step");
    EXPECT(kvt_step_select(st, N_LAYERS, q), KVT_EINVAL, "layer");
    EXPECT(kvt_step_select(st, 0, NULL), KVT_EINVAL, "q");
    EXPECT(kvt_step_ready_get(NULL, 0, &ready), KVT_EINVAL, "step");
    EXPECT(kvt_step_ready_get(st, 2, &ready), KVT_EINVAL, "seq_index");
    EXPECT(kvt_step_ready_get(st, 0, NULL), KVT_EINVAL, "ready");
    EXPECT(kvt_step_dirty_get(NULL, 0, 0, 0, &first, &n), KVT_EINVAL, "step");
    EXPECT(kvt_step_dirty_get(st, N_LAYERS, 0, 0, &first, &n), KVT_EINVAL, "layer");
    EXPECT(kvt_step_dirty_get(st, 0, 2, 0, &first, &n), KVT_EINVAL, "seq_index");
    EXPECT(kvt_step_dirty_get(st, 0, 0, N_KV_HEADS, &first, &n), KVT_EINVAL, "kv_head");
    EXPECT(kvt_step_dirty_get(st, 0, 0, 0, NULL, &n), KVT_EINVAL, "first_page");
    EXPECT(kvt_step_dirty_get(st, 0, 0, 0, &first, NULL), KVT_EINVAL, "n_pages");
    /* Warm-up while a step is open. */
    EXPECT(kvt_seq_warmup(f->p, f->t[0].id, obs, 2), KVT_ESTATE, "");
    TU_OK(kvt_step_finish(st));
    snap_same(&s0, f, "refused per-step calls");

    /* Warm-up arguments. */
    EXPECT(kvt_seq_warmup(NULL, f->t[0].id, obs, 2), KVT_EINVAL, "pool");
    EXPECT(kvt_seq_warmup(f->p, f->t[0].id, NULL, 2), KVT_EINVAL, "obs_queries");
    EXPECT(kvt_seq_warmup(f->p, f->t[0].id, obs, 0), KVT_EINVAL, "n_obs");
    EXPECT(kvt_seq_warmup(f->p, gone, obs, 2), KVT_ENOENT, "seq");
    snap_same(&s0, f, "refused warm-ups");

    /* Step options: another policy (same geometry) is refused; the pool's
     * own is accepted. */
    kvt_policy *other = policy_of(&ph);
    kvt_step_opts bad = so;
    bad.policy = other;
    st = NULL;
    EXPECT(kvt_step_plan(f->p, ids, 2, &bad, &st), KVT_EINVAL, "policy");
    if (st)
        TU_OK(kvt_step_finish(st));
    bad.policy = f->pol;
    TU_OK(kvt_step_plan(f->p, ids, 2, &bad, &st));
    TU_OK(kvt_step_finish(st));
    snap_same(&s0, f, "refused step options");

    /* Explicit moves against the policy's placement: dropping the device
     * copy of an unstable head's page, or of a stable head's sink page. */
    kvt_mover *mv;
    TU_OK(kvt_pool_mover_get(f->p, &mv));
    kvt_fence fence;
    int32_t mres[1];
    const kvt_move unst = {f->t[0].id, 1, 1, 2, KVT_TIER_DEVICE, KVT_TIER_HOST,
                           KVT_MOVE_DROP_SOURCE};
    const kvt_move sink = {f->t[0].id, 0, 0, 0, KVT_TIER_DEVICE, KVT_TIER_HOST,
                           KVT_MOVE_DROP_SOURCE};
    EXPECT(kvt_mover_submit(mv, &unst, 1, 0, mres, &fence), KVT_EINVAL, "unstable head");
    EXPECT(kvt_mover_submit(mv, &sink, 1, 0, mres, &fence), KVT_EINVAL, "sink or local");
    TU_OK(wait_all(f));
    snap_same(&s0, f, "refused moves");

    /* Pool options. */
    kvt_pool *p2 = NULL;
    kvt_pool_opts o =
        tu_opts(N_LAYERS, N_KV_HEADS, HQ, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, 64, 0);
    o.policy = f->pol;
    o.selector = f->sel;
    EXPECT(kvt_pool_create(&o, &p2), KVT_EINVAL, "policy"); /* no host tier */
    assert_null(p2);
    o.host_bytes = 64ull * 2 * PAGE_TOKENS * HEAD_DIM * 2;
    kvt_geometry g2 = pgeom();
    g2.head_dim = 32;
    kvt_policy *pol32;
    TU_OK(kvt_policy_create(&g2, NULL, &pol32));
    kvt_selector *sel32;
    TU_OK(kvt_selector_create(&g2, NULL, &sel32));
    o.policy = pol32;
    EXPECT(kvt_pool_create(&o, &p2), KVT_EINVAL, "policy");
    o.policy = f->pol;
    o.selector = sel32;
    EXPECT(kvt_pool_create(&o, &p2), KVT_EINVAL, "selector");
    o.selector = f->sel;
    assert_null(p2);

    /* Warm-up needs a tiered pool with a selector. */
    o.target_tokens = 0;
    o.selector = NULL;
    TU_OK(kvt_pool_create(&o, &p2));
    kvt_seq_id x;
    TU_OK(kvt_seq_create(p2, NULL, &x));
    TU_OK(kvt_seq_append(p2, x, 0, f->t[0].k[0], f->t[0].v[0], 3 * PAGE_TOKENS, KVT_DTYPE_F16, 0));
    TU_OK(kvt_seq_append(p2, x, 1, f->t[0].k[1], f->t[0].v[1], 3 * PAGE_TOKENS, KVT_DTYPE_F16, 0));
    EXPECT(kvt_seq_warmup(p2, x, obs, 2), KVT_EINVAL, "pool");
    TU_CHECK(p2);
    kvt_pool_destroy(p2);
    o.policy = NULL;
    o.selector = f->sel;
    TU_OK(kvt_pool_create(&o, &p2));
    TU_OK(kvt_seq_create(p2, NULL, &x));
    TU_OK(kvt_seq_append(p2, x, 0, f->t[0].k[0], f->t[0].v[0], 3 * PAGE_TOKENS, KVT_DTYPE_F16, 0));
    TU_OK(kvt_seq_append(p2, x, 1, f->t[0].k[1], f->t[0].v[1], 3 * PAGE_TOKENS, KVT_DTYPE_F16, 0));
    EXPECT(kvt_seq_warmup(p2, x, obs, 2), KVT_EINVAL, "pool");
    TU_CHECK(p2);
    kvt_pool_destroy(p2);

    /* Sizing arguments (last: a NULL out has crashed the library). */
    kvt_pool_sizing sz = {.struct_size = sizeof sz};
    o.policy = f->pol;
    o.target_tokens = 100;
    EXPECT(kvt_pool_sizing_get(NULL, &sz), KVT_EINVAL, "opts");
    sz.struct_size = 4;
    EXPECT(kvt_pool_sizing_get(&o, &sz), KVT_EINVAL, "struct_size");
    EXPECT(kvt_pool_sizing_get(&o, NULL), KVT_EINVAL, "out");
#undef EXPECT

    snap_same(&s0, f, "bad input");
    verify_all(f);
    free(s0.b);
    free(obs);
    kvt_policy_destroy(other);
    kvt_policy_destroy(pol32);
    kvt_selector_destroy(sel32);
    pfx_close(f);
    if (used)
        fail_msg("calls that differ from the spec:%s", report);
}

/* ---- 11. a disk tier under a small host ------------------------------------------------- */

static void test_disk_small_host(void **state)
{
    (void)state;
    pheads ph = ph_uniform(2, 2, 1, 1, 4);
    ph_unstable(&ph, 0, 1);
    /* The host holds 11 pages; the stable heads offload about 80. */
    pfx *f = pfx_open(&ph, 400, 12, 8u << 20, 0xd15c);
    pfx_add(f, 8 * PAGE_TOKENS + 5, KEYS_RANDOM);
    pfx_add(f, 10 * PAGE_TOKENS, KEYS_RANDOM);
    pfx_add(f, 7 * PAGE_TOKENS + 17, KEYS_RANDOM);
    TU_OK(wait_all(f));
    check_offloaded(f, KVT_RES_DISK, false);
    verify_all(f);
    for (uint32_t step = 0; step < 20; step++) {
        const step_args a = {.wait_before = step % 2 == 0, .exact_stats = true};
        step_res r;
        pfx_step(f, &a, &r);
    }
    TU_OK(wait_all(f));
    check_offloaded(f, KVT_RES_DISK, false);
    verify_all(f);
    /* Promotions did read from the disk (through the staging buffers). */
    kvt_stats s = pstats(f->p);
    assert_true(s.moved_requests[KVT_DIR_DISK_TO_HOST] > 0);
    pfx_close(f);
}

/* Forks in a tiered pool with host and disk tiers (issue 23): children
 * inherit the parent's selection and placement, and every step of every
 * sequence is checked by pfx_step against its references (the selection
 * rule against rescored metadata, the output against double-precision
 * attention over exactly the selected pages, selected pages on device
 * after the decode, evictions only of unselected, unforced pages with
 * another copy), with kvt_pool_check after each; then the parent goes
 * first, a fork of a fork, a truncated child. A shared page is counted
 * once on the device. */
static void test_fork_tiered(void **state)
{
    (void)state;
    pheads ph = ph_uniform(3, 2, 1, 1, 4);
    ph_unstable(&ph, 1, 0);
    pfx *f = pfx_open(&ph, 160, 40, 16ull << 20, 0xf02c);
    pfx_add(f, 24 * PAGE_TOKENS + 5, KEYS_RANDOM);
    const step_args a = {0};
    step_res r;
    for (int s = 0; s < 3; s++)
        pfx_step(f, &a, &r);
    const kvt_stats s0 = pstats(f->p);
    pfx_fork(f, 0);
    pfx_fork(f, 0);
    const kvt_stats s1 = pstats(f->p);
    /* The forks copied one open page per (layer, head) each, nothing else. */
    assert_int_equal(s1.tier[KVT_TIER_DEVICE].pages - s0.tier[KVT_TIER_DEVICE].pages,
                     2 * NLH);
    assert_int_equal(s1.tier[KVT_TIER_HOST].pages, s0.tier[KVT_TIER_HOST].pages);
    assert_int_equal(s1.tier[KVT_TIER_DISK].pages, s0.tier[KVT_TIER_DISK].pages);
    check_device_count(f);
    verify_all(f);
    uint32_t rr = 0, steps = 0;
    for (int s = 0; s < 8; s++, steps++) {
        pfx_step(f, &a, &r);
        for (uint32_t i = 0; i < f->ns; i++)
            for (uint32_t lh = 0; lh < NLH; lh++)
                rr += r.reranked[i][lh];
    }
    pfx_release(f, 0); /* the parent first: the children stay whole */
    verify_all(f);
    pfx_fork(f, 1);    /* a fork of a fork */
    pfx_truncate(f, 0, f->t[0].n - 2 * PAGE_TOKENS - 3);
    pfx_truncate(f, 2, f->t[2].n - 1);
    TU_CHECK(f->p);
    verify_all(f);
    for (int s = 0; s < 8; s++, steps++)
        pfx_step(f, &a, &r);
    check_device_count(f);
    verify_all(f);
    TU_OK(wait_all(f));
    print_message("# tiered forks: %u steps, %u heads rescored in the first 8\n", steps, rr);
    pfx_close(f);
}

/* Drops the host and device copies of seq i's unforced full pages that the
 * disk holds (public moves), so the next steps read them from the disk. */
static void disk_only(pfx *f, uint32_t i)
{
    const uint32_t np = pages_of(f->t[i].n);
    for (uint32_t l = 0; l < N_LAYERS; l++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++)
            for (uint32_t pg = 1; pg + 2 < np; pg++) {
                uint8_t r = residency(f->p, f->t[i].id, l, h, pg);
                kvt_fence fe;
                if ((r & KVT_RES_DEVICE) && (r & KVT_RES_DISK)) {
                    kvt_move mv = {f->t[i].id, l, h, pg, KVT_TIER_DEVICE, KVT_TIER_DISK,
                                   KVT_MOVE_DROP_SOURCE};
                    if (kvt_mover_submit(f->m, &mv, 1, 0, NULL, &fe))
                        continue; /* forced or selected for a holder: it stays */
                    TU_OK(kvt_mover_wait(f->m, fe, UINT64_MAX));
                    r = residency(f->p, f->t[i].id, l, h, pg);
                }
                if ((r & KVT_RES_HOST) && (r & KVT_RES_DISK)) {
                    kvt_move mv = {f->t[i].id, l, h, pg, KVT_TIER_HOST, KVT_TIER_DISK,
                                   KVT_MOVE_DROP_SOURCE};
                    TU_OK(kvt_mover_submit(f->m, &mv, 1, 0, NULL, &fe));
                    TU_OK(kvt_mover_wait(f->m, fe, UINT64_MAX));
                }
            }
}

/* The same queries for every sequence: a parent and its fork select the
 * same pages, so one holder's promotion is the other's page arriving. */
static void same_q(pfx *f, uint32_t layer, float *q)
{
    (void)layer;
    for (uint32_t x = 0; x < HQ * HEAD_DIM; x++)
        q[x] = (float)(2.0 * tu_unit(&f->r));
    for (uint32_t i = 1; i < f->ns; i++)
        memcpy(q + (size_t)i * HQ * HEAD_DIM, q, HQ * HEAD_DIM * sizeof *q);
}

/* Holders of shared pages in one step (found by review): a page another
 * holder is promoting is waited for before the decode reads it (every
 * decode succeeds and matches the reference over the pages it selected,
 * with the pages living only on disk before each step); a fork warms up
 * right after its parent; a shared page whose copy-out failed goes out
 * once when both holders step (no EBUSY at every finish); and a public
 * move may not drop a page another holder keeps as its last page. */
static void test_fork_holders_in_one_step(void **state)
{
    (void)state;
    pheads ph = ph_uniform(3, 2, 1, 1, 1); /* interval 1: rerank every step */
    pfx *f = pfx_open(&ph, 400, 400, 16ull << 20, 0x5eed);
    pfx_add(f, 20 * PAGE_TOKENS + 5, KEYS_RANDOM);
    TU_OK(wait_all(f));
    disk_only(f, 0);
    pfx_fork(f, 0);
    TU_CHECK(f->p);
    const step_args a = {.make_q = same_q};
    step_res r;
    for (int it = 0; it < 6; it++) {
        disk_only(f, 0);
        disk_only(f, 1);
        pfx_step(f, &a, &r); /* fails on a decode error or a wrong output */
        TU_OK(wait_all(f));
    }
    verify_all(f);
    pfx_close(f);

    /* Warm-up of a fork right after its parent's. */
    ph = ph_uniform(3, 2, 1, 1, 4);
    f = pfx_open(&ph, 400, 400, 16ull << 20, 0x5eee);
    pfx_add(f, 20 * PAGE_TOKENS + 5, KEYS_RANDOM);
    TU_OK(wait_all(f));
    disk_only(f, 0);
    pfx_fork(f, 0);
    float *obs = malloc((size_t)N_LAYERS * 4 * HQ * HEAD_DIM * sizeof *obs);
    for (size_t x = 0; x < (size_t)N_LAYERS * 4 * HQ * HEAD_DIM; x++)
        obs[x] = (float)tu_unit(&f->r);
    TU_OK(kvt_seq_warmup(f->p, f->t[0].id, obs, 4));
    TU_OK(kvt_seq_warmup(f->p, f->t[1].id, obs, 4));
    free(obs);
    TU_OK(wait_all(f));
    TU_CHECK(f->p);
    pfx_close(f);

    /* A copy-out that found the host full, then both holders step (every
     * step reranks: the test's manual step leaves no top-K to model). */
    const pheads ph1 = ph_uniform(3, 2, 1, 1, 1);
    f = pfx_open(&ph1, 400, 120, 0, 0x5eef);
    pfx_add(f, 10 * PAGE_TOKENS + 31, KEYS_RANDOM);
    TU_OK(wait_all(f));
    const uint32_t fr = pstats(f->p).tier[KVT_TIER_HOST].blocks_free;
    pfx_add(f, (fr / NLH) * PAGE_TOKENS + 3, KEYS_RANDOM); /* fills the host */
    TU_OK(wait_all(f));
    pfx_release(f, 1);
    pfx_add(f, (fr / NLH) * PAGE_TOKENS + 3, KEYS_RANDOM);
    TU_OK(wait_all(f));
    {   /* one step of the first: page 10 fills, no room to copy it out */
        kvt_step_opts so;
        TU_OK(kvt_step_opts_init(&so));
        kvt_step *st;
        TU_OK(kvt_step_plan(f->p, &f->t[0].id, 1, &so, &st));
        uint16_t k[N_KV_HEADS * HEAD_DIM], v[N_KV_HEADS * HEAD_DIM];
        float q[HQ * HEAD_DIM], out[HQ * HEAD_DIM], lse[HQ];
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            for (uint32_t x = 0; x < N_KV_HEADS * HEAD_DIM; x++) {
                k[x] = f16_moderate(&f->r);
                v[x] = f16_moderate(&f->r);
                f->t[0].k[l][(size_t)f->t[0].n * N_KV_HEADS * HEAD_DIM + x] = k[x];
                f->t[0].v[l][(size_t)f->t[0].n * N_KV_HEADS * HEAD_DIM + x] = v[x];
            }
            for (uint32_t x = 0; x < HQ * HEAD_DIM; x++)
                q[x] = (float)tu_unit(&f->r);
            TU_OK(kvt_step_append(st, l, k, v, KVT_DTYPE_F16, 0));
            TU_OK(kvt_step_attend(st, l, q, out, lse));
        }
        TU_EXPECT_ERR(kvt_step_finish(st), KVT_ENOSPC, "host tier");
        f->t[0].n++;
        TU_OK(wait_all(f));
    }
    const step_args one = {0};
    pfx_fork(f, 0);
    pfx_release(f, 1); /* the filler goes: room again */
    for (int it = 0; it < 3; it++) {
        pfx_step(f, &one, &r); /* pfx_step fails on a finish error */
        TU_OK(wait_all(f));
    }
    for (uint32_t lh = 0; lh < NLH; lh++)
        if (is_stable(f, lh))
            assert_true(residency(f->p, f->t[0].id, lh / N_KV_HEADS, lh % N_KV_HEADS, 10) &
                        KVT_RES_HOST);
    pfx_close(f);

    /* A page that is another holder's last page stays on the device. */
    f = pfx_open(&ph, 400, 400, 16ull << 20, 0x5ef0);
    pfx_add(f, 20 * PAGE_TOKENS + 5, KEYS_RANDOM);
    TU_OK(wait_all(f));
    pfx_fork(f, 0);
    pfx_truncate(f, 1, 10 * PAGE_TOKENS); /* page 9: the child's last page */
    TU_CHECK(f->p);
    kvt_move mv = {f->t[0].id, 0, 0, 9, KVT_TIER_DEVICE, KVT_TIER_HOST, KVT_MOVE_DROP_SOURCE};
    kvt_fence fe = 1;
    TU_EXPECT_ERR(kvt_mover_submit(f->m, &mv, 1, 0, NULL, &fe), KVT_EINVAL, "shares");
    TU_CHECK(f->p);
    verify_all(f);
    pfx_close(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_class_placement),   cmocka_unit_test(test_exact_window1),
        cmocka_unit_test(test_exact_window2),     cmocka_unit_test(test_lookahead_eviction),
        cmocka_unit_test(test_recycling),         cmocka_unit_test(test_ready_pause),
        cmocka_unit_test(test_warmup_importance), cmocka_unit_test(test_warmup_host_cache),
        cmocka_unit_test(test_enospc),
        cmocka_unit_test(test_sizing),            cmocka_unit_test(test_dirty_ranges),
        cmocka_unit_test(test_bad_input),         cmocka_unit_test(test_disk_small_host),
        cmocka_unit_test(test_fork_tiered),         cmocka_unit_test(test_fork_holders_in_one_step),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
