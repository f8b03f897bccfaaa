/* The example decoder's model path end to end (examples/decode/: gguf.c,
 * model.c, tokenizer.c, engine.c), against a tiny llama-architecture GGUF
 * written here by a GGUF writer of this file's own:
 *  - the configuration and every weight read back by model_load_gguf, the
 *    weights compared with values widened here from the bytes written (F32,
 *    F16 and Q8_0 tensors mixed);
 *  - the GPT-2 byte-level BPE tokenizer of the file (tok_from_gguf): merges
 *    applied, decode(encode(text)) == text;
 *  - the engine's logits after engine_prefill and after each engine_decode
 *    step against an independent forward pass in double computed here
 *    (RMSNorm, adjacent-pair RoPE, GQA attention, SwiGLU, untied output),
 *    through a dense cache and a tiered cache whose budget covers the whole
 *    context (which must then equal the dense one bit for bit);
 *  - malformed models: a tensor of the wrong shape, an unsupported tensor
 *    type, a missing tensor, an unsupported architecture, absurd sizes: each
 *    -1 with a message, nothing leaked. */
#include "testutil.h"

#include <fcntl.h>
#include <unistd.h>

#include "engine.h"
#include "gguf.h"
#include "model.h"
#include "tokenizer.h"

#include "gguf_writer.h"

/* ---- the tiny model's shape ------------------------------------------------------ */
enum { DIM = 32, HID = 48, NL = 2, NH = 4, NKV = 2, HD = DIM / NH, CTX = 64 };
#define QD (NH * HD)
#define KVD (NKV * HD)
#define THETA 10000.0f
#define EPS 1e-5f

/* ---- metadata helpers over gguf_writer.h ------------------------------------------ */
static void kv_str(wb *w, const char *key, const char *v)
{
    w_key(w, key, GGUF_T_STRING);
    w_str(w, v);
}
/* An integer: u32, or u64 when it does not fit. */
static void kv_uint(wb *w, const char *key, uint64_t v)
{
    if (v > UINT32_MAX) {
        w_key(w, key, GGUF_T_U64);
        w_le(w, v, 8);
    } else {
        w_key(w, key, GGUF_T_U32);
        w_le(w, v, 4);
    }
}
static void kv_f32(wb *w, const char *key, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    w_key(w, key, GGUF_T_F32);
    w_le(w, u, 4);
}
static void kv_strarr(wb *w, const char *key, char **v, uint64_t n)
{
    w_key(w, key, GGUF_T_ARRAY);
    w_le(w, GGUF_T_STRING, 4);
    w_le(w, n, 8);
    for (uint64_t i = 0; i < n; i++)
        w_str(w, v[i]);
}

/* ---- f16 and Q8_0, from the definitions ------------------------------------------- */
/* The f16 encoding of x rounded to nearest, ties to even (x finite). The
 * quantum of x's binade is 2^(e - 10) (e >= -14: subnormals share the
 * quantum of the smallest normal binade); nearbyint rounds ties to even in
 * the default rounding mode. */
static uint16_t f16_bits(double x)
{
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs(x);
    if (a == 0)
        return sign;
    if (a >= 65520.0) /* max 65504 + half an ulp (16) and on: overflow */
        return (uint16_t)(sign | 0x7c00);
    int e = ilogb(a);
    if (e < -14)
        e = -14;
    double m = nearbyint(ldexp(a, 10 - e));
    if (m >= 2048) { /* rounded up into the next binade */
        m /= 2;
        e++;
    }
    if (m < 1024) /* subnormal (e == -14) */
        return (uint16_t)(sign | (uint16_t)m);
    return (uint16_t)(sign | (uint16_t)((e + 15) << 10) | (uint16_t)(m - 1024));
}
static double f16_round(double x)
{
    return tu_f16_value(f16_bits(x));
}

/* ---- tensors ---------------------------------------------------------------------- */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q8_0 = 8 };

typedef struct {
    char name[64];
    uint64_t rows, cols; /* dims = [cols, rows] (1-D when rows == 0) */
    uint32_t type;
    uint8_t *bytes;
    size_t nbytes;
    double *val; /* [rows][cols] widened here from bytes */
} ttensor;

/* Encodes x[n] (n = rows * cols) as type, then widens the bytes back. */
static void t_encode(ttensor *t, const double *x)
{
    const size_t n = (size_t)(t->rows ? t->rows : 1) * t->cols;
    t->val = calloc(n, sizeof *t->val);
    assert_non_null(t->val);
    switch (t->type) {
    case T_F32:
        t->nbytes = 4 * n;
        t->bytes = malloc(t->nbytes);
        for (size_t i = 0; i < n; i++) {
            float f = (float)x[i];
            memcpy(t->bytes + 4 * i, &f, 4);
            float g;
            memcpy(&g, t->bytes + 4 * i, 4);
            t->val[i] = g;
        }
        break;
    case T_F16:
        t->nbytes = 2 * n;
        t->bytes = malloc(t->nbytes);
        for (size_t i = 0; i < n; i++) {
            uint16_t h = f16_bits(x[i]);
            t->bytes[2 * i] = (uint8_t)h;
            t->bytes[2 * i + 1] = (uint8_t)(h >> 8);
            t->val[i] = tu_f16_value((uint16_t)(t->bytes[2 * i] | t->bytes[2 * i + 1] << 8));
        }
        break;
    case T_Q8_0:
        assert_int_equal(n % 32, 0);
        t->nbytes = n / 32 * 34;
        t->bytes = malloc(t->nbytes);
        for (size_t b = 0; b < n / 32; b++) {
            double amax = 0;
            for (int k = 0; k < 32; k++)
                amax = fmax(amax, fabs(x[32 * b + k]));
            uint16_t dh = f16_bits(amax / 127);
            double d = tu_f16_value(dh);
            uint8_t *q = t->bytes + 34 * b;
            q[0] = (uint8_t)dh;
            q[1] = (uint8_t)(dh >> 8);
            for (int k = 0; k < 32; k++) {
                double r = d > 0 ? nearbyint(x[32 * b + k] / d) : 0;
                r = r > 127 ? 127 : r < -127 ? -127 : r;
                q[2 + k] = (uint8_t)(int8_t)r;
            }
            /* Widened from the bytes. */
            double dd = tu_f16_value((uint16_t)(q[0] | q[1] << 8));
            for (int k = 0; k < 32; k++)
                t->val[32 * b + k] = dd * (double)(int8_t)q[2 + k];
        }
        break;
    case T_Q4_0: /* only for the unsupported-type case: bytes, no values */
        assert_int_equal(n % 32, 0);
        t->nbytes = n / 32 * 18;
        t->bytes = calloc(t->nbytes, 1);
        break;
    default:
        fail_msg("type %u", t->type);
    }
    assert_non_null(t->bytes);
}

/* ---- the model description and its variants ----------------------------------------- */
typedef struct {
    const char *arch;       /* "llama" unless set */
    uint64_t dim_key;       /* embedding_length written (DIM unless set) */
    const char *bad_rows;   /* this tensor gets 8 rows fewer than the header implies */
    const char *q4;         /* this tensor is written as Q4_0 */
    const char *omit;       /* this tensor is left out */
    int tied;               /* no output.weight */
} variant;

typedef struct {
    ttensor t[64];
    int nt;
    char **toks;
    uint32_t vocab;
    char **merges;
    uint32_t n_merges;
    int32_t bos, eos;
    wb file;
} tmodel;

/* GPT-2's bytes_to_unicode, written here: printable latin-1 bytes map to
 * themselves, the rest in byte order to U+0100 on. */
static void byte_syms(char sym[256][4])
{
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        uint32_t cp = printable ? b : next++;
        if (cp < 0x80) {
            sym[b][0] = (char)cp;
            sym[b][1] = 0;
        } else {
            sym[b][0] = (char)(0xc0 | (cp >> 6));
            sym[b][1] = (char)(0x80 | (cp & 0x3f));
            sym[b][2] = 0;
        }
    }
}

/* Merges in rank order ("a b", with Ġ = U+0120 for a space); each result is
 * a token after the 256 byte symbols. */
static const char *const MERGES[] = {"Ġ t", "h e",  "Ġt he", "i n", "Ġ a",  "e r",
                                     "o n", "Ġa n", "Ġan d", "l l", "Ġ w", "o r"};
#define N_MERGES (sizeof MERGES / sizeof MERGES[0])

static void build_vocab(tmodel *tm)
{
    char sym[256][4];
    byte_syms(sym);
    tm->vocab = 256 + (uint32_t)N_MERGES + 2;
    tm->toks = calloc(tm->vocab, sizeof *tm->toks);
    tm->merges = calloc(N_MERGES, sizeof *tm->merges);
    assert_non_null(tm->toks);
    assert_non_null(tm->merges);
    for (int b = 0; b < 256; b++)
        tm->toks[b] = strdup(sym[b]);
    for (size_t r = 0; r < N_MERGES; r++) {
        tm->merges[r] = strdup(MERGES[r]);
        char *s = strdup(MERGES[r]), *sp = strchr(s, ' ');
        memmove(sp, sp + 1, strlen(sp + 1) + 1);
        tm->toks[256 + r] = s;
    }
    tm->n_merges = (uint32_t)N_MERGES;
    tm->bos = (int32_t)(256 + N_MERGES);
    tm->eos = tm->bos + 1;
    tm->toks[tm->bos] = strdup("<|begin_of_text|>");
    tm->toks[tm->eos] = strdup("<|end_of_text|>");
}

static void add_tensor(tmodel *tm, const variant *v, const char *name, uint64_t rows,
                       uint64_t cols, uint32_t type, double scale, double offset, tu_rng *r)
{
    if (v->omit && !strcmp(v->omit, name))
        return;
    assert_true(tm->nt < 64);
    ttensor *t = &tm->t[tm->nt++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->rows = rows;
    t->cols = cols;
    t->type = type;
    if (v->bad_rows && !strcmp(v->bad_rows, name))
        t->rows -= 8;
    if (v->q4 && !strcmp(v->q4, name))
        t->type = T_Q4_0;
    const size_t n = (size_t)(t->rows ? t->rows : 1) * cols;
    double *x = malloc(n * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < n; i++)
        x[i] = offset + scale * tu_unit(r);
    t_encode(t, x);
    free(x);
}

/* The whole file into tm->file. Weights uniform with variance about
 * 1/fan_in (activations stay O(1)), norms 1 +- 0.2; types mixed per layer. */
static void build_model(tmodel *tm, const variant *v)
{
    memset(tm, 0, sizeof *tm);
    build_vocab(tm);
    tu_rng r = {0x6d6f64656c2121ull};
    const uint32_t V = tm->vocab;
    const double sd = sqrt(3.0 / DIM), sq = sqrt(3.0 / QD), sh = sqrt(3.0 / HID);
    add_tensor(tm, v, "token_embd.weight", V, DIM, T_Q8_0, 1.0, 0, &r);
    add_tensor(tm, v, "output_norm.weight", 0, DIM, T_F32, 0.2, 1.0, &r);
    if (!v->tied)
        add_tensor(tm, v, "output.weight", V, DIM, T_F16, 2 * sd, 0, &r);
    /* Types per layer: {attn_norm, q, k, v, o, ffn_norm, gate, down, up};
     * ffn_down's rows are HID = 48 long, not a multiple of Q8_0's 32. */
    static const uint32_t types[NL][9] = {
        {T_F32, T_Q8_0, T_F16, T_F32, T_Q8_0, T_F32, T_F16, T_F32, T_Q8_0},
        {T_F16, T_F16, T_Q8_0, T_Q8_0, T_F32, T_F16, T_Q8_0, T_F16, T_F32},
    };
    for (int l = 0; l < NL; l++) {
        char n[64];
#define ADD(i, suffix, rows, cols, sc, off)                                                \
    do {                                                                                   \
        snprintf(n, sizeof n, "blk.%d." suffix, l);                                        \
        add_tensor(tm, v, n, rows, cols, types[l][i], sc, off, &r);                        \
    } while (0)
        ADD(0, "attn_norm.weight", 0, DIM, 0.2, 1.0);
        ADD(1, "attn_q.weight", QD, DIM, 2 * sd, 0); /* x2: attention not uniform */
        ADD(2, "attn_k.weight", KVD, DIM, 2 * sd, 0);
        ADD(3, "attn_v.weight", KVD, DIM, sd, 0);
        ADD(4, "attn_output.weight", DIM, QD, sq, 0);
        ADD(5, "ffn_norm.weight", 0, DIM, 0.2, 1.0);
        ADD(6, "ffn_gate.weight", HID, DIM, sd, 0);
        ADD(7, "ffn_down.weight", DIM, HID, sh, 0);
        ADD(8, "ffn_up.weight", HID, DIM, sd, 0);
#undef ADD
    }

    wb kv = {0};
    uint64_t n_kv = 0;
    kv_str(&kv, "general.architecture", v->arch ? v->arch : "llama"), n_kv++;
    char k[96];
    const char *a = v->arch ? v->arch : "llama";
#define KU(key, val) (snprintf(k, sizeof k, "%s." key, a), kv_uint(&kv, k, (val)), n_kv++)
#define KF(key, val) (snprintf(k, sizeof k, "%s." key, a), kv_f32(&kv, k, (val)), n_kv++)
    KU("embedding_length", v->dim_key ? v->dim_key : DIM);
    KU("feed_forward_length", HID);
    KU("block_count", NL);
    KU("attention.head_count", NH);
    KU("attention.head_count_kv", NKV);
    KU("context_length", CTX);
    KF("rope.freq_base", THETA);
    KF("attention.layer_norm_rms_epsilon", EPS);
#undef KU
#undef KF
    kv_str(&kv, "tokenizer.ggml.model", "gpt2"), n_kv++;
    kv_strarr(&kv, "tokenizer.ggml.tokens", tm->toks, tm->vocab), n_kv++;
    kv_strarr(&kv, "tokenizer.ggml.merges", tm->merges, tm->n_merges), n_kv++;
    kv_uint(&kv, "tokenizer.ggml.bos_token_id", (uint64_t)tm->bos), n_kv++;
    kv_uint(&kv, "tokenizer.ggml.eos_token_id", (uint64_t)tm->eos), n_kv++;

    /* Header, metadata, tensor infos (offsets at multiples of 32), data. */
    wb *w = &tm->file;
    wb_put(w, "GGUF", 4);
    w_le(w, 3, 4);
    w_le(w, (uint64_t)tm->nt, 8);
    w_le(w, n_kv, 8);
    wb_put(w, kv.p, kv.n);
    wb_free(&kv);
    uint64_t off = 0;
    for (int i = 0; i < tm->nt; i++) {
        const ttensor *t = &tm->t[i];
        w_str(w, t->name);
        w_le(w, t->rows ? 2 : 1, 4);
        w_le(w, t->cols, 8);
        if (t->rows)
            w_le(w, t->rows, 8);
        w_le(w, t->type, 4);
        w_le(w, off, 8);
        off = (off + t->nbytes + 31) / 32 * 32;
    }
    static const uint8_t zero[32];
    wb_put(w, zero, (32 - w->n % 32) % 32);
    for (int i = 0; i < tm->nt; i++) {
        wb_put(w, tm->t[i].bytes, tm->t[i].nbytes);
        wb_put(w, zero, (32 - w->n % 32) % 32);
    }
}

static void free_model(tmodel *tm)
{
    for (int i = 0; i < tm->nt; i++) {
        free(tm->t[i].bytes);
        free(tm->t[i].val);
    }
    for (uint32_t i = 0; i < tm->vocab; i++)
        free(tm->toks[i]);
    for (uint32_t i = 0; i < tm->n_merges; i++)
        free(tm->merges[i]);
    free(tm->toks);
    free(tm->merges);
    wb_free(&tm->file);
}

static const ttensor *tfind(const tmodel *tm, const char *fmt, int l)
{
    char n[64];
    snprintf(n, sizeof n, fmt, l);
    for (int i = 0; i < tm->nt; i++)
        if (!strcmp(tm->t[i].name, n))
            return &tm->t[i];
    fail_msg("no tensor %s", n);
    return NULL;
}

/* Writes the file to a temporary path and maps it with gguf_open. */
static void open_file(const tmodel *tm, gguf *g, char *path, size_t cap)
{
    const char *dir = getenv("TMPDIR");
    snprintf(path, cap, "%s/kvt_decode_model_XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    size_t at = 0;
    while (at < tm->file.n) {
        ssize_t k = write(fd, tm->file.p + at, tm->file.n - at);
        assert_true(k > 0);
        at += (size_t)k;
    }
    close(fd);
    char err[256] = "";
    if (gguf_open(path, g, err, sizeof err))
        fail_msg("gguf_open: %s", err);
}

/* ---- the reference forward pass, in double ---------------------------------------- */
typedef struct {
    const tmodel *tm;
    const double *emb, *wcls, *fin;
    const double *an[NL], *wq[NL], *wk[NL], *wv[NL], *wo[NL], *fn[NL], *w1[NL], *w2[NL],
        *w3[NL];
    double K[NL][CTX][KVD], V[NL][CTX][KVD];   /* as computed */
    double Kh[NL][CTX][KVD], Vh[NL][CTX][KVD]; /* rounded to f16, as the pool stores them */
} ref;

static void ref_init(ref *R, const tmodel *tm, int tied)
{
    memset(R, 0, sizeof *R);
    R->tm = tm;
    R->emb = tfind(tm, "token_embd.weight", 0)->val;
    R->wcls = tied ? R->emb : tfind(tm, "output.weight", 0)->val;
    R->fin = tfind(tm, "output_norm.weight", 0)->val;
    for (int l = 0; l < NL; l++) {
        R->an[l] = tfind(tm, "blk.%d.attn_norm.weight", l)->val;
        R->wq[l] = tfind(tm, "blk.%d.attn_q.weight", l)->val;
        R->wk[l] = tfind(tm, "blk.%d.attn_k.weight", l)->val;
        R->wv[l] = tfind(tm, "blk.%d.attn_v.weight", l)->val;
        R->wo[l] = tfind(tm, "blk.%d.attn_output.weight", l)->val;
        R->fn[l] = tfind(tm, "blk.%d.ffn_norm.weight", l)->val;
        R->w1[l] = tfind(tm, "blk.%d.ffn_gate.weight", l)->val;
        R->w2[l] = tfind(tm, "blk.%d.ffn_down.weight", l)->val;
        R->w3[l] = tfind(tm, "blk.%d.ffn_up.weight", l)->val;
    }
}

static void r_rmsnorm(double *o, const double *x, const double *w, int n)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    const double inv = 1.0 / sqrt(ss / n + (double)EPS);
    for (int i = 0; i < n; i++)
        o[i] = x[i] * inv * w[i];
}
/* y[rows] = W[rows][cols] x[cols] */
static void r_matvec(double *y, const double *W, const double *x, int rows, int cols)
{
    for (int r = 0; r < rows; r++) {
        double acc = 0;
        for (int c = 0; c < cols; c++)
            acc += W[(size_t)r * cols + c] * x[c];
        y[r] = acc;
    }
}
/* Adjacent pairs (2i, 2i+1) rotated by pos * theta^(-2i/hd). */
static void r_rope(double *x, int heads, int pos)
{
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < HD / 2; i++) {
            const double ang = pos * pow((double)THETA, -2.0 * i / HD);
            double *p = x + h * HD + 2 * i, x0 = p[0], x1 = p[1];
            p[0] = x0 * cos(ang) - x1 * sin(ang);
            p[1] = x0 * sin(ang) + x1 * cos(ang);
        }
}

/* Token tok at position pos (every earlier position already run); the
 * attention reads the f16-rounded K/V when f16kv (decode: through the pool),
 * the computed ones otherwise (prefill attends its own f32 K/V). */
static void ref_step(ref *R, int32_t tok, int pos, int f16kv, double *logits)
{
    double x[DIM], xb[DIM], q[QD], att[QD], h1[HID], h3[HID], o[DIM];
    memcpy(x, R->emb + (size_t)tok * DIM, sizeof x);
    for (int l = 0; l < NL; l++) {
        r_rmsnorm(xb, x, R->an[l], DIM);
        r_matvec(q, R->wq[l], xb, QD, DIM);
        r_matvec(R->K[l][pos], R->wk[l], xb, KVD, DIM);
        r_matvec(R->V[l][pos], R->wv[l], xb, KVD, DIM);
        r_rope(q, NH, pos);
        r_rope(R->K[l][pos], NKV, pos);
        for (int i = 0; i < KVD; i++) {
            R->Kh[l][pos][i] = f16_round(R->K[l][pos][i]);
            R->Vh[l][pos][i] = f16_round(R->V[l][pos][i]);
        }
        double (*K)[KVD] = f16kv ? R->Kh[l] : R->K[l];
        double (*V)[KVD] = f16kv ? R->Vh[l] : R->V[l];
        for (int h = 0; h < NH; h++) {
            const int kh = h / (NH / NKV);
            double s[CTX], mx = -INFINITY, z = 0;
            for (int t = 0; t <= pos; t++) {
                double dot = 0;
                for (int d = 0; d < HD; d++)
                    dot += q[h * HD + d] * K[t][kh * HD + d];
                s[t] = dot / sqrt((double)HD);
                mx = fmax(mx, s[t]);
            }
            for (int d = 0; d < HD; d++)
                att[h * HD + d] = 0;
            for (int t = 0; t <= pos; t++) {
                const double wgt = exp(s[t] - mx);
                z += wgt;
                for (int d = 0; d < HD; d++)
                    att[h * HD + d] += wgt * V[t][kh * HD + d];
            }
            for (int d = 0; d < HD; d++)
                att[h * HD + d] /= z;
        }
        r_matvec(o, R->wo[l], att, DIM, QD);
        for (int i = 0; i < DIM; i++)
            x[i] += o[i];
        r_rmsnorm(xb, x, R->fn[l], DIM);
        r_matvec(h1, R->w1[l], xb, HID, DIM);
        r_matvec(h3, R->w3[l], xb, HID, DIM);
        for (int i = 0; i < HID; i++)
            h1[i] = h1[i] / (1 + exp(-h1[i])) * h3[i];
        r_matvec(o, R->w2[l], h1, DIM, HID);
        for (int i = 0; i < DIM; i++)
            x[i] += o[i];
    }
    r_rmsnorm(xb, x, R->fin, DIM);
    r_matvec(logits, R->wcls, xb, (int)R->tm->vocab, DIM);
}

static uint32_t argmax_f(const float *x, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}
static uint32_t argmax_d(const double *x, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* Tolerance, relative to the logits' scale (their largest magnitude). The
 * engine computes in f32 (products by BLAS / a vectorised dot, RMSNorm's
 * scale and RoPE's cos/sin rounded to f32, expf, the library's softmax)
 * against this double reference: a few f32 ulps per operation, ~1e-6 of the
 * scale at these widths (32..48 terms). The pool keeps K and V in f16 and
 * the reference rounds them too (ref_step), but from double values where
 * the engine rounds f32 ones, so an element within an f32 ulp of an f16
 * rounding boundary can land one f16 ulp (2^-11 ~ 4.9e-4 relative) away,
 * a difference the attention average and the later layers dilute: observed
 * up to ~1.2e-5 of the scale (and ~6e-7 without such a flip). 2e-4 leaves a
 * margin of >10x over that, yet catches a reference that ignored the f16
 * storage (~1e-3 here) and anything structurally wrong (a wrong RoPE pairing
 * or frequency, a wrong GQA head mapping, a missed position, a mis-widened
 * weight: O(0.1..1) of the scale). ~1e-3, the usual budget for an f16 KV
 * cache, would pass all the correct variants as well but not separate the
 * f16 effect. */
#define REL_TOL 2e-4

static double compare_logits(const char *what, int step, const float *got, const double *want,
                             uint32_t n)
{
    double scale = 0, worst = 0;
    for (uint32_t i = 0; i < n; i++)
        scale = fmax(scale, fabs(want[i]));
    assert_true(scale > 0.1); /* not degenerate */
    for (uint32_t i = 0; i < n; i++) {
        const double e = fabs((double)got[i] - want[i]);
        worst = fmax(worst, e / scale);
        if (e > REL_TOL * scale)
            fail_msg("%s step %d: logit %u is %.9g, reference %.9g (|diff| %.3g > %.1g x %.3g)",
                     what, step, i, (double)got[i], want[i], e, REL_TOL, scale);
    }
    const uint32_t ag = argmax_f(got, n), ar = argmax_d(want, n);
    if (ag != ar)
        fail_msg("%s step %d: argmax %u, reference %u (%.9g vs %.9g)", what, step, ag, ar,
                 want[ag], want[ar]);
    return worst;
}

/* ---- tests ------------------------------------------------------------------------- */
static void test_load_config_weights(void **state)
{
    (void)state;
    tmodel tm;
    variant v = {0};
    build_model(&tm, &v);
    gguf g;
    char path[256], err[256] = "";
    open_file(&tm, &g, path, sizeof path);
    model m;
    if (model_load_gguf(&m, &g, err, sizeof err))
        fail_msg("model_load_gguf: %s", err);
    const model_cfg *c = &m.c;
    assert_int_equal(c->dim, DIM);
    assert_int_equal(c->hidden, HID);
    assert_int_equal(c->n_layers, NL);
    assert_int_equal(c->n_heads, NH);
    assert_int_equal(c->n_kv_heads, NKV);
    assert_int_equal(c->head_dim, HD);
    assert_int_equal(c->vocab, tm.vocab);
    assert_int_equal(c->ctx, CTX);
    assert_true(c->rope_theta == THETA);
    assert_true(c->rms_eps == EPS);
    assert_true(c->rope_scale == 1.0f);
    assert_int_equal(c->rope, ROPE_ADJACENT);
    assert_int_equal(c->tied, 0);
    assert_int_equal(c->qkv_bias, 0);
    assert_null(m.bq);
    assert_true(m.wcls != m.tok_emb);
    /* Every weight, widened by the loader, equals the value widened here
     * from the same bytes (exact: f16 and f16 x int8 are exact in f32). */
    struct {
        const char *fmt;
        const float *base;
        size_t per_layer;
    } ws[] = {
        {"token_embd.weight", m.tok_emb, 0},     {"output_norm.weight", m.rms_final, 0},
        {"output.weight", m.wcls, 0},            {"blk.%d.attn_norm.weight", m.rms_att, DIM},
        {"blk.%d.attn_q.weight", m.wq, QD * DIM}, {"blk.%d.attn_k.weight", m.wk, KVD * DIM},
        {"blk.%d.attn_v.weight", m.wv, KVD * DIM}, {"blk.%d.attn_output.weight", m.wo, DIM * QD},
        {"blk.%d.ffn_norm.weight", m.rms_ffn, DIM}, {"blk.%d.ffn_gate.weight", m.w1, HID * DIM},
        {"blk.%d.ffn_down.weight", m.w2, DIM * HID}, {"blk.%d.ffn_up.weight", m.w3, HID * DIM},
    };
    for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
        for (int l = 0; l < (ws[i].per_layer ? NL : 1); l++) {
            const ttensor *t = tfind(&tm, ws[i].fmt, l);
            const float *got = ws[i].base + (size_t)l * ws[i].per_layer;
            const size_t n = (size_t)(t->rows ? t->rows : 1) * t->cols;
            for (size_t e = 0; e < n; e++)
                if (got[e] != (float)t->val[e])
                    fail_msg("%s element %zu: loaded %.9g, expected %.9g", t->name, e,
                             (double)got[e], t->val[e]);
        }
    model_free(&m);
    gguf_close(&g);
    unlink(path);
    free_model(&tm);
}

static void test_tokenizer_round_trip(void **state)
{
    (void)state;
    tmodel tm;
    variant v = {0};
    build_model(&tm, &v);
    gguf g;
    char path[256], err[256] = "";
    open_file(&tm, &g, path, sizeof path);
    tokenizer *tk;
    if (tok_from_gguf(&tk, &g, err, sizeof err))
        fail_msg("tok_from_gguf: %s", err);
    assert_int_equal(tok_get_kind(tk), TOK_BPE);
    assert_int_equal(tok_vocab(tk), tm.vocab);
    assert_int_equal(tok_bos(tk), tm.bos);
    assert_int_equal(tok_eos(tk), tm.eos);
    int32_t ids[256];
    /* The merges apply: " the" is one token (Ġthe, 256 + 2), " and" too. */
    int64_t n = tok_encode(tk, " the", 4, 0, ids, 256, err, sizeof err);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 256 + 2);
    n = tok_encode(tk, " and", 4, 0, ids, 256, err, sizeof err);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 256 + 8);
    /* BOS first when asked. */
    n = tok_encode(tk, "in", 2, 1, ids, 256, err, sizeof err);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], tm.bos);
    assert_int_equal(ids[1], 256 + 3);
    static const char *const texts[] = {
        "the cat and the hat in the water",
        "Hello, world!\nSecond line:\t123 + 456 = 579",
        "h\xc3\xa9llo w\xc3\xb6rld \xe2\x98\x83 \xf0\x9f\x98\x80 done",
        "  leading and trailing spaces  ",
        "\x01\x02\x7f\xff\xfe raw bytes",
        "",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        const char *s = texts[i];
        n = tok_encode(tk, s, strlen(s), 0, ids, 256, err, sizeof err);
        if (n < 0)
            fail_msg("encode '%s': %s", s, err);
        assert_true(n <= 256);
        char out[512];
        size_t at = 0;
        for (int64_t j = 0; j < n; j++) {
            size_t k;
            const char *p = tok_decode(tk, j ? ids[j - 1] : -1, ids[j], &k);
            assert_non_null(p);
            assert_true(at + k < sizeof out);
            memcpy(out + at, p, k);
            at += k;
        }
        out[at] = 0;
        if (at != strlen(s) || memcmp(out, s, at))
            fail_msg("round trip of text %zu: '%s' came back as '%s'", i, s, out);
    }
    tok_free(tk);
    gguf_close(&g);
    unlink(path);
    free_model(&tm);
}

/* Prefill T prompt tokens into a dense and a tiered cache, then NDEC decode
 * steps through each, every logit vector against the reference. */
enum { T_PROMPT = 20, NDEC = 8 };

static void run_forward(int tied)
{
    tmodel tm;
    variant v = {.tied = tied};
    build_model(&tm, &v);
    gguf g;
    char path[256], err[256] = "";
    open_file(&tm, &g, path, sizeof path);
    model m;
    if (model_load_gguf(&m, &g, err, sizeof err))
        fail_msg("model_load_gguf: %s", err);
    assert_int_equal(m.c.tied, tied);
    const uint32_t V = m.c.vocab;
    ref *R = malloc(sizeof *R);
    assert_non_null(R);
    ref_init(R, &tm, tied);

    int32_t prompt[T_PROMPT], next[NDEC];
    for (int i = 0; i < T_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37u + 11u) % V);
    prompt[0] = tm.bos;
    prompt[5] = 256 + 2; /* merged tokens too */
    for (int i = 0; i < NDEC; i++)
        next[i] = (int32_t)((i * 101u + 7u) % V);

    double *rl = malloc(V * sizeof *rl);
    float *pl = malloc(V * sizeof *pl);
    assert_non_null(rl);
    assert_non_null(pl);
    for (int p = 0; p < T_PROMPT; p++)
        ref_step(R, prompt[p], p, 0, rl);

    const engine_opts eo = {.budget = 100000, .threads = 2, .policy = NULL, .disk = NULL,
                            .rerank_sim = NAN};
    kvcache kc[2];
    kv_open(&kc[0], &m, &eo, 0, CTX);
    kv_open(&kc[1], &m, &eo, 1, CTX);
    const uint32_t n_obs = T_PROMPT;
    float *obs = malloc((size_t)NL * n_obs * QD * sizeof *obs);
    assert_non_null(obs);
    engine_prefill(&m, prompt, T_PROMPT, kc, 2, pl, obs, n_obs, 0, 2);
    double worst = compare_logits("prefill", 0, pl, rl, V);
    /* The tiered cache as the tool sets it up: warm-up placement from the
     * last prompt queries, then wait for the moves. */
    TU_OK(kvt_seq_warmup(kc[1].pool, kc[1].seq, obs, n_obs));
    kvt_mover *mv;
    TU_OK(kvt_pool_mover_get(kc[1].pool, &mv));
    TU_OK(kvt_mover_wait(mv, KVT_FENCE_ALL, UINT64_MAX));

    work wd, wt;
    work_init(&wd, &m.c);
    work_init(&wt, &m.c);
    for (int s = 0; s < NDEC; s++) {
        const int pos = T_PROMPT + s;
        ref_step(R, next[s], pos, 1, rl);
        engine_decode(&m, &kc[0], next[s], (uint32_t)pos, &wd);
        engine_decode(&m, &kc[1], next[s], (uint32_t)pos, &wt);
        worst = fmax(worst, compare_logits("dense decode", s + 1, wd.logits, rl, V));
        for (uint32_t i = 0; i < V; i++)
            if (memcmp(&wd.logits[i], &wt.logits[i], sizeof(float)))
                fail_msg("decode step %d: tiered logit %u is %a, dense %a (budget covers "
                         "the context: must be identical)", s + 1, i, (double)wt.logits[i],
                         (double)wd.logits[i]);
    }
    print_message("    %s output: largest |engine - reference| / max|logit| = %.3g\n",
                  tied ? "tied" : "untied", worst);
    work_free(&wd);
    work_free(&wt);
    kv_close(&kc[0]);
    kv_close(&kc[1]);
    free(obs);
    free(rl);
    free(pl);
    free(R);
    model_free(&m);
    gguf_close(&g);
    unlink(path);
    free_model(&tm);
}

static void test_forward_untied(void **state)
{
    (void)state;
    run_forward(0);
}
static void test_forward_tied(void **state)
{
    (void)state;
    run_forward(1);
}

/* A malformed model must fail to load with a message containing each of
 * needles (NULL-terminated list), leaving the model zeroed. */
static void expect_load_fail(const variant *v, const char *const *needles)
{
    tmodel tm;
    build_model(&tm, v);
    gguf g;
    char err[256] = "";
    if (gguf_parse(tm.file.p, tm.file.n, &g, err, sizeof err))
        fail_msg("gguf_parse: %s", err);
    model m;
    memset(&m, 0xa5, sizeof m);
    err[0] = 0;
    int rc = model_load_gguf(&m, &g, err, sizeof err);
    if (rc != -1)
        fail_msg("model_load_gguf returned %d, expected -1", rc);
    for (const char *const *n = needles; *n; n++)
        if (!strstr(err, *n))
            fail_msg("message '%s' does not name '%s'", err, *n);
    assert_null(m.tok_emb);
    assert_null(m.wq);
    assert_null(m.wcls);
    model_free(&m); /* harmless on the zeroed model */
    gguf_close(&g);
    free_model(&tm);
}

static void test_malformed(void **state)
{
    (void)state;
    {
        variant v = {.bad_rows = "blk.1.attn_q.weight"};
        expect_load_fail(&v, (const char *const[]){"blk.1.attn_q.weight", "24", "32", NULL});
    }
    {
        variant v = {.bad_rows = "token_embd.weight"}; /* vocab from it: output.weight off */
        expect_load_fail(&v, (const char *const[]){"output.weight", NULL});
    }
    {
        variant v = {.q4 = "blk.1.ffn_up.weight"};
        expect_load_fail(&v, (const char *const[]){"blk.1.ffn_up.weight", "Q4_0", NULL});
    }
    {
        variant v = {.omit = "blk.1.ffn_down.weight"};
        expect_load_fail(&v, (const char *const[]){"blk.1.ffn_down.weight", "missing", NULL});
    }
    {
        variant v = {.omit = "token_embd.weight"};
        expect_load_fail(&v, (const char *const[]){"token_embd.weight", NULL});
    }
    {
        variant v = {.arch = "gptj"};
        expect_load_fail(&v, (const char *const[]){"gptj", NULL});
    }
    {
        variant v = {.dim_key = 1ull << 31};
        expect_load_fail(&v, (const char *const[]){"absurd", NULL});
    }
    {
        variant v = {.dim_key = (1ull << 32) + 32};
        expect_load_fail(&v, (const char *const[]){"embedding_length", NULL});
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load_config_weights),
        cmocka_unit_test(test_tokenizer_round_trip),
        cmocka_unit_test(test_forward_untied),
        cmocka_unit_test(test_forward_tied),
        cmocka_unit_test(test_malformed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
