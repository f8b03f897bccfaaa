/* The tier tests' helpers (tiertest.h). */
#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tiertest.h"

char g_dir[256];

int tier_setup(void **state)
{
    (void)state;
    const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(g_dir, sizeof g_dir, "%s/kvt-tier-XXXXXX", base);
    return mkdtemp(g_dir) ? 0 : -1;
}

int tier_teardown(void **state)
{
    (void)state;
    return rmdir(g_dir);
}

/* ---- sequences kept by the test ------------------------------------------- */

uint16_t rand_f16(tu_rng *r)
{
    uint16_t h;
    do
        h = (uint16_t)tu_next(r);
    while (((h >> 10) & 31) == 31); /* finite values only */
    return h;
}

void tseq_init(tseq *t)
{
    memset(t, 0, sizeof *t);
    for (int l = 0; l < N_LAYERS; l++) {
        t->k[l] = calloc((size_t)MAXTOK * N_KV_HEADS * HEAD_DIM, 2);
        t->v[l] = calloc((size_t)MAXTOK * N_KV_HEADS * HEAD_DIM, 2);
    }
}

void tseq_free(tseq *t)
{
    for (int l = 0; l < N_LAYERS; l++) {
        free(t->k[l]);
        free(t->v[l]);
    }
}

void tseq_append(kvt_pool *p, tseq *t, uint32_t n, tu_rng *r)
{
    for (int l = 0; l < N_LAYERS; l++) {
        uint16_t *k = t->k[l] + (size_t)t->n * N_KV_HEADS * HEAD_DIM;
        uint16_t *v = t->v[l] + (size_t)t->n * N_KV_HEADS * HEAD_DIM;
        for (size_t i = 0; i < (size_t)n * N_KV_HEADS * HEAD_DIM; i++) {
            k[i] = rand_f16(r);
            v[i] = rand_f16(r);
        }
        TU_OK(kvt_seq_append(p, t->id, (uint32_t)l, k, v, n, KVT_DTYPE_F16, 0));
    }
    t->n += n;
}

void tseq_verify(const kvt_pool *p, const tseq *t)
{
    uint16_t *k = malloc((size_t)MAXTOK * HEAD_DIM * 2);
    uint16_t *v = malloc((size_t)MAXTOK * HEAD_DIM * 2);
    for (int l = 0; l < N_LAYERS; l++)
        for (int h = 0; h < N_KV_HEADS; h++) {
            TU_OK(kvt_seq_read_kv(p, t->id, (uint32_t)l, (uint32_t)h, 0, t->n, k, v));
            for (uint32_t i = 0; i < t->n; i++)
                for (int d = 0; d < HEAD_DIM; d++) {
                    size_t ref = ((size_t)i * N_KV_HEADS + h) * HEAD_DIM + d;
                    if (k[(size_t)i * HEAD_DIM + d] != t->k[l][ref] ||
                        v[(size_t)i * HEAD_DIM + d] != t->v[l][ref])
                        fail_msg("layer %d head %d token %u dim %d: read back differs", l, h, i,
                                 d);
                }
        }
    free(k);
    free(v);
}

/* ---- pools ------------------------------------------------------------------ */

kvt_pool_opts disk_opts(uint32_t dev, uint32_t host, uint64_t disk_bytes,
                        const kvt_mover_opts *mo)
{
    kvt_pool_opts o = tu_opts(N_LAYERS, N_KV_HEADS, N_KV_HEADS, HEAD_DIM, PAGE_TOKENS,
                              KVT_DTYPE_F16, dev, host);
    o.disk_dir = g_dir;
    o.disk_bytes = disk_bytes;
    o.mover = mo;
    o.n_threads = 1;
    return o;
}

kvt_mover_opts tier_mover_opts(uint32_t extent_pages, uint32_t segment_extents)
{
    kvt_mover_opts mo;
    TU_OK(kvt_mover_opts_init(&mo));
    mo.extent_pages = extent_pages;
    mo.segment_extents = segment_extents;
    return mo;
}

uint8_t residency(const kvt_pool *p, kvt_seq_id s, uint32_t l, uint32_t h, uint32_t pg)
{
    uint8_t r = 0;
    TU_OK(kvt_seq_block_table_get(p, s, l, h, pg, 1, NULL, NULL, &r));
    return r;
}

kvt_mover *mover_of(kvt_pool *p)
{
    kvt_mover *m = NULL;
    TU_OK(kvt_pool_mover_get(p, &m));
    assert_non_null(m);
    return m;
}

int count_dir_entries(void)
{
    DIR *d = opendir(g_dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

uint32_t random_batch(const kvt_pool *p, tseq *t, uint32_t ns, tu_rng *r, kvt_move *mv,
                      uint8_t *before, uint32_t cap)
{
    uint32_t n = 0;
    for (uint32_t tries = 0; tries < 3 * cap && n < cap; tries++) {
        tseq *s = &t[tu_below(r, ns)];
        uint32_t full = s->n / PAGE_TOKENS;
        if (!full)
            continue;
        uint32_t l = tu_below(r, N_LAYERS), h = tu_below(r, N_KV_HEADS), pg = tu_below(r, full);
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

/* ---- the mover tests' fixture ------------------------------------------------ */

void tier_fx_open(tier_fx *f, uint32_t dev, uint32_t host, uint64_t disk_bytes,
                  const kvt_mover_opts *mo, uint64_t seed)
{
    memset(f, 0, sizeof *f);
    if (mo)
        f->mo = *mo;
    f->o = disk_opts(dev, host, disk_bytes, mo ? &f->mo : NULL);
    TU_OK(kvt_pool_create(&f->o, &f->p));
    f->m = mover_of(f->p);
    f->r = (tu_rng){seed};
}

tseq *tier_fx_add(tier_fx *f, uint32_t ntok)
{
    assert_true(f->ns < TIER_FX_MAXS);
    tseq *t = &f->t[f->ns++];
    tseq_init(t);
    TU_OK(kvt_seq_create(f->p, NULL, &t->id));
    tseq_append(f->p, t, ntok, &f->r);
    return t;
}

void tier_fx_close(tier_fx *f)
{
    kvt_pool_destroy(f->p);
    f->p = NULL;
    for (uint32_t i = 0; i < f->ns; i++)
        tseq_free(&f->t[i]);
    f->ns = 0;
}
