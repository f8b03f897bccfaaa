/* Writes the seed corpus of fuzz_seq_restore.c into the directory argv[1]:
 * kvtier-seq(5) streams of the fuzz target's geometry (2 layers, 2 KV
 * heads, head_dim 8, pages of 8 tokens, f16) saved by the library itself:
 *   empty.kvtseq      a sequence with no tokens
 *   one.kvtseq        1 token (one partial page per head)
 *   full.kvtseq       16 tokens (two full pages)
 *   mixed.kvtseq      21 tokens, and a NaN key
 *   uneven.kvtseq     layers of 17 and 9 tokens
 * Built and run by `make fuzz` against the fuzz build's static library. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvtier/kvtier.h>

static FILE *g_out;

static int64_t put(void *ctx, const void *buf, size_t len)
{
    (void)ctx;
    return fwrite(buf, 1, len, g_out) == len ? (int64_t)len : -1;
}

#define OK(call)                                                                           \
    do {                                                                                   \
        if ((call) != 0) {                                                                 \
            fprintf(stderr, "gen_seq_corpus: %s: %s\n", #call, kvt_last_error());          \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_seq_corpus DIR\n");
        return 2;
    }
    kvt_pool_opts o;
    OK(kvt_pool_opts_init(&o));
    o.backend = KVT_BACKEND_CPU;
    o.geom.n_layers = 2;
    o.geom.n_kv_heads = 2;
    o.geom.n_q_heads = 2;
    o.geom.head_dim = 8;
    o.geom.page_tokens = 8;
    o.geom.dtype = KVT_DTYPE_F16;
    o.device_bytes = 64ull * 2u * 8u * 8u * 2u;
    kvt_pool *p;
    OK(kvt_pool_create(&o, &p));
    static const struct {
        const char *name;
        uint32_t n[2];
    } seeds[] = {{"empty", {0, 0}}, {"one", {1, 1}}, {"full", {16, 16}}, {"mixed", {21, 21}},
                 {"uneven", {17, 9}}};
    uint16_t k[21 * 2 * 8], v[21 * 2 * 8];
    for (size_t i = 0; i < sizeof k / 2; i++) {
        k[i] = (uint16_t)(0x3000u + (i * 37u) % 0x0c00u + ((i & 1u) << 15));
        v[i] = (uint16_t)(0x3400u + (i * 11u) % 0x0800u);
    }
    for (size_t s = 0; s < sizeof seeds / sizeof seeds[0]; s++) {
        kvt_seq_id id;
        OK(kvt_seq_create(p, NULL, &id));
        if (s == 3)
            k[5 * 16 + 3] = 0x7e00u; /* a NaN key */
        for (uint32_t l = 0; l < 2; l++)
            if (seeds[s].n[l])
                OK(kvt_seq_append(p, id, l, k, v, seeds[s].n[l], KVT_DTYPE_F16, 0));
        char path[4096];
        snprintf(path, sizeof path, "%s/%s.kvtseq", argv[1], seeds[s].name);
        if (!(g_out = fopen(path, "wb"))) {
            perror(path);
            return 1;
        }
        OK(kvt_seq_save(p, id, put, NULL));
        if (fclose(g_out)) {
            perror(path);
            return 1;
        }
        OK(kvt_seq_release(p, id));
    }
    kvt_pool_destroy(p);
    return 0;
}
