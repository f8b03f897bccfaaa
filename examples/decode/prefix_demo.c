/* kvtier-decode --prefix-demo (see prefix_demo.h). */
#include "prefix_demo.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROG "kvtier-decode"

static void check(int rc, const char *what)
{
    if (rc) {
        fprintf(stderr, PROG ": %s failed: %s (%s)\n", what, kvt_err_name(rc), kvt_last_error());
        exit(1);
    }
}

static double bytes_used(const kvt_pool *p)
{
    kvt_stats st;
    st.struct_size = sizeof st;
    check(kvt_pool_stats_get(p, &st), "kvt_pool_stats_get");
    return (double)(st.tier[KVT_TIER_DEVICE].bytes_used + st.tier[KVT_TIER_HOST].bytes_used);
}

int prefix_demo(const model *m, const int32_t *prompt, uint32_t T, const engine_opts *eo,
                int tiered, uint32_t n_req, uint32_t q_tokens, uint64_t seed, int json)
{
    const model_cfg *c = &m->c;
    engine_opts o = *eo;
    o.chunk = o.chunk ? o.chunk : 512;
    o.prefix_cache = 1;
    engine_opts ro = o;
    ro.prefix_cache = 0;
    const uint32_t N = T + q_tokens;
    int32_t *toks = malloc((size_t)N * sizeof *toks);
    float *lr = malloc(c->vocab * sizeof *lr);
    if (!toks || !lr) {
        fprintf(stderr, PROG ": out of memory\n");
        exit(1);
    }
    memcpy(toks, prompt, (size_t)T * sizeof *toks);
    kvcache kc, ref;
    kv_open(&kc, m, &o, tiered, N + 1);
    kv_open(&ref, m, &ro, tiered, N + 1);
    /* Each request has its own sequence (kv_open made an empty one). */
    check(kvt_seq_release(kc.pool, kc.seq), "kvt_seq_release");
    check(kvt_seq_release(ref.pool, ref.seq), "kvt_seq_release");
    work w;
    work_init_rows(&w, c, o.chunk);
    uint64_t s = 0x2545f4914f6cdd1dull ^ seed, saved = 0, total = 0;
    double t_first = 0, t_later = 0, t_ref = 0, worst = 0;
    int mismatch = 0;
    for (uint32_t r = 0; r < n_req; r++) {
        for (uint32_t i = T; i < N; i++) { /* the request's own question */
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            toks[i] = (int32_t)(s % c->vocab);
        }
        kvt_seq_opts so;
        check(kvt_seq_opts_init(&so), "kvt_seq_opts_init");
        so.prefix = (const uint32_t *)toks; /* token ids are never negative */
        so.n_prefix = N;
        double t0 = now_s();
        check(kvt_seq_create(kc.pool, &so, &kc.seq), "kvt_seq_create (prefix)");
        kvt_seq_info si = {.struct_size = sizeof si};
        check(kvt_seq_info_get(kc.pool, kc.seq, &si), "kvt_seq_info_get");
        const uint32_t have = si.prefix_tokens;
        for (uint32_t p0 = have; p0 < N; p0 += o.chunk) {
            const uint32_t n = N - p0 < o.chunk ? N - p0 : o.chunk;
            engine_step(m, &kc, toks + p0, n, p0, 1, 0, &w, NULL, 0, 0);
        }
        const double dt = now_s() - t0;
        /* The reference: the same request prefilled from scratch. */
        t0 = now_s();
        check(kvt_seq_create(ref.pool, NULL, &ref.seq), "kvt_seq_create");
        engine_prefill_chunked(m, toks, N, &ref, 1, o.chunk, lr, NULL, 0, 0);
        const double dr = now_s() - t0;
        double diff = 0;
        for (uint32_t i = 0; i < c->vocab; i++) {
            const double d = fabs((double)w.logits[i] - (double)lr[i]);
            diff = d > diff || d != d ? d : diff;
        }
        const uint32_t next = argmax(w.logits, c->vocab), rnext = argmax(lr, c->vocab);
        mismatch |= next != rnext;
        worst = diff > worst ? diff : worst;
        check(kvt_pool_check(kc.pool), "kvt_pool_check");
        fprintf(stderr, "request %u: %u prompt tokens, %u from the cache, %u prefilled in "
                "%.3f s (from scratch: %.3f s); next token %u (reference %u), last logits "
                "max |diff| %.3g\n", r, N, have, N - have, dt, dr, next, rnext, diff);
        check(kvt_seq_release(kc.pool, kc.seq), "kvt_seq_release"); /* its pages stay cached */
        check(kvt_seq_release(ref.pool, ref.seq), "kvt_seq_release");
        saved += have;
        total += N;
        if (r == 0)
            t_first = dt;
        else
            t_later += dt;
        t_ref += dr;
    }
    kvt_stats st;
    st.struct_size = sizeof st;
    check(kvt_pool_stats_get(kc.pool, &st), "kvt_pool_stats_get");
    const double held = bytes_used(kc.pool);
    /* Every request's KV kept without sharing (what one cache per request holds). */
    const double tok_bytes = (double)st.block_bytes / 16.0 * c->n_layers * c->n_kv_heads;
    const double unshared = (double)n_req * N * tok_bytes;
    const double later = n_req > 1 ? t_later / (n_req - 1) : 0;
    fprintf(stderr, "prefix cache: %llu of %llu prompt tokens came from the cache (%.1f%%); "
            "prefill %.3f s for the first request, %.3f s mean for the later ones (%.1fx "
            "faster; from scratch %.3f s mean); cached now %.1f MiB (device + host) for "
            "%u requests whose KV without sharing is %.1f MiB; logits max |diff| %.3g\n",
            (unsigned long long)saved, (unsigned long long)total, 100.0 * (double)saved / (double)total,
            t_first, later, later > 0 ? t_first / later : 0, t_ref / n_req, held / 1048576.0,
            n_req, unshared / 1048576.0, worst);
    if (json)
        printf("{\"bench\":\"prefix_demo\",\"requests\":%u,\"system_tokens\":%u,"
               "\"question_tokens\":%u,\"chunk\":%u,\"kv\":\"%s\",\"prefix_prefill_saved\":%.4f,"
               "\"first_prefill_s\":%.4f,\"later_prefill_s\":%.4f,\"scratch_prefill_s\":%.4f,"
               "\"cached_bytes\":%.0f,\"unshared_bytes\":%.0f,\"max_logit_diff\":%.4g,"
               "\"next_tokens_agree\":%s}\n",
               n_req, T, q_tokens, o.chunk, tiered ? "tiered" : "dense",
               (double)saved / (double)total, t_first, later, t_ref / n_req, held, unshared, worst,
               mismatch ? "false" : "true");
    work_free(&w);
    kv_close(&kc);
    kv_close(&ref);
    free(toks);
    free(lr);
    return mismatch;
}
