/* kvtier-decode: tokenizers (see tokenizer.h).
 *
 * Both kinds keep the vocabulary as one blob of piece bytes with offsets and
 * an open-addressing hash from piece bytes to id (the first id wins for a
 * duplicated piece). Encoding runs a list of symbols (spans of the text,
 * each with its id) and merges the best adjacent pair until none merges:
 *  - SPM: a pair merges when the concatenated text is a piece; best = the
 *    highest score of that piece, ties to the leftmost pair. Symbols left
 *    without a piece at the end become their bytes' <0xNN> tokens.
 *  - BPE: a pair merges when (left id, right id) is in the merges list; best
 *    = the lowest rank, ties to the leftmost pair. Every symbol is a token.
 * Candidate pairs wait in a heap (best first), pushed when two symbols
 * become neighbours and dropped as stale when popped after either side
 * changed, so a text of n symbols merges in O(n log n). */
#include "tokenizer.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOK_TYPE_NORMAL 1
#define TOK_TYPE_CONTROL 3

typedef struct span {
    const char *p;
    size_t n;
} span;

typedef struct pair_ent {
    uint64_t key;  /* (left << 32) | right; UINT64_MAX = empty */
    int32_t out;   /* merged id */
    uint32_t rank;
} pair_ent;

struct tokenizer {
    tok_kind kind;
    uint32_t n;
    char *blob;       /* all pieces, each NUL-terminated */
    size_t *off;      /* [n] */
    uint32_t *len;    /* [n] */
    float *scores;    /* [n] (SPM) */
    uint8_t *special; /* [n]: 1 = decodes to nothing (BOS, EOS, control) */
    int32_t *hslot;   /* [hcap]: piece hash, -1 = empty */
    uint32_t hcap;
    pair_ent *pairs;  /* BPE merges by id pair */
    uint32_t pcap;
    int32_t byte_tok[256]; /* SPM: <0xNN>; BPE: the byte's mapped symbol */
    int32_t bos, eos;
    int add_bos; /* tokenizer.ggml.add_bos_token: 1, 0, or -1 when not given */
    int16_t u2b[512]; /* BPE: mapped code point -> byte, -1 when none */
    char *dec;   /* tok_decode's buffer */
    size_t dec_cap;
};

/* ---- helpers ---------------------------------------------------------- */

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void seterr(char *err, size_t cap, const char *fmt, ...)
{
    if (!err || cap == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
}

static uint32_t hash_bytes(const char *p, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)p[i];
        h *= 16777619u;
    }
    return h;
}

static uint32_t hash_u64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return (uint32_t)k;
}

static const char *piece(const tokenizer *t, int32_t id)
{
    return t->blob + t->off[id];
}

/* Id of the piece with bytes p[0..n), or -1. */
static int32_t lookup(const tokenizer *t, const char *p, size_t n)
{
    uint32_t mask = t->hcap - 1, i = hash_bytes(p, n) & mask;
    for (;;) {
        int32_t id = t->hslot[i];
        if (id < 0)
            return -1;
        if (t->len[id] == n && memcmp(piece(t, id), p, n) == 0)
            return id;
        i = (i + 1) & mask;
    }
}

static const pair_ent *pair_find(const tokenizer *t, int32_t a, int32_t b)
{
    if (t->pcap == 0)
        return NULL;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t mask = t->pcap - 1, i = hash_u64(key) & mask;
    for (;;) {
        if (t->pairs[i].key == UINT64_MAX)
            return NULL;
        if (t->pairs[i].key == key)
            return &t->pairs[i];
        i = (i + 1) & mask;
    }
}

static uint32_t pow2_at_least(uint64_t n)
{
    uint32_t c = 16;
    while (c < n)
        c <<= 1;
    return c;
}

/* GPT-2's bytes_to_unicode: the printable latin-1 bytes ('!'..'~',
 * U+00A1..U+00AC, U+00AE..U+00FF) map to themselves, the others, in byte
 * order, to U+0100 on. */
static void byte_map(uint32_t b2u[256])
{
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        b2u[b] = printable ? b : next++;
    }
}

static size_t utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Length of the UTF-8 sequence at p[0..n) (n >= 1): 2..4 for a well-formed
 * sequence, 1 for ASCII or any byte that does not start one. *cp receives
 * the code point (the byte itself for length 1). */
static size_t utf8_next(const uint8_t *p, size_t n, uint32_t *cp)
{
    uint8_t b = p[0];
    size_t k;
    uint32_t v, min;
    if (b < 0x80) {
        *cp = b;
        return 1;
    } else if (b >= 0xc2 && b <= 0xdf) {
        k = 2, v = b & 0x1fu, min = 0x80;
    } else if (b >= 0xe0 && b <= 0xef) {
        k = 3, v = b & 0x0fu, min = 0x800;
    } else if (b >= 0xf0 && b <= 0xf4) {
        k = 4, v = b & 0x07u, min = 0x10000;
    } else {
        *cp = b;
        return 1;
    }
    if (k > n) {
        *cp = b;
        return 1;
    }
    for (size_t i = 1; i < k; i++) {
        if ((p[i] & 0xc0) != 0x80) {
            *cp = b;
            return 1;
        }
        v = (v << 6) | (p[i] & 0x3fu);
    }
    if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) {
        *cp = b;
        return 1;
    }
    *cp = v;
    return k;
}

/* ---- building ---------------------------------------------------------- */

void tok_free(tokenizer *t)
{
    if (!t)
        return;
    free(t->blob);
    free(t->off);
    free(t->len);
    free(t->scores);
    free(t->special);
    free(t->hslot);
    free(t->pairs);
    free(t->dec);
    free(t);
}

/* tokens[n] (bytes, copied), scores (SPM; NULL for BPE), types (NULL or
 * [n] GGUF token types), merges[n_merges] (BPE: "a b"). */
static int tok_build(tokenizer **out, tok_kind kind, const span *tokens, const float *scores,
                     const int32_t *types, uint32_t n, const span *merges, uint32_t n_merges,
                     int32_t bos, int32_t eos, int add_bos, char *err, size_t cap)
{
    *out = NULL;
    if (kind != TOK_SPM && kind != TOK_BPE) {
        seterr(err, cap, "tokenizer: unknown kind %d", (int)kind);
        return -1;
    }
    if (n == 0 || n > (uint32_t)INT32_MAX / 2) {
        seterr(err, cap, "tokenizer: vocabulary size %u out of range", n);
        return -1;
    }
    if (kind == TOK_SPM && !scores) {
        seterr(err, cap, "tokenizer: SentencePiece vocabulary without scores");
        return -1;
    }
    if (bos < -1 || bos >= (int64_t)n || eos < -1 || eos >= (int64_t)n) {
        seterr(err, cap, "tokenizer: BOS id %d / EOS id %d outside the vocabulary of %u",
               (int)bos, (int)eos, n);
        return -1;
    }
    tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        goto oom;
    t->kind = kind;
    t->n = n;
    t->bos = bos;
    t->eos = eos;
    t->add_bos = add_bos;
    size_t total = 0, maxlen = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!tokens[i].p && tokens[i].n) {
            seterr(err, cap, "tokenizer: token %u has no text", i);
            tok_free(t);
            return -1;
        }
        if (tokens[i].n > UINT32_MAX / 4) {
            seterr(err, cap, "tokenizer: token %u is %zu bytes long", i, tokens[i].n);
            tok_free(t);
            return -1;
        }
        total += tokens[i].n + 1;
        maxlen = tokens[i].n > maxlen ? tokens[i].n : maxlen;
    }
    t->blob = malloc(total);
    t->off = malloc(n * sizeof *t->off);
    t->len = malloc(n * sizeof *t->len);
    t->special = calloc(n, 1);
    t->hcap = pow2_at_least(2ull * n);
    t->hslot = malloc(t->hcap * sizeof *t->hslot);
    t->dec_cap = maxlen + 8;
    t->dec = malloc(t->dec_cap);
    if (!t->blob || !t->off || !t->len || !t->special || !t->hslot || !t->dec)
        goto oom;
    if (kind == TOK_SPM) {
        t->scores = malloc(n * sizeof *t->scores);
        if (!t->scores)
            goto oom;
        memcpy(t->scores, scores, n * sizeof *t->scores);
    }
    memset(t->hslot, 0xff, t->hcap * sizeof *t->hslot);
    size_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        t->off[i] = at;
        t->len[i] = (uint32_t)tokens[i].n;
        if (tokens[i].n)
            memcpy(t->blob + at, tokens[i].p, tokens[i].n);
        t->blob[at + tokens[i].n] = 0;
        at += tokens[i].n + 1;
        if ((types && types[i] == TOK_TYPE_CONTROL) || (int32_t)i == bos || (int32_t)i == eos)
            t->special[i] = 1;
        if (lookup(t, tokens[i].p ? tokens[i].p : "", tokens[i].n) >= 0)
            continue; /* duplicate piece: the first id keeps it */
        uint32_t mask = t->hcap - 1, h = hash_bytes(piece(t, (int32_t)i), tokens[i].n) & mask;
        while (t->hslot[h] >= 0)
            h = (h + 1) & mask;
        t->hslot[h] = (int32_t)i;
    }
    if (kind == TOK_SPM) {
        for (int b = 0; b < 256; b++) {
            char s[8];
            snprintf(s, sizeof s, "<0x%02X>", b);
            t->byte_tok[b] = lookup(t, s, 6);
        }
    } else {
        uint32_t b2u[256];
        byte_map(b2u);
        for (int i = 0; i < 512; i++)
            t->u2b[i] = -1;
        for (int b = 0; b < 256; b++)
            t->u2b[b2u[b]] = (int16_t)b;
        for (int b = 0; b < 256; b++) {
            char s[4];
            size_t k = utf8_put(b2u[b], s);
            t->byte_tok[b] = lookup(t, s, k);
        }
        t->pcap = pow2_at_least(2ull * n_merges + 1);
        t->pairs = malloc(t->pcap * sizeof *t->pairs);
        if (!t->pairs)
            goto oom;
        for (uint32_t i = 0; i < t->pcap; i++)
            t->pairs[i].key = UINT64_MAX;
        char *cat = malloc(2 * maxlen + 2);
        if (!cat)
            goto oom;
        for (uint32_t r = 0; r < n_merges; r++) {
            const char *m = merges[r].p;
            size_t mn = merges[r].n, sp = 1;
            if (!m || mn < 3)
                continue;
            while (sp < mn && m[sp] != ' ')
                sp++;
            if (sp >= mn - 1)
                continue; /* no "a b" form: skipped */
            int32_t a = lookup(t, m, sp), b = lookup(t, m + sp + 1, mn - sp - 1);
            if (a < 0 || b < 0 || (size_t)t->len[a] + t->len[b] > 2 * maxlen)
                continue;
            memcpy(cat, piece(t, a), t->len[a]);
            memcpy(cat + t->len[a], piece(t, b), t->len[b]);
            int32_t c = lookup(t, cat, (size_t)t->len[a] + t->len[b]);
            if (c < 0)
                continue; /* the merged piece is not a token: never applies */
            uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
            uint32_t mask = t->pcap - 1, h = hash_u64(key) & mask;
            while (t->pairs[h].key != UINT64_MAX && t->pairs[h].key != key)
                h = (h + 1) & mask;
            if (t->pairs[h].key == key)
                continue; /* repeated merge: the first rank stands */
            t->pairs[h].key = key;
            t->pairs[h].out = c;
            t->pairs[h].rank = r;
        }
        free(cat);
    }
    *out = t;
    return 0;
oom:
    tok_free(t);
    seterr(err, cap, "tokenizer: out of memory");
    return -1;
}

int tok_from_arrays(tokenizer **out, tok_kind kind, const char *const *tokens,
                    const float *scores, uint32_t n, const char *const *merges,
                    uint32_t n_merges, int32_t bos, int32_t eos, char *err, size_t cap)
{
    if (!out) {
        seterr(err, cap, "tok_from_arrays: out is NULL");
        return -1;
    }
    *out = NULL;
    if (!tokens || (n_merges && !merges)) {
        seterr(err, cap, "tok_from_arrays: tokens or merges is NULL");
        return -1;
    }
    span *ts = malloc((n ? n : 1) * sizeof *ts);
    span *ms = malloc((n_merges ? n_merges : 1) * sizeof *ms);
    int rc = -1;
    if (!ts || !ms) {
        seterr(err, cap, "tokenizer: out of memory");
        goto done;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (!tokens[i]) {
            seterr(err, cap, "tok_from_arrays: token %u is NULL", i);
            goto done;
        }
        ts[i].p = tokens[i];
        ts[i].n = strlen(tokens[i]);
    }
    for (uint32_t i = 0; i < n_merges; i++) {
        ms[i].p = merges[i];
        ms[i].n = merges[i] ? strlen(merges[i]) : 0;
    }
    rc = tok_build(out, kind, ts, scores, NULL, n, ms, n_merges, bos, eos, -1, err, cap);
done:
    free(ts);
    free(ms);
    return rc;
}

/* Replaces every ' ' in s[0..n) with U+2581 into out (3n bytes). */
static size_t space_to_u2581(const char *s, size_t n, char *out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(out + k, "\xe2\x96\x81", 3);
            k += 3;
        } else {
            out[k++] = s[i];
        }
    }
    return k;
}

int tok_from_llama2c(tokenizer **out, const char *path, uint32_t vocab_size, char *err,
                     size_t cap)
{
    if (!out) {
        seterr(err, cap, "tok_from_llama2c: out is NULL");
        return -1;
    }
    *out = NULL;
    if (!path) {
        seterr(err, cap, "tok_from_llama2c: path is NULL");
        return -1;
    }
    if (vocab_size == 0 || vocab_size > (uint32_t)INT32_MAX / 2) {
        seterr(err, cap, "%s: vocabulary size %u out of range", path, vocab_size);
        return -1;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        seterr(err, cap, "%s: %s", path, strerror(errno));
        return -1;
    }
    uint8_t *buf = NULL;
    size_t size = 0, bcap = 0;
    for (;;) {
        if (size == bcap) {
            size_t nc = bcap ? 2 * bcap : 65536;
            uint8_t *nb = realloc(buf, nc);
            if (!nb) {
                free(buf);
                fclose(f);
                seterr(err, cap, "%s: out of memory", path);
                return -1;
            }
            buf = nb;
            bcap = nc;
        }
        size_t got = fread(buf + size, 1, bcap - size, f);
        size += got;
        if (got == 0)
            break;
    }
    int rd_err = ferror(f);
    fclose(f);
    if (rd_err) {
        free(buf);
        seterr(err, cap, "%s: read error", path);
        return -1;
    }
    if (size < 4 || (size - 4) / 8 < vocab_size) { /* 8 bytes a token at least */
        free(buf);
        seterr(err, cap, "%s: truncated (%zu bytes cannot hold %u tokens)", path, size,
               vocab_size);
        return -1;
    }
    int rc = -1;
    span *ts = calloc(vocab_size, sizeof *ts);
    float *sc = malloc(vocab_size * sizeof *sc);
    char *conv = NULL;
    if (!ts || !sc) {
        seterr(err, cap, "%s: out of memory", path);
        goto done;
    }
    int32_t maxlen;
    if (size < 4) {
        seterr(err, cap, "%s: truncated (no max_token_length)", path);
        goto done;
    }
    memcpy(&maxlen, buf, 4);
    if (maxlen <= 0 || maxlen > (1 << 20)) {
        seterr(err, cap, "%s: max_token_length %d is absurd", path, (int)maxlen);
        goto done;
    }
    /* The export writes U+2581 as ' ': pieces get U+2581 back here (3 bytes
     * for each space at most). */
    size_t pos = 4, conv_len = 0;
    conv = malloc((size > 4 ? size - 4 : 1) * 3);
    if (!conv) {
        seterr(err, cap, "%s: out of memory", path);
        goto done;
    }
    for (uint32_t i = 0; i < vocab_size; i++) {
        int32_t l;
        if (size - pos < 8) {
            seterr(err, cap, "%s: truncated at token %u of %u", path, i, vocab_size);
            goto done;
        }
        memcpy(&sc[i], buf + pos, 4);
        memcpy(&l, buf + pos + 4, 4);
        pos += 8;
        if (l < 0 || l > maxlen) {
            seterr(err, cap, "%s: token %u has length %d (max_token_length %d)", path, i,
                   (int)l, (int)maxlen);
            goto done;
        }
        if (size - pos < (size_t)l) {
            seterr(err, cap, "%s: truncated in token %u of %u", path, i, vocab_size);
            goto done;
        }
        ts[i].p = conv + conv_len; /* conv does not move */
        ts[i].n = space_to_u2581((const char *)buf + pos, (size_t)l, conv + conv_len);
        conv_len += ts[i].n;
        pos += (size_t)l;
    }
    rc = tok_build(out, TOK_SPM, ts, sc, NULL, vocab_size, NULL, 0, vocab_size > 1 ? 1 : -1,
                   vocab_size > 2 ? 2 : -1, -1, err, cap);
done:
    free(buf);
    free(ts);
    free(sc);
    free(conv);
    return rc;
}

int tok_from_gguf(tokenizer **out, const gguf *g, char *err, size_t cap)
{
    if (!out) {
        seterr(err, cap, "tok_from_gguf: out is NULL");
        return -1;
    }
    *out = NULL;
    if (!g) {
        seterr(err, cap, "tok_from_gguf: no GGUF");
        return -1;
    }
    gguf_str model;
    if (gguf_get_str(g, "tokenizer.ggml.model", &model) != 0) {
        seterr(err, cap, "GGUF: no tokenizer.ggml.model string");
        return -1;
    }
    tok_kind kind;
    if (gguf_str_eq(model, "llama")) {
        kind = TOK_SPM;
    } else if (gguf_str_eq(model, "gpt2")) {
        kind = TOK_BPE;
    } else {
        int ml = model.n > 64 ? 64 : (int)model.n;
        seterr(err, cap, "GGUF: tokenizer.ggml.model '%.*s' not supported (llama or gpt2)",
               ml, model.p);
        return -1;
    }
    const gguf_kv *tk = gguf_find(g, "tokenizer.ggml.tokens");
    if (!tk || tk->type != GGUF_T_ARRAY || tk->arr_type != GGUF_T_STRING) {
        seterr(err, cap, "GGUF: no tokenizer.ggml.tokens string array");
        return -1;
    }
    if (tk->arr_n == 0 || tk->arr_n > (uint64_t)INT32_MAX / 2) {
        seterr(err, cap, "GGUF: tokenizer.ggml.tokens has %llu entries",
               (unsigned long long)tk->arr_n);
        return -1;
    }
    uint32_t n = (uint32_t)tk->arr_n, n_merges = 0;
    int rc = -1;
    span *ts = malloc(n * sizeof *ts);
    float *sc = NULL;
    int32_t *types = NULL;
    span *ms = NULL;
    if (!ts)
        goto oom;
    gguf_arr_iter it;
    gguf_arr_begin(&it, g, tk);
    for (uint32_t i = 0; i < n; i++) {
        gguf_str s;
        if (gguf_arr_next_str(&it, &s) != 0) {
            seterr(err, cap, "GGUF: tokenizer.ggml.tokens: bad entry %u", i);
            goto done;
        }
        ts[i].p = s.p;
        ts[i].n = (size_t)s.n;
    }
    if (kind == TOK_SPM) {
        const gguf_kv *sk = gguf_find(g, "tokenizer.ggml.scores");
        if (!sk || sk->type != GGUF_T_ARRAY || sk->arr_type != GGUF_T_F32 || sk->arr_n != n) {
            seterr(err, cap, "GGUF: no tokenizer.ggml.scores f32 array of %u entries", n);
            goto done;
        }
        sc = malloc(n * sizeof *sc);
        if (!sc)
            goto oom;
        gguf_arr_begin(&it, g, sk);
        for (uint32_t i = 0; i < n; i++)
            if (gguf_arr_next_f32(&it, &sc[i]) != 0) {
                seterr(err, cap, "GGUF: tokenizer.ggml.scores: bad entry %u", i);
                goto done;
            }
    } else {
        const gguf_kv *mk = gguf_find(g, "tokenizer.ggml.merges");
        if (!mk || mk->type != GGUF_T_ARRAY || mk->arr_type != GGUF_T_STRING) {
            seterr(err, cap, "GGUF: no tokenizer.ggml.merges string array");
            goto done;
        }
        if (mk->arr_n > UINT32_MAX / 4) {
            seterr(err, cap, "GGUF: tokenizer.ggml.merges has %llu entries",
                   (unsigned long long)mk->arr_n);
            goto done;
        }
        n_merges = (uint32_t)mk->arr_n;
        ms = malloc((n_merges ? n_merges : 1) * sizeof *ms);
        if (!ms)
            goto oom;
        gguf_arr_begin(&it, g, mk);
        for (uint32_t i = 0; i < n_merges; i++) {
            gguf_str s;
            if (gguf_arr_next_str(&it, &s) != 0) {
                seterr(err, cap, "GGUF: tokenizer.ggml.merges: bad entry %u", i);
                goto done;
            }
            ms[i].p = s.p;
            ms[i].n = (size_t)s.n;
        }
    }
    const gguf_kv *yk = gguf_find(g, "tokenizer.ggml.token_type");
    if (yk && yk->type == GGUF_T_ARRAY && yk->arr_n == n) {
        types = malloc(n * sizeof *types);
        if (!types)
            goto oom;
        gguf_arr_begin(&it, g, yk);
        for (uint32_t i = 0; i < n; i++) {
            int64_t v;
            if (gguf_arr_next_i64(&it, &v) != 0) {
                free(types); /* not an integer array: ignored */
                types = NULL;
                break;
            }
            types[i] = v >= INT32_MIN && v <= INT32_MAX ? (int32_t)v : 0;
        }
    }
    int32_t ids[2] = {-1, -1};
    const char *keys[2] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"};
    for (int k = 0; k < 2; k++) {
        uint64_t v;
        if (gguf_get_u64(g, keys[k], &v) != 0)
            continue;
        if (v >= n) {
            seterr(err, cap, "GGUF: %s = %llu outside the vocabulary of %u", keys[k],
                   (unsigned long long)v, n);
            goto done;
        }
        ids[k] = (int32_t)v;
    }
    int add_bos = -1;
    const gguf_kv *ak = gguf_find(g, "tokenizer.ggml.add_bos_token");
    uint64_t av;
    if (ak && ak->type == GGUF_T_BOOL && ak->val)
        add_bos = ak->val[0] != 0;
    else if (ak && gguf_get_u64(g, "tokenizer.ggml.add_bos_token", &av) == 0)
        add_bos = av != 0;
    rc = tok_build(out, kind, ts, sc, types, n, ms, n_merges, ids[0], ids[1], add_bos, err,
                   cap);
    goto done;
oom:
    seterr(err, cap, "tokenizer: out of memory");
done:
    free(ts);
    free(sc);
    free(types);
    free(ms);
    return rc;
}

/* ---- accessors ---------------------------------------------------------- */

tok_kind tok_get_kind(const tokenizer *t)
{
    return t->kind;
}
uint32_t tok_vocab(const tokenizer *t)
{
    return t->n;
}
int32_t tok_bos(const tokenizer *t)
{
    return t->bos;
}
int32_t tok_eos(const tokenizer *t)
{
    return t->eos;
}

/* ---- encoding ----------------------------------------------------------- */

typedef struct sym {
    size_t start, len; /* span of the (normalized) text; len 0 = merged away */
    int32_t id;        /* -1: SPM symbol without a piece */
    int32_t prev, next;
} sym;

/* A candidate merge of symbols l and r, valid while both still have the
 * lengths recorded here and r still follows l (symbols only grow, so equal
 * lengths mean the same spans). */
typedef struct cand {
    double score; /* higher merges first; ties to the lower l */
    int32_t l, r, out;
    size_t llen, rlen;
} cand;

typedef struct enc {
    const tokenizer *t;
    const char *text;
    sym *s;
    cand *heap; /* max-heap of candidates, stale ones dropped when popped */
    size_t hn;
    int32_t *ids;
    size_t cap;
    int64_t count;
} enc;

static void emit(enc *e, int32_t id)
{
    if ((uint64_t)e->count < e->cap)
        e->ids[e->count] = id;
    e->count++;
}

static int cand_before(const cand *a, const cand *b)
{
    return a->score > b->score || (a->score == b->score && a->l < b->l);
}

static void heap_push(enc *e, cand c)
{
    size_t i = e->hn++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!cand_before(&c, &e->heap[up]))
            break;
        e->heap[i] = e->heap[up];
        i = up;
    }
    e->heap[i] = c;
}

static cand heap_pop(enc *e)
{
    cand top = e->heap[0], last = e->heap[--e->hn];
    size_t i = 0, n = e->hn;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && cand_before(&e->heap[c + 1], &e->heap[c]))
            c++;
        if (!cand_before(&e->heap[c], &last))
            break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n)
        e->heap[i] = last;
    return top;
}

/* Pushes the merge of symbol i with its right neighbour, if there is one. */
static void pair_push(enc *e, int32_t i)
{
    if (i < 0 || e->s[i].next < 0)
        return;
    const sym *a = &e->s[i], *b = &e->s[a->next];
    cand c = {.l = i, .r = a->next, .llen = a->len, .rlen = b->len, .out = -1};
    if (e->t->kind == TOK_SPM) {
        c.out = lookup(e->t, e->text + a->start, a->len + b->len);
        if (c.out >= 0)
            c.score = e->t->scores[c.out];
    } else {
        const pair_ent *p = pair_find(e->t, a->id, b->id);
        if (p) {
            c.out = p->out;
            c.score = -(double)p->rank;
        }
    }
    if (c.out >= 0)
        heap_push(e, c);
}

/* Merges symbols 0..m-1 (already linked in order) to the end; e->heap has
 * room for 3m candidates (m - 1 at first, two more per merge). */
static void merge_all(enc *e, int32_t m)
{
    e->hn = 0;
    for (int32_t i = 0; i < m; i++)
        pair_push(e, i);
    while (e->hn) {
        cand c = heap_pop(e);
        sym *a = &e->s[c.l], *b = &e->s[c.r];
        if (a->len != c.llen || b->len != c.rlen || a->next != c.r)
            continue; /* stale */
        a->id = c.out;
        a->len += b->len;
        b->len = 0;
        a->next = b->next;
        if (a->next >= 0)
            e->s[a->next].prev = c.l;
        pair_push(e, a->prev);
        pair_push(e, c.l);
    }
}

static int64_t encode_spm(enc *e, const char *text, size_t len, char *err, size_t errcap)
{
    const tokenizer *t = e->t;
    if (len == 0)
        return 0;
    if (len > (SIZE_MAX - 3) / 3 || len > (size_t)INT32_MAX / 4) {
        seterr(err, errcap, "tok_encode: text of %zu bytes too long", len);
        return -1;
    }
    char *norm = malloc(3 * (len + 1));
    if (!norm) {
        seterr(err, errcap, "tok_encode: out of memory");
        return -1;
    }
    memcpy(norm, "\xe2\x96\x81", 3); /* the dummy prefix */
    size_t nl = 3 + space_to_u2581(text, len, norm + 3);
    e->s = malloc(nl * sizeof *e->s);
    e->heap = malloc((3 * nl + 4) * sizeof *e->heap);
    if (!e->s || !e->heap) {
        free(e->s);
        free(e->heap);
        free(norm);
        seterr(err, errcap, "tok_encode: out of memory");
        return -1;
    }
    e->text = norm;
    int32_t m = 0;
    for (size_t i = 0; i < nl;) {
        uint32_t cp;
        size_t k = utf8_next((const uint8_t *)norm + i, nl - i, &cp);
        sym *s = &e->s[m];
        s->start = i;
        s->len = k;
        s->id = lookup(t, norm + i, k);
        s->prev = m - 1;
        s->next = m + 1;
        m++;
        i += k;
    }
    e->s[m - 1].next = -1;
    merge_all(e, m);
    int64_t rc = 0;
    for (int32_t i = 0; i >= 0; i = e->s[i].next) {
        const sym *s = &e->s[i];
        if (s->id >= 0) {
            emit(e, s->id);
            continue;
        }
        for (size_t k = 0; k < s->len; k++) {
            uint8_t b = (uint8_t)norm[s->start + k];
            if (t->byte_tok[b] < 0) {
                seterr(err, errcap,
                       "tok_encode: byte 0x%02X at offset %zu has no piece and no <0x%02X> "
                       "byte-fallback token",
                       b, s->start + k >= 3 ? s->start + k - 3 : 0, b);
                rc = -1;
                goto out;
            }
            emit(e, t->byte_tok[b]);
        }
    }
out:
    free(norm);
    free(e->s);
    free(e->heap);
    e->s = NULL;
    return rc;
}

static int is_ws(uint8_t c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}
static int is_letter(uint8_t c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c >= 0x80;
}
static int is_digit(uint8_t c)
{
    return c >= '0' && c <= '9';
}
static int is_other(uint8_t c)
{
    return !is_ws(c) && !is_letter(c) && !is_digit(c);
}
static int lower(uint8_t c)
{
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

/* End of the pre-tokenizer chunk starting at i (< n), after the GPT-2
 * pattern 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+
 * |\s+(?!\S)|\s+ with ASCII classes, bytes >= 0x80 counted as letters, and
 * the contractions matched in either case. */
static size_t chunk_end(const uint8_t *p, size_t n, size_t i)
{
    if (p[i] == '\'' && i + 1 < n) {
        int c1 = lower(p[i + 1]), c2 = i + 2 < n ? lower(p[i + 2]) : 0;
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
            return i + 2;
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
            return i + 3;
    }
    size_t j = (p[i] == ' ' && i + 1 < n) ? i + 1 : i;
    if (is_letter(p[j])) {
        while (j < n && is_letter(p[j]))
            j++;
        return j;
    }
    if (is_digit(p[j])) {
        size_t k = 0;
        while (j < n && k < 3 && is_digit(p[j]))
            j++, k++;
        return j;
    }
    if (is_other(p[j])) {
        while (j < n && is_other(p[j]))
            j++;
        return j;
    }
    /* whitespace at i */
    size_t e = i;
    while (e < n && is_ws(p[e]))
        e++;
    if (e == n)
        return n;
    return e - i >= 2 ? e - 1 : i + 1;
}

static int64_t encode_bpe(enc *e, const char *text, size_t len, char *err, size_t errcap)
{
    const tokenizer *t = e->t;
    if (len == 0)
        return 0;
    if (len > (size_t)INT32_MAX / 2) {
        seterr(err, errcap, "tok_encode: text of %zu bytes too long", len);
        return -1;
    }
    const uint8_t *p = (const uint8_t *)text;
    for (size_t i = 0; i < len; i++)
        if (t->byte_tok[p[i]] < 0) {
            uint32_t b2u[256];
            char s[8];
            byte_map(b2u);
            s[utf8_put(b2u[p[i]], s)] = 0;
            seterr(err, errcap,
                   "tok_encode: byte 0x%02X at offset %zu: its symbol '%s' is not a token",
                   p[i], i, s);
            return -1;
        }
    e->s = malloc(len * sizeof *e->s);
    e->heap = malloc((3 * len + 4) * sizeof *e->heap);
    if (!e->s || !e->heap) {
        free(e->s);
        free(e->heap);
        seterr(err, errcap, "tok_encode: out of memory");
        return -1;
    }
    e->text = text;
    sym *all = e->s;
    for (size_t i = 0; i < len;) {
        size_t end = chunk_end(p, len, i);
        int32_t m = (int32_t)(end - i);
        e->s = all + i; /* indices within the chunk */
        for (int32_t k = 0; k < m; k++) {
            sym *s = &e->s[k];
            s->start = i + (size_t)k;
            s->len = 1;
            s->id = t->byte_tok[p[i + (size_t)k]];
            s->prev = k - 1;
            s->next = k + 1 < m ? k + 1 : -1;
        }
        merge_all(e, m);
        for (int32_t k = 0; k >= 0; k = e->s[k].next)
            emit(e, e->s[k].id);
        i = end;
    }
    free(all);
    free(e->heap);
    e->s = NULL;
    return 0;
}

int64_t tok_encode(const tokenizer *t, const char *text, size_t len, int add_bos,
                   int32_t *ids, size_t cap, char *err, size_t errcap)
{
    if (!t || (!text && len) || (!ids && cap)) {
        seterr(err, errcap, "tok_encode: %s is NULL", !t ? "t" : !text ? "text" : "ids");
        return -1;
    }
    enc e = {.t = t, .ids = ids, .cap = cap};
    if (add_bos && t->bos >= 0)
        emit(&e, t->bos);
    int64_t rc = t->kind == TOK_SPM ? encode_spm(&e, text, len, err, errcap)
                                    : encode_bpe(&e, text, len, err, errcap);
    return rc < 0 ? -1 : e.count;
}

/* ---- decoding ----------------------------------------------------------- */

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

const char *tok_decode(tokenizer *t, int32_t prev, int32_t id, size_t *n)
{
    size_t dummy;
    if (!n)
        n = &dummy;
    *n = 0;
    if (!t || id < 0 || (uint32_t)id >= t->n)
        return NULL;
    char *out = t->dec;
    out[0] = 0;
    if (t->special[id])
        return out;
    const char *s = piece(t, id);
    size_t l = t->len[id], k = 0;
    if (t->kind == TOK_SPM) {
        if (l == 6 && s[0] == '<' && s[1] == '0' && s[2] == 'x' && s[5] == '>' &&
            hexval(s[3]) >= 0 && hexval(s[4]) >= 0) {
            out[0] = (char)(hexval(s[3]) * 16 + hexval(s[4]));
            out[1] = 0;
            *n = 1;
            return out;
        }
        for (size_t i = 0; i < l;) {
            if (i + 3 <= l && memcmp(s + i, "\xe2\x96\x81", 3) == 0) {
                out[k++] = ' ';
                i += 3;
            } else {
                out[k++] = s[i++];
            }
        }
        if (prev >= 0 && prev == t->bos && k > 0 && out[0] == ' ') {
            memmove(out, out + 1, k - 1);
            k--;
        }
    } else {
        const int16_t *u2b = t->u2b;
        for (size_t i = 0; i < l;) {
            uint32_t cp;
            size_t c = utf8_next((const uint8_t *)s + i, l - i, &cp);
            if (c > 1 && cp < 512 && u2b[cp] >= 0) {
                out[k++] = (char)u2b[cp];
            } else if (c == 1 && cp < 0x80 && u2b[cp] >= 0) {
                out[k++] = (char)u2b[cp];
            } else {
                memcpy(out + k, s + i, c); /* not a mapped symbol: as it is */
                k += c;
            }
            i += c;
        }
    }
    out[k] = 0;
    *n = k;
    return out;
}
