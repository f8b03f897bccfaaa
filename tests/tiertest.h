/* Helpers of the tier tests (test_mover, test_mover_faults): sequences of
 * random f16 bit patterns kept by the test as the reference (f16 -> f16
 * storage is the identity), read back through kvt_seq_read_kv. */
#ifndef KVT_TIERTEST_H
#define KVT_TIERTEST_H

#include <dirent.h>
#include <stdbool.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

#define L 2
#define H 2
#define D 64
#define P 32 /* block = 2 * 32 * 64 * 2 = 8 KiB: one O_DIRECT-friendly slot */
#define MAXTOK 8192

static char g_dir[256];


typedef struct {
    kvt_seq_id id;
    uint32_t n;
    uint16_t *k[L], *v[L]; /* [MAXTOK][H][D] */
} tseq;

static inline uint16_t rand_f16(tu_rng *r)
{
    uint16_t h;
    do
        h = (uint16_t)tu_next(r);
    while (((h >> 10) & 31) == 31); /* finite values only */
    return h;
}

static inline void tseq_init(tseq *t)
{
    memset(t, 0, sizeof *t);
    for (int l = 0; l < L; l++) {
        t->k[l] = calloc((size_t)MAXTOK * H * D, 2);
        t->v[l] = calloc((size_t)MAXTOK * H * D, 2);
    }
}

static inline void tseq_free(tseq *t)
{
    for (int l = 0; l < L; l++) {
        free(t->k[l]);
        free(t->v[l]);
    }
}

static inline void tseq_append(kvt_pool *p, tseq *t, uint32_t n, tu_rng *r)
{
    for (int l = 0; l < L; l++) {
        uint16_t *k = t->k[l] + (size_t)t->n * H * D, *v = t->v[l] + (size_t)t->n * H * D;
        for (size_t i = 0; i < (size_t)n * H * D; i++) {
            k[i] = rand_f16(r);
            v[i] = rand_f16(r);
        }
        TU_OK(kvt_seq_append(p, t->id, (uint32_t)l, k, v, n, KVT_DTYPE_F16, 0));
    }
    t->n += n;
}

/* Every token of every (layer, head) reads back bit for bit. */
static inline void tseq_verify(const kvt_pool *p, const tseq *t)
{
    uint16_t *k = malloc((size_t)MAXTOK * D * 2), *v = malloc((size_t)MAXTOK * D * 2);
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++) {
            TU_OK(kvt_seq_read_kv(p, t->id, (uint32_t)l, (uint32_t)h, 0, t->n, k, v));
            for (uint32_t i = 0; i < t->n; i++)
                for (int d = 0; d < D; d++) {
                    size_t ref = ((size_t)i * H + h) * D + d;
                    if (k[(size_t)i * D + d] != t->k[l][ref] || v[(size_t)i * D + d] != t->v[l][ref])
                        fail_msg("layer %d head %d token %u dim %d: read back differs", l, h, i, d);
                }
        }
    free(k);
    free(v);
}

static inline kvt_pool_opts disk_opts(uint32_t dev, uint32_t host, uint64_t disk_bytes,
                               const kvt_mover_opts *mo)
{
    kvt_pool_opts o = tu_opts(L, H, H, D, P, KVT_DTYPE_F16, dev, host);
    o.disk_dir = g_dir;
    o.disk_bytes = disk_bytes;
    o.mover = mo;
    o.n_threads = 1;
    return o;
}

static inline uint8_t residency(const kvt_pool *p, kvt_seq_id s, uint32_t l, uint32_t h, uint32_t pg)
{
    uint8_t r = 0;
    TU_OK(kvt_seq_block_table(p, s, l, h, pg, 1, NULL, NULL, &r));
    return r;
}

static inline kvt_mover *mover_of(kvt_pool *p)
{
    kvt_mover *m = NULL;
    TU_OK(kvt_pool_mover(p, &m));
    assert_non_null(m);
    return m;
}

static inline int count_dir_entries(void)
{
    DIR *d = opendir(g_dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* Up to cap random moves of distinct full pages of the ns sequences t, each
 * from a tier that holds the page to another tier, half of them dropping
 * the source; before[i] (when not NULL) gets the page's residency. */
static inline uint32_t random_batch(const kvt_pool *p, tseq *t, uint32_t ns, tu_rng *r,
                                    kvt_move *mv, uint8_t *before, uint32_t cap)
{
    uint32_t n = 0;
    for (uint32_t tries = 0; tries < 3 * cap && n < cap; tries++) {
        tseq *s = &t[tu_below(r, ns)];
        uint32_t full = s->n / P;
        if (!full)
            continue;
        uint32_t l = tu_below(r, L), h = tu_below(r, H), pg = tu_below(r, full);
        bool dup = false;
        for (uint32_t j = 0; j < n; j++)
            dup |= mv[j].seq == s->id && mv[j].layer == l && mv[j].kv_head == h &&
                   mv[j].page == pg;
        if (dup)
            continue;
        uint8_t res = residency(p, s->id, l, h, pg);
        kvt_tier from, to;
        do
            from = tu_below(r, 3);
        while (!(res & (1u << from)));
        do
            to = tu_below(r, 3);
        while (to == from);
        if (before)
            before[n] = res;
        mv[n++] = (kvt_move){s->id, l, h, pg, from, to,
                             tu_below(r, 2) ? KVT_MOVE_DROP_SOURCE : 0u};
    }
    return n;
}

static inline int tier_setup(void **state)
{
    (void)state;
    const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(g_dir, sizeof g_dir, "%s/kvt-tier-XXXXXX", base);
    return mkdtemp(g_dir) ? 0 : -1;
}

static inline int tier_teardown(void **state)
{
    (void)state;
    return rmdir(g_dir);
}

#endif /* KVT_TIERTEST_H */
