/* kvtier-decode --remote URL: the prompt's KV shared through a Redis server
 * (or cluster) by every run of the same model - the first run writes its
 * prompt's pages, a later run on the same prompt lands them and prefills
 * only what is left. */
#ifndef KVTD_REMOTE_RUN_H
#define KVTD_REMOTE_RUN_H

#include "engine.h"

/* The remote options for endpoint url and model m (the fingerprint: a hash
 * of the configuration and a sample of the weights, kept in fp[64]). */
kvt_remote_opts remote_opts(const char *url, const model *m, char fp[64]);

typedef struct remote_report {
    uint32_t prompt_tokens, remote_tokens, local_tokens;
    double prefill_s, fetch_ms;
    uint64_t get_bytes;
} remote_report;

/* Replaces kc's empty sequence by one created with the prompt as its
 * prefix (all but the last n_obs tokens: the engine computes those, for
 * their queries and the last logits), waits for the remote pages, then
 * prefills the rest in dense steps of `chunk` tokens. logits: the last
 * position's; obs: the last n_obs queries [L][n_obs][H][hd]. */
void remote_prefill(const model *m, const int32_t *prompt, uint32_t T, kvcache *kc,
                    uint32_t chunk, float *logits, float *obs, uint32_t n_obs,
                    remote_report *r);
/* Waits until what the run queued is written; prints what it wrote. */
void remote_finish(kvcache *kc, int quiet);

#endif /* KVTD_REMOTE_RUN_H */
