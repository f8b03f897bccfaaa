/* Steps of several tokens per sequence (kvt_step_opts.n_new): the plan's
 * check of the counts, and the copy-out of a dense step's chunk of prefill
 * in a tiered pool at kvt_step_finish. The rows themselves run through the
 * same plan, append, selection and decode as one token (plan.c, layer.c,
 * decode.c). */
#include <stdint.h>
#include <stdio.h>

#include "../core/store.h"
#include "../tier/tier.h"
#include "step_int.h"

/* The step's token counts (kvt_step_opts.n_new, n_rows, max_new): each
 * count 1 .. max_new, their sum n_rows; *rmax the largest. */
int kvt__plan_new_tokens(const kvt_pool *pool, const kvt_step_opts *o, uint32_t n_seqs,
                                uint32_t *rmax)
{
    if (o->max_new > KVT_STEP_MAX_NEW)
        return kvt__err(KVT_EINVAL, "opts->max_new: %u is above KVT_STEP_MAX_NEW (%u)",
                        o->max_new, KVT_STEP_MAX_NEW);
    const uint64_t rows = o->n_new ? o->n_rows : n_seqs;
    if (o->reserved2)
        return kvt__err(KVT_EINVAL, "opts->reserved2: must be zero (is %u)", o->reserved2);
    if (o->token_ids && o->n_token_ids != rows)
        return kvt__err(KVT_EINVAL, "opts->n_token_ids: %u ids for the step's %llu rows (one "
                        "id per row)", o->n_token_ids, (unsigned long long)rows);
    if (!o->token_ids && o->n_token_ids)
        return kvt__err(KVT_EINVAL, "opts->token_ids: NULL with n_token_ids %u",
                        o->n_token_ids);
    const uint32_t max_new = o->max_new ? o->max_new : KVT_STEP_MAX_NEW;
    *rmax = 1;
    if (!o->n_new) {
        if (o->n_rows)
            return kvt__err(KVT_EINVAL, "opts->n_rows: %u without opts->n_new (must be 0: one "
                            "row per sequence)", o->n_rows);
        return 0;
    }
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        if (o->n_new[i] == 0 || o->n_new[i] > max_new)
            return kvt__err(KVT_EINVAL, "opts->n_new[%u]: %u tokens; a sequence carries 1 to "
                            "%u (opts->max_new) in a step", i, o->n_new[i], max_new);
        sum += o->n_new[i];
        *rmax = o->n_new[i] > *rmax ? o->n_new[i] : *rmax;
    }
    if (sum != o->n_rows)
        return kvt__err(KVT_EINVAL, "opts->n_rows: %u, but opts->n_new sums to %llu over the "
                        "%u sequences (the rows of k, v, q and out)", o->n_rows,
                        (unsigned long long)sum, n_seqs);
    if (*rmax > 1 && !(o->flags & KVT_STEP_DENSE) && (pool->be_caps & KVT__BE_NO_MULTI_SPARSE))
        return kvt__err(KVT_ENOTSUP, "opts->n_new: the CUDA backend takes several tokens per "
                        "sequence (up to %u given) in KVT_STEP_DENSE steps only in this "
                        "release", *rmax);
    return 0;
}

void kvt__step_chunk_offload(kvt_step *st)
{
    /* A dense step in a tiered pool (a chunk of prefill): the full pages of
     * its sequences of several tokens go out as kvt_seq_append's do (the
     * plan made device room for every layer's; later chunks read them where
     * they land). A failed copy-out leaves them on device and the next pass
     * retries; the caller's detail message is kept (kvt_step_finish(3)). */
    char keep[512]; /* the size of the thread's message (core/error.c) */
    snprintf(keep, sizeof keep, "%s", kvt_last_error());
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i];
        if (st->nnew[i] < 2 || !s->live || s->gen != (uint32_t)(st->ids[i] >> 32))
            continue;
        for (uint32_t l = 0; l < st->L; l++)
            kvt__place_after_append(st->pool, s, st->ids[i], l, s->n_tokens[l] - st->nnew[i]);
    }
    kvt__err(0, "%s", keep);
}

int kvt__plan_token_ids(const kvt_step_opts *o, uint32_t n_seqs, kvt__seq *const *ss)
{
    for (uint32_t i = 0, row = 0; i < n_seqs; i++) {
        const kvt__seq *s = ss[i];
        const uint32_t nn = o->n_new ? o->n_new[i] : 1u, first = s->n_tokens[0];
        for (uint32_t j = 0; j < nn; j++, row++)
            if (first + j < s->pfx.n_ids && s->pfx.ids[first + j] != o->token_ids[row])
                return kvt__err(KVT_EINVAL, "opts->token_ids[%u]: id %u for position %u of "
                                "seqs[%u], which has id %u recorded there", row,
                                o->token_ids[row], first + j, i, s->pfx.ids[first + j]);
    }
    return 0;
}

void kvt__step_token_ids(kvt_step *st)
{
    char keep[512]; /* the caller's message stays (as kvt__step_chunk_offload) */
    snprintf(keep, sizeof keep, "%s", kvt_last_error());
    for (uint32_t i = 0; i < st->n; i++) {
        kvt__seq *s = st->seqs[i];
        if (!s->live || s->gen != (uint32_t)(st->ids[i] >> 32))
            continue;
        const uint32_t first = s->n_tokens[0] - st->nnew[i];
        /* Positions before the rows without ids: nothing can be keyed past
         * them, so the rows' ids are not recorded either. */
        if (st->has_tok && first <= s->pfx.n_ids)
            kvt__pfx_ids_set(st->pool, s, first, st->tok + st->row0[i], st->nnew[i],
                             "opts->token_ids"); /* (checked at the plan; ENOMEM: unkeyed) */
        kvt__pfx_register(st->pool, s);
    }
    kvt__err(0, "%s", keep);
}
