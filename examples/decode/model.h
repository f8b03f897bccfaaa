/* kvtier-decode: a Llama-architecture model (RMSNorm, RoPE, GQA attention,
 * SwiGLU MLP, tied or untied output), its weights widened to f32 at load,
 * and the matrix products of its forward pass through CBLAS (OpenBLAS).
 * The attention itself is not here: decode attention is libkvtier's, and
 * prefill attention is model_prefill_attention below. */
#ifndef KVTD_MODEL_H
#define KVTD_MODEL_H

#include <stddef.h>
#include <stdint.h>

typedef enum { ROPE_ADJACENT = 0, ROPE_HALVES = 1 } rope_mode;

typedef struct model_cfg {
    uint32_t dim, hidden, n_layers, n_heads, n_kv_heads, head_dim, vocab, ctx;
    float rope_theta;   /* base of the rotary frequencies */
    float rope_scale;   /* linear position scaling (1 = none) */
    rope_mode rope;     /* pairs (2i, 2i+1) (Llama) or (i, i + d/2) (Qwen2, NeoX) */
    float rms_eps;
    int qkv_bias;       /* Qwen2-style biases on q, k, v */
    int tied;           /* output = token embedding */
} model_cfg;

/* Weights, row-major [out][in]; per-layer tensors stacked over layers. */
typedef struct model {
    model_cfg c;
    float *tok_emb;           /* [vocab][dim] */
    float *rms_att, *rms_ffn; /* [L][dim] */
    float *wq, *wk, *wv, *wo; /* [L][H*hd][dim], [L][Hkv*hd][dim] x2, [L][dim][H*hd] */
    float *bq, *bk, *bv;      /* [L][H*hd], [L][Hkv*hd] x2, or NULL */
    float *w1, *w2, *w3;      /* gate [L][hidden][dim], down [L][dim][hidden], up [L][hidden][dim] */
    float *rms_final;         /* [dim] */
    float *wcls;              /* [vocab][dim] (== tok_emb when tied) */
    char desc[128];           /* where it came from, in words */
} model;

/* Loaders: 0, or -1 with a message in err. */
int model_load_llama2c(model *m, const char *path, char *err, size_t cap);
struct gguf;
int model_load_gguf(model *m, const struct gguf *g, char *err, size_t cap);
/* The embedded default: a deterministic synthetic model (fixed seed) shaped
 * so that attention dominates decode at long context. */
void model_synthetic(model *m, uint32_t ctx);
void model_free(model *m);

/* Sizes. */
static inline uint32_t model_qdim(const model_cfg *c) { return c->n_heads * c->head_dim; }
static inline uint32_t model_kvdim(const model_cfg *c) { return c->n_kv_heads * c->head_dim; }

/* out[n][dim] = RMSNorm of x[n][dim] with weight w. */
void model_rmsnorm(const model_cfg *c, float *out, const float *x, const float *w, size_t n);
/* Y[n][rows] = X[n][cols] W^T (+ bias), W [rows][cols]: one GEMV for n == 1. */
void model_matmul(float *Y, const float *X, const float *W, const float *bias, size_t n,
                  uint32_t rows, uint32_t cols);
/* Rotary embedding of x[n][heads][hd] at positions pos0, pos0 + 1, ... */
void model_rope(const model_cfg *c, float *x, size_t n, uint32_t heads, uint32_t pos0);
/* x[n][dim] += SwiGLU MLP of layer l (scratch h1, h3: [n][hidden]). */
void model_mlp(const model *m, uint32_t l, float *x, size_t n, float *xb, float *h1, float *h3);
/* Causal attention of n queries q[n][H][hd] at positions pos0.. over the
 * keys/values k, v [pos0 + n][Hkv][hd] of this layer, by GEMM in chunks,
 * heads spread over nthreads threads; out[n][H][hd]. The prefill's own
 * attention (kvtier serves decode). */
void model_prefill_attention(const model_cfg *c, const float *q, const float *k,
                             const float *v, size_t n, uint32_t pos0, float *out,
                             uint32_t nthreads);
/* OpenBLAS's thread controls (not in cblas.h). */
void openblas_set_num_threads(int n);
int openblas_get_num_threads(void);

#endif /* KVTD_MODEL_H */
