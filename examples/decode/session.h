/* kvtier-decode: a session saved to a file and continued later
 * (--save / --resume): the sequence's KV cache as a kvtier-seq(5) stream
 * (kvt_seq_save / kvt_seq_restore), followed by the decoder's own state -
 * the next token to feed, the sampler's state and the model's shape, so a
 * resume with another model is refused. */
#ifndef KVTD_SESSION_H
#define KVTD_SESSION_H

#include <stdint.h>

#include "engine.h"

typedef struct session_state {
    int32_t next_tok; /* sampled, not yet in the cache */
    uint64_t rng;     /* the sampler's state */
} session_state;

/* The tokens of the longest layer of the session saved in path (read from
 * the stream's header, kvtier-seq(5)). 0, or -1 with a message in err. */
int session_peek(const char *path, uint32_t *n_tokens, char *err, size_t errlen);
/* Writes kc's sequence and st to path. 0, or -1 with a message in err. */
int session_save(const char *path, const kvcache *kc, const model_cfg *c,
                 const session_state *st, char *err, size_t errlen);
/* Replaces kc's sequence by the one saved in path, with room for
 * max_tokens tokens (kc->seq names the restored sequence; its length in
 * *n_tokens) and reads st. 0, or -1 with
 * a message in err (nothing restored). */
int session_resume(const char *path, kvcache *kc, const model_cfg *c, uint32_t max_tokens,
                   session_state *st, uint32_t *n_tokens, char *err, size_t errlen);

#endif /* KVTD_SESSION_H */
