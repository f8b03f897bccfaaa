/* The CUDA backend's part of shared pages and saved sequences
 * (kvt_seq_fork, kvt_seq_truncate, kvt_seq_restore): host bytes into GPU
 * memory, a fork's copy of the parent's per-slot GPU state (open-page
 * accumulators, kept top-K sets), a page's metadata and accumulators
 * rebuilt from its rows after a cut, and device scratch for a restore's
 * rows. Each waits for the pool's queued work first: these run between
 * steps, never on a step's path. */
#include <stdlib.h>
#include <string.h>

#include "cuda_int.h"

int kvt__cuda_write(const kvt_pool *p, void *dst, const void *src, size_t n)
{
    struct kvt__cuda *c = p->cu;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cup_quiesce(c);
    return rc ? rc : kvt__cu_copy_sync(dst, src, n, c->stream);
}

int kvt__cuda_seq_fork(kvt_pool *p, const kvt__seq *src, kvt__seq *dst)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t from = kvt__cup_slot(p, src), to = kvt__cup_slot(p, dst);
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cup_quiesce(c);
    /* The child's slot state, as large as the parent's (kcap only grows). */
    if (!rc)
        rc = kvt__cup_slot_state(p, dst, c->kcap);
    if (rc)
        return rc;
    const size_t acc = (size_t)c->LH * 3u * p->g.head_dim;
    if (from < c->acc_slots &&
        (rc = kvt__cu_memcpy(c->d_acc + to * acc, c->d_acc + from * acc, acc * sizeof(float))))
        return rc;
    if (from < c->saved_slots && c->kcap) {
        const size_t rows = (size_t)c->LH * c->kcap;
        if ((rc = kvt__cu_memcpy(c->d_saved + to * rows, c->d_saved + from * rows,
                                 rows * sizeof(uint32_t))) ||
            (rc = kvt__cu_memcpy(c->d_nsaved + (size_t)to * c->LH,
                                 c->d_nsaved + (size_t)from * c->LH, c->LH * sizeof(uint32_t))))
            return rc;
    }
    return 0;
}

int kvt__cuda_page_rebuild(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page, uint32_t count)
{
    struct kvt__cuda *c = p->cu;
    const uint32_t D = p->g.head_dim;
    const size_t row = (size_t)D * p->elem, e = lh * s->cap_pages + page;
    int rc = kvt__cu_set_device(c->device);
    if (!rc)
        rc = kvt__cup_quiesce(c);
    if (!rc)
        rc = kvt__cup_slot_state(p, s, c->kcap);
    if (rc)
        return rc;
    uint8_t *rows = malloc((size_t)count * row + 3 * row);
    float *acc = malloc(3u * D * sizeof *acc);
    if (!rows || !acc) {
        free(rows);
        free(acc);
        return kvt__err(KVT_ENOMEM, "kvt_seq_truncate: cannot allocate a page's rows");
    }
    /* A cut may have given the page a new metadata slot (a shared page
     * copied): the GPU's copy of the metadata table follows (dirty ranges
     * carry the device table only). */
    if (s->be.cu_cap && s->be.cu_cap == s->cap_pages &&
        (rc = kvt__cu_memcpy(c->d_mtab + s->be.cu_off + e, &s->meta_slot[e], sizeof(uint32_t)))) {
        free(rows);
        free(acc);
        return rc;
    }
    uint8_t *meta = rows + (size_t)count * row;
    const uint8_t *blk = kvt__arena_block(&p->tier[KVT_TIER_DEVICE], s->dev_block[e]);
    if (!(rc = kvt__cu_memcpy(rows, blk, (size_t)count * row))) {
        const bool bad = kvt__page_rebuild(p, rows, count, acc, meta, meta + 2 * row);
        if (!(rc = kvt__cu_memcpy(kvt__meta_mm(p, s->meta_slot[e]), meta, 2 * row)) &&
            !(rc = kvt__cu_memcpy(kvt__meta_mean(p, s->meta_slot[e]), meta + 2 * row, row)) &&
            !(rc = kvt__cu_memcpy(c->d_acc + ((size_t)kvt__cup_slot(p, s) * c->LH + lh) * 3u * D,
                                  acc, 3u * D * sizeof *acc)))
            s->res[e] = (uint8_t)((s->res[e] & ~KVT__RES_NONFINITE) |
                                  (bad ? KVT__RES_NONFINITE : 0));
    }
    free(rows);
    free(acc);
    return rc;
}

int kvt__cuda_scratch(kvt_pool *p, size_t bytes, void **ptr)
{
    int rc = kvt__cu_set_device(p->cu->device);
    return rc ? rc : kvt__cu_malloc(ptr, bytes);
}

void kvt__cuda_scratch_free(kvt_pool *p, void *ptr)
{
    (void)p;
    kvt__cu_free(ptr);
}
