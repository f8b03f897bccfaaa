/* The backend interface: one versioned table of functions per backend
 * (libgit2's git_odb_backend is the model), chosen at pool creation
 * (kvt_pool.be). The CPU backend (cpu.c) is the library's own host code:
 * it fills only the entries it serves differently from that code, and the
 * other areas run their host path where an entry is NULL. The CUDA backend
 * (cuda_pool.c, cuda_step.c, cuda_copy.c with nvcc) fills every entry; a
 * build without nvcc has the same table with a pool_init that answers
 * KVT_ENOTSUP (cuda_none.c), so no pool ever gets it. Nothing outside
 * lib/backend names a backend's functions. */
#ifndef KVTIER_BACKEND_H
#define KVTIER_BACKEND_H

#include "../core/store.h"

#define KVT__BACKEND_V1 1u

struct kvt_step;

typedef struct kvt__backend {
    uint32_t version; /* KVT__BACKEND_V1 */
    const char *name;
    bool built;       /* false: this build cannot serve the backend */
    uint32_t caps;    /* KVT__BE_* (core/store.h), copied to kvt_pool.be_caps */

    /* ---- pool -------------------------------------------------------------
     * After the arenas' ids exist (bases unset for external memory): checks
     * what the backend serves, allocates its memory, sets the device and
     * metadata bases. pool_fini undoes a full or partial pool_init. */
    int (*pool_init)(kvt_pool *p, const kvt_pool_opts *o);
    void (*pool_fini)(kvt_pool *p);
    /* kvt_pool_check's part: the backend's own copies of the tables match. */
    int (*check)(const kvt_pool *p);
    /* Copies n bytes of backend memory (KVT__BE_DEVICE_REMOTE) to the host,
     * and host bytes into backend memory. */
    int (*read)(const kvt_pool *p, void *dst, const void *src, size_t n);
    int (*write)(const kvt_pool *p, void *dst, const void *src, size_t n);
    /* kvt_seq_fork: src's per-sequence backend state (open-page
     * accumulators, kept top-K sets) becomes dst's; NULL: the host's. */
    int (*seq_fork)(kvt_pool *p, const kvt__seq *src, kvt__seq *dst);
    /* kvt_seq_truncate: the metadata, accumulators and non-finite bit of
     * page (lh, page) rebuilt from its first count rows, whose metadata slot
     * may be new (the backend's table copies follow); NULL: on the host
     * (kvt__page_rebuild over the host-addressable device tier). */
    int (*page_rebuild)(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page, uint32_t count);
    /* Backend memory kvt_seq_append takes rows from (a restore's staging);
     * NULL: host memory. */
    int (*scratch)(kvt_pool *p, size_t bytes, void **ptr);
    void (*scratch_free)(kvt_pool *p, void *ptr);
    /* Appends n checked rows of one layer (blocks known to be available;
     * all or nothing; sets the layer's length). Required. */
    int (*seq_append)(kvt_pool *p, kvt__seq *s, uint32_t layer, const void *k, const void *v,
                      uint32_t n, kvt_dtype src_dtype, uint64_t token_stride);
    /* Takes back the last token of a layer (kvt__append_pop's contract);
     * NULL: kvt__append_pop on the host-addressable device tier. */
    int (*seq_pop)(kvt_pool *p, kvt__seq *s, uint32_t layer);

    /* ---- the step (lib/step; NULL: the step's host code) ------------------- */
    int (*step_plan)(struct kvt_step *st, void *stream);
    int (*step_append)(struct kvt_step *st, uint32_t layer, const void *k, const void *v,
                       kvt_dtype src_dtype, uint64_t seq_stride, const uint32_t *cur);
    int (*step_select)(struct kvt_step *st, uint32_t layer, const float *q);
    /* Pools with lower tiers: the selection of the layer just launched back
     * on the host, with the votes of reranked heads as importance. */
    int (*step_fetch)(struct kvt_step *st, uint32_t layer, const uint32_t **sel);
    /* Before the decode of the sequences with run[i] == 1 (NULL: all), once
     * their promotions landed: the layer's changed table entries and their
     * block lists reach the backend; *missing: selected pages off device. */
    int (*step_place)(struct kvt_step *st, uint32_t layer, const uint8_t *run,
                      uint32_t *missing);
    /* run (NULL = all, decoded): 0 leaves a sequence out, 1 decodes it, 2
     * empties it (zeros, lse -infinity). */
    int (*step_decode)(struct kvt_step *st, uint32_t layer, const float *q, float *out,
                       float *lse, const uint8_t *run);
    int (*step_selection)(const struct kvt_step *st, size_t ih, uint32_t *pages,
                          uint32_t capacity, uint32_t *n_pages);
    int (*step_finish)(struct kvt_step *st);

    /* ---- the tier mover's copies (lib/tier; NULL: memcpy on the mover's
     * threads) ------------------------------------------------------------
     * batch_mark: an event recorded when a batch touching the device tier
     * is submitted (after the work that wrote or read its blocks), which its
     * copies wait for; copier_open/close: a thread's copier; copy: adds a
     * copy to the copier's round, after `after` (uva: the host side is
     * pinned and mapped); copier_sync: issues the round and waits for it,
     * even after an error. host_pin/unpin: the I/O thread's staging. */
    int (*batch_mark)(kvt_pool *p, void **event);
    void (*event_free)(void *event);
    int (*copier_open)(const kvt_pool *p, void **copier);
    void (*copier_close)(void *copier);
    int (*copy)(const kvt_pool *p, void *copier, void *after, void *dst, const void *src,
                size_t n, bool uva);
    int (*copier_sync)(const kvt_pool *p, void *copier);
    int (*host_pin)(const kvt_pool *p, void *h, size_t bytes);
    void (*host_unpin)(const kvt_pool *p, void *h);

    /* ---- kvt_seq_warmup (lib/tier/place.c; NULL: scored on the host) ------
     * warm_imp: for every stable (layer, head) lh and page j of its layer,
     * imp[lh * stride + j] = the summed vote of the n_obs queries; warm_topk:
     * the warm-up's first top-K sets become the backend's saved sets. */
    int (*warm_imp)(kvt_pool *p, kvt__seq *s, const float *obs, uint32_t n_obs, float *imp,
                    size_t stride);
    int (*warm_topk)(kvt_pool *p, kvt__seq *s);
} kvt__backend;

KVT__HIDDEN extern const kvt__backend kvt__backend_cpu;
KVT__HIDDEN extern const kvt__backend kvt__backend_cuda;

/* Test hooks of the CUDA backend (tests/gpu), only in the test libraries
 * (-DKVT_TEST_HOOKS: libkvtier-hooks.a and the emulation library); the
 * installed library has the constants below in their place and counts
 * nothing. KVT__HOOK(stmt) runs stmt only in a test build. */
#ifdef KVT_TEST_HOOKS
#define KVT__HOOK(stmt) stmt
/* The mover's switch between the copy kernel and cudaMemcpyAsync (bytes;
 * KVT__CU_COPY_KERNEL_MAX). */
KVT__HIDDEN extern size_t kvt__cuda_copy_kernel_max;
/* Each copier sleeps this long before issuing a round (0: not at all). */
KVT__HIDDEN extern uint32_t kvt__cuda_mv_delay_us;
/* The next this many copy rounds into the device tier fail with KVT_EIO. */
KVT__HIDDEN extern uint32_t kvt__cuda_mv_fail_rounds;
/* Decodes that launched their ready sequences before waiting for the
 * others' promotions (lib/step/decode.c). */
KVT__HIDDEN extern uint64_t kvt__cuda_ready_first;
/* host_pin fails (the staging stays pageable). */
KVT__HIDDEN extern bool kvt__cuda_pin_refuse;
/* Bytes of raw scores per GPU scoring call of the warm-up (64 MiB). */
KVT__HIDDEN extern size_t kvt__cuda_warm_budget;
#else
#define KVT__HOOK(stmt) ((void)0)
#endif

#endif /* KVTIER_BACKEND_H */
