/* kvtier-decode --draft N: self-speculative greedy decoding. The tiered
 * sparse path drafts N tokens (ordinary one-token steps), the draft's K/V is
 * taken back (kvt_seq_truncate), and one dense step of N + 1 tokens
 * (kvt_step_opts.n_new) verifies them: the longest prefix of the draft that
 * dense greedy decoding agrees with is kept, plus dense's own next token,
 * and the rejected tokens leave the cache with kvt_seq_truncate. The output
 * is dense greedy decoding's, token for token. */
#ifndef KVTD_DRAFT_H
#define KVTD_DRAFT_H

#include <stdint.h>

#include "engine.h"

typedef struct draft_stats {
    uint32_t verifies;  /* dense verification steps */
    uint32_t drafted;   /* tokens the sparse path proposed */
    uint32_t accepted;  /* of those, kept */
    uint32_t produced;  /* tokens out (accepted + one per verification) */
} draft_stats;

/* Generates up to gen tokens after `first` (already sampled, not yet in the
 * cache, which holds pos tokens) into out[gen] (out[0] = first); stops after
 * an eos token when eos >= 0. Returns the count. w must hold n_draft + 1
 * rows. */
uint32_t draft_generate(const model *m, kvcache *kc, int32_t first, uint32_t pos, uint32_t gen,
                        uint32_t n_draft, int32_t eos, work *w, int32_t *out, draft_stats *ds);

#endif /* KVTD_DRAFT_H */
