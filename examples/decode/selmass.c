/* kvtier-decode: the attention mass a selection kept (--compare's
 * kept_mass). For one decode token, each query head's softmax over every
 * token the layer holds, in double precision from the stored keys
 * (kvt_seq_read_kv), and the share of it on the pages the step selected
 * for the head's KV head (kvt_step_selection_get). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

static double f16_to_double(uint16_t h)
{
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double s = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0)
        return s * ldexp(m, -24);
    if (e == 31)
        return m ? NAN : s * INFINITY;
    return s * ldexp(m + 1024, e - 25);
}

void selmass_layer(kvcache *kc, kvt_step *st, uint32_t layer, const float *q, const model_cfg *c)
{
    const uint32_t H = c->n_kv_heads, G = c->n_heads / c->n_kv_heads, D = c->head_dim;
    uint32_t T = 0;
    if (kvt_seq_length_get(kc->pool, kc->seq, layer, &T) || T == 0)
        return;
    const uint32_t P = 16, np = (T + P - 1) / P;
    uint16_t *k = malloc((size_t)T * D * sizeof *k);
    uint32_t *pages = malloc((size_t)np * sizeof *pages);
    uint8_t *sel = malloc(np);
    double *s = malloc((size_t)T * sizeof *s);
    if (!k || !pages || !sel || !s) {
        fprintf(stderr, "kvtier-decode: out of memory measuring the kept mass\n");
        exit(1);
    }
    const double scale = 1.0 / sqrt((double)D);
    for (uint32_t h = 0; h < H; h++) {
        uint32_t n = 0;
        if (kvt_seq_read_kv(kc->pool, kc->seq, layer, h, 0, T, k, NULL) ||
            kvt_step_selection_get(st, layer, 0, h, pages, np, &n, NULL)) {
            fprintf(stderr, "kvtier-decode: kept mass: %s\n", kvt_last_error());
            exit(1);
        }
        memset(sel, 0, np);
        for (uint32_t j = 0; j < n; j++)
            sel[pages[j]] = 1;
        for (uint32_t g = 0; g < G; g++) {
            const float *qg = q + ((size_t)h * G + g) * D;
            double mx = -INFINITY;
            for (uint32_t t = 0; t < T; t++) {
                double dot = 0;
                for (uint32_t d = 0; d < D; d++)
                    dot += (double)qg[d] * f16_to_double(k[(size_t)t * D + d]);
                s[t] = dot * scale;
                mx = s[t] > mx ? s[t] : mx;
            }
            double all = 0, kept = 0;
            for (uint32_t t = 0; t < T; t++) {
                const double e = exp(s[t] - mx);
                all += e;
                kept += sel[t / P] ? e : 0;
            }
            kc->mass_sum += kept / all;
            kc->mass_n++;
        }
    }
    free(k);
    free(pages);
    free(sel);
    free(s);
}
