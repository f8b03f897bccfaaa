/* The CUDA backend's pool state and the helpers its files share
 * (cuda_pool.c: the pool, its sequences' device state and prefill;
 * cuda_step.c: the per-layer calls; cuda_copy.c: the tier mover's copies
 * and the warm-up's scoring). Internal to lib/backend. */
#ifndef KVTIER_CUDA_INT_H
#define KVTIER_CUDA_INT_H

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/store.h"
#include "../step/step_int.h"
#include "../../cuda/kvt_cuda.h"
#include "backend.h"

/* An event recorded after the last GPU work that read a pinned buffer. */
typedef struct kvt__guard {
    void *ev;
    bool pending;
} kvt__guard;

struct kvt__cuda {
    int device;
    bool uva_direct;       /* kernels may use registered host addresses as is */
    void *stream;          /* the pool's own stream (prefill; steps without one) */
    void *done;            /* recorded when a step finishes */
    bool done_pending;
    void *sst;             /* the open step's stream */
    bool sync_calls;       /* the step named no stream: each call waits */
    uint8_t *selected;     /* [n_layers] selected in the open step */
    uint8_t *d_dev, *d_meta;
    uint32_t LH;
    /* The table heap: GPU copies of the sequences' tables. */
    uint32_t *d_tab, *d_mtab;
    uint64_t tab_cap, tab_used;
    /* Per sequence slot: open-page accumulators [LH][3][D] and saved top-K
     * sets [LH][kcap] with their counts [LH]. */
    float *d_acc;
    uint32_t acc_slots;
    uint32_t *d_saved, *d_nsaved;
    uint32_t saved_slots, kcap;
    /* Step scratch: pinned item arrays, one slice of cap_items per layer. */
    size_t cap_items;
    kvt__cu_append_item *h_app;
    kvt__cu_score_item *h_sc;
    kvt__cu_topk_item *h_tk;
    kvt__cu_sf_item *h_sf;
    kvt__cu_attn_item *h_at;
    /* ... and their device copies, uploaded on the step's stream before the
     * launches, so kernels read items from device memory, not over PCIe. */
    kvt__cu_append_item *d_app;
    kvt__cu_score_item *d_sc;
    kvt__cu_topk_item *d_tk;
    kvt__cu_sf_item *d_sf;
    kvt__cu_attn_item *d_at;
    uint32_t *h_sdev, *h_smeta; /* new table entries */
    kvt__cu_range *h_rg;
    size_t cap_pages;      /* entries of the device selection buffers */
    float *d_vote;
    uint32_t *d_sel, *d_topk, *d_blocks, *d_ntok, *d_nsel, *d_ntopk;
    size_t cap_work;
    void *d_work;
    uint32_t np_max;       /* the plan's page bound (sizes the decode split) */
    uint32_t at_sp;        /* the decode's pages per split for the plan's batch */
    /* Prefill items. */
    kvt__cu_append_item *h_papp;
    size_t cap_papp;
    /* Pools with a host or disk tier ("lower" tiers). */
    bool lower;
    bool host_reg;         /* the host arena is registered (pinned, mapped) */
    size_t cap_hp, cap_hi; /* pages / items of the buffers below */
    uint32_t *h_sel, *h_blk; /* the selection back on the host; the block list (first
                                the top-K parts back on the host) */
    uint32_t *h_nsel;      /* [2 * items]: selection counts, top-K part counts */
    float *h_vote;
    kvt__cu_copy *h_cl;    /* [3 * items + 2] copy lists */
    uint32_t *h_zero;      /* a pinned 0 (emptied decode items) */
    /* Dirty-range staging of the table flush. */
    uint32_t *h_fl;
    kvt__cu_range *h_flr;
    size_t cap_fl, cap_flr;
    /* Pinned buffers written again only once the work that read them is
     * done: the flush staging, and the copy lists with the block list. */
    kvt__guard g_fl, g_cl;
    /* kvt_seq_warmup: the cuBLAS handle (on the pool's stream; NULL when
     * libcublas did not load: the fallback kernel) and the scratch. */
    void *blas;
    bool blas_tried;
    uint32_t *h_wslot, *d_wslot;
    float *h_wq, *d_wq, *h_wimp, *d_wimp;
    size_t cap_wslot, cap_wq, cap_wimp; /* elements of the pinned arrays */
    size_t cap_wslot_d, cap_wq_d, cap_wimp_d, cap_wwork; /* bytes of the device ones */
    void *d_wwork;
};

/* Shared by the backend's files (cuda_pool.c). */
/* The slot index of s in the pool. */
KVT__HIDDEN uint32_t kvt__cup_slot(const kvt_pool *p, const kvt__seq *s);
KVT__HIDDEN void kvt__cup_pin_free(void **h);
KVT__HIDDEN void kvt__cup_dev_free(void **d);
/* Everything queued on the pool's and the step's streams has finished. */
KVT__HIDDEN int kvt__cup_quiesce(struct kvt__cuda *c);
/* Orders the pool's stream after the last finished step's work on the GPU,
 * without a host wait. */
KVT__HIDDEN int kvt__cup_after_step(struct kvt__cuda *c);
/* Grows device memory *d to `bytes`, keeping the first `keep` bytes
 * (copied on `stream`). */
KVT__HIDDEN int kvt__cup_dev_grow(void **d, size_t keep, size_t bytes, void *stream);
/* Places s's table copy in the table heap (uploaded whole) if needed. */
KVT__HIDDEN int kvt__cup_tab_place(kvt_pool *p, kvt__seq *s);
/* Grows a pinned array to n elements of sz bytes (contents dropped). */
KVT__HIDDEN int kvt__cup_pin_grow(void **h, size_t n, size_t sz);
/* Waits until the guarded buffers may be written again. */
KVT__HIDDEN int kvt__cup_guard_wait(kvt__guard *g);
/* The work just queued on `stream` reads the guarded buffers. */
KVT__HIDDEN int kvt__cup_guard_set(kvt__guard *g, void *stream);
/* Queues on `stream` the sync of the device-table entries the host changed
 * in layers [l0, l1) of seqs[n] to their GPU copies. */
KVT__HIDDEN int kvt__cup_tab_flush(const kvt_pool *p, kvt__seq *const *seqs, uint32_t n,
                                   uint32_t l0, uint32_t l1, void *stream);
/* The slot's GPU state (accumulators, saved top-K sets) sized for kmax. */
KVT__HIDDEN int kvt__cup_slot_state(kvt_pool *p, kvt__seq *s, uint32_t kmax);
/* Uploads `bytes` of pinned items h to device d on `stream`. */
KVT__HIDDEN int kvt__cup_items_up(void *d, const void *h, size_t bytes, void *stream);

/* ---- the entries of kvt__backend_cuda (the table is in cuda_pool.c) ---------- */
/* Shared pages and saved sequences (cuda_share.c). */
KVT__HIDDEN int kvt__cuda_write(const kvt_pool *p, void *dst, const void *src, size_t n);
KVT__HIDDEN int kvt__cuda_seq_fork(kvt_pool *p, const kvt__seq *src, kvt__seq *dst);
KVT__HIDDEN int kvt__cuda_page_rebuild(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page,
                                       uint32_t count);
KVT__HIDDEN int kvt__cuda_scratch(kvt_pool *p, size_t bytes, void **ptr);
KVT__HIDDEN void kvt__cuda_scratch_free(kvt_pool *p, void *ptr);
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
/* Takes back the last token of a layer (the backend table's seq_pop): the
 * step's kernels are waited for, a page the token opened goes back, else
 * the page's accumulators and metadata are rebuilt on the host from its key
 * rows and uploaded. */
KVT__HIDDEN int kvt__cuda_seq_pop(kvt_pool *p, kvt__seq *s, uint32_t layer);
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
/* Pins host memory for the GPU in place (the I/O thread's staging);
 * unpin before it is unmapped. */
KVT__HIDDEN int kvt__cuda_host_pin(const struct kvt_pool *p, void *h, size_t bytes);
KVT__HIDDEN void kvt__cuda_host_unpin(const struct kvt_pool *p, void *h);
/* kvt_seq_warmup's importance on the GPU: for every stable (layer, head)
 * lh and page j < pages of layer l, imp[lh * stride + j] = the sum over the
 * n_obs queries of the layer of the page's vote (the CPU's kvt__sel_score
 * summed in query order). Waits for earlier work and for the result;
 * scores with cuBLAS when libcublas loads, else with the fallback kernel. */
KVT__HIDDEN int kvt__cuda_warm_imp(struct kvt_pool *p, struct kvt__seq *s, const float *obs,
                                   uint32_t n_obs, float *imp, size_t stride);
/* The warm-up's first top-K sets (s->sel.topk of the heads with sel.topk_k set)
 * become the GPU's saved sets of the sequence, which the steps reuse. */
KVT__HIDDEN int kvt__cuda_warm_topk(struct kvt_pool *p, struct kvt__seq *s);

#endif /* KVTIER_CUDA_INT_H */
