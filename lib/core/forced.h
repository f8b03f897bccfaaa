/* The forced-page rule, written once for the library (C) and the CUDA
 * kernels (cuda/, through kvt_cuda_rt.cuh): of a (layer, KV head) with np
 * pages holding `tokens` tokens (page_tokens P), every selection holds the
 * first `sink` pages, a partially filled last page, and the `local` full
 * pages before it (the last `local` pages when the last page is full),
 * whatever their scores: the partial page never uses up local_pages.
 * Internal. */
#ifndef KVTIER_FORCED_H
#define KVTIER_FORCED_H

#include <stdbool.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define KVT__RULE static __host__ __device__ __forceinline__
#else
#define KVT__RULE static inline
#endif

/* The pages that compete for the top-K places: [*lo, *hi) (empty when
 * *lo >= *hi: every page is forced). Pages below *lo and from *hi on are
 * forced. */
KVT__RULE void kvt__forced_span(uint32_t np, uint32_t tokens, uint32_t P, uint32_t sink,
                                uint32_t local, uint32_t *lo, uint32_t *hi)
{
    const uint32_t ns = sink < np ? sink : np;
    const uint64_t want = (uint64_t)local + (np != 0 && tokens % P != 0); /* + the partial page */
    const uint32_t nl = want < np ? (uint32_t)want : np;
    *lo = ns;
    *hi = np - nl;
}

/* Whether page pg is forced (the same rule, one page). */
KVT__RULE bool kvt__forced(uint32_t pg, uint32_t np, uint32_t tokens, uint32_t P, uint32_t sink,
                           uint32_t local)
{
    uint32_t lo, hi;
    kvt__forced_span(np, tokens, P, sink, local, &lo, &hi);
    return pg < lo || pg >= hi;
}

#endif /* KVTIER_FORCED_H */
