/* Writes the GGUF seed corpus of fuzz_gguf.c: three small valid files
 * (each well under 4 KiB) into the directory given as argv[1]:
 *   llama_q8_align16.gguf  v3, Llama-like metadata (strings, u32, f32, a
 *                          string array of tokens, f32 scores, i32 token
 *                          types), general.alignment 16, F32 + Q8_0 tensors
 *   f16_bf16.gguf          v3, default alignment 32, F16 / BF16 / F32
 *                          tensors of 1 to 3 dims, a Q4_0 tensor (parses,
 *                          not widened), arrays of u8 / i16 / u64 / f64 / bool
 *   v2_scalars.gguf        v2, one key of every scalar type, no tensors
 * Build: cc -std=c11 -D_GNU_SOURCE tests/fuzz/gen_gguf_corpus.c -o gen &&
 *        ./gen tests/fuzz/corpus/gguf */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64, T_I64, T_F64 };

static uint8_t buf[8192];
static size_t len;

static void put(const void *p, size_t n)
{
    if (len + n > sizeof buf) {
        fprintf(stderr, "gen_gguf_corpus: seed too large\n");
        exit(1);
    }
    memcpy(buf + len, p, n);
    len += n;
}
static void le(uint64_t v, int n)
{
    for (int i = 0; i < n; i++) {
        uint8_t b = (uint8_t)(v >> (8 * i));
        put(&b, 1);
    }
}
static void f32(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    le(u, 4);
}
static void f64(double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    le(u, 8);
}
static void str(const char *s)
{
    le(strlen(s), 8);
    put(s, strlen(s));
}
static void key(const char *k, uint32_t t)
{
    str(k);
    le(t, 4);
}
static void arr(const char *k, uint32_t et, uint64_t n)
{
    key(k, T_ARR);
    le(et, 4);
    le(n, 8);
}
static void pad(size_t a)
{
    while (len % a)
        le(0, 1);
}
static void hdr(uint32_t version, uint64_t nt, uint64_t nkv)
{
    put("GGUF", 4);
    le(version, 4);
    le(nt, 8);
    le(nkv, 8);
}
static void tinfo(const char *name, uint32_t nd, const uint64_t *dims, uint32_t type, uint64_t off)
{
    str(name);
    le(nd, 4);
    for (uint32_t i = 0; i < nd; i++)
        le(dims[i], 8);
    le(type, 4);
    le(off, 8);
}
static void save(const char *dir, const char *name)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
    printf("%s: %zu bytes\n", path, len);
    len = 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    /* 1: Llama-like, alignment 16, F32 + Q8_0. */
    hdr(3, 2, 8);
    key("general.architecture", T_STR), str("llama");
    key("general.alignment", T_U32), le(16, 4);
    key("llama.context_length", T_U32), le(128, 4);
    key("llama.embedding_length", T_U32), le(32, 4);
    key("llama.rope.freq_base", T_F32), f32(10000.0f);
    arr("tokenizer.ggml.tokens", T_STR, 4), str("<unk>"), str("<s>"), str("</s>"), str("\xe2\x96\x81" "a");
    arr("tokenizer.ggml.scores", T_F32, 4), f32(0), f32(0), f32(0), f32(-1.5f);
    arr("tokenizer.ggml.token_type", T_I32, 4), le(2, 4), le(3, 4), le(3, 4), le(1, 4);
    uint64_t d4[1] = {4}, d32x2[2] = {32, 2};
    tinfo("output_norm.weight", 1, d4, 0, 0);
    tinfo("token_embd.weight", 2, d32x2, 8, 16);
    pad(16);
    f32(1.0f), f32(-2.0f), f32(0.5f), f32(3.0f);
    for (int b = 0; b < 2; b++) {
        le(b ? 0x3800 : 0x3c00, 2); /* scale 1.0, 0.5 */
        for (int k = 0; k < 32; k++)
            le((uint64_t)(uint8_t)(int8_t)(k * 9 - 100), 1);
    }
    save(argv[1], "llama_q8_align16.gguf");

    /* 2: default alignment, F16 / BF16 / F32 / Q4_0, numeric arrays. */
    hdr(3, 4, 6);
    key("general.name", T_STR), str("seed");
    arr("a.u8", T_U8, 3), le(1, 1), le(2, 1), le(255, 1);
    arr("a.i16", T_I16, 2), le((uint16_t)-3, 2), le(4, 2);
    arr("a.u64", T_U64, 2), le(7, 8), le(UINT64_MAX, 8);
    arr("a.f64", T_F64, 2), f64(0.25), f64(-1e300);
    arr("a.bool", T_BOOL, 2), le(1, 1), le(0, 1);
    uint64_t d8[1] = {8}, d2x2x2[3] = {2, 2, 2}, d3[1] = {3}, d32[1] = {32};
    tinfo("h", 1, d8, 1, 0);
    tinfo("bf", 3, d2x2x2, 30, 32);
    tinfo("f", 1, d3, 0, 64);
    tinfo("q4", 1, d32, 2, 96);
    pad(32);
    static const uint16_t h[8] = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x7c00, 0xfc00, 0x7e00, 0x8000};
    for (int i = 0; i < 8; i++)
        le(h[i], 2);
    pad(32);
    static const uint16_t bf[8] = {0x3f80, 0xbf80, 0x0001, 0x7f7f, 0x7f80, 0xff80, 0x7fc0, 0x4049};
    for (int i = 0; i < 8; i++)
        le(bf[i], 2);
    pad(32);
    f32(1.0f), f32(2.0f), f32(3.0f);
    pad(32);
    le(0x3c00, 2);
    for (int k = 0; k < 16; k++)
        le((uint64_t)(k * 17), 1);
    save(argv[1], "f16_bf16.gguf");

    /* 3: version 2, every scalar type, no tensors. */
    hdr(2, 0, 12);
    key("u8", T_U8), le(200, 1);
    key("i8", T_I8), le((uint8_t)-5, 1);
    key("u16", T_U16), le(60000, 2);
    key("i16", T_I16), le((uint16_t)-300, 2);
    key("u32", T_U32), le(4000000000u, 4);
    key("i32", T_I32), le((uint32_t)-7, 4);
    key("f32", T_F32), f32(1.5f);
    key("bool", T_BOOL), le(1, 1);
    key("str", T_STR), str("hello");
    key("u64", T_U64), le(1ull << 40, 8);
    key("i64", T_I64), le((uint64_t)-(1ll << 40), 8);
    key("f64", T_F64), f64(0.1);
    save(argv[1], "v2_scalars.gguf");
    return 0;
}
