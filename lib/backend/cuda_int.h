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
#include "hooks.h"
#include "../step/step_int.h"
#include "../../cuda/kvt_cuda.h"

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

#endif /* KVTIER_CUDA_INT_H */
