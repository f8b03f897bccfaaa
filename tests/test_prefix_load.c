/* The prefix cache under load (issue 25): pressure on a small device-only
 * pool, and random multi-request workloads on tiered pools with host and
 * disk tiers (with and without per-tier caps). The references are
 * prefixtest.h's: rows that follow from the token ids, double-precision
 * attention for every decode, the model of the index as an upper bound of
 * what is attached, and kvt_pool_check after every operation. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prefixtest.h"

static void test_pressure(void **state)
{
    (void)state;
    model_reset();
    const uint32_t dev = 8 * 4 * N_LAYERS * H + 1; /* 8 pages per head */
    kvt_pool_opts o = cache_opts(dev, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {99};
    static conv sys, c[3];
    memset(&sys, 0, sizeof sys);
    rand_ids(sys.ids, 64, &r); /* a two-page system prompt */
    uint32_t hits = 0;
    for (uint32_t round = 0; round < 40; round++) {
        conv *x = &c[round % 3];
        if (x->live)
            conv_release(p, x);
        *x = sys;
        rand_ids(x->ids + 64, 64 + tu_below(&r, 64), &r);
        const uint32_t m = conv_create(p, x, 64, false);
        hits += m == 64;
        /* Two live conversations of up to 8 pages each: the cache must give
         * way every round. */
        conv_append(p, x, 96 - m + tu_below(&r, 32));
        conv_verify(p, x);
        for (uint32_t j = 0; j < 3; j++)
            if (c[j].live)
                conv_verify(p, &c[j]);
        TU_CHECK(p);
        if (round % 3 == 2) /* one conversation ends */
            conv_release(p, &c[(round + 1) % 3]);
    }
    const kvt_stats s = pstats(p);
    assert_true(s.prefix_reclaimed_pages > 0);
    assert_true(hits > 20); /* the system prompt stays (most recently used) */
    print_message("# %u of 40 requests found the system prompt; %llu pages reclaimed\n", hits,
                  (unsigned long long)s.prefix_reclaimed_pages);
    for (uint32_t j = 0; j < 3; j++)
        if (c[j].live)
            conv_release(p, &c[j]);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

/* Random multi-request workloads on tiered pools with a disk tier (and, in
 * one, per-tier caps): chats sharing system prompts, multi-turn
 * continuations of earlier conversations, dense steps of one token and
 * chunks of several with token ids, forks, truncates and releases; every
 * decode against double-precision attention, every row against its ids,
 * kvt_pool_check after every operation. */
static void random_tiered(uint64_t seed, bool caps, uint32_t ops)
{
    model_reset();
    pheads ph = ph_uniform(2, 2, 1, 1, 2);
    ph_unstable(&ph, 1, 0);
    pfx *f = pfx_new(&ph, seed);
    kvt_pool_opts o = pfx_opts(f, 4 * 32 * N_LAYERS * H / 3, 120, 96ull << 20);
    o.flags |= KVT_POOL_PREFIX_CACHE;
    if (caps) {
        o.prefix_cache_bytes[KVT_TIER_DEVICE] = 24ull * 8192;
        o.prefix_cache_bytes[KVT_TIER_HOST] = 1; /* none on host: straight to disk */
    }
    TU_OK(kvt_pool_create(&o, &f->p));
    kvt_pool *p = f->p;
    tu_rng *r = &f->r;
    static uint32_t sys[3][160];
    for (uint32_t i = 0; i < 3; i++)
        rand_ids(sys[i], 160, r);
    static conv c[MAXC], done[8];
    memset(c, 0, sizeof c);
    uint32_t ndone = 0, counts[6] = {0};
    for (uint32_t op = 0; op < ops; op++) {
        const uint32_t i = tu_below(r, 6), kind = tu_below(r, 6);
        conv *x = &c[i];
        if (!x->live) {
            memset(x, 0, sizeof *x);
            x->salt = tu_below(r, 5) ? SALT_A : SALT_B;
            uint32_t np;
            if (ndone && tu_below(r, 2)) { /* the next turn of an earlier chat */
                const conv *old = &done[tu_below(r, ndone)];
                memcpy(x->ids, old->ids, old->n * sizeof *x->ids);
                x->salt = old->salt;
                np = old->n;
            } else { /* a new chat on a system prompt */
                const uint32_t s = tu_below(r, 3);
                memcpy(x->ids, sys[s], sizeof sys[s]);
                np = 64 + tu_below(r, 97);
            }
            const uint32_t add = 1 + tu_below(r, 80);
            rand_ids(x->ids + np, add, r);
            conv_create(p, x, np + add, false);
            /* Prefill the rest: in chunks through steps (token ids), or
             * kvt_seq_append. */
            while (x->n < np + add) {
                uint32_t k = np + add - x->n;
                k = k > 48 ? 48 : k;
                if (tu_below(r, 2)) {
                    conv_step(p, &x, 1, &k, r);
                } else {
                    TU_OK(kvt_seq_tokens_set(p, x->id, x->n, x->ids + x->n, k));
                    conv_append(p, x, k);
                }
            }
            counts[0]++;
        } else if (kind <= 1 && x->n + 8 < 500) { /* decode steps over some live chats */
            conv *cs[MAXC];
            uint32_t nn[MAXC], n = 0;
            for (uint32_t j = 0; j < 6; j++)
                if (c[j].live && c[j].n + 8 < 500 && (j == i || tu_below(r, 2))) {
                    cs[n] = &c[j];
                    nn[n] = 1 + (tu_below(r, 3) == 0 ? tu_below(r, 6) : 0);
                    rand_ids(c[j].ids + c[j].n, nn[n], r);
                    n++;
                }
            conv_step(p, cs, n, nn, r);
            counts[1]++;
        } else if (kind == 2) { /* the chat ends: remembered for a next turn */
            if (ndone < 8)
                done[ndone++] = *x;
            else
                done[tu_below(r, 8)] = *x;
            conv_release(p, x);
            counts[2]++;
        } else if (kind == 3) {
            uint32_t j = 0;
            while (j < 6 && c[j].live)
                j++;
            if (j < 6) {
                c[j] = *x;
                TU_OK(kvt_seq_fork(p, x->id, &(kvt_seq_opts){.struct_size = sizeof(kvt_seq_opts),
                                                            .salt = x->salt},
                                   &c[j].id));
                conv_verify(p, &c[j]);
                counts[3]++;
            }
        } else if (kind == 4 && x->n) {
            const uint32_t n = x->n - tu_below(r, x->n < 70 ? x->n + 1 : 70);
            TU_OK(kvt_seq_truncate(p, x->id, n));
            x->n = n;
            counts[4]++;
        } else {
            conv_verify(p, x);
            counts[5]++;
        }
        TU_CHECK(p);
    }
    for (uint32_t j = 0; j < 6; j++)
        if (c[j].live) {
            conv_verify(p, &c[j]);
            conv_release(p, &c[j]);
        }
    TU_CHECK(p);
    const kvt_stats s = pstats(p);
    print_message("# %u ops: %u creates, %u steps, %u releases, %u forks, %u truncates; "
                  "%llu of %llu prefix tokens hit, %llu pages reclaimed, cached %llu/%llu/%llu "
                  "(device/host/disk)\n",
                  ops, counts[0], counts[1], counts[2], counts[3], counts[4],
                  (unsigned long long)s.prefix_hit_tokens,
                  (unsigned long long)(s.prefix_hit_tokens + s.prefix_miss_tokens),
                  (unsigned long long)s.prefix_reclaimed_pages,
                  (unsigned long long)s.prefix_cached_pages[0],
                  (unsigned long long)s.prefix_cached_pages[1],
                  (unsigned long long)s.prefix_cached_pages[2]);
    assert_true(s.prefix_hit_tokens > 0);
    if (caps) {
        assert_true(s.prefix_cached_pages[KVT_TIER_DEVICE] <= 24);
        assert_int_equal(s.prefix_cached_pages[KVT_TIER_HOST], 0);
    }
    uint64_t n = 0;
    TU_OK(kvt_prefix_drop_all(p, &n));
    TU_CHECK(p);
    assert_int_equal(dev_used(p), 0);
    assert_int_equal(p->disk->n_ext_free, p->disk->n_ext - (p->disk->spill[0] != 0) -
                                              (p->disk->spill[1] != 0) - (p->disk->spill[2] != 0) -
                                              (p->disk->spill[3] != 0));
    pfx_close(f);
}

static void test_random_tiered(void **state)
{
    (void)state;
    random_tiered(1234, false, 500);
}

static void test_random_tiered_caps(void **state)
{
    (void)state;
    random_tiered(4321, true, 500);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pressure),
        cmocka_unit_test(test_random_tiered),
        cmocka_unit_test(test_random_tiered_caps),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
