/* Append + metadata (kvt__cu_append, cuda/append.cu) against the CPU backend.
 *
 * Every case drives a real CPU pool (kvt_seq_append) and the kernel with the
 * same tokens: several sequences x KV heads, a prefill chunk spanning several
 * pages, more chunks that start inside a partly filled page, then single-token
 * decode steps, strided sources (a different stride per sequence), every
 * pool dtype from every source dtype, keys with NaN (random payloads and
 * signs), +-inf, +-0, subnormals, values past f16's range and ordinary values
 * of mixed magnitude (so the f32 running sums round and any change of order
 * shows). The kernel writes into a device arena and metadata store laid out
 * here (blocks and slots shuffled, block 0 the null block, the store in its
 * two planes - every slot's min and max rows, then every slot's mean row -
 * everything pre-filled with a pattern). After every launch:
 *  - the stored K and V rows equal kvt_seq_read_kv byte for byte;
 *  - each page's metadata, widened to f32, equals kvt_seq_page_meta_get bit for
 *    bit, and the f32 accumulators equal the CPU's (kvt__seq internals);
 *  - nothing outside the written rows / slots changed (the pattern).
 * The one allowance, documented in kvt_cuda.h: where the CPU's bits are a
 * NaN made by arithmetic or by a dtype conversion (a NaN key's page mean;
 * a NaN key or value converted between dtypes, where the CPU's F16C path
 * keeps payload bits its portable path drops), the GPU's must be a NaN too,
 * with any payload. Rows copied within one dtype carry NaN payloads exactly.
 * The grid hint max_tokens is exercised as 0 (one block per item), exact,
 * and too small (the blocks then stride over an item's pages). Bad
 * arguments name themselves. */
#include "gputest.h"
#include "testutil.h"
#include "internal.h"

#define PATTERN 0xa5u

typedef struct {
    uint32_t D, P, H, S; /* head_dim, page_tokens, KV heads, sequences */
    kvt_dtype pdt, sdt;  /* pool dtype, source dtype */
    uint32_t steps;
    int hint;            /* max_tokens: 0 = 0, 1 = exact, 2 = 1 token too few per chunk */
} cfg;

/* ---- source data ------------------------------------------------------------ */

/* A random element in dtype dt, specials included. */
static void put_elem(void *buf, kvt_dtype dt, size_t i, tu_rng *r, int specials)
{
    const uint32_t c = specials ? tu_below(r, 1000) : 999;
    const uint32_t sign = (uint32_t)(tu_next(r) & 1u);
    float f;
    if (c < 3) { /* NaN with a random payload */
        if (dt == KVT_DTYPE_F32) {
            uint32_t u = (sign << 31) | 0x7f800000u | (1u + tu_below(r, 0x7fffff));
            memcpy((float *)buf + i, &u, 4);
        } else if (dt == KVT_DTYPE_F16) {
            ((uint16_t *)buf)[i] = (uint16_t)((sign << 15) | 0x7c00u | (1u + tu_below(r, 0x3ff)));
        } else {
            ((uint16_t *)buf)[i] = (uint16_t)((sign << 15) | 0x7f80u | (1u + tu_below(r, 0x7f)));
        }
        return;
    }
    if (c < 6)
        f = sign ? -INFINITY : INFINITY;
    else if (c < 30)
        f = sign ? -0.0f : 0.0f;
    else if (c < 60)
        f = ldexpf(tu_unit(r), -18 - (int)tu_below(r, 10)); /* f16 subnormals and below */
    else if (c < 66)
        f = (sign ? -1.0f : 1.0f) * (60000.0f + 1e6f * (tu_unit(r) + 1.0f)); /* past f16 */
    else if (c < 300)
        f = tu_unit(r) * 1e-3f;
    else
        f = tu_unit(r) * (1.0f + (float)tu_below(r, 8));
    if (dt == KVT_DTYPE_F32)
        ((float *)buf)[i] = f;
    else if (dt == KVT_DTYPE_F16)
        ((uint16_t *)buf)[i] = kvt__f32_to_f16(f, KVT__RN);
    else
        ((uint16_t *)buf)[i] = kvt__f32_to_bf16(f, KVT__RN);
}

static int elem_is_nan(const void *buf, kvt_dtype dt, size_t i)
{
    if (dt == KVT_DTYPE_F32)
        return isnan(((const float *)buf)[i]);
    const uint16_t h = ((const uint16_t *)buf)[i];
    if (dt == KVT_DTYPE_F16)
        return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu);
    return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu);
}

static float widen(const void *buf, kvt_dtype dt, size_t i)
{
    if (dt == KVT_DTYPE_F32)
        return ((const float *)buf)[i];
    const uint16_t h = ((const uint16_t *)buf)[i];
    return dt == KVT_DTYPE_F16 ? kvt__f16_to_f32(h) : kvt__bf16_to_f32(h);
}

static uint32_t fbits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Bit-equal, or (when allowed) both NaN. */
static void expect_f32(float want, float got, int nan_any, const char *what, uint32_t s,
                       uint32_t h, uint32_t pg, uint32_t d)
{
    if (fbits(want) == fbits(got))
        return;
    if (nan_any && isnan(want) && isnan(got))
        return;
    fail_msg("%s: seq %u head %u page %u dim %u: CPU %a (0x%08x), GPU %a (0x%08x)", what, s, h,
             pg, d, (double)want, fbits(want), (double)got, fbits(got));
}

/* ---- one case ------------------------------------------------------------------ */

static void run_case(const cfg *c, uint64_t seed)
{
    tu_rng r = {seed};
    const uint32_t D = c->D, P = c->P, H = c->H, S = c->S, steps = c->steps;
    const size_t pe = kvt_dtype_size(c->pdt), se = kvt_dtype_size(c->sdt);
    const int cross = c->pdt != c->sdt; /* conversions may re-encode NaNs */

    /* Schedules: a prefill chunk (1 .. 3P + 5 tokens, sometimes none), then
     * chunks of 1 .. P + 3, then single tokens; 0 = the sequence sits out. */
    uint32_t *sched = calloc((size_t)S * steps, sizeof *sched), *T = calloc(S, sizeof *T);
    uint32_t Tmax = 0;
    for (uint32_t s = 0; s < S; s++) {
        uint32_t tot = 0;
        for (uint32_t j = 0; j < steps; j++) {
            uint32_t n;
            if (j == 0)
                n = tu_below(&r, 5) == 0 ? 0 : 1 + tu_below(&r, 3 * P + 5);
            else if (j < steps / 2)
                n = tu_below(&r, 4) == 0 ? 0 : 1 + tu_below(&r, P + 3);
            else
                n = tu_below(&r, 6) == 0 ? 0 : 1;
            sched[(size_t)s * steps + j] = n;
            tot += n;
        }
        Tmax = tot > Tmax ? tot : Tmax;
    }
    const uint32_t maxp = (Tmax + P - 1) / P + 1;
    const uint64_t bb = 2ull * P * D * pe, mb = 3ull * D * pe, row = (uint64_t)D * pe;

    /* The CPU pool. */
    kvt_pool_opts o = tu_opts(1, H, H, D, P, c->pdt, (uint64_t)S * H * maxp + 4, 0);
    kvt_pool *pool;
    TU_OK(kvt_pool_create(&o, &pool));
    kvt_seq_id *ids = calloc(S, sizeof *ids);
    for (uint32_t s = 0; s < S; s++)
        TU_OK(kvt_seq_create(pool, NULL, &ids[s]));

    /* The device side: shuffled blocks (0 = null block, never used) and
     * slots, spares left untouched. */
    const uint32_t nent = S * H * maxp, nblk = nent + 3, nslot = nent + 2;
    uint32_t *dev_tab = malloc(nent * sizeof *dev_tab), *meta_tab = malloc(nent * sizeof *meta_tab);
    uint32_t *perm = malloc(nblk * sizeof *perm);
    for (uint32_t i = 0; i < nblk; i++)
        perm[i] = i;
    for (uint32_t i = nblk - 1; i > 1; i--) { /* shuffle 1..nblk-1 */
        uint32_t j = 1 + tu_below(&r, i);
        uint32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (uint32_t i = 0; i < nent; i++)
        dev_tab[i] = perm[1 + i];
    for (uint32_t i = 0; i < nslot; i++)
        perm[i] = i;
    for (uint32_t i = nslot - 1; i > 0; i--) {
        uint32_t j = tu_below(&r, i + 1);
        uint32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (uint32_t i = 0; i < nent; i++)
        meta_tab[i] = perm[i];

    uint8_t *arena = malloc(nblk * bb), *meta = malloc(nslot * mb);
    float *acc = malloc((size_t)S * H * 3 * D * sizeof *acc);
    uint8_t *d_arena, *d_meta;
    uint32_t *d_dev_tab, *d_meta_tab;
    float *d_acc;
    TU_OK(kvt__cu_malloc((void **)&d_arena, nblk * bb));
    TU_OK(kvt__cu_malloc((void **)&d_meta, nslot * mb));
    TU_OK(kvt__cu_malloc((void **)&d_dev_tab, nent * 4));
    TU_OK(kvt__cu_malloc((void **)&d_meta_tab, nent * 4));
    TU_OK(kvt__cu_malloc((void **)&d_acc, (size_t)S * H * 3 * D * 4));
    TU_OK(kvt__cu_memset(d_arena, PATTERN, nblk * bb));
    TU_OK(kvt__cu_memset(d_meta, PATTERN, nslot * mb));
    TU_OK(kvt__cu_memset(d_acc, 0xff, (size_t)S * H * 3 * D * 4)); /* NaN: must not be read */
    TU_OK(kvt__cu_memcpy(d_dev_tab, dev_tab, nent * 4));
    TU_OK(kvt__cu_memcpy(d_meta_tab, meta_tab, nent * 4));
    void *stream;
    TU_OK(kvt__cu_stream_create(&stream, 0));

    kvt__cu_append_item *items = malloc((size_t)S * H * sizeof *items);
    kvt__cu_append_item *d_items;
    TU_OK(kvt__cu_malloc((void **)&d_items, (size_t)S * H * sizeof *items));
    void **kb = calloc(S, sizeof *kb), **vb = calloc(S, sizeof *vb);
    uint8_t *kout = malloc((size_t)(Tmax + 1) * D * pe), *vout = malloc((size_t)(Tmax + 1) * D * pe);
    float *mn = malloc(D * 4), *mx = malloc(D * 4), *me = malloc(D * 4);

    for (uint32_t j = 0; j < steps; j++) {
        /* Sources: each sequence's chunk with its own stride, packed into
         * one device buffer per K and V. */
        uint64_t total = 0, *base = calloc(S, sizeof *base), *stride = calloc(S, sizeof *stride);
        uint32_t chunk_max = 0;
        for (uint32_t s = 0; s < S; s++) {
            const uint32_t n = sched[(size_t)s * steps + j];
            stride[s] = (uint64_t)H * D + tu_below(&r, 3) * 8u + tu_below(&r, 2);
            base[s] = total + tu_below(&r, 5);
            total = base[s] + n * stride[s];
            chunk_max = n > chunk_max ? n : chunk_max;
        }
        void *hk = calloc(total + 1, se), *hv = calloc(total + 1, se);
        for (uint32_t s = 0; s < S; s++) {
            const uint32_t n = sched[(size_t)s * steps + j];
            for (uint64_t e = 0; e < n * stride[s]; e++) {
                put_elem(hk, c->sdt, base[s] + e, &r, 1);
                put_elem(hv, c->sdt, base[s] + e, &r, 1);
            }
            if (n) {
                kb[s] = (uint8_t *)hk + base[s] * se;
                vb[s] = (uint8_t *)hv + base[s] * se;
                TU_OK(kvt_seq_append(pool, ids[s], 0, kb[s], vb[s], n, c->sdt, stride[s]));
            }
        }
        void *d_k, *d_v;
        TU_OK(kvt__cu_malloc(&d_k, (total + 1) * se));
        TU_OK(kvt__cu_malloc(&d_v, (total + 1) * se));
        TU_OK(kvt__cu_memcpy(d_k, hk, (total + 1) * se));
        TU_OK(kvt__cu_memcpy(d_v, hv, (total + 1) * se));

        uint32_t ni = 0;
        for (uint32_t s = 0; s < S; s++)
            for (uint32_t h = 0; h < H; h++) {
                const uint32_t n = sched[(size_t)s * steps + j];
                items[ni].src_off = base[s] + (uint64_t)h * D;
                items[ni].src_stride = stride[s];
                items[ni].table_off = (uint64_t)(s * H + h) * maxp;
                items[ni].acc_off = (uint64_t)(s * H + h) * 3u * D;
                items[ni].first_pos = T[s];
                items[ni].n_tokens = n; /* 0: a no-op item */
                ni++;
            }
        /* Items in a scrambled order: the launch does not depend on it. */
        for (uint32_t i = ni - 1; i > 0; i--) {
            uint32_t k = tu_below(&r, i + 1);
            kvt__cu_append_item t = items[i];
            items[i] = items[k];
            items[k] = t;
        }
        TU_OK(kvt__cu_memcpy(d_items, items, ni * sizeof *items));
        kvt__cu_append_args a = {0};
        a.d_items = d_items;
        a.n_items = ni;
        a.D = D;
        a.P = P;
        a.dtype = c->pdt;
        a.src_dtype = c->sdt;
        a.d_k = d_k;
        a.d_v = d_v;
        a.d_dev_table = d_dev_tab;
        a.d_meta_table = d_meta_tab;
        a.d_dev_base = d_arena;
        a.block_bytes = bb;
        a.d_meta_base = d_meta;
        a.meta_bytes = mb;
        a.meta_slots = nslot;
        a.d_acc = d_acc;
        a.max_tokens = c->hint == 0 ? 0 : c->hint == 1 ? chunk_max
                                                         : (chunk_max > 1 ? chunk_max / 2 : 0);
        TU_OK(kvt__cu_append(&a, stream));
        TU_OK(kvt__cu_stream_sync(stream));
        for (uint32_t s = 0; s < S; s++)
            T[s] += sched[(size_t)s * steps + j];

        /* Compare everything. */
        TU_OK(kvt__cu_memcpy(arena, d_arena, nblk * bb));
        TU_OK(kvt__cu_memcpy(meta, d_meta, nslot * mb));
        TU_OK(kvt__cu_memcpy(acc, d_acc, (size_t)S * H * 3 * D * 4));
        uint8_t *blk_used = calloc(nblk, 1), *slot_used = calloc(nslot, 1);
        for (uint32_t s = 0; s < S; s++) {
            kvt__seq *sq;
            TU_OK(kvt__seq_lookup(pool, ids[s], &sq));
            const uint32_t np = (T[s] + P - 1) / P;
            for (uint32_t h = 0; h < H; h++) {
                const size_t e0 = (size_t)(s * H + h) * maxp;
                if (T[s])
                    TU_OK(kvt_seq_read_kv(pool, ids[s], 0, h, 0, T[s], kout, vout));
                for (uint32_t t = 0; t < T[s]; t++) {
                    const uint32_t pg = t / P, slot = t % P;
                    const uint8_t *blk = arena + dev_tab[e0 + pg] * bb;
                    for (int kv = 0; kv < 2; kv++) {
                        const uint8_t *want = (kv ? vout : kout) + (size_t)t * D * pe;
                        const uint8_t *got = blk + (size_t)(kv ? P + slot : slot) * D * pe;
                        for (uint32_t d = 0; d < D; d++) {
                            if (!memcmp(want + d * pe, got + d * pe, pe))
                                continue;
                            if (cross && elem_is_nan(want, c->pdt, d) &&
                                elem_is_nan(got, c->pdt, d))
                                continue;
                            fail_msg("%s row: seq %u head %u token %u dim %u differs (step %u)",
                                     kv ? "V" : "K", s, h, t, d, j);
                        }
                    }
                }
                for (uint32_t pg = 0; pg < np; pg++) {
                    const uint32_t b = dev_tab[e0 + pg], m = meta_tab[e0 + pg];
                    blk_used[b] = 1;
                    slot_used[m] = 1;
                    /* Slots past the tokens are untouched. */
                    const uint32_t used = pg + 1 < np ? P : T[s] - pg * P;
                    for (int kv = 0; kv < 2; kv++)
                        for (size_t x = (size_t)(kv * P + used) * D * pe;
                             x < (size_t)(kv * P + P) * D * pe; x++)
                            if (arena[b * bb + x] != PATTERN)
                                fail_msg("block of seq %u head %u page %u: byte %zu written "
                                         "past the tokens", s, h, pg, x);
                    TU_OK(kvt_seq_page_meta_get(pool, ids[s], 0, h, pg, mn, mx, me));
                    /* Plane 1: min and max rows; plane 2: the mean row. */
                    const uint8_t *ms = meta + m * 2 * row;
                    const uint8_t *mmean = meta + (uint64_t)nslot * 2 * row + m * row;
                    for (uint32_t d = 0; d < D; d++) {
                        const float gmin = widen(ms, c->pdt, d), gmax = widen(ms, c->pdt, D + d);
                        if (isnan(gmin) || isnan(gmax))
                            fail_msg("seq %u head %u page %u dim %u: NaN bound", s, h, pg, d);
                        expect_f32(mn[d], gmin, 0, "min", s, h, pg, d);
                        expect_f32(mx[d], gmax, 0, "max", s, h, pg, d);
                        expect_f32(me[d], widen(mmean, c->pdt, d), 1, "mean", s, h, pg, d);
                    }
                }
                if (T[s]) { /* the open page's accumulators */
                    const float *ca = sq->acc + (size_t)h * 3 * D;
                    const float *ga = acc + (size_t)(s * H + h) * 3 * D;
                    for (uint32_t d = 0; d < 3 * D; d++)
                        expect_f32(ca[d], ga[d], d >= 2 * D, "accumulator", s, h, np - 1,
                                   d);
                }
            }
        }
        for (uint32_t b = 0; b < nblk; b++)
            for (uint64_t x = 0; !blk_used[b] && x < bb; x++)
                if (arena[b * bb + x] != PATTERN)
                    fail_msg("unused block %u written (byte %llu)", b, (unsigned long long)x);
        for (uint32_t m = 0; m < nslot; m++)
            for (uint64_t x = 0; !slot_used[m] && x < mb; x++) {
                const uint64_t at = x < 2 * row ? (uint64_t)m * 2 * row + x
                                                : (uint64_t)nslot * 2 * row + m * row + x - 2 * row;
                if (meta[at] != PATTERN)
                    fail_msg("unused metadata slot %u written (%s plane)", m,
                             x < 2 * row ? "min / max" : "mean");
            }
        free(blk_used);
        free(slot_used);
        kvt__cu_free(d_k);
        kvt__cu_free(d_v);
        free(hk);
        free(hv);
        free(base);
        free(stride);
    }

    kvt__cu_stream_destroy(stream);
    kvt__cu_free(d_items);
    kvt__cu_free(d_arena);
    kvt__cu_free(d_meta);
    kvt__cu_free(d_dev_tab);
    kvt__cu_free(d_meta_tab);
    kvt__cu_free(d_acc);
    kvt_pool_destroy(pool);
    free(sched);
    free(T);
    free(ids);
    free(dev_tab);
    free(meta_tab);
    free(perm);
    free(arena);
    free(meta);
    free(acc);
    free(items);
    free(kb);
    free(vb);
    free(kout);
    free(vout);
    free(mn);
    free(mx);
    free(me);
}

/* ---- tests -------------------------------------------------------------------------- */

static const kvt_dtype dts[3] = {KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_F32};

/* Every (pool, source) dtype pair, D in {64, 128, 40}, P in {16, 32, 8}. */
static void test_append_dtypes(void **state)
{
    (void)state;
    uint64_t seed = 0x5eed0001;
    for (int p = 0; p < 3; p++)
        for (int s = 0; s < 3; s++) {
            const int k = p * 3 + s;
            cfg c = {k % 3 == 0 ? 64u : k % 3 == 1 ? 128u : 40u,
                     k % 2 ? 32u : (k % 3 == 2 ? 8u : 16u),
                     2,
                     2,
                     dts[p],
                     dts[s],
                     10,
                     (k + p) % 3};
            run_case(&c, seed++);
        }
}

/* More sequences and heads, long decode tails, each grid hint. */
static void test_append_decode(void **state)
{
    (void)state;
    for (int hint = 0; hint < 3; hint++) {
        cfg c = {64, 16, 3, 4, KVT_DTYPE_F16, KVT_DTYPE_F32, 20, hint};
        run_case(&c, 0xdec0de00u + (uint64_t)hint);
    }
    cfg c = {8, 8, 1, 2, KVT_DTYPE_BF16, KVT_DTYPE_BF16, 12, 1};
    run_case(&c, 0xdec0de10u);
}

/* Large head_dim (threads loop over dimensions) and the largest page. */
static void test_append_wide(void **state)
{
    (void)state;
    cfg c = {512, 256, 1, 1, KVT_DTYPE_F16, KVT_DTYPE_BF16, 3, 1};
    run_case(&c, 0x31de);
    cfg c2 = {1024, 8, 1, 1, KVT_DTYPE_F32, KVT_DTYPE_F16, 4, 2};
    run_case(&c2, 0x31de2);
}

static void test_bad_args(void **state)
{
    (void)state;
    static uint8_t dummy[64] __attribute__((aligned(16)));
    kvt__cu_append_args ok = {0};
    ok.d_items = (const kvt__cu_append_item *)dummy;
    ok.n_items = 1;
    ok.D = 64;
    ok.P = 16;
    ok.dtype = KVT_DTYPE_F16;
    ok.src_dtype = KVT_DTYPE_F32;
    ok.d_k = ok.d_v = dummy;
    ok.d_dev_table = ok.d_meta_table = (const uint32_t *)dummy;
    ok.d_dev_base = ok.d_meta_base = dummy;
    ok.block_bytes = 2 * 16 * 64 * 2;
    ok.meta_bytes = 3 * 64 * 2;
    ok.meta_slots = 2;
    ok.d_acc = (float *)dummy;
    kvt__cu_append_args a;

    TU_EXPECT_ERR(kvt__cu_append(NULL, NULL), KVT_EINVAL, "a");
#define BAD(field, value, needle)                                      \
    do {                                                               \
        a = ok;                                                        \
        a.field = value;                                               \
        TU_EXPECT_ERR(kvt__cu_append(&a, NULL), KVT_EINVAL, needle);   \
    } while (0)
    BAD(D, 0, "a->D");
    BAD(D, 12, "a->D");
    BAD(D, 1032, "a->D");
    BAD(P, 0, "a->P");
    BAD(P, 24, "a->P");
    BAD(P, 512, "a->P");
    BAD(P, 4, "a->P");
    BAD(dtype, 0, "a->dtype");
    BAD(dtype, 7, "a->dtype");
    BAD(src_dtype, 0, "a->src_dtype");
    BAD(src_dtype, 4, "a->src_dtype");
    BAD(block_bytes, 2 * 16 * 64 * 2 - 1, "a->block_bytes");
    BAD(meta_bytes, 3 * 64 * 2 - 2, "a->meta_bytes");
    BAD(meta_bytes, 3 * 64 * 2 + 16, "a->meta_bytes"); /* the planes have no padding */
    BAD(meta_bytes, 3 * 64 * 4, "a->meta_bytes");      /* f32's rows for an f16 pool */
    BAD(meta_slots, 0, "a->meta_slots");
    BAD(n_items, 0x80000000u, "a->n_items");
    BAD(d_items, NULL, "a->d_items");
    BAD(d_k, NULL, "a->d_k");
    BAD(d_v, NULL, "a->d_v");
    BAD(d_dev_table, NULL, "a->d_dev_table");
    BAD(d_meta_table, NULL, "a->d_meta_table");
    BAD(d_dev_base, NULL, "a->d_dev_base");
    BAD(d_meta_base, NULL, "a->d_meta_base");
    BAD(d_acc, NULL, "a->d_acc");
#undef BAD
    /* No items: nothing to do, even with NULL arrays. */
    a = ok;
    a.n_items = 0;
    a.d_items = NULL;
    a.d_acc = NULL;
    TU_OK(kvt__cu_append(&a, NULL));
}

int main(void)
{
    GPU_SKIP_WITHOUT_DEVICE();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_append_dtypes),
        cmocka_unit_test(test_append_decode),
        cmocka_unit_test(test_append_wide),
        cmocka_unit_test(test_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
