/* The pool's worker threads (threads.c). */
#ifndef KVTIER_THREADS_H
#define KVTIER_THREADS_H

#include <pthread.h>
#include <stdatomic.h>

#include "base.h"

/* ---- worker threads (threads.c) ------------------------------------------ */
typedef void (*kvt__task_fn)(void *ctx, uint32_t task, uint32_t thread);
typedef struct kvt__tp {
    uint32_t n_threads;          /* including the calling thread */
    bool inited;
    _Atomic bool stop;
    pthread_t *th;
    void *args;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t sleepers;
    _Atomic uint32_t gen;        /* job generation */
    _Atomic uint64_t next;       /* gen << 32 | next task index */
    _Atomic uint32_t done;       /* tasks finished in this job */
    kvt__task_fn fn;
    void *ctx;
    uint32_t n_tasks;
} kvt__tp;
KVT__HIDDEN int kvt__tp_init(kvt__tp *tp, uint32_t n_threads);
KVT__HIDDEN void kvt__tp_fini(kvt__tp *tp);
/* Runs fn(ctx, task, thread) for task < n_tasks on the workers and the
 * calling thread (thread 0); returns when all are done. */
KVT__HIDDEN void kvt__tp_run(kvt__tp *tp, kvt__task_fn fn, void *ctx, uint32_t n_tasks);

#endif /* KVTIER_THREADS_H */
