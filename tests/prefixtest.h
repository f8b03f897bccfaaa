/* Helpers of the prefix cache tests (test_prefix, test_prefix_load): token
 * sequences whose K/V rows are a pure function of the token prefix (so the
 * rows any sequence must hold follow from its ids alone), a model of the
 * prefix index (the whole-page runs some sequence keyed), and the
 * conversation helpers that append, attach, verify and step through the
 * public calls. The code is tests/prefixtest.c, compiled into each test
 * that includes this header (with the fault-injection library: the hash
 * hook lives there). */
#ifndef KVT_PREFIXTEST_H
#define KVT_PREFIXTEST_H

#include "testutil.h"
#include "internal.h"
#include "../tier/tier.h"
#include "placetest.h"

#define P PAGE_TOKENS
#define H N_KV_HEADS
#define D HEAD_DIM
#define G GQA_GROUP
#define SALT_A 0x5a17u
#define SALT_B 0xb0b0u

#define MAXC 12
#ifndef CTOK
#define CTOK 1024 /* (test_remote: more) */
#endif

/* A sequence and its token ids. */
typedef struct {
    kvt_seq_id id;
    bool live;
    uint64_t salt;
    uint32_t n;              /* rows appended */
    uint32_t ids[CTOK];      /* its token ids (n of them, plus any recorded ahead) */
} conv;

/* The rows of positions [from, to) of token sequence ids under salt, layer
 * l: k/v [to - from][H][D] (f16 bit patterns of moderate magnitude). */
void rows_of(const uint32_t *ids, uint64_t salt, uint32_t from, uint32_t to, uint32_t l,
             uint16_t *k, uint16_t *v);

/* The model of the index: forget every run; record c's keyed whole pages;
 * the most tokens a prefix of n ids can match under salt. */
void model_reset(void);
void model_key(const conv *c);
uint32_t model_best(const uint32_t *ids, uint32_t n, uint64_t salt);

/* Appends ids[c->n .. c->n + n) through kvt_seq_append (ids recorded first). */
void conv_append(kvt_pool *p, conv *c, uint32_t n);
/* Creates c with prefix c->ids[0..n_prefix) under c->salt; the tokens
 * matched, checked against the model (exact: nothing can have been
 * reclaimed; else at most the model's). */
uint32_t conv_create(kvt_pool *p, conv *c, uint32_t n_prefix, bool exact);
/* Every row of c reads back equal to the rows of its ids. */
void conv_verify(const kvt_pool *p, const conv *c);
void conv_release(kvt_pool *p, conv *c);
/* One dense step: cs[i] appends nn[i] tokens (ids as token_ids) and queries
 * them causally; every row against double-precision attention. */
void conv_step(kvt_pool *p, conv **cs, uint32_t n, const uint32_t *nn, tu_rng *r);

void rand_ids(uint32_t *ids, uint32_t n, tu_rng *r);
/* A device (and host) pool of the placement geometry with the cache. */
kvt_pool_opts cache_opts(uint32_t dev, uint32_t host);
uint64_t dev_used(const kvt_pool *p);

#endif /* KVT_PREFIXTEST_H */
