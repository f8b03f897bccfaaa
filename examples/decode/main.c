/* kvtier-decode: a minimal Llama-architecture decoder that keeps its KV
 * cache in libkvtier, the way an inference engine embeds it.
 *
 * The engine (this file and model.c) owns the model: embeddings, norms,
 * projections, RoPE, the MLP and the prefill's own attention (GEMM over
 * chunks). libkvtier owns the KV cache and decode attention:
 *
 *   prefill, per layer:  kvt_seq_append(K, V of the prompt)   then, tiered:
 *                        kvt_seq_warmup(queries of the last prompt tokens)
 *   decode, per token:   kvt_step_plan
 *                        per layer: kvt_step_append(k, v)
 *                                   kvt_step_select(q) + kvt_step_decode(q)
 *                        kvt_step_finish
 *
 * --kv dense keeps every page on the device tier and attends over all of
 * them (KVT_STEP_DENSE); --kv tiered (the default) places pages by head
 * class under a policy and attends over the selected pages. --compare runs
 * both on the same prompt and reports how often they agree. --samples N
 * forks the prompt's sequence (kvt_seq_fork) into N samples that share its
 * pages; --save / --resume keep a session in a file (kvt_seq_save /
 * kvt_seq_restore, session.c).
 *
 * Run `kvtier-decode --help` for the options. */
#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvtier/kvtier.h>

#include "gguf.h"
#include "draft.h"
#include "prefill_ab.h"
#include "prefix_demo.h"
#include "remote_run.h"
#include "engine.h"
#include "model.h"
#include "session.h"
#include "tokenizer.h"

#define PROG "kvtier-decode"


#define CHECK(call)                                                                        \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_) {                                                                         \
            fprintf(stderr, PROG ": %s failed: %s (%s)\n", #call, kvt_err_name(rc_),       \
                    kvt_last_error());                                                     \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static void die(const char *fmt, const char *arg)
{
    fprintf(stderr, PROG ": ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    exit(1);
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        die("out of memory (%s)", "allocation failed");
    return p;
}


/* ---- options ------------------------------------------------------------------- */
typedef struct opts {
    const char *model, *tokenizer, *prompt, *prompt_file, *policy, *disk, *save, *resume;
    const char *remote;   /* --remote URL */
    int tiered, compare, json, quiet, prefill_ab;
    uint32_t prefix_demo; /* requests of --prefix-demo (0 = off) */
    uint32_t question;    /* their question tokens */
    uint32_t budget, threads, ctx, gen, prompt_tokens, samples, chunk, draft;
    uint32_t method, interval; /* --selector, --interval */
    uint32_t prompt_gen;       /* --prompt-gen N */
    float rerank_sim;          /* --rerank-sim (NaN: the default) */
    uint64_t seed;
    float temp, top_p;
} opts;

static const char usage[] =
    "usage: " PROG " [options]\n"
    "  --model FILE         GGUF (llama, qwen2) or llama2.c checkpoint; default: the\n"
    "                       embedded synthetic model\n"
    "  --tokenizer FILE     llama2.c tokenizer.bin (GGUF files carry their own)\n"
    "  --prompt TEXT | --prompt-file FILE   text prompt (needs a tokenizer)\n"
    "  --prompt-tokens N    synthetic prompt of N token ids (default 16384 for the\n"
    "                       embedded model, 64 otherwise) when no text is given\n"
    "  --prompt-gen N       the prompt is N tokens the model samples itself from BOS\n"
    "                       (temperature 1, --seed): text-like context without a\n"
    "                       tokenizer\n"
    "  --kv dense|tiered    KV placement (default tiered)\n"
    "  --budget N           tokens each head attends (top-K pages; default 1024)\n"
    "  --policy FILE        head-stability profile (kvtier-profile(5)); default: every\n"
    "                       eighth KV head unstable, the rest stable, interval 16\n"
    "  --disk DIR           tiered: add the disk tier in DIR, host tier 25% of the KV\n"
    "  --ctx N              context length to size the pool for (default prompt + gen)\n"
    "  --gen N              tokens to generate (default 32)\n"
    "  --threads N          worker threads (default: online CPUs)\n"
    "  --temp T --top-p P   sampling (default greedy: temp 0)\n"
    "  --seed N             sampling and synthetic-prompt seed (default 1)\n"
    "  --compare            run dense and tiered on the same prompt; report agreement\n"
    "                       and the attention mass the selection kept (kept_mass)\n"
    "  --selector M         the tiered cache's page scores: minmax (Quest's bound, the\n"
    "                       default), mean, token (TokenSelect: exact q.k of every\n"
    "                       key, soft-voted) or oracle (the true attention mass, as\n"
    "                       slow as dense: a yardstick)\n"
    "  --interval N         the built-in policy's rerank interval of stable heads\n"
    "                       (default 16)\n"
    "  --rerank-sim X       the selection cache: rescore a head between its reranks\n"
    "                       when its query's cosine similarity to the last rerank's\n"
    "                       falls below X (-1 = never; default 0.8)\n"
    "  --samples N          N samples of the prompt, forks sharing its pages (with --temp)\n"
    "  --chunk N            prefill through kvtier: dense steps of N new tokens each\n"
    "                       (default 512); 0 = the engine's own GEMM attention\n"
    "  --draft N            self-speculative greedy decoding: the cache's path drafts N\n"
    "                       tokens, one dense step of N + 1 verifies them\n"
    "  --prefill-ab         time the GEMM prefill against the chunked one (dense and\n"
    "                       tiered caches), median of 3, then exit\n"
    "  --prefix-demo N      N requests that share the prompt as a system prompt, each\n"
    "                       with --question own tokens, through the prefix cache (the\n"
    "                       later ones attach the prompt's pages and prefill only the\n"
    "                       rest); prints prefill times and bytes saved, then exits\n"
    "  --question N         question tokens per --prefix-demo request (default 64)\n"
    "  --remote URL         share the prompt's KV through Redis (redis://host:port,\n"
    "                       unix:/path, or a cluster's nodes, comma-separated): a run\n"
    "                       on a prompt an earlier run of the same model wrote lands\n"
    "                       its pages and prefills only the rest\n"
    "  --save FILE          save the session (KV cache and sampler) after generating\n"
    "  --resume FILE        continue a saved session (no prompt; same model)\n"
    "  --json               print one JSON summary line on stdout at the end\n"
    "  --quiet              no generated text\n";

static uint32_t parse_u32(const char *s, const char *flag)
{
    char *end;
    errno = 0;
    unsigned long v = s ? strtoul(s, &end, 10) : 0;
    if (!s || !*s || *end || errno || v > UINT32_MAX)
        die("bad value for %s", flag);
    return (uint32_t)v;
}

static void parse(int argc, char **argv, opts *o)
{
    memset(o, 0, sizeof *o);
    o->tiered = 1;
    o->budget = 1024;
    o->gen = 32;
    o->seed = 1;
    o->top_p = 1.0f;
    o->chunk = 512;
    o->rerank_sim = NAN;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define ARG(name) (!strcmp(a, name) && (v || (die("%s needs a value", name), 0)) && ++i)
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(usage, stdout);
            exit(0);
        } else if (!strcmp(a, "--compare"))
            o->compare = 1;
        else if (!strcmp(a, "--json"))
            o->json = 1;
        else if (!strcmp(a, "--quiet"))
            o->quiet = 1;
        else if (!strcmp(a, "--prefill-ab"))
            o->prefill_ab = 1;
        else if (ARG("--model"))
            o->model = v;
        else if (ARG("--tokenizer"))
            o->tokenizer = v;
        else if (ARG("--prompt"))
            o->prompt = v;
        else if (ARG("--prompt-file"))
            o->prompt_file = v;
        else if (ARG("--policy"))
            o->policy = v;
        else if (ARG("--disk"))
            o->disk = v;
        else if (ARG("--kv")) {
            if (!strcmp(v, "dense"))
                o->tiered = 0;
            else if (!strcmp(v, "tiered"))
                o->tiered = 1;
            else
                die("--kv must be dense or tiered, not %s", v);
        } else if (ARG("--selector")) {
            static const char *const names[] = {"minmax", "mean", "token", "oracle"};
            o->method = 4;
            for (uint32_t m = 0; m < 4; m++)
                if (!strcmp(v, names[m]))
                    o->method = m;
            if (o->method == 4)
                die("--selector must be minmax, mean, token or oracle, not %s", v);
        } else if (ARG("--prompt-gen")) {
            o->prompt_gen = parse_u32(v, "--prompt-gen");
        } else if (ARG("--interval")) {
            o->interval = parse_u32(v, "--interval");
            if (!o->interval)
                die("--interval must be at least 1%s", "");
        } else if (ARG("--rerank-sim")) {
            char *end;
            o->rerank_sim = strtof(v, &end);
            if (*end || !(o->rerank_sim >= -1.0f && o->rerank_sim <= 1.0f))
                die("--rerank-sim must be a number in -1 .. 1, not %s", v);
        } else if (ARG("--budget"))
            o->budget = parse_u32(v, "--budget");
        else if (ARG("--threads"))
            o->threads = parse_u32(v, "--threads");
        else if (ARG("--ctx"))
            o->ctx = parse_u32(v, "--ctx");
        else if (ARG("--gen"))
            o->gen = parse_u32(v, "--gen");
        else if (ARG("--prompt-tokens"))
            o->prompt_tokens = parse_u32(v, "--prompt-tokens");
        else if (ARG("--samples"))
            o->samples = parse_u32(v, "--samples");
        else if (ARG("--chunk"))
            o->chunk = parse_u32(v, "--chunk");
        else if (ARG("--prefix-demo"))
            o->prefix_demo = parse_u32(v, "--prefix-demo");
        else if (ARG("--question"))
            o->question = parse_u32(v, "--question");
        else if (ARG("--draft"))
            o->draft = parse_u32(v, "--draft");
        else if (ARG("--save"))
            o->save = v;
        else if (ARG("--remote"))
            o->remote = v;
        else if (ARG("--resume"))
            o->resume = v;
        else if (ARG("--seed"))
            o->seed = parse_u32(v, "--seed");
        else if (ARG("--temp"))
            o->temp = strtof(v, NULL);
        else if (ARG("--top-p"))
            o->top_p = strtof(v, NULL);
        else {
            fprintf(stderr, PROG ": unknown option %s\n%s", a, usage);
            exit(2);
        }
#undef ARG
    }
    if (o->prompt && o->prompt_file)
        die("give --prompt or --prompt-file, not both%s", "");
    if (!(o->temp >= 0) || !(o->top_p > 0 && o->top_p <= 1))
        die("--temp must be >= 0 and --top-p in (0, 1]%s", "");
    if (o->samples == 0)
        o->samples = 1;
    if (o->samples > 64)
        die("--samples: at most 64%s", "");
    if (o->compare && (o->samples > 1 || o->save || o->resume))
        die("--compare runs one sample, without --save or --resume%s", "");
    if (o->resume && (o->prompt || o->prompt_file || o->prompt_tokens))
        die("--resume continues a saved session; it takes no prompt%s", "");
    if (o->prefix_demo && (o->prefix_demo > 64 || o->compare || o->resume || o->save ||
                           o->samples > 1 || o->draft))
        die("--prefix-demo N (1 to 64) runs alone: no --compare, --resume, --save, --samples "
            "or --draft%s", "");
    if (o->remote && (o->compare || o->resume || o->prefix_demo || o->prefill_ab))
        die("--remote runs one cache from a prompt: no --compare, --resume, --prefix-demo or "
            "--prefill-ab%s", "");
    if (o->question == 0)
        o->question = 64;
    if (o->chunk > KVT_STEP_MAX_NEW)
        die("--chunk: at most 8192 tokens a step%s", "");
    if (o->draft && (o->draft > 64 || o->temp > 0 || o->samples > 1 || o->compare))
        die("--draft N (1 to 64) runs greedy decoding of one sample, without --compare%s", "");
}

/* ---- sampling ------------------------------------------------------------------- */
static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

typedef struct {
    float p;
    uint32_t i;
} prob;

static int prob_desc(const void *a, const void *b)
{
    const prob *x = a, *y = b;
    return (x->p < y->p) - (x->p > y->p);
}

static uint32_t sample(const float *logits, uint32_t n, float temp, float top_p, uint64_t *rng,
                       prob *scratch)
{
    if (temp <= 0)
        return argmax(logits, n);
    float mx = logits[argmax(logits, n)];
    double z = 0;
    for (uint32_t i = 0; i < n; i++) {
        scratch[i].p = expf((logits[i] - mx) / temp);
        scratch[i].i = i;
        z += scratch[i].p;
    }
    qsort(scratch, n, sizeof *scratch, prob_desc);
    double cum = 0, r = (double)(rng_next(rng) >> 11) / 9007199254740992.0;
    uint32_t keep = n;
    for (uint32_t i = 0; i < n; i++) {
        cum += scratch[i].p / z;
        if (cum >= top_p) {
            keep = i + 1;
            break;
        }
    }
    double zk = 0;
    for (uint32_t i = 0; i < keep; i++)
        zk += scratch[i].p;
    double acc = 0;
    for (uint32_t i = 0; i < keep; i++) {
        acc += scratch[i].p / zk;
        if (r < acc)
            return scratch[i].i;
    }
    return scratch[keep - 1].i;
}

/* ---- text ------------------------------------------------------------------------ */
static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        die("cannot open %s", path);
    size_t cap = 1 << 16, n = 0;
    char *b = xmalloc(cap);
    size_t r;
    while ((r = fread(b + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap)
            b = realloc(b, cap *= 2);
        if (!b)
            die("out of memory reading %s", path);
    }
    fclose(f);
    *len = n;
    return b;
}

static void emit(tokenizer *tk, int32_t prev, int32_t id)
{
    if (!tk) {
        printf(" %d", id);
        return;
    }
    size_t n;
    const char *s = tok_decode(tk, prev, id, &n);
    if (s)
        fwrite(s, 1, n, stdout);
}

static int is_gguf(const char *path)
{
    FILE *f = fopen(path, "rb");
    char mg[4] = {0};
    if (!f)
        die("cannot open %s", path);
    size_t r = fread(mg, 1, 4, f);
    fclose(f);
    return r == 4 && !memcmp(mg, "GGUF", 4);
}

int main(int argc, char **argv)
{
    opts o;
    parse(argc, argv, &o);
    if (o.threads)
        openblas_set_num_threads((int)o.threads);
    else
        o.threads = (uint32_t)sysconf(_SC_NPROCESSORS_ONLN);
    char err[512];
    model m;
    gguf g;
    memset(&g, 0, sizeof g);
    tokenizer *tk = NULL;
    const int synthetic = o.model == NULL;
    if (synthetic) {
        model_synthetic(&m, 0);
    } else if (is_gguf(o.model)) {
        if (gguf_open(o.model, &g, err, sizeof err) || model_load_gguf(&m, &g, err, sizeof err) ||
            tok_from_gguf(&tk, &g, err, sizeof err))
            die("%s", err);
    } else {
        if (model_load_llama2c(&m, o.model, err, sizeof err))
            die("%s", err);
        if (o.tokenizer && tok_from_llama2c(&tk, o.tokenizer, m.c.vocab, err, sizeof err))
            die("%s", err);
    }
    const model_cfg *c = &m.c;

    /* The prompt. */
    int32_t *prompt = NULL;
    uint32_t T = 0;
    if (o.resume) {
        if (session_peek(o.resume, &T, err, sizeof err))
            die("%s", err);
        T += 1; /* and the saved next token, fed first */
    } else if (o.prompt || o.prompt_file) {
        if (!tk)
            die("a text prompt needs a tokenizer (a GGUF model, or --tokenizer)%s", "");
        size_t len;
        char *text = o.prompt ? (char *)o.prompt : read_file(o.prompt_file, &len);
        if (o.prompt)
            len = strlen(o.prompt);
        int64_t n = tok_encode(tk, text, len, 1, NULL, 0, err, sizeof err);
        if (n < 0)
            die("%s", err);
        prompt = xmalloc((size_t)(n ? n : 1) * sizeof *prompt);
        tok_encode(tk, text, len, 1, prompt, (size_t)n, err, sizeof err);
        T = (uint32_t)n;
        if (o.prompt_file)
            free(text);
    } else if (o.prompt_gen) {
        /* The model's own text: sampled at temperature 1 through a dense
         * cache of its own, one token at a time. */
        T = o.prompt_gen;
        prompt = xmalloc(T * sizeof *prompt);
        kvcache gk;
        const engine_opts geo = {1024, o.threads, NULL, NULL, 1, 0, 0, 0, 0, NULL, 0, 0, NAN};
        kv_open(&gk, &m, &geo, 0, T + 1);
        work gw;
        work_init(&gw, c);
        prob *gps = xmalloc(c->vocab * sizeof *gps);
        uint64_t s = 0x9e3779b97f4a7c15ull ^ o.seed;
        prompt[0] = synthetic ? 0 : 1; /* llama2.c's BOS */
        for (uint32_t i = 0; i + 1 < T; i++) {
            engine_decode(&m, &gk, prompt[i], i, &gw);
            prompt[i + 1] = (int32_t)sample(gw.logits, c->vocab, 1.0f, 1.0f, &s, gps);
        }
        free(gps);
        work_free(&gw);
        kv_close(&gk);
    } else {
        T = o.prompt_tokens ? o.prompt_tokens : synthetic ? 16384 : 64;
        prompt = xmalloc(T * sizeof *prompt);
        uint64_t s = 0x9e3779b97f4a7c15ull ^ o.seed;
        for (uint32_t i = 0; i < T; i++)
            prompt[i] = (int32_t)(rng_next(&s) % c->vocab);
        if (!synthetic)
            prompt[0] = 1; /* llama2.c's BOS */
    }
    if (T == 0 && !o.resume)
        die("the prompt is empty%s", "");
    const uint32_t ctx = o.ctx ? o.ctx : T + o.gen;
    if (ctx < T + o.gen)
        die("--ctx is below prompt + --gen%s", "");
    if (!synthetic && c->ctx && ctx > c->ctx && !o.quiet)
        fprintf(stderr, PROG ": note: %u tokens exceed the model's trained context %u\n", ctx,
                c->ctx);

    /* The caches: one, or dense + tiered for --compare. */
    kvcache kc[2];
    int nkc = o.compare ? 2 : 1;
    char fp[64];
    kvt_remote_opts ro;
    if (o.remote)
        ro = remote_opts(o.remote, &m, fp);
    const engine_opts eo = {o.budget, o.threads, o.policy, o.disk, o.samples, o.gen,
                            o.resume != NULL, o.chunk, 0, o.remote ? &ro : NULL,
                            o.method, o.interval, o.rerank_sim};
    if (o.prefix_demo)
        return prefix_demo(&m, prompt, T, &eo, o.tiered, o.prefix_demo, o.question, o.seed,
                           o.json);
    if (o.prefill_ab)
        return prefill_ab(&m, prompt, T, &eo, ctx, o.json);
    if (o.compare) {
        kv_open(&kc[0], &m, &eo, 0, ctx);
        kv_open(&kc[1], &m, &eo, 1, ctx);
    } else {
        kv_open(&kc[0], &m, &eo, o.tiered, ctx);
    }
    if (!o.quiet)
        fprintf(stderr, "%s: %s; %u layers, %u/%u heads x %u, vocab %u; prompt %u tokens, "
                "generating %u; KV %s\n", PROG, m.desc, c->n_layers, c->n_heads, c->n_kv_heads,
                c->head_dim, c->vocab, T, o.gen, o.compare ? "dense and tiered" :
                o.tiered ? "tiered" : "dense");

    /* Prefill. */
    const uint32_t n_obs = T < 32 ? T : 32;
    float *obs = xmalloc((size_t)c->n_layers * n_obs * model_qdim(c) * sizeof *obs);
    work w;
    work_init(&w, c);
    float *logits2 = xmalloc(c->vocab * sizeof(float));
    prob *ps = xmalloc(c->vocab * sizeof *ps);
    double t0 = now_s();
    session_state ss = {0, 0};
    remote_report rr = {0, 0, 0, 0, 0, 0};
    if (o.resume) { /* the saved cache, then its next token through it */
        uint32_t have;
        if (session_resume(o.resume, &kc[0], c, ctx + 1, &ss, &have, err, sizeof err))
            die("%s", err);
        engine_decode(&m, &kc[0], ss.next_tok, have, &w);
        T = have + 1;
    } else if (o.remote) { /* what the remote tier has, then the rest */
        remote_prefill(&m, prompt, T, &kc[0], o.chunk ? o.chunk : 512, w.logits, obs, n_obs,
                       &rr);
        if (!o.quiet)
            fprintf(stderr, "remote: %u of %u prompt tokens landed from %s (%.1f MiB, fetch "
                    "%.1f ms), %u from the local cache, %u prefilled; %.3f s\n",
                    rr.remote_tokens, T, o.remote, (double)rr.get_bytes / 1048576.0, rr.fetch_ms,
                    rr.local_tokens, T - rr.remote_tokens - rr.local_tokens, rr.prefill_s);
    } else if (o.chunk) {
        engine_prefill_chunked(&m, prompt, T, kc, nkc, o.chunk, w.logits, obs, n_obs,
                               !o.quiet || T >= 4096);
    } else {
        engine_prefill(&m, prompt, T, kc, nkc, w.logits, obs, n_obs, !o.quiet || T >= 4096,
                       o.threads);
    }
    double t_warm = now_s();
    for (int i = 0; i < nkc && !o.resume; i++)
        if (kc[i].tiered) {
            /* Importance-guided placement from the last prompt queries; a
             * one-sequence engine then waits for its pages (a batching
             * engine would leave the sequence out until kvt_step_ready_get). */
            CHECK(kvt_seq_warmup(kc[i].pool, kc[i].seq, obs, n_obs));
            kvt_mover *mv;
            CHECK(kvt_pool_mover_get(kc[i].pool, &mv));
            CHECK(kvt_mover_wait(mv, KVT_FENCE_ALL, UINT64_MAX));
        }
    const double t_prefill = now_s() - t0;
    t_warm = now_s() - t_warm;

    /* Decode: matrix-vector products this small run faster on one BLAS
     * thread (the library's own workers do the attention). */
    openblas_set_num_threads(1);
    /* --samples: the prompt's sequence and its forks, which share its pages
     * (the open last page of each head is copied); each decodes on its own. */
    kvt_seq_id *sids = xmalloc(o.samples * sizeof *sids);
    sids[0] = kc[0].seq;
    for (uint32_t i = 1; i < o.samples; i++)
        CHECK(kvt_seq_fork(kc[0].pool, sids[0], NULL, &sids[i]));
    float *logits0 = xmalloc(c->vocab * sizeof *logits0);
    memcpy(logits0, w.logits, c->vocab * sizeof *logits0);
    uint32_t agree = 0, compared = 0, n_draft_out = 0;
    draft_stats ds = {0, 0, 0, 0};
    double max_diff = 0;
    kvt_stats st0[2];
    for (int i = 0; i < nkc; i++) {
        st0[i].struct_size = sizeof st0[i];
        CHECK(kvt_pool_stats_get(kc[i].pool, &st0[i]));
    }
    for (uint32_t si = 0; si < o.samples; si++) {
        kc[0].seq = sids[si];
        memcpy(w.logits, logits0, c->vocab * sizeof *logits0);
        uint64_t rng = o.resume && si == 0 ? ss.rng : (o.seed + si) * 0x2545f4914f6cdd1dull + 1;
        int32_t tok = (int32_t)sample(w.logits, c->vocab, o.temp, o.top_p, &rng, ps), prev = -1;
        if (!o.quiet)
            printf("%s%s", o.samples > 1 ? (si ? "\n[sample] " : "[sample] ") : "",
                   tk ? "" : "ids:");
        if (o.draft) { /* greedy, one sample: draft, verify, truncate */
            work wd;
            work_init_rows(&wd, c, o.draft + 1);
            int32_t *toks = xmalloc((o.gen ? o.gen : 1) * sizeof *toks);
            const uint32_t got = draft_generate(&m, &kc[0], tok, T, o.gen, o.draft,
                                                tk ? tok_eos(tk) : -1, &wd, toks, &ds);
            for (uint32_t j = 0; j < got && !o.quiet; j++)
                emit(tk, j ? toks[j - 1] : -1, toks[j]);
            n_draft_out = got;
            free(toks);
            work_free(&wd);
            continue;
        }
        for (uint32_t g2 = 0; g2 < o.gen; g2++) {
            if (!o.quiet) {
                emit(tk, prev, tok);
                fflush(stdout);
            }
            prev = tok;
            if (g2 + 1 == o.gen)
                break;
            const uint32_t pos = T + g2;
            engine_decode(&m, &kc[0], tok, pos, &w);
            if (o.compare) {
                memcpy(logits2, w.logits, c->vocab * sizeof *logits2); /* dense */
                /* The kept mass on a sample of steps: every step of a small
                 * context, every 16th past 4096 tokens (it reads every key). */
                kc[1].mass_due = pos < 4096 || g2 % 16 == 0;
                engine_decode(&m, &kc[1], tok, pos, &w);                 /* tiered */
                kc[1].mass_due = 0;
                compared++;
                agree += argmax(logits2, c->vocab) == argmax(w.logits, c->vocab);
                for (uint32_t i = 0; i < c->vocab; i++) {
                    double dd = fabs((double)logits2[i] - (double)w.logits[i]);
                    max_diff = dd > max_diff ? dd : max_diff;
                }
                memcpy(w.logits, logits2, c->vocab * sizeof *logits2); /* dense leads */
            }
            tok = (int32_t)sample(w.logits, c->vocab, o.temp, o.top_p, &rng, ps);
            if (tk && tok == tok_eos(tk))
                break;
        }
        if (o.save && si == 0) { /* prev: emitted, not yet fed through the cache */
            const session_state out = {prev, rng};
            if (session_save(o.save, &kc[0], c, &out, err, sizeof err))
                die("%s", err);
        }
    }
    kc[0].seq = sids[0];
    free(logits0);
    if (!o.quiet) {
        printf("\n");
        if (synthetic)
            printf("(the embedded model's weights are random, not trained: it repeats a token "
                   "and its ids are not text; what it shows is whether tiered decoding keeps "
                   "dense decoding's tokens, below)\n");
    }

    /* Summary. */
    /* Tokens the timed steps produced: every generated token but the first
     * (sampled from the prefill); with --draft, the verifications' output. */
    const uint32_t steps = o.draft ? (n_draft_out > 1 ? n_draft_out - 1 : 0)
                                   : (o.gen > 1 ? o.gen - 1 : 0) * o.samples;
    kvt_stats st[2];
    for (int i = 0; i < nkc; i++) {
        st[i].struct_size = sizeof st[i];
        CHECK(kvt_pool_stats_get(kc[i].pool, &st[i]));
        CHECK(kvt_pool_check(kc[i].pool));
    }
    kvcache *tv = &kc[nkc - 1]; /* the tiered cache when there is one */
    const kvt_stats *ts = &st[nkc - 1];
    const double dense_bytes = (double)(tv->sz.dense_bytes - ts->block_bytes);
    const double dev = (double)ts->tier[KVT_TIER_DEVICE].bytes_used;
    const double tps = steps ? steps / tv->t_decode : 0;
    const double h2d = (double)(ts->moved_bytes[KVT_DIR_HOST_TO_DEVICE] -
                                st0[nkc - 1].moved_bytes[KVT_DIR_HOST_TO_DEVICE]);
    const uint64_t sp = ts->sel_pages - st0[nkc - 1].sel_pages;
    const double hit = sp ? (double)(ts->sel_resident - st0[nkc - 1].sel_resident) / (double)sp : 1.0;
    fprintf(stderr, "prefill: %u tokens in %.2f s (%.0f tokens/s; kvtier append%s %.2f s)\n", T,
            t_prefill, T / t_prefill, tv->tiered ? " + warm-up" : "",
            tv->t_prefill_kv + (tv->tiered ? t_warm : 0));
    fprintf(stderr, "decode: %u tokens, %.1f tokens/s (%s)", steps, tps,
            tv->tiered ? "tiered" : "dense");
    if (o.compare)
        fprintf(stderr, ", dense %.1f tokens/s: %.2fx", steps / kc[0].t_decode,
                kc[0].t_decode / tv->t_decode);
    for (int i = 0; i < nkc && steps; i++)
        fprintf(stderr, "\n  %s per token: %.2f ms = plan+finish %.2f + kvt_step_append %.2f + select "
                "%.2f + attention %.2f + the model's own %.2f", kc[i].tiered ? "tiered" : "dense",
                1e3 * kc[i].t_decode / steps, 1e3 * kc[i].t_plan / steps,
                1e3 * kc[i].t_append / steps, 1e3 * kc[i].t_select / steps,
                1e3 * kc[i].t_attend / steps,
                1e3 * (kc[i].t_decode - kc[i].t_plan - kc[i].t_append - kc[i].t_select -
                       kc[i].t_attend) / steps);
    fprintf(stderr, "\nKV: device %.1f MiB = %.1f%% of dense %.1f MiB; host %.1f MiB, disk %.1f "
            "MiB; moved host->device %.2f MiB (%.1f KiB/token); hit rate %.3f\n",
            dev / 1048576, 100 * dev / dense_bytes, dense_bytes / 1048576,
            (double)ts->tier[KVT_TIER_HOST].bytes_used / 1048576,
            (double)ts->tier[KVT_TIER_DISK].bytes_used / 1048576, h2d / 1048576,
            steps ? h2d / 1024 / steps : 0, hit);
    if (o.draft)
        fprintf(stderr, "draft: %u verifications of up to %u drafted tokens: %u of %u accepted "
                "(%.3f), %.2f tokens per verification\n", ds.verifies, o.draft, ds.accepted,
                ds.drafted, ds.drafted ? (double)ds.accepted / ds.drafted : 0.0,
                ds.verifies ? (double)ds.produced / ds.verifies : 0.0);
    static const char *const sel_names[] = {"minmax", "mean", "token", "oracle"};
    const double kept_mass = o.compare && kc[1].mass_n ? kc[1].mass_sum / (double)kc[1].mass_n : 1.0;
    const uint64_t hsel = ts->head_selections - st0[nkc - 1].head_selections;
    const double rescored = hsel ? (double)(ts->reranked_heads - st0[nkc - 1].reranked_heads) /
                                       (double)hsel
                                 : 0.0;
    if (o.compare) {
        fprintf(stderr, "compare: top-1 agreement %u/%u (%.3f), max |logit difference| %.4g\n",
                agree, compared, compared ? (double)agree / compared : 1.0, max_diff);
        fprintf(stderr, "selection: %s, kept %.4f of the attention mass; %.1f%% of head "
                "selections rescored (%llu by the selection cache)\n", sel_names[o.method],
                kept_mass, 100.0 * rescored,
                (unsigned long long)(ts->similarity_reranks - st0[nkc - 1].similarity_reranks));
        /* At a glance: what the library is for. */
        const double dd = (double)st[0].tier[KVT_TIER_DEVICE].bytes_used;
        printf("dense  %7.1f tokens/s, device KV %7.1f MiB\n"
               "tiered %7.1f tokens/s, device KV %7.1f MiB (%.1f%%)  ->  %.2fx faster, "
               "same next token %u/%u times\n",
               steps ? steps / kc[0].t_decode : 0.0, dd / 1048576, tps, dev / 1048576,
               dd > 0 ? 100 * dev / dd : 0.0, tv->t_decode > 0 ? kc[0].t_decode / tv->t_decode : 0.0,
               agree, compared);
    }
    if (o.json) {
        printf("{\"model\":\"%s\",\"kv\":\"%s\",\"prompt_tokens\":%u,\"gen_tokens\":%u,"
               "\"threads\":%u,\"budget_tokens\":%u,\"prefill_s\":%.3f,\"prefill_tok_s\":%.1f,"
               "\"decode_tok_s\":%.2f,\"device_bytes\":%.0f,\"dense_bytes\":%.0f,"
               "\"device_fraction\":%.4f,\"host_bytes\":%llu,\"disk_bytes\":%llu,"
               "\"h2d_bytes\":%.0f,\"hit_rate\":%.4f",
               synthetic ? "synthetic" : m.desc, o.compare ? "compare" : tv->tiered ? "tiered" : "dense",
               T, steps, o.threads, o.budget, t_prefill, T / t_prefill, tps, dev, dense_bytes,
               dev / dense_bytes, (unsigned long long)ts->tier[KVT_TIER_HOST].bytes_used,
               (unsigned long long)ts->tier[KVT_TIER_DISK].bytes_used, h2d, hit);
        if (o.draft)
            printf(",\"draft\":%u,\"verifies\":%u,\"draft_accept_rate\":%.4f,"
                   "\"tokens_per_verify\":%.3f", o.draft, ds.verifies,
                   ds.drafted ? (double)ds.accepted / ds.drafted : 0.0,
                   ds.verifies ? (double)ds.produced / ds.verifies : 0.0);
        printf(",\"prefill_chunk\":%u", o.resume ? 0 : o.chunk);
        if (o.remote)
            printf(",\"remote_tokens\":%u,\"remote_fetch_ms\":%.2f,\"remote_get_bytes\":%llu",
                   rr.remote_tokens, rr.fetch_ms, (unsigned long long)rr.get_bytes);
        if (o.compare)
            printf(",\"dense_decode_tok_s\":%.2f,\"decode_speedup\":%.3f,\"top1_agreement\":%.4f,"
                   "\"max_logit_diff\":%.5g,\"compared\":%u",
                   steps / kc[0].t_decode, kc[0].t_decode / tv->t_decode,
                   compared ? (double)agree / compared : 1.0, max_diff, compared);
        if (tv->tiered)
            printf(",\"selector\":\"%s\",\"rescored_fraction\":%.4f,"
                   "\"similarity_reranks\":%llu", sel_names[o.method], rescored,
                   (unsigned long long)(ts->similarity_reranks - st0[nkc - 1].similarity_reranks));
        if (o.compare)
            printf(",\"kept_mass\":%.4f", kept_mass);
        printf("}\n");
    }
    if (o.samples > 1) {
        /* What the forks saved: device and host bytes against as many
         * sequences each holding the prompt. */
        fprintf(stderr, "samples: %u forks of %u prompt tokens: device %.1f MiB + host %.1f MiB "
                "(one sequence %.1f MiB of KV)\n", o.samples, T,
                (double)ts->tier[KVT_TIER_DEVICE].bytes_used / 1048576,
                (double)ts->tier[KVT_TIER_HOST].bytes_used / 1048576,
                (double)(tv->sz.dense_bytes - ts->block_bytes) / 1048576);
    }
    for (uint32_t i = 1; i < o.samples; i++)
        CHECK(kvt_seq_release(kc[0].pool, sids[i]));
    free(sids);
    if (o.remote)
        remote_finish(&kc[0], o.quiet);
    for (int i = 0; i < nkc; i++)
        kv_close(&kc[i]);
    free(obs);
    free(prompt);
    free(logits2);
    free(ps);
    work_free(&w);
    tok_free(tk);
    model_free(&m);
    gguf_close(&g);
    return 0;
}
