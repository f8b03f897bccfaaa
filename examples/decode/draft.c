/* kvtier-decode --draft N (see draft.h). */
#include "draft.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void truncate_or_die(kvcache *kc, uint32_t n)
{
    int rc = kvt_seq_truncate(kc->pool, kc->seq, n);
    if (rc) {
        fprintf(stderr, "kvtier-decode: kvt_seq_truncate to %u tokens failed: %s (%s)\n", n,
                kvt_err_name(rc), kvt_last_error());
        exit(1);
    }
}

uint32_t draft_generate(const model *m, kvcache *kc, int32_t first, uint32_t pos, uint32_t gen,
                        uint32_t n_draft, int32_t eos, work *w, int32_t *out, draft_stats *ds)
{
    const uint32_t V = m->c.vocab;
    int32_t *d = malloc((n_draft + 1) * sizeof *d);
    if (!d) {
        fprintf(stderr, "kvtier-decode: out of memory\n");
        exit(1);
    }
    memset(ds, 0, sizeof *ds);
    uint32_t have = 0;
    if (gen)
        out[have++] = first;
    int32_t tok = first;
    while (have < gen && tok != eos) {
        /* Draft: n one-token steps through the cache's own path (sparse
         * when tiered), each appending its token. */
        const uint32_t n = gen - have < n_draft ? gen - have : n_draft;
        d[0] = tok;
        for (uint32_t k = 1; k <= n; k++) {
            engine_decode(m, kc, d[k - 1], pos + k - 1, w);
            d[k] = (int32_t)argmax(w->logits, V);
        }
        truncate_or_die(kc, pos); /* the draft's K/V goes */
        /* Verify: d[0..n] as one dense step of n + 1 tokens; row j's logits
         * give dense's token after d[j]. */
        engine_step(m, kc, d, n + 1, pos, 1, 1, w, NULL, 0, 0);
        uint32_t a = 0;
        while (a < n && (int32_t)argmax(w->logits + (size_t)a * V, V) == d[a + 1] &&
               d[a + 1] != eos)
            a++;
        const int32_t next = (int32_t)argmax(w->logits + (size_t)a * V, V);
        /* Keep d[0..a] in the cache (a + 1 tokens), drop the rejected. */
        truncate_or_die(kc, pos + a + 1);
        for (uint32_t j = 1; j <= a && have < gen; j++)
            out[have++] = d[j];
        if (have < gen)
            out[have++] = next;
        ds->verifies++;
        ds->drafted += n;
        ds->accepted += a;
        ds->produced += a + 1;
        pos += a + 1;
        tok = next; /* an eos in the draft is never accepted */
    }
    free(d);
    return have;
}
