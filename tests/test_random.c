/* A randomized workload of 10,000 create/append/release operations over 64
 * sequences, checked against a shadow model: every return code predicted
 * (OK, ENOSPC, ERANGE), block usage equal to the model's, the invariant
 * checker after every operation, and contents byte-exact on read-back. */
#include "testutil.h"

enum { L = 2, H = 2, D = 8, P = 8, SEQS = 64, MAXTOK = 120, USABLE = 700, OPS = 10000 };

typedef struct {
    int live;
    kvt_seq_id id;
    uint32_t n[L];
    uint16_t *k[L], *v[L]; /* [MAXTOK][H][D] */
} shadow_seq;

static shadow_seq sh[SEQS];

static uint32_t pages(uint32_t t)
{
    return (t + P - 1) / P;
}

static uint64_t model_used(void)
{
    uint64_t u = 0;
    for (int i = 0; i < SEQS; i++)
        if (sh[i].live)
            for (int l = 0; l < L; l++)
                u += (uint64_t)pages(sh[i].n[l]) * H;
    return u;
}

static uint16_t rand_f16(tu_rng *r)
{
    uint16_t h = (uint16_t)tu_next(r);
    if (((h >> 10) & 31) == 31)
        h &= 0xfbff; /* finite */
    return h;
}

static void verify_seq(kvt_pool *p, shadow_seq *s, tu_rng *r)
{
    static uint16_t k[MAXTOK * D], v[MAXTOK * D];
    for (uint32_t l = 0; l < L; l++) {
        uint32_t n;
        TU_OK(kvt_seq_length_get(p, s->id, l, &n));
        assert_int_equal(n, s->n[l]);
        for (uint32_t h = 0; h < H; h++) {
            if (n) {
                TU_OK(kvt_seq_read_kv(p, s->id, l, h, 0, n, k, v));
                for (uint32_t t = 0; t < n; t++) {
                    assert_memory_equal(k + t * D, s->k[l] + ((size_t)t * H + h) * D, 2 * D);
                    assert_memory_equal(v + t * D, s->v[l] + ((size_t)t * H + h) * D, 2 * D);
                }
            }
            /* Metadata of one random page: f16 sources make min/max exact. */
            if (n) {
                uint32_t pg = tu_below(r, pages(n)), t1 = (pg + 1) * P < n ? (pg + 1) * P : n;
                float mn[D], mx[D];
                TU_OK(kvt_seq_page_meta_get(p, s->id, l, h, pg, mn, mx, NULL));
                for (uint32_t d = 0; d < D; d++) {
                    double lo = INFINITY, hi = -INFINITY;
                    for (uint32_t t = pg * P; t < t1; t++) {
                        double x = tu_f16_value(s->k[l][((size_t)t * H + h) * D + d]);
                        lo = x < lo ? x : lo;
                        hi = x > hi ? x : hi;
                    }
                    assert_true((double)mn[d] == lo);
                    assert_true((double)mx[d] == hi);
                }
            }
        }
    }
}

static void test_random_workload(void **state)
{
    (void)state;
    kvt_pool_opts o = tu_opts(L, H, H, D, P, KVT_DTYPE_F16, USABLE + 1, 0);
    o.max_seqs = SEQS;
    kvt_pool *p;
    TU_OK(kvt_pool_create(&o, &p));
    tu_rng r = {0xC0FFEEull};
    static uint16_t kbuf[40 * H * D], vbuf[40 * H * D];
    unsigned counts[8] = {0};
    int op = 0; /* create/append/release operations executed */
    while (op < OPS) {
        uint32_t what = tu_below(&r, 100), i = tu_below(&r, SEQS);
        shadow_seq *s = &sh[i];
        if (what < 12) { /* create */
            if (s->live)
                continue;
            kvt_seq_opts so = KVT_SEQ_OPTS_INIT;
            so.max_tokens = MAXTOK;
            TU_OK(kvt_seq_create(p, &so, &s->id));
            s->live = 1;
            for (int l = 0; l < L; l++) {
                s->n[l] = 0;
                s->k[l] = malloc((size_t)MAXTOK * H * D * 2);
                s->v[l] = malloc((size_t)MAXTOK * H * D * 2);
            }
            counts[0]++;
            op++;
        } else if (what < 20) { /* release */
            if (!s->live)
                continue;
            TU_OK(kvt_seq_release(p, s->id));
            TU_EXPECT_ERR(kvt_seq_release(p, s->id), KVT_ENOENT, "seq");
            s->live = 0;
            for (int l = 0; l < L; l++) {
                free(s->k[l]);
                free(s->v[l]);
            }
            counts[1]++;
            op++;
        } else if (what < 97) { /* append */
            if (!s->live)
                continue;
            uint32_t l = tu_below(&r, L);
            uint32_t T = tu_below(&r, 10) < 7 ? 1 : 1 + tu_below(&r, 40);
            for (uint32_t x = 0; x < T * H * D; x++) {
                kbuf[x] = rand_f16(&r);
                vbuf[x] = rand_f16(&r);
            }
            int want;
            uint64_t need = (uint64_t)(pages(s->n[l] + T) - pages(s->n[l])) * H;
            if (s->n[l] + T > MAXTOK)
                want = KVT_ERANGE;
            else if (need > USABLE - model_used())
                want = KVT_ENOSPC;
            else
                want = 0;
            int rc = kvt_seq_append(p, s->id, l, kbuf, vbuf, T, KVT_DTYPE_F16, 0);
            if (rc != want)
                fail_msg("op %d: append of %u tokens to layer %u (%u held, %llu blocks "
                         "needed, %llu free) returned %s, expected %s: %s", op, T, l, s->n[l],
                         (unsigned long long)need,
                         (unsigned long long)(USABLE - model_used()), kvt_err_name(rc),
                         kvt_err_name(want), kvt_last_error());
            if (rc == 0) {
                memcpy(s->k[l] + (size_t)s->n[l] * H * D, kbuf, (size_t)T * H * D * 2);
                memcpy(s->v[l] + (size_t)s->n[l] * H * D, vbuf, (size_t)T * H * D * 2);
                s->n[l] += T;
            }
            counts[rc == 0 ? 2 : rc == KVT_ENOSPC ? 3 : 4]++;
            op++;
        } else { /* verify one sequence fully */
            if (!s->live)
                continue;
            verify_seq(p, s, &r);
            counts[5]++;
        }
        TU_CHECK(p);
        kvt_stats st = {.struct_size = sizeof st};
        TU_OK(kvt_pool_stats_get(p, &st));
        assert_int_equal(st.tier[KVT_TIER_DEVICE].blocks_used, model_used());
        assert_int_equal(st.meta_pages_used, model_used());
    }
    /* Every kind of outcome happened, so the workload really exercised them. */
    print_message("creates %u releases %u appends ok %u enospc %u erange %u verifies %u\n",
                  counts[0], counts[1], counts[2], counts[3], counts[4], counts[5]);
    for (int c = 0; c < 6; c++)
        assert_true(counts[c] > 0);
    for (int i = 0; i < SEQS; i++)
        if (sh[i].live) {
            verify_seq(p, &sh[i], &r);
            for (int l = 0; l < L; l++) {
                free(sh[i].k[l]);
                free(sh[i].v[l]);
            }
        }
    kvt_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_workload),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
