// Page scoring from the metadata store and the per-head selection rule
// (forced pages + top-K), the GPU side of lib/select/selector.c.
//
// Scoring: a group of 8 lanes scores one page at a time; each lane takes
// 16-byte pieces of the page's metadata rows (d = 8 * (lane + 8 j) ...), the
// query rows of the GQA group come from shared memory, KVT_SC_GR heads at a
// time in registers, and the 8 partial sums meet by shuffles. SUM and MAX
// votes are per page, so an item's pages spread over blockIdx.y; SOFTVOTE
// needs each head's maximum and sum over all pages of the item: one block per
// item, a first pass keeps an online (max, sum of exp) per head and group,
// merged in shared memory, and a second pass rescores and votes.
//
// TOKEN / ORACLE read the keys of the pages with a device block: the group's
// 8 lanes split the page's tokens (lane l takes t = l, l + 8, ...), each
// token's K row 16 bytes at a time against the staged query rows, a full dot
// product per head in registers; the lanes' running maximum (ORACLE: and sum
// of exp) meet by shuffles. Pages without a device block take the MINMAX
// path's bound. SUM / MAX spread pages one per group over blockIdx.y;
// SOFTVOTE keeps the first pass's raw scores in the caller's workspace, so
// the keys are read once.
//
// Top-K: one block per item. The forced pages bound a contiguous range of
// competitors [c0, c1); the take-th largest key is found by a 4-pass radix
// select (8 bits a pass, 256-bin shared histogram), then every warp walks its
// contiguous share of the range in index order, taking keys above the
// threshold and the first `need` keys equal to it, positions from ballots and
// a block-wide prefix over the warps. Exact, deterministic.
#include "kvt_cuda_rt.cuh"
#include "kvtier/selector.h"

// Full unrolling of the fixed-size register loops (so the tiles stay in
// registers).
#ifdef KVT_CUDA_EMU
#define KVT_SC_UNROLL _Pragma("GCC unroll 8")
#else
#define KVT_SC_UNROLL _Pragma("unroll")
#endif

namespace {

// ---- scoring ---------------------------------------------------------------
constexpr uint32_t KVT_SC_LANES = 8;          // lanes per page
constexpr uint32_t KVT_SC_GR = 8;             // query heads per register tile
constexpr uint32_t KVT_SC_THREADS = 256;      // SUM / MAX
constexpr uint32_t KVT_SC_THREADS_SV = 512;   // SOFTVOTE (one block per item)
constexpr uint32_t KVT_SC_MAX_GROUPS = KVT_SC_THREADS_SV / KVT_SC_LANES;
constexpr uint32_t KVT_SC_PAGES_PER_GROUP = 4; // SUM / MAX: sizes grid.y
constexpr size_t KVT_SC_QSMEM = 32 * 1024;    // query rows staged in shared memory up to this

struct alignas(16) kvt_sc_v4f {
    float x, y, z, w;
};
struct alignas(16) kvt_sc_v4u {
    uint32_t x, y, z, w;
};

// Elements [8 v, 8 v + 8) of a metadata row (16-byte aligned).
template <uint32_t DT> KVT_DEV void kvt_sc_meta8(const uint8_t *row, uint32_t v, float (&x)[8])
{
    if (DT == KVT_DTYPE_F32) {
        const kvt_sc_v4f *p = reinterpret_cast<const kvt_sc_v4f *>(row) + 2u * v;
        const kvt_sc_v4f a = p[0], b = p[1];
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
        x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    } else {
        const kvt_sc_v4u u = reinterpret_cast<const kvt_sc_v4u *>(row)[v];
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
KVT_SC_UNROLL
        for (int e = 0; e < 4; e++) {
            const uint16_t lo = (uint16_t)(w[e] & 0xffffu), hi = (uint16_t)(w[e] >> 16);
            x[2 * e] = DT == KVT_DTYPE_BF16 ? kvt_bf16_to_f32(lo) : kvt_f16_to_f32(lo);
            x[2 * e + 1] = DT == KVT_DTYPE_BF16 ? kvt_bf16_to_f32(hi) : kvt_f16_to_f32(hi);
        }
    }
}

// 8 floats of a staged (32-byte aligned) shared-memory row.
KVT_DEV void kvt_sc_ld8(const float *p, float (&x)[8])
{
    const kvt_sc_v4f a = reinterpret_cast<const kvt_sc_v4f *>(p)[0];
    const kvt_sc_v4f b = reinterpret_cast<const kvt_sc_v4f *>(p)[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// Bytes of one metadata row (16-byte multiple: D is a multiple of 8).
template <uint32_t DT> KVT_DEV uint64_t kvt_sc_row(uint32_t D)
{
    return (uint64_t)D * (DT == KVT_DTYPE_F32 ? 4u : 2u);
}

// A slot's rows in the store's two planes (kvt_cuda.h): plane 1 holds its
// min row with the max row right after, plane 2 (after all n slots' min and
// max rows) its mean row. Both 16-byte aligned (d_meta_base is).
template <uint32_t DT>
KVT_DEV const uint8_t *kvt_sc_meta_mm(const kvt__cu_score_args &a, uint32_t slot)
{
    return a.d_meta_base + (uint64_t)slot * 2u * kvt_sc_row<DT>(a.D);
}
template <uint32_t DT>
KVT_DEV const uint8_t *kvt_sc_meta_mean(const kvt__cu_score_args &a, uint32_t slot)
{
    const uint64_t row = kvt_sc_row<DT>(a.D);
    return a.d_meta_base + (uint64_t)a.meta_slots * 2u * row + (uint64_t)slot * row;
}

// This lane's share of the raw scores of one page for heads g0 .. g0 + gn -
// 1, from m: MINMAX the slot's min row (max right after, plane 1), MEAN its
// mean row (plane 2). MINMAX: qa.kmax + qb.kmin with qa = max(q, 0),
// qb = min(q, 0) as the CPU forms them (so a 0 * inf of an opened box is a
// NaN here too); MEAN: q.kmean. Staged: qa / qb (or q) rows in shared
// memory; else q straight from global memory.
template <uint32_t DT, uint32_t METHOD>
KVT_DEV void kvt_sc_partial(const uint8_t *m, uint32_t D, uint32_t lg, uint32_t g0, uint32_t gn,
                            bool staged, const float *qa, const float *qb, const float *qg,
                            float (&acc)[KVT_SC_GR])
{
    const uint32_t nv = D / 8;
    const uint64_t row = kvt_sc_row<DT>(D);
    for (uint32_t v = lg; v < nv; v += KVT_SC_LANES) {
        float lo[8], hi[8];
        if (METHOD == KVT_SCORE_MINMAX) {
            kvt_sc_meta8<DT>(m, v, lo);
            kvt_sc_meta8<DT>(m + row, v, hi);
        } else {
            kvt_sc_meta8<DT>(m, v, hi);
        }
KVT_SC_UNROLL
        for (uint32_t j = 0; j < KVT_SC_GR; j++) {
            if (j >= gn)
                break;
            const size_t qo = (size_t)(g0 + j) * D + 8u * v;
            float pa[8], pb[8];
            if (staged) {
                kvt_sc_ld8(qa + qo, pa);
                if (METHOD == KVT_SCORE_MINMAX)
                    kvt_sc_ld8(qb + qo, pb);
            } else {
KVT_SC_UNROLL
                for (int e = 0; e < 8; e++) {
                    const float x = qg[qo + e];
                    pa[e] = METHOD == KVT_SCORE_MINMAX ? (x > 0.0f ? x : 0.0f) : x;
                    pb[e] = x < 0.0f ? x : 0.0f;
                }
            }
            float s = acc[j];
KVT_SC_UNROLL
            for (int e = 0; e < 8; e++)
                s = METHOD == KVT_SCORE_MINMAX ? fmaf(pa[e], hi[e], fmaf(pb[e], lo[e], s))
                                               : fmaf(pa[e], hi[e], s);
            acc[j] = s;
        }
    }
}

// 8 query elements at element offset qo of the item's rows: from shared
// memory when staged (rows 32-byte aligned there), else from global memory.
KVT_DEV void kvt_sc_q8(bool staged, const float *qs, const float *qg, size_t qo, float (&x)[8])
{
    if (staged) {
        kvt_sc_ld8(qs + qo, x);
        return;
    }
KVT_SC_UNROLL
    for (int e = 0; e < 8; e++)
        x[e] = qg[qo + e];
}

// TOKEN / ORACLE, a page without a device copy: this lane's share of its
// MINMAX bound (qa.kmax + qb.kmin, qa / qb formed from q on the fly as the
// CPU forms them), from m = the slot's min row (max right after, plane 1).
template <uint32_t DT>
KVT_DEV void kvt_sc_bound(const uint8_t *m, uint32_t D, uint32_t lg, uint32_t g0, uint32_t gn,
                          bool staged, const float *qs, const float *qg, float (&acc)[KVT_SC_GR])
{
    const uint32_t nv = D / 8;
    const uint64_t row = kvt_sc_row<DT>(D);
    for (uint32_t v = lg; v < nv; v += KVT_SC_LANES) {
        float lo[8], hi[8];
        kvt_sc_meta8<DT>(m, v, lo);
        kvt_sc_meta8<DT>(m + row, v, hi);
KVT_SC_UNROLL
        for (uint32_t j = 0; j < KVT_SC_GR; j++) {
            if (j >= gn)
                break;
            float x[8];
            kvt_sc_q8(staged, qs, qg, (size_t)(g0 + j) * D + 8u * v, x);
            float s = acc[j];
KVT_SC_UNROLL
            for (int e = 0; e < 8; e++) {
                const float pa = x[e] > 0.0f ? x[e] : 0.0f, pb = x[e] < 0.0f ? x[e] : 0.0f;
                s = fmaf(pa, hi[e], fmaf(pb, lo[e], s));
            }
            acc[j] = s;
        }
    }
}

// ORACLE's running log-sum-exp at scale c: m = the largest score so far, z =
// sum of exp(c (s - m)); r finite, c > 0.
KVT_DEV void kvt_sc_lse_add(float &m, float &z, float r, float c)
{
    if (r > m) {
        z = z * expf(c * (m - r)) + 1.0f;
        m = r;
    } else {
        z += expf(c * (r - m));
    }
}
// Merges (m2, z2) into (m, z); both lanes of a shuffle pair get the same sums
// (the same products, added in either order).
KVT_DEV void kvt_sc_lse_merge(float &m, float &z, float m2, float z2, float c)
{
    if (!(m2 > -INFINITY))
        return;
    if (m2 > m) {
        z = z * expf(c * (m - m2)) + z2;
        m = m2;
    } else {
        z += z2 * expf(c * (m2 - m));
    }
}

// TOKEN / ORACLE, a page on the device: this lane's tokens t = lg, lg + 8,
// ... < ntok of the block at kb, each a full dot product per head (the K row
// 16 bytes at a time, the query rows staged or from global memory), folded
// into the lane's running max m (and ORACLE's z); bad = a non-finite
// product appeared.
template <uint32_t DT, uint32_t METHOD>
KVT_DEV void kvt_sc_keys_lane(const uint8_t *kb, uint32_t ntok, uint32_t D, uint32_t lg,
                              uint32_t g0, uint32_t gn, bool staged, const float *qs,
                              const float *qg, float c, float (&m)[KVT_SC_GR],
                              float (&z)[KVT_SC_GR], uint32_t (&bad)[KVT_SC_GR])
{
    const uint32_t nv = D / 8;
    const size_t row = (size_t)D * (DT == KVT_DTYPE_F32 ? 4u : 2u);
    for (uint32_t t = lg; t < ntok; t += KVT_SC_LANES) {
        const uint8_t *kr = kb + (size_t)t * row;
        float s[KVT_SC_GR];
KVT_SC_UNROLL
        for (uint32_t j = 0; j < KVT_SC_GR; j++)
            s[j] = 0.0f;
        for (uint32_t v = 0; v < nv; v++) {
            float x[8];
            kvt_sc_meta8<DT>(kr, v, x);
KVT_SC_UNROLL
            for (uint32_t j = 0; j < KVT_SC_GR; j++) {
                if (j >= gn)
                    break;
                float qv[8];
                kvt_sc_q8(staged, qs, qg, (size_t)(g0 + j) * D + 8u * v, qv);
                float acc = s[j];
KVT_SC_UNROLL
                for (int e = 0; e < 8; e++)
                    acc = fmaf(qv[e], x[e], acc);
                s[j] = acc;
            }
        }
KVT_SC_UNROLL
        for (uint32_t j = 0; j < KVT_SC_GR; j++) {
            if (j >= gn)
                break;
            const float r = s[j];
            if (!(fabsf(r) < INFINITY))
                bad[j] = 1u;
            else if (METHOD == KVT_SCORE_TOKEN)
                m[j] = fmaxf(m[j], r);
            else
                kvt_sc_lse_add(m[j], z[j], r, c);
        }
    }
}

// TOKEN / ORACLE raw scores of heads g0 .. g0 + gn - 1 for page `page` (zeros
// when !live), complete in every lane of the group: from the keys when the
// page has a device block, else from its metadata bound (ORACLE: plus
// ln(ntok) / c); NaN for a non-finite product or query row (qbad). Every
// lane of the warp must call it (shuffles).
template <uint32_t DT, uint32_t METHOD>
KVT_DEV void kvt_sc_page_keys(const kvt__cu_score_args &a, const kvt__cu_score_keys &k,
                              const kvt__cu_score_item &it, uint32_t page, bool live,
                              uint32_t lg, uint32_t g0, uint32_t gn, bool staged,
                              const float *qs, const uint32_t *qbad, float (&acc)[KVT_SC_GR])
{
    const float *qg = a.d_q + it.q_off;
    const float c = a.vote_scale;
    float m[KVT_SC_GR], z[KVT_SC_GR];
    uint32_t bad[KVT_SC_GR];
KVT_SC_UNROLL
    for (uint32_t j = 0; j < KVT_SC_GR; j++) {
        acc[j] = 0.0f;
        m[j] = -INFINITY;
        z[j] = 0.0f;
        bad[j] = 0u;
    }
    uint32_t ntok = 0, blk = 0;
    if (live) {
        const uint64_t first = (uint64_t)page * k.P;
        ntok = it.tokens > first ? (uint32_t)kvt_umin64(k.P, it.tokens - first) : 0u;
        blk = k.d_dev_table[it.table_off + page];
        if (blk) {
            kvt_sc_keys_lane<DT, METHOD>(k.d_dev_base + (uint64_t)blk * k.block_bytes, ntok, a.D,
                                         lg, g0, gn, staged, qs, qg, c, m, z, bad);
        } else {
            const uint8_t *mp = kvt_sc_meta_mm<DT>(a, a.d_meta_table[it.table_off + page]);
            kvt_sc_bound<DT>(mp, a.D, lg, g0, gn, staged, qs, qg, acc);
        }
    }
KVT_SC_UNROLL
    for (uint32_t j = 0; j < KVT_SC_GR; j++) {
        float s = acc[j], mj = m[j], zj = z[j];
        uint32_t bj = bad[j];
        s += kvt_shfl_xor(s, 1);
        s += kvt_shfl_xor(s, 2);
        s += kvt_shfl_xor(s, 4);
KVT_SC_UNROLL
        for (int o = 1; o < (int)KVT_SC_LANES; o <<= 1) {
            const float m2 = kvt_shfl_xor(mj, o);
            bj |= kvt_shfl_xor(bj, o);
            if (METHOD == KVT_SCORE_TOKEN) {
                mj = fmaxf(mj, m2);
            } else {
                const float z2 = kvt_shfl_xor(zj, o);
                kvt_sc_lse_merge(mj, zj, m2, z2, c);
            }
        }
        float r;
        if (blk)
            r = bj ? NAN : METHOD == KVT_SCORE_TOKEN ? mj : mj + logf(zj) / c;
        else
            r = METHOD == KVT_SCORE_ORACLE ? kvt_add_rn(s, logf((float)ntok) / c) : s;
        if (j < gn && qbad[g0 + j])
            r = NAN;
        acc[j] = live ? r : 0.0f;
    }
}

// Raw scores of heads g0 .. g0 + gn - 1 for page `page` (any value when
// !live: zeros), complete in every lane of the group. Every lane of the
// warp must call it (shuffles).
template <uint32_t DT, uint32_t METHOD>
KVT_DEV void kvt_sc_page(const kvt__cu_score_args &a, const kvt__cu_score_keys &k,
                         const kvt__cu_score_item &it, uint32_t page, bool live, uint32_t lg,
                         uint32_t g0, uint32_t gn, bool staged, const float *qa, const float *qb,
                         const uint32_t *qbad, float (&acc)[KVT_SC_GR])
{
    if constexpr (METHOD >= KVT_SCORE_TOKEN) {
        (void)qb;
        kvt_sc_page_keys<DT, METHOD>(a, k, it, page, live, lg, g0, gn, staged, qa, qbad, acc);
    } else {
        (void)k;
        (void)qbad;
KVT_SC_UNROLL
        for (uint32_t j = 0; j < KVT_SC_GR; j++)
            acc[j] = 0.0f;
        if (live) {
            const uint32_t slot = a.d_meta_table[it.table_off + page];
            const uint8_t *m = METHOD == KVT_SCORE_MINMAX ? kvt_sc_meta_mm<DT>(a, slot)
                                                          : kvt_sc_meta_mean<DT>(a, slot);
            kvt_sc_partial<DT, METHOD>(m, a.D, lg, g0, gn, staged, qa, qb, a.d_q + it.q_off, acc);
        }
KVT_SC_UNROLL
        for (uint32_t j = 0; j < KVT_SC_GR; j++) {
            float s = acc[j];
            s += kvt_shfl_xor(s, 1);
            s += kvt_shfl_xor(s, 2);
            s += kvt_shfl_xor(s, 4);
            acc[j] = s;
        }
    }
}

// Online softmax statistics: (m, s) = running maximum and sum of exp(r - m)
// over finite-or--inf r; NaN and +inf are flagged elsewhere.
KVT_DEV void kvt_sc_online(float &m, float &s, float r)
{
    if (r > m) {
        s = s * expf(m - r) + 1.0f;
        m = r;
    } else if (r > -INFINITY) {
        s += expf(r - m);
    }
}
KVT_DEV void kvt_sc_merge(float &m, float &s, float m2, float s2)
{
    if (!(m2 > -INFINITY))
        return;
    if (m2 > m) {
        s = s * expf(m - m2) + s2;
        m = m2;
    } else {
        s += s2 * expf(m2 - m);
    }
}

template <uint32_t DT, uint32_t METHOD>
KVT_KERNEL __launch_bounds__(KVT_SC_THREADS_SV) kvt_score_kernel(const kvt__cu_score_args a,
                                                                 const kvt__cu_score_keys k,
                                                                 int staged)
{
    KVT_DYN_SHARED(float, dyn);
    KVT_SHARED(float, red_m, KVT_SC_MAX_GROUPS * KVT_SC_GR);
    KVT_SHARED(float, red_s, KVT_SC_MAX_GROUPS * KVT_SC_GR);
    KVT_SHARED(uint32_t, red_f, KVT_SC_MAX_GROUPS * KVT_SC_GR);
    const kvt__cu_score_item it = a.d_items[blockIdx.x];
    const uint32_t G = a.G, D = a.D, np = it.n_pages;
    if (np == 0)
        return; // the whole block: before any barrier
    const bool keyed = METHOD >= KVT_SCORE_TOKEN, sv = a.vote == KVT_VOTE_SOFTVOTE;
    const size_t GD = (size_t)G * D;
    const uint32_t nq = staged ? (METHOD == KVT_SCORE_MINMAX ? 2u : 1u) : 0u;
    float *qa = dyn, *qb = dyn + GD;
    float *st_m = dyn + nq * GD, *st_inv = st_m + G, *st_sp = st_inv + G;
    // TOKEN / ORACLE: per query row, whether it holds a non-finite element.
    uint32_t *qbad = reinterpret_cast<uint32_t *>(st_m + (sv ? 3u * G : 0u));
    if (staged) {
        const float *q = a.d_q + it.q_off;
        for (size_t i = threadIdx.x; i < GD; i += blockDim.x) {
            const float x = q[i];
            if (METHOD == KVT_SCORE_MINMAX) {
                qa[i] = x > 0.0f ? x : 0.0f;
                qb[i] = x < 0.0f ? x : 0.0f;
            } else {
                qa[i] = x;
            }
        }
    }
    if (keyed) {
        for (uint32_t g = threadIdx.x; g < G; g += blockDim.x) {
            const float *q = a.d_q + it.q_off + (size_t)g * D;
            uint32_t b = 0;
            for (uint32_t d = 0; d < D; d++)
                b |= fabsf(q[d]) < INFINITY ? 0u : 1u;
            qbad[g] = b;
        }
    }
    if (staged || keyed)
        KVT_SYNC();
    const uint32_t ng = blockDim.x / KVT_SC_LANES;
    const uint32_t grp = threadIdx.x / KVT_SC_LANES, lg = threadIdx.x % KVT_SC_LANES;
    float *out = a.d_vote + it.vote_off;
    float acc[KVT_SC_GR];

    if (!sv) {
        for (uint32_t base = blockIdx.y * ng; base < np; base += gridDim.y * ng) {
            const uint32_t page = base + grp;
            const bool live = page < np;
            float v = 0.0f;
            for (uint32_t g0 = 0; g0 < G; g0 += KVT_SC_GR) {
                const uint32_t gn = kvt_umin(KVT_SC_GR, G - g0);
                kvt_sc_page<DT, METHOD>(a, k, it, page, live, lg, g0, gn, staged, qa, qb, qbad,
                                        acc);
KVT_SC_UNROLL
                for (uint32_t j = 0; j < KVT_SC_GR; j++) {
                    if (j >= gn)
                        break;
                    const float r = acc[j];
                    if (g0 + j == 0)
                        v = r;
                    else if (a.vote == KVT_VOTE_SUM)
                        v = kvt_add_rn(v, r);
                    else // the CPU's MAX: a NaN head takes the vote and keeps it
                        v = r > v || r != r ? r : v;
                }
            }
            if (live && lg == 0)
                out[page] = v != v ? INFINITY : v;
        }
        return;
    }

    // SOFTVOTE. TOKEN / ORACLE keep the first pass's raw scores [page][G] in
    // the workspace (this block's region), when there is one and the item
    // fits it, so the second pass reads no key again.
    float *ws = keyed && k.d_work && np <= a.max_pages
                    ? k.d_work + (uint64_t)blockIdx.x * a.max_pages * G
                    : nullptr;
    // Pass 1: per head, over every page of the item.
    const float scale = a.vote_scale;
    for (uint32_t g0 = 0; g0 < G; g0 += KVT_SC_GR) {
        const uint32_t gn = kvt_umin(KVT_SC_GR, G - g0);
        float m[KVT_SC_GR], s[KVT_SC_GR];
        uint32_t sp[KVT_SC_GR];
KVT_SC_UNROLL
        for (uint32_t j = 0; j < KVT_SC_GR; j++) {
            m[j] = -INFINITY;
            s[j] = 0.0f;
            sp[j] = 0;
        }
        for (uint32_t base = 0; base < np; base += ng) {
            const uint32_t page = base + grp;
            const bool live = page < np;
            kvt_sc_page<DT, METHOD>(a, k, it, page, live, lg, g0, gn, staged, qa, qb, qbad, acc);
            if (!live)
                continue;
            if (ws && lg == 0) {
KVT_SC_UNROLL
                for (uint32_t j = 0; j < KVT_SC_GR; j++) {
                    if (j >= gn)
                        break;
                    ws[(size_t)page * G + g0 + j] = acc[j];
                }
            }
KVT_SC_UNROLL
            for (uint32_t j = 0; j < KVT_SC_GR; j++) {
                const float r = kvt_mul_rn(acc[j], scale);
                sp[j] |= (r != r || r == INFINITY) ? 1u : 0u;
                kvt_sc_online(m[j], s[j], r);
            }
        }
        if (lg == 0) {
KVT_SC_UNROLL
            for (uint32_t j = 0; j < KVT_SC_GR; j++) {
                red_m[grp * KVT_SC_GR + j] = m[j];
                red_s[grp * KVT_SC_GR + j] = s[j];
                red_f[grp * KVT_SC_GR + j] = sp[j];
            }
        }
        KVT_SYNC();
        if (threadIdx.x < gn) {
            const uint32_t j = threadIdx.x;
            float M = -INFINITY, S = 0.0f;
            uint32_t F = 0;
            for (uint32_t x = 0; x < ng; x++) {
                kvt_sc_merge(M, S, red_m[x * KVT_SC_GR + j], red_s[x * KVT_SC_GR + j]);
                F |= red_f[x * KVT_SC_GR + j];
            }
            // A NaN or +inf score (an opened box) takes the head's whole
            // vote; so does nothing when every score is -inf (the CPU's
            // isinf(max) test).
            const bool special = F != 0 || !(M > -INFINITY) || M == INFINITY;
            st_m[g0 + j] = M;
            st_sp[g0 + j] = special ? 1.0f : 0.0f;
            st_inv[g0 + j] = special ? 0.0f : 1.0f / S;
        }
        KVT_SYNC();
    }
    // Pass 2: rescore (or read the kept raw scores back: the same group
    // wrote them, before the barriers above), vote in head order like the
    // CPU.
    for (uint32_t base = 0; base < np; base += ng) {
        const uint32_t page = base + grp;
        const bool live = page < np;
        float v = 0.0f;
        for (uint32_t g0 = 0; g0 < G; g0 += KVT_SC_GR) {
            const uint32_t gn = kvt_umin(KVT_SC_GR, G - g0);
            if (ws) {
KVT_SC_UNROLL
                for (uint32_t j = 0; j < KVT_SC_GR; j++)
                    acc[j] = live && j < gn ? ws[(size_t)page * G + g0 + j] : 0.0f;
            } else {
                kvt_sc_page<DT, METHOD>(a, k, it, page, live, lg, g0, gn, staged, qa, qb, qbad,
                                        acc);
            }
KVT_SC_UNROLL
            for (uint32_t j = 0; j < KVT_SC_GR; j++) {
                if (j >= gn)
                    break;
                const uint32_t g = g0 + j;
                const float r = kvt_mul_rn(acc[j], scale);
                const float c = st_sp[g] != 0.0f
                                    ? ((r != r || r == INFINITY) ? INFINITY : 0.0f)
                                    : kvt_mul_rn(expf(r - st_m[g]), st_inv[g]);
                v = kvt_add_rn(v, c);
            }
        }
        if (live && lg == 0)
            out[page] = v != v ? INFINITY : v;
    }
}

// ---- top-K -----------------------------------------------------------------
constexpr uint32_t KVT_TK_THREADS = 512;
constexpr uint32_t KVT_TK_CACHE_PAGES = 8192; // keys kept in shared memory (32 KiB) up to this

// A vote as an unsigned key in the order of kvt__sel_pick: NaN = +inf and
// -0 = +0 (equal votes tie by index), larger vote = larger key.
KVT_DEV uint32_t kvt_tk_key(float f)
{
    uint32_t u = kvt_f32_bits(f);
    if (f != f)
        u = 0x7f800000u;
    if (u == 0x80000000u)
        u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

KVT_DEV uint32_t kvt_tk_key_at(const uint32_t *keys, const float *vote, uint32_t i)
{
    return keys ? keys[i] : kvt_tk_key(vote[i]);
}

KVT_KERNEL __launch_bounds__(KVT_TK_THREADS) kvt_topk_kernel(const kvt__cu_topk_args a, uint32_t cache_pages)
{
    KVT_DYN_SHARED(uint32_t, cache);
    KVT_SHARED(uint32_t, hist, 256);
    KVT_SHARED(uint32_t, wcnt, 64);
    KVT_SHARED(uint32_t, bc, 2);
    const kvt__cu_topk_item it = a.d_items[blockIdx.x];
    const uint32_t tid = threadIdx.x, nt = blockDim.x;
    const uint32_t np = it.n_pages;
    uint32_t *sel = a.d_sel + it.sel_off;
    uint32_t *topk = a.d_topk ? a.d_topk + it.sel_off : nullptr;
    // Competitors: [c0, c1); the rest is forced.
    uint32_t c0, c1;
    kvt__forced_span(np, it.tokens, a.P, it.sink, it.local, &c0, &c1);
    if (c0 >= c1) {
        for (uint32_t i = tid; i < np; i += nt)
            sel[i] = i;
        if (tid == 0) {
            a.d_n_sel[blockIdx.x] = np;
            if (a.d_n_topk)
                a.d_n_topk[blockIdx.x] = 0;
        }
        return;
    }
    const uint32_t nc = c1 - c0, take = kvt_umin(it.k, nc);
    for (uint32_t i = tid; i < c0; i += nt)
        sel[i] = i;
    for (uint32_t i = c1 + tid; i < np; i += nt)
        sel[c0 + take + (i - c1)] = i;
    if (tid == 0) {
        a.d_n_sel[blockIdx.x] = c0 + take + (np - c1);
        if (a.d_n_topk)
            a.d_n_topk[blockIdx.x] = take;
    }
    if (take == nc) { // every competitor
        for (uint32_t i = c0 + tid; i < c1; i += nt) {
            sel[i] = i;
            if (topk)
                topk[i - c0] = i;
        }
        return;
    }
    if (take == 0)
        return;

    const float *vote = a.d_vote + it.vote_off + c0;
    const uint32_t *keys = nullptr;
    if (nc <= cache_pages) {
        for (uint32_t i = tid; i < nc; i += nt)
            cache[i] = kvt_tk_key(vote[i]);
        keys = cache; // visible after the first barrier below
    }

    // Radix select: the take-th largest key, 8 bits a pass from the top.
    uint32_t prefix = 0, mask = 0, rem = take;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (uint32_t b = tid; b < 256; b += nt)
            hist[b] = 0;
        KVT_SYNC();
        for (uint32_t i = tid; i < nc; i += nt) {
            const uint32_t k = kvt_tk_key_at(keys, vote, i);
            if ((k & mask) == prefix)
                atomicAdd(&hist[(k >> shift) & 255u], 1u);
        }
        KVT_SYNC();
        if (tid < 32) {
            // Lane l holds bins 255 - 8 l down to 248 - 8 l (descending).
            uint32_t c[8], sum = 0;
KVT_SC_UNROLL
            for (uint32_t j = 0; j < 8; j++) {
                c[j] = hist[255u - 8u * tid - j];
                sum += c[j];
            }
            uint32_t incl = sum;
KVT_SC_UNROLL
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t t = kvt_shfl(incl, (int)tid >= o ? (int)tid - o : (int)tid);
                if ((int)tid >= o)
                    incl += t;
            }
            uint32_t before = incl - sum;
            if (before < rem && rem <= incl) {
                for (uint32_t j = 0; j < 8; j++) {
                    if (before + c[j] >= rem) {
                        bc[0] = 255u - 8u * tid - j;
                        bc[1] = rem - before;
                        break;
                    }
                    before += c[j];
                }
            }
        }
        KVT_SYNC();
        prefix |= bc[0] << shift;
        mask |= 255u << shift;
        rem = bc[1];
    }
    const uint32_t thr = prefix, need = rem; // keys > thr all go, plus `need` equal ones

    // Each warp: a contiguous run of the competitors, in steps of 32.
    const uint32_t nw = nt / 32, w = tid / 32, lane = tid % 32;
    const uint32_t chunk = ((nc + nw - 1) / nw + 31u) & ~31u;
    const uint32_t wb = kvt_umin(nc, w * chunk), we = kvt_umin(nc, wb + chunk);
    const uint32_t below = (1u << lane) - 1u;
    uint32_t ngt = 0, neq = 0;
    for (uint32_t j = wb; j < we; j += 32) {
        const uint32_t i = j + lane;
        const uint32_t k = i < we ? kvt_tk_key_at(keys, vote, i) : 0u;
        ngt += (uint32_t)__popc(kvt_ballot(i < we && k > thr));
        neq += (uint32_t)__popc(kvt_ballot(i < we && k == thr));
    }
    if (lane == 0) {
        wcnt[w] = ngt;
        wcnt[32 + w] = neq;
    }
    KVT_SYNC();
    uint32_t gt_before = 0, eq_seen = 0;
    for (uint32_t x = 0; x < w; x++) {
        gt_before += wcnt[x];
        eq_seen += wcnt[32 + x];
    }
    uint32_t pos = gt_before + kvt_umin(eq_seen, need);
    for (uint32_t j = wb; j < we; j += 32) {
        const uint32_t i = j + lane;
        const uint32_t k = i < we ? kvt_tk_key_at(keys, vote, i) : 0u;
        const bool eq = i < we && k == thr;
        const uint32_t eqm = kvt_ballot(eq);
        const bool take_it =
            i < we && (k > thr || (eq && eq_seen + (uint32_t)__popc(eqm & below) < need));
        const uint32_t tm = kvt_ballot(take_it);
        if (take_it) {
            const uint32_t at = pos + (uint32_t)__popc(tm & below);
            sel[c0 + at] = c0 + i;
            if (topk)
                topk[at] = c0 + i;
        }
        pos += (uint32_t)__popc(tm);
        eq_seen += (uint32_t)__popc(eqm);
    }
}

bool kvt_sc_dtype_ok(kvt_dtype dt)
{
    return dt == KVT_DTYPE_F16 || dt == KVT_DTYPE_BF16 || dt == KVT_DTYPE_F32;
}

template <uint32_t DT>
cudaError_t kvt_sc_launch(const kvt__cu_score_args *a, const kvt__cu_score_keys *k, dim3 grid,
                          dim3 block, size_t smem, void *stream, int staged)
{
    switch (a->method) {
    case KVT_SCORE_MINMAX:
        return KVT_LAUNCH((kvt_score_kernel<DT, KVT_SCORE_MINMAX>), grid, block, smem, stream, *a,
                          *k, staged);
    case KVT_SCORE_MEAN:
        return KVT_LAUNCH((kvt_score_kernel<DT, KVT_SCORE_MEAN>), grid, block, smem, stream, *a,
                          *k, staged);
    case KVT_SCORE_TOKEN:
        return KVT_LAUNCH((kvt_score_kernel<DT, KVT_SCORE_TOKEN>), grid, block, smem, stream, *a,
                          *k, staged);
    default:
        return KVT_LAUNCH((kvt_score_kernel<DT, KVT_SCORE_ORACLE>), grid, block, smem, stream, *a,
                          *k, staged);
    }
}

// The votes the kernel runs: ORACLE's is always SOFTVOTE.
uint32_t kvt_sc_vote(const kvt__cu_score_args *a)
{
    return a->method == KVT_SCORE_ORACLE ? KVT_VOTE_SOFTVOTE : a->vote;
}

} // namespace

extern "C" {

size_t kvt__cu_score_workspace_bytes(const kvt__cu_score_args *a)
{
    if (!a || (a->method != KVT_SCORE_TOKEN && a->method != KVT_SCORE_ORACLE) ||
        kvt_sc_vote(a) != KVT_VOTE_SOFTVOTE)
        return 0;
    return (size_t)a->n_items * a->max_pages * a->G * sizeof(float);
}

int kvt__cu_score(const kvt__cu_score_args *a, void *stream)
{
    return kvt__cu_score_ex(a, NULL, stream);
}

int kvt__cu_score_ex(const kvt__cu_score_args *a, const kvt__cu_score_keys *k, void *stream)
{
    if (!a)
        return kvt__err(KVT_EINVAL, "a: must not be NULL");
    if (a->G == 0 || a->G > 256)
        return kvt__err(KVT_EINVAL, "a->G: %u is outside 1..256", a->G);
    if (a->D < 8 || a->D > 1024 || a->D % 8 != 0)
        return kvt__err(KVT_EINVAL, "a->D: %u is not a multiple of 8 in 8..1024", a->D);
    if (!kvt_sc_dtype_ok(a->dtype))
        return kvt__err(KVT_EINVAL, "a->dtype: %u is not F16, BF16 or F32", a->dtype);
    if (a->method > KVT_SCORE_ORACLE)
        return kvt__err(KVT_EINVAL, "a->method: unknown scoring method %u", a->method);
    if (a->vote > KVT_VOTE_SOFTVOTE)
        return kvt__err(KVT_EINVAL, "a->vote: unknown vote %u", a->vote);
    const bool keyed = a->method >= KVT_SCORE_TOKEN;
    if (a->method == KVT_SCORE_ORACLE && !(a->vote_scale > 0.0f && a->vote_scale < INFINITY))
        return kvt__err(KVT_EINVAL, "a->vote_scale: %g is not a finite value > 0 (ORACLE's c)",
                        (double)a->vote_scale);
    if (a->vote == KVT_VOTE_SOFTVOTE && !(a->vote_scale >= 0.0f && a->vote_scale < INFINITY))
        return kvt__err(KVT_EINVAL, "a->vote_scale: %g is not a finite value >= 0",
                        (double)a->vote_scale);
    if (a->n_items > 0x7fffffffu)
        return kvt__err(KVT_EINVAL, "a->n_items: %u is above 2^31 - 1", a->n_items);
    const uint64_t elem = kvt_dtype_bytes(a->dtype);
    if (int rc = kvt_meta_check(a->D, a->dtype, a->meta_bytes, a->meta_slots))
        return rc;
    kvt__cu_score_keys kk = {};
    if (keyed) {
        if (!k)
            return kvt__err(KVT_EINVAL, "k: TOKEN and ORACLE need the keys (kvt__cu_score_ex)");
        if (k->P < 8 || k->P > 256 || (k->P & (k->P - 1)) != 0)
            return kvt__err(KVT_EINVAL, "k->P: %u is not a power of two in 8..256", k->P);
        if (k->block_bytes < 2ull * k->P * a->D * elem || k->block_bytes % 16 != 0)
            return kvt__err(KVT_EINVAL, "k->block_bytes: %llu is not a multiple of 16 of at "
                            "least 2 * P * D * %llu = %llu",
                            (unsigned long long)k->block_bytes, (unsigned long long)elem,
                            (unsigned long long)(2ull * k->P * a->D * elem));
        if (k->reserved != 0)
            return kvt__err(KVT_EINVAL, "k->reserved: must be zero");
        kk = *k;
    }
    if (a->n_items == 0)
        return 0;
    KVT_CU_NEED(a, d_items);
    KVT_CU_NEED(a, d_q);
    KVT_CU_NEED(a, d_meta_table);
    if (!a->d_meta_base || (uintptr_t)a->d_meta_base % 16 != 0)
        return kvt__err(KVT_EINVAL, "a->d_meta_base: %p is NULL or not 16-byte aligned",
                        (const void *)a->d_meta_base);
    KVT_CU_NEED(a, d_vote);
    if (keyed) {
        if (!k->d_dev_table)
            return kvt__err(KVT_EINVAL, "k->d_dev_table: must not be NULL");
        if (!k->d_dev_base || (uintptr_t)k->d_dev_base % 16 != 0)
            return kvt__err(KVT_EINVAL, "k->d_dev_base: %p is NULL or not 16-byte aligned",
                            (const void *)k->d_dev_base);
    }

    kvt__cu_score_args b = *a;
    b.vote = kvt_sc_vote(a);
    const bool sv = b.vote == KVT_VOTE_SOFTVOTE;
    // Staged query rows: qa and qb for MINMAX, q for the others.
    const size_t qbytes = (a->method == KVT_SCORE_MINMAX ? 2u : 1u) * (size_t)a->G * a->D * 4u;
    const int staged = qbytes <= KVT_SC_QSMEM;
    const size_t smem = (staged ? qbytes : 0) + (sv ? 3u * (size_t)a->G * 4u : 0) +
                        (keyed ? (size_t)a->G * 4u : 0);
    const uint32_t threads = sv ? KVT_SC_THREADS_SV : KVT_SC_THREADS;
    uint32_t gy = 1;
    if (!sv) {
        // A page's keys are P rows, not one metadata slot: a group per page.
        const uint64_t per = (uint64_t)(threads / KVT_SC_LANES) *
                             (keyed ? 1u : KVT_SC_PAGES_PER_GROUP);
        gy = (uint32_t)kvt_umin64(kvt_umax(1u, (uint32_t)((a->max_pages + per - 1) / per)),
                                  65535u);
    }
    const dim3 grid(a->n_items, gy), block(threads);
    cudaError_t e;
    if (a->dtype == KVT_DTYPE_F16)
        e = kvt_sc_launch<KVT_DTYPE_F16>(&b, &kk, grid, block, smem, stream, staged);
    else if (a->dtype == KVT_DTYPE_BF16)
        e = kvt_sc_launch<KVT_DTYPE_BF16>(&b, &kk, grid, block, smem, stream, staged);
    else
        e = kvt_sc_launch<KVT_DTYPE_F32>(&b, &kk, grid, block, smem, stream, staged);
    return KVT_CU_LAUNCHED(e, "kvt__cu_score");
}

int kvt__cu_topk(const kvt__cu_topk_args *a, void *stream)
{
    if (!a)
        return kvt__err(KVT_EINVAL, "a: must not be NULL");
    if (a->P < 8 || a->P > 256 || (a->P & (a->P - 1)) != 0)
        return kvt__err(KVT_EINVAL, "a->P: %u is not a power of two in 8..256", a->P);
    if (a->n_items > 0x7fffffffu)
        return kvt__err(KVT_EINVAL, "a->n_items: %u is above 2^31 - 1", a->n_items);
    if (a->n_items == 0)
        return 0;
    KVT_CU_NEED(a, d_items);
    KVT_CU_NEED(a, d_vote);
    KVT_CU_NEED(a, d_sel);
    KVT_CU_NEED(a, d_n_sel);
    const uint32_t cache = a->max_pages <= KVT_TK_CACHE_PAGES ? a->max_pages : 0u;
    const cudaError_t e = KVT_LAUNCH(kvt_topk_kernel, dim3(a->n_items), dim3(KVT_TK_THREADS),
                                     (size_t)cache * 4u, stream, *a, cache);
    return KVT_CU_LAUNCHED(e, "kvt__cu_topk");
}

} // extern "C"
