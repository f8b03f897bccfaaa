/* The CUDA backend's entry points as the other areas call them
 * (cuda_pool.c, cuda_step.c, cuda_copy.c with nvcc; cuda_none.c's stubs
 * otherwise). */
#ifndef KVTIER_BACKEND_HOOKS_H
#define KVTIER_BACKEND_HOOKS_H

#include "../core/store.h"

/* ---- backends ------------------------------------------------------------ */
/* CUDA backend (lib/backend/cuda_pool.c with nvcc, cuda_none.c otherwise):
 * the pool's device tier and metadata store in GPU memory, the per-layer
 * calls as the kernels of cuda/. Every hook but kvt__cuda_built runs only
 * for a pool whose cu is set. */
struct kvt_pool;
struct kvt_step;
struct kvt__seq;
KVT__HIDDEN bool kvt__cuda_built(void);
/* After the arenas' ids exist (bases unset): checks what the backend
 * serves, allocates device memory, sets the device and metadata bases. */
KVT__HIDDEN int kvt__cuda_pool_init(struct kvt_pool *p, const kvt_pool_opts *o);
KVT__HIDDEN void kvt__cuda_pool_fini(struct kvt_pool *p);
/* Prefill/append outside a step: the pages of [cur, cur + n) are allocated
 * in the host tables; uploads their entries, runs the append kernel on the
 * pool's stream and waits for it (k and v are the caller's). */
KVT__HIDDEN int kvt__cuda_seq_append(struct kvt_pool *p, struct kvt__seq *s, uint32_t layer,
                                     const void *k, const void *v, uint32_t n, uint32_t cur,
                                     kvt_dtype src_dtype, uint64_t token_stride);
/* kvt_pool_check's part: every placed GPU table copy equals the host table
 * for every page of every live sequence (waits). */
KVT__HIDDEN int kvt__cuda_check(const struct kvt_pool *p);
/* Copies n bytes of device memory to the host (waits). */
KVT__HIDDEN int kvt__cuda_read(const struct kvt_pool *p, void *dst, const void *dev_src, size_t n);
KVT__HIDDEN int kvt__cuda_step_plan(struct kvt_step *st, void *stream);
KVT__HIDDEN int kvt__cuda_step_append(struct kvt_step *st, uint32_t layer, const void *k,
                                      const void *v, kvt_dtype src_dtype, uint64_t seq_stride,
                                      const uint32_t *cur);
KVT__HIDDEN int kvt__cuda_step_select(struct kvt_step *st, uint32_t layer, const float *q);
/* run (NULL = every sequence, decoded): run[i] == 0 leaves sequence i
 * out of this call (its rows untouched), 1 decodes it, 2 empties it (its
 * output rows zeros, lse -infinity, and its items stay empty). One launch
 * per run of consecutive sequences in the call, all split alike. */
KVT__HIDDEN int kvt__cuda_step_decode(struct kvt_step *st, uint32_t layer, const float *q,
                                      float *out, float *lse, const uint8_t *run);
/* The selection of (sequence, head) ih of the current layer (waits). */
KVT__HIDDEN int kvt__cuda_step_selection(const struct kvt_step *st, size_t ih, uint32_t *pages,
                                         uint32_t capacity, uint32_t *n_pages);
KVT__HIDDEN int kvt__cuda_step_finish(struct kvt_step *st);
/* Pools with a host or disk tier (tiered CUDA pools): the selection of the
 * layer just launched comes back to the host (one event wait), with the
 * votes of reranked heads as the pages' importance. Returns the host copy
 * of the selection in *sel (indexed by st->sel_off, counts in
 * st->sel_cnt). */
KVT__HIDDEN int kvt__cuda_step_fetch(struct kvt_step *st, uint32_t layer, const uint32_t **sel);
/* Before the decode of the sequences with run[i] == 1 (run NULL: all),
 * once their promotions have landed: syncs the layer's changed table
 * entries to the GPU and uploads those sequences' block lists from the host
 * tables. *missing: their selected pages without a device copy (they read
 * as zeros; the decode reports them). */
KVT__HIDDEN int kvt__cuda_step_place(struct kvt_step *st, uint32_t layer, const uint8_t *run,
                                     uint32_t *missing);
/* The tier mover's side: each copy thread (and the I/O thread) has its own
 * low-priority stream; a batch touching the device tier carries an event
 * recorded on the host thread at submit time (after the kernels that wrote
 * or read its blocks), which the copies wait for on the GPU. */
/* A thread's copier: its stream and a pinned list of the copies of the
 * current round. */
KVT__HIDDEN int kvt__cuda_mv_stream(const struct kvt_pool *p, void **copier);
KVT__HIDDEN void kvt__cuda_mv_stream_free(void *copier);
KVT__HIDDEN int kvt__cuda_mv_mark(struct kvt_pool *p, void **event);
KVT__HIDDEN void kvt__cuda_mv_event_free(void *event);
/* Adds a copy of n bytes (either side device memory) to the copier's
 * round, after the event `after`; uva: the host side (if any) is pinned and
 * mapped, so the zero-copy kernel may serve it. A full list issues and
 * waits for the round first. */
KVT__HIDDEN int kvt__cuda_mv_copy(const struct kvt_pool *p, void *copier, void *after, void *dst,
                                  const void *src, size_t n, bool uva);
/* Issues the round (transfers up to kvt__cuda_copy_kernel_max bytes in one
 * launch of the zero-copy kernel, larger ones with cudaMemcpyAsync) and
 * waits for it, even after an error. */
KVT__HIDDEN int kvt__cuda_mv_sync(const struct kvt_pool *p, void *copier);
/* The mover's switch between the copy kernel and cudaMemcpyAsync (bytes;
 * default KVT__CU_COPY_KERNEL_MAX, 1 MiB; tests change it). */
KVT__HIDDEN extern size_t kvt__cuda_copy_kernel_max;
/* Test hook: each copier sleeps this long before issuing a round (0: not
 * at all), so promotions are still in flight when the decode comes. */
KVT__HIDDEN extern uint32_t kvt__cuda_mv_delay_us;
/* Test hook: the next this many copy rounds into the device tier (the
 * promotions) fail with KVT_EIO, copying nothing. */
KVT__HIDDEN extern uint32_t kvt__cuda_mv_fail_rounds;
/* Test hook: CUDA decodes that launched their ready sequences before
 * waiting for the others' promotions (lib/attn/step.c). */
KVT__HIDDEN extern uint64_t kvt__cuda_ready_first;
/* Pins host memory for the GPU in place (the I/O thread's staging);
 * unpin before it is unmapped. */
KVT__HIDDEN int kvt__cuda_host_pin(const struct kvt_pool *p, void *h, size_t bytes);
/* Test hook: kvt__cuda_host_pin fails (the staging stays pageable). */
KVT__HIDDEN extern bool kvt__cuda_pin_refuse;
KVT__HIDDEN void kvt__cuda_host_unpin(const struct kvt_pool *p, void *h);
/* kvt_seq_warmup's importance on the GPU: for every stable (layer, head)
 * lh and page j < pages of layer l, imp[lh * stride + j] = the sum over the
 * n_obs queries of the layer of the page's vote (the CPU's kvt__sel_score
 * summed in query order). Waits for earlier work and for the result;
 * scores with cuBLAS when libcublas loads, else with the fallback kernel. */
KVT__HIDDEN int kvt__cuda_warm_imp(struct kvt_pool *p, struct kvt__seq *s, const float *obs,
                                   uint32_t n_obs, float *imp, size_t stride);
/* The warm-up's first top-K sets (s->topk of the heads with topk_k set)
 * become the GPU's saved sets of the sequence, which the steps reuse. */
KVT__HIDDEN int kvt__cuda_warm_topk(struct kvt_pool *p, struct kvt__seq *s);
/* Bytes of raw scores per GPU scoring call of the warm-up (64 MiB; tests
 * lower it to split the queries into several calls). */
KVT__HIDDEN extern size_t kvt__cuda_warm_budget;

#endif /* KVTIER_BACKEND_HOOKS_H */
