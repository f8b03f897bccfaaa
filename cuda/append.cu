// Append + metadata: K/V rows of one layer into their device blocks and the
// per-page key box (min, max, mean), bit-identical to lib/core/append.c.
//
// Work split: each item's tokens fall into "segments", one per page they
// touch (the first may continue a partly filled page, the last may leave
// one open). Pages are independent - the accumulators restart when a token
// opens a page - so segments run in parallel: a thread block holds `nsl`
// slices of `dl` threads ("workers"), blocks along y and slices stride over
// the item's segments, and inside a slice each thread owns dimensions
// d = lane, lane + dl, ... Only the first segment reads the item's
// accumulators and only the last writes them, so worker 0 does both, in
// that order. Per dimension the tokens of a segment are taken in order, so
// the running min / max / sum see exactly the CPU's f32 operations in the
// CPU's order, and the conversions are kvt_load / kvt_store (convert.c's
// bit-level code). Not valid under -use_fast_math / -ftz=true (f32
// subnormal sums would flush).
#include "kvt_cuda_rt.cuh"

namespace {

// f32 operations that must round exactly like the CPU's: never contracted
// with a neighbouring multiply into an FMA (sums: kvt_add_rn).
KVT_DEV float kvt_ap_div(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

// One element of a row: a raw copy when source and pool dtypes agree (the
// CPU memcpy()s the row, NaN payloads included), else f32 and back, round
// to nearest even.
KVT_DEV void kvt_ap_elem(void *dst, uint64_t di, kvt_dtype dt, const void *src, uint64_t si,
                         kvt_dtype st)
{
    if (dt == st) {
        if (dt == KVT_DTYPE_F32)
            static_cast<uint32_t *>(dst)[di] = static_cast<const uint32_t *>(src)[si];
        else
            static_cast<uint16_t *>(dst)[di] = static_cast<const uint16_t *>(src)[si];
    } else {
        kvt_store(dst, di, dt, kvt_load(src, si, st), KVT_RN);
    }
}

// Segment `seg` of item `it`: tokens [t0, t1) of the item fill page
// first_pos / P + seg from slot (first_pos + t0) % P on; this thread does
// dimensions lane, lane + dl, ...
KVT_DEV void kvt_ap_segment(const kvt__cu_append_args &a, const kvt__cu_append_item &it,
                            uint32_t seg, uint32_t nseg, uint32_t lane, uint32_t dl)
{
    const uint32_t D = a.D, P = a.P, off = it.first_pos % P;
    const uint32_t t0 = seg == 0 ? 0u : seg * P - off;
    const uint32_t t1 = (uint32_t)kvt_umin64(it.n_tokens, (uint64_t)(seg + 1) * P - off);
    const uint64_t entry = it.table_off + it.first_pos / P + seg;
    uint8_t *blk = a.d_dev_base + (uint64_t)a.d_dev_table[entry] * a.block_bytes;
    // The slot's rows in the store's two planes: min and max side by side in
    // plane 1, the mean in plane 2 (kvt_cuda.h).
    const uint64_t row = (uint64_t)D * kvt_dtype_bytes(a.dtype), slot_m = a.d_meta_table[entry];
    uint8_t *mm = a.d_meta_base + slot_m * 2u * row;
    uint8_t *mean = a.d_meta_base + (uint64_t)a.meta_slots * 2u * row + slot_m * row;
    float *acc = a.d_acc + it.acc_off;
    const uint32_t slot0 = (it.first_pos + t0) % P;
    const bool resume = slot0 != 0; // the page was opened by an earlier append
    for (uint32_t d = lane; d < D; d += dl) {
        float mn = INFINITY, mx = -INFINITY, sum = 0.0f;
        if (resume) {
            mn = acc[d];
            mx = acc[D + d];
            sum = acc[2 * D + d];
        }
        for (uint32_t t = t0; t < t1; t++) {
            const uint64_t si = it.src_off + (uint64_t)t * it.src_stride + d;
            const uint32_t slot = slot0 + (t - t0);
            kvt_ap_elem(blk, (uint64_t)slot * D + d, a.dtype, a.d_k, si, a.src_dtype);
            kvt_ap_elem(blk, (uint64_t)(P + slot) * D + d, a.dtype, a.d_v, si, a.src_dtype);
            // The key as stored (the box bounds the stored keys, and a
            // truncation rebuilds it from them exactly).
            const float x = kvt_load(blk, (uint64_t)slot * D + d, a.dtype);
            // The CPU's expressions, operand order included (signed zeros:
            // the first of equal values stays).
            const float lo = x == x ? x : -INFINITY, hi = x == x ? x : INFINITY;
            mn = lo < mn ? lo : mn;
            mx = hi > mx ? hi : mx;
            sum = kvt_add_rn(sum, x);
        }
        const uint32_t count = slot0 + (t1 - t0);
        kvt_store(mm, d, a.dtype, mn, KVT_RD);
        kvt_store(mm, (uint64_t)D + d, a.dtype, mx, KVT_RU);
        kvt_store(mean, d, a.dtype, kvt_ap_div(sum, (float)count), KVT_RN);
        if (seg == nseg - 1) { // the page left open for the next append
            acc[d] = mn;
            acc[D + d] = mx;
            acc[2 * D + d] = sum;
        }
    }
}

// At most 256 threads a block (dl * nsl, below): the bound lets ptxas keep the
// registers within what such a block may use.
#define KVT__AP_THREADS 256u

KVT_KERNEL __launch_bounds__(KVT__AP_THREADS) kvt_append_kernel(const kvt__cu_append_args a, uint32_t nsl)
{
    const kvt__cu_append_item it = a.d_items[blockIdx.x];
    const uint32_t dl = blockDim.x / nsl;
    const uint32_t slice = threadIdx.x / dl, lane = threadIdx.x % dl;
    if (slice >= nsl || lane >= a.D || it.n_tokens == 0)
        return; // no barriers or warp operations below
    const uint32_t nseg =
        (uint32_t)(((uint64_t)(it.first_pos % a.P) + it.n_tokens + a.P - 1) / a.P);
    const uint32_t worker = blockIdx.y * nsl + slice, nw = gridDim.y * nsl;
    // Worker 0 takes the first segment, which may read the accumulators,
    // and then the last, which writes them: in that order, by the same
    // threads. The pages between go to every worker.
    if (worker == 0) {
        kvt_ap_segment(a, it, 0, nseg, lane, dl);
        if (nseg > 1)
            kvt_ap_segment(a, it, nseg - 1, nseg, lane, dl);
    }
    for (uint32_t seg = 1 + worker; seg + 1 < nseg; seg += nw)
        kvt_ap_segment(a, it, seg, nseg, lane, dl);
}

bool kvt_ap_dtype_ok(kvt_dtype dt)
{
    return dt == KVT_DTYPE_F16 || dt == KVT_DTYPE_BF16 || dt == KVT_DTYPE_F32;
}

} // namespace

extern "C" {

int kvt__cu_append(const kvt__cu_append_args *a, void *stream)
{
    if (!a)
        return kvt__err(KVT_EINVAL, "a: must not be NULL");
    if (a->D < 8 || a->D > 1024 || a->D % 8 != 0)
        return kvt__err(KVT_EINVAL, "a->D: %u is not a multiple of 8 in 8..1024", a->D);
    if (a->P < 8 || a->P > 256 || (a->P & (a->P - 1)) != 0)
        return kvt__err(KVT_EINVAL, "a->P: %u is not a power of two in 8..256", a->P);
    if (!kvt_ap_dtype_ok(a->dtype))
        return kvt__err(KVT_EINVAL, "a->dtype: %u is not F16, BF16 or F32", a->dtype);
    if (!kvt_ap_dtype_ok(a->src_dtype))
        return kvt__err(KVT_EINVAL, "a->src_dtype: %u is not F16, BF16 or F32", a->src_dtype);
    if (a->n_items > 0x7fffffffu)
        return kvt__err(KVT_EINVAL, "a->n_items: %u is above 2^31 - 1 (one thread block "
                        "each)", a->n_items);
    const uint64_t elem = kvt_dtype_bytes(a->dtype);
    if (a->block_bytes < 2ull * a->P * a->D * elem)
        return kvt__err(KVT_EINVAL, "a->block_bytes: %llu is below 2 * P * D * %llu = %llu",
                        (unsigned long long)a->block_bytes, (unsigned long long)elem,
                        (unsigned long long)(2ull * a->P * a->D * elem));
    if (int rc = kvt_meta_check(a->D, a->dtype, a->meta_bytes, a->meta_slots))
        return rc;
    if (a->n_items == 0)
        return 0;
    static const char *const names[] = {"a->d_items",    "a->d_k",         "a->d_v",
                                        "a->d_dev_table", "a->d_meta_table", "a->d_dev_base",
                                        "a->d_meta_base", "a->d_acc"};
    const void *const ptrs[] = {a->d_items,       a->d_k,        a->d_v,
                                a->d_dev_table,   a->d_meta_table, a->d_dev_base,
                                a->d_meta_base,   a->d_acc};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (!ptrs[i])
            return kvt__err(KVT_EINVAL, "%s: must not be NULL", names[i]);

    // dl threads per slice cover D (up to 256 dimensions at once, whole
    // warps); with a prefill hint, several slices and blocks share an
    // item's pages.
    const uint32_t dl = (kvt_umin(a->D, KVT__AP_THREADS) + 31u) & ~31u;
    uint32_t nsl = 1, gy = 1;
    if (a->max_tokens > 1) {
        const uint64_t segs = ((uint64_t)a->max_tokens + 2u * a->P - 2u) / a->P;
        nsl = (uint32_t)kvt_umin64(kvt_umax(1u, KVT__AP_THREADS / dl), segs);
        gy = (uint32_t)kvt_umin64((segs + nsl - 1) / nsl, 65535u);
    }
    const cudaError_t e = KVT_LAUNCH(kvt_append_kernel, dim3(a->n_items, gy), dim3(dl * nsl), 0,
                                     stream, *a, nsl);
    return KVT_CU_LAUNCHED(e, "kvt__cu_append");
}

} // extern "C"
