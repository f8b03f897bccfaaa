// Sparse flash-decode (kvt__cu_attn): the G query rows of one KV head attend
// over a list of device blocks, split over thread blocks and merged by
// log-sum-exp. Reference: kvt__attn (lib/attn/kern_impl.h) driven by
// kvt__dec_task / kvt__merge (lib/attn/step.c).
//
// Grid: one thread block of 128 threads per (item, split). A split covers
// split_pages consecutive pages of its item (the last real split also takes
// any pages past max_pages, so an item that breaks the max_pages promise is
// still computed right, only slower) and serves the whole GQA group of its
// KV head, so every K/V byte is read once per group.
//
// Tiles: the split's tokens stream through shared memory in tiles of TT
// token slots, double-buffered (tile i+1 is in flight through cp.async while
// tile i is computed). When a page holds at most the target tile size, a
// tile is PPT whole pages (TP = P slots each); otherwise a tile is a chunk
// of TP tokens of one page. Only the valid tokens of a page are fetched; the
// V rows of empty slots inside a tile are zero-filled and their scores are
// -inf, so they add exactly nothing. A tile's K rows come first, then its V
// rows, each row padded to RS bytes (a multiple of 16).
//
// Threads: a row of D elements is covered by TX lanes (TX = next power of
// two >= ceil(D / 8), at most 32) holding 8 consecutive elements each; a
// warp holds 32 / TX such lane groups and the block NY = 4 * 32 / TX "y
// slots". Per tile:
//   1. scores: y slot s takes token s (then s + NY ...), loads its 8-element
//      K fragment once and forms the dot products with the G prescaled query
//      rows (q in shared memory, f32), reduced over the TX lanes with xor
//      shuffles; S[g][s] = scale * q_g . k_s, -inf for an empty slot;
//   2. softmax: one warp per query row: running maximum m, denominator l
//      and the rescale factor alpha of the row (the online softmax of
//      kvt__attn: alpha = 1 when the maximum does not move, 0 when it was
//      -inf), S becomes p = exp(S - m);
//   3. values: y slot y owns accumulator rows y, y + NY, ... (4 at a time in
//      registers, 8 columns per lane); with fewer query rows than y slots
//      (G < NY) the tokens are dealt to KS = NY / G partial accumulators per
//      row instead, summed once at the end. Accumulators live in shared
//      memory between tiles (f32, [NA][QS]).
// Every lane of a warp runs the same number of shuffles (loop bounds are
// uniform over the block), as the dialect requires.
//
// Limits: G 1..64, D 1..256, P 1..1024, dtype F16/BF16/F32. Rows whose byte
// size D * elem is a multiple of 16 (D % 8 == 0 at 2 bytes, D % 4 == 0 at
// f32), with a 16-byte aligned arena and block size, are fetched with
// cp.async; other shapes with plain element loads (same arithmetic, no
// copy/compute overlap). Shared memory: 4 * TT * RS (tiles) + 4 * G * QS
// (queries) + 4 * NA * QS (accumulators) + 4 * G * (TT + 1) (scores) + 12 * G
// dynamic, 512 bytes static; TT starts at 16 KiB / (2 * RS) slots (at most
// 64) and is halved until this fits the device's opt-in limit. The largest
// shape, G = 64, D = 256, f32, needs about 133 KiB even at TT = 1, within
// sm_80's 163 KiB (it gets TT = 4 there, TT = 8 on sm_90). f16, D = 128,
// G = 8, P = 16: TT = 32 (two pages), 42112 + 512 bytes.
//
// Splits (split_pages = 0): enough splits per item that n_items * splits
// covers about two waves of resident blocks (SM count times the blocks of
// this size one SM holds), but no split smaller than 64 token slots
// (ceil(64 / P) pages), below which the partial results written and merged
// cost about as much traffic as the K/V the split reads.
//
// Partial results (more than one split): m, l and the unnormalised acc[D]
// per (item, split, g) in the workspace; kvt__attn_merge (one block per
// (item, g)) combines the splits that exist for the item exactly as
// kvt__merge: M = max m, L = sum l * exp(m - M), out = sum acc * exp(m - M)
// / L, lse = M + log(L). Items with a single real split are finished by the
// split kernel itself; items with no pages get zeros and -inf.

#include "kvt_cuda_rt.cuh"

#define KVT__AT_THREADS 128u
#define KVT__AT_WARPS (KVT__AT_THREADS / 32u)
#define KVT__AT_RB 4u        /* accumulator rows per register batch */
#define KVT__AT_TT_MAX 64u   /* token slots per tile, at most */
#define KVT__AT_TILE_BYTES 16384u /* target K+V bytes per tile (one stage) */
#define KVT__AT_MIN_SPLIT_TOKENS 64u
#define KVT__AT_STATIC_SMEM (2u * KVT__AT_TT_MAX * 4u) /* tnt[] of the split kernel */
#define KVT__AT_MERGE_THREADS 128u
#define KVT__AT_MERGE_CHUNK 256u

// Full unrolling of the fixed 8-column / 4-row register loops.
#ifdef KVT_CUDA_EMU
#define KVT__AT_UNROLL _Pragma("GCC unroll 8")
#else
#define KVT__AT_UNROLL _Pragma("unroll")
#endif

#define KVT__DT_F16 0
#define KVT__DT_BF16 1
#define KVT__DT_F32 2

// 16 bytes, for vector loads and stores of shared memory.
struct alignas(16) kvt__v16 {
    uint32_t w[4];
};

// Everything a launch of the split kernel needs (by value).
struct kvt__attn_kp {
    const kvt__cu_attn_item *items;
    const float *q;
    float *out, *lse;
    const uint32_t *blocks, *ntok;
    const uint8_t *base;
    uint64_t block_bytes;
    float *ws_acc, *ws_m, *ws_l;
    float scale;
    uint32_t G, D, P;
    uint32_t nsplit, sp;
    uint32_t TX, LTX, NY, KS, NA, QS, RS, TT, ST, TP, PPT;
    uint32_t off_q, off_acc, off_s, off_m, off_l, off_al; /* bytes into dynamic shared memory */
};

// ---- device helpers -----------------------------------------------------------
template <int DT> KVT_DEV float kvt__at_half(uint32_t h)
{
    return DT == KVT__DT_BF16 ? kvt_bf16_to_f32((uint16_t)h) : kvt_f16_to_f32((uint16_t)h);
}

// Element d of a row (shared memory) of the pool dtype, as f32.
template <int DT> KVT_DEV float kvt__at_elem(const uint8_t *row, uint32_t d)
{
    if (DT == KVT__DT_F32)
        return reinterpret_cast<const float *>(row)[d];
    return kvt__at_half<DT>(reinterpret_cast<const uint16_t *>(row)[d]);
}

// The 8 elements of a row from column c (a multiple of 8), zeros past D.
template <int DT> KVT_DEV void kvt__at_frag(const uint8_t *row, uint32_t c, uint32_t D, float *f)
{
    if (c + 8u <= D) {
        if (DT == KVT__DT_F32) {
            const kvt__v16 *p = reinterpret_cast<const kvt__v16 *>(row + (size_t)c * 4u);
            const kvt__v16 a = p[0], b = p[1];
            KVT__AT_UNROLL
            for (int i = 0; i < 4; i++) {
                f[i] = kvt_bits_f32(a.w[i]);
                f[4 + i] = kvt_bits_f32(b.w[i]);
            }
        } else {
            const kvt__v16 a = *reinterpret_cast<const kvt__v16 *>(row + (size_t)c * 2u);
            KVT__AT_UNROLL
            for (int i = 0; i < 4; i++) {
                f[2 * i] = kvt__at_half<DT>(a.w[i] & 0xffffu);
                f[2 * i + 1] = kvt__at_half<DT>(a.w[i] >> 16);
            }
        }
    } else {
        KVT__AT_UNROLL
        for (uint32_t i = 0; i < 8u; i++)
            f[i] = c + i < D ? kvt__at_elem<DT>(row, c + i) : 0.0f;
    }
}

// 8 floats of shared memory (32-byte aligned).
KVT_DEV void kvt__at_ld8(const float *p, float *f)
{
    const kvt__v16 *v = reinterpret_cast<const kvt__v16 *>(p);
    const kvt__v16 a = v[0], b = v[1];
    KVT__AT_UNROLL
    for (int i = 0; i < 4; i++) {
        f[i] = kvt_bits_f32(a.w[i]);
        f[4 + i] = kvt_bits_f32(b.w[i]);
    }
}
KVT_DEV void kvt__at_st8(float *p, const float *f)
{
    kvt__v16 a, b;
    KVT__AT_UNROLL
    for (int i = 0; i < 4; i++) {
        a.w[i] = kvt_f32_bits(f[i]);
        b.w[i] = kvt_f32_bits(f[4 + i]);
    }
    kvt__v16 *v = reinterpret_cast<kvt__v16 *>(p);
    v[0] = a;
    v[1] = b;
}

// An item's page counts: n[j] valid tokens in page j, and a causal row's cut
// (kvt__cu_attn_item.cut): its last page holds at most `cut` tokens it sees.
struct kvt__at_pl {
    const uint32_t *n;
    uint32_t last, cut;
};

KVT_DEV uint32_t kvt__at_ntok(const kvt__at_pl &pn, uint32_t j, uint32_t P)
{
    const uint32_t n = j == pn.last && pn.cut ? kvt_umin(pn.n[j], pn.cut) : pn.n[j];
    return kvt_umin(n, P);
}

// A tile: pages j .. j + npg - 1 of the item (relative to pages_off), token
// slots from c0 within each page (c0 > 0 only in chunk mode), `slots` token
// slots up to and including the last valid token.
struct kvt__at_tile {
    uint32_t j, c0, npg, slots;
};

KVT_DEV kvt__at_tile kvt__at_tile_at(const kvt__attn_kp &k, const kvt__at_pl &pn, uint32_t j,
                                     uint32_t c0, uint32_t pend)
{
    kvt__at_tile t;
    t.j = j;
    t.c0 = c0;
    t.npg = kvt_umin(k.PPT, pend - j);
    const uint32_t nl = kvt__at_ntok(pn, j + t.npg - 1u, k.P);
    t.slots = (t.npg - 1u) * k.TP + (nl > c0 ? kvt_umin(nl - c0, k.TP) : 0u);
    return t;
}

// The tile after t; returns false after the split's last tile.
KVT_DEV bool kvt__at_tile_next(const kvt__attn_kp &k, const kvt__at_pl &pn, uint32_t pend,
                               const kvt__at_tile &t, kvt__at_tile *nx)
{
    uint32_t j = t.j, c0 = t.c0 + k.TP;
    if (c0 >= kvt__at_ntok(pn, j, k.P)) {
        if (pend - j <= k.PPT)
            return false;
        j += k.PPT;
        c0 = 0;
    }
    *nx = kvt__at_tile_at(k, pn, j, c0, pend);
    return true;
}

// Starts the copies of tile t into stage buffer `stage`, and records the
// valid tokens of each of its pages in tnt[0 .. npg).
template <int DT, bool AL>
KVT_DEV void kvt__at_issue(const kvt__attn_kp &k, const uint32_t *pb, const kvt__at_pl &pn,
                           const kvt__at_tile &t, uint8_t *stage, uint32_t *tnt, uint32_t tid)
{
    const uint32_t elem = DT == KVT__DT_F32 ? 4u : 2u;
    const uint64_t row = (uint64_t)k.D * elem;
    const uint32_t slots = t.slots;
    if (tid < t.npg) {
        const uint32_t n = kvt__at_ntok(pn, t.j + tid, k.P);
        tnt[tid] = n > t.c0 ? kvt_umin(n - t.c0, k.TP) : 0u;
    }
    if (AL) {
        const uint32_t cr = (uint32_t)(row / 16u); /* 16-byte pieces per row */
        const uint32_t half = slots * cr, total = 2u * half;
        for (uint32_t u = tid; u < total; u += KVT__AT_THREADS) {
            const uint32_t kv = u >= half ? 1u : 0u, r = u - kv * half;
            const uint32_t s = r / cr, c = r - s * cr;
            const uint32_t pi = s / k.TP, tok = t.c0 + (s - pi * k.TP);
            uint8_t *dst = stage + ((size_t)kv * k.TT + s) * k.RS + (size_t)c * 16u;
            if (tok < kvt__at_ntok(pn, t.j + pi, k.P)) {
                const uint8_t *src = k.base + (uint64_t)pb[t.j + pi] * k.block_bytes +
                                     ((uint64_t)kv * k.P + tok) * row + (uint64_t)c * 16u;
                kvt_cp_async16(dst, src);
            } else if (kv) {
                kvt__v16 z = {{0u, 0u, 0u, 0u}};
                *reinterpret_cast<kvt__v16 *>(dst) = z;
            }
        }
    } else {
        const uint32_t half = slots * k.D, total = 2u * half;
        for (uint32_t u = tid; u < total; u += KVT__AT_THREADS) {
            const uint32_t kv = u >= half ? 1u : 0u, r = u - kv * half;
            const uint32_t s = r / k.D, d = r - s * k.D;
            const uint32_t pi = s / k.TP, tok = t.c0 + (s - pi * k.TP);
            uint8_t *dst = stage + ((size_t)kv * k.TT + s) * k.RS;
            const bool ok = tok < kvt__at_ntok(pn, t.j + pi, k.P);
            if (!ok && !kv)
                continue;
            const uint8_t *src = ok ? k.base + (uint64_t)pb[t.j + pi] * k.block_bytes +
                                          ((uint64_t)kv * k.P + tok) * row
                                    : nullptr;
            if (DT == KVT__DT_F32)
                reinterpret_cast<float *>(dst)[d] = ok ? reinterpret_cast<const float *>(src)[d] : 0.0f;
            else
                reinterpret_cast<uint16_t *>(dst)[d] =
                    ok ? reinterpret_cast<const uint16_t *>(src)[d] : (uint16_t)0;
        }
    }
    kvt_cp_async_commit();
}

// ---- the split kernel ---------------------------------------------------------
template <int DT, bool AL> KVT_KERNEL __launch_bounds__(KVT__AT_THREADS) kvt__attn_split(const kvt__attn_kp k)
{
    KVT_DYN_SHARED(uint8_t, sm);
    KVT_SHARED(uint32_t, tnt, 2u * KVT__AT_TT_MAX);
    const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const uint32_t TX = k.TX, x = lane & (TX - 1u);
    const uint32_t y = warp * (32u / TX) + (lane >> k.LTX);
    const uint32_t G = k.G, D = k.D, QS = k.QS, ST = k.ST;
    const uint32_t item = blockIdx.x / k.nsplit, split = blockIdx.x - item * k.nsplit;
    const kvt__cu_attn_item it = k.items[item];
    const uint32_t np = it.n_pages;

    if (np == 0) { /* nothing to attend: zeros and -inf, from split 0 */
        if (split == 0) {
            for (uint32_t i = tid; i < G * D; i += KVT__AT_THREADS)
                k.out[it.out_off + i] = 0.0f;
            if (k.lse)
                for (uint32_t g = tid; g < G; g += KVT__AT_THREADS)
                    k.lse[it.lse_off + g] = -INFINITY;
        }
        return;
    }
    const uint32_t ns =
        (uint32_t)kvt_umin64(((uint64_t)np + k.sp - 1u) / k.sp, (uint64_t)k.nsplit);
    if (split >= ns)
        return;
    const uint32_t p0 = split * k.sp, pend = split + 1u == ns ? np : p0 + k.sp;

    float *qs = reinterpret_cast<float *>(sm + k.off_q);
    float *acc = reinterpret_cast<float *>(sm + k.off_acc);
    float *S = reinterpret_cast<float *>(sm + k.off_s);
    float *mS = reinterpret_cast<float *>(sm + k.off_m);
    float *lS = reinterpret_cast<float *>(sm + k.off_l);
    float *alS = reinterpret_cast<float *>(sm + k.off_al);
    const size_t stage_bytes = (size_t)2u * k.TT * k.RS;

    const float *qg = k.q + it.q_off;
    for (uint32_t i = tid; i < G * QS; i += KVT__AT_THREADS) {
        const uint32_t g = i / QS, d = i - g * QS;
        qs[i] = d < D ? k.scale * qg[(size_t)g * D + d] : 0.0f;
    }
    for (uint32_t i = tid; i < k.NA * QS; i += KVT__AT_THREADS)
        acc[i] = 0.0f;
    for (uint32_t g = tid; g < G; g += KVT__AT_THREADS) {
        mS[g] = -INFINITY;
        lS[g] = 0.0f;
    }

    const uint32_t *pb = k.blocks + it.pages_off;
    const kvt__at_pl pn = {k.ntok + it.pages_off, np - 1u, it.cut};
    kvt__at_tile cur = kvt__at_tile_at(k, pn, p0, 0u, pend), nxt;
    uint32_t st = 0;
    kvt__at_issue<DT, AL>(k, pb, pn, cur, sm, tnt, tid);
    for (;;) {
        const bool more = kvt__at_tile_next(k, pn, pend, cur, &nxt);
        if (more) {
            kvt__at_issue<DT, AL>(k, pb, pn, nxt, sm + (st ^ 1u) * stage_bytes,
                                  tnt + (st ^ 1u) * KVT__AT_TT_MAX, tid);
            kvt_cp_async_wait_groups<1>();
        } else {
            kvt_cp_async_wait_all();
        }
        KVT_SYNC();

        const uint8_t *Kb = sm + st * stage_bytes, *Vb = Kb + (size_t)k.TT * k.RS;
        const uint32_t *tn = tnt + st * KVT__AT_TT_MAX;
        const uint32_t slots = cur.slots;

        // 1. scores
        for (uint32_t s0 = 0; s0 < slots; s0 += k.NY) {
            const uint32_t s = s0 + y;
            const uint32_t pi = s / k.TP;
            const bool valid = s < slots && s - pi * k.TP < tn[kvt_umin(pi, cur.npg - 1u)];
            float kf[8];
            if (valid)
                kvt__at_frag<DT>(Kb + (size_t)s * k.RS, x * 8u, D, kf);
            else
                for (int i = 0; i < 8; i++)
                    kf[i] = 0.0f;
            for (uint32_t g = 0; g < G; g++) {
                float qf[8];
                kvt__at_ld8(qs + (size_t)g * QS + x * 8u, qf);
                float dot = 0.0f;
                KVT__AT_UNROLL
                for (int i = 0; i < 8; i++)
                    dot += qf[i] * kf[i];
                for (uint32_t o = TX >> 1; o; o >>= 1)
                    dot += kvt_shfl_xor(dot, (int)o);
                if (x == (g & (TX - 1u)) && s < slots)
                    S[(size_t)g * ST + s] = valid ? dot : -INFINITY;
            }
        }
        KVT_SYNC();

        // 2. online softmax, one warp per query row
        for (uint32_t g = warp; g < G; g += KVT__AT_WARPS) {
            float *sg = S + (size_t)g * ST;
            float mx = -INFINITY;
            for (uint32_t t = lane; t < slots; t += 32u)
                mx = fmaxf(mx, sg[t]);
            for (int o = 16; o; o >>= 1)
                mx = fmaxf(mx, kvt_shfl_xor(mx, o));
            const float mo = mS[g], mn = fmaxf(mo, mx);
            float sum = 0.0f;
            for (uint32_t t = lane; t < slots; t += 32u) {
                const float p = mn == -INFINITY ? 0.0f : expf(sg[t] - mn);
                sg[t] = p;
                sum += p;
            }
            for (int o = 16; o; o >>= 1)
                sum += kvt_shfl_xor(sum, o);
            if (lane == 0) {
                const float alpha = mo == mn ? 1.0f : mo == -INFINITY ? 0.0f : expf(mo - mn);
                lS[g] = lS[g] * alpha + sum;
                mS[g] = mn;
                alS[g] = alpha;
            }
        }
        KVT_SYNC();

        // 3. values
        for (uint32_t ar0 = y; ar0 < k.NA; ar0 += KVT__AT_RB * k.NY) {
            float a[KVT__AT_RB][8];
            uint32_t so[KVT__AT_RB];
            bool rv[KVT__AT_RB];
            const uint32_t kp = ar0 / G; /* > 0 only when KS > 1 (one row) */
            KVT__AT_UNROLL
            for (uint32_t r = 0; r < KVT__AT_RB; r++) {
                const uint32_t ar = ar0 + r * k.NY;
                rv[r] = ar < k.NA;
                const uint32_t g = rv[r] ? ar % G : 0u;
                so[r] = g * ST;
                if (rv[r]) {
                    const float al = alS[g];
                    kvt__at_ld8(acc + (size_t)ar * QS + x * 8u, a[r]);
                    KVT__AT_UNROLL
                    for (int i = 0; i < 8; i++)
                        a[r][i] *= al;
                } else {
                    KVT__AT_UNROLL
                    for (int i = 0; i < 8; i++)
                        a[r][i] = 0.0f;
                }
            }
            for (uint32_t t = kp; t < slots; t += k.KS) {
                float vf[8];
                kvt__at_frag<DT>(Vb + (size_t)t * k.RS, x * 8u, D, vf);
                KVT__AT_UNROLL
                for (uint32_t r = 0; r < KVT__AT_RB; r++) {
                    const float p = rv[r] ? S[so[r] + t] : 0.0f;
                    KVT__AT_UNROLL
                    for (int i = 0; i < 8; i++)
                        a[r][i] += p * vf[i];
                }
            }
            KVT__AT_UNROLL
            for (uint32_t r = 0; r < KVT__AT_RB; r++)
                if (rv[r])
                    kvt__at_st8(acc + (size_t)(ar0 + r * k.NY) * QS + x * 8u, a[r]);
        }
        KVT_SYNC();

        if (!more)
            break;
        cur = nxt;
        st ^= 1u;
    }

    if (k.KS > 1u) { /* fold the token-parallel partial accumulators into rows 0..G-1 */
        for (uint32_t i = tid; i < G * QS; i += KVT__AT_THREADS) {
            float v = acc[i];
            for (uint32_t p = 1; p < k.KS; p++)
                v += acc[(size_t)p * G * QS + i];
            acc[i] = v;
        }
        KVT_SYNC();
    }

    if (ns == 1u) { /* the only split: final rows */
        for (uint32_t i = tid; i < G * D; i += KVT__AT_THREADS) {
            const uint32_t g = i / D, d = i - g * D;
            const float l = lS[g];
            k.out[it.out_off + i] = l > 0.0f ? acc[(size_t)g * QS + d] * (1.0f / l) : 0.0f;
        }
        if (k.lse)
            for (uint32_t g = tid; g < G; g += KVT__AT_THREADS)
                k.lse[it.lse_off + g] = lS[g] > 0.0f ? mS[g] + logf(lS[g]) : -INFINITY;
    } else { /* partial (m, l, acc) for kvt__attn_merge */
        const size_t base = ((size_t)item * k.nsplit + split) * G;
        for (uint32_t i = tid; i < G * D; i += KVT__AT_THREADS) {
            const uint32_t g = i / D, d = i - g * D;
            k.ws_acc[base * D + i] = acc[(size_t)g * QS + d];
        }
        for (uint32_t g = tid; g < G; g += KVT__AT_THREADS) {
            k.ws_m[base + g] = mS[g];
            k.ws_l[base + g] = lS[g];
        }
    }
}

// ---- the merge kernel: one block per (item, query row) ----------------------
KVT_DEV float kvt__at_block_max(float v, float *red, uint32_t tid)
{
    for (int o = 16; o; o >>= 1)
        v = fmaxf(v, kvt_shfl_xor(v, o));
    if ((tid & 31u) == 0)
        red[tid >> 5] = v;
    KVT_SYNC();
    float r = red[0];
    for (uint32_t w = 1; w < KVT__AT_MERGE_THREADS / 32u; w++)
        r = fmaxf(r, red[w]);
    KVT_SYNC();
    return r;
}
KVT_DEV float kvt__at_block_sum(float v, float *red, uint32_t tid)
{
    for (int o = 16; o; o >>= 1)
        v += kvt_shfl_xor(v, o);
    if ((tid & 31u) == 0)
        red[tid >> 5] = v;
    KVT_SYNC();
    float r = red[0];
    for (uint32_t w = 1; w < KVT__AT_MERGE_THREADS / 32u; w++)
        r += red[w];
    KVT_SYNC();
    return r;
}

KVT_KERNEL __launch_bounds__(KVT__AT_MERGE_THREADS) kvt__attn_merge(const kvt__attn_kp k)
{
    KVT_SHARED(float, red, KVT__AT_MERGE_THREADS / 32u);
    KVT_SHARED(float, w, KVT__AT_MERGE_CHUNK);
    const uint32_t tid = threadIdx.x, G = k.G, D = k.D;
    const uint32_t item = blockIdx.x / G, g = blockIdx.x - item * G;
    const kvt__cu_attn_item it = k.items[item];
    const uint32_t ns =
        (uint32_t)kvt_umin64(((uint64_t)it.n_pages + k.sp - 1u) / k.sp, (uint64_t)k.nsplit);
    if (ns < 2u) /* written by the split kernel */
        return;
    const size_t base = (size_t)item * k.nsplit * G + g; /* + s * G: split s */
    float M = -INFINITY;
    for (uint32_t s = tid; s < ns; s += KVT__AT_MERGE_THREADS)
        M = fmaxf(M, k.ws_m[base + (size_t)s * G]);
    M = kvt__at_block_max(M, red, tid);
    float L = 0.0f;
    if (M != -INFINITY)
        for (uint32_t s = tid; s < ns; s += KVT__AT_MERGE_THREADS) {
            const float m = k.ws_m[base + (size_t)s * G];
            if (m != -INFINITY)
                L += k.ws_l[base + (size_t)s * G] * expf(m - M);
        }
    L = kvt__at_block_sum(L, red, tid);

    float o[2] = {0.0f, 0.0f};
    for (uint32_t c0 = 0; c0 < ns; c0 += KVT__AT_MERGE_CHUNK) {
        const uint32_t cnt = kvt_umin(KVT__AT_MERGE_CHUNK, ns - c0);
        for (uint32_t s = tid; s < cnt; s += KVT__AT_MERGE_THREADS) {
            const float m = k.ws_m[base + (size_t)(c0 + s) * G];
            w[s] = m == -INFINITY ? 0.0f : expf(m - M);
        }
        KVT_SYNC();
        KVT__AT_UNROLL
        for (uint32_t j = 0; j < 2u; j++) {
            const uint32_t d = tid + j * KVT__AT_MERGE_THREADS;
            if (d < D)
                for (uint32_t s = 0; s < cnt; s++)
                    o[j] += w[s] * k.ws_acc[(base + (size_t)(c0 + s) * G) * D + d];
        }
        KVT_SYNC();
    }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    KVT__AT_UNROLL
    for (uint32_t j = 0; j < 2u; j++) {
        const uint32_t d = tid + j * KVT__AT_MERGE_THREADS;
        if (d < D)
            k.out[it.out_off + (size_t)g * D + d] = L > 0.0f ? o[j] * inv : 0.0f;
    }
    if (k.lse && tid == 0)
        k.lse[it.lse_off + g] = L > 0.0f ? M + logf(L) : -INFINITY;
}

// ---- host side ------------------------------------------------------------------
namespace {

struct kvt__attn_plan {
    kvt__attn_kp k;
    bool aligned;
    size_t smem;     /* dynamic shared memory of the split kernel */
    size_t smem_max; /* the device's opt-in limit per block */
    uint64_t ws_bytes;
    uint32_t grid;
};

#define KVT__AT_BAD(...) (report ? kvt__err(KVT_EINVAL, __VA_ARGS__) : KVT_EINVAL)

uint32_t kvt__at_pow2_ceil(uint32_t v)
{
    uint32_t p = 1;
    while (p < v)
        p <<= 1;
    return p;
}

size_t kvt__at_round16(size_t v) { return (v + 15u) & ~(size_t)15u; }

// Lays out shared memory for tiles of TT slots; returns the bytes.
size_t kvt__at_layout(kvt__attn_kp *k)
{
    size_t off = (size_t)4u * k->TT * k->RS; /* 2 stages x (K, V) */
    k->off_q = (uint32_t)off;
    off += kvt__at_round16((size_t)4u * k->G * k->QS);
    k->off_acc = (uint32_t)off;
    off += kvt__at_round16((size_t)4u * k->NA * k->QS);
    k->off_s = (uint32_t)off;
    off += kvt__at_round16((size_t)4u * k->G * k->ST);
    k->off_m = (uint32_t)off;
    off += kvt__at_round16((size_t)4u * k->G);
    k->off_l = (uint32_t)off;
    off += kvt__at_round16((size_t)4u * k->G);
    k->off_al = (uint32_t)off;
    off += kvt__at_round16((size_t)4u * k->G);
    return off;
}

// Tile shape for a target of tt token slots per tile.
void kvt__at_tiles(kvt__attn_kp *k, uint32_t tt)
{
    if (k->P <= tt) { /* whole pages per tile */
        k->TP = k->P;
        k->PPT = tt / k->P;
    } else { /* chunks of a page, as even as possible */
        const uint32_t chunks = (k->P + tt - 1u) / tt;
        k->TP = (k->P + chunks - 1u) / chunks;
        k->PPT = 1;
    }
    k->TT = k->TP * k->PPT;
    k->ST = k->TT | 1u; /* odd stride: rows of S in different banks */
}

int kvt__at_device_attr(cudaDeviceAttr what, int *v, int *dev, bool report)
{
    cudaError_t e = cudaGetDevice(dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(v, what, *dev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); // else the next launch reports it as its own
        return report ? kvt__err(KVT_EIO, "kvt__cu_attn: device query failed: %s (%s)",
                                 cudaGetErrorName(e), cudaGetErrorString(e))
                      : KVT_EIO;
    }
    return 0;
}

// Validates the arguments and chooses the launch shape.
int kvt__attn_plan_make(const kvt__cu_attn_args *a, kvt__attn_plan *pl, bool report)
{
    if (a == nullptr)
        return KVT__AT_BAD("a: must not be NULL");
    if (a->G < 1 || a->G > 64)
        return KVT__AT_BAD("a->G: %u query rows per KV head, expected 1..64", a->G);
    if (a->D < 1 || a->D > 256)
        return KVT__AT_BAD("a->D: head_dim %u, expected 1..256 (8 columns per lane, 32 lanes "
                           "per row)", a->D);
    if (a->P < 1 || a->P > 1024)
        return KVT__AT_BAD("a->P: %u tokens per page, expected 1..1024", a->P);
    if (a->dtype != KVT_DTYPE_F16 && a->dtype != KVT_DTYPE_BF16 && a->dtype != KVT_DTYPE_F32)
        return KVT__AT_BAD("a->dtype: %u, expected KVT_DTYPE_F16, BF16 or F32", a->dtype);
    if (!__builtin_isfinite(a->scale))
        return KVT__AT_BAD("a->scale: %g is not finite", (double)a->scale);
    const uint32_t elem = kvt_dtype_bytes(a->dtype);
    const uint64_t row = (uint64_t)a->D * elem;
    if (a->block_bytes < 2u * (uint64_t)a->P * row)
        return KVT__AT_BAD("a->block_bytes: %llu, a block of %u tokens of head_dim %u needs "
                           "%llu", (unsigned long long)a->block_bytes, a->P, a->D,
                           (unsigned long long)(2u * (uint64_t)a->P * row));
    memset(pl, 0, sizeof *pl);
    if (a->n_items == 0)
        return 0;
    if (a->d_items == nullptr)
        return KVT__AT_BAD("a->d_items: must not be NULL");
    if (a->d_q == nullptr)
        return KVT__AT_BAD("a->d_q: must not be NULL");
    if (a->d_out == nullptr)
        return KVT__AT_BAD("a->d_out: must not be NULL");
    if (a->d_blocks == nullptr)
        return KVT__AT_BAD("a->d_blocks: must not be NULL");
    if (a->d_ntok == nullptr)
        return KVT__AT_BAD("a->d_ntok: must not be NULL");
    if (a->d_dev_base == nullptr)
        return KVT__AT_BAD("a->d_dev_base: must not be NULL");

    kvt__attn_kp *k = &pl->k;
    k->G = a->G;
    k->D = a->D;
    k->P = a->P;
    k->TX = kvt__at_pow2_ceil((a->D + 7u) / 8u);
    k->LTX = 0;
    while ((1u << k->LTX) < k->TX)
        k->LTX++;
    k->QS = 8u * k->TX;
    k->NY = KVT__AT_WARPS * (32u / k->TX);
    k->KS = a->G >= k->NY ? 1u : k->NY / a->G;
    k->NA = k->KS * a->G;
    k->RS = (uint32_t)kvt__at_round16((size_t)row);
    pl->aligned = row % 16u == 0 && a->block_bytes % 16u == 0 &&
                  (uintptr_t)a->d_dev_base % 16u == 0;

    int smem_max = 0, sms = 0, smem_sm = 0, dev = 0, rc;
    if ((rc = kvt__at_device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, &smem_max, &dev,
                                  report)) ||
        (rc = kvt__at_device_attr(cudaDevAttrMultiProcessorCount, &sms, &dev, report)) ||
        (rc = kvt__at_device_attr(cudaDevAttrMaxSharedMemoryPerMultiprocessor, &smem_sm, &dev,
                                  report)))
        return rc;
    pl->smem_max = (size_t)smem_max;
    uint32_t tt = KVT__AT_TILE_BYTES / (2u * k->RS);
    tt = tt < 1u ? 1u : tt > KVT__AT_TT_MAX ? KVT__AT_TT_MAX : tt;
    for (;;) {
        kvt__at_tiles(k, tt);
        pl->smem = kvt__at_layout(k);
        if (pl->smem + KVT__AT_STATIC_SMEM <= (size_t)smem_max)
            break;
        if (tt == 1u)
            return KVT__AT_BAD("a->G, a->D: %u query rows of head_dim %u need %zu bytes of "
                               "shared memory, the device allows %d", a->G, a->D,
                               pl->smem + KVT__AT_STATIC_SMEM, smem_max);
        tt /= 2u;
    }

    // Splits.
    const uint32_t mp = a->max_pages;
    uint32_t sp, nsplit;
    if (mp == 0) {
        sp = 1;
        nsplit = 1;
    } else if (a->split_pages) {
        sp = a->split_pages;
        nsplit = (uint32_t)(((uint64_t)mp + sp - 1u) / sp);
    } else {
        /* + static shared memory + the 1 KiB the runtime reserves per block */
        const size_t per_block = pl->smem + KVT__AT_STATIC_SMEM + 1024u;
        uint64_t resident = (size_t)smem_sm / per_block;
        resident = resident < 1u ? 1u : resident > 2048u / KVT__AT_THREADS
                                            ? 2048u / KVT__AT_THREADS : resident;
        const uint64_t target = 2u * (uint64_t)(sms > 0 ? sms : 1) * resident;
        const uint64_t want = (target + a->n_items - 1u) / a->n_items;
        const uint64_t spmin = (KVT__AT_MIN_SPLIT_TOKENS + a->P - 1u) / a->P;
        uint64_t s = ((uint64_t)mp + want - 1u) / want;
        sp = (uint32_t)(s < spmin ? spmin : s);
        nsplit = (uint32_t)(((uint64_t)mp + sp - 1u) / sp);
    }
    k->sp = sp;
    k->nsplit = nsplit;
    const uint64_t blocks = (uint64_t)a->n_items * nsplit;
    if (blocks > 0x7fffffffu)
        return KVT__AT_BAD("a->n_items: %u items x %u splits exceed the grid limit (raise "
                           "a->split_pages)", a->n_items, nsplit);
    if (nsplit > 1u && (uint64_t)a->n_items * a->G > 0x7fffffffu)
        return KVT__AT_BAD("a->n_items: %u items x %u query rows exceed the grid limit",
                           a->n_items, a->G);
    pl->grid = (uint32_t)blocks;
    /* blocks * G * (D + 2) * 4 < 2^31 * 64 * 258 * 4: no overflow in 64 bits */
    pl->ws_bytes = nsplit > 1u ? blocks * a->G * (a->D + 2u) * sizeof(float) : 0u;
    return 0;
}

template <int DT, bool AL> cudaError_t kvt__at_launch_split(const kvt__attn_plan *pl, void *stream)
{
    void (*kvt__attn_split_kernel)(const kvt__attn_kp) = kvt__attn_split<DT, AL>;
    // Above the default 48 KiB - counting the static tnt[]: the default cap
    // on the dynamic part is 48 KiB less the static shared memory - the
    // kernel's cap is raised to all the device's opt-in limit leaves beside
    // the kernel's static shared memory (the cap only bounds what a launch
    // may ask for; occupancy follows the launch's actual size). At every
    // such launch: the attribute belongs to the kernel in the current
    // context, which a cudaDeviceReset replaces, so a cache of "done" per
    // device would outlive it (kvt__cu_recycle does the same).
    if (pl->smem + KVT__AT_STATIC_SMEM > 48u * 1024u) {
        const cudaError_t e = KVT_SET_MAX_DYN_SHARED(kvt__attn_split_kernel,
                                                       pl->smem_max - KVT__AT_STATIC_SMEM);
        if (e != cudaSuccess) {
            (void)cudaGetLastError(); // reported by the caller, not by the next launch
            return e;
        }
    }
    return KVT_LAUNCH(kvt__attn_split_kernel, pl->grid, KVT__AT_THREADS, pl->smem, stream, pl->k);
}

template <int DT> cudaError_t kvt__at_launch_dt(const kvt__attn_plan *pl, void *stream)
{
    return pl->aligned ? kvt__at_launch_split<DT, true>(pl, stream)
                       : kvt__at_launch_split<DT, false>(pl, stream);
}

} // namespace

extern "C" {

KVT__HIDDEN size_t kvt__cu_attn_workspace_bytes(const kvt__cu_attn_args *a)
{
    kvt__attn_plan pl;
    if (kvt__attn_plan_make(a, &pl, false))
        return 0;
    return (size_t)pl.ws_bytes;
}

KVT__HIDDEN uint32_t kvt__cu_attn_split_pages(const kvt__cu_attn_args *a)
{
    kvt__attn_plan pl;
    if (a->n_items == 0 || kvt__attn_plan_make(a, &pl, false))
        return 0;
    return pl.k.sp;
}

KVT__HIDDEN int kvt__cu_attn(const kvt__cu_attn_args *a, void *stream)
{
    kvt__attn_plan pl;
    int rc = kvt__attn_plan_make(a, &pl, true);
    if (rc || a->n_items == 0)
        return rc;
    if (pl.ws_bytes && a->d_work == nullptr)
        return kvt__err(KVT_EINVAL, "a->d_work: must not be NULL (%u splits of %u pages need "
                        "%llu bytes of workspace, see kvt__cu_attn_workspace_bytes)",
                        pl.k.nsplit, pl.k.sp, (unsigned long long)pl.ws_bytes);
    if (pl.ws_bytes && (uintptr_t)a->d_work % 4u)
        return kvt__err(KVT_EINVAL, "a->d_work: %p is not 4-byte aligned", a->d_work);
    kvt__attn_kp *k = &pl.k;
    k->items = a->d_items;
    k->q = a->d_q;
    k->out = a->d_out;
    k->lse = a->d_lse;
    k->blocks = a->d_blocks;
    k->ntok = a->d_ntok;
    k->base = a->d_dev_base;
    k->block_bytes = a->block_bytes;
    k->scale = a->scale;
    if (pl.ws_bytes) {
        const size_t n = (size_t)pl.grid * a->G;
        k->ws_acc = static_cast<float *>(a->d_work);
        k->ws_m = k->ws_acc + n * a->D;
        k->ws_l = k->ws_m + n;
    }
    cudaError_t e;
    switch (a->dtype) {
    case KVT_DTYPE_F16:
        e = kvt__at_launch_dt<KVT__DT_F16>(&pl, stream);
        break;
    case KVT_DTYPE_BF16:
        e = kvt__at_launch_dt<KVT__DT_BF16>(&pl, stream);
        break;
    default:
        e = kvt__at_launch_dt<KVT__DT_F32>(&pl, stream);
        break;
    }
    if (e == cudaSuccess && k->nsplit > 1u)
        e = KVT_LAUNCH(kvt__attn_merge, pl.grid / k->nsplit * a->G, KVT__AT_MERGE_THREADS, 0,
                       stream, pl.k);
    return KVT_CU_LAUNCHED(e, "kvt__cu_attn");
}

} // extern "C"
