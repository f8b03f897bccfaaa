// Finishing a step's selection on the device: after kvt__cu_topk ran for the
// reranked heads, one launch saves their top-k part, rebuilds the selection
// of the heads that reuse a saved top-k part (the rule of kvt__sel_pick with
// vote == NULL) or take every page, and maps every selection to device
// blocks and valid token counts for kvt__cu_attn, so the host never sees it.
//
// One block per item. The REUSE merge needs no marks: the forced pages are
// the ranges [0, c0) and [c1, np) (c0 = min(sink, np), c1 = np - max(min(
// local, np), partial last page)), and since the saved list is increasing and
// distinct, its entries that are not forced and < np are the contiguous run
// saved[lo .. hi) with lo = #entries < c0, hi = #entries < c1. The selection
// is then [0, c0) ++ saved[lo .. hi) ++ [c1, np): entry j of it is a closed
// formula, so the block counts lo and hi (and checks the list's order) in one
// parallel pass and writes every entry in a second - no shared-memory bitmap,
// no prefix sum, no page-count limit.
//
// An item whose inputs break the contract (unknown mode, n_pages not
// ceil(tokens / P), a count above its capacity, a list out of order, an array
// its mode needs passed as NULL) writes only d_n_sel[item] = UINT32_MAX and
// d_attn[item].n_pages = 0, so a following kvt__cu_attn reads nothing for it;
// every check runs before the first write.
#include "kvt_cuda_rt.cuh"

namespace {

constexpr uint32_t KVT_SF_THREADS = 256;

// An increasing list of page indices: entry j breaks the order or the bound
// (bound = 0: no bound).
KVT_DEV bool kvt_sf_bad_entry(const uint32_t *list, uint32_t j, uint32_t bound)
{
    const uint32_t v = list[j];
    return (bound != 0 && v >= bound) || (j > 0 && list[j - 1] >= v);
}

KVT_KERNEL __launch_bounds__(KVT_SF_THREADS) kvt_sf_kernel(const kvt__cu_sf_args a)
{
    KVT_SHARED(uint32_t, sh, 4); // [0] a check failed, [1] lo, [2] hi
    const uint32_t item = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const kvt__cu_sf_item it = a.d_items[item];
    const uint32_t np = it.n_pages, P = a.P, mode = it.mode;
    if (tid == 0)
        sh[0] = sh[1] = sh[2] = 0;

    // Checks of the item's fields (the same in every thread).
    bool bad = mode > KVT__CU_SF_ALL || (uint64_t)np != ((uint64_t)it.tokens + P - 1u) / P;
    uint32_t c0, c1; // competitors [c0, c1); the rest is forced
    kvt__forced_span(np, it.tokens, P, it.sink, it.local, &c0, &c1);
    const bool all_forced = c0 >= c1;
    uint32_t n_sel = 0, n_topk = 0, n_saved = 0;
    const uint32_t *sel_in = a.d_sel + it.sel_off;
    const uint32_t *topk = nullptr, *saved_in = nullptr;
    if (!bad && mode == KVT__CU_SF_RERANK) {
        bad = !a.d_topk || !a.d_saved;
        if (!bad) {
            n_sel = a.d_n_sel[item];
            n_topk = a.d_n_topk[item];
            topk = a.d_topk + it.sel_off;
            bad = n_sel > np || n_topk > n_sel || n_topk > a.saved_cap;
        }
    } else if (!bad && mode == KVT__CU_SF_REUSE) {
        bad = !a.d_saved;
        if (!bad) {
            n_saved = a.d_n_saved[it.saved_idx];
            saved_in = a.d_saved + it.saved_off;
            bad = n_saved > a.saved_cap;
        }
    }
    KVT_SYNC(); // sh initialised; every thread has read d_n_sel[item]

    // Checks of the lists (and, for REUSE, lo and hi), one parallel pass.
    if (!bad && mode == KVT__CU_SF_RERANK) {
        uint32_t f = 0;
        for (uint32_t j = tid; j < n_sel; j += nt)
            f |= kvt_sf_bad_entry(sel_in, j, np) ? 1u : 0u;
        for (uint32_t j = tid; j < n_topk; j += nt)
            f |= kvt_sf_bad_entry(topk, j, np) ? 1u : 0u;
        if (f)
            atomicExch(&sh[0], 1u);
    } else if (!bad && mode == KVT__CU_SF_REUSE) {
        uint32_t f = 0, lo = 0, hi = 0;
        for (uint32_t j = tid; j < n_saved; j += nt) {
            const uint32_t v = saved_in[j];
            f |= kvt_sf_bad_entry(saved_in, j, 0) ? 1u : 0u;
            lo += v < c0 ? 1u : 0u;
            hi += v < c1 ? 1u : 0u;
        }
        if (f)
            atomicExch(&sh[0], 1u);
        if (lo)
            atomicAdd(&sh[1], lo);
        if (hi)
            atomicAdd(&sh[2], hi);
    }
    KVT_SYNC();
    if (bad || sh[0] != 0) {
        if (tid == 0) {
            a.d_n_sel[item] = UINT32_MAX;
            a.d_attn[item].n_pages = 0;
        }
        return;
    }

    // The selection: entry j is [0, c0) ++ saved[lo .. hi) ++ [c1, np) for
    // REUSE, j itself for ALL (and for REUSE when the forced pages cover
    // everything), d_sel's own entry for RERANK.
    uint32_t n, head, mid = 0, lo = 0;
    if (mode == KVT__CU_SF_RERANK) {
        n = n_sel;
        head = 0;
    } else if (mode == KVT__CU_SF_ALL || all_forced) {
        n = head = np;
    } else {
        lo = sh[1];
        mid = sh[2] - lo; // <= c1 - c0: distinct entries in [c0, c1)
        head = c0;
        n = c0 + mid + (np - c1);
    }
    uint32_t *sel = a.d_sel + it.sel_off;
    uint32_t *blocks = a.d_blocks + it.sel_off, *ntok = a.d_ntok + it.sel_off;
    const uint32_t *table = a.d_dev_table + it.table_off;
    for (uint32_t j = tid; j < n; j += nt) {
        uint32_t page;
        if (mode == KVT__CU_SF_RERANK) {
            page = sel_in[j];
        } else {
            page = j < head ? j : j < head + mid ? saved_in[lo + (j - head)] : c1 + (j - head - mid);
            sel[j] = page;
        }
        blocks[j] = table[page];
        ntok[j] = (uint32_t)kvt_umin64(P, (uint64_t)it.tokens - (uint64_t)page * P);
    }
    if (mode == KVT__CU_SF_RERANK) {
        uint32_t *saved = a.d_saved + it.saved_off;
        for (uint32_t j = tid; j < n_topk; j += nt)
            saved[j] = topk[j];
    }
    if (tid == 0) {
        if (mode == KVT__CU_SF_RERANK)
            a.d_n_saved[it.saved_idx] = n_topk;
        else
            a.d_n_sel[item] = n;
        a.d_attn[item].n_pages = n;
    }
}

} // namespace

extern "C" {

int kvt__cu_sel_finish(const kvt__cu_sf_args *a, void *stream)
{
    if (!a)
        return kvt__err(KVT_EINVAL, "a: must not be NULL");
    if (a->P < 1 || a->P > 1024)
        return kvt__err(KVT_EINVAL, "a->P: %u is outside 1..1024", a->P);
    if (a->n_items > 0x7fffffffu)
        return kvt__err(KVT_EINVAL, "a->n_items: %u is above 2^31 - 1", a->n_items);
    if (a->n_items == 0)
        return 0;
    KVT_CU_NEED(a, d_items);
    KVT_CU_NEED(a, d_sel);
    KVT_CU_NEED(a, d_n_sel);
    if (!a->d_topk != !a->d_n_topk)
        return kvt__err(KVT_EINVAL, "a->d_n_topk: %s while d_topk is %s",
                        a->d_n_topk ? "set" : "NULL", a->d_topk ? "set" : "NULL");
    if (!a->d_saved != !a->d_n_saved)
        return kvt__err(KVT_EINVAL, "a->d_n_saved: %s while d_saved is %s",
                        a->d_n_saved ? "set" : "NULL", a->d_saved ? "set" : "NULL");
    KVT_CU_NEED(a, d_dev_table);
    KVT_CU_NEED(a, d_blocks);
    KVT_CU_NEED(a, d_ntok);
    KVT_CU_NEED(a, d_attn);
    const cudaError_t e = KVT_LAUNCH(kvt_sf_kernel, dim3(a->n_items), dim3(KVT_SF_THREADS), 0,
                                     stream, *a);
    return KVT_CU_LAUNCHED(e, "kvt__cu_sel_finish");
}

} // extern "C"
