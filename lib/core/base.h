/* The base of every lib/ file: errors, options structs, overflow-checked
 * arithmetic, geometry, CPU features, CRC32C and dtype conversion
 * (prefix kvt__, never exported). */
#ifndef KVTIER_BASE_H
#define KVTIER_BASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtier/kvtier.h"

#define KVT__HIDDEN __attribute__((visibility("hidden")))
#define KVT__PRINTF(a, b) __attribute__((format(printf, a, b)))

/* ---- errors (error.c) ---------------------------------------------------
 * Records the thread's detail message and returns code, so call sites read
 * `return kvt__err(KVT_EINVAL, "layer: %u >= n_layers %u", l, n);`. */
KVT__HIDDEN int kvt__err(int code, const char *fmt, ...) KVT__PRINTF(2, 3);

/* Whether the byte ranges [a, a + na) and [b, b + nb) share a byte (by
 * address: host or device pointers alike). */
static inline bool kvt__overlap(const void *a, size_t na, const void *b, size_t nb)
{
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return na && nb && x < y + nb && y < x + na;
}

/* Names of the public enums for messages (geometry.c): "f16", "cpu", ...;
 * "?" for a value the enum does not have. */
KVT__HIDDEN const char *kvt__dtype_name(uint32_t dtype);
KVT__HIDDEN const char *kvt__backend_name(uint32_t backend);
/* KVT_EINVAL for an append's src_dtype that names no element type. */
KVT__HIDDEN int kvt__src_dtype_err(uint32_t src_dtype);

/* A path for a message (error.c): itself when short, else its first and
 * last characters around "...", so the message's reason after it is never
 * cut off by the message's length limit. buf holds at least 160 bytes. */
#define KVT__BRIEF_MAX 160u
KVT__HIDDEN const char *kvt__brief(const char *path, char *buf);

#define KVT__CHECK_NULL(p)                                                    \
    do {                                                                      \
        if ((p) == NULL)                                                      \
            return kvt__err(KVT_EINVAL, "%s: must not be NULL", #p);          \
    } while (0)

/* ---- options structs (opts.c) -------------------------------------------
 * Copies a caller's options struct of any size >= min_size into dst (size
 * ours, zero-filled first). Rejects a size below min_size and non-zero
 * bytes past ours (a newer caller asking for something we lack). */
KVT__HIDDEN int kvt__opts_copy(void *dst, size_t ours, const void *src, size_t min_size,
                               const char *what);
/* Checks a selection-cache threshold (kvt_selector_opts.rerank_similarity,
 * the policy's): -1 .. 1, KVT_EINVAL naming `name` otherwise (NaN
 * included). */
KVT__HIDDEN int kvt__similarity_check(float t, const char *name);
/* Output struct variant: validates *struct_size at dst, reports how many
 * bytes to fill and zeroes the caller's tail beyond ours. */
KVT__HIDDEN int kvt__out_struct(void *dst, size_t ours, size_t min_size, const char *what,
                                size_t *fill);

/* ---- overflow-checked arithmetic ---------------------------------------- */
static inline bool kvt__mul_u64(uint64_t a, uint64_t b, uint64_t *r)
{
    return !__builtin_mul_overflow(a, b, r);
}
static inline bool kvt__add_u64(uint64_t a, uint64_t b, uint64_t *r)
{
    return !__builtin_add_overflow(a, b, r);
}

/* ---- geometry (geometry.c) ---------------------------------------------- */
/* Validates *g and writes the resolved geometry (defaults applied). */
KVT__HIDDEN int kvt__geometry_resolve(const kvt_geometry *g, kvt_geometry *out);

/* ---- CPU features (cpu.c) ------------------------------------------------ */
#define KVT__CPU_AVX    (1u << 0)
#define KVT__CPU_F16C   (1u << 1)
#define KVT__CPU_FMA    (1u << 2)
#define KVT__CPU_AVX2   (1u << 3)
#define KVT__CPU_AVX512 (1u << 4) /* AVX-512 F + BW + VL */
KVT__HIDDEN uint32_t kvt__cpu_features(void);

/* ---- CRC32C (crc32c.c) --------------------------------------------------
 * Castagnoli CRC of n bytes continuing from crc (0 to start); the SSE4.2
 * instruction when the CPU has it, else slicing-by-8 tables. The _sw form is
 * always the table version (tests compare the two). */
KVT__HIDDEN uint32_t kvt__crc32c(uint32_t crc, const void *buf, size_t n);
KVT__HIDDEN uint32_t kvt__crc32c_sw(uint32_t crc, const void *buf, size_t n);
/* Copies n bytes src -> dst (not overlapping) and returns CRC32C(0, src):
 * the data is read once, for a check of what was copied. */
KVT__HIDDEN uint32_t kvt__crc32c_copy(void *dst, const void *src, size_t n);

/* ---- element conversion (convert.c) ------------------------------------- */
typedef enum { KVT__RN = 0, KVT__RD = 1, KVT__RU = 2 } kvt__round;
KVT__HIDDEN float kvt__f16_to_f32(uint16_t h);
KVT__HIDDEN float kvt__bf16_to_f32(uint16_t h);
KVT__HIDDEN uint16_t kvt__f32_to_f16(float f, kvt__round mode);
KVT__HIDDEN uint16_t kvt__f32_to_bf16(float f, kvt__round mode);
/* n elements of type src -> f32. */
KVT__HIDDEN void kvt__load_f32(float *dst, const void *src, kvt_dtype src_dtype, size_t n);
/* n f32 -> elements of type dst, rounding as given. */
KVT__HIDDEN void kvt__store_f32(void *dst, kvt_dtype dst_dtype, const float *src, size_t n,
                                kvt__round mode);

#endif /* KVTIER_BASE_H */
