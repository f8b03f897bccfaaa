/* The CUDA backend's kernels, as C-callable launchers (internal: kvt__cu_*,
 * hidden; the library and tests/gpu call them).
 *
 * Every launcher:
 *  - takes the engine's stream (`void *` = cudaStream_t; NULL = the legacy
 *    default stream, which the library itself never passes),
 *  - only enqueues work: no device or stream synchronisation, no allocation
 *    (scratch comes from the caller, sized by the *_workspace_bytes helpers),
 *  - returns 0, or a KVT_E* code with kvt_last_error() naming the argument
 *    or the CUDA error (KVT_EINVAL for bad arguments, KVT_EIO for a failed
 *    launch).
 * Pointers named d_* are device memory (or pinned host memory mapped into
 * the device's address space: UVA); item arrays live in device-visible
 * memory too. Data layouts are the CPU backend's, byte for byte:
 *  - a block holds page_tokens K rows then page_tokens V rows, each row
 *    head_dim elements of the pool dtype (block_bytes = 2 * P * D * elem);
 *  - a page's metadata is three rows of head_dim elements of the pool dtype
 *    (row = D * elem bytes): min (rounded toward -inf), max (toward +inf),
 *    mean (to nearest). The metadata store of n = meta_slots slots
 *    (n * meta_bytes bytes, meta_bytes = 3 * row) is two planes, as
 *    lib/core/store.h's kvt__meta_mm / kvt__meta_mean: plane 1 at d_meta_base
 *    holds [n][min row, max row] (slot s's min row at d_meta_base + s * 2 *
 *    row, its max row right after), plane 2 at d_meta_base + n * 2 * row
 *    holds [n][mean row] (slot s's at + s * row). A MINMAX scorer reads only
 *    plane 1, a MEAN scorer only plane 2. Slot 0 is the null slot (zero
 *    in both planes);
 *  - the f32 accumulators of a (sequence, layer, head)'s open page are
 *    [3][D] = running min, max and sum of the keys appended to it.
 * The CPU backend (lib/) is the reference every kernel is tested against
 * (tests/gpu). The same sources build with nvcc for the GPU and with the host
 * C++ compiler against cuda/emu (KVT_CUDA_EMU), a CPU emulation of the
 * execution model used to test the kernels' logic where no GPU is present.
 */
#ifndef KVTIER_CUDA_H
#define KVTIER_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvtier/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifndef KVT__HIDDEN
#define KVT__HIDDEN __attribute__((visibility("hidden")))
#endif

/* ---- runtime glue (cuda/runtime.cu) ----------------------------------------
 * Number of usable devices (0 when none or no driver); on failure *why gets
 * the CUDA error's name and text (static storage). */
KVT__HIDDEN int kvt__cu_device_count(const char **why);
/* Device memory / pinned mapped host memory / copies, for tests and the
 * backend; each returns 0 or KVT_ENOMEM/KVT_EIO with the CUDA error. */
KVT__HIDDEN int kvt__cu_malloc(void **d_out, size_t bytes);
KVT__HIDDEN void kvt__cu_free(void *d);
KVT__HIDDEN int kvt__cu_host_alloc(void **h_out, size_t bytes); /* pinned, mapped */
KVT__HIDDEN void kvt__cu_host_free(void *h);
/* Test helpers (the library does not call them): they start and finish
 * with a device synchronisation, so they are ordered after all earlier
 * work on every stream. Each counts in kvt__cu_device_syncs. */
KVT__HIDDEN int kvt__cu_memcpy(void *dst, const void *src, size_t bytes);
KVT__HIDDEN int kvt__cu_memset(void *d, int value, size_t bytes);
/* Device synchronisations so far: every cudaDeviceSynchronize under the
 * emulation, the helpers' above on a GPU (tests check that a pool's calls
 * make none). */
KVT__HIDDEN uint64_t kvt__cu_device_sync_count(void);
/* The library's blocking copy and set: queued on `stream` (ordered after
 * its earlier work only; the caller waits for other streams first) and
 * waited for, without synchronising the device. */
KVT__HIDDEN int kvt__cu_copy_sync(void *dst, const void *src, size_t bytes, void *stream);
KVT__HIDDEN int kvt__cu_memset_sync(void *d, int value, size_t bytes, void *stream);
/* Pins and maps existing host memory (a pool's host arena) so kernels
 * read it through UVA; unregister before it is freed. */
KVT__HIDDEN int kvt__cu_host_register(void *h, size_t bytes);
KVT__HIDDEN void kvt__cu_host_unregister(void *h);
/* The device pointer of pinned mapped host memory (UVA: the same address). */
KVT__HIDDEN void *kvt__cu_host_device_ptr(void *h);
/* 1 when kernels on `device` may use the host address of registered
 * (cudaHostRegister) memory as is (unified addressing and
 * cudaDevAttrCanUseHostPointerForRegisteredMem), else 0. */
KVT__HIDDEN int kvt__cu_host_ptr_direct(int device);
KVT__HIDDEN int kvt__cu_stream_create(void **stream, int low_priority);
KVT__HIDDEN void kvt__cu_stream_destroy(void *stream);
KVT__HIDDEN int kvt__cu_stream_sync(void *stream);
/* Events: the mover records one per batch; a sequence waits on its event. */
KVT__HIDDEN int kvt__cu_event_create(void **event);
KVT__HIDDEN void kvt__cu_event_destroy(void *event);
KVT__HIDDEN int kvt__cu_event_record(void *event, void *stream);
KVT__HIDDEN int kvt__cu_stream_wait_event(void *stream, void *event);
/* 1 done, 0 pending, <0 error. */
KVT__HIDDEN int kvt__cu_event_query(void *event);
/* Waits for the event (the host thread, not the device). */
KVT__HIDDEN int kvt__cu_event_sync(void *event);
/* Makes `device` current for the calling thread. */
KVT__HIDDEN int kvt__cu_set_device(int device);

/* ---- append + metadata (cuda/append.cu) ------------------------------------
 * One item per (sequence, KV head) of one layer: n_tokens consecutive
 * tokens starting at position first_pos. Token t's K and V rows start at
 * element src_off + t * src_stride of d_k / d_v (source dtype). Page
 * pos / P of the item lives in device block d_dev_table[table_off + page]
 * with metadata slot d_meta_table[table_off + page]. The kernel writes the
 * rows (converted to the pool dtype, round to nearest even), updates the
 * accumulators d_acc[acc_off .. acc_off + 3D) in token order (reset when a
 * token opens a page; a NaN key widens its dimension to [-inf, +inf]) and
 * stores the page's metadata after the last token and whenever a page
 * fills, exactly as lib/core/append.c. Items must name distinct
 * accumulators. D is a multiple of 8 in 8..1024 and P a power of two in
 * 8..256 (the geometry's limits); items with n_tokens == 0 do nothing.
 * Bit-identical to the CPU backend, with one exception C leaves open: the
 * payload and sign of a NaN made by arithmetic (a NaN key's page mean; a NaN
 * converted between dtypes, where the CPU's F16C path keeps payload bits
 * that the portable path drops) - NaN stays NaN, only its bits may differ.
 * The pages an append touches are independent (the accumulators restart
 * when a token opens a page), so with max_tokens > 1 they are spread over
 * the grid: prefill chunks do not run one page after another. */
typedef struct kvt__cu_append_item {
    uint64_t src_off;
    uint64_t src_stride;
    uint64_t table_off;
    uint64_t acc_off;
    uint32_t first_pos;
    uint32_t n_tokens;
} kvt__cu_append_item;

typedef struct kvt__cu_append_args {
    const kvt__cu_append_item *d_items;
    uint32_t n_items;
    uint32_t D, P;
    kvt_dtype dtype;      /* pool dtype: F16, BF16 or F32 */
    kvt_dtype src_dtype;  /* F16, BF16 or F32 */
    const void *d_k, *d_v;
    const uint32_t *d_dev_table, *d_meta_table;
    uint8_t *d_dev_base;  /* device arena (block 0 = null block) */
    uint64_t block_bytes;
    uint8_t *d_meta_base; /* metadata store (two planes, above) */
    uint64_t meta_bytes;  /* one slot's three rows in total: exactly 3 * D * elem */
    uint32_t meta_slots;  /* slots in the store (n above; sets plane 2's offset), > 0 */
    float *d_acc;
    uint32_t max_tokens;  /* hint: >= most items' n_tokens; sizes the grid
                             (0 or 1 = one thread block per item, right for
                             decode; any value stays correct) */
} kvt__cu_append_args;
KVT__HIDDEN int kvt__cu_append(const kvt__cu_append_args *a, void *stream);

/* ---- page scoring (cuda/select.cu) -----------------------------------------
 * One item per (sequence, KV head): its G query rows [G][D] f32 at
 * d_q[q_off], its n_pages metadata slots at d_meta_table[table_off ...].
 * Raw score of page i for query g: MINMAX sum_d max(q*kmin, q*kmax)
 * (= qa.kmax + qb.kmin with qa = max(q,0), qb = min(q,0)); MEAN q.kmean.
 * The group's vote (SUM, MAX, SOFTVOTE with vote_scale; NaN rules of
 * lib/select/selector.c) goes to d_vote[vote_off + i]. G is 1..256, D a
 * multiple of 8 in 8..1024; d_meta_base is 16-byte aligned, meta_bytes is
 * exactly 3 * D * elem and meta_slots > 0 (the store's two planes, above:
 * every row then starts 16-byte aligned, D * elem being a multiple of 16,
 * and rows are read 16 bytes at a time). MINMAX reads plane 1 only, MEAN
 * plane 2 only. Non-finite votes (+inf for a NaN or
 * +inf score, -inf) are the CPU's exactly; finite ones differ from it only
 * by f32 summation order (tests/gpu: 1e-5 of the magnitude sum). SUM and
 * MAX spread an item's pages over blockIdx.y (max_pages only sizes that
 * grid: any value is correct, a low one is slower); SOFTVOTE takes one
 * block per item (per-head maximum and sum over all its pages) and reads
 * the metadata twice.
 *
 * The key-reading methods (kvt__cu_score_ex with a kvt__cu_score_keys):
 *  TOKEN   raw score of page i = max over its stored tokens t of q . k_t
 *          (k_t the K row of the page's device block, pool dtype widened to
 *          f32, f32 accumulation); page i of an item holds
 *          min(P, tokens - i P) tokens (none, raw -inf, when tokens <= i P).
 *  ORACLE  raw score = (1/c) ln sum_t exp(c q . k_t), c = vote_scale (> 0),
 *          computed as m + ln(sum_t exp(c (q . k_t - m))) / c with m the
 *          largest q . k_t; the vote is SOFTVOTE whatever a->vote says.
 * A page whose entry d_dev_table[table_off + i] is 0 (no device copy: the
 * host tables name a device block only once its bytes are there, so a page
 * only on host or disk, or still on its way to the device, has none) is
 * scored from its metadata instead: its MINMAX bound, plus ln(ntok) / c for
 * ORACLE - never below the exact value. A non-finite q . k_t (a NaN or
 * infinite key, or an overflow) makes the page's raw score NaN (vote +inf,
 * as the CPU's KVT__RES_NONFINITE pages), and a query row with a non-finite
 * element scores NaN on every page (the CPU's rule). Only K rows are read.
 * Lanes split a page's tokens (8 lanes a page, each its tokens t = lane,
 * lane + 8, ... in registers against the staged query rows); the lanes'
 * (max, sum of exp) meet by shuffles. SOFTVOTE keeps the raw scores of the
 * first pass in d_work when given (kvt__cu_score_workspace_bytes(a)
 * bytes; items with n_pages > max_pages, or d_work NULL: the second pass
 * reads the keys again). Finite votes: within the f32 rounding of the dot
 * products (tests/gpu compare with a double reference). */
typedef struct kvt__cu_score_item {
    uint64_t q_off;
    uint64_t table_off;  /* into d_meta_table and (TOKEN, ORACLE) d_dev_table */
    uint64_t vote_off;
    uint32_t n_pages;
    uint32_t tokens;     /* TOKEN, ORACLE: tokens stored in the item's pages
                            (n_pages = ceil(tokens / P)); unused otherwise */
} kvt__cu_score_item;

typedef struct kvt__cu_score_args {
    const kvt__cu_score_item *d_items;
    uint32_t n_items;
    uint32_t G, D;
    kvt_dtype dtype;
    uint32_t method;   /* KVT_SCORE_* */
    uint32_t vote;     /* KVT_VOTE_* (ORACLE: always SOFTVOTE) */
    float vote_scale;
    uint32_t max_pages; /* >= every item's n_pages (sizes the grid and the
                           workspace; a hint) */
    const float *d_q;
    const uint32_t *d_meta_table;
    const uint8_t *d_meta_base; /* metadata store (two planes, above) */
    uint64_t meta_bytes;        /* one slot's three rows in total: 3 * D * elem */
    uint32_t meta_slots;        /* slots in the store (sets plane 2's offset), > 0 */
    float *d_vote;
} kvt__cu_score_args;

/* The key-reading methods' inputs (a struct of its own, so the positional
 * initialisers of kvt__cu_score_args stay complete). */
typedef struct kvt__cu_score_keys {
    const uint32_t *d_dev_table; /* device block of each page, at the item's
                                    table_off (the layout of d_meta_table: a
                                    pool's table heap holds both at one
                                    offset); 0 = no device copy */
    const uint8_t *d_dev_base;   /* device arena, 16-byte aligned; block b at
                                    d_dev_base + b * block_bytes holds K[P][D]
                                    then V[P][D] in the pool dtype */
    uint64_t block_bytes;        /* a multiple of 16, >= 2 * P * D * elem */
    uint32_t P;                  /* page_tokens: a power of two in 8..256 */
    uint32_t reserved;           /* must be zero */
    float *d_work;               /* SOFTVOTE scratch, or NULL (see above) */
} kvt__cu_score_keys;

KVT__HIDDEN int kvt__cu_score(const kvt__cu_score_args *a, void *stream);
/* k: NULL for MINMAX and MEAN (kvt__cu_score is kvt__cu_score_ex(a, NULL,
 * stream)); required by TOKEN and ORACLE. */
KVT__HIDDEN int kvt__cu_score_ex(const kvt__cu_score_args *a, const kvt__cu_score_keys *k,
                                 void *stream);
/* Scratch the scoring kernel may use: n_items * max_pages * G floats for
 * TOKEN and ORACLE with SOFTVOTE (the raw scores between the two passes),
 * else 0 (one query group per item reads each page's metadata once; the
 * many-query product of the warm-up goes to cuBLAS instead, kvt__cu_warm). */
KVT__HIDDEN size_t kvt__cu_score_workspace_bytes(const kvt__cu_score_args *a);

/* ---- per-head top-K (cuda/select.cu) ---------------------------------------
 * One item per (sequence, KV head), the rule of kvt__sel_pick: the first
 * min(sink, np) pages, the last min(local, np) and a partial last page
 * (tokens % P != 0) are forced; the top k of the other pages by (vote desc,
 * index asc), NaN counting as +infinity, join them. Writes the selection in
 * increasing page order to d_sel[sel_off ...] with its count in
 * d_n_sel[item], and the top-k part alone (increasing) to d_topk[sel_off
 * ...] with its count in d_n_topk[item]. Capacity at sel_off must be at
 * least min(np, k + sink + local + 1); nothing past the counts is written.
 * Exact (a radix select on the votes as ordered keys, -0 tying with +0),
 * for any page count: with max_pages <= 8192 an item's keys stay in shared
 * memory (32 KiB); otherwise (or for an item above max_pages) the votes are
 * re-read from global memory (L2) in each of the six passes - no limit. */
typedef struct kvt__cu_topk_item {
    uint64_t vote_off;
    uint64_t sel_off;
    uint32_t n_pages, tokens, k, sink, local;
    uint32_t reserved;
} kvt__cu_topk_item;

typedef struct kvt__cu_topk_args {
    const kvt__cu_topk_item *d_items;
    uint32_t n_items;
    uint32_t P;
    uint32_t max_pages; /* sizes the shared-memory key cache (any value is correct) */
    const float *d_vote;
    uint32_t *d_sel, *d_n_sel;
    uint32_t *d_topk, *d_n_topk; /* d_topk may be NULL (then d_n_topk too) */
} kvt__cu_topk_args;
KVT__HIDDEN int kvt__cu_topk(const kvt__cu_topk_args *a, void *stream);

/* ---- sparse flash-decode (cuda/decode.cu) ----------------------------------
 * One item per (sequence, KV head): its G query rows (f32, [G][D] at
 * d_q[q_off]) attend over n_pages device blocks d_blocks[pages_off ...]
 * holding d_ntok[pages_off ...] valid tokens each (1..P). Writes the
 * normalised output rows [G][D] to d_out[out_off] and, when d_lse is not
 * NULL, the natural log of each row's softmax denominator of scale * q.k
 * to d_lse[lse_off + g]. n_pages == 0: zeros and -infinity. The pages of an
 * item are split over thread blocks of split_pages pages each (0 = chosen
 * from n_items and the SM count); partial results merge by log-sum-exp. */
typedef struct kvt__cu_attn_item {
    uint64_t q_off;
    uint64_t out_off;
    uint64_t lse_off;
    uint64_t pages_off;
    uint32_t n_pages;
    uint32_t cut;      /* a causal query (a step of several tokens): its last
                          page holds at most `cut` tokens it sees; 0 = all */
} kvt__cu_attn_item;

typedef struct kvt__cu_attn_args {
    const kvt__cu_attn_item *d_items;
    uint32_t n_items;
    uint32_t G, D, P;
    kvt_dtype dtype;
    float scale;
    uint32_t max_pages;   /* >= every item's n_pages (sizes the split grid) */
    uint32_t split_pages; /* 0 = auto */
    const float *d_q;
    float *d_out, *d_lse;
    const uint32_t *d_blocks, *d_ntok;
    const uint8_t *d_dev_base;
    uint64_t block_bytes;
    void *d_work;         /* kvt__cu_attn_workspace_bytes(a) bytes */
} kvt__cu_attn_args;
KVT__HIDDEN size_t kvt__cu_attn_workspace_bytes(const kvt__cu_attn_args *a);
/* The pages per split the launch of *a uses (a->split_pages, or the one
 * chosen for it); 0 when *a is invalid or has no items. A launch over a
 * subset of a's items with this split_pages needs no more workspace than
 * *a, and splits each item's pages the same way. */
KVT__HIDDEN uint32_t kvt__cu_attn_split_pages(const kvt__cu_attn_args *a);
KVT__HIDDEN int kvt__cu_attn(const kvt__cu_attn_args *a, void *stream);

/* ---- copies and table sync (cuda/copy.cu) ----------------------------------
 * A copy of `bytes` from src to dst, either of which may be device memory
 * or pinned mapped host memory (UVA). */
typedef struct kvt__cu_copy {
    uint64_t src, dst, bytes;
} kvt__cu_copy;
/* Zero-copy kernel: d_list (device-visible) holds n copies; each is split
 * into chunk_bytes pieces (0 = 256 KiB), the grid is capped at max_blocks
 * (0 = 2 per SM) so it leaves the SMs to concurrent decode kernels. 16-byte
 * aligned addresses and sizes go 16 bytes per thread; otherwise the widest
 * of 8 / 4 bytes at which src and dst agree, with byte-wise ends (else
 * byte-wise). chunk_bytes must be a multiple of 16; the copies must not
 * overlap one another's destinations. */
KVT__HIDDEN int kvt__cu_copy_kernel(const kvt__cu_copy *d_list, uint32_t n, uint32_t max_blocks,
                                    uint64_t chunk_bytes, void *stream);
/* The same copies as cudaMemcpyAsync calls (h_list on the host). */
KVT__HIDDEN int kvt__cu_copy_memcpy(const kvt__cu_copy *h_list, uint32_t n, void *stream);
/* Up to this size per transfer the mover copies with the kernel, above it
 * with cudaMemcpyAsync (the default of kvt__cuda_copy_kernel_max; a guess
 * until kvtier-bench --backend cuda copy has measured the crossover on a
 * GPU). */
#define KVT__CU_COPY_KERNEL_MAX (1u << 20)
/* Bytes of raw scores one call of the warm-up's GPU scoring may hold (the
 * observation queries are split into calls below this). */
#define KVT__CU_WARM_BUDGET ((size_t)64 << 20)

/* Dirty-range table sync: for each range, n entries of the pinned host
 * table (read through UVA) from h_table[src_off] to d_table[dst_off]. */
typedef struct kvt__cu_range {
    uint64_t src_off, dst_off;
    uint32_t n;
    uint32_t reserved;
} kvt__cu_range;
KVT__HIDDEN int kvt__cu_table_sync(const uint32_t *h_table, uint32_t *d_table,
                                   const kvt__cu_range *d_ranges, uint32_t n_ranges,
                                   void *stream);

/* ---- fused recycle (cuda/recycle.cu) ---------------------------------------
 * One item per (sequence, stable KV head) that reranked: the three-in-one
 * kernel of FlexiCache. Inputs: the head's new selection (sorted, from
 * kvt__cu_topk) and, per page, its device block (0 = not on device), its
 * host block (0 = none) and residency bits (KVT_RES_* | busy 0x80 |
 * inbound 0x40), its importance (the last score) and the forced rule.
 * One pass, in shared memory:
 *  - promoted: selected pages with no device block and no busy/inbound bit
 *    (the host settles busy pages before the kernel runs);
 *  - evictable: unselected, unforced pages on device, not busy, with a
 *    host or disk copy; "stuck" = unselected, unforced, on device, but
 *    busy or with no other copy;
 *  - lookahead: room = max(0, k * window - (selected unforced pages +
 *    stuck)); the `room` evictable pages of highest importance (ties: lower
 *    page first) stay; the others are evicted, in (importance desc, page
 *    asc) order;
 *  - the x-th promoted page (in page order) takes the x-th evicted page's
 *    block (recycled in place: the evicted entry becomes 0 and loses
 *    KVT_RES_DEVICE) or, past the evicted ones, the next block of the
 *    item's free list d_free[free_off ...] (n_free entries; more needed =
 *    the item fails with d_status[item] = 1 and changes nothing); the
 *    promoted entry gets its block and busy | inbound, as on the CPU
 *    backend: the host sets KVT_RES_DEVICE and clears both bits when the
 *    copy's event completes, so neither the decode nor another eviction
 *    takes the page before its bytes are there;
 *  - evicted pages beyond the promoted ones are dropped (entry 0, bit
 *    cleared) and their blocks listed in d_freed for the host to return;
 *  - each promotion of a page with a host block appends a copy (host
 *    block -> device block, block_bytes) to d_copies[copy_off ...] for
 *    kvt__cu_copy_kernel; a page only on disk gets its block the same way
 *    and is listed (page index) in d_stage[copy_off ...] for the host to
 *    fetch through the staging path.
 * "On device", "host block", "only on disk" read the residency bits (the
 * tables must agree with them); a NaN importance ranks as +infinity, -0 as
 * +0.
 * Outputs per item: d_counts[4 * item + {0,1,2,3}] = promoted from host
 * (= entries of d_copies), evicted, freed, staged; d_status[item] = 0 ok,
 * 1 out of free blocks, 2 n_pages > max_pages (nothing changed, counts 0
 * for both). max_pages <= 16384 (shared memory: 8 * pow2ceil(max_pages) +
 * max_pages bytes a block, within the device's opt-in limit). */
typedef struct kvt__cu_recycle_item {
    uint64_t table_off;   /* into d_dev_table, d_host_table, d_res, d_imp */
    uint64_t sel_off;     /* selection in d_sel, count in d_n_sel[item] */
    uint64_t free_off;    /* into d_free; n_free entries */
    uint64_t copy_off;    /* into d_copies / d_freed / d_stage (each sized
                             for n_pages entries) */
    uint32_t n_pages, tokens, k, window, sink, local, n_free;
    uint32_t reserved;
} kvt__cu_recycle_item;

typedef struct kvt__cu_recycle_args {
    const kvt__cu_recycle_item *d_items;
    uint32_t n_items;
    uint32_t P;
    uint32_t max_pages;
    uint32_t *d_dev_table;          /* updated in place */
    const uint32_t *d_host_table;
    uint8_t *d_res;                 /* updated in place */
    const float *d_imp;
    const uint32_t *d_sel, *d_n_sel;
    const uint32_t *d_free;
    const uint8_t *d_dev_base;      /* copy destinations */
    const uint8_t *h_host_base;     /* the pinned host arena as the device
                                       addresses it: kvt__cu_host_device_ptr
                                       of a registered range (the host
                                       address itself only where
                                       kvt__cu_host_ptr_direct) */
    uint64_t block_bytes;
    kvt__cu_copy *d_copies;
    uint32_t *d_freed;
    uint32_t *d_stage;              /* pages to fetch from disk */
    uint32_t *d_counts;
    uint32_t *d_status;
} kvt__cu_recycle_args;
KVT__HIDDEN int kvt__cu_recycle(const kvt__cu_recycle_args *a, void *stream);

/* ---- finishing a step's selection on the device (cuda/selfinish.cu) -------
 * One item per (sequence, KV head) of a layer, after kvt__cu_topk ran for
 * the reranked items. Per item, by mode:
 *  KVT__CU_SF_RERANK: the selection is already at d_sel[sel_off ...] (count
 *    d_n_sel[item]) and its top-k part at d_topk[sel_off ...] (count
 *    d_n_topk[item]); the top-k part is saved: copied to
 *    d_saved[saved_off ...] with its count in d_n_saved[saved_idx];
 *  KVT__CU_SF_REUSE: the selection is rebuilt by the rule of kvt__sel_pick
 *    with reused top-k pages: the forced pages (first min(sink, np), last
 *    min(local, np), and page np - 1 when tokens % P != 0) united with the
 *    saved pages d_saved[saved_off ... + d_n_saved[saved_idx]) that are
 *    < np, in increasing order, written to d_sel[sel_off ...] with the count
 *    in d_n_sel[item] (saved entries are increasing and distinct);
 *  KVT__CU_SF_ALL: every page 0 .. np - 1 (dense).
 * Then, in every mode, the selection's pages are mapped to device blocks:
 * d_blocks[sel_off + j] = d_dev_table[table_off + page_j] and
 * d_ntok[sel_off + j] = min(P, tokens - page_j * P), and
 * d_attn[item].n_pages = the selection's count (the other fields of the
 * attention item are the caller's), so kvt__cu_attn can run next without
 * the host seeing the selection. Capacity at sel_off: >= np.
 * Nothing past the counts is written. kvt__cu_topk indexes d_n_sel and
 * d_n_topk by its own item number: the RERANK items must have the same
 * numbers in both launches (e.g. run kvt__cu_topk over this item list with
 * n_pages 0 for the other modes, or put the RERANK items first). Items must
 * name distinct sel_off regions, and a RERANK item's saved region (and
 * saved_idx) must be no other item's in the same launch.
 * Item errors: an item with an unknown mode, n_pages != ceil(tokens / P),
 * d_n_sel > np or d_n_topk > d_n_sel (RERANK), a top-k part longer than
 * saved_cap (RERANK) or d_n_saved > saved_cap (REUSE), a list out of order
 * (d_sel / d_topk entries not increasing or >= np; saved entries not
 * increasing), or a mode whose arrays were passed as NULL (RERANK needs
 * d_topk and d_saved, REUSE d_saved) writes d_n_sel[item] = UINT32_MAX and
 * d_attn[item].n_pages = 0 and nothing else (every check precedes the first
 * write); the host checks d_n_sel. A block per item, no shared-memory
 * bitmap: the saved entries that join are a contiguous run of the sorted
 * list, found by counting, so any page count works (max_pages is unused).
 * Launcher errors (KVT_EINVAL naming the field): P outside 1..1024,
 * n_items above 2^31 - 1, a NULL array other than d_topk / d_n_topk and
 * d_saved / d_n_saved (each pair NULL together or neither); n_items == 0
 * does nothing. */
#define KVT__CU_SF_RERANK 0u
#define KVT__CU_SF_REUSE  1u
#define KVT__CU_SF_ALL    2u
typedef struct kvt__cu_sf_item {
    uint64_t sel_off;     /* into d_sel, d_topk, d_blocks, d_ntok */
    uint64_t saved_off;   /* into d_saved */
    uint64_t table_off;   /* into d_dev_table */
    uint32_t saved_idx;   /* into d_n_saved */
    uint32_t mode;        /* KVT__CU_SF_* */
    uint32_t n_pages, tokens, sink, local;
} kvt__cu_sf_item;

typedef struct kvt__cu_sf_args {
    const kvt__cu_sf_item *d_items;
    uint32_t n_items;
    uint32_t P;
    uint32_t max_pages;         /* >= every item's n_pages (sizing hint) */
    uint32_t saved_cap;         /* entries at each saved_off; a top-k part
                                   longer than this is an error: the item's
                                   d_n_sel is set to UINT32_MAX (the host
                                   checks) - see "Item errors" above */
    uint32_t *d_sel, *d_n_sel;
    const uint32_t *d_topk, *d_n_topk;
    uint32_t *d_saved, *d_n_saved;
    const uint32_t *d_dev_table;
    uint32_t *d_blocks, *d_ntok;
    kvt__cu_attn_item *d_attn;  /* n_pages written per item */
} kvt__cu_sf_args;
KVT__HIDDEN int kvt__cu_sel_finish(const kvt__cu_sf_args *a, void *stream);

/* ---- warm-up importance (cuda/warm.cu) --------------------------------------
 * For each of n_heads heads of one layer: d_imp[h * n_pages + j] += the sum
 * over queries o = 0 .. n_obs - 1 (in that order) of the vote page j gets
 * for query o, as kvt__sel_score computes it on the CPU (method MINMAX or
 * MEAN; vote SUM, MAX or SOFTVOTE with vote_scale; a NaN vote counts
 * +inf). d_q holds the prepared query rows [n_heads][n_obs * G][W]: for
 * MINMAX W = 2D, row = [qa | qb] (qa = q > 0 ? q : 0, qb = q < 0 ? q : 0);
 * for MEAN W = D, row = q. Page j's metadata slot is d_slots[h * n_pages +
 * j], in the two-plane store above (meta_bytes exactly 3 * D * elem,
 * meta_slots > 0; MINMAX gathers from plane 1 only, MEAN from plane 2
 * only). The raw scores are one strided batched SGEMM over the heads: cuBLAS's
 * when `blas` is a handle from kvt__cu_blas_create (on the same stream),
 * else a tiled kernel. Results equal the CPU's up to the summation order
 * of each dot product (exact when every product and partial sum is). The
 * work area holds the landmarks, the scores and the SOFTVOTE statistics:
 * kvt__cu_warm_workspace_bytes(a), which grows with n_heads * n_obs * G *
 * n_pages (the caller splits the queries into calls to bound it). */
typedef struct kvt__cu_warm_args {
    uint32_t n_heads, n_pages, n_obs, G, D;
    kvt_dtype dtype;
    uint32_t method, vote; /* KVT_SCORE_*, KVT_VOTE_* */
    float vote_scale;
    const uint32_t *d_slots;
    const uint8_t *d_meta_base; /* metadata store (two planes, above) */
    uint64_t meta_bytes;        /* one slot's three rows in total: 3 * D * elem */
    uint32_t meta_slots;        /* slots in the store (sets plane 2's offset), > 0 */
    const float *d_q;
    float *d_imp;
    void *d_work;
    void *blas;
} kvt__cu_warm_args;
KVT__HIDDEN size_t kvt__cu_warm_workspace_bytes(const kvt__cu_warm_args *a);
KVT__HIDDEN int kvt__cu_warm(const kvt__cu_warm_args *a, void *stream);
/* cuBLAS is loaded at run time (dlopen libcublas.so.<major built against>,
 * then libcublas.so), once per process. A handle bound to `stream`; fails
 * with KVT_ENOTSUP naming why when the library cannot be loaded or
 * initialised (callers fall back to the kernel). */
KVT__HIDDEN int kvt__cu_blas_create(void **handle, void *stream);
KVT__HIDDEN void kvt__cu_blas_destroy(void *handle);
/* Tests: forbid (1) or allow (0) kvt__cu_blas_create, to run the fallback. */
KVT__HIDDEN void kvt__cu_blas_forbid(int forbid);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_CUDA_H */
