/* kvtier-decode: model loading and the forward pass's dense parts. */
#include "model.h"

#include <cblas.h>
#include <pthread.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include "gguf.h"

static int fail(char *err, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return -1;
}

void model_free(model *m)
{
    if (m->wcls && m->wcls != m->tok_emb)
        free(m->wcls);
    free(m->tok_emb);
    free(m->rms_att);
    free(m->rms_ffn);
    free(m->wq);
    free(m->wk);
    free(m->wv);
    free(m->wo);
    free(m->bq);
    free(m->bk);
    free(m->bv);
    free(m->w1);
    free(m->w2);
    free(m->w3);
    free(m->rms_final);
    memset(m, 0, sizeof *m);
}

/* Checks a configuration read from a file: every size positive and the
 * products bounded, so that the allocations below cannot overflow. */
static int cfg_check(const model_cfg *c, char *err, size_t cap)
{
    if (!c->dim || !c->hidden || !c->n_layers || !c->n_heads || !c->n_kv_heads ||
        !c->head_dim || !c->vocab)
        return fail(err, cap, "model: a size in the header is 0 (dim %u hidden %u layers %u "
                    "heads %u kv heads %u head_dim %u vocab %u)", c->dim, c->hidden,
                    c->n_layers, c->n_heads, c->n_kv_heads, c->head_dim, c->vocab);
    if (c->n_heads % c->n_kv_heads)
        return fail(err, cap, "model: %u heads are not a multiple of %u KV heads", c->n_heads,
                    c->n_kv_heads);
    if (c->head_dim % 2)
        return fail(err, cap, "model: head_dim %u is odd (RoPE rotates pairs)", c->head_dim);
    const double lim = 1u << 31;
    if ((double)c->dim > 1 << 16 || (double)c->hidden > 1 << 18 || c->n_layers > 1024 ||
        c->n_heads > 1024 || c->head_dim > 1024 || c->vocab > (1u << 22) ||
        (double)c->vocab * c->dim > lim || (double)c->hidden * c->dim > lim ||
        (double)c->n_heads * c->head_dim * c->dim > lim)
        return fail(err, cap, "model: absurd sizes (dim %u hidden %u layers %u heads %u "
                    "head_dim %u vocab %u)", c->dim, c->hidden, c->n_layers, c->n_heads,
                    c->head_dim, c->vocab);
    if (!(c->rope_theta > 0) || !(c->rms_eps > 0) || !(c->rope_scale > 0))
        return fail(err, cap, "model: rope theta %g, scale %g and rms eps %g must be > 0",
                    (double)c->rope_theta, (double)c->rope_scale, (double)c->rms_eps);
    return 0;
}

static float *xalloc(size_t n, char *err, size_t cap, int *rc)
{
    float *p = malloc((n ? n : 1) * sizeof *p);
    if (!p && !*rc)
        *rc = fail(err, cap, "model: out of memory (%zu floats)", n);
    return p;
}

static int alloc_weights(model *m, char *err, size_t cap)
{
    const model_cfg *c = &m->c;
    const size_t L = c->n_layers, d = c->dim, q = model_qdim(c), kv = model_kvdim(c);
    int rc = 0;
    m->tok_emb = xalloc((size_t)c->vocab * d, err, cap, &rc);
    m->rms_att = xalloc(L * d, err, cap, &rc);
    m->rms_ffn = xalloc(L * d, err, cap, &rc);
    m->wq = xalloc(L * q * d, err, cap, &rc);
    m->wk = xalloc(L * kv * d, err, cap, &rc);
    m->wv = xalloc(L * kv * d, err, cap, &rc);
    m->wo = xalloc(L * d * q, err, cap, &rc);
    m->w1 = xalloc(L * c->hidden * d, err, cap, &rc);
    m->w2 = xalloc(L * d * c->hidden, err, cap, &rc);
    m->w3 = xalloc(L * c->hidden * d, err, cap, &rc);
    m->rms_final = xalloc(d, err, cap, &rc);
    if (c->qkv_bias) {
        m->bq = xalloc(L * q, err, cap, &rc);
        m->bk = xalloc(L * kv, err, cap, &rc);
        m->bv = xalloc(L * kv, err, cap, &rc);
    }
    m->wcls = c->tied ? m->tok_emb : xalloc((size_t)c->vocab * d, err, cap, &rc);
    if (rc)
        model_free(m);
    return rc;
}

/* ---- llama2.c checkpoints ---------------------------------------------------- */
int model_load_llama2c(model *m, const char *path, char *err, size_t cap)
{
    memset(m, 0, sizeof *m);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return fail(err, cap, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_size < 28) {
        close(fd);
        return fail(err, cap, "%s: not a llama2.c checkpoint (too small or not a file)", path);
    }
    size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return fail(err, cap, "%s: mmap: %s", path, strerror(errno));
    int32_t h[7];
    memcpy(h, map, sizeof h);
    model_cfg *c = &m->c;
    for (int i = 0; i < 7; i++)
        if (h[i] == 0 || (i != 5 && h[i] < 0) || h[i] == INT32_MIN) {
            munmap(map, size);
            return fail(err, cap, "%s: header field %d is %d: not a llama2.c checkpoint", path,
                        i, h[i]);
        }
    c->dim = (uint32_t)h[0];
    c->hidden = (uint32_t)h[1];
    c->n_layers = (uint32_t)h[2];
    c->n_heads = (uint32_t)h[3];
    c->n_kv_heads = (uint32_t)h[4];
    c->tied = h[5] > 0;
    c->vocab = (uint32_t)(h[5] > 0 ? h[5] : -h[5]);
    c->ctx = (uint32_t)h[6];
    c->head_dim = c->n_heads && c->dim % c->n_heads == 0 ? c->dim / c->n_heads : 0;
    c->rope_theta = 10000.0f;
    c->rope_scale = 1.0f;
    c->rope = ROPE_ADJACENT;
    c->rms_eps = 1e-5f;
    if (cfg_check(c, err, cap)) {
        munmap(map, size);
        return -1;
    }
    const size_t L = c->n_layers, d = c->dim, q = model_qdim(c), kv = model_kvdim(c);
    const size_t hid = c->hidden, hd = c->head_dim;
    size_t need = (size_t)c->vocab * d + L * d + L * q * d + 2 * L * kv * d + L * d * q + L * d +
                  3 * L * hid * d + d + 2 * (size_t)c->ctx * hd / 2 +
                  (c->tied ? 0 : (size_t)c->vocab * d);
    if (need * 4 + 28 != size) {
        munmap(map, size);
        return fail(err, cap, "%s: %zu bytes, the header's shapes need %zu: truncated or "
                    "not a llama2.c checkpoint", path, size, need * 4 + 28);
    }
    if (alloc_weights(m, err, cap)) {
        munmap(map, size);
        return -1;
    }
    const float *p = (const float *)(const void *)((const uint8_t *)map + 28);
#define TAKE(dst, n)                                                                       \
    do {                                                                                   \
        memcpy((dst), p, (n) * sizeof(float));                                             \
        p += (n);                                                                          \
    } while (0)
    TAKE(m->tok_emb, (size_t)c->vocab * d);
    TAKE(m->rms_att, L * d);
    TAKE(m->wq, L * q * d);
    TAKE(m->wk, L * kv * d);
    TAKE(m->wv, L * kv * d);
    TAKE(m->wo, L * d * q);
    TAKE(m->rms_ffn, L * d);
    TAKE(m->w1, L * hid * d);
    TAKE(m->w2, L * d * hid);
    TAKE(m->w3, L * hid * d);
    TAKE(m->rms_final, d);
    p += (size_t)c->ctx * hd; /* freq_cis_real and _imag, recomputed here */
    if (!c->tied)
        TAKE(m->wcls, (size_t)c->vocab * d);
#undef TAKE
    munmap(map, size);
    snprintf(m->desc, sizeof m->desc, "llama2.c checkpoint %s", path);
    return 0;
}

/* ---- GGUF ------------------------------------------------------------------------ */
static int gguf_u32(const gguf *g, const char *arch, const char *key, uint32_t *out, int required,
                    char *err, size_t cap)
{
    char k[160];
    snprintf(k, sizeof k, "%s.%s", arch, key);
    uint64_t v;
    if (gguf_get_u64(g, k, &v)) {
        if (required)
            return fail(err, cap, "gguf: key %s is missing", k);
        return 1;
    }
    if (v > UINT32_MAX)
        return fail(err, cap, "gguf: %s = %llu is out of range", k, (unsigned long long)v);
    *out = (uint32_t)v;
    return 0;
}

/* Copies tensor `name` widened to f32 into dst, checking its shape is
 * [rows][cols] (dims[0] = cols). */
static int take_tensor(const gguf *g, const char *name, float *dst, uint64_t rows, uint64_t cols,
                       char *err, size_t cap)
{
    const gguf_tensor *t = gguf_tensor_find(g, name);
    if (!t)
        return fail(err, cap, "gguf: tensor %s is missing", name);
    uint64_t r = 1;
    for (uint32_t i = 1; i < t->n_dims; i++)
        r *= t->dims[i];
    if (t->dims[0] != cols || r != rows)
        return fail(err, cap, "gguf: tensor %s is %llu x %llu, the header says %llu x %llu",
                    name, (unsigned long long)r, (unsigned long long)t->dims[0],
                    (unsigned long long)rows, (unsigned long long)cols);
    return gguf_tensor_f32(t, dst, err, cap);
}

int model_load_gguf(model *m, const gguf *g, char *err, size_t cap)
{
    memset(m, 0, sizeof *m);
    gguf_str a;
    if (gguf_get_str(g, "general.architecture", &a))
        return fail(err, cap, "gguf: general.architecture is missing");
    char arch[64];
    if (a.n >= sizeof arch)
        return fail(err, cap, "gguf: architecture name too long");
    memcpy(arch, a.p, a.n);
    arch[a.n] = 0;
    model_cfg *c = &m->c;
    if (!strcmp(arch, "llama"))
        c->rope = ROPE_ADJACENT;
    else if (!strcmp(arch, "qwen2"))
        c->rope = ROPE_HALVES;
    else
        return fail(err, cap, "gguf: architecture '%s' is not supported (llama, qwen2)", arch);
    if (gguf_u32(g, arch, "embedding_length", &c->dim, 1, err, cap) ||
        gguf_u32(g, arch, "feed_forward_length", &c->hidden, 1, err, cap) ||
        gguf_u32(g, arch, "block_count", &c->n_layers, 1, err, cap) ||
        gguf_u32(g, arch, "attention.head_count", &c->n_heads, 1, err, cap))
        return -1;
    c->n_kv_heads = c->n_heads;
    if (gguf_u32(g, arch, "attention.head_count_kv", &c->n_kv_heads, 0, err, cap) < 0)
        return -1;
    c->ctx = 2048;
    if (gguf_u32(g, arch, "context_length", &c->ctx, 0, err, cap) < 0)
        return -1;
    c->head_dim = c->n_heads && c->dim % c->n_heads == 0 ? c->dim / c->n_heads : 0;
    if (gguf_u32(g, arch, "attention.key_length", &c->head_dim, 0, err, cap) < 0)
        return -1;
    char k[160];
    c->rope_theta = 10000.0f;
    snprintf(k, sizeof k, "%s.rope.freq_base", arch);
    gguf_get_f32(g, k, &c->rope_theta);
    c->rms_eps = 1e-5f;
    snprintf(k, sizeof k, "%s.attention.layer_norm_rms_epsilon", arch);
    gguf_get_f32(g, k, &c->rms_eps);
    c->rope_scale = 1.0f;
    snprintf(k, sizeof k, "%s.rope.scaling.factor", arch);
    gguf_str st;
    char sk[160];
    snprintf(sk, sizeof sk, "%s.rope.scaling.type", arch);
    if (!gguf_get_str(g, sk, &st) && gguf_str_eq(st, "linear"))
        gguf_get_f32(g, k, &c->rope_scale);
    const gguf_tensor *emb = gguf_tensor_find(g, "token_embd.weight");
    if (!emb || emb->n_dims != 2)
        return fail(err, cap, "gguf: tensor token_embd.weight is missing or not 2-D");
    if (emb->dims[1] > (1u << 22))
        return fail(err, cap, "gguf: vocabulary of %llu tokens is absurd",
                    (unsigned long long)emb->dims[1]);
    c->vocab = (uint32_t)emb->dims[1];
    c->tied = gguf_tensor_find(g, "output.weight") == NULL;
    c->qkv_bias = gguf_tensor_find(g, "blk.0.attn_q.bias") != NULL;
    if (cfg_check(c, err, cap) || alloc_weights(m, err, cap))
        return -1;
    const uint64_t d = c->dim, q = model_qdim(c), kv = model_kvdim(c), hid = c->hidden;
    int rc = take_tensor(g, "token_embd.weight", m->tok_emb, c->vocab, d, err, cap);
    if (!rc)
        rc = take_tensor(g, "output_norm.weight", m->rms_final, 1, d, err, cap);
    if (!rc && !c->tied)
        rc = take_tensor(g, "output.weight", m->wcls, c->vocab, d, err, cap);
    for (uint32_t l = 0; l < c->n_layers && !rc; l++) {
        char n[96];
#define T(suffix, dst, rows, cols)                                                         \
    do {                                                                                   \
        snprintf(n, sizeof n, "blk.%u." suffix, l);                                        \
        if (!rc)                                                                           \
            rc = take_tensor(g, n, (dst), (rows), (cols), err, cap);                       \
    } while (0)
        T("attn_norm.weight", m->rms_att + l * d, 1, d);
        T("attn_q.weight", m->wq + l * q * d, q, d);
        T("attn_k.weight", m->wk + l * kv * d, kv, d);
        T("attn_v.weight", m->wv + l * kv * d, kv, d);
        T("attn_output.weight", m->wo + l * d * q, d, q);
        T("ffn_norm.weight", m->rms_ffn + l * d, 1, d);
        T("ffn_gate.weight", m->w1 + l * hid * d, hid, d);
        T("ffn_down.weight", m->w2 + l * d * hid, d, hid);
        T("ffn_up.weight", m->w3 + l * hid * d, hid, d);
        if (c->qkv_bias) {
            T("attn_q.bias", m->bq + l * q, 1, q);
            T("attn_k.bias", m->bk + l * kv, 1, kv);
            T("attn_v.bias", m->bv + l * kv, 1, kv);
        }
#undef T
    }
    if (rc) {
        model_free(m);
        return -1;
    }
    snprintf(m->desc, sizeof m->desc, "GGUF %s model", arch);
    return 0;
}

/* ---- the embedded default ------------------------------------------------------ */
static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void fill_uniform(float *p, size_t n, float a, uint64_t *s)
{
    for (size_t i = 0; i < n; i++)
        p[i] = a * ((float)(rng_next(s) >> 40) / (float)(1u << 24) * 2.0f - 1.0f);
}

void model_synthetic(model *m, uint32_t ctx)
{
    memset(m, 0, sizeof *m);
    model_cfg *c = &m->c;
    /* Narrow model, many KV heads: 16 KV heads x 64 = 1024 K and 1024 V
     * values per token and layer against a 128-wide residual stream, so the
     * KV cache (not the weights, 1.3 MiB a layer) is what a long-context
     * decode reads: 32 MiB a layer at 16k tokens in f16. */
    c->dim = 128;
    c->hidden = 256;
    c->n_layers = 4;
    c->n_heads = 16;
    c->n_kv_heads = 16;
    c->head_dim = 64;
    c->vocab = 512;
    c->ctx = ctx;
    c->rope_theta = 500000.0f;
    c->rope_scale = 1.0f;
    c->rope = ROPE_ADJACENT;
    c->rms_eps = 1e-5f;
    c->tied = 1;
    c->qkv_bias = 1;
    char err[128];
    if (alloc_weights(m, err, sizeof err)) {
        fprintf(stderr, "kvtier-decode: %s\n", err);
        exit(1);
    }
    uint64_t s = 0x6b767469657221ull; /* fixed seed: the same model everywhere */
    const size_t L = c->n_layers, d = c->dim, q = model_qdim(c), kv = model_kvdim(c);
    fill_uniform(m->tok_emb, (size_t)c->vocab * d, 1.0f, &s);
    for (size_t i = 0; i < L * d; i++)
        m->rms_att[i] = m->rms_ffn[i] = 1.0f;
    for (size_t i = 0; i < d; i++)
        m->rms_final[i] = 1.0f;
    /* Uniform(-a, a) with variance 1/fan_in. */
    fill_uniform(m->wq, L * q * d, sqrtf(3.0f / (float)d), &s);
    fill_uniform(m->wk, L * kv * d, sqrtf(3.0f / (float)d), &s);
    memset(m->bq, 0, L * q * sizeof *m->bq);
    memset(m->bk, 0, L * kv * sizeof *m->bk);
    memset(m->bv, 0, L * kv * sizeof *m->bv);
    /* Structure, so that attention has something to find: in each head the
     * last 8 dimensions (the slowest RoPE pairs, nearly position-free over
     * the context) carry a fixed query direction u (a bias) and keys along u
     * scaled by the token's projection on a direction e of the residual
     * stream. Each head then prefers the same tokens step after step (a
     * "stable" head, in FlexiCache's sense), with the random parts of the
     * projections as noise around that preference. */
    const uint32_t hd = c->head_dim, U = 8, G = c->n_heads / c->n_kv_heads;
    float *e = xalloc(d, err, sizeof err, &(int){0});
    for (size_t l = 0; l < L; l++)
        for (uint32_t kh = 0; kh < c->n_kv_heads; kh++) {
            fill_uniform(e, d, 1.0f, &s);
            double n2 = 0;
            for (size_t i = 0; i < d; i++)
                n2 += (double)e[i] * e[i];
            for (size_t i = 0; i < d; i++)
                e[i] = (float)(e[i] / sqrt(n2));
            for (uint32_t j = 0; j < U; j++) {
                const float sign = (rng_next(&s) >> 63) ? 1.0f : -1.0f;
                const float uj = sign / sqrtf((float)U);
                const size_t row = (size_t)kh * hd + hd - U + j;
                for (size_t i = 0; i < d; i++)
                    m->wk[(l * kv + row) * d + i] += 4.0f * uj * e[i];
                for (uint32_t g = 0; g < G; g++)
                    m->bq[l * q + (size_t)(kh * G + g) * hd + hd - U + j] = 4.0f * uj;
            }
        }
    free(e);
    fill_uniform(m->wv, L * kv * d, sqrtf(3.0f / (float)d), &s);
    fill_uniform(m->wo, L * d * q, sqrtf(3.0f / (float)q), &s);
    fill_uniform(m->w1, L * c->hidden * d, sqrtf(3.0f / (float)d), &s);
    fill_uniform(m->w3, L * c->hidden * d, sqrtf(3.0f / (float)d), &s);
    fill_uniform(m->w2, L * d * c->hidden, sqrtf(3.0f / (float)c->hidden), &s);
    snprintf(m->desc, sizeof m->desc, "embedded synthetic model (seed fixed)");
}

/* ---- forward pieces -------------------------------------------------------------- */
void model_rmsnorm(const model_cfg *c, float *out, const float *x, const float *w, size_t n)
{
    for (size_t r = 0; r < n; r++) {
        const float *xr = x + r * c->dim;
        float *o = out + r * c->dim;
        double ss = 0;
        for (uint32_t i = 0; i < c->dim; i++)
            ss += (double)xr[i] * xr[i];
        const float inv = 1.0f / sqrtf((float)(ss / c->dim) + c->rms_eps);
        for (uint32_t i = 0; i < c->dim; i++)
            o[i] = xr[i] * inv * w[i];
    }
}

/* y = W x for one token: a dot product per row. Decode's matrices are
 * small (the synthetic model's are 128 to 1024 wide), where BLAS's
 * per-call overhead exceeds the work; this loop vectorises (-fopenmp-simd)
 * and is compiled for AVX-512, AVX2 and the baseline, picked at load. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void gemv_rows(float *y, const float *W, const float *x, uint32_t rows, uint32_t cols)
{
    for (uint32_t r = 0; r < rows; r++) {
        const float *w = W + (size_t)r * cols;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (uint32_t j = 0; j < cols; j++)
            acc += w[j] * x[j];
        y[r] = acc;
    }
}

void model_matmul(float *Y, const float *X, const float *W, const float *bias, size_t n,
                  uint32_t rows, uint32_t cols)
{
    if (n == 1)
        gemv_rows(Y, W, X, rows, cols);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)rows, (int)cols, 1.0f,
                    X, (int)cols, W, (int)cols, 0.0f, Y, (int)rows);
    if (bias)
        for (size_t r = 0; r < n; r++)
            for (uint32_t i = 0; i < rows; i++)
                Y[r * rows + i] += bias[i];
}

void model_rope(const model_cfg *c, float *x, size_t n, uint32_t heads, uint32_t pos0)
{
    const uint32_t hd = c->head_dim, half = hd / 2;
    for (size_t r = 0; r < n; r++) {
        const double pos = (double)(pos0 + r) / c->rope_scale;
        for (uint32_t i = 0; i < half; i++) {
            const double freq = pow((double)c->rope_theta, -2.0 * i / hd);
            const float cs = (float)cos(pos * freq), sn = (float)sin(pos * freq);
            for (uint32_t h = 0; h < heads; h++) {
                float *v = x + (r * heads + h) * hd;
                const uint32_t a = c->rope == ROPE_ADJACENT ? 2 * i : i;
                const uint32_t b = c->rope == ROPE_ADJACENT ? 2 * i + 1 : i + half;
                const float x0 = v[a], x1 = v[b];
                v[a] = x0 * cs - x1 * sn;
                v[b] = x0 * sn + x1 * cs;
            }
        }
    }
}

void model_mlp(const model *m, uint32_t l, float *x, size_t n, float *xb, float *h1, float *h3)
{
    const model_cfg *c = &m->c;
    const size_t d = c->dim, hid = c->hidden;
    model_rmsnorm(c, xb, x, m->rms_ffn + l * d, n);
    model_matmul(h1, xb, m->w1 + l * hid * d, NULL, n, c->hidden, c->dim);
    model_matmul(h3, xb, m->w3 + l * hid * d, NULL, n, c->hidden, c->dim);
    for (size_t i = 0; i < n * hid; i++)
        h1[i] = h1[i] / (1.0f + expf(-h1[i])) * h3[i];
    model_matmul(xb, h1, m->w2 + l * d * hid, NULL, n, c->dim, c->hidden);
    for (size_t i = 0; i < n * d; i++)
        x[i] += xb[i];
}

/* e^x for x <= 0 (softmax after subtracting the maximum): 2^n * e^r with
 * |r| <= ln2/2 and a degree-6 polynomial, relative error about 2e-7; plain
 * arithmetic so the softmax loop vectorises. Underflows to 0 below -87. */
static inline float exp_neg(float x)
{
    if (x < -87.0f)
        return 0.0f;
    /* Round to nearest by the 1.5 * 2^23 trick (no libm call, so the
     * loop vectorises). */
    const float n = (x * 1.44269504089f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union {
        uint32_t u;
        float f;
    } sc = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return p * sc.f;
}

typedef struct {
    const model_cfg *c;
    const float *q, *k, *v;
    size_t n;
    uint32_t pos0, tid, nthreads;
    float *out;
} attn_job;

/* The heads h with h % nthreads == tid, one GEMM pair per chunk of queries. */
static void *attn_heads(void *arg)
{
    const attn_job *j = arg;
    const model_cfg *c = j->c;
    const uint32_t H = c->n_heads, G = c->n_heads / c->n_kv_heads, hd = c->head_dim;
    const size_t qld = (size_t)H * hd, kvld = (size_t)c->n_kv_heads * hd;
    const size_t CH = 256; /* queries per GEMM */
    const float scale = 1.0f / sqrtf((float)hd);
    const size_t n = j->n, pos0 = j->pos0;
    float *S = malloc(CH * (pos0 + n) * sizeof *S);
    if (!S) {
        fprintf(stderr, "kvtier-decode: out of memory in prefill attention\n");
        exit(1);
    }
    for (uint32_t h = j->tid; h < H; h += j->nthreads) {
        const float *K = j->k + (size_t)(h / G) * hd, *V = j->v + (size_t)(h / G) * hd;
        for (size_t i0 = 0; i0 < n; i0 += CH) {
            const size_t nc = n - i0 < CH ? n - i0 : CH;
            const size_t T = pos0 + i0 + nc; /* keys the chunk's last query sees */
            const float *Q = j->q + i0 * qld + (size_t)h * hd;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nc, (int)T, (int)hd, scale,
                        Q, (int)qld, K, (int)kvld, 0.0f, S, (int)T);
            for (size_t r = 0; r < nc; r++) {
                float *s = S + r * T;
                const size_t lim = pos0 + i0 + r + 1; /* causal */
                float mx = -INFINITY;
                for (size_t t = 0; t < lim; t++)
                    mx = s[t] > mx ? s[t] : mx;
                float z = 0;
                for (size_t t = 0; t < lim; t++) {
                    s[t] = exp_neg(s[t] - mx);
                    z += s[t];
                }
                const float inv = 1.0f / z;
                for (size_t t = 0; t < lim; t++)
                    s[t] *= inv;
                for (size_t t = lim; t < T; t++)
                    s[t] = 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nc, (int)hd, (int)T, 1.0f,
                        S, (int)T, V, (int)kvld, 0.0f, j->out + i0 * qld + (size_t)h * hd,
                        (int)qld);
        }
    }
    free(S);
    return NULL;
}

void model_prefill_attention(const model_cfg *c, const float *q, const float *k,
                             const float *v, size_t n, uint32_t pos0, float *out,
                             uint32_t nthreads)
{
    /* Heads split over our own threads, each running single-threaded BLAS
     * (OpenBLAS's threads would spin while the softmax runs). */
    if (nthreads < 1)
        nthreads = 1;
    if (nthreads > 64)
        nthreads = 64;
    int was = openblas_get_num_threads();
    openblas_set_num_threads(1);
    pthread_t th[64];
    attn_job jobs[64];
    for (uint32_t t = 0; t < nthreads; t++) {
        jobs[t] = (attn_job){c, q, k, v, n, pos0, t, nthreads, out};
        if (t && pthread_create(&th[t], NULL, attn_heads, &jobs[t]) != 0) {
            fprintf(stderr, "kvtier-decode: cannot start a thread\n");
            exit(1);
        }
    }
    attn_heads(&jobs[0]);
    for (uint32_t t = 1; t < nthreads; t++)
        pthread_join(th[t], NULL);
    openblas_set_num_threads(was);
}
