/* Helpers of the tier tests (test_mover, test_mover_faults, and through
 * placetest.h test_place, test_place_faults): sequences of random f16 bit
 * patterns kept by the test as the reference (f16 -> f16 storage is the
 * identity), read back through kvt_seq_read_kv, and the fixture of the mover
 * tests (a disk-tiered pool, its mover and its sequences).
 *
 * The code is tests/tiertest.c, compiled into every test binary that
 * includes this header, with that test's flags (the fault-injection tests
 * build it with -DKVT_FAULT_INJECTION as they build themselves). */
#ifndef KVT_TIERTEST_H
#define KVT_TIERTEST_H

#include <stdbool.h>
#include <stdint.h>

#include "testutil.h"

/* The geometry of the tier tests' pools. */
#define N_LAYERS 2
#define N_KV_HEADS 2
#define HEAD_DIM 64
#define PAGE_TOKENS 32 /* block = 2 * 32 * 64 * 2 = 8 KiB: one O_DIRECT-friendly slot */
#define MAXTOK 8192

/* The scratch directory of the disk tier: made by tier_setup, removed
 * (empty) by tier_teardown. */
extern char g_dir[256];

/* cmocka group setup and teardown of the tier tests: g_dir. */
int tier_setup(void **state);
int tier_teardown(void **state);

/* ---- sequences kept by the test ------------------------------------------- */

typedef struct {
    kvt_seq_id id;
    uint32_t n;
    uint16_t *k[N_LAYERS], *v[N_LAYERS]; /* [MAXTOK][N_KV_HEADS][HEAD_DIM] */
} tseq;

/* A random f16 bit pattern of a finite value. */
uint16_t rand_f16(tu_rng *r);

/* Zeroes t and allocates its K/V for MAXTOK tokens (t->id is left 0). */
void tseq_init(tseq *t);
void tseq_free(tseq *t);

/* Appends n random tokens to every layer of t, in the pool and in the kept
 * copy. */
void tseq_append(kvt_pool *p, tseq *t, uint32_t n, tu_rng *r);

/* Every token of every (layer, head) reads back bit for bit. */
void tseq_verify(const kvt_pool *p, const tseq *t);

/* ---- pools ------------------------------------------------------------------ */

/* Options of a pool of the tier geometry (f16, one thread) with a disk tier
 * of disk_bytes in g_dir; device and host in blocks. */
kvt_pool_opts disk_opts(uint32_t dev, uint32_t host, uint64_t disk_bytes,
                        const kvt_mover_opts *mo);

/* Mover options: the defaults, with extents of extent_pages pages and
 * segments of segment_extents extents. */
kvt_mover_opts tier_mover_opts(uint32_t extent_pages, uint32_t segment_extents);

/* The residency bits (KVT_RES_*) of one page. */
uint8_t residency(const kvt_pool *p, kvt_seq_id s, uint32_t l, uint32_t h, uint32_t pg);

/* The pool's mover (never NULL). */
kvt_mover *mover_of(kvt_pool *p);

/* Entries of g_dir whose names do not start with a dot. */
int count_dir_entries(void);

/* Up to cap random moves of distinct full pages of the ns sequences t, each
 * from a tier that holds the page to another tier, half of them dropping
 * the source; before[i] (when not NULL) gets the page's residency. */
uint32_t random_batch(const kvt_pool *p, tseq *t, uint32_t ns, tu_rng *r, kvt_move *mv,
                      uint8_t *before, uint32_t cap);

/* ---- the mover tests' fixture ------------------------------------------------ */

#define TIER_FX_MAXS 3

/* A pool of disk_opts(dev, host, disk_bytes, mo) with its mover, a seeded
 * generator and up to TIER_FX_MAXS kept sequences. The fixture holds a copy
 * of the mover options, so it must stay where it was opened. */
typedef struct {
    kvt_pool_opts o;   /* the options the pool was created with */
    kvt_mover_opts mo; /* o.mover points here (when opened with a mover) */
    kvt_pool *p;
    kvt_mover *m;
    tu_rng r;
    uint32_t ns;
    tseq t[TIER_FX_MAXS];
} tier_fx;

/* Creates the pool (mo NULL: the default mover options) and takes its
 * mover; no sequence yet. */
void tier_fx_open(tier_fx *f, uint32_t dev, uint32_t host, uint64_t disk_bytes,
                  const kvt_mover_opts *mo, uint64_t seed);

/* A new sequence of the pool with ntok random tokens from f->r: f->t[f->ns++]. */
tseq *tier_fx_add(tier_fx *f, uint32_t ntok);

/* Destroys the pool (which waits for the moves in flight) and frees the
 * kept sequences. No kvt_pool_check: the tests check where they mean to. */
void tier_fx_close(tier_fx *f);

#endif /* KVT_TIERTEST_H */
