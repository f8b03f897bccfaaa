/* The CUDA hooks of a build without nvcc (or with CUDA=0): no pool is ever
 * on the CUDA backend, so only kvt__cuda_pool_init is reached. */
#include "../core/store.h"
#include "hooks.h"

bool kvt__cuda_built(void)
{
    return false;
}

int kvt__cuda_pool_init(kvt_pool *p, const kvt_pool_opts *o)
{
    (void)p;
    (void)o;
    return kvt__err(KVT_ENOTSUP, "opts->backend: this build of libkvtier has no CUDA backend "
                    "(built without nvcc or with CUDA=0)");
}

void kvt__cuda_pool_fini(kvt_pool *p)
{
    (void)p;
}

#define KVT__NO_CUDA kvt__err(KVT_EINTERNAL, "CUDA backend: not built")

int kvt__cuda_seq_append(kvt_pool *p, kvt__seq *s, uint32_t layer, const void *k, const void *v,
                         uint32_t n, uint32_t cur, kvt_dtype src_dtype, uint64_t token_stride)
{
    (void)p, (void)s, (void)layer, (void)k, (void)v, (void)n, (void)cur, (void)src_dtype;
    (void)token_stride;
    return KVT__NO_CUDA;
}

int kvt__cuda_check(const kvt_pool *p)
{
    (void)p;
    return KVT__NO_CUDA;
}

int kvt__cuda_read(const kvt_pool *p, void *dst, const void *dev_src, size_t n)
{
    (void)p, (void)dst, (void)dev_src, (void)n;
    return KVT__NO_CUDA;
}

int kvt__cuda_step_plan(struct kvt_step *st, void *stream)
{
    (void)st, (void)stream;
    return KVT__NO_CUDA;
}

int kvt__cuda_step_append(struct kvt_step *st, uint32_t layer, const void *k, const void *v,
                          kvt_dtype src_dtype, uint64_t seq_stride, const uint32_t *cur)
{
    (void)st, (void)layer, (void)k, (void)v, (void)src_dtype, (void)seq_stride, (void)cur;
    return KVT__NO_CUDA;
}

int kvt__cuda_step_select(struct kvt_step *st, uint32_t layer, const float *q)
{
    (void)st, (void)layer, (void)q;
    return KVT__NO_CUDA;
}

int kvt__cuda_step_decode(struct kvt_step *st, uint32_t layer, const float *q, float *out,
                          float *lse, const uint8_t *run)
{
    (void)st, (void)layer, (void)q, (void)out, (void)lse, (void)run;
    return KVT__NO_CUDA;
}

int kvt__cuda_step_selection(const struct kvt_step *st, size_t ih, uint32_t *pages,
                             uint32_t capacity, uint32_t *n_pages)
{
    (void)st, (void)ih, (void)pages, (void)capacity, (void)n_pages;
    return KVT__NO_CUDA;
}

int kvt__cuda_step_finish(struct kvt_step *st)
{
    (void)st;
    return KVT__NO_CUDA;
}

int kvt__cuda_step_fetch(struct kvt_step *st, uint32_t layer, const uint32_t **sel)
{
    (void)st, (void)layer, (void)sel;
    return KVT__NO_CUDA;
}

int kvt__cuda_step_place(struct kvt_step *st, uint32_t layer, const uint8_t *run,
                         uint32_t *missing)
{
    (void)st, (void)layer, (void)run, (void)missing;
    return KVT__NO_CUDA;
}

/* The mover calls these only for batches that carry an event, which only a
 * CUDA pool's batches do. */
int kvt__cuda_mv_stream(const kvt_pool *p, void **stream)
{
    (void)p;
    *stream = NULL;
    return KVT__NO_CUDA;
}

void kvt__cuda_mv_stream_free(void *stream)
{
    (void)stream;
}

int kvt__cuda_mv_mark(kvt_pool *p, void **event)
{
    (void)p;
    *event = NULL;
    return KVT__NO_CUDA;
}

void kvt__cuda_mv_event_free(void *event)
{
    (void)event;
}

int kvt__cuda_mv_copy(const kvt_pool *p, void *copier, void *after, void *dst, const void *src,
                      size_t n, bool uva)
{
    (void)p, (void)copier, (void)after, (void)dst, (void)src, (void)n, (void)uva;
    return KVT__NO_CUDA;
}

size_t kvt__cuda_copy_kernel_max;
uint32_t kvt__cuda_mv_delay_us;
uint32_t kvt__cuda_mv_fail_rounds;
bool kvt__cuda_pin_refuse;

int kvt__cuda_mv_sync(const kvt_pool *p, void *stream)
{
    (void)p, (void)stream;
    return KVT__NO_CUDA;
}

int kvt__cuda_host_pin(const kvt_pool *p, void *h, size_t bytes)
{
    (void)p, (void)h, (void)bytes;
    return KVT__NO_CUDA;
}

void kvt__cuda_host_unpin(const kvt_pool *p, void *h)
{
    (void)p, (void)h;
}

int kvt__cuda_warm_imp(kvt_pool *p, kvt__seq *s, const float *obs, uint32_t n_obs, float *imp,
                       size_t stride)
{
    (void)p, (void)s, (void)obs, (void)n_obs, (void)imp, (void)stride;
    return KVT__NO_CUDA;
}

int kvt__cuda_warm_topk(kvt_pool *p, kvt__seq *s)
{
    (void)p, (void)s;
    return KVT__NO_CUDA;
}

size_t kvt__cuda_warm_budget;
