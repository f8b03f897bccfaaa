/* kvtier-decode: the GGUF reader (see gguf.h).
 *
 * Parsing walks the file once with a bounds-checked cursor: every length or
 * count read from the file is compared with the bytes left before it is
 * used, and every size computed from file values (element counts, byte
 * counts, offsets) uses overflow-checked arithmetic. The kv and tensor
 * arrays are allocated only after their counts have been bounded by the
 * bytes left divided by the smallest possible encoded entry, so a hostile
 * header cannot ask for more memory than a small multiple of the file.
 * After a successful parse every gguf_kv and gguf_tensor points at checked
 * bytes, which the getters and iterators below rely on (they still check
 * against the mapping, cheaply). */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_HEADER_SIZE 24u
/* Smallest encodings: a kv is an empty key (8), a type (4) and a u8 (1); a
 * tensor info is an empty name (8), n_dims (4), one dim (8), a type (4) and
 * an offset (8). */
#define GGUF_MIN_KV 13u
#define GGUF_MIN_TENSOR 32u
#define GGUF_DEFAULT_ALIGNMENT 32u

#if defined(__GNUC__) || defined(__clang__)
#define GGUF_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define GGUF_PRINTF(a, b)
#endif

GGUF_PRINTF(3, 4)
static void set_err(char *err, size_t cap, const char *fmt, ...)
{
    if (err == NULL || cap == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    if (n < 0)
        snprintf(err, cap, "gguf: error");
}

/* ---- little-endian loads ------------------------------------------------ */
static uint16_t ld16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (uint16_t)(p[1] << 8));
}
static uint32_t ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t ld64(const uint8_t *p)
{
    return (uint64_t)ld32(p) | (uint64_t)ld32(p + 4) << 32;
}
static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 31u, m = h & 1023u;
    uint32_t u;
    if (e == 31) {
        u = sign | 0x7f800000u | (m << 13); /* inf, NaN (payload kept) */
    } else if (e != 0) {
        u = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
        u = sign;
    } else { /* subnormal: normalize */
        uint32_t ee = 113;
        while ((m & 1024u) == 0) {
            m <<= 1;
            ee--;
        }
        u = sign | (ee << 23) | ((m & 1023u) << 13);
    }
    return f32_from_bits(u);
}
static float bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

/* ---- names ---------------------------------------------------------------- */
static const char *value_type_name(uint32_t t)
{
    static const char *const names[] = {"u8",  "i8",     "u16",   "i16", "u32",
                                        "i32", "f32",    "bool",  "string", "array",
                                        "u64", "i64",    "f64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

/* Fixed size of a scalar value type; 0 for string, array and unknown. */
static size_t scalar_size(uint32_t t)
{
    switch (t) {
    case GGUF_T_U8: case GGUF_T_I8: case GGUF_T_BOOL: return 1;
    case GGUF_T_U16: case GGUF_T_I16: return 2;
    case GGUF_T_U32: case GGUF_T_I32: case GGUF_T_F32: return 4;
    case GGUF_T_U64: case GGUF_T_I64: case GGUF_T_F64: return 8;
    default: return 0;
    }
}

static int is_int_type(uint32_t t)
{
    switch (t) {
    case GGUF_T_U8: case GGUF_T_I8: case GGUF_T_U16: case GGUF_T_I16: case GGUF_T_U32:
    case GGUF_T_I32: case GGUF_T_U64: case GGUF_T_I64: return 1;
    default: return 0;
    }
}

/* ggml tensor types: elements per block and bytes per block, for sizing any
 * tensor in the directory (only F32/F16/BF16/Q8_0 are widened). */
typedef struct {
    const char *name;
    uint32_t blck;
    uint32_t size;
} ggml_traits;

static const ggml_traits *ggml_type_traits(uint32_t t)
{
    static const ggml_traits tab[] = {
        [0] = {"F32", 1, 4},          [1] = {"F16", 1, 2},
        [2] = {"Q4_0", 32, 18},       [3] = {"Q4_1", 32, 20},
        [6] = {"Q5_0", 32, 22},       [7] = {"Q5_1", 32, 24},
        [8] = {"Q8_0", 32, 34},       [9] = {"Q8_1", 32, 36},
        [10] = {"Q2_K", 256, 84},     [11] = {"Q3_K", 256, 110},
        [12] = {"Q4_K", 256, 144},    [13] = {"Q5_K", 256, 176},
        [14] = {"Q6_K", 256, 210},    [15] = {"Q8_K", 256, 292},
        [16] = {"IQ2_XXS", 256, 66},  [17] = {"IQ2_XS", 256, 74},
        [18] = {"IQ3_XXS", 256, 98},  [19] = {"IQ1_S", 256, 50},
        [20] = {"IQ4_NL", 32, 18},    [21] = {"IQ3_S", 256, 110},
        [22] = {"IQ2_S", 256, 82},    [23] = {"IQ4_XS", 256, 136},
        [24] = {"I8", 1, 1},          [25] = {"I16", 1, 2},
        [26] = {"I32", 1, 4},         [27] = {"I64", 1, 8},
        [28] = {"F64", 1, 8},         [29] = {"IQ1_M", 256, 56},
        [30] = {"BF16", 1, 2},        [34] = {"TQ1_0", 256, 54},
        [35] = {"TQ2_0", 256, 66},    [39] = {"MXFP4", 32, 17},
    };
    if (t >= sizeof tab / sizeof tab[0] || tab[t].name == NULL)
        return NULL;
    return &tab[t];
}

/* ---- cursor ----------------------------------------------------------------- */
typedef struct {
    const uint8_t *base;
    size_t size, pos;
    char *err;
    size_t cap;
} rd;

static size_t rd_left(const rd *r)
{
    return r->size - r->pos;
}

/* Fails (with a message naming `what`) unless n more bytes are there. */
static int rd_need(rd *r, uint64_t n, const char *what, uint64_t idx)
{
    if (n > rd_left(r)) {
        set_err(r->err, r->cap,
                "gguf: truncated: %s (#%llu) at offset %zu needs %llu bytes, %zu left",
                what, (unsigned long long)idx, r->pos, (unsigned long long)n, rd_left(r));
        return -1;
    }
    return 0;
}

static int rd_u32(rd *r, uint32_t *v, const char *what, uint64_t idx)
{
    if (rd_need(r, 4, what, idx))
        return -1;
    *v = ld32(r->base + r->pos);
    r->pos += 4;
    return 0;
}

static int rd_u64(rd *r, uint64_t *v, const char *what, uint64_t idx)
{
    if (rd_need(r, 8, what, idx))
        return -1;
    *v = ld64(r->base + r->pos);
    r->pos += 8;
    return 0;
}

static int rd_str(rd *r, gguf_str *s, const char *what, uint64_t idx)
{
    uint64_t n;
    if (rd_u64(r, &n, what, idx))
        return -1;
    if (n > rd_left(r)) {
        set_err(r->err, r->cap,
                "gguf: %s (#%llu) at offset %zu has length %llu, past the end of the file "
                "(%zu bytes left)",
                what, (unsigned long long)idx, r->pos - 8, (unsigned long long)n, rd_left(r));
        return -1;
    }
    s->p = (const char *)(r->base + r->pos);
    s->n = n;
    r->pos += (size_t)n;
    return 0;
}

static int rd_skip(rd *r, uint64_t n, const char *what, uint64_t idx)
{
    if (rd_need(r, n, what, idx))
        return -1;
    r->pos += (size_t)n;
    return 0;
}

/* ---- parsing ------------------------------------------------------------------ */
static int str_cmp(const void *a, const void *b)
{
    const gguf_str *x = a, *y = b;
    if (x->n != y->n)
        return x->n < y->n ? -1 : 1;
    return x->n ? memcmp(x->p, y->p, (size_t)x->n) : 0;
}

/* Finds a repeated string among n (sorting a copy): 0 when all differ, 1
 * with *dup set, -1 when out of memory. */
static int find_dup(const void *first, size_t stride, uint64_t n, gguf_str *dup)
{
    if (n < 2)
        return 0;
    gguf_str *v = malloc((size_t)n * sizeof *v);
    if (v == NULL)
        return -1;
    const unsigned char *p = first; /* a gguf_str at the start of each element */
    for (uint64_t i = 0; i < n; i++)
        memcpy(&v[i], p + (size_t)i * stride, sizeof *v);
    qsort(v, (size_t)n, sizeof *v, str_cmp);
    int found = 0;
    for (uint64_t i = 1; i < n && !found; i++)
        if (str_cmp(&v[i - 1], &v[i]) == 0) {
            *dup = v[i];
            found = 1;
        }
    free(v);
    return found;
}

static int fmt_name(char *buf, size_t cap, gguf_str s)
{
    /* Printable prefix of a file string, for messages. */
    size_t n = s.n < cap - 1 ? (size_t)s.n : cap - 1, i;
    for (i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s.p[i];
        buf[i] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    buf[i] = 0;
    return (int)i;
}

static int parse_kv(rd *r, uint64_t i, gguf_kv *kv)
{
    if (rd_str(r, &kv->key, "metadata key", i))
        return -1;
    char name[64];
    fmt_name(name, sizeof name, kv->key);
    if (rd_u32(r, &kv->type, "metadata value type", i))
        return -1;
    uint32_t t = kv->type;
    if (t > GGUF_T_F64) {
        set_err(r->err, r->cap, "gguf: metadata key '%s' has unknown value type %u", name, t);
        return -1;
    }
    if (t == GGUF_T_STRING) {
        kv->val = r->base + r->pos;
        gguf_str s;
        return rd_str(r, &s, "metadata string value", i);
    }
    if (t != GGUF_T_ARRAY) {
        kv->val = r->base + r->pos;
        return rd_skip(r, scalar_size(t), "metadata value", i);
    }
    if (rd_u32(r, &kv->arr_type, "metadata array element type", i) ||
        rd_u64(r, &kv->arr_n, "metadata array count", i))
        return -1;
    uint32_t et = kv->arr_type;
    uint64_t n = kv->arr_n;
    kv->val = r->base + r->pos;
    if (et == GGUF_T_ARRAY) {
        set_err(r->err, r->cap, "gguf: metadata key '%s' is an array of arrays (not supported)",
                name);
        return -1;
    }
    if (et > GGUF_T_F64) {
        set_err(r->err, r->cap, "gguf: metadata key '%s' is an array of unknown type %u", name,
                et);
        return -1;
    }
    size_t es = et == GGUF_T_STRING ? 8 : scalar_size(et);
    if (n > rd_left(r) / es) {
        set_err(r->err, r->cap,
                "gguf: metadata key '%s': array count %llu of %s too large for the %zu bytes "
                "left",
                name, (unsigned long long)n, value_type_name(et), rd_left(r));
        return -1;
    }
    if (et != GGUF_T_STRING)
        return rd_skip(r, n * es, "metadata array", i);
    for (uint64_t k = 0; k < n; k++) {
        gguf_str s;
        if (rd_str(r, &s, "string array element", k)) {
            size_t len = strlen(r->err ? r->err : "");
            if (r->err && len + 1 < r->cap)
                snprintf(r->err + len, r->cap - len, " in key '%s'", name);
            return -1;
        }
    }
    return 0;
}

static int parse_alignment(gguf *g, char *err, size_t cap)
{
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_kv *kv = gguf_find(g, "general.alignment");
    if (kv == NULL)
        return 0;
    uint64_t a;
    if (!is_int_type(kv->type)) {
        set_err(err, cap, "gguf: general.alignment has type %s, expected an integer",
                value_type_name(kv->type));
        return -1;
    }
    if (gguf_get_u64(g, "general.alignment", &a)) {
        set_err(err, cap, "gguf: general.alignment is negative");
        return -1;
    }
    if (a == 0 || (a & (a - 1)) != 0 || a > (1u << 30)) {
        set_err(err, cap, "gguf: general.alignment %llu is not a power of two up to 2^30",
                (unsigned long long)a);
        return -1;
    }
    g->alignment = a;
    return 0;
}

static int parse_tensor(rd *r, uint64_t i, gguf_tensor *t, uint64_t *off_out)
{
    if (rd_str(r, &t->name, "tensor name", i))
        return -1;
    char name[64];
    fmt_name(name, sizeof name, t->name);
    if (rd_u32(r, &t->n_dims, "tensor n_dims", i))
        return -1;
    if (t->n_dims == 0 || t->n_dims > GGUF_MAX_DIMS) {
        set_err(r->err, r->cap, "gguf: tensor '%s' has n_dims %u (must be 1..%d)", name,
                t->n_dims, GGUF_MAX_DIMS);
        return -1;
    }
    for (uint32_t d = 0; d < t->n_dims; d++) {
        if (rd_u64(r, &t->dims[d], "tensor dim", i))
            return -1;
        if (t->dims[d] > (uint64_t)INT64_MAX) {
            set_err(r->err, r->cap, "gguf: tensor '%s' dim %u is %llu (negative as int64)",
                    name, d, (unsigned long long)t->dims[d]);
            return -1;
        }
    }
    for (uint32_t d = t->n_dims; d < GGUF_MAX_DIMS; d++)
        t->dims[d] = 1;
    uint64_t off;
    if (rd_u32(r, &t->type, "tensor type", i) || rd_u64(r, &off, "tensor offset", i))
        return -1;
    const ggml_traits *tr = ggml_type_traits(t->type);
    if (tr == NULL) {
        set_err(r->err, r->cap, "gguf: tensor '%s' has unknown ggml type %u", name, t->type);
        return -1;
    }
    uint64_t n = 1;
    int zero = 0;
    for (uint32_t d = 0; d < t->n_dims; d++)
        zero |= t->dims[d] == 0;
    for (uint32_t d = 0; d < t->n_dims && !zero; d++)
        if (__builtin_mul_overflow(n, t->dims[d], &n) || n > (uint64_t)INT64_MAX) {
            set_err(r->err, r->cap,
                    "gguf: tensor '%s': element count overflows (dims %llu x %llu x %llu x "
                    "%llu)",
                    name, (unsigned long long)t->dims[0], (unsigned long long)t->dims[1],
                    (unsigned long long)t->dims[2], (unsigned long long)t->dims[3]);
            return -1;
        }
    if (zero)
        n = 0;
    if (t->dims[0] % tr->blck != 0) {
        set_err(r->err, r->cap,
                "gguf: tensor '%s' of type %s: dims[0] %llu is not a multiple of the block "
                "size %u",
                name, tr->name, (unsigned long long)t->dims[0], tr->blck);
        return -1;
    }
    t->n_elems = n;
    if (__builtin_mul_overflow(n / tr->blck, (uint64_t)tr->size, &t->n_bytes)) {
        set_err(r->err, r->cap, "gguf: tensor '%s': byte size overflows (%llu elements of %s)",
                name, (unsigned long long)n, tr->name);
        return -1;
    }
    *off_out = off;
    return 0;
}

int gguf_parse(const void *buf, size_t size, gguf *g, char *err, size_t cap)
{
    if (err && cap)
        err[0] = 0;
    if (g == NULL) {
        set_err(err, cap, "gguf: no output struct");
        return -1;
    }
    memset(g, 0, sizeof *g);
    if (buf == NULL && size != 0) {
        set_err(err, cap, "gguf: no buffer");
        return -1;
    }
    const uint8_t *b = buf;
    rd r = {b, size, 0, err, cap};
    if (size < GGUF_HEADER_SIZE) {
        set_err(err, cap, "gguf: file too small (%zu bytes, a header is %u)", size,
                GGUF_HEADER_SIZE);
        return -1;
    }
    if (memcmp(b, "GGUF", 4) != 0) {
        set_err(err, cap, "gguf: bad magic %02x %02x %02x %02x (expected 'GGUF')", b[0], b[1],
                b[2], b[3]);
        return -1;
    }
    r.pos = 4;
    uint32_t version;
    uint64_t n_tensors, n_kv;
    rd_u32(&r, &version, "version", 0);
    rd_u64(&r, &n_tensors, "n_tensors", 0);
    rd_u64(&r, &n_kv, "n_kv", 0);
    if (version != 2 && version != 3) {
        set_err(err, cap, "gguf: unsupported version %u (this reader reads 2 and 3)", version);
        return -1;
    }
    if (n_kv > rd_left(&r) / GGUF_MIN_KV) {
        set_err(err, cap, "gguf: n_kv %llu too large for the %zu bytes after the header",
                (unsigned long long)n_kv, rd_left(&r));
        return -1;
    }
    if (n_tensors > rd_left(&r) / GGUF_MIN_TENSOR) {
        set_err(err, cap, "gguf: n_tensors %llu too large for the %zu bytes after the header",
                (unsigned long long)n_tensors, rd_left(&r));
        return -1;
    }
    g->base = b;
    g->size = size;
    g->version = version;
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    g->kv = calloc(n_kv ? (size_t)n_kv : 1, sizeof *g->kv);
    if (g->kv == NULL) {
        set_err(err, cap, "gguf: out of memory for %llu metadata entries",
                (unsigned long long)n_kv);
        goto fail;
    }
    for (uint64_t i = 0; i < n_kv; i++) {
        if (parse_kv(&r, i, &g->kv[i]))
            goto fail;
        g->n_kv = i + 1;
    }
    gguf_str dup;
    int d = find_dup(&g->kv[0].key, sizeof *g->kv, g->n_kv,
                     &dup);
    if (d) {
        char name[64];
        if (d < 0)
            set_err(err, cap, "gguf: out of memory checking metadata keys");
        else {
            fmt_name(name, sizeof name, dup);
            set_err(err, cap, "gguf: duplicate metadata key '%s'", name);
        }
        goto fail;
    }
    if (parse_alignment(g, err, cap))
        goto fail;

    if (n_tensors > rd_left(&r) / GGUF_MIN_TENSOR) {
        set_err(err, cap, "gguf: n_tensors %llu too large for the %zu bytes after the metadata",
                (unsigned long long)n_tensors, rd_left(&r));
        goto fail;
    }
    g->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *g->tensors);
    uint64_t *offs = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *offs);
    if (g->tensors == NULL || offs == NULL) {
        free(offs);
        set_err(err, cap, "gguf: out of memory for %llu tensors", (unsigned long long)n_tensors);
        goto fail;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        if (parse_tensor(&r, i, &g->tensors[i], &offs[i])) {
            free(offs);
            goto fail;
        }
        g->n_tensors = i + 1;
    }
    d = find_dup(&g->tensors[0].name, sizeof *g->tensors,
                 g->n_tensors, &dup);
    if (d) {
        char name[64];
        if (d < 0)
            set_err(err, cap, "gguf: out of memory checking tensor names");
        else {
            fmt_name(name, sizeof name, dup);
            set_err(err, cap, "gguf: duplicate tensor name '%s'", name);
        }
        free(offs);
        goto fail;
    }
    /* Data section: the first multiple of the alignment at or after the end
     * of the tensor infos (pos <= size, alignment <= 2^30: no overflow on
     * 64-bit; checked anyway). */
    uint64_t a = g->alignment, data_start;
    if (__builtin_add_overflow((uint64_t)r.pos, a - 1, &data_start)) {
        free(offs);
        set_err(err, cap, "gguf: data section offset overflows");
        goto fail;
    }
    data_start -= data_start % a;
    if (n_tensors > 0 && data_start > size) {
        free(offs);
        set_err(err, cap,
                "gguf: data section would start at offset %llu, past the end of the file "
                "(%zu bytes)",
                (unsigned long long)data_start, size);
        goto fail;
    }
    uint64_t data_size = n_tensors > 0 ? size - data_start : 0;
    for (uint64_t i = 0; i < n_tensors; i++) {
        gguf_tensor *t = &g->tensors[i];
        char name[64];
        fmt_name(name, sizeof name, t->name);
        uint64_t off = offs[i], end;
        if (off % a != 0) {
            set_err(err, cap, "gguf: tensor '%s' offset %llu is not a multiple of the alignment %llu",
                    name, (unsigned long long)off, (unsigned long long)a);
            free(offs);
            goto fail;
        }
        if (__builtin_add_overflow(off, t->n_bytes, &end) || end > data_size) {
            set_err(err, cap,
                    "gguf: tensor '%s' data (offset %llu, %llu bytes) runs past the end of the "
                    "file (data section of %llu bytes at offset %llu)",
                    name, (unsigned long long)off, (unsigned long long)t->n_bytes,
                    (unsigned long long)data_size, (unsigned long long)data_start);
            free(offs);
            goto fail;
        }
        t->data = b + data_start + off;
    }
    free(offs);
    return 0;
fail:
    free(g->kv);
    free(g->tensors);
    memset(g, 0, sizeof *g);
    return -1;
}

int gguf_open(const char *path, gguf *g, char *err, size_t cap)
{
    if (err && cap)
        err[0] = 0;
    if (g == NULL || path == NULL) {
        set_err(err, cap, "gguf: no path or output struct");
        return -1;
    }
    memset(g, 0, sizeof *g);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        set_err(err, cap, "gguf: cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        set_err(err, cap, "gguf: cannot stat %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        set_err(err, cap, "gguf: %s is not a regular file", path);
        close(fd);
        return -1;
    }
    if (st.st_size < (off_t)GGUF_HEADER_SIZE) {
        set_err(err, cap, "gguf: %s is too small (%lld bytes, a header is %u)", path,
                (long long)st.st_size, GGUF_HEADER_SIZE);
        close(fd);
        return -1;
    }
    if ((uint64_t)st.st_size > (uint64_t)SIZE_MAX) {
        set_err(err, cap, "gguf: %s is too large to map", path);
        close(fd);
        return -1;
    }
    size_t size = (size_t)st.st_size;
    void *m = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED) {
        set_err(err, cap, "gguf: cannot map %s: %s", path, strerror(e));
        return -1;
    }
    if (gguf_parse(m, size, g, err, cap) != 0) {
        munmap(m, size);
        /* Prefix the path to the message. */
        if (err && cap) {
            char tmp[512];
            snprintf(tmp, sizeof tmp, "%s", err);
            set_err(err, cap, "%s: %s", path, tmp);
        }
        return -1;
    }
    g->map = m;
    g->map_size = size;
    return 0;
}

void gguf_close(gguf *g)
{
    if (g == NULL)
        return;
    free(g->kv);
    free(g->tensors);
    if (g->map != NULL)
        munmap(g->map, g->map_size);
    memset(g, 0, sizeof *g);
}

/* ---- look-ups ------------------------------------------------------------------- */
int gguf_str_eq(gguf_str s, const char *c)
{
    if (c == NULL)
        return 0;
    size_t n = strlen(c);
    return s.n == n && (n == 0 || memcmp(s.p, c, n) == 0);
}

const gguf_kv *gguf_find(const gguf *g, const char *key)
{
    if (g == NULL || key == NULL)
        return NULL;
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (gguf_str_eq(g->kv[i].key, key))
            return &g->kv[i];
    return NULL;
}

/* Reads an integer of type t at p: 0 with *neg set for negative values. */
static int load_int(uint32_t t, const uint8_t *p, uint64_t *u, int *neg)
{
    *neg = 0;
    int64_t s;
    switch (t) {
    case GGUF_T_U8: *u = p[0]; return 0;
    case GGUF_T_U16: *u = ld16(p); return 0;
    case GGUF_T_U32: *u = ld32(p); return 0;
    case GGUF_T_U64: *u = ld64(p); return 0;
    case GGUF_T_I8: s = (int8_t)p[0]; break;
    case GGUF_T_I16: s = (int16_t)ld16(p); break;
    case GGUF_T_I32: s = (int32_t)ld32(p); break;
    case GGUF_T_I64: s = (int64_t)ld64(p); break;
    default: return -1;
    }
    *neg = s < 0;
    *u = (uint64_t)s;
    return 0;
}

int gguf_get_u64(const gguf *g, const char *key, uint64_t *out)
{
    const gguf_kv *kv = gguf_find(g, key);
    uint64_t u;
    int neg;
    if (kv == NULL || load_int(kv->type, kv->val, &u, &neg) || neg)
        return -1;
    if (out)
        *out = u;
    return 0;
}

int gguf_get_f32(const gguf *g, const char *key, float *out)
{
    const gguf_kv *kv = gguf_find(g, key);
    if (kv == NULL)
        return -1;
    float f;
    if (kv->type == GGUF_T_F32) {
        f = f32_from_bits(ld32(kv->val));
    } else if (kv->type == GGUF_T_F64) {
        uint64_t u = ld64(kv->val);
        double dv;
        memcpy(&dv, &u, sizeof dv);
        f = (float)dv;
    } else {
        return -1;
    }
    if (out)
        *out = f;
    return 0;
}

int gguf_get_str(const gguf *g, const char *key, gguf_str *out)
{
    const gguf_kv *kv = gguf_find(g, key);
    if (kv == NULL || kv->type != GGUF_T_STRING)
        return -1;
    if (out) {
        out->n = ld64(kv->val);
        out->p = (const char *)kv->val + 8;
    }
    return 0;
}

void gguf_arr_begin(gguf_arr_iter *it, const gguf *g, const gguf_kv *kv)
{
    it->g = g;
    it->kv = kv;
    it->i = 0;
    it->p = (kv != NULL && kv->type == GGUF_T_ARRAY) ? kv->val : NULL;
}

/* Bytes left in the file from it->p (0 when not iterating a parsed file). */
static size_t iter_left(const gguf_arr_iter *it)
{
    if (it->g == NULL || it->p == NULL || it->kv == NULL || it->i >= it->kv->arr_n)
        return 0;
    const uint8_t *end = it->g->base + it->g->size;
    if (it->p < it->g->base || it->p > end)
        return 0;
    return (size_t)(end - it->p);
}

int gguf_arr_next_str(gguf_arr_iter *it, gguf_str *out)
{
    size_t left = iter_left(it);
    if (left < 8 || it->kv->arr_type != GGUF_T_STRING)
        return -1;
    uint64_t n = ld64(it->p);
    if (n > left - 8)
        return -1;
    if (out) {
        out->n = n;
        out->p = (const char *)it->p + 8;
    }
    it->p += 8 + (size_t)n;
    it->i++;
    return 0;
}

int gguf_arr_next_f32(gguf_arr_iter *it, float *out)
{
    size_t left = iter_left(it);
    if (it->kv == NULL)
        return -1;
    uint32_t t = it->kv->arr_type;
    if ((t != GGUF_T_F32 && t != GGUF_T_F64) || left < scalar_size(t))
        return -1;
    float f;
    if (t == GGUF_T_F32) {
        f = f32_from_bits(ld32(it->p));
    } else {
        uint64_t u = ld64(it->p);
        double dv;
        memcpy(&dv, &u, sizeof dv);
        f = (float)dv;
    }
    if (out)
        *out = f;
    it->p += scalar_size(t);
    it->i++;
    return 0;
}

int gguf_arr_next_i64(gguf_arr_iter *it, int64_t *out)
{
    size_t left = iter_left(it);
    if (it->kv == NULL)
        return -1;
    uint32_t t = it->kv->arr_type;
    uint64_t u;
    int neg;
    if (!is_int_type(t) || left < scalar_size(t) || load_int(t, it->p, &u, &neg))
        return -1;
    if (!neg && u > (uint64_t)INT64_MAX)
        return -1;
    if (out)
        *out = (int64_t)u;
    it->p += scalar_size(t);
    it->i++;
    return 0;
}

const gguf_tensor *gguf_tensor_find(const gguf *g, const char *name)
{
    if (g == NULL || name == NULL)
        return NULL;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (gguf_str_eq(g->tensors[i].name, name))
            return &g->tensors[i];
    return NULL;
}

int gguf_tensor_f32(const gguf_tensor *t, float *out, char *err, size_t cap)
{
    if (t == NULL || (out == NULL && t->n_elems != 0)) {
        set_err(err, cap, "gguf: no tensor or output buffer");
        return -1;
    }
    const uint8_t *p = t->data;
    uint64_t n = t->n_elems;
    switch (t->type) {
    case GGML_F32:
        for (uint64_t i = 0; i < n; i++)
            out[i] = f32_from_bits(ld32(p + 4 * i));
        return 0;
    case GGML_F16:
        for (uint64_t i = 0; i < n; i++)
            out[i] = f16_to_f32(ld16(p + 2 * i));
        return 0;
    case GGML_BF16:
        for (uint64_t i = 0; i < n; i++)
            out[i] = bf16_to_f32(ld16(p + 2 * i));
        return 0;
    case GGML_Q8_0:
        for (uint64_t blk = 0; blk < n / 32; blk++) {
            const uint8_t *q = p + 34 * blk;
            float dsc = f16_to_f32(ld16(q));
            for (int k = 0; k < 32; k++)
                out[32 * blk + (uint64_t)k] = dsc * (float)(int8_t)q[2 + k];
        }
        return 0;
    default: {
        const ggml_traits *tr = ggml_type_traits(t->type);
        char name[64];
        fmt_name(name, sizeof name, t->name);
        set_err(err, cap,
                "gguf: tensor '%s' has type %s (%u); only F32, F16, BF16 and Q8_0 can be "
                "widened to f32",
                name, tr ? tr->name : "unknown", t->type);
        return -1;
    }
    }
}
