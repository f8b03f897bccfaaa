/* The step workspace (plan.c, layer.c, decode.c), shared with the CUDA
 * backend's per-layer calls (lib/backend/cuda_pool.c). Internal. */
#ifndef KVTIER_STEP_INT_H
#define KVTIER_STEP_INT_H

#include "../core/store.h"

struct kvt_step {
    kvt_pool *pool;
    bool open;
    const kvt_selector *sel;
    /* Per-head budget and interval, [L * H]: the policy's when the plan has
     * one, else the selector's. */
    const uint32_t *k, *sink, *local, *interval;
    const float *sim;         /* [L * H] the selection cache's thresholds */
    kvt_profiler *prof;       /* records the top-K sets of reranked heads */
    uint8_t *recorded;        /* [L] layer already recorded in this step */
    uint8_t *counted;         /* [L] layer already in the pool's counters */
    /* The per-plan arrays below (those with a size in brackets) are carved
     * from one allocation, wksp (plan.c, kvt__step_carve). */
    void *wksp;
    size_t wksp_bytes;
    uint32_t *rec;            /* [np_max] one head's top-K part (with a profiler) */
    uint32_t flags;
    float scale;
    uint32_t n;               /* sequences */
    uint32_t L, H, Hq, G, D, P;

    kvt_seq_id *ids;          /* [n] */
    kvt__seq **seqs;          /* [n] */
    /* Tokens per sequence (kvt_step_opts.n_new): rows = their sum, rmax the
     * largest; sequence i owns rows row0[i] .. row0[i] + nnew[i] - 1. */
    uint32_t *nnew, *row0;    /* [n] */
    uint32_t rows, rmax;
    uint32_t *tok;            /* [rows] kvt_step_opts.token_ids, copied */
    bool has_tok;
    uint32_t *expect;         /* [n * L] tokens each layer should hold */
    uint8_t *due;             /* [n * L * H] rerank this step */
    uint8_t *appended;        /* [L] */
    uint32_t n_appended;      /* layers appended so far */
    bool read_only;           /* a layer was selected before any append: the
                                 step appends nothing */
    uint32_t sel_layer;       /* layer of the current selection */
    uint32_t emptied_layer;   /* CUDA: a decode of this layer emptied the items
                                 of failed sequences (decode it after a new
                                 selection only) */

    uint32_t *sel_off, *sel_cnt; /* [n * H] */
    uint8_t *sel_rr;          /* [n * H] rescored */
    uint8_t *sim_rr;          /* [n * H] ... because its query drifted (the
                                 selection cache) */
    /* The score pass of key-reading methods (select.c); raw NULL when the
     * step has none: raw scores [G][np] of each head that rescores, at
     * raw_off[ih], and its page-chunk tasks (head, first, end page). */
    float *raw;               /* [cap_raw] */
    uint64_t *raw_off;        /* [n * H] */
    uint32_t *stask;          /* [3 * cap_stask] */
    uint32_t *task0, *ntask;  /* [n * H] decode tasks of each (seq, head) */
    _Atomic uint32_t *pending; /* [n * H] tasks left before the merge */
    size_t cap_sel;
    uint32_t *sel_pages;      /* [cap_sel] */
    size_t cap_tasks;
    uint32_t *task_ih, *task_first, *task_count; /* [cap_tasks] */
    uint64_t *task_part;      /* [cap_tasks] offset of the task's part */
    size_t cap_part;
    float *part;              /* [cap_part] per task [2R + R*D], R = nnew[i]*G rows */
    uint32_t n_threads;
    size_t tstride;
    uint8_t *tmem;            /* [n_threads][tstride] */
    size_t bounce_off;        /* in a thread's tmem: room for one disk slot,
                                 aligned for O_DIRECT (0 = no disk tier) */

    /* Tiered placement (a pool with a policy, not a dense step). */
    bool tiered;
    kvt_fence *fence;         /* [n] promotions in flight (0 = none) */
    int32_t *fcode;           /* [n] their outcome once reported */
    uint8_t *fpend;           /* [n] 1 = fence not yet reported */
    kvt_fence *wf;            /* [n] warm-up's promotions in flight (0 = none) */
    int32_t *wcode;           /* [n] their outcome once reported */
    uint32_t *pm_off, *pm_cnt; /* [n] the sequence's moves in pm */
    size_t cap_pm;
    kvt_move *pm;             /* [cap_pm] promotions of the current layer */
    uint32_t *pmdst;          /* [cap_pm] device block handed to each */
    int32_t *pmres;           /* [cap_pm] per-move outcome */
    void *ev;                 /* [np_max] eviction candidates of one head (kvt__evc) */
    uint32_t *pml;            /* [np_max] promoted pages of one head */
    uint8_t *failed;          /* [n] a promotion of the sequence failed */
    uint8_t *run;             /* [n] the CUDA decode's rounds; on the CPU, sequences a
                                 decode task could not read a page of */

    /* Arguments of the running job. */
    uint32_t layer;
    const float *q;
    float *out, *lse;
    _Atomic int err;
};

/* The element counts of a plan's arrays (kvt__step_carve). */
typedef struct kvt__step_sizes {
    uint64_t n, nl, nh, nlh; /* sequences; x layers; x heads; x layers x heads */
    uint64_t sel, tasks, part, tmem, rec, pm, ev;
    uint64_t rows;           /* token ids (kvt_step_opts.token_ids) */
    uint64_t raw, stask;     /* the score pass: raw floats, chunk tasks */
} kvt__step_sizes;

/* Points st's per-plan arrays into base (NULL: only sizes them); returns
 * the bytes they take, SIZE_MAX on overflow. */
KVT__HIDDEN size_t kvt__step_carve(kvt_step *st, const kvt__step_sizes *z, void *base);

/* Pages per decode task. Fixed, so that the split (and the floating-point
 * merge order) depends on the selection only, never on the thread count.
 * 128 (1 MiB of f16 K/V at D 128, P 16): fewer tasks to start and merge
 * than 32 (dense decode ~7% faster, measured). */
#define KVT__CHUNK_PAGES 128u
/* Pages per task of the score pass (select.c). */
#define KVT__SCORE_CHUNK 64u
#define KVT__NO_LAYER 0xffffffffu

/* Pages per decode task of a sequence with n_new tokens of G query heads
 * each: KVT__CHUNK_PAGES for one token (the split it always had), more for
 * many rows so that a chunk of prefill keeps few partial results. Depends
 * on the step only, never on the thread count. */
static inline uint32_t kvt__task_pages(uint32_t n_new, uint32_t G)
{
    const uint32_t rows = n_new * G;
    return KVT__CHUNK_PAGES * (n_new <= 1u || rows <= 64u ? 1u : (rows + 63u) / 64u);
}
/* The `local` pages (full pages before a partial last one, which is
 * forced anyway; lib/core/forced.h) of a selection over a layer holding
 * `tokens` tokens, n_new of them this step's: the selector's `local`, or
 * more so that every page holding a new token is forced. */
static inline uint32_t kvt__step_local(uint32_t local, uint32_t tokens, uint32_t n_new,
                                       uint32_t P)
{
    if (n_new <= 1 || tokens == 0)
        return local;
    const uint32_t first = (n_new < tokens ? tokens - n_new : 0) / P;
    const uint32_t span = (tokens - 1) / P - first + 1u; /* pages holding new tokens */
    const uint32_t need = span - (tokens % P != 0);
    return need > local ? need : local;
}

/* The argument check every call that takes a step makes (plan.c): the step
 * is not NULL and is open; layer, seq_index and kv_head, unless KVT__ANY,
 * are in range. */
#define KVT__ANY UINT32_MAX
KVT__HIDDEN int kvt__step_args(const kvt_step *st, uint32_t layer, uint32_t seq_index,
                               uint32_t kv_head);
/* ... and before a per-layer call, the step's sequences are all still live
 * and hold the tokens the plan expects (plan.c). */
KVT__HIDDEN int kvt__step_enter(const kvt_step *st, uint32_t layer);
/* Tiered steps (layer.c): whether sequence i still has promotions (its
 * warm-up's or this layer's) in flight, recording outcomes that arrived; */
KVT__HIDDEN bool kvt__pending(kvt_step *st, uint32_t i);
/* waits until none is (count: a decode that waited, kvt_stats.paused_seqs); */
KVT__HIDDEN void kvt__settle(kvt_step *st, uint32_t i, bool count);
/* after failed promotions, makes the heads whose pages did not arrive
 * rescore, and clears the recorded outcomes. */
KVT__HIDDEN void kvt__fail_reset(kvt_step *st, uint32_t i);
/* Steps of several tokens (multi.c): the plan's check of opts->n_new,
 * n_rows and max_new (*rmax: the largest count); */
KVT__HIDDEN int kvt__plan_new_tokens(const kvt_pool *pool, const kvt_step_opts *o,
                                     uint32_t n_seqs, uint32_t *rmax);
/* at the finish of a dense step in a tiered pool, the full pages of its
 * sequences of several tokens go out as kvt_seq_append's do (a failed
 * copy-out leaves them on device; the error is not kept). */
KVT__HIDDEN void kvt__step_chunk_offload(kvt_step *st);
/* kvt_step_opts.token_ids at the plan: each sequence's rows' ids must agree
 * with the ids it has recorded for those positions (multi.c). */
KVT__HIDDEN int kvt__plan_token_ids(const kvt_step_opts *o, uint32_t n_seqs,
                                    kvt__seq *const *ss);
/* At kvt_step_finish, once every layer is appended: records the rows' ids
 * (kvt_step_opts.token_ids) and keys the pages that can be (multi.c). */
KVT__HIDDEN void kvt__step_token_ids(kvt_step *st);
/* The host's selection of st->layer (select.c): which heads rescore, the
 * score pass, the picks, into sel_pages / sel_cnt / sel_rr / sim_rr; */
KVT__HIDDEN void kvt__select_heads(kvt_step *st);
/* the profiler's records of the heads reranked in `layer`; */
KVT__HIDDEN int kvt__select_record(kvt_step *st, uint32_t layer);
/* the pool's counters (every backend), once per layer and step. */
KVT__HIDDEN void kvt__select_count(kvt_step *st, uint32_t layer);
/* After a layer's selection: the heads that rescored tell the host cache's
 * eviction lists of importances that fell (select.c; pools with a disk). */
KVT__HIDDEN void kvt__select_imp(kvt_step *st, uint32_t layer);
/* The selection of a layer (kvt_step_select's work). */
KVT__HIDDEN int kvt__select(kvt_step *st, uint32_t layer, const float *q);

#endif /* KVTIER_STEP_INT_H */
