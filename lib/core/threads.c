/* The pool's worker threads: a fork-join over task indexes. The calling
 * thread works too; workers spin briefly after a job (per-layer calls come
 * in quick succession) and then sleep on a condition variable.
 *
 * A job (fn, ctx, n_tasks) is published under the mutex together with its
 * generation, and a worker copies it under the mutex when it sees a new
 * generation: no field is read while the caller writes the next job's.
 * Workers claim task indexes with a CAS on `next`, whose high half is the
 * job's generation, so a worker still holding an older job's copy can never
 * claim a task of a newer one (the older job's tasks are all claimed by
 * then, so its CAS finds a different generation or no index below its
 * n_tasks). */
#include <pthread.h>
#include <stdlib.h>

#include "threads.h"

#define KVT__SPIN_ITERS 2000u

static inline void kvt__cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A job as a worker runs it: its own copy. */
typedef struct {
    uint32_t gen, n_tasks;
    kvt__task_fn fn;
    void *ctx;
} kvt__job;

/* Runs tasks of job j until none is left; returns how many ran. */
static uint32_t kvt__tp_drain(kvt__tp *tp, const kvt__job *j, uint32_t thread)
{
    uint32_t ran = 0;
    for (;;) {
        uint64_t v = atomic_load_explicit(&tp->next, memory_order_acquire);
        if ((uint32_t)(v >> 32) != j->gen || (uint32_t)v >= j->n_tasks)
            break;
        if (!atomic_compare_exchange_weak_explicit(&tp->next, &v, v + 1,
                                                   memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        j->fn(j->ctx, (uint32_t)v, thread);
        ran++;
    }
    return ran;
}

typedef struct {
    kvt__tp *tp;
    uint32_t id;
} kvt__worker_arg;

static void *kvt__worker(void *arg)
{
    kvt__worker_arg *wa = arg;
    kvt__tp *tp = wa->tp;
    const uint32_t id = wa->id;
    uint32_t seen = 0;
    for (;;) {
        uint32_t gen = atomic_load_explicit(&tp->gen, memory_order_acquire);
        for (uint32_t i = 0; gen == seen && i < KVT__SPIN_ITERS; i++) {
            kvt__cpu_relax();
            gen = atomic_load_explicit(&tp->gen, memory_order_acquire);
        }
        pthread_mutex_lock(&tp->mu);
        if (gen == seen) {
            tp->sleepers++;
            while ((gen = atomic_load_explicit(&tp->gen, memory_order_acquire)) == seen &&
                   !atomic_load_explicit(&tp->stop, memory_order_relaxed))
                pthread_cond_wait(&tp->cv, &tp->mu);
            tp->sleepers--;
        }
        /* The job of the generation now published, copied under the mutex
         * that its publication holds. */
        const kvt__job j = {atomic_load_explicit(&tp->gen, memory_order_relaxed), tp->n_tasks,
                            tp->fn, tp->ctx};
        pthread_mutex_unlock(&tp->mu);
        if (atomic_load_explicit(&tp->stop, memory_order_acquire))
            break;
        seen = j.gen;
        uint32_t ran = kvt__tp_drain(tp, &j, id);
        if (ran)
            atomic_fetch_add_explicit(&tp->done, ran, memory_order_acq_rel);
    }
    return NULL;
}

int kvt__tp_init(kvt__tp *tp, uint32_t n_threads)
{
    tp->n_threads = 1;
    atomic_init(&tp->stop, false);
    atomic_init(&tp->gen, 0);
    atomic_init(&tp->next, 0);
    atomic_init(&tp->done, 0);
    if (pthread_mutex_init(&tp->mu, NULL))
        return kvt__err(KVT_ENOMEM, "thread pool: cannot create a mutex");
    if (pthread_cond_init(&tp->cv, NULL)) {
        pthread_mutex_destroy(&tp->mu);
        return kvt__err(KVT_ENOMEM, "thread pool: cannot create a condition variable");
    }
    tp->inited = true;
    if (n_threads <= 1)
        return 0;
    tp->th = calloc(n_threads - 1, sizeof *tp->th);
    tp->args = calloc(n_threads - 1, sizeof(kvt__worker_arg));
    if (!tp->th || !tp->args)
        return kvt__err(KVT_ENOMEM, "thread pool: cannot allocate %u workers", n_threads - 1);
    kvt__worker_arg *args = tp->args;
    for (uint32_t i = 0; i + 1 < n_threads; i++) {
        args[i].tp = tp;
        args[i].id = i + 1;
        if (pthread_create(&tp->th[i], NULL, kvt__worker, &args[i]))
            return kvt__err(KVT_ENOMEM, "thread pool: cannot start worker %u of %u", i + 1,
                            n_threads - 1);
        tp->n_threads++;
    }
    return 0;
}

void kvt__tp_fini(kvt__tp *tp)
{
    if (!tp->inited)
        return;
    pthread_mutex_lock(&tp->mu);
    atomic_store_explicit(&tp->stop, true, memory_order_release);
    atomic_fetch_add_explicit(&tp->gen, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&tp->cv);
    pthread_mutex_unlock(&tp->mu);
    for (uint32_t i = 0; i + 1 < tp->n_threads; i++)
        pthread_join(tp->th[i], NULL);
    free(tp->th);
    free(tp->args);
    pthread_cond_destroy(&tp->cv);
    pthread_mutex_destroy(&tp->mu);
    tp->inited = false;
}

void kvt__tp_run(kvt__tp *tp, kvt__task_fn fn, void *ctx, uint32_t n_tasks)
{
    if (n_tasks == 0)
        return;
    if (tp->n_threads <= 1 || n_tasks == 1) {
        for (uint32_t t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    /* The previous job is complete (done == its n_tasks). The new one is
     * published under the mutex, where workers copy it. */
    pthread_mutex_lock(&tp->mu);
    const kvt__job j = {atomic_load_explicit(&tp->gen, memory_order_relaxed) + 1u, n_tasks, fn,
                        ctx};
    tp->fn = fn;
    tp->ctx = ctx;
    tp->n_tasks = n_tasks;
    atomic_store_explicit(&tp->done, 0, memory_order_relaxed);
    atomic_store_explicit(&tp->next, (uint64_t)j.gen << 32, memory_order_release);
    atomic_store_explicit(&tp->gen, j.gen, memory_order_release);
    if (tp->sleepers)
        pthread_cond_broadcast(&tp->cv);
    pthread_mutex_unlock(&tp->mu);
    uint32_t ran = kvt__tp_drain(tp, &j, 0);
    if (ran)
        atomic_fetch_add_explicit(&tp->done, ran, memory_order_acq_rel);
    while (atomic_load_explicit(&tp->done, memory_order_acquire) != n_tasks)
        kvt__cpu_relax();
}
