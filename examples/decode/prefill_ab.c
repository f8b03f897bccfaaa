/* kvtier-decode --prefill-ab (see prefill_ab.h). */
#include "prefill_ab.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double median3(double *x)
{
    for (int i = 0; i < 3; i++)
        for (int j = i + 1; j < 3; j++)
            if (x[j] < x[i]) {
                double t = x[i];
                x[i] = x[j];
                x[j] = t;
            }
    return x[1];
}

static double max_diff(const float *a, const float *b, uint32_t n)
{
    double m = 0;
    for (uint32_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - (double)b[i]);
        m = d > m || d != d ? d : m;
    }
    return m;
}

int prefill_ab(const model *m, const int32_t *prompt, uint32_t T, const engine_opts *eo,
               uint32_t ctx, int json)
{
    const model_cfg *c = &m->c;
    engine_opts o = *eo;
    if (!o.chunk)
        o.chunk = 512;
    float *lg = malloc(c->vocab * sizeof *lg), *lc = malloc(c->vocab * sizeof *lc);
    float *lt = malloc(c->vocab * sizeof *lt);
    if (!lg || !lc || !lt) {
        fprintf(stderr, "kvtier-decode: out of memory\n");
        exit(1);
    }
    double tg[3], tc[3], tt[3], host_frac = 0;
    for (int r = 0; r < 3; r++) {
        kvcache kc;
        kv_open(&kc, m, &o, 0, ctx);
        double t0 = now_s();
        engine_prefill(m, prompt, T, &kc, 1, lg, NULL, 0, 0, o.threads);
        tg[r] = now_s() - t0;
        kv_close(&kc);

        kv_open(&kc, m, &o, 0, ctx);
        t0 = now_s();
        engine_prefill_chunked(m, prompt, T, &kc, 1, o.chunk, lc, NULL, 0, 0);
        tc[r] = now_s() - t0;
        kv_close(&kc);

        /* Tiered: stable heads' pages go to the host tier as they fill, and
         * later chunks attend to them there. */
        kv_open(&kc, m, &o, 1, ctx);
        t0 = now_s();
        engine_prefill_chunked(m, prompt, T, &kc, 1, o.chunk, lt, NULL, 0, 0);
        tt[r] = now_s() - t0;
        kvt_stats st;
        st.struct_size = sizeof st;
        if (kvt_pool_stats_get(kc.pool, &st) == 0 && kvt_pool_check(kc.pool) == 0) {
            const double dense = (double)(kc.sz.dense_bytes - st.block_bytes);
            host_frac = dense > 0 ? (double)st.tier[KVT_TIER_HOST].bytes_used / dense : 0;
        } else {
            fprintf(stderr, "kvtier-decode: the tiered cache fails its check: %s\n",
                    kvt_last_error());
            exit(1);
        }
        kv_close(&kc);
    }
    const double g = median3(tg), ch = median3(tc), ti = median3(tt);
    const double dc = max_diff(lg, lc, c->vocab), dt = max_diff(lg, lt, c->vocab);
    fprintf(stderr, "prefill of %u tokens, median of 3: GEMM %.3f s, kvtier chunked (%u) %.3f s "
            "(%.3fx), tiered chunked %.3f s (%.3fx, %.0f%% of the KV on the host tier); last "
            "logits vs GEMM: max |diff| %.3g dense, %.3g tiered\n", T, g, o.chunk, ch, ch / g,
            ti, ti / g, 100 * host_frac, dc, dt);
    if (json)
        printf("{\"bench\":\"prefill_ab\",\"prompt_tokens\":%u,\"chunk\":%u,\"threads\":%u,"
               "\"gemm_prefill_s\":%.4f,\"chunked_prefill_s\":%.4f,"
               "\"chunked_tiered_prefill_s\":%.4f,\"tiered_host_fraction\":%.4f,"
               "\"max_logit_diff_dense\":%.4g,\"max_logit_diff_tiered\":%.4g,"
               "\"chunked_prefill_over_gemm\":%.4f,\"chunked_tiered_over_gemm\":%.4f}\n",
               T, o.chunk, o.threads, g, ch, ti, host_frac, dc, dt, ch / g, ti / g);
    free(lg);
    free(lc);
    free(lt);
    return 0;
}
