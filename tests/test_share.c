/* Shared pages (issue 23): kvt_seq_fork, kvt_seq_truncate, kvt_seq_save and
 * kvt_seq_restore, against independent references:
 *
 * - every row read back bit for bit against the rows the test kept (f16
 *   storage of f16 rows is the identity), from whichever tier holds it;
 * - decode of parents and children against double-precision attention over
 *   the kept rows;
 * - a model of which sequences hold which page: the reference count of
 *   each physical page (reached through the internal header; the test
 *   links the static library) equals the number of live sequences the
 *   model says hold it, and pages the model calls distinct are distinct;
 * - truncate then append equals never having appended the dropped rows
 *   (a twin sequence, rows and metadata byte for byte);
 * - kvt_pool_check after every operation;
 * - streams: round trips from every tier; short writes, short reads, bit
 *   flips, another geometry, another version, concatenated streams. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tiertest.h"
#include "internal.h"
#include "../tier/tier.h" /* the disk tier's extent counts */

#define BLK_BYTES (2u * PAGE_TOKENS * HEAD_DIM * 2u)
#define NPG(n) (((n) + PAGE_TOKENS - 1) / PAGE_TOKENS)

/* ---- the page model -------------------------------------------------------- */

/* Model page ids of every (layer, head, page) of a test sequence; 0 = none. */
#define MAXPG (MAXTOK / PAGE_TOKENS)
typedef struct {
    tseq t;
    bool live;
    uint32_t id[N_LAYERS][N_KV_HEADS][MAXPG];
} mseq;

static uint32_t g_next_id = 1;

static void model_append(mseq *m, uint32_t n_before, uint32_t n_after)
{
    for (uint32_t l = 0; l < N_LAYERS; l++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++)
            for (uint32_t pg = NPG(n_before); pg < NPG(n_after); pg++)
                m->id[l][h][pg] = g_next_id++;
}

static uint32_t model_holders(const mseq *ms, uint32_t nm, uint32_t id)
{
    uint32_t c = 0;
    for (uint32_t i = 0; i < nm; i++)
        if (ms[i].live)
            for (uint32_t l = 0; l < N_LAYERS; l++)
                for (uint32_t h = 0; h < N_KV_HEADS; h++)
                    for (uint32_t pg = 0; pg < NPG(ms[i].t.n); pg++)
                        c += ms[i].id[l][h][pg] == id;
    return c;
}

/* The pool's reference counts and page identities against the model. */
static void model_check(kvt_pool *p, const mseq *ms, uint32_t nm)
{
    uint32_t *owner = calloc(p->meta.n_blocks, sizeof *owner); /* meta slot -> model id */
    for (uint32_t i = 0; i < nm; i++) {
        if (!ms[i].live)
            continue;
        kvt__seq *s;
        TU_OK(kvt__seq_lookup(p, ms[i].t.id, &s));
        for (uint32_t l = 0; l < N_LAYERS; l++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++)
                for (uint32_t pg = 0; pg < NPG(ms[i].t.n); pg++) {
                    const uint32_t id = ms[i].id[l][h][pg];
                    const uint32_t m = s->meta_slot[kvt__lh(p, l, h) * s->cap_pages + pg];
                    assert_true(m > 0 && m < p->meta.n_blocks);
                    if (owner[m] && owner[m] != id)
                        fail_msg("pages %u and %u share metadata slot %u", owner[m], id, m);
                    owner[m] = id;
                    if (p->pg_ref[m] != model_holders(ms, nm, id))
                        fail_msg("page %u (seq %u l%u h%u p%u): %u references, model %u", id, i,
                                 l, h, pg, p->pg_ref[m], model_holders(ms, nm, id));
                }
    }
    free(owner);
}

static void mseq_fork(kvt_pool *p, mseq *dst, const mseq *src)
{
    memset(dst, 0, sizeof *dst);
    tseq_init(&dst->t);
    TU_OK(kvt_seq_fork(p, src->t.id, NULL, &dst->t.id));
    dst->t.n = src->t.n;
    dst->live = true;
    for (int l = 0; l < N_LAYERS; l++) {
        memcpy(dst->t.k[l], src->t.k[l], (size_t)src->t.n * N_KV_HEADS * HEAD_DIM * 2);
        memcpy(dst->t.v[l], src->t.v[l], (size_t)src->t.n * N_KV_HEADS * HEAD_DIM * 2);
    }
    const uint32_t full = src->t.n / PAGE_TOKENS;
    for (uint32_t l = 0; l < N_LAYERS; l++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            memcpy(dst->id[l][h], src->id[l][h], full * sizeof(uint32_t));
            if (src->t.n % PAGE_TOKENS)
                dst->id[l][h][full] = g_next_id++; /* the copied open page */
        }
}

static void mseq_truncate(kvt_pool *p, mseq *ms, uint32_t nm, mseq *m, uint32_t n)
{
    TU_OK(kvt_seq_truncate(p, m->t.id, n));
    const uint32_t old = m->t.n;
    m->t.n = n;
    for (uint32_t l = 0; l < N_LAYERS; l++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            for (uint32_t pg = NPG(n); pg < NPG(old); pg++)
                m->id[l][h][pg] = 0;
            /* A kept, now open page that others hold becomes a private copy. */
            if (n % PAGE_TOKENS && n < old) {
                uint32_t *id = &m->id[l][h][n / PAGE_TOKENS];
                if (model_holders(ms, nm, *id) > 1)
                    *id = g_next_id++;
            }
        }
}

static void mseq_release(kvt_pool *p, mseq *m)
{
    TU_OK(kvt_seq_release(p, m->t.id));
    tseq_free(&m->t);
    m->live = false;
}

/* Moves whole pages of one sequence between tiers at random (one sequence
 * per batch: a shared page is never named twice), and waits. */
static void random_moves(kvt_pool *p, mseq *m, tu_rng *r, uint32_t cap)
{
    kvt_move mv[16];
    uint32_t n = random_batch(p, &m->t, 1, r, mv, NULL, cap < 16 ? cap : 16);
    if (!n)
        return;
    kvt_fence f;
    int32_t res[16];
    int rc = kvt_mover_submit(mover_of(p), mv, n, 0, res, &f);
    if (rc == KVT_ENOSPC) /* a full tier: a legitimate refusal, nothing changed */
        return;
    TU_OK(rc);
    TU_OK(kvt_mover_wait(mover_of(p), f, UINT64_MAX));
}

/* ---- decode against double-precision attention ------------------------------ */

/* One dense step over the sequences m[0..n): appends one random token to
 * each (kept), decodes every layer with random queries, compares with the
 * reference over the kept rows. */
static void step_and_compare(kvt_pool *p, mseq **m, uint32_t n, tu_rng *r)
{
    const uint32_t H = N_KV_HEADS, D = HEAD_DIM;
    kvt_seq_id ids[8];
    for (uint32_t i = 0; i < n; i++)
        ids[i] = m[i]->t.id;
    kvt_step *st;
    kvt_step_opts so;
    TU_OK(kvt_step_opts_init(&so));
    so.flags = KVT_STEP_DENSE;
    TU_OK(kvt_step_plan(p, ids, n, &so, &st));
    uint16_t *k = malloc((size_t)n * H * D * 2), *v = malloc((size_t)n * H * D * 2);
    float *q = malloc((size_t)n * H * D * 4), *out = malloc((size_t)n * H * D * 4);
    float *lse = malloc((size_t)n * H * 4);
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t x = 0; x < H * D; x++) {
                k[i * H * D + x] = rand_f16(r);
                v[i * H * D + x] = rand_f16(r);
                m[i]->t.k[l][(size_t)m[i]->t.n * H * D + x] = k[i * H * D + x];
                m[i]->t.v[l][(size_t)m[i]->t.n * H * D + x] = v[i * H * D + x];
            }
        TU_OK(kvt_step_append(st, l, k, v, KVT_DTYPE_F16, 0));
        for (size_t x = 0; x < (size_t)n * H * D; x++)
            q[x] = (float)(0.05 * tu_unit(r));
        TU_OK(kvt_step_attend(st, l, q, out, lse));
        for (uint32_t i = 0; i < n; i++) {
            const uint32_t T = m[i]->t.n + 1;
            double *kd = malloc((size_t)T * D * 8), *vd = malloc((size_t)T * D * 8);
            for (uint32_t h = 0; h < H; h++) {
                for (uint32_t t = 0; t < T; t++)
                    for (uint32_t d = 0; d < D; d++) {
                        kd[t * D + d] = tu_f16_value(m[i]->t.k[l][((size_t)t * H + h) * D + d]);
                        vd[t * D + d] = tu_f16_value(m[i]->t.v[l][((size_t)t * H + h) * D + d]);
                    }
                double ro[HEAD_DIM], rl, kap, vmax;
                const float *qh = q + ((size_t)i * H + h) * D;
                tu_ref_attention(qh, 1, D, kd, vd, T, 1.0 / sqrt((double)D), ro, &rl, &kap,
                                 &vmax);
                for (uint32_t d = 0; d < D; d++) {
                    const double got = out[((size_t)i * H + h) * D + d];
                    if (fabs(got - ro[d]) > 1e-3 * vmax + 1e-5)
                        fail_msg("seq %u layer %u head %u dim %u: %g, reference %g", i, l, h, d,
                                 got, ro[d]);
                }
                assert_true(fabs(lse[i * H + h] - rl) < 1e-3 * (1.0 + fabs(rl)));
            }
            free(kd);
            free(vd);
        }
    }
    TU_OK(kvt_step_finish(st));
    for (uint32_t i = 0; i < n; i++)
        m[i]->t.n++;
    free(k);
    free(v);
    free(q);
    free(out);
    free(lse);
}

/* Appends n random tokens to m (pool and kept rows) and the model. */
static void mseq_append(kvt_pool *p, mseq *m, uint32_t n, tu_rng *r)
{
    const uint32_t before = m->t.n;
    if (!n)
        return;
    tseq_append(p, &m->t, n, r);
    model_append(m, before, m->t.n);
}

static void mseq_new(kvt_pool *p, mseq *m, uint32_t n, tu_rng *r)
{
    memset(m, 0, sizeof *m);
    tseq_init(&m->t);
    TU_OK(kvt_seq_create(p, NULL, &m->t.id));
    m->live = true;
    mseq_append(p, m, n, r);
}

/* Copies m's pages that live only on disk to the host (a dense decode
 * reads host copies in place, not the disk); false when the host is full. */
static bool fetch_to_host(kvt_pool *p, mseq *m)
{
    for (uint32_t l = 0; l < N_LAYERS; l++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++)
            for (uint32_t pg = 0; pg < NPG(m->t.n); pg++) {
                if (residency(p, m->t.id, l, h, pg) != KVT_RES_DISK)
                    continue;
                kvt_move mv = {m->t.id, l, h, pg, KVT_TIER_DISK, KVT_TIER_HOST, 0};
                kvt_fence f;
                int rc = kvt_mover_submit(mover_of(p), &mv, 1, 0, NULL, &f);
                if (rc == KVT_ENOSPC)
                    return false;
                TU_OK(rc);
                TU_OK(kvt_mover_wait(mover_of(p), f, UINT64_MAX));
            }
    return true;
}

/* ---- tests ----------------------------------------------------------------------- */

static uint64_t dev_used(const kvt_pool *p)
{
    return p->tier[KVT_TIER_DEVICE].n_blocks - 1u - p->tier[KVT_TIER_DEVICE].n_free;
}

/* A fork shares the full pages (device and host), copies the open page,
 * decodes like the parent, diverges, and outlives the parent. */
static void test_fork_shares_and_diverges(void **state)
{
    (void)state;
    kvt_pool_opts o = disk_opts(512, 512, 0, NULL);
    o.disk_dir = NULL;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {23};
    static mseq m[3];
    mseq_new(p, &m[0], 200, &r); /* 6 full pages + 8 rows per (layer, head) */
    /* Some full pages to the host only (decode reads them in place there). */
    for (uint32_t pg = 1; pg < 5; pg += 2)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            kvt_move mv = {m[0].t.id, 0, h, pg, KVT_TIER_DEVICE, KVT_TIER_HOST,
                           KVT_MOVE_DROP_SOURCE};
            kvt_fence f;
            TU_OK(kvt_mover_submit(mover_of(p), &mv, 1, 0, NULL, &f));
            TU_OK(kvt_mover_wait(mover_of(p), f, UINT64_MAX));
        }
    const uint64_t dev0 = dev_used(p), host0 = p->pages_in_tier[KVT_TIER_HOST];
    mseq_fork(p, &m[1], &m[0]);
    mseq_fork(p, &m[2], &m[0]);
    /* Only the open pages were copied: one per (layer, head) and child. */
    assert_int_equal(dev_used(p), dev0 + 2u * N_LAYERS * N_KV_HEADS);
    assert_int_equal(p->pages_in_tier[KVT_TIER_HOST], host0);
    kvt_seq_info info;
    info.struct_size = sizeof info;
    TU_OK(kvt_seq_info_get(p, m[1].t.id, &info));
    assert_int_equal(info.n_tokens, 200);
    TU_CHECK(p);
    model_check(p, m, 3);
    for (int i = 0; i < 3; i++)
        tseq_verify(p, &m[i].t);
    /* One step over all three (each appends its own token), twice. */
    mseq *all[3] = {&m[0], &m[1], &m[2]};
    step_and_compare(p, all, 3, &r);
    step_and_compare(p, all, 3, &r);
    for (int i = 0; i < 3; i++)
        tseq_verify(p, &m[i].t);
    TU_CHECK(p);
    /* Diverge past the page boundary, then the parent goes first. */
    mseq_append(p, &m[1], 70, &r);
    mseq_append(p, &m[0], 33, &r);
    mseq_release(p, &m[0]);
    TU_CHECK(p);
    model_check(p, m, 3);
    tseq_verify(p, &m[1].t);
    tseq_verify(p, &m[2].t);
    mseq *two[2] = {&m[1], &m[2]};
    step_and_compare(p, two, 2, &r);
    mseq_release(p, &m[2]);
    mseq_release(p, &m[1]);
    TU_CHECK(p);
    assert_int_equal(dev_used(p), 0);
    assert_int_equal(p->meta.n_free, p->meta.n_blocks - 1u);
    kvt_pool_destroy(p);
}

/* Thousands of random fork / append / truncate / release / move / step
 * operations in a pool with host and disk tiers, against the rows, the
 * model and (steps) double-precision attention. */
static void test_random_ops(void **state)
{
    (void)state;
    kvt_mover_opts mo = tier_mover_opts(4, 2);
    kvt_pool_opts o = disk_opts(400, 120, 64ull << 20, &mo);
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {2323};
    enum { NM = 8, OPS = 2500 };
    static mseq m[NM];
    memset(m, 0, sizeof m);
    uint32_t counts[7] = {0};
    for (uint32_t op = 0; op < OPS; op++) {
        const uint32_t i = tu_below(&r, NM), kind = tu_below(&r, 7);
        mseq *x = &m[i];
        if (!x->live) {
            uint32_t src = tu_below(&r, NM);
            for (uint32_t j = 0; j < NM && !m[src].live; j++)
                src = (src + 1) % NM;
            if (m[src].live && kind < 4) {
                mseq_fork(p, x, &m[src]);
                counts[0]++;
            } else {
                mseq_new(p, x, tu_below(&r, 90), &r);
                counts[1]++;
            }
        } else if (kind == 0 && x->t.n + 80 < 700) {
            mseq_append(p, x, 1 + tu_below(&r, 80), &r);
            counts[2]++;
        } else if (kind == 1) {
            const uint32_t n = tu_below(&r, 3) ? x->t.n - tu_below(&r, x->t.n / 3 + 1)
                                               : tu_below(&r, x->t.n + 1);
            mseq_truncate(p, m, NM, x, n);
            counts[3]++;
        } else if (kind == 2 && tu_below(&r, 3) == 0) {
            mseq_release(p, x);
            counts[4]++;
        } else if (kind == 6 && x->t.n + 1 < 700) {
            /* A dense step over x and up to two more live sequences (forks
             * of one another or not): each appends a token, and every
             * layer's output is checked against the reference. */
            mseq *sm[3] = {x};
            uint32_t n = 1;
            for (uint32_t j = 0; j < NM && n < 3; j++)
                if (&m[j] != x && m[j].live && m[j].t.n + 1 < 700 && tu_below(&r, 2))
                    sm[n++] = &m[j];
            bool ok = true;
            for (uint32_t j = 0; j < n && ok; j++)
                ok = fetch_to_host(p, sm[j]);
            /* (A later fetch may have evicted an earlier one's host copy.) */
            for (uint32_t j = 0; j < n && ok; j++)
                for (uint32_t l = 0; l < N_LAYERS && ok; l++)
                    for (uint32_t h = 0; h < N_KV_HEADS && ok; h++)
                        for (uint32_t pg = 0; pg < NPG(sm[j]->t.n) && ok; pg++)
                            ok = residency(p, sm[j]->t.id, l, h, pg) != KVT_RES_DISK;
            if (ok) {
                for (uint32_t j = 0; j < n; j++)
                    if (sm[j]->t.n % PAGE_TOKENS == 0) /* the step opens a page */
                        model_append(sm[j], sm[j]->t.n, sm[j]->t.n + 1);
                step_and_compare(p, sm, n, &r);
                counts[6]++;
            }
        } else {
            random_moves(p, x, &r, 1 + tu_below(&r, 12));
            counts[5]++;
        }
        TU_CHECK(p);
        model_check(p, m, NM);
        if (x->live && (op % 7 == 0 || kind == 1))
            tseq_verify(p, &x->t);
    }
    for (uint32_t i = 0; i < NM; i++)
        if (m[i].live) {
            tseq_verify(p, &m[i].t);
            mseq_release(p, &m[i]);
        }
    TU_CHECK(p);
    assert_int_equal(dev_used(p), 0);
    assert_int_equal(p->disk->n_ext_free, p->disk->n_ext);
    print_message("# %u ops: %u forks, %u creates, %u appends, %u truncates, %u releases, "
                  "%u move batches, %u steps\n", OPS, counts[0], counts[1], counts[2],
                  counts[3], counts[4], counts[5], counts[6]);
    kvt_pool_destroy(p);
}

/* Truncating then appending R equals appending R right after the kept
 * prefix: rows and metadata byte for byte, with f32 rows stored as f16 (the
 * metadata describes the rows as stored) and with the kept page shared
 * with a fork (which stays intact). */
static void test_truncate_equals_never_appended(void **state)
{
    (void)state;
    enum { H = 2, D = 16, P = 8, TMAX = 200 };
    const uint32_t cuts[] = {0, 1, 7, 8, 9, 16, 37, 63, 64, 100};
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++)
        for (int with_fork = 0; with_fork < 2; with_fork++) {
            kvt_pool_opts o = tu_opts(2, H, H, D, P, KVT_DTYPE_F16, 256, 0);
            kvt_pool *p;
            TU_OK(kvt_pool_create(&o, &p));
            tu_rng r = {100 + c};
            static float k[TMAX * H * D], v[TMAX * H * D], k2[TMAX * H * D], v2[TMAX * H * D];
            for (size_t i = 0; i < (size_t)TMAX * H * D; i++) {
                k[i] = (float)(3.0 * tu_unit(&r) + 1e-4 * tu_unit(&r));
                v[i] = (float)tu_unit(&r);
                k2[i] = (float)(3.0 * tu_unit(&r));
                v2[i] = (float)tu_unit(&r);
            }
            const uint32_t n1 = 100, n0 = cuts[c], R = 45;
            kvt_seq_id a, b, f = 0;
            TU_OK(kvt_seq_create(p, NULL, &a));
            TU_OK(kvt_seq_create(p, NULL, &b));
            for (uint32_t l = 0; l < 2; l++) {
                TU_OK(kvt_seq_append(p, a, l, k, v, n1, KVT_DTYPE_F32, 0));
                if (n0)
                    TU_OK(kvt_seq_append(p, b, l, k, v, n0, KVT_DTYPE_F32, 0));
            }
            if (with_fork)
                TU_OK(kvt_seq_fork(p, a, NULL, &f));
            TU_OK(kvt_seq_truncate(p, a, n0));
            TU_CHECK(p);
            for (uint32_t l = 0; l < 2; l++) {
                TU_OK(kvt_seq_append(p, a, l, k2, v2, R, KVT_DTYPE_F32, 0));
                TU_OK(kvt_seq_append(p, b, l, k2, v2, R, KVT_DTYPE_F32, 0));
            }
            TU_CHECK(p);
            static uint16_t ra[TMAX * D * 2], rb[TMAX * D * 2];
            for (uint32_t l = 0; l < 2; l++)
                for (uint32_t h = 0; h < H; h++) {
                    TU_OK(kvt_seq_read_kv(p, a, l, h, 0, n0 + R, ra, ra + TMAX * D));
                    TU_OK(kvt_seq_read_kv(p, b, l, h, 0, n0 + R, rb, rb + TMAX * D));
                    assert_memory_equal(ra, rb, sizeof ra);
                    for (uint32_t pg = 0; pg < (n0 + R + P - 1) / P; pg++) {
                        float ma[3][D], mb[3][D];
                        TU_OK(kvt_seq_page_meta_get(p, a, l, h, pg, ma[0], ma[1], ma[2]));
                        TU_OK(kvt_seq_page_meta_get(p, b, l, h, pg, mb[0], mb[1], mb[2]));
                        if (memcmp(ma, mb, sizeof ma))
                            fail_msg("cut %u fork %d layer %u head %u page %u: metadata "
                                     "differs", n0, with_fork, l, h, pg);
                    }
                }
            if (with_fork) { /* the fork still holds the 100 original rows */
                for (uint32_t l = 0; l < 2; l++)
                    for (uint32_t h = 0; h < H; h++) {
                        kvt_seq_id c2;
                        TU_OK(kvt_seq_create(p, NULL, &c2));
                        for (uint32_t ll = 0; ll < 2; ll++)
                            TU_OK(kvt_seq_append(p, c2, ll, k, v, n1, KVT_DTYPE_F32, 0));
                        TU_OK(kvt_seq_read_kv(p, f, l, h, 0, n1, ra, ra + TMAX * D));
                        TU_OK(kvt_seq_read_kv(p, c2, l, h, 0, n1, rb, rb + TMAX * D));
                        assert_memory_equal(ra, rb, sizeof ra);
                        TU_OK(kvt_seq_release(p, c2));
                    }
                TU_OK(kvt_seq_release(p, f));
            }
            TU_OK(kvt_seq_release(p, a));
            TU_OK(kvt_seq_release(p, b));
            TU_CHECK(p);
            kvt_pool_destroy(p);
        }
}

/* ---- streams ------------------------------------------------------------------- */

typedef struct {
    uint8_t *b;
    size_t n, cap, at;
    size_t fail_at; /* write: refuse at this offset; read: end the stream here */
    bool short_io;  /* hand over at most 7 bytes a call */
} membuf;

static int64_t mem_write(void *ctx, const void *buf, size_t len)
{
    membuf *m = ctx;
    if (m->n >= m->fail_at)
        return -1;
    if (m->short_io && len > 7)
        len = 7;
    if (m->n + len > m->fail_at)
        len = m->fail_at - m->n;
    if (m->n + len > m->cap) {
        m->cap = (m->n + len) * 2;
        m->b = realloc(m->b, m->cap);
    }
    memcpy(m->b + m->n, buf, len);
    m->n += len;
    return (int64_t)len;
}

static int64_t mem_read(void *ctx, void *buf, size_t len)
{
    membuf *m = ctx;
    size_t end = m->n < m->fail_at ? m->n : m->fail_at;
    if (m->short_io && len > 5)
        len = 5;
    if (len > end - m->at)
        len = end - m->at;
    memcpy(buf, m->b + m->at, len);
    m->at += len;
    return (int64_t)len;
}

static int64_t bad_read(void *ctx, void *buf, size_t len)
{
    (void)ctx;
    (void)buf;
    (void)len;
    return -1;
}

static membuf save_seq(const kvt_pool *p, kvt_seq_id id)
{
    membuf m = {NULL, 0, 0, 0, SIZE_MAX, false};
    TU_OK(kvt_seq_save(p, id, mem_write, &m));
    return m;
}

/* Restored rows and metadata equal the original's, byte for byte. */
static void same_seq(const kvt_pool *pa, kvt_seq_id a, const kvt_pool *pb, kvt_seq_id b,
                     uint32_t n)
{
    static uint16_t ka[MAXTOK * HEAD_DIM], kb[MAXTOK * HEAD_DIM];
    static uint16_t va[MAXTOK * HEAD_DIM], vb[MAXTOK * HEAD_DIM];
    for (uint32_t l = 0; l < N_LAYERS; l++)
        for (uint32_t h = 0; h < N_KV_HEADS; h++) {
            TU_OK(kvt_seq_read_kv(pa, a, l, h, 0, n, ka, va));
            TU_OK(kvt_seq_read_kv(pb, b, l, h, 0, n, kb, vb));
            assert_memory_equal(ka, kb, (size_t)n * HEAD_DIM * 2);
            assert_memory_equal(va, vb, (size_t)n * HEAD_DIM * 2);
            for (uint32_t pg = 0; pg < NPG(n); pg++) {
                float ma[3][HEAD_DIM], mb[3][HEAD_DIM];
                TU_OK(kvt_seq_page_meta_get(pa, a, l, h, pg, ma[0], ma[1], ma[2]));
                TU_OK(kvt_seq_page_meta_get(pb, b, l, h, pg, mb[0], mb[1], mb[2]));
                assert_memory_equal(ma, mb, sizeof ma);
            }
        }
}

/* Round trips from every tier: pages on the device, host-only and
 * disk-only; restored into the same pool and into a device-only pool. */
static void test_save_restore_every_tier(void **state)
{
    (void)state;
    kvt_mover_opts mo = tier_mover_opts(4, 2);
    kvt_pool_opts o = disk_opts(256, 64, 32ull << 20, &mo);
    kvt_pool *p, *q;
    TU_OK(kvt_pool_create(&o, &p));
    kvt_pool_opts o2 = disk_opts(256, 0, 0, NULL);
    o2.disk_dir = NULL;
    TU_OK(kvt_pool_create(&o2, &q));
    tu_rng r = {77};
    static mseq m, c;
    mseq_new(p, &m, 333, &r);
    uint32_t on[3] = {0};
    for (uint32_t pg = 0; pg < 333 / PAGE_TOKENS; pg++)
        for (uint32_t l = 0; l < N_LAYERS; l++)
            for (uint32_t h = 0; h < N_KV_HEADS; h++) {
                const uint32_t where = (pg + l + h) % 3; /* 0 device, 1 host, 2 disk */
                kvt_fence f;
                if (where >= 1) {
                    kvt_move mv = {m.t.id, l, h, pg, KVT_TIER_DEVICE, KVT_TIER_HOST,
                                   KVT_MOVE_DROP_SOURCE};
                    TU_OK(kvt_mover_submit(mover_of(p), &mv, 1, 0, NULL, &f));
                    TU_OK(kvt_mover_wait(mover_of(p), f, UINT64_MAX));
                }
                if (where == 2) {
                    kvt_move mv = {m.t.id, l, h, pg, KVT_TIER_HOST, KVT_TIER_DISK,
                                   KVT_MOVE_DROP_SOURCE};
                    TU_OK(kvt_mover_submit(mover_of(p), &mv, 1, 0, NULL, &f));
                    TU_OK(kvt_mover_wait(mover_of(p), f, UINT64_MAX));
                }
                assert_int_equal(residency(p, m.t.id, l, h, pg) & 7u, 1u << where);
                on[where]++;
            }
    assert_true(on[0] && on[1] && on[2]);
    /* A fork shares the disk-only pages; save it too. */
    mseq_fork(p, &c, &m);
    membuf s1 = save_seq(p, m.t.id), s2 = save_seq(p, c.t.id);
    assert_int_equal(s1.n, s2.n);
    kvt_seq_id back, back2;
    TU_OK(kvt_seq_restore(p, NULL, mem_read, &s1, &back));
    TU_OK(kvt_seq_restore(q, NULL, mem_read, &s2, &back2));
    TU_CHECK(p);
    TU_CHECK(q);
    same_seq(p, m.t.id, p, back, m.t.n);
    same_seq(p, c.t.id, q, back2, c.t.n);
    tseq t = m.t;
    t.id = back2;
    tseq_verify(q, &t);
    /* Saved short writes and short reads: the same stream. */
    membuf s3 = {NULL, 0, 0, 0, SIZE_MAX, true};
    TU_OK(kvt_seq_save(p, c.t.id, mem_write, &s3));
    assert_int_equal(s3.n, s1.n);
    assert_memory_equal(s3.b, s1.b, s1.n);
    s3.short_io = true;
    kvt_seq_id back3;
    TU_OK(kvt_seq_restore(q, NULL, mem_read, &s3, &back3));
    same_seq(q, back2, q, back3, c.t.n);
    /* Two streams back to back: the reader stops at each trailer. */
    membuf cat = {NULL, 0, 0, 0, SIZE_MAX, false};
    TU_OK(kvt_seq_save(p, m.t.id, mem_write, &cat));
    TU_OK(kvt_seq_truncate(p, c.t.id, 40));
    TU_OK(kvt_seq_save(p, c.t.id, mem_write, &cat));
    kvt_seq_id x1, x2;
    TU_OK(kvt_seq_restore(q, NULL, mem_read, &cat, &x1));
    TU_OK(kvt_seq_restore(q, NULL, mem_read, &cat, &x2));
    assert_int_equal(cat.at, cat.n);
    same_seq(p, m.t.id, q, x1, m.t.n);
    same_seq(p, c.t.id, q, x2, 40);
    TU_CHECK(p);
    TU_CHECK(q);
    free(s1.b);
    free(s2.b);
    free(s3.b);
    free(cat.b);
    mseq_release(p, &c);
    mseq_release(p, &m);
    kvt_pool_destroy(p);
    kvt_pool_destroy(q);
}

static void pool_same(const kvt_pool *p, uint32_t live, uint64_t dev, uint32_t meta_free)
{
    assert_int_equal(p->n_live, live);
    assert_int_equal(dev_used(p), dev);
    assert_int_equal(p->meta.n_free, meta_free);
    TU_CHECK(p);
}

/* Damaged streams are refused, naming what is wrong, with nothing of them
 * left in the pool. */
static void test_restore_faults(void **state)
{
    (void)state;
    kvt_pool_opts o = disk_opts(256, 0, 0, NULL);
    o.disk_dir = NULL;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {5};
    static mseq m;
    mseq_new(p, &m, 77, &r);
    membuf s = save_seq(p, m.t.id);
    const uint32_t live = p->n_live, mfree = p->meta.n_free;
    const uint64_t dev = dev_used(p);
    kvt_seq_id id = 42;
    /* A write error at every offset of the stream: KVT_EIO, nothing changes. */
    for (size_t at = 0; at < s.n; at += at < 200 ? 1 : 251) {
        membuf w = {NULL, 0, 0, 0, at, false};
        TU_EXPECT_ERR(kvt_seq_save(p, m.t.id, mem_write, &w), KVT_EIO, "write");
        free(w.b);
    }
    pool_same(p, live, dev, mfree);
    /* Every truncation: KVT_ECORRUPT. */
    for (size_t at = 0; at < s.n; at += at < 200 ? 1 : 97) {
        s.at = 0;
        s.fail_at = at;
        TU_EXPECT_ERR(kvt_seq_restore(p, NULL, mem_read, &s, &id), KVT_ECORRUPT, "stream");
        assert_int_equal(id, KVT_SEQ_NONE);
    }
    s.fail_at = SIZE_MAX;
    pool_same(p, live, dev, mfree);
    /* Bit flips anywhere: KVT_ECORRUPT. */
    for (int i = 0; i < 300; i++) {
        const size_t at = i < 80 ? (size_t)i : tu_below(&r, (uint32_t)s.n);
        const uint8_t bit = (uint8_t)(1u << tu_below(&r, 8));
        s.b[at] ^= bit;
        s.at = 0;
        TU_EXPECT_ERR(kvt_seq_restore(p, NULL, mem_read, &s, &id), KVT_ECORRUPT, "");
        s.b[at] ^= bit;
    }
    pool_same(p, live, dev, mfree);
    s.at = 0;
    TU_EXPECT_ERR(kvt_seq_restore(p, NULL, bad_read, NULL, &id), KVT_EIO, "read");
    /* Another version, correctly checksummed: KVT_ENOTSUP naming it. */
    membuf v = {malloc(s.n), s.n, s.n, 0, SIZE_MAX, false};
    memcpy(v.b, s.b, s.n);
    const uint32_t ver = 2, hb = 56 + 4 * N_LAYERS;
    memcpy(v.b + 8, &ver, 4);
    const uint32_t crc = kvt__crc32c(0, v.b, hb);
    memcpy(v.b + hb, &crc, 4);
    TU_EXPECT_ERR(kvt_seq_restore(p, NULL, mem_read, &v, &id), KVT_ENOTSUP, "version");
    free(v.b);
    /* A pool of another geometry or dtype: KVT_EINVAL naming the field. */
    kvt_pool_opts o3 = tu_opts(N_LAYERS, 4, 4, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, 64, 0);
    kvt_pool *p3;
    TU_OK(kvt_pool_create(&o3, &p3));
    s.at = 0;
    TU_EXPECT_ERR(kvt_seq_restore(p3, NULL, mem_read, &s, &id), KVT_EINVAL, "n_kv_heads");
    pool_same(p3, 0, 0, p3->meta.n_blocks - 1u);
    kvt_pool_destroy(p3);
    o3 = tu_opts(N_LAYERS, N_KV_HEADS, N_KV_HEADS, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_BF16, 64, 0);
    TU_OK(kvt_pool_create(&o3, &p3));
    s.at = 0;
    TU_EXPECT_ERR(kvt_seq_restore(p3, NULL, mem_read, &s, &id), KVT_EINVAL, "dtype: f16");
    kvt_pool_destroy(p3);
    o3 = tu_opts(N_LAYERS, N_KV_HEADS, N_KV_HEADS, HEAD_DIM, 16, KVT_DTYPE_F16, 64, 0);
    TU_OK(kvt_pool_create(&o3, &p3));
    s.at = 0;
    TU_EXPECT_ERR(kvt_seq_restore(p3, NULL, mem_read, &s, &id), KVT_EINVAL, "page_tokens");
    kvt_pool_destroy(p3);
    /* A limit below the saved length: KVT_ERANGE. */
    kvt_seq_opts so;
    TU_OK(kvt_seq_opts_init(&so));
    so.max_tokens = 50;
    s.at = 0;
    TU_EXPECT_ERR(kvt_seq_restore(p, &so, mem_read, &s, &id), KVT_ERANGE, "n_tokens");
    /* A pool too small for the stream: KVT_ENOSPC, nothing left. */
    o3 = tu_opts(N_LAYERS, N_KV_HEADS, N_KV_HEADS, HEAD_DIM, PAGE_TOKENS, KVT_DTYPE_F16, 6, 0);
    TU_OK(kvt_pool_create(&o3, &p3));
    s.at = 0;
    TU_EXPECT_ERR(kvt_seq_restore(p3, NULL, mem_read, &s, &id), KVT_ENOSPC, "");
    pool_same(p3, 0, 0, p3->meta.n_blocks - 1u);
    kvt_pool_destroy(p3);
    /* After all that, the stream still restores. */
    s.at = 0;
    TU_OK(kvt_seq_restore(p, NULL, mem_read, &s, &id));
    same_seq(p, m.t.id, p, id, m.t.n);
    free(s.b);
    mseq_release(p, &m);
    kvt_pool_destroy(p);
}

/* Bad input: open steps, lengths, room, arguments. */
static void test_bad_input(void **state)
{
    (void)state;
    kvt_pool_opts o = disk_opts(64, 0, 0, NULL);
    o.disk_dir = NULL;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {9};
    static mseq a, b;
    mseq_new(p, &a, 40, &r);
    mseq_new(p, &b, 40, &r);
    kvt_seq_id c;
    kvt_step *st;
    kvt_step_opts dense;
    TU_OK(kvt_step_opts_init(&dense));
    dense.flags = KVT_STEP_DENSE;
    TU_OK(kvt_step_plan(p, &a.t.id, 1, &dense, &st));
    TU_EXPECT_ERR(kvt_seq_fork(p, a.t.id, NULL, &c), KVT_ESTATE, "open step");
    TU_EXPECT_ERR(kvt_seq_truncate(p, a.t.id, 3), KVT_ESTATE, "open step");
    membuf s = {NULL, 0, 0, 0, SIZE_MAX, false};
    TU_EXPECT_ERR(kvt_seq_save(p, a.t.id, mem_write, &s), KVT_ESTATE, "open step");
    /* A sequence the step does not include may be forked meanwhile. */
    TU_OK(kvt_seq_fork(p, b.t.id, NULL, &c));
    TU_OK(kvt_seq_release(p, c));
    TU_OK(kvt_step_finish(st));
    TU_EXPECT_ERR(kvt_seq_truncate(p, a.t.id, 41), KVT_ERANGE, "n_tokens: 41");
    kvt_seq_opts so;
    TU_OK(kvt_seq_opts_init(&so));
    so.max_tokens = 39;
    TU_EXPECT_ERR(kvt_seq_fork(p, a.t.id, &so, &c), KVT_EINVAL, "max_tokens");
    TU_EXPECT_ERR(kvt_seq_fork(NULL, a.t.id, NULL, &c), KVT_EINVAL, "pool");
    TU_EXPECT_ERR(kvt_seq_fork(p, a.t.id, NULL, NULL), KVT_EINVAL, "out");
    TU_EXPECT_ERR(kvt_seq_fork(p, 12345, NULL, &c), KVT_ENOENT, "");
    TU_EXPECT_ERR(kvt_seq_save(p, a.t.id, NULL, NULL), KVT_EINVAL, "write");
    TU_EXPECT_ERR(kvt_seq_restore(p, NULL, NULL, NULL, &c), KVT_EINVAL, "read");
    /* Fill the device until a fork's open-page copies do not fit. */
    kvt_seq_id fill;
    TU_OK(kvt_seq_create(p, NULL, &fill));
    static uint16_t zk[64 * N_KV_HEADS * HEAD_DIM];
    while (p->tier[KVT_TIER_DEVICE].n_free >= N_LAYERS * N_KV_HEADS)
        TU_OK(kvt_seq_append(p, fill, 0, zk, zk, PAGE_TOKENS, KVT_DTYPE_F16, 0));
    const uint32_t live = p->n_live, mfree = p->meta.n_free;
    const uint64_t dev = dev_used(p);
    TU_EXPECT_ERR(kvt_seq_fork(p, a.t.id, NULL, &c), KVT_ENOSPC, "kvt_seq_fork");
    pool_same(p, live, dev, mfree);
    tseq_verify(p, &a.t);
    /* Truncating into a shared page needs a block too. */
    TU_OK(kvt_seq_release(p, fill));
    TU_OK(kvt_seq_create(p, NULL, &fill));
    mseq_append(p, &a, 24, &r); /* 64 tokens: two full pages, nothing to copy */
    TU_OK(kvt_seq_fork(p, a.t.id, NULL, &c));
    while (p->tier[KVT_TIER_DEVICE].n_free >= N_KV_HEADS)
        TU_OK(kvt_seq_append(p, fill, 0, zk, zk, PAGE_TOKENS, KVT_DTYPE_F16, 0));
    TU_EXPECT_ERR(kvt_seq_truncate(p, a.t.id, 50), KVT_ENOSPC, "kvt_seq_truncate");
    tseq_verify(p, &a.t);
    TU_CHECK(p);
    /* Truncating at a page boundary needs nothing. */
    TU_OK(kvt_seq_truncate(p, a.t.id, 32));
    a.t.n = 32;
    tseq_verify(p, &a.t);
    TU_CHECK(p);
    TU_OK(kvt_seq_release(p, c));
    TU_OK(kvt_seq_release(p, fill));
    mseq_release(p, &a);
    mseq_release(p, &b);
    TU_CHECK(p);
    kvt_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fork_shares_and_diverges),
        cmocka_unit_test(test_random_ops),
        cmocka_unit_test(test_truncate_equals_never_appended),
        cmocka_unit_test(test_save_restore_every_tier),
        cmocka_unit_test(test_restore_faults),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, tier_setup, tier_teardown);
}
