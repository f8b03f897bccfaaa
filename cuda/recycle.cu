// Fused recycle (declared in kvt_cuda.h): after a rerank, one thread block
// per (sequence, KV head) classifies its pages, picks the lookahead pages to
// keep, hands the evicted pages' device blocks to the promoted pages and
// writes the copy list, all in one pass over shared memory.
//
// Shared memory per block (dynamic, sized from max_pages):
//   keys [pow2ceil(max_pages)] u64: the evictable pages, sorted;
//   cls  [max_pages] u8: each page's class (below).
// = 8 * pow2ceil(max_pages) + max_pages bytes, 72 KiB for 8192 pages and
// 144 KiB for the limit of 16384 (sm_80 allows 163 KiB a block, sm_90 227;
// the launcher checks the device's opt-in limit).
//
// Order of the work (blockDim threads, T):
//  1. the selection marks cls[page] (a byte per page: no atomics needed);
//  2. thread-strided (coalesced) over the pages: the class of each page;
//  3. each thread takes a contiguous run of ceil(np / T) pages and counts
//     its evictable / promoted-from-host / promoted-from-disk / selected
//     unforced / stuck pages; one block-wide exclusive scan numbers them in
//     page order;
//  4. room, and the evicted count; an item short of free blocks stops here;
//  5. evictables into keys[] at their scanned slots as (importance key
//     << 32 | ~page), then a bitonic sort, descending: (importance desc,
//     page asc) exactly, since every key is distinct;
//  6. each thread walks its run again: its x-th promoted page takes evicted
//     page x's block (the same thread reads and clears that entry, so no
//     other thread touches it) or free block x - nevict; the dropped pages
//     [npro, nevict) of the sorted order go to d_freed, thread-strided.
#include "kvt_cuda_rt.cuh"

#define KVT__RC_THREADS 256u
#define KVT__RC_MAX_PAGES 16384u
#define KVT__RC_NSCAN 5 // evictable, promoted host, promoted disk, selected unforced, stuck

// Page classes (cls bits 0-2) and the selected-unforced flag (bit 3).
#define KVT__C_NONE 0u
#define KVT__C_PRO_HOST 1u
#define KVT__C_PRO_DISK 2u
#define KVT__C_EVICT 3u
#define KVT__C_STUCK 4u
#define KVT__C_TOP 8u

#define KVT__R_BUSY 0x80u
#define KVT__R_INBOUND 0x40u

namespace {

// Orders importances as floats compare, as unsigned integers: NaN ranks as
// +infinity and -0 as +0 (they compare equal, so their pages tie).
KVT_DEV uint32_t kvt__imp_key(float f)
{
    if (f != f)
        f = INFINITY;
    if (f == 0.0f)
        f = 0.0f;
    const uint32_t u = kvt_f32_bits(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

KVT_DEV uint32_t kvt__pow2ceil(uint32_t n)
{
    uint32_t p = 1;
    while (p < n)
        p <<= 1;
    return p;
}

KVT_DEV void kvt__rc_result(const kvt__cu_recycle_args &a, uint32_t item, uint32_t status,
                            uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3)
{
    a.d_counts[4ull * item + 0] = c0;
    a.d_counts[4ull * item + 1] = c1;
    a.d_counts[4ull * item + 2] = c2;
    a.d_counts[4ull * item + 3] = c3;
    a.d_status[item] = status;
}

KVT_KERNEL __launch_bounds__(KVT__RC_THREADS) kvt__recycle_k(const kvt__cu_recycle_args a, uint32_t n2max)
{
    KVT_DYN_SHARED(uint64_t, s_keys);
    uint8_t *s_cls = reinterpret_cast<uint8_t *>(s_keys + n2max);
    KVT_SHARED(uint32_t, s_warp, 32 * KVT__RC_NSCAN);
    const uint32_t t = threadIdx.x, T = blockDim.x, lane = t & 31u, warp = t >> 5;
    const uint32_t item = blockIdx.x;
    const kvt__cu_recycle_item it = a.d_items[item];
    const uint32_t np = it.n_pages;
    if (np > a.max_pages) { // uniform over the block: nothing to sync with
        if (t == 0)
            kvt__rc_result(a, item, 2, 0, 0, 0, 0);
        return;
    }
    uint32_t *dev = a.d_dev_table + it.table_off;
    const uint32_t *host = a.d_host_table + it.table_off;
    uint8_t *res = a.d_res + it.table_off;
    const float *imp = a.d_imp + it.table_off;
    const uint32_t *sel = a.d_sel + it.sel_off;
    const uint32_t nsel = a.d_n_sel[item];

    // 1. The selection (pages out of range are ignored).
    for (uint32_t pg = t; pg < np; pg += T)
        s_cls[pg] = 0;
    KVT_SYNC();
    for (uint32_t j = t; j < nsel; j += T) {
        const uint32_t pg = sel[j];
        if (pg < np)
            s_cls[pg] = 1;
    }
    KVT_SYNC();

    // 2. Classes.
    for (uint32_t pg = t; pg < np; pg += T) {
        const uint32_t r = res[pg];
        const bool selected = s_cls[pg] != 0;
        const bool forced = kvt__forced(pg, np, it.tokens, a.P, it.sink, it.local);
        uint32_t c = KVT__C_NONE;
        if (selected) {
            if (!(r & (KVT_RES_DEVICE | KVT__R_BUSY | KVT__R_INBOUND)))
                c = (r & KVT_RES_HOST) ? KVT__C_PRO_HOST : KVT__C_PRO_DISK;
            c |= forced ? 0u : KVT__C_TOP;
        } else if ((r & KVT_RES_DEVICE) && !forced) {
            c = !(r & KVT__R_BUSY) && (r & (KVT_RES_HOST | KVT_RES_DISK)) ? KVT__C_EVICT
                                                                            : KVT__C_STUCK;
        }
        s_cls[pg] = static_cast<uint8_t>(c);
    }
    KVT_SYNC();

    // 3. Counts over each thread's run of pages, scanned across the block.
    const uint32_t run = (np + T - 1) / T;
    const uint32_t lo = kvt_umin(np, t * run), hi = kvt_umin(np, lo + run);
    uint32_t v[KVT__RC_NSCAN] = {0, 0, 0, 0, 0};
    for (uint32_t pg = lo; pg < hi; pg++) {
        const uint32_t c = s_cls[pg], k = c & 7u;
        v[0] += k == KVT__C_EVICT;
        v[1] += k == KVT__C_PRO_HOST;
        v[2] += k == KVT__C_PRO_DISK;
        v[3] += (c & KVT__C_TOP) != 0;
        v[4] += k == KVT__C_STUCK;
    }
    uint32_t ex[KVT__RC_NSCAN], tot[KVT__RC_NSCAN];
    for (int q = 0; q < KVT__RC_NSCAN; q++) {
        uint32_t inc = v[q];
        for (int d = 1; d < 32; d <<= 1) {
            const uint32_t y = kvt_shfl(inc, lane >= static_cast<uint32_t>(d)
                                                 ? static_cast<int>(lane) - d
                                                 : static_cast<int>(lane));
            if (lane >= static_cast<uint32_t>(d))
                inc += y;
        }
        if (lane == 31)
            s_warp[warp * KVT__RC_NSCAN + q] = inc;
        ex[q] = inc - v[q];
    }
    KVT_SYNC();
    for (int q = 0; q < KVT__RC_NSCAN; q++) {
        tot[q] = 0;
        for (uint32_t w = 0; w < (T >> 5); w++) {
            const uint32_t x = s_warp[w * KVT__RC_NSCAN + q];
            ex[q] += w < warp ? x : 0;
            tot[q] += x;
        }
    }

    // 4. Lookahead room and the evictions; an item short of blocks fails
    // before it writes anything.
    const uint32_t nev = tot[0], npro = tot[1] + tot[2];
    const uint64_t kw = static_cast<uint64_t>(it.k) * it.window;
    const uint64_t used = static_cast<uint64_t>(tot[3]) + tot[4];
    const uint64_t room = kw > used ? kw - used : 0;
    const uint32_t keep = room >= nev ? nev : static_cast<uint32_t>(room);
    const uint32_t nevict = nev - keep;
    const uint32_t deficit = npro > nevict ? npro - nevict : 0;
    if (deficit > it.n_free) {
        if (t == 0)
            kvt__rc_result(a, item, 1, 0, 0, 0, 0);
        return;
    }

    // 5. Sort the evictables when some go.
    if (nevict) {
        const uint32_t n2 = kvt__pow2ceil(nev);
        uint32_t slot = ex[0];
        for (uint32_t pg = lo; pg < hi; pg++)
            if ((s_cls[pg] & 7u) == KVT__C_EVICT)
                s_keys[slot++] = static_cast<uint64_t>(kvt__imp_key(imp[pg])) << 32 |
                                 static_cast<uint32_t>(~pg);
        for (uint32_t i = nev + t; i < n2; i += T)
            s_keys[i] = 0; // below every real key: the importance key is >= 0x007fffff
        KVT_SYNC();
        for (uint32_t k = 2; k <= n2; k <<= 1) {
            for (uint32_t j = k >> 1; j > 0; j >>= 1) {
                for (uint32_t i = t; i < (n2 >> 1); i += T) {
                    const uint32_t x = ((i & ~(j - 1)) << 1) | (i & (j - 1)), y = x | j;
                    const uint64_t kx = s_keys[x], ky = s_keys[y];
                    // Descending runs where bit k of x is clear: the last
                    // merge (k == n2) leaves the whole array descending.
                    if ((x & k) == 0 ? kx < ky : kx > ky) {
                        s_keys[x] = ky;
                        s_keys[y] = kx;
                    }
                }
                KVT_SYNC();
            }
        }
    }

    // 6. Hand the blocks over, in page order of the promoted pages.
    uint32_t x = ex[1] + ex[2], ci = ex[1], si = ex[2];
    for (uint32_t pg = lo; pg < hi; pg++) {
        const uint32_t k = s_cls[pg] & 7u;
        if (k != KVT__C_PRO_HOST && k != KVT__C_PRO_DISK)
            continue;
        uint32_t blk;
        if (x < nevict) {
            const uint32_t e = ~static_cast<uint32_t>(s_keys[keep + x]);
            blk = dev[e];
            dev[e] = 0;
            res[e] = static_cast<uint8_t>(res[e] & ~KVT_RES_DEVICE);
        } else {
            blk = a.d_free[it.free_off + (x - nevict)];
        }
        dev[pg] = blk;
        res[pg] = static_cast<uint8_t>(res[pg] | KVT__R_BUSY | KVT__R_INBOUND);
        if (k == KVT__C_PRO_HOST) {
            kvt__cu_copy cp;
            cp.src = reinterpret_cast<uint64_t>(a.h_host_base) +
                     static_cast<uint64_t>(host[pg]) * a.block_bytes;
            cp.dst = reinterpret_cast<uint64_t>(a.d_dev_base) +
                     static_cast<uint64_t>(blk) * a.block_bytes;
            cp.bytes = a.block_bytes;
            a.d_copies[it.copy_off + ci++] = cp;
        } else {
            a.d_stage[it.copy_off + si++] = pg;
        }
        x++;
    }
    for (uint32_t d = npro + t; d < nevict; d += T) {
        const uint32_t e = ~static_cast<uint32_t>(s_keys[keep + d]);
        a.d_freed[it.copy_off + (d - npro)] = dev[e];
        dev[e] = 0;
        res[e] = static_cast<uint8_t>(res[e] & ~KVT_RES_DEVICE);
    }
    if (t == 0)
        kvt__rc_result(a, item, 0, tot[1], nevict, nevict > npro ? nevict - npro : 0, tot[2]);
}

uint32_t kvt__pow2ceil_host(uint32_t n)
{
    uint32_t p = 1;
    while (p < n)
        p <<= 1;
    return p;
}

} // namespace

extern "C" {

int kvt__cu_recycle(const kvt__cu_recycle_args *a, void *stream)
{
    if (!a)
        return kvt__err(KVT_EINVAL, "a: must not be NULL");
    if (a->n_items == 0)
        return 0;
    if (a->n_items > 0x7fffffffu)
        return kvt__err(KVT_EINVAL, "a->n_items: %u above the grid limit 2^31 - 1", a->n_items);
#define KVT__RC_NEED(f)                                                                     \
    do {                                                                                    \
        if (!a->f)                                                                          \
            return kvt__err(KVT_EINVAL, "a->" #f ": NULL with n_items = %u", a->n_items);   \
    } while (0)
    KVT__RC_NEED(d_items);
    KVT__RC_NEED(d_dev_table);
    KVT__RC_NEED(d_host_table);
    KVT__RC_NEED(d_res);
    KVT__RC_NEED(d_imp);
    KVT__RC_NEED(d_sel);
    KVT__RC_NEED(d_n_sel);
    KVT__RC_NEED(d_free);
    KVT__RC_NEED(d_dev_base);
    KVT__RC_NEED(h_host_base);
    KVT__RC_NEED(d_copies);
    KVT__RC_NEED(d_freed);
    KVT__RC_NEED(d_stage);
    KVT__RC_NEED(d_counts);
    KVT__RC_NEED(d_status);
#undef KVT__RC_NEED
    if (a->P == 0)
        return kvt__err(KVT_EINVAL, "a->P: 0 tokens per page");
    if (a->block_bytes == 0)
        return kvt__err(KVT_EINVAL, "a->block_bytes: 0");
    if (a->max_pages > KVT__RC_MAX_PAGES)
        return kvt__err(KVT_EINVAL, "a->max_pages: %u above the %u pages a thread block holds "
                        "in shared memory", a->max_pages, KVT__RC_MAX_PAGES);
    const uint32_t n2max = kvt__pow2ceil_host(a->max_pages ? a->max_pages : 1);
    const size_t smem = (size_t)8 * n2max + ((a->max_pages + 15u) & ~15u);
    if (smem > 48u * 1024u) {
        int dev = 0, optin = 0;
        cudaError_t e = cudaGetDevice(&dev);
        if (e == cudaSuccess)
            e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (e != cudaSuccess) {
            (void)cudaGetLastError(); // else the next launch reports it as its own
            return kvt__err(KVT_EIO, "kvt__cu_recycle: shared memory limit: %s (%s)",
                            cudaGetErrorName(e), cudaGetErrorString(e));
        }
        // The static part (s_warp) shares the limit.
        const size_t stat = 32 * KVT__RC_NSCAN * sizeof(uint32_t);
        if (smem + stat > (size_t)optin)
            return kvt__err(KVT_EINVAL, "a->max_pages: %u needs %zu bytes of shared memory, "
                            "the device allows %d a block", a->max_pages, smem, optin);
        // The cap goes to all the opt-in limit allows, not to this launch's
        // size: it is per kernel and device, not per launch, so lowering it
        // would fail a bigger launch another host thread has just allowed.
        e = KVT_SET_MAX_DYN_SHARED(kvt__recycle_k, (size_t)optin - stat);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return kvt__err(KVT_EIO, "kvt__cu_recycle: %zu bytes of shared memory: %s (%s)", smem,
                            cudaGetErrorName(e), cudaGetErrorString(e));
        }
    }
    const kvt__cu_recycle_args args = *a; // by value: the launch may outlive *a
    const cudaError_t e =
        KVT_LAUNCH(kvt__recycle_k, a->n_items, KVT__RC_THREADS, smem, stream, args, n2max);
    return KVT_CU_LAUNCHED(e, "kvt__cu_recycle");
}

} // extern "C"
