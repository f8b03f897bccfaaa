/* kvtier-decode --prefix-demo: several requests that share the prompt as a
 * system prompt, each with a question of its own, through one pool with
 * the prefix cache (KVT_POOL_PREFIX_CACHE). Each request creates its
 * sequence with its token ids as the prefix: the cache attaches the pages
 * an earlier request left, and the engine prefills only the rest (dense
 * chunks over the attached pages). */
#ifndef KVTD_PREFIX_DEMO_H
#define KVTD_PREFIX_DEMO_H

#include <stdint.h>

#include "engine.h"

/* n_req requests of the prompt (T tokens) plus q_tokens question tokens
 * each (drawn from seed). Each request's last logits are compared with the
 * same request prefilled from scratch in a pool without the cache. Prints a
 * line per request and a summary on stderr and, with json, one JSON line
 * (prefix_prefill_saved, ...) on stdout. Returns 0, or 1 when a request's
 * greedy next token differs from the reference's. */
int prefix_demo(const model *m, const int32_t *prompt, uint32_t T, const engine_opts *eo,
                int tiered, uint32_t n_req, uint32_t q_tokens, uint64_t seed, int json);

#endif /* KVTD_PREFIX_DEMO_H */
