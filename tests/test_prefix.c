/* The prefix cache (issue 25): pages reused across requests by their token
 * content, against independent references:
 *
 * - the rows of a token prefix are a pure function of the prefix (a chained
 *   hash of the ids drawn into f16 bit patterns), so the rows every
 *   sequence must hold follow from its token ids alone: every row read back
 *   (kvt_seq_read_kv, from whichever tier holds it) equals them bit for
 *   bit, whether the sequence computed it or attached it;
 * - decode (dense steps, one token or chunks of several, with token_ids)
 *   against double-precision attention over those rows;
 * - the tokens attached against a model of the index (the longest run of
 *   whole pages some sequence of the same salt keyed), exactly where
 *   nothing can have been reclaimed, as an upper bound where it can;
 * - hash collisions forced by a test hook (every key equal): token
 *   comparison rejects every false match;
 * - kvt_pool_check after every operation (it validates the index: every
 *   entry's pages live and named back, keys recomputed from the ids, the
 *   cached pages' blocks and counts), and no referenced page is ever lost
 *   under pressure (the rows of live sequences read back).
 * The test links the fault-injection library (the hook lives there);
 * test_prefix_load.c has the pressure and random workload tests. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prefixtest.h"

/* ---- tests ------------------------------------------------------------------- */

/* A released sequence's full pages serve the next request with the same
 * prefix: shared while both live, cached after, attached exactly as far as
 * whole pages match; partial and divergent prefixes; stats. */
static void test_reuse(void **state)
{
    (void)state;
    model_reset();
    kvt_pool_opts o = cache_opts(600, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {41};
    static conv a, b, c, d;
    memset(&a, 0, sizeof a);
    a.salt = SALT_A;
    rand_ids(a.ids, 300, &r);
    TU_OK(kvt_seq_create(p, &(kvt_seq_opts){.struct_size = sizeof(kvt_seq_opts), .salt = SALT_A},
                         &a.id));
    a.live = true;
    conv_append(p, &a, 100); /* 3 full pages keyed, 4 tokens open */
    TU_CHECK(p);
    kvt_stats s = pstats(p);
    assert_int_equal(s.prefix_keyed_pages, 3 * N_LAYERS * H);

    /* While a lives: b shares its pages. */
    b = a;
    b.id = 0;
    assert_int_equal(conv_create(p, &b, 100, true), 96);
    kvt__seq *sa, *sb;
    TU_OK(kvt__seq_lookup(p, a.id, &sa));
    TU_OK(kvt__seq_lookup(p, b.id, &sb));
    for (uint32_t pg = 0; pg < 3; pg++) {
        assert_int_equal(sb->meta_slot[pg], sa->meta_slot[pg]);
        assert_int_equal(p->pg_ref[sa->meta_slot[pg]], 2);
    }
    conv_append(p, &b, 4); /* b's own open page: the ids are already known */
    conv_verify(p, &b);
    TU_CHECK(p);
    /* a leaves: its 3 keyed pages stay (held by b); its open page is freed. */
    conv_release(p, &a);
    TU_CHECK(p);
    conv_release(p, &b); /* now cached, nobody holds them */
    TU_CHECK(p);
    s = pstats(p);
    assert_int_equal(s.prefix_cached_pages[KVT_TIER_DEVICE], 3 * N_LAYERS * H);
    assert_int_equal(dev_used(p), 3 * N_LAYERS * H);

    /* A divergent prefix: same first 40 ids, then others: one page. */
    c = a;
    for (uint32_t i = 40; i < 300; i++)
        c.ids[i] ^= 0x55u;
    assert_int_equal(conv_create(p, &c, 200, true), 32);
    conv_append(p, &c, 200 - 32);
    conv_verify(p, &c);
    /* A shorter prefix than one page: nothing. */
    d = a;
    assert_int_equal(conv_create(p, &d, 31, true), 0);
    conv_release(p, &d);
    /* The original prefix again, longer: 3 pages, then its rest computed. */
    d = a;
    assert_int_equal(conv_create(p, &d, 300, true), 96);
    conv_append(p, &d, 300 - 96);
    conv_verify(p, &d);
    TU_CHECK(p);
    s = pstats(p);
    assert_int_equal(s.prefix_lookups, 4);
    assert_int_equal(s.prefix_hit_tokens, 96 + 32 + 0 + 96);
    assert_int_equal(s.prefix_miss_tokens, (100 - 96) + (200 - 32) + 31 + (300 - 96));
    assert_int_equal(s.prefix_hit_pages, (96 + 32 + 96) / P * N_LAYERS * H);
    conv_release(p, &c);
    conv_release(p, &d);
    TU_CHECK(p);
    /* Everything now cached: drop it all, the device is empty. */
    uint64_t dropped = 0;
    TU_OK(kvt_prefix_drop_all(p, &dropped));
    assert_int_equal(dropped, pstats(p).prefix_dropped_pages);
    assert_true(dropped > 0);
    assert_int_equal(dev_used(p), 0);
    assert_int_equal(pstats(p).prefix_keyed_pages, 0);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

/* Salts isolate; a forced hash collision (every key equal) never serves
 * another prompt's pages; drop by salt leaves the other salt's. */
static void test_salts_and_collisions(void **state)
{
    (void)state;
    model_reset();
    kvt_pool_opts o = cache_opts(800, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    p->pfx->key_mask = 0; /* every page key is 0: all in one hash chain */
    tu_rng r = {77};
    static conv a, b, x;
    memset(&a, 0, sizeof a);
    a.salt = SALT_A;
    rand_ids(a.ids, 128, &r);
    TU_OK(kvt_seq_create(p, &(kvt_seq_opts){.struct_size = sizeof(kvt_seq_opts), .salt = SALT_A},
                         &a.id));
    conv_append(p, &a, 128);
    conv_release(p, &a);
    /* b: other ids in page 0, a's ids in pages 1..3: the keys collide and
     * the ids of pages 1..3 match, but their parent does not. */
    b = a;
    b.ids[5] ^= 1u;
    assert_int_equal(conv_create(p, &b, 128, true), 0);
    conv_append(p, &b, 128);
    conv_verify(p, &b);
    conv_release(p, &b);
    TU_CHECK(p);
    /* x: a's page 0 and 1, then b's page 2: two pages. */
    x = a;
    x.ids[70] = b.ids[70] ^ 7u;
    assert_int_equal(conv_create(p, &x, 128, true), 64);
    conv_append(p, &x, 64);
    conv_verify(p, &x);
    conv_release(p, &x);
    /* A chain [X] and a chain [Z, Y]: a request [X, Y] finds page 0 under X
     * and, with every key equal, an entry for page 1 with ids Y - but its
     * parent is Z's page: one page, never Z's rows for Y. */
    {
        static conv cx, cz, q;
        memset(&cx, 0, sizeof cx);
        cx.salt = SALT_A;
        rand_ids(cx.ids, 64, &r);
        cz = cx;
        rand_ids(cz.ids, 32, &r); /* Z, then the same Y */
        TU_OK(kvt_seq_create(p, &(kvt_seq_opts){.struct_size = sizeof(kvt_seq_opts),
                                                 .salt = SALT_A}, &cx.id));
        conv_append(p, &cx, 32); /* X only */
        conv_release(p, &cx);
        TU_OK(kvt_seq_create(p, &(kvt_seq_opts){.struct_size = sizeof(kvt_seq_opts),
                                                 .salt = SALT_A}, &cz.id));
        conv_append(p, &cz, 64);
        conv_release(p, &cz);
        q = cx;
        assert_int_equal(conv_create(p, &q, 64, true), 32);
        conv_append(p, &q, 32);
        conv_verify(p, &q);
        conv_release(p, &q);
        TU_CHECK(p);
    }
    /* The same ids under another salt: nothing, and its own rows. */
    x = a;
    x.salt = SALT_B;
    assert_int_equal(conv_create(p, &x, 128, true), 0);
    conv_append(p, &x, 128);
    conv_verify(p, &x);
    conv_release(p, &x);
    TU_CHECK(p);
    /* Drop salt A: B's pages stay and still match. */
    uint64_t n = 0;
    TU_OK(kvt_prefix_drop(p, SALT_A, &n));
    assert_true(n > 0);
    TU_CHECK(p);
    x = a;
    model_reset(); /* salt A's runs are gone */
    assert_int_equal(conv_create(p, &x, 128, true), 0);
    conv_release(p, &x);
    model_reset();
    {
        static conv y; /* what salt B keyed: a's ids, 128 rows */
        y = a;
        y.salt = SALT_B;
        y.n = 128;
        model_key(&y);
    }
    x = a;
    x.salt = SALT_B;
    assert_int_equal(conv_create(p, &x, 128, true), 128);
    conv_verify(p, &x);
    conv_release(p, &x);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

/* Dropping a salt while one of its sequences runs: the sequence keeps its
 * rows and ids but is never indexed again (nor its forks); another salt's
 * sequence goes on being indexed; sequences created later under the
 * dropped salt are. */
static void test_drop_live(void **state)
{
    (void)state;
    model_reset();
    kvt_pool_opts o = cache_opts(400, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {8};
    static conv a, b, f, x;
    memset(&a, 0, sizeof a);
    rand_ids(a.ids, 256, &r);
    a.salt = SALT_A;
    b = a;
    b.salt = SALT_B;
    assert_int_equal(conv_create(p, &a, 64, true), 0);
    assert_int_equal(conv_create(p, &b, 64, true), 0);
    conv_append(p, &a, 64);
    conv_append(p, &b, 64);
    const uint64_t per = 2 * N_LAYERS * H; /* two pages of every (layer, head) */
    assert_int_equal(pstats(p).prefix_keyed_pages, 2 * per);
    uint64_t n = 0;
    TU_OK(kvt_prefix_drop(p, SALT_A, &n));
    assert_int_equal(n, per);
    assert_int_equal(pstats(p).prefix_keyed_pages, per);
    TU_CHECK(p);
    /* a grows (rows and ids) and forks: nothing of it is indexed again. */
    conv_append(p, &a, 64);
    f = a;
    TU_OK(kvt_seq_fork(p, a.id, &(kvt_seq_opts){.struct_size = sizeof(kvt_seq_opts),
                                                .salt = SALT_A}, &f.id));
    uint32_t nn = 32;
    conv *fs[1] = {&f};
    conv_step(p, fs, 1, &nn, &r);
    conv_append(p, &b, 64); /* b is, as before */
    assert_int_equal(pstats(p).prefix_keyed_pages, 2 * per);
    conv_verify(p, &a);
    conv_verify(p, &f);
    TU_CHECK(p);
    conv_release(p, &a);
    conv_release(p, &f);
    assert_int_equal(dev_used(p), (b.n + P - 1) / P * N_LAYERS * H); /* only b's pages */
    /* A new sequence under salt A finds nothing, and is indexed itself. */
    model_reset();
    x = a;
    x.n = 0;
    assert_int_equal(conv_create(p, &x, 128, true), 0);
    conv_append(p, &x, 128);
    assert_int_equal(pstats(p).prefix_keyed_pages, (4 + 4) * N_LAYERS * H);
    conv_release(p, &x);
    conv_release(p, &b);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

/* Found in review: state the cache inherits from the page store and the
 * mover. (1) A page whose disk copy was dropped keeps its disk slot without
 * the disk bit: caching, spilling and freeing it must not leak the slot.
 * (2) A truncation lets pages go deepest first, as a release does, so a
 * reclaim takes the chain's last page, not its first. (3) A fork with NULL
 * options of a salted sequence takes its salt. (4) A smaller max_tokens in
 * a fork keeps only the ids it can hold. */
static void test_review_cases(void **state)
{
    (void)state;
    model_reset();
    kvt_mover_opts mo = tier_mover_opts(4, 2);
    for (int spill = 0; spill < 2; spill++) {
        kvt_pool_opts o = disk_opts(64, 64, 4u << 20, &mo);
        o.flags |= KVT_POOL_PREFIX_CACHE;
        if (spill)
            o.prefix_cache_bytes[KVT_TIER_HOST] = 1; /* cached host copies go to disk */
        kvt_pool *p;
        TU_OK(kvt_pool_create(&o, &p));
        tu_rng r = {3};
        static conv a;
        memset(&a, 0, sizeof a);
        rand_ids(a.ids, 64, &r);
        TU_OK(kvt_seq_create(p, NULL, &a.id));
        conv_append(p, &a, 64);
        kvt_fence fe;
        kvt_move mv = {a.id, 0, 0, 0, KVT_TIER_DEVICE, KVT_TIER_DISK, 0};
        TU_OK(kvt_mover_submit(mover_of(p), &mv, 1, 0, NULL, &fe));
        TU_OK(kvt_mover_wait(mover_of(p), fe, UINT64_MAX));
        kvt_move back = {a.id, 0, 0, 0, KVT_TIER_DISK, KVT_TIER_HOST, KVT_MOVE_DROP_SOURCE};
        TU_OK(kvt_mover_submit(mover_of(p), &back, 1, 0, NULL, &fe));
        TU_OK(kvt_mover_wait(mover_of(p), fe, UINT64_MAX));
        TU_CHECK(p);
        conv_release(p, &a);
        TU_CHECK(p);
        assert_int_equal(conv_create(p, &a, 64, true), 64);
        conv_verify(p, &a); /* (the spilled page read back from disk) */
        conv_release(p, &a);
        uint64_t n;
        TU_OK(kvt_prefix_drop_all(p, &n));
        TU_CHECK(p);
        assert_int_equal(p->disk->n_ext_free + (p->disk->spill[0] != 0),
                         p->disk->n_ext); /* every slot back */
        kvt_pool_destroy(p);
    }

    kvt_pool_opts o = cache_opts(400, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {4};
    static conv a, b;
    memset(&a, 0, sizeof a);
    a.salt = SALT_A;
    rand_ids(a.ids, 128, &r);
    assert_int_equal(conv_create(p, &a, 128, true), 0);
    conv_append(p, &a, 128);
    TU_OK(kvt_seq_truncate(p, a.id, 0));
    a.n = 0;
    TU_CHECK(p);
    /* Reclaim exactly one entry (one page position) by asking the metadata
     * store for one entry's worth more than it has. */
    kvt__pfx_make_room(p, KVT_NUM_TIERS, p->meta.n_free + N_LAYERS * H);
    assert_int_equal(pstats(p).prefix_reclaimed_pages, N_LAYERS * H);
    TU_CHECK(p);
    model_reset();
    b = a;
    b.id = 0;
    b.n = 96;
    model_key(&b); /* the first three pages are what is left */
    assert_int_equal(conv_create(p, &b, 128, true), 96);
    conv_verify(p, &b);
    /* Fork with NULL options: the parent's salt; a smaller limit: fewer ids. */
    static conv c;
    c = b;
    TU_OK(kvt_seq_fork(p, b.id, NULL, &c.id));
    kvt_seq_info si = {.struct_size = sizeof si};
    TU_OK(kvt_seq_info_get(p, c.id, &si));
    assert_true(si.salt == SALT_A);
    conv_release(p, &c);
    TU_OK(kvt_seq_fork(p, b.id, &(kvt_seq_opts){.struct_size = sizeof(kvt_seq_opts),
                                                .max_tokens = 100}, &c.id));
    TU_OK(kvt_seq_info_get(p, c.id, &si));
    assert_int_equal(si.token_ids, 100);
    assert_true(si.salt == SALT_A);
    TU_EXPECT_ERR(kvt_seq_fork(p, b.id, &(kvt_seq_opts){.struct_size = sizeof(kvt_seq_opts),
                                                        .salt = SALT_B}, &c.id),
                  KVT_EINVAL, "salt");
    conv_release(p, &b);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

/* Attaching in a tiered pool while another holder's move drops the device
 * copy of what becomes the new sequence's last (forced) page: the attach
 * waits for it and brings the page back. */
static void test_attach_during_move(void **state)
{
    (void)state;
    pheads ph = ph_uniform(8, 2, 1, 1, 4);
    pfx *f = pfx_new(&ph, 5);
    kvt_pool_opts o = pfx_opts(f, 500, 500, 0);
    o.flags |= KVT_POOL_PREFIX_CACHE;
    TU_OK(kvt_pool_create(&o, &f->p));
    kvt_pool *p = f->p;
    kvt_mover *m = f->m = mover_of(p);
    const uint32_t T = 8 * P;
    const uint32_t a = pfx_add(f, T, KEYS_RANDOM);
    TU_OK(wait_all(f));
    uint32_t ids[8 * P];
    for (uint32_t i = 0; i < T; i++)
        ids[i] = 11 + i;
    TU_OK(kvt_seq_tokens_set(p, f->t[a].id, 0, ids, T));
    kvt_fence fe;
    for (uint32_t lh = 0; lh < NLH; lh++) /* page 3 on device in every head */
        if (!(residency(p, f->t[a].id, lh / H, lh % H, 3) & KVT_RES_DEVICE)) {
            kvt_move in = {f->t[a].id, lh / H, lh % H, 3, KVT_TIER_HOST, KVT_TIER_DEVICE, 0};
            TU_OK(kvt_mover_submit(m, &in, 1, 0, NULL, &fe));
            TU_OK(kvt_mover_wait(m, fe, UINT64_MAX));
        }
    kvt_move out = {f->t[a].id, 0, 0, 3, KVT_TIER_DEVICE, KVT_TIER_HOST, KVT_MOVE_DROP_SOURCE};
    TU_OK(kvt_mover_submit(m, &out, 1, 0, NULL, &fe)); /* in flight */
    kvt_seq_opts so;
    TU_OK(kvt_seq_opts_init(&so));
    so.prefix = ids;
    so.n_prefix = 4 * P; /* pages 0..3: page 3 is the new sequence's last */
    kvt_seq_id b;
    TU_OK(kvt_seq_create(p, &so, &b));
    TU_OK(kvt_mover_wait(m, fe, UINT64_MAX));
    assert_true(residency(p, b, 0, 0, 3) & KVT_RES_DEVICE);
    TU_CHECK(p);
    for (uint32_t pg = 0; pg < 4; pg++)
        for (uint32_t lh = 0; lh < NLH; lh++) { /* the attached rows are a's */
            uint16_t kb[P * D], ka[P * D];
            TU_OK(kvt_seq_read_kv(p, b, lh / H, lh % H, pg * P, P, kb, NULL));
            TU_OK(kvt_seq_read_kv(p, f->t[a].id, lh / H, lh % H, pg * P, P, ka, NULL));
            assert_memory_equal(kb, ka, sizeof kb);
        }
    TU_OK(kvt_seq_release(p, b));
    TU_CHECK(p);
    pfx_close(f);
}

/* Bad input: a clear error naming the argument, nothing attached or
 * recorded. */
static void test_bad_input(void **state)
{
    (void)state;
    model_reset();
    kvt_pool_opts o = cache_opts(200, 0);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {5};
    static conv a;
    memset(&a, 0, sizeof a);
    rand_ids(a.ids, 200, &r);
    TU_OK(kvt_seq_create(p, NULL, &a.id));
    conv_append(p, &a, 64);
    const kvt_stats s0 = pstats(p);
    kvt_seq_opts so;
    TU_OK(kvt_seq_opts_init(&so));
    so.max_tokens = 100;
    so.prefix = a.ids;
    so.n_prefix = 101;
    kvt_seq_id id = 7;
    TU_EXPECT_ERR(kvt_seq_create(p, &so, &id), KVT_EINVAL, "n_prefix");
    assert_int_equal(id, KVT_SEQ_NONE);
    so.n_prefix = 10;
    so.prefix = NULL;
    TU_EXPECT_ERR(kvt_seq_create(p, &so, &id), KVT_EINVAL, "prefix");
    so.prefix = a.ids;
    so.reserved = 1;
    TU_EXPECT_ERR(kvt_seq_create(p, &so, &id), KVT_EINVAL, "reserved");
    kvt_stats s1 = pstats(p);
    assert_int_equal(s1.n_seqs, s0.n_seqs);
    assert_int_equal(s1.prefix_lookups, s0.prefix_lookups);
    /* Ids: a gap, a mismatch, past max_tokens: nothing recorded. */
    uint32_t other = a.ids[3] + 1u;
    TU_EXPECT_ERR(kvt_seq_tokens_set(p, a.id, 65, a.ids + 65, 1), KVT_EINVAL, "ids");
    TU_EXPECT_ERR(kvt_seq_tokens_set(p, a.id, 3, &other, 1), KVT_EINVAL, "position 3");
    TU_EXPECT_ERR(kvt_seq_tokens_set(p, a.id, 64, a.ids, UINT32_MAX - 10), KVT_EINVAL,
                  "max_tokens");
    TU_EXPECT_ERR(kvt_seq_tokens_set(p, a.id, 64, NULL, 3), KVT_EINVAL, "ids");
    TU_EXPECT_ERR(kvt_seq_tokens_set(NULL, a.id, 64, a.ids, 1), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_tokens_set(p, a.id + (1ull << 32), 64, a.ids, 1), KVT_ENOENT, "");
    TU_EXPECT_ERR(kvt_prefix_drop(NULL, 0, NULL), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_prefix_drop_all(NULL, NULL), KVT_EINVAL, "pool");
    {
        kvt_step_opts dso;
        TU_OK(kvt_step_opts_init(&dso));
        dso.flags = KVT_STEP_DENSE;
        kvt_step *open_st;
        TU_OK(kvt_step_plan(p, &a.id, 1, &dso, &open_st));
        TU_EXPECT_ERR(kvt_seq_tokens_set(p, a.id, 64, a.ids + 64, 1), KVT_ESTATE,
                      "kvt_seq_tokens_set");
        /* (a step that appended nothing: finishing it changes nothing) */
        TU_OK(kvt_step_finish(open_st));
    }
    kvt_seq_info si = {.struct_size = sizeof si};
    TU_OK(kvt_seq_info_get(p, a.id, &si));
    assert_int_equal(si.token_ids, 64);
    /* The same ids again are accepted (idempotent). */
    TU_OK(kvt_seq_tokens_set(p, a.id, 0, a.ids, 64));
    /* Fork: another salt, or a prefix. */
    so.reserved = 0;
    so.prefix = NULL;
    so.n_prefix = 0;
    so.max_tokens = 0;
    so.salt = 9;
    TU_EXPECT_ERR(kvt_seq_fork(p, a.id, &so, &id), KVT_EINVAL, "salt");
    so.salt = 0;
    so.prefix = a.ids;
    so.n_prefix = 4;
    TU_EXPECT_ERR(kvt_seq_fork(p, a.id, &so, &id), KVT_EINVAL, "prefix");
    /* Step: token ids whose count is not the rows'. */
    kvt_step_opts sto;
    TU_OK(kvt_step_opts_init(&sto));
    sto.flags = KVT_STEP_DENSE;
    sto.token_ids = a.ids;
    sto.n_token_ids = 2;
    kvt_step *st;
    TU_EXPECT_ERR(kvt_step_plan(p, &a.id, 1, &sto, &st), KVT_EINVAL, "n_token_ids");
    sto.token_ids = NULL;
    TU_EXPECT_ERR(kvt_step_plan(p, &a.id, 1, &sto, &st), KVT_EINVAL, "token_ids");
    /* ... or that contradict recorded ids (recorded ahead of the rows). */
    TU_OK(kvt_seq_tokens_set(p, a.id, 64, a.ids + 64, 1));
    sto.token_ids = &other;
    sto.n_token_ids = 1;
    TU_EXPECT_ERR(kvt_step_plan(p, &a.id, 1, &sto, &st), KVT_EINVAL, "token_ids[0]");
    /* Pool options: caps without the cache. */
    kvt_pool_opts bo = cache_opts(200, 0);
    bo.flags = 0;
    bo.prefix_cache_bytes[KVT_TIER_HOST] = 1u << 20;
    kvt_pool *q = NULL;
    TU_EXPECT_ERR(kvt_pool_create(&bo, &q), KVT_EINVAL, "prefix_cache_bytes[1]");
    assert_null(q);
    /* A pool without the cache records ids, attaches nothing. */
    bo.prefix_cache_bytes[KVT_TIER_HOST] = 0;
    TU_OK(kvt_pool_create(&bo, &q));
    static conv c;
    memset(&c, 0, sizeof c);
    memcpy(c.ids, a.ids, sizeof c.ids);
    TU_OK(kvt_seq_create(q, NULL, &c.id));
    conv_append(q, &c, 64);
    conv_release(q, &c);
    model_reset();
    assert_int_equal(conv_create(q, &c, 64, true), 0);
    assert_int_equal(pstats(q).prefix_lookups, 0);
    conv_release(q, &c);
    kvt_pool_destroy(q);
    conv_verify(p, &a);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

/* A device-only pool far smaller than the conversations: cached pages are
 * reclaimed (least recently used first) so that appends never fail while
 * any could be; live sequences' pages are never touched. */
int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reuse),
        cmocka_unit_test(test_salts_and_collisions),
        cmocka_unit_test(test_drop_live),
        cmocka_unit_test(test_review_cases),
        cmocka_unit_test(test_attach_during_move),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
