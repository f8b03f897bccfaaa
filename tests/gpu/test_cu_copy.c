/* Block copies (kvt__cu_copy_kernel, kvt__cu_copy_memcpy) and the dirty-range
 * table sync (kvt__cu_table_sync), cuda/copy.cu.
 *
 * Every copy list moves bytes between four areas: pinned mapped host memory
 * (source and destination) and device memory (source and destination), in
 * the three directions the mover uses (host -> device, device -> host,
 * device -> device). The expected result is memcpy on host copies of the
 * areas taken before the run; after the run both destination areas are
 * compared whole and byte-exactly (so stray writes between the copies show
 * too). Sizes run from 8 KiB to 1 MiB with unaligned sizes and offsets
 * (including src and dst that agree only modulo 8, 4 or nothing), through
 * every chunk size from 16 bytes to larger than any copy and grid caps of 1,
 * 3, 37 blocks and the default; the same lists go through the
 * cudaMemcpyAsync path. The table sync is checked against a host loop. */
#include "gputest.h"
#include "testutil.h"

#define AREA (8u << 20) /* bytes of each of the four areas */

typedef struct {
    uint8_t *hs, *hd; /* pinned host: source, destination */
    uint8_t *ds, *dd; /* device: source, destination */
    uint8_t *hs_ref, *ds_ref;
    uint8_t *hd_exp, *dd_exp, *dd_got;
    void *stream;
} areas;

static void fill(uint8_t *p, size_t n, tu_rng *r)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint64_t x = tu_next(r);
        memcpy(p + i, &x, 8);
    }
    for (; i < n; i++)
        p[i] = (uint8_t)tu_next(r);
}

static void areas_init(areas *a, tu_rng *r)
{
    TU_OK(kvt__cu_host_alloc((void **)&a->hs, AREA));
    TU_OK(kvt__cu_host_alloc((void **)&a->hd, AREA));
    TU_OK(kvt__cu_malloc((void **)&a->ds, AREA));
    TU_OK(kvt__cu_malloc((void **)&a->dd, AREA));
    a->hs_ref = malloc(AREA);
    a->ds_ref = malloc(AREA);
    a->hd_exp = malloc(AREA);
    a->dd_exp = malloc(AREA);
    a->dd_got = malloc(AREA);
    assert_non_null(a->dd_got);
    fill(a->hs, AREA, r);
    memcpy(a->hs_ref, a->hs, AREA);
    fill(a->ds_ref, AREA, r);
    TU_OK(kvt__cu_memcpy(a->ds, a->ds_ref, AREA));
    TU_OK(kvt__cu_stream_create(&a->stream, 0));
}

static void areas_fini(areas *a)
{
    kvt__cu_stream_destroy(a->stream);
    kvt__cu_host_free(a->hs);
    kvt__cu_host_free(a->hd);
    kvt__cu_free(a->ds);
    kvt__cu_free(a->dd);
    free(a->hs_ref);
    free(a->ds_ref);
    free(a->hd_exp);
    free(a->dd_exp);
    free(a->dd_got);
}

/* Fresh destination contents before each run (the expected result starts
 * from the same bytes). */
static void reset_destinations(areas *a, tu_rng *r)
{
    fill(a->hd_exp, AREA, r);
    fill(a->dd_exp, AREA, r);
    memcpy(a->hd, a->hd_exp, AREA);
    TU_OK(kvt__cu_memcpy(a->dd, a->dd_exp, AREA));
}

/* A random list of n copies of min_bytes..max_bytes (log-uniform), a third
 * of them with unaligned sizes and offsets. Destinations are laid out one
 * after another (random gaps) so none overlap; sources anywhere. Also
 * applies each copy to the expected areas (host memcpy from the reference
 * copies of the sources). */
static void make_list(areas *a, tu_rng *r, kvt__cu_copy *list, uint32_t n, uint32_t min_bytes,
                      uint32_t max_bytes)
{
    uint64_t cur[2] = {0, 0}; /* cursors in hd, dd */
    for (uint32_t i = 0; i < n; i++) {
        const double lr = log((double)max_bytes / min_bytes);
        uint64_t bytes = (uint64_t)(min_bytes * exp(lr * (tu_next(r) >> 11) * 0x1p-53));
        const int odd = tu_below(r, 3) == 0;
        bytes = odd ? bytes + 1 + tu_below(r, 15) : bytes & ~(uint64_t)15;
        if (tu_below(r, 40) == 0)
            bytes = 0; /* an empty copy now and then */
        const uint32_t kind = tu_below(r, 3); /* 0 h->d, 1 d->h, 2 d->d */
        const int to_host = kind == 1, from_host = kind == 0;
        /* Source offset: 16-aligned, or agreeing with the destination only
         * modulo 8, 4, or not at all (chosen after the destination). */
        uint64_t gap = tu_below(r, 4) * 16;
        uint64_t doff = (cur[to_host ? 0 : 1] + 15) / 16 * 16 + gap;
        if (odd)
            doff += tu_below(r, 16);
        assert_true(doff + bytes <= AREA);
        cur[to_host ? 0 : 1] = doff + bytes;
        uint64_t soff = (uint64_t)tu_below(r, (uint32_t)(AREA - bytes - 64)) & ~(uint64_t)15;
        switch (odd ? tu_below(r, 4) : 4) {
        case 0: soff += (doff + 8) % 16; break;  /* agree modulo 8 only */
        case 1: soff += (doff + 4) % 16; break;  /* modulo 4 only */
        case 2: soff += (doff + 1) % 16; break;  /* not even modulo 2 */
        case 3: soff += doff % 16; break;        /* same misalignment */
        default: break;
        }
        assert_true(soff + bytes <= AREA);
        uint8_t *src = from_host ? a->hs : a->ds, *dst = to_host ? a->hd : a->dd;
        const uint8_t *sref = from_host ? a->hs_ref : a->ds_ref;
        uint8_t *dexp = to_host ? a->hd_exp : a->dd_exp;
        if (from_host)
            src = kvt__cu_host_device_ptr(a->hs);
        if (to_host)
            dst = kvt__cu_host_device_ptr(a->hd);
        assert_non_null(src);
        assert_non_null(dst);
        list[i].src = (uint64_t)(uintptr_t)(src + soff);
        list[i].dst = (uint64_t)(uintptr_t)(dst + doff);
        list[i].bytes = bytes;
        memcpy(dexp + doff, sref + soff, bytes);
    }
}

static void check_areas(areas *a, const char *what)
{
    TU_OK(kvt__cu_stream_sync(a->stream));
    TU_OK(kvt__cu_memcpy(a->dd_got, a->dd, AREA));
    if (!memcmp(a->hd, a->hd_exp, AREA) && !memcmp(a->dd_got, a->dd_exp, AREA))
        return;
    for (size_t i = 0; i < AREA; i++) {
        if (a->hd[i] != a->hd_exp[i])
            fail_msg("%s: host destination byte %zu is 0x%02x, expected 0x%02x", what, i,
                     a->hd[i], a->hd_exp[i]);
        if (a->dd_got[i] != a->dd_exp[i])
            fail_msg("%s: device destination byte %zu is 0x%02x, expected 0x%02x", what, i,
                     a->dd_got[i], a->dd_exp[i]);
    }
}

/* The list in device-visible memory: device memory, or pinned host memory
 * read through UVA. */
static kvt__cu_copy *list_upload(const kvt__cu_copy *list, uint32_t n, int pinned, void **owner)
{
    const size_t bytes = (size_t)n * sizeof *list;
    if (pinned) {
        TU_OK(kvt__cu_host_alloc(owner, bytes));
        memcpy(*owner, list, bytes);
        return kvt__cu_host_device_ptr(*owner);
    }
    TU_OK(kvt__cu_malloc(owner, bytes));
    TU_OK(kvt__cu_memcpy(*owner, list, bytes));
    return *owner;
}

static void list_free(void *owner, int pinned)
{
    if (pinned)
        kvt__cu_host_free(owner);
    else
        kvt__cu_free(owner);
}

/* ---- the kernel and the memcpy path on random lists ------------------------ */

static void test_copy_random(void **state)
{
    (void)state;
    tu_rng r = {0x5eedc0c0a11ull};
    areas a;
    areas_init(&a, &r);
    /* Chunk sizes, each with a byte range that keeps the emulated run
     * short: 16-byte chunks make one work unit per 16 bytes. */
    const struct {
        uint64_t chunk;
        uint32_t min_bytes, max_bytes, max_n;
    } cfg[] = {
        {0, 8u << 10, 1u << 20, 6},          /* default 256 KiB */
        {16, 8u << 10, 16u << 10, 3},
        {4096, 8u << 10, 256u << 10, 6},
        {48u << 10, 8u << 10, 1u << 20, 6},  /* not a power of two */
        {1u << 20, 8u << 10, 1u << 20, 6},   /* one chunk a copy */
        {1ull << 40, 8u << 10, 1u << 20, 6}, /* far beyond any copy */
    };
    const uint32_t caps[] = {1, 3, 37, 0};
    kvt__cu_copy list[16];
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        for (size_t g = 0; g < sizeof caps / sizeof caps[0]; g++) {
            const uint32_t n = 1 + tu_below(&r, cfg[c].max_n);
            const int pinned = (int)((c + g) & 1);
            reset_destinations(&a, &r);
            make_list(&a, &r, list, n, cfg[c].min_bytes, cfg[c].max_bytes);
            void *owner;
            kvt__cu_copy *d_list = list_upload(list, n, pinned, &owner);
            char what[128];
            snprintf(what, sizeof what, "kernel: chunk %llu, max_blocks %u, %u copies, list in %s",
                     (unsigned long long)cfg[c].chunk, caps[g], n, pinned ? "host" : "device");
            TU_OK(kvt__cu_copy_kernel(d_list, n, caps[g], cfg[c].chunk, a.stream));
            check_areas(&a, what);
            list_free(owner, pinned);

            /* The same kind of list through cudaMemcpyAsync. */
            reset_destinations(&a, &r);
            make_list(&a, &r, list, n, cfg[c].min_bytes, cfg[c].max_bytes);
            snprintf(what, sizeof what, "memcpy: %u copies", n);
            TU_OK(kvt__cu_copy_memcpy(list, n, a.stream));
            check_areas(&a, what);
        }
    }
    areas_fini(&a);
}

/* More copies than one tile (256) of the kernel's scan: several tiles per
 * block, small copies of 1..2 KiB, many of them unaligned. */
static void test_copy_many(void **state)
{
    (void)state;
    tu_rng r = {0x77aa1234ull};
    areas a;
    areas_init(&a, &r);
    enum { N = 700 };
    kvt__cu_copy *list = malloc(N * sizeof *list);
    const uint32_t caps[] = {1, 5, 0};
    const uint64_t chunks[] = {0, 512, 16};
    for (size_t g = 0; g < 3; g++) {
        reset_destinations(&a, &r);
        make_list(&a, &r, list, N, 1u << 10, 2u << 10);
        void *owner;
        kvt__cu_copy *d_list = list_upload(list, N, 0, &owner);
        char what[96];
        snprintf(what, sizeof what, "kernel: %u copies, chunk %llu, max_blocks %u", N,
                 (unsigned long long)chunks[g], caps[g]);
        TU_OK(kvt__cu_copy_kernel(d_list, N, caps[g], chunks[g], a.stream));
        check_areas(&a, what);
        list_free(owner, 0);
    }
    reset_destinations(&a, &r);
    make_list(&a, &r, list, N, 1u << 10, 2u << 10);
    TU_OK(kvt__cu_copy_memcpy(list, N, a.stream));
    check_areas(&a, "memcpy: 700 copies");
    free(list);
    areas_fini(&a);
}

/* Sizes and offsets at every residue modulo 16 around the vector width,
 * short copies (0..40 bytes) included, between host and device. */
static void test_copy_edges(void **state)
{
    (void)state;
    tu_rng r = {0xed9e5ull};
    areas a;
    areas_init(&a, &r);
    enum { N = 96 };
    kvt__cu_copy list[N];
    reset_destinations(&a, &r);
    uint8_t *hs = kvt__cu_host_device_ptr(a.hs);
    for (uint32_t i = 0; i < N; i++) {
        const uint64_t bytes = i < 48 ? i : 8192 + (i % 16);
        const uint64_t doff = (uint64_t)i * 16384 + (i % 16);
        const uint64_t soff = (uint64_t)i * 16384 + ((i / 16) % 16);
        const int from_host = i & 1;
        list[i].src = (uint64_t)(uintptr_t)((from_host ? hs : a.ds) + soff);
        list[i].dst = (uint64_t)(uintptr_t)(a.dd + doff);
        list[i].bytes = bytes;
        memcpy(a.dd_exp + doff, (from_host ? a.hs_ref : a.ds_ref) + soff, bytes);
    }
    void *owner;
    kvt__cu_copy *d_list = list_upload(list, N, 1, &owner);
    TU_OK(kvt__cu_copy_kernel(d_list, N, 4, 4096, a.stream));
    check_areas(&a, "kernel: edge sizes and offsets");
    list_free(owner, 1);
    areas_fini(&a);
}

/* ---- table sync -------------------------------------------------------------- */

static void test_table_sync(void **state)
{
    (void)state;
    tu_rng r = {0x7ab1e5ull};
    enum { NH = 20000, ND = 24000 };
    uint32_t *h_table, *d_table, *exp = malloc(ND * sizeof *exp), *got = malloc(ND * sizeof *got);
    void *stream;
    TU_OK(kvt__cu_host_alloc((void **)&h_table, NH * sizeof *h_table));
    TU_OK(kvt__cu_malloc((void **)&d_table, ND * sizeof *d_table));
    TU_OK(kvt__cu_stream_create(&stream, 1));
    /* Range counts above the kernel's grid cap (4096) too; lengths from 0
     * to past one block of threads. */
    const uint32_t counts[] = {1, 2, 17, 300, 5000};
    const uint32_t maxlen[] = {700, 300, 200, 60, 4};
    for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
        const uint32_t n = counts[c];
        for (uint32_t i = 0; i < NH; i++)
            h_table[i] = (uint32_t)tu_next(&r);
        for (uint32_t i = 0; i < ND; i++)
            exp[i] = (uint32_t)tu_next(&r);
        TU_OK(kvt__cu_memcpy(d_table, exp, ND * sizeof *exp));
        kvt__cu_range *rg = calloc(n, sizeof *rg);
        uint64_t cur = 0;
        for (uint32_t i = 0; i < n; i++) {
            /* Empty ranges too, except in the largest count, where every
             * range must show (a range the grid-stride loop skipped). */
            rg[i].n = n > 4096 ? 1 + tu_below(&r, maxlen[c]) : tu_below(&r, maxlen[c] + 1);
            rg[i].src_off = tu_below(&r, NH - rg[i].n + 1);
            cur += tu_below(&r, 3);
            rg[i].dst_off = cur;
            cur += rg[i].n;
            assert_true(cur <= ND);
        }
        /* Destinations in shuffled order (the ranges need not be sorted). */
        for (uint32_t i = n; i > 1; i--) {
            const uint32_t j = tu_below(&r, i);
            const kvt__cu_range t = rg[i - 1];
            rg[i - 1] = rg[j];
            rg[j] = t;
        }
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t e = 0; e < rg[i].n; e++)
                exp[rg[i].dst_off + e] = h_table[rg[i].src_off + e];
        kvt__cu_range *d_rg;
        TU_OK(kvt__cu_malloc((void **)&d_rg, n * sizeof *rg));
        TU_OK(kvt__cu_memcpy(d_rg, rg, n * sizeof *rg));
        TU_OK(kvt__cu_table_sync(kvt__cu_host_device_ptr(h_table), d_table, d_rg, n, stream));
        TU_OK(kvt__cu_stream_sync(stream));
        TU_OK(kvt__cu_memcpy(got, d_table, ND * sizeof *got));
        for (uint32_t i = 0; i < ND; i++)
            if (got[i] != exp[i])
                fail_msg("table sync, %u ranges: entry %u is %u, expected %u", n, i, got[i],
                         exp[i]);
        kvt__cu_free(d_rg);
        free(rg);
    }
    kvt__cu_stream_destroy(stream);
    kvt__cu_host_free(h_table);
    kvt__cu_free(d_table);
    free(exp);
    free(got);
}

/* ---- bad arguments and empty calls ----------------------------------------- */

static void test_bad_args(void **state)
{
    (void)state;
    void *stream;
    TU_OK(kvt__cu_stream_create(&stream, 0));
    kvt__cu_copy *d_list;
    TU_OK(kvt__cu_malloc((void **)&d_list, sizeof *d_list));
    uint32_t *d_table;
    TU_OK(kvt__cu_malloc((void **)&d_table, 64));
    uint32_t *h_table;
    TU_OK(kvt__cu_host_alloc((void **)&h_table, 64));
    kvt__cu_range *d_rg;
    TU_OK(kvt__cu_malloc((void **)&d_rg, sizeof *d_rg));

    /* Nothing to do: no launch, no error, even with NULL pointers. */
    TU_OK(kvt__cu_copy_kernel(NULL, 0, 0, 0, stream));
    TU_OK(kvt__cu_copy_memcpy(NULL, 0, stream));
    TU_OK(kvt__cu_table_sync(NULL, NULL, NULL, 0, stream));

    TU_EXPECT_ERR(kvt__cu_copy_kernel(NULL, 3, 0, 0, stream), KVT_EINVAL, "d_list");
    TU_EXPECT_ERR(kvt__cu_copy_kernel(d_list, 1, 0, 17, stream), KVT_EINVAL, "chunk_bytes");
    TU_EXPECT_ERR(kvt__cu_copy_kernel(d_list, 1, 0, 8, stream), KVT_EINVAL, "chunk_bytes");
    TU_EXPECT_ERR(kvt__cu_copy_memcpy(NULL, 2, stream), KVT_EINVAL, "h_list");
    kvt__cu_copy h[2] = {{(uint64_t)(uintptr_t)d_table, (uint64_t)(uintptr_t)d_table + 32, 16},
                         {0, (uint64_t)(uintptr_t)d_table, 4}};
    TU_EXPECT_ERR(kvt__cu_copy_memcpy(h, 2, stream), KVT_EINVAL, "h_list[1].src");
    h[1].src = h[0].src;
    h[1].dst = 0;
    TU_EXPECT_ERR(kvt__cu_copy_memcpy(h, 2, stream), KVT_EINVAL, "h_list[1].dst");
    h[1].bytes = 0; /* an empty copy may have NULL addresses */
    TU_OK(kvt__cu_copy_memcpy(h, 2, stream));

    TU_EXPECT_ERR(kvt__cu_table_sync(NULL, d_table, d_rg, 1, stream), KVT_EINVAL, "h_table");
    TU_EXPECT_ERR(kvt__cu_table_sync(h_table, NULL, d_rg, 1, stream), KVT_EINVAL, "d_table");
    TU_EXPECT_ERR(kvt__cu_table_sync(h_table, d_table, NULL, 1, stream), KVT_EINVAL,
                  "d_ranges");
    TU_OK(kvt__cu_stream_sync(stream));

    kvt__cu_free(d_rg);
    kvt__cu_host_free(h_table);
    kvt__cu_free(d_table);
    kvt__cu_free(d_list);
    kvt__cu_stream_destroy(stream);
}

int main(void)
{
    GPU_SKIP_WITHOUT_DEVICE();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_copy_random),
        cmocka_unit_test(test_copy_many),
        cmocka_unit_test(test_copy_edges),
        cmocka_unit_test(test_table_sync),
        cmocka_unit_test(test_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
