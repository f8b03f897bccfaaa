// Block copies between device memory and pinned mapped host memory, and the
// dirty-range sync of the block tables (declared in kvt_cuda.h).
//
// The zero-copy kernel reads and writes pinned host memory through UVA, so a
// batch of small transfers costs one launch instead of one DMA setup each,
// and its grid cap leaves most SMs to the decode kernels running beside it.
//
// Work split: a copy of `bytes` is ceil(bytes / chunk) units (copy, chunk),
// numbered in list order; unit u belongs to thread block u mod grid, so
// every block gets an equal share of the chunks whatever the sizes. No block
// knows the numbering in advance (the list lives in device memory and the
// launcher neither reads it nor has scratch for a prefix sum), so each block
// walks the list in tiles of blockDim copies: a block-wide scan of the
// tile's chunk counts into shared memory, then each of the block's units in
// the tile finds its copy by binary search over that scan. Every block reads
// the whole list (24 bytes a copy, from L2 after the first block), which is
// cheap next to the data for the list lengths the mover builds.
#include "kvt_cuda_rt.cuh"

#define KVT__COPY_THREADS 256u             // also the tile: copies per scan
#define KVT__COPY_CHUNK (256ull << 10)     // chunk_bytes == 0
#define KVT__COPY_UNROLL 4                 // vectors in flight per thread
#define KVT__SYNC_THREADS 128u
#define KVT__SYNC_MAX_GRID 4096u

namespace {

// Vectors of `len / sizeof(V)` elements, thread-strided (coalesced), with
// KVT__COPY_UNROLL loads issued before their stores: reads of host memory
// over the bus have microseconds of latency, so each thread keeps several in
// flight.
template <typename V>
KVT_DEV void kvt__copy_vec(uint8_t *dst, const uint8_t *src, uint64_t nvec)
{
    V *d = reinterpret_cast<V *>(dst);
    const V *s = reinterpret_cast<const V *>(src);
    const uint64_t T = blockDim.x;
    uint64_t i = threadIdx.x;
    for (; i + (KVT__COPY_UNROLL - 1) * T < nvec; i += KVT__COPY_UNROLL * T) {
        V r[KVT__COPY_UNROLL];
        for (int u = 0; u < KVT__COPY_UNROLL; u++)
            r[u] = s[i + u * T];
        for (int u = 0; u < KVT__COPY_UNROLL; u++)
            d[i + u * T] = r[u];
    }
    for (; i < nvec; i += T)
        d[i] = s[i];
}

KVT_DEV void kvt__copy_bytes(uint8_t *dst, const uint8_t *src, uint64_t len)
{
    for (uint64_t i = threadIdx.x; i < len; i += blockDim.x)
        dst[i] = src[i];
}

// One block copies len bytes. The vector width is the widest of 16, 8, 4
// for which src and dst agree modulo it; the bytes before the first aligned
// address and after the last whole vector go byte-wise. Fully 16-byte
// aligned copies are thus pure 16-byte traffic.
KVT_DEV void kvt__copy_range(uint8_t *dst, const uint8_t *src, uint64_t len)
{
    const uint64_t mis = (reinterpret_cast<uint64_t>(src) ^ reinterpret_cast<uint64_t>(dst));
    const uint64_t w = (mis & 15u) == 0 ? 16u : (mis & 7u) == 0 ? 8u : (mis & 3u) == 0 ? 4u : 1u;
    if (w == 1) {
        kvt__copy_bytes(dst, src, len);
        return;
    }
    uint64_t head = (w - (reinterpret_cast<uint64_t>(src) & (w - 1))) & (w - 1);
    head = head < len ? head : len;
    const uint64_t nvec = (len - head) / w;
    const uint64_t body = nvec * w;
    kvt__copy_bytes(dst, src, head);
    if (w == 16)
        kvt__copy_vec<uint4>(dst + head, src + head, nvec);
    else if (w == 8)
        kvt__copy_vec<uint2>(dst + head, src + head, nvec);
    else
        kvt__copy_vec<uint32_t>(dst + head, src + head, nvec);
    kvt__copy_bytes(dst + head + body, src + head + body, len - head - body);
}

KVT_DEV uint64_t kvt__chunks(uint64_t bytes, uint64_t chunk)
{
    return bytes / chunk + (bytes % chunk != 0);
}

KVT_KERNEL __launch_bounds__(KVT__COPY_THREADS) kvt__copy_k(const kvt__cu_copy *list, uint32_t n, uint64_t chunk)
{
#ifdef KVT_CUDA_EMU
    // A GPU faults on an address it cannot reach (pageable host memory);
    // the emulation would copy it: checked when the kernel runs, with the
    // list as the kernel reads it.
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        if (!kvt_emu_gpu_visible(list, (size_t)n * sizeof *list))
            kvt_emu_fault("kvt__copy_k: the copy list is not memory the GPU can reach");
        for (uint32_t i = 0; i < n; i++)
            if (!kvt_emu_gpu_visible(reinterpret_cast<const void *>(list[i].src), list[i].bytes) ||
                !kvt_emu_gpu_visible(reinterpret_cast<const void *>(list[i].dst), list[i].bytes))
                kvt_emu_fault("kvt__copy_k: a copy reads or writes memory the GPU cannot reach");
    }
#endif
    KVT_SHARED(uint64_t, s_end, KVT__COPY_THREADS); // inclusive scan of the tile's chunks
    KVT_SHARED(uint64_t, s_warp, KVT__COPY_THREADS / 32);
    const uint32_t t = threadIdx.x, lane = t & 31u, warp = t >> 5;
    const uint32_t T = blockDim.x, nw = T >> 5;
    const uint64_t G = gridDim.x, b = blockIdx.x;
    uint64_t base = 0; // units of the tiles before this one
    for (uint64_t i0 = 0; i0 < n; i0 += T) {
        const uint64_t i = i0 + t;
        const uint32_t cnt = static_cast<uint32_t>(kvt_umin64(T, n - i0));
        uint64_t c = i < n ? kvt__chunks(list[i].bytes, chunk) : 0;
        // Block-wide inclusive scan: within the warp by shuffles (as two
        // 32-bit halves: the dialect's shuffles are 32-bit), then the warp
        // totals.
        for (int d = 1; d < 32; d <<= 1) {
            const int src = lane >= static_cast<uint32_t>(d) ? static_cast<int>(lane) - d
                                                              : static_cast<int>(lane);
            const uint32_t lo = kvt_shfl(static_cast<uint32_t>(c), src);
            const uint32_t hi = kvt_shfl(static_cast<uint32_t>(c >> 32), src);
            if (lane >= static_cast<uint32_t>(d))
                c += (static_cast<uint64_t>(hi) << 32) | lo;
        }
        if (lane == 31)
            s_warp[warp] = c;
        KVT_SYNC();
        uint64_t total = 0;
        for (uint32_t w = 0; w < nw; w++) {
            const uint64_t x = s_warp[w];
            c += w < warp ? x : 0;
            total += x;
        }
        s_end[t] = c;
        KVT_SYNC();
        // This block's units in [base, base + total), in order.
        uint64_t u = base + (b + G - base % G) % G;
        for (; u < base + total; u += G) {
            const uint64_t r = u - base;
            uint32_t lo = 0, hi = cnt - 1; // first j with s_end[j] > r
            while (lo < hi) {
                const uint32_t mid = (lo + hi) >> 1;
                if (s_end[mid] > r)
                    hi = mid;
                else
                    lo = mid + 1;
            }
            const uint64_t first = lo ? s_end[lo - 1] : 0;
            const kvt__cu_copy cp = list[i0 + lo];
            const uint64_t off = (r - first) * chunk;
            const uint64_t len = kvt_umin64(chunk, cp.bytes - off);
            kvt__copy_range(reinterpret_cast<uint8_t *>(cp.dst + off),
                            reinterpret_cast<const uint8_t *>(cp.src + off), len);
        }
        base += total;
        KVT_SYNC(); // s_end and s_warp are rewritten by the next tile
    }
}

// One block per range (grid-stride over the ranges), its threads over the
// entries: each warp reads 128 consecutive bytes of the host table.
KVT_KERNEL __launch_bounds__(KVT__SYNC_THREADS)
kvt__table_sync_k(const uint32_t *h_table, uint32_t *d_table, const kvt__cu_range *ranges, uint32_t n)
{
#ifdef KVT_CUDA_EMU
    if (blockIdx.x == 0 && threadIdx.x == 0) { // as in kvt__copy_k
        if (!kvt_emu_gpu_visible(ranges, (size_t)n * sizeof *ranges))
            kvt_emu_fault("kvt__table_sync_k: the ranges are not memory the GPU can reach");
        for (uint32_t r = 0; r < n; r++)
            if (!kvt_emu_gpu_visible(h_table + ranges[r].src_off, ranges[r].n * 4ull) ||
                !kvt_emu_gpu_visible(d_table + ranges[r].dst_off, ranges[r].n * 4ull))
                kvt_emu_fault("kvt__table_sync_k: a range is not memory the GPU can reach");
    }
#endif
    for (uint32_t r = blockIdx.x; r < n; r += gridDim.x) {
        const kvt__cu_range rg = ranges[r];
        const uint32_t *s = h_table + rg.src_off;
        uint32_t *d = d_table + rg.dst_off;
        for (uint32_t e = threadIdx.x; e < rg.n; e += blockDim.x)
            d[e] = s[e];
    }
}

} // namespace

extern "C" {

// The copies of d_list must not overlap one another's destinations nor any
// source (the units run in no defined order). Any address and size work;
// the bandwidth is best when src and dst agree modulo 16. chunk_bytes must
// be a multiple of 16 (so chunks keep the copy's alignment).
int kvt__cu_copy_kernel(const kvt__cu_copy *d_list, uint32_t n, uint32_t max_blocks,
                        uint64_t chunk_bytes, void *stream)
{
    if (n == 0)
        return 0;
    if (!d_list)
        return kvt__err(KVT_EINVAL, "d_list: NULL with n = %u copies", n);
    if (chunk_bytes % 16 != 0)
        return kvt__err(KVT_EINVAL, "chunk_bytes: %llu is not a multiple of 16",
                        (unsigned long long)chunk_bytes);
    const uint64_t chunk = chunk_bytes ? chunk_bytes : KVT__COPY_CHUNK;
    uint32_t grid = max_blocks;
    if (grid == 0) {
        int dev = 0, sms = 0;
        cudaError_t e = cudaGetDevice(&dev);
        if (e == cudaSuccess)
            e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        if (e != cudaSuccess) {
            (void)cudaGetLastError(); // else the next launch reports it as its own
            return kvt__err(KVT_EIO, "kvt__cu_copy_kernel: SM count: %s (%s)",
                            cudaGetErrorName(e), cudaGetErrorString(e));
        }
        grid = 2u * static_cast<uint32_t>(sms > 0 ? sms : 1);
    }
    grid = kvt_umin(grid, 0x7fffffffu);
    const cudaError_t e =
        KVT_LAUNCH(kvt__copy_k, grid, KVT__COPY_THREADS, 0, stream, d_list, n, chunk);
    return KVT_CU_LAUNCHED(e, "kvt__cu_copy_kernel");
}

int kvt__cu_copy_memcpy(const kvt__cu_copy *h_list, uint32_t n, void *stream)
{
    if (n == 0)
        return 0;
    if (!h_list)
        return kvt__err(KVT_EINVAL, "h_list: NULL with n = %u copies", n);
    for (uint32_t i = 0; i < n; i++) {
        if (h_list[i].bytes && !h_list[i].src)
            return kvt__err(KVT_EINVAL, "h_list[%u].src: NULL for %llu bytes", i,
                            (unsigned long long)h_list[i].bytes);
        if (h_list[i].bytes && !h_list[i].dst)
            return kvt__err(KVT_EINVAL, "h_list[%u].dst: NULL for %llu bytes", i,
                            (unsigned long long)h_list[i].bytes);
    }
    for (uint32_t i = 0; i < n; i++) {
        const kvt__cu_copy *c = &h_list[i];
        if (!c->bytes)
            continue;
        const cudaError_t e = cudaMemcpyAsync(reinterpret_cast<void *>(c->dst),
                                              reinterpret_cast<const void *>(c->src), c->bytes,
                                              cudaMemcpyDefault,
                                              static_cast<cudaStream_t>(stream));
        if (e != cudaSuccess) {
            (void)cudaGetLastError(); // else the next launch reports it as its own
            return kvt__err(KVT_EIO, "kvt__cu_copy_memcpy: h_list[%u] (%llu bytes): %s (%s)", i,
                            (unsigned long long)c->bytes, cudaGetErrorName(e),
                            cudaGetErrorString(e));
        }
    }
    return 0;
}

int kvt__cu_table_sync(const uint32_t *h_table, uint32_t *d_table, const kvt__cu_range *d_ranges,
                       uint32_t n_ranges, void *stream)
{
    if (n_ranges == 0)
        return 0;
    if (!h_table)
        return kvt__err(KVT_EINVAL, "h_table: NULL with %u ranges", n_ranges);
    if (!d_table)
        return kvt__err(KVT_EINVAL, "d_table: NULL with %u ranges", n_ranges);
    if (!d_ranges)
        return kvt__err(KVT_EINVAL, "d_ranges: NULL with n_ranges = %u", n_ranges);
    const uint32_t grid = kvt_umin(n_ranges, KVT__SYNC_MAX_GRID);
    const cudaError_t e = KVT_LAUNCH(kvt__table_sync_k, grid, KVT__SYNC_THREADS, 0, stream,
                                     h_table, d_table, d_ranges, n_ranges);
    return KVT_CU_LAUNCHED(e, "kvt__cu_table_sync");
}

} // extern "C"
