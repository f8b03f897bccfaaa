/* kvtier-decode: a GGUF reader (versions 2 and 3), enough for Llama-family
 * models: the key/value metadata, the tensor directory and the tensor data,
 * with F32, F16, BF16 and Q8_0 tensors widened to f32.
 *
 * The whole file is mapped read-only; every offset, count and size read from
 * it is checked against the file before use, so a damaged or hostile file
 * gives an error message, never a crash (a libFuzzer target covers
 * gguf_parse). Nothing here calls libkvtier. */
#ifndef KVTD_GGUF_H
#define KVTD_GGUF_H

#include <stddef.h>
#include <stdint.h>

/* Value types of the metadata (the GGUF numbering). */
enum {
    GGUF_T_U8 = 0, GGUF_T_I8 = 1, GGUF_T_U16 = 2, GGUF_T_I16 = 3, GGUF_T_U32 = 4,
    GGUF_T_I32 = 5, GGUF_T_F32 = 6, GGUF_T_BOOL = 7, GGUF_T_STRING = 8, GGUF_T_ARRAY = 9,
    GGUF_T_U64 = 10, GGUF_T_I64 = 11, GGUF_T_F64 = 12
};

/* Tensor types (the ggml numbering) this reader widens to f32. */
enum { GGML_F32 = 0, GGML_F16 = 1, GGML_Q8_0 = 8, GGML_BF16 = 30 };

/* A string inside the mapped file (not NUL-terminated). */
typedef struct gguf_str {
    const char *p;
    uint64_t n;
} gguf_str;

typedef struct gguf_kv {
    gguf_str key;
    uint32_t type;          /* GGUF_T_* */
    uint32_t arr_type;      /* element type when type == GGUF_T_ARRAY */
    uint64_t arr_n;         /* element count when type == GGUF_T_ARRAY */
    const uint8_t *val;     /* the value (or the first array element) in the file */
} gguf_kv;

#define GGUF_MAX_DIMS 4
typedef struct gguf_tensor {
    gguf_str name;
    uint32_t n_dims;
    uint64_t dims[GGUF_MAX_DIMS]; /* dims[0] is the fastest-varying (a row's length) */
    uint32_t type;                /* GGML_* */
    uint64_t n_elems;
    uint64_t n_bytes;
    const uint8_t *data;          /* inside the mapping, checked to fit */
} gguf_tensor;

typedef struct gguf {
    const uint8_t *base;    /* the file's bytes */
    size_t size;
    void *map;              /* mmap'ed region (NULL when parsed from a caller's buffer) */
    size_t map_size;
    uint32_t version;
    uint64_t n_kv, n_tensors;
    gguf_kv *kv;            /* [n_kv] */
    gguf_tensor *tensors;   /* [n_tensors] */
    uint64_t alignment;     /* general.alignment, default 32 */
} gguf;

/* Parses size bytes at buf (the caller keeps buf alive while g is used).
 * Returns 0, or -1 with a message in err (cap bytes). On failure *g holds
 * nothing to free. */
int gguf_parse(const void *buf, size_t size, gguf *g, char *err, size_t cap);
/* Maps and parses a file. */
int gguf_open(const char *path, gguf *g, char *err, size_t cap);
/* Releases what gguf_parse / gguf_open allocated or mapped. Accepts a
 * zeroed struct. */
void gguf_close(gguf *g);

/* Metadata look-ups by key; NULL when absent. */
const gguf_kv *gguf_find(const gguf *g, const char *key);
/* Typed getters: 0 on success, -1 when absent or of another type (integer
 * getters accept any integer type whose value fits). */
int gguf_get_u64(const gguf *g, const char *key, uint64_t *out);
int gguf_get_f32(const gguf *g, const char *key, float *out);  /* F32 or F64 */
int gguf_get_str(const gguf *g, const char *key, gguf_str *out);
/* Element i of a string array (kv->type ARRAY of STRING); -1 past the end.
 * O(i) the first time: callers walk arrays in order with gguf_arr_iter. */
typedef struct gguf_arr_iter {
    const gguf *g;
    const gguf_kv *kv;
    uint64_t i;
    const uint8_t *p;
} gguf_arr_iter;
void gguf_arr_begin(gguf_arr_iter *it, const gguf *g, const gguf_kv *kv);
int gguf_arr_next_str(gguf_arr_iter *it, gguf_str *out);  /* 0, or -1 at the end / bad */
int gguf_arr_next_f32(gguf_arr_iter *it, float *out);     /* F32 arrays */
int gguf_arr_next_i64(gguf_arr_iter *it, int64_t *out);   /* any integer array */

/* A tensor by name; NULL when absent. */
const gguf_tensor *gguf_tensor_find(const gguf *g, const char *name);
/* Widens the n elements of t to f32 (n == t->n_elems). Q8_0: blocks of 32
 * int8 with an f16 scale. Returns 0, or -1 with a message for a type this
 * reader does not support. */
int gguf_tensor_f32(const gguf_tensor *t, float *out, char *err, size_t cap);

/* Compares a file string with a C string. */
int gguf_str_eq(gguf_str s, const char *c);

#endif /* KVTD_GGUF_H */
