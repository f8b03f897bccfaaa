/* kvtier-decode --remote (see remote_run.h). */
#include "remote_run.h"

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

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

kvt_remote_opts remote_opts(const char *url, const model *m, char fp[64])
{
    /* A real engine names its checkpoint (a weights hash, a revision); the
     * example hashes the configuration, the final norm and every 1021st
     * value of the token embedding, which tell its models apart. */
    const model_cfg *c = &m->c;
    uint64_t h = fnv(0xcbf29ce484222325ull, c, sizeof *c);
    h = fnv(h, m->rms_final, c->dim * sizeof *m->rms_final);
    const size_t n = (size_t)c->vocab * c->dim;
    for (size_t i = 0; i < n; i += 1021)
        h = fnv(h, &m->tok_emb[i], sizeof *m->tok_emb);
    snprintf(fp, 64, "kvtier-decode:%016llx", (unsigned long long)h);
    kvt_remote_opts r;
    check(kvt_remote_opts_init(&r), "kvt_remote_opts_init");
    r.endpoints = url;
    r.fingerprint = fp;
    return r;
}

void remote_prefill(const model *m, const int32_t *prompt, uint32_t T, kvcache *kc,
                    uint32_t chunk, float *logits, float *obs, uint32_t n_obs,
                    remote_report *r)
{
    memset(r, 0, sizeof *r);
    r->prompt_tokens = T;
    check(kvt_seq_release(kc->pool, kc->seq), "kvt_seq_release");
    kvt_seq_opts so;
    check(kvt_seq_opts_init(&so), "kvt_seq_opts_init");
    so.prefix = (const uint32_t *)prompt; /* (token ids are never negative) */
    so.n_prefix = T > n_obs ? T - n_obs : 0;
    const double t0 = now_s();
    check(kvt_seq_create(kc->pool, &so, &kc->seq), "kvt_seq_create (prefix)");
    /* A batching engine would go on with its other sequences and ask again
     * (timeout 0); a single request has nothing else to do. */
    uint32_t have;
    check(kvt_seq_prefix_wait(kc->pool, kc->seq, UINT32_MAX, &have), "kvt_seq_prefix_wait");
    kvt_seq_info si = {.struct_size = sizeof si};
    check(kvt_seq_info_get(kc->pool, kc->seq, &si), "kvt_seq_info_get");
    kvt_stats st = {.struct_size = sizeof st};
    check(kvt_pool_stats_get(kc->pool, &st), "kvt_pool_stats_get");
    r->remote_tokens = si.remote_tokens;
    r->local_tokens = have - si.remote_tokens;
    r->fetch_ms = (double)st.remote_fetch_ns / 1e6;
    r->get_bytes = st.remote_get_bytes;
    /* The rest of the prompt's ids (for the pages it completes) go with
     * the steps; the prefix's are the sequence's already. */
    engine_prefill_rest(m, prompt, have, T, kc, chunk, logits, obs, n_obs); /* (have < T) */
    check(kvt_seq_tokens_set(kc->pool, kc->seq, 0, (const uint32_t *)prompt, T),
          "kvt_seq_tokens_set");
    r->prefill_s = now_s() - t0;
}

void remote_finish(kvcache *kc, int quiet)
{
    const double t0 = now_s();
    const int rc = kvt_remote_flush(kc->pool, 60000);
    kvt_stats st = {.struct_size = sizeof st};
    check(kvt_pool_stats_get(kc->pool, &st), "kvt_pool_stats_get");
    if (!quiet || rc)
        fprintf(stderr, "remote: wrote %llu values (%.1f MiB), %llu not written, %llu faults "
                "(flush %.3f s%s)\n", (unsigned long long)st.remote_put_values,
                (double)st.remote_put_bytes / 1048576.0, (unsigned long long)st.remote_put_dropped,
                (unsigned long long)st.remote_errors, now_s() - t0,
                rc ? ": timed out" : "");
}
