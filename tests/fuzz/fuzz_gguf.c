/* libFuzzer target for the GGUF reader of kvtier-decode
 * (examples/decode/gguf.c).
 *
 * Each input is parsed with gguf_parse from a private copy of exactly its
 * size (so an over-read is caught by ASan). A failure must leave *g zeroed
 * with a message; a success must give a directory whose every pointer lies
 * inside the input: the target walks every kv (scalars through the typed
 * getters, arrays element by element through the iterators, which must
 * yield exactly arr_n elements of a matching type), looks every tensor up
 * by name, and widens every tensor of a supported type with at most 2^20
 * elements. Build (from the repository root):
 *   clang -std=c11 -D_GNU_SOURCE -g -O1 -fsanitize=fuzzer,address,undefined \
 *     -Iexamples/decode tests/fuzz/fuzz_gguf.c examples/decode/gguf.c -o fuzz_gguf
 * Seed corpus: tests/fuzz/corpus/gguf (written by gen_gguf_corpus.c). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void in_file(const gguf *g, const void *p, uint64_t n)
{
    const uint8_t *b = p;
    if (n == 0)
        return;
    if (b < g->base || b > g->base + g->size || n > (uint64_t)(g->base + g->size - b))
        abort();
}

static void walk_kv(const gguf *g, const gguf_kv *kv)
{
    in_file(g, kv->key.p, kv->key.n);
    if (gguf_find(g, "general.alignment") == NULL && g->alignment != 32)
        abort();
    uint64_t u;
    float f;
    gguf_str s;
    char key[80];
    size_t kn = kv->key.n < sizeof key - 1 ? (size_t)kv->key.n : sizeof key - 1;
    memcpy(key, kv->key.p, kn);
    key[kn] = 0;
    /* The first entry with this key as a C string (keys may hold NULs). */
    const gguf_kv *k0 = gguf_find(g, key);
    if (k0 != NULL) {
        (void)gguf_get_u64(g, key, &u);
        (void)gguf_get_f32(g, key, &f);
        if (gguf_get_str(g, key, &s) == 0)
            in_file(g, s.p, s.n);
    }
    if (kv->type != GGUF_T_ARRAY)
        return;
    gguf_arr_iter it;
    gguf_arr_begin(&it, g, kv);
    uint64_t n = 0;
    int64_t iv;
    switch (kv->arr_type) {
    case GGUF_T_STRING:
        while (gguf_arr_next_str(&it, &s) == 0)
            in_file(g, s.p, s.n), n++;
        break;
    case GGUF_T_F32:
    case GGUF_T_F64:
        while (gguf_arr_next_f32(&it, &f) == 0)
            n++;
        break;
    case GGUF_T_U64: /* values past INT64_MAX end the walk early */
        while (gguf_arr_next_i64(&it, &iv) == 0)
            n++;
        if (n > kv->arr_n)
            abort();
        return;
    case GGUF_T_BOOL:
        return;
    default:
        while (gguf_arr_next_i64(&it, &iv) == 0)
            n++;
        break;
    }
    if (n != kv->arr_n)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *copy = malloc(size ? size : 1);
    if (copy == NULL)
        return 0;
    if (size)
        memcpy(copy, data, size);
    gguf g;
    char err[256];
    err[0] = 0;
    if (gguf_parse(copy, size, &g, err, sizeof err) != 0) {
        static const gguf zero;
        if (err[0] == 0 || memcmp(&g, &zero, sizeof g) != 0)
            abort();
        free(copy);
        return 0;
    }
    for (uint64_t i = 0; i < g.n_kv; i++)
        walk_kv(&g, &g.kv[i]);
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const gguf_tensor *t = &g.tensors[i];
        in_file(&g, t->name.p, t->name.n);
        in_file(&g, t->data, t->n_bytes);
        if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
            abort();
        if (t->data < g.base || t->data > g.base + g.size)
            abort();
        if (memchr(t->name.p, 0, (size_t)t->name.n) == NULL && t->name.n < 200) {
            char name[200];
            memcpy(name, t->name.p, (size_t)t->name.n);
            name[t->name.n] = 0;
            if (gguf_tensor_find(&g, name) != t) /* names are unique */
                abort();
        }
        int ok = t->type == GGML_F32 || t->type == GGML_F16 || t->type == GGML_BF16 ||
                 t->type == GGML_Q8_0;
        if (t->n_elems > (1u << 20))
            continue;
        float *out = malloc((t->n_elems ? (size_t)t->n_elems : 1) * sizeof *out);
        if (out == NULL)
            continue;
        err[0] = 0;
        int rc = gguf_tensor_f32(t, out, err, sizeof err);
        if ((rc == 0) != ok || (rc != 0 && err[0] == 0))
            abort();
        free(out);
    }
    gguf_close(&g);
    free(copy);
    return 0;
}
