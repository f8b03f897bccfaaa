/* kvtier-decode: tokenizers. Text in, token ids out, and back:
 *  - SentencePiece-style (GGUF tokenizer.ggml.model "llama", and llama2.c's
 *    tokenizer.bin): pieces with scores, spaces as U+2581, a leading space
 *    added, pairs merged by best score, bytes without a piece as <0xNN>
 *    byte-fallback tokens;
 *  - GPT-2 byte-level BPE (tokenizer.ggml.model "gpt2", as Llama 3, SmolLM2
 *    and Qwen2 use): bytes mapped to printable code points, text pre-split
 *    into words (a word keeps its leading space; digits, letters,
 *    punctuation and newlines split apart), each word merged by the rank of
 *    the merges list.
 * Nothing here calls libkvtier. */
#ifndef KVTD_TOKENIZER_H
#define KVTD_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef enum { TOK_SPM = 1, TOK_BPE = 2 } tok_kind;

typedef struct tokenizer tokenizer; /* opaque */

/* From a GGUF file's tokenizer.ggml.* keys (model, tokens, scores,
 * token_type, merges, bos_token_id, eos_token_id). Returns 0, or -1 with a
 * message. */
int tok_from_gguf(tokenizer **out, const gguf *g, char *err, size_t cap);
/* From a llama2.c tokenizer.bin (int32 max_token_length, then per token:
 * f32 score, int32 length, bytes) for a vocabulary of vocab_size tokens. */
int tok_from_llama2c(tokenizer **out, const char *path, uint32_t vocab_size, char *err,
                     size_t cap);
/* From explicit arrays (tests): n tokens as NUL-terminated UTF-8 strings;
 * scores (SPM) or merges ("a b" strings, BPE, n_merges of them). */
int tok_from_arrays(tokenizer **out, tok_kind kind, const char *const *tokens,
                    const float *scores, uint32_t n, const char *const *merges,
                    uint32_t n_merges, int32_t bos, int32_t eos, char *err, size_t cap);
void tok_free(tokenizer *t);

tok_kind tok_get_kind(const tokenizer *t);
uint32_t tok_vocab(const tokenizer *t);
int32_t tok_bos(const tokenizer *t); /* -1 when none */
int32_t tok_eos(const tokenizer *t);

/* Encodes len bytes of UTF-8 text into ids (capacity cap); adds BOS first
 * when add_bos and the vocabulary has one. Returns the count (may exceed
 * cap: then only cap were written), or -1 with a message. */
int64_t tok_encode(const tokenizer *t, const char *text, size_t len, int add_bos,
                   int32_t *ids, size_t cap, char *err, size_t errcap);
/* The bytes of token id (SPM: U+2581 back to a space, <0xNN> to its byte;
 * BPE: the byte mapping undone). *n receives the length; returns NULL for an
 * id out of range. prev is the previous id (-1 at the start): SPM drops the
 * leading space of the first piece after BOS. The pointer stays valid until
 * the next call with t. */
const char *tok_decode(tokenizer *t, int32_t prev, int32_t id, size_t *n);

#endif /* KVTD_TOKENIZER_H */
