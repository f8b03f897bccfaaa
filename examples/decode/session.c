/* kvtier-decode: --save / --resume (see session.h). */
#include "session.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static const char sess_magic[8] = {'K', 'V', 'T', 'D', 'S', 'E', 'S', '1'};

/* The decoder's record after the stream (little-endian, 40 bytes). */
typedef struct {
    char magic[8];
    uint32_t n_layers, n_heads, n_kv_heads, head_dim, vocab;
    int32_t next_tok;
    uint64_t rng;
} sess_rec;

static int64_t file_write(void *ctx, const void *buf, size_t len)
{
    return fwrite(buf, 1, len, ctx) == len ? (int64_t)len : -1;
}

static int64_t file_read(void *ctx, void *buf, size_t len)
{
    size_t n = fread(buf, 1, len, ctx);
    return n == 0 && ferror((FILE *)ctx) ? -1 : (int64_t)n;
}

static void shape(sess_rec *r, const model_cfg *c)
{
    memset(r, 0, sizeof *r);
    memcpy(r->magic, sess_magic, 8);
    r->n_layers = c->n_layers;
    r->n_heads = c->n_heads;
    r->n_kv_heads = c->n_kv_heads;
    r->head_dim = c->head_dim;
    r->vocab = c->vocab;
}

int session_peek(const char *path, uint32_t *n_tokens, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "--resume: cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    uint8_t h[56];
    uint32_t L = 0, n = 0, best = 0;
    int ok = fread(h, sizeof h, 1, f) == 1 && !memcmp(h, "KVTSEQ\0\0", 8);
    if (ok) {
        memcpy(&L, h + 16, 4);
        ok = L > 0 && L <= 65536;
    }
    for (uint32_t l = 0; ok && l < L; l++) {
        ok = fread(&n, 4, 1, f) == 1;
        best = n > best ? n : best;
    }
    fclose(f);
    if (!ok) {
        snprintf(err, errlen, "--resume: %s is not a kvtier-decode session", path);
        return -1;
    }
    *n_tokens = best;
    return 0;
}

int session_save(const char *path, const kvcache *kc, const model_cfg *c,
                 const session_state *st, char *err, size_t errlen)
{
    FILE *f = fopen(path, "wb");
    if (!f) {
        snprintf(err, errlen, "--save: cannot create %s: %s", path, strerror(errno));
        return -1;
    }
    sess_rec r;
    shape(&r, c);
    r.next_tok = st->next_tok;
    r.rng = st->rng;
    int rc = kvt_seq_save(kc->pool, kc->seq, file_write, f);
    if (rc)
        snprintf(err, errlen, "--save: %s: %s (%s)", path, kvt_err_name(rc), kvt_last_error());
    else if (fwrite(&r, sizeof r, 1, f) != 1)
        snprintf(err, errlen, "--save: %s: write failed", path), rc = -1;
    if (fclose(f) && !rc) {
        snprintf(err, errlen, "--save: %s: %s", path, strerror(errno));
        rc = -1;
    }
    if (rc)
        remove(path); /* no half-written session left behind */
    return rc ? -1 : 0;
}

int session_resume(const char *path, kvcache *kc, const model_cfg *c, uint32_t max_tokens,
                   session_state *st, uint32_t *n_tokens, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "--resume: cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    kvt_seq_id id;
    kvt_seq_opts so;
    kvt_seq_opts_init(&so);
    so.max_tokens = max_tokens;
    int rc = kvt_seq_restore(kc->pool, &so, file_read, f, &id);
    if (rc) {
        snprintf(err, errlen, "--resume: %s: %s (%s)", path, kvt_err_name(rc),
                 kvt_last_error());
        fclose(f);
        return -1;
    }
    sess_rec r, want;
    shape(&want, c);
    const int ok = fread(&r, sizeof r, 1, f) == 1;
    fclose(f);
    if (!ok || memcmp(r.magic, want.magic, 8)) {
        snprintf(err, errlen, "--resume: %s: no decoder state after the KV stream", path);
    } else if (r.n_layers != want.n_layers || r.n_heads != want.n_heads ||
               r.n_kv_heads != want.n_kv_heads || r.head_dim != want.head_dim ||
               r.vocab != want.vocab) {
        snprintf(err, errlen, "--resume: %s was saved with a model of %u layers, %u/%u heads "
                 "x %u, vocab %u; this model differs", path, r.n_layers, r.n_heads,
                 r.n_kv_heads, r.head_dim, r.vocab);
    } else if (r.next_tok < 0 || (uint32_t)r.next_tok >= c->vocab) {
        snprintf(err, errlen, "--resume: %s: next token %d is outside the vocabulary", path,
                 r.next_tok);
    } else {
        kvt_seq_info info;
        info.struct_size = sizeof info;
        if ((rc = kvt_seq_info_get(kc->pool, id, &info)) ||
            (rc = kvt_seq_release(kc->pool, kc->seq))) {
            snprintf(err, errlen, "--resume: %s (%s)", kvt_err_name(rc), kvt_last_error());
            kvt_seq_release(kc->pool, id);
            return -1;
        }
        kc->seq = id;
        *n_tokens = info.n_tokens;
        st->next_tok = r.next_tok;
        st->rng = r.rng;
        return 0;
    }
    kvt_seq_release(kc->pool, id);
    return -1;
}
