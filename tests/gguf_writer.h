/* A GGUF writer into memory for the tests of the example decoder's model
 * reader (test_gguf, test_decode_model): little-endian scalars, strings,
 * the header, keys and array headers; the tests lay out the rest.
 * Include after cmocka.h (allocation failures are assertions). */
#ifndef KVT_GGUF_WRITER_H
#define KVT_GGUF_WRITER_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../examples/decode/gguf.h"

typedef struct {
    uint8_t *p;
    size_t n, cap;
} wb;

static inline void wb_put(wb *w, const void *d, size_t n)
{
    if (w->n + n > w->cap) {
        size_t c = w->cap ? w->cap : 256;
        while (c < w->n + n)
            c *= 2;
        w->p = realloc(w->p, c);
        assert_non_null(w->p);
        w->cap = c;
    }
    if (n)
        memcpy(w->p + w->n, d, n);
    w->n += n;
}
static inline void wb_free(wb *w)
{
    free(w->p);
    memset(w, 0, sizeof *w);
}
static inline void w_u8(wb *w, uint8_t v)
{
    wb_put(w, &v, 1);
}
static inline void w_le(wb *w, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        w_u8(w, (uint8_t)(v >> (8 * i)));
}
static inline void w_u16(wb *w, uint16_t v)
{
    w_le(w, v, 2);
}
static inline void w_u32(wb *w, uint32_t v)
{
    w_le(w, v, 4);
}
static inline void w_u64(wb *w, uint64_t v)
{
    w_le(w, v, 8);
}
static inline void w_f32(wb *w, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    w_u32(w, u);
}
static inline void w_f64(wb *w, double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    w_u64(w, u);
}
static inline void w_str(wb *w, const char *s)
{
    w_u64(w, strlen(s));
    wb_put(w, s, strlen(s));
}
static inline void w_pad(wb *w, uint64_t a)
{
    while (w->n % a)
        w_u8(w, 0);
}
static inline void w_hdr(wb *w, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    wb_put(w, "GGUF", 4);
    w_u32(w, version);
    w_u64(w, n_tensors);
    w_u64(w, n_kv);
}
/* A key and its value type. */
static inline void w_key(wb *w, const char *key, uint32_t type)
{
    w_str(w, key);
    w_u32(w, type);
}
static inline void w_arr(wb *w, const char *key, uint32_t elem_type, uint64_t n)
{
    w_key(w, key, GGUF_T_ARRAY);
    w_u32(w, elem_type);
    w_u64(w, n);
}

#endif /* KVT_GGUF_WRITER_H */
