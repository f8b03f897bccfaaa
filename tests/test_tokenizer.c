/* kvtier-decode's tokenizers (examples/decode/tokenizer.c): SentencePiece-
 * style and GPT-2 byte-level BPE on small hand-made vocabularies whose
 * encodings were worked out by hand, round trips on random text, the
 * llama2.c tokenizer.bin loader, the GGUF loader (on GGUF files built here
 * in memory) and error paths. The GPT-2 byte table is rebuilt here from the
 * Python definition. */
#include "testutil.h"

#include <unistd.h>

#include "../examples/decode/gguf.h"
#include "../examples/decode/tokenizer.h"

#define U2581 "\xe2\x96\x81"

/* ---- helpers ------------------------------------------------------------- */

/* Index of s in v[n] by a linear scan (the expectation side of the tests). */
static int32_t idx(const char *const *v, uint32_t n, const char *s)
{
    for (uint32_t i = 0; i < n; i++)
        if (strcmp(v[i], s) == 0)
            return (int32_t)i;
    fail_msg("test vocabulary has no '%s'", s);
    return -1;
}

/* Encodes text and checks the ids are exactly the pieces want[] (NULL-ended)
 * of v. */
static void expect_enc(const tokenizer *t, const char *const *v, uint32_t n, const char *text,
                       int add_bos, const char *const *want)
{
    int32_t ids[256];
    char err[256] = "";
    int64_t c = tok_encode(t, text, strlen(text), add_bos, ids, 256, err, sizeof err);
    if (c < 0)
        fail_msg("encode '%s': %s", text, err);
    size_t nw = 0;
    while (want[nw])
        nw++;
    size_t off = 0;
    if (add_bos && tok_bos(t) >= 0) {
        assert_true(c >= 1);
        assert_int_equal(ids[0], tok_bos(t));
        off = 1;
    }
    if ((size_t)c != nw + off) {
        for (int64_t i = 0; i < c && i < 256; i++)
            print_message("  got[%lld] = %d '%s'\n", (long long)i, ids[i], v[ids[i]]);
        fail_msg("encode '%s': %lld ids, expected %zu", text, (long long)c, nw + off);
    }
    for (size_t i = 0; i < nw; i++)
        if (ids[off + i] != idx(v, n, want[i]))
            fail_msg("encode '%s': id %zu is %d '%s', expected '%s'", text, i, ids[off + i],
                     ids[off + i] >= 0 && (uint32_t)ids[off + i] < n ? v[ids[off + i]] : "?",
                     want[i]);
}

/* decode(encode(text)) with BOS requested: the bytes must come back. */
static void expect_round_trip(tokenizer *t, const char *text, size_t len)
{
    size_t cap = 4 * len + 8;
    int32_t *ids = malloc(cap * sizeof *ids);
    char *back = malloc(4 * len + 64);
    char err[256] = "";
    int64_t c = tok_encode(t, text, len, 1, ids, cap, err, sizeof err);
    if (c < 0)
        fail_msg("encode (%zu bytes): %s", len, err);
    assert_true((size_t)c <= cap);
    size_t at = 0;
    int32_t prev = -1;
    for (int64_t i = 0; i < c; i++) {
        assert_true(ids[i] >= 0 && (uint32_t)ids[i] < tok_vocab(t));
        size_t n = 0;
        const char *p = tok_decode(t, prev, ids[i], &n);
        assert_non_null(p);
        assert_true(at + n <= 4 * len + 64);
        memcpy(back + at, p, n);
        at += n;
        prev = ids[i];
    }
    if (at != len || memcmp(back, text, len) != 0) {
        print_message("  in : ");
        for (size_t i = 0; i < len; i++)
            print_message("%02x", (uint8_t)text[i]);
        print_message("\n  out: ");
        for (size_t i = 0; i < at; i++)
            print_message("%02x", (uint8_t)back[i]);
        print_message("\n");
        fail_msg("round trip of %zu bytes gave %zu bytes", len, at);
    }
    free(ids);
    free(back);
}

static const char *dec(tokenizer *t, int32_t prev, int32_t id, size_t *n)
{
    const char *p = tok_decode(t, prev, id, n);
    assert_non_null(p);
    return p;
}

/* ---- SentencePiece ---------------------------------------------------------- */

/* 0 <unk>, 1 <s>, 2 </s>, 3..258 <0x00>..<0xFF>, then these pieces. */
static const struct {
    const char *s;
    float score;
} spm_extra[] = {
    {U2581, -100}, {"h", -100}, {"e", -100}, {"l", -100}, {"o", -100},  {"w", -100},
    {"r", -100},   {"d", -100}, {"he", -1},  {"ll", -2},  {"llo", -3},  {"hello", -4},
    {U2581 "hello", -5}, {U2581 "w", -6}, {"or", -7}, {U2581 "wor", -8}, {"ld", -9},
    {U2581 "world", -10}, {"\xc3\xb1", -50} /* ñ */, {"x", -100}, {"y", -100},
    {"z", -100},   {"xy", -20}, {"yz", -20}, {"p", -100}, {"q", -100}, {"s", -100},
    {"pq", -30},   {"qs", -25},
};
#define SPM_N (259 + sizeof spm_extra / sizeof spm_extra[0])

typedef struct {
    char store[SPM_N][16];
    const char *v[SPM_N];
    float sc[SPM_N];
} spm_vocab;

static void spm_vocab_make(spm_vocab *sv)
{
    strcpy(sv->store[0], "<unk>");
    strcpy(sv->store[1], "<s>");
    strcpy(sv->store[2], "</s>");
    for (int b = 0; b < 256; b++)
        snprintf(sv->store[3 + b], 16, "<0x%02X>", b);
    for (size_t i = 0; i < sizeof spm_extra / sizeof spm_extra[0]; i++)
        strcpy(sv->store[259 + i], spm_extra[i].s);
    for (size_t i = 0; i < SPM_N; i++) {
        sv->v[i] = sv->store[i];
        sv->sc[i] = i >= 259 ? spm_extra[i - 259].score : 0.0f;
    }
}

static tokenizer *spm_make(spm_vocab *sv)
{
    tokenizer *t = NULL;
    char err[256] = "";
    spm_vocab_make(sv);
    if (tok_from_arrays(&t, TOK_SPM, sv->v, sv->sc, SPM_N, NULL, 0, 1, 2, err, sizeof err))
        fail_msg("tok_from_arrays: %s", err);
    assert_int_equal(tok_get_kind(t), TOK_SPM);
    assert_int_equal(tok_vocab(t), SPM_N);
    assert_int_equal(tok_bos(t), 1);
    assert_int_equal(tok_eos(t), 2);
    return t;
}

static void test_spm_hand(void **state)
{
    (void)state;
    spm_vocab sv;
    tokenizer *t = spm_make(&sv);
    const char *const *v = sv.v;
    /* he(-1), ll(-2), llo(-3), hello(-4), ▁hello(-5), ▁w, or, ▁wor, ld, ▁world. */
    expect_enc(t, v, SPM_N, "hello", 0, (const char *[]){U2581 "hello", NULL});
    expect_enc(t, v, SPM_N, "hello", 1, (const char *[]){U2581 "hello", NULL});
    expect_enc(t, v, SPM_N, "hello world", 1,
               (const char *[]){U2581 "hello", U2581 "world", NULL});
    /* "hell": he, ll; "hell" is no piece. */
    expect_enc(t, v, SPM_N, "hell", 0, (const char *[]){U2581, "he", "ll", NULL});
    /* Ties go to the leftmost pair: xy and yz both -20. */
    expect_enc(t, v, SPM_N, "xyz", 0, (const char *[]){U2581, "xy", "z", NULL});
    /* Higher score first: qs (-25) before pq (-30). */
    expect_enc(t, v, SPM_N, "pqs", 0, (const char *[]){U2581, "p", "qs", NULL});
    /* Two spaces: the dummy prefix and the text's are both U+2581. */
    expect_enc(t, v, SPM_N, " hello", 0, (const char *[]){U2581, U2581 "hello", NULL});
    /* A two-byte code point that is a piece; one that is not (é = C3 A9)
     * falls back to its bytes; so does a 4-byte emoji and a lone bad byte. */
    expect_enc(t, v, SPM_N, "\xc3\xb1", 0, (const char *[]){U2581, "\xc3\xb1", NULL});
    expect_enc(t, v, SPM_N, "h\xc3\xa9", 0,
               (const char *[]){U2581, "h", "<0xC3>", "<0xA9>", NULL});
    expect_enc(t, v, SPM_N, "\xf0\x9f\x98\x80", 0,
               (const char *[]){U2581, "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", NULL});
    expect_enc(t, v, SPM_N, "\xff" "d", 0, (const char *[]){U2581, "<0xFF>", "d", NULL});
    expect_enc(t, v, SPM_N, "A\n", 0, (const char *[]){U2581, "<0x41>", "<0x0A>", NULL});
    /* Empty text: nothing, or BOS alone. */
    int32_t ids[4] = {-7, -7, -7, -7};
    assert_int_equal(tok_encode(t, "", 0, 0, ids, 4, NULL, 0), 0);
    assert_int_equal(tok_encode(t, "", 0, 1, ids, 4, NULL, 0), 1);
    assert_int_equal(ids[0], 1);
    /* A short output buffer: the full count, only cap written. */
    ids[0] = ids[1] = ids[2] = -7;
    assert_int_equal(tok_encode(t, "xyz", 3, 1, ids, 2, NULL, 0), 4);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], idx(v, SPM_N, U2581));
    assert_int_equal(ids[2], -7);
    assert_int_equal(tok_encode(t, "xyz", 3, 1, NULL, 0, NULL, 0), 4);
    tok_free(t);
}

static void test_spm_decode(void **state)
{
    (void)state;
    spm_vocab sv;
    tokenizer *t = spm_make(&sv);
    const char *const *v = sv.v;
    size_t n;
    const char *p = dec(t, -1, idx(v, SPM_N, U2581 "hello"), &n);
    assert_int_equal(n, 6);
    assert_memory_equal(p, " hello", 6);
    p = dec(t, 1, idx(v, SPM_N, U2581 "hello"), &n); /* after BOS */
    assert_int_equal(n, 5);
    assert_memory_equal(p, "hello", 5);
    p = dec(t, idx(v, SPM_N, "he"), idx(v, SPM_N, U2581 "world"), &n);
    assert_int_equal(n, 6);
    assert_memory_equal(p, " world", 6);
    p = dec(t, -1, idx(v, SPM_N, "<0x41>"), &n);
    assert_int_equal(n, 1);
    assert_int_equal(p[0], 'A');
    p = dec(t, -1, idx(v, SPM_N, "<0x00>"), &n);
    assert_int_equal(n, 1);
    assert_int_equal(p[0], 0);
    p = dec(t, -1, idx(v, SPM_N, "<0xFF>"), &n);
    assert_int_equal(n, 1);
    assert_int_equal((uint8_t)p[0], 0xff);
    p = dec(t, -1, idx(v, SPM_N, "\xc3\xb1"), &n);
    assert_int_equal(n, 2);
    assert_memory_equal(p, "\xc3\xb1", 2);
    /* BOS and EOS decode to nothing. */
    dec(t, -1, 1, &n);
    assert_int_equal(n, 0);
    dec(t, 5, 2, &n);
    assert_int_equal(n, 0);
    /* Out of range. */
    assert_null(tok_decode(t, -1, -1, &n));
    assert_null(tok_decode(t, -1, (int32_t)SPM_N, &n));
    /* Without BOS the dummy prefix stays: " " + text. */
    int32_t ids[16];
    int64_t c = tok_encode(t, "hello", 5, 0, ids, 16, NULL, 0);
    assert_int_equal(c, 1);
    p = dec(t, -1, ids[0], &n);
    assert_int_equal(n, 6);
    assert_memory_equal(p, " hello", 6);
    tok_free(t);
}

static void test_spm_round_trip(void **state)
{
    (void)state;
    spm_vocab sv;
    tokenizer *t = spm_make(&sv);
    static const char *const fixed[] = {
        "hello world",
        " leading space",
        "two  spaces and trailing ",
        "   ",
        "tab\there\nnewline\r\n",
        "h\xc3\xa9llo w\xc3\xb6rld \xc3\xb1 \xf0\x9f\x98\x80 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e",
        "xyzpqs hellohello worldworld",
        "",
    };
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        expect_round_trip(t, fixed[i], strlen(fixed[i]));
    tu_rng r = {0x5eed1};
    char buf[200];
    static const char ascii[] = "helowrdxyzpqs ABC!?.,\t\n0123";
    static const char *const cps[] = {"h", "e", "l", "o", " ", "\xc3\xb1", "\xc3\xa9",
                                      "\xe6\x97\xa5", "\xf0\x9f\x98\x80", "w", "or", "ld"};
    for (int it = 0; it < 300; it++) {
        /* ASCII */
        size_t n = tu_below(&r, 60);
        for (size_t i = 0; i < n; i++)
            buf[i] = ascii[tu_below(&r, sizeof ascii - 1)];
        expect_round_trip(t, buf, n);
        /* UTF-8 */
        n = 0;
        for (uint32_t k = tu_below(&r, 30); k > 0; k--) {
            const char *c = cps[tu_below(&r, sizeof cps / sizeof cps[0])];
            memcpy(buf + n, c, strlen(c));
            n += strlen(c);
        }
        expect_round_trip(t, buf, n);
        /* Any bytes (invalid UTF-8 included) but U+2581 itself, which
         * decodes to a space. */
        n = tu_below(&r, 60);
        for (size_t i = 0; i < n; i++)
            buf[i] = (char)tu_below(&r, 256);
        if (memmem(buf, n, U2581, 3) == NULL)
            expect_round_trip(t, buf, n);
    }
    tok_free(t);
}

/* Without <0xNN> pieces a character outside the vocabulary is an error. */
static void test_spm_missing_byte(void **state)
{
    (void)state;
    const char *v[] = {"<unk>", "<s>", "</s>", U2581, "a"};
    float sc[] = {0, 0, 0, -1, -1};
    tokenizer *t = NULL;
    char err[256] = "";
    assert_int_equal(tok_from_arrays(&t, TOK_SPM, v, sc, 5, NULL, 0, 1, 2, err, sizeof err),
                     0);
    int32_t ids[8];
    assert_int_equal(tok_encode(t, "a", 1, 1, ids, 8, err, sizeof err), 3);
    err[0] = 0;
    assert_int_equal(tok_encode(t, "a\xc3\xa9", 3, 1, ids, 8, err, sizeof err), -1);
    assert_non_null(strstr(err, "0xC3"));
    /* NULL / zero-sized error buffers are fine. */
    assert_int_equal(tok_encode(t, "b", 1, 1, ids, 8, NULL, 0), -1);
    assert_int_equal(tok_encode(t, "b", 1, 1, ids, 8, err, 1), -1);
    assert_int_equal(err[0], 0);
    tok_free(t);
}

/* ---- GPT-2 byte-level BPE --------------------------------------------------- */

/* bytes_to_unicode() as in GPT-2's encoder.py:
 *   bs = list(range(ord("!"), ord("~")+1)) + list(range(ord("¡"), ord("¬")+1))
 *        + list(range(ord("®"), ord("ÿ")+1)); cs = bs[:]
 *   n = 0; for b in range(256): if b not in bs: bs.append(b); cs.append(256+n); n += 1 */
static void ref_b2u(uint32_t cp[256])
{
    int in_bs[256] = {0};
    for (int b = '!'; b <= '~'; b++)
        in_bs[b] = 1;
    for (int b = 0xa1; b <= 0xac; b++)
        in_bs[b] = 1;
    for (int b = 0xae; b <= 0xff; b++)
        in_bs[b] = 1;
    uint32_t n = 0;
    for (int b = 0; b < 256; b++)
        cp[b] = in_bs[b] ? (uint32_t)b : 256 + n++;
}

static void put_utf8(uint32_t c, char *o)
{
    if (c < 0x80) {
        o[0] = (char)c, o[1] = 0;
    } else { /* < 0x800 here */
        o[0] = (char)(0xc0 | (c >> 6));
        o[1] = (char)(0x80 | (c & 0x3f));
        o[2] = 0;
    }
}

#define BPE_MAX 320
typedef struct {
    char store[BPE_MAX][24];
    const char *v[BPE_MAX];
    uint32_t n;
} bpe_vocab;

/* Ids 0..255: the symbol of byte b at id b (skip: a byte left out, -1 for
 * none; its slot gets a dummy "<skip>"), then extra[]. */
static void bpe_vocab_make(bpe_vocab *bv, const char *const *extra, int skip)
{
    uint32_t cp[256];
    ref_b2u(cp);
    for (int b = 0; b < 256; b++)
        if (b == skip)
            strcpy(bv->store[b], "<skip>");
        else
            put_utf8(cp[b], bv->store[b]);
    bv->n = 256;
    for (size_t i = 0; extra && extra[i]; i++)
        strcpy(bv->store[bv->n++], extra[i]);
    for (uint32_t i = 0; i < bv->n; i++)
        bv->v[i] = bv->store[i];
}

static tokenizer *bpe_make(bpe_vocab *bv, const char *const *extra,
                           const char *const *merges, int skip)
{
    bpe_vocab_make(bv, extra, skip);
    uint32_t nm = 0;
    while (merges && merges[nm])
        nm++;
    tokenizer *t = NULL;
    char err[256] = "";
    if (tok_from_arrays(&t, TOK_BPE, bv->v, NULL, bv->n, merges, nm, -1, -1, err, sizeof err))
        fail_msg("tok_from_arrays: %s", err);
    assert_int_equal(tok_get_kind(t), TOK_BPE);
    assert_int_equal(tok_vocab(t), bv->n);
    return t;
}

/* Ġ is U+0120 (the symbol of ' '), Ċ U+010A ('\n'): BPE_SP, BPE_NL. */
#define BPE_SP "\xc4\xa0"
#define BPE_NL "\xc4\x8a"

static const char *const bpe_extra[] = {
    BPE_SP "t", "he", "in", "ing", BPE_SP "the", BPE_SP "th", BPE_SP "thing", "the",
    "12", "123", "34", "45", "do", "don", "'t", "n'",
    BPE_SP BPE_SP, BPE_SP "b", BPE_NL BPE_NL,
    NULL,
};
static const char *const bpe_merges[] = {
    BPE_SP " t",     /* 0 */
    "h e",           /* 1 */
    "i n",           /* 2 */
    "in g",          /* 3 */
    BPE_SP "t he",   /* 4 */
    BPE_SP "t h",    /* 5 */
    BPE_SP "th ing", /* 6 */
    "t he",          /* 7 */
    "3 4",           /* 8: would join "123" and "45" if digits did not split */
    "1 2", "12 3", "4 5",
    "d o", "do n", "' t", "n '",
    BPE_SP " " BPE_SP, BPE_SP " b", BPE_NL " " BPE_NL,
    "x y",           /* no "xy" token: ignored */
    "bad",           /* no space: ignored */
    NULL,
};

static void test_bpe_hand(void **state)
{
    (void)state;
    bpe_vocab bv;
    tokenizer *t = bpe_make(&bv, bpe_extra, bpe_merges, -1);
    const char *const *v = bv.v;
    uint32_t n = bv.n;
    /* "the": he (1), then t+he (7). " thing": Ġt (0), in (2), ing (3),
     * Ġt+h (5), Ġth+ing (6). " the": Ġt (0), he (1), Ġt+he (4). */
    expect_enc(t, v, n, "the thing the", 0,
               (const char *[]){"the", BPE_SP "thing", BPE_SP "the", NULL});
    /* add_bos without a BOS in the vocabulary adds nothing. */
    expect_enc(t, v, n, "the", 1, (const char *[]){"the", NULL});
    /* Digits in groups of three: "123" "45" (34 would merge first across). */
    expect_enc(t, v, n, "12345", 0, (const char *[]){"123", "45", NULL});
    expect_enc(t, v, n, " 12345", 0, (const char *[]){BPE_SP, "123", "45", NULL});
    expect_enc(t, v, n, "1234567", 0, (const char *[]){"123", "45", "6", "7", NULL});
    /* Contractions split off: "don" "'t", not "n'" (n ' merges). */
    expect_enc(t, v, n, "don't", 0, (const char *[]){"don", "'t", NULL});
    /* Whitespace: a run keeps its last space for the next word. */
    expect_enc(t, v, n, "a   b", 0, (const char *[]){"a", BPE_SP BPE_SP, BPE_SP "b", NULL});
    expect_enc(t, v, n, "a  ", 0, (const char *[]){"a", BPE_SP BPE_SP, NULL});
    expect_enc(t, v, n, "a\n\nb", 0, (const char *[]){"a", BPE_NL, BPE_NL, "b", NULL});
    expect_enc(t, v, n, "a\n\n", 0, (const char *[]){"a", BPE_NL BPE_NL, NULL});
    /* Punctuation runs apart from letters ("n!" would not merge anyway). */
    expect_enc(t, v, n, "in!? ing", 0, (const char *[]){"in", "!", "?", BPE_SP, "ing", NULL});
    /* Every byte is its own symbol first; non-ASCII bytes count as letters. */
    expect_enc(t, v, n, "\xc3\xa9t", 0, (const char *[]){"\xc3\x83", "\xc2\xa9", "t", NULL});
    expect_enc(t, v, n, "\x01\x7f", 0, (const char *[]){"\xc4\x81", "\xc4\xa1", NULL});
    tok_free(t);
}

/* The merge with the lower rank wins, whichever the text offers first. */
static void test_bpe_rank_order(void **state)
{
    (void)state;
    static const char *const extra[] = {"ab", "bc", NULL};
    static const char *const m1[] = {"a b", "b c", NULL}, *const m2[] = {"b c", "a b", NULL};
    bpe_vocab bv;
    tokenizer *t = bpe_make(&bv, extra, m1, -1);
    expect_enc(t, bv.v, bv.n, "abc", 0, (const char *[]){"ab", "c", NULL});
    expect_enc(t, bv.v, bv.n, "abcabc", 0, (const char *[]){"ab", "c", "ab", "c", NULL});
    tok_free(t);
    t = bpe_make(&bv, extra, m2, -1);
    expect_enc(t, bv.v, bv.n, "abc", 0, (const char *[]){"a", "bc", NULL});
    expect_enc(t, bv.v, bv.n, "abcabc", 0, (const char *[]){"a", "bc", "a", "bc", NULL});
    tok_free(t);
    /* A repeated merge keeps its first rank. */
    static const char *const m3[] = {"b c", "a b", "b c", NULL};
    t = bpe_make(&bv, extra, m3, -1);
    expect_enc(t, bv.v, bv.n, "abc", 0, (const char *[]){"a", "bc", NULL});
    tok_free(t);
}

static void test_bpe_decode_round_trip(void **state)
{
    (void)state;
    bpe_vocab bv;
    tokenizer *t = bpe_make(&bv, bpe_extra, bpe_merges, -1);
    uint32_t cp[256];
    ref_b2u(cp);
    /* Each byte symbol decodes to its byte. */
    for (int b = 0; b < 256; b++) {
        size_t n;
        const char *p = dec(t, -1, b, &n);
        assert_int_equal(n, 1);
        assert_int_equal((uint8_t)p[0], b);
    }
    size_t n;
    const char *p = dec(t, -1, idx(bv.v, bv.n, BPE_SP "thing"), &n);
    assert_int_equal(n, 6);
    assert_memory_equal(p, " thing", 6);
    p = dec(t, -1, idx(bv.v, bv.n, BPE_NL BPE_NL), &n);
    assert_int_equal(n, 2);
    assert_memory_equal(p, "\n\n", 2);
    assert_null(tok_decode(t, -1, (int32_t)bv.n, &n));
    assert_null(tok_decode(t, -1, -2, &n));
    /* All 256 byte values in one string, and random byte strings. */
    char buf[512];
    for (int b = 0; b < 256; b++)
        buf[b] = (char)b;
    expect_round_trip(t, buf, 256);
    for (int b = 0; b < 256; b++)
        buf[b] = (char)(255 - b);
    expect_round_trip(t, buf, 256);
    tu_rng r = {0xb9e};
    static const char common[] = "the thing 12345 don't   \n\n!?abc";
    for (int it = 0; it < 2000; it++) {
        size_t len = tu_below(&r, 80);
        for (size_t i = 0; i < len; i++)
            buf[i] = (it & 1) ? (char)tu_below(&r, 256)
                              : common[tu_below(&r, sizeof common - 1)];
        expect_round_trip(t, buf, len);
    }
    expect_round_trip(t, "", 0);
    tok_free(t);
}

static void test_bpe_missing_byte(void **state)
{
    (void)state;
    bpe_vocab bv;
    tokenizer *t = bpe_make(&bv, NULL, NULL, 'q');
    int32_t ids[8];
    char err[256] = "";
    assert_int_equal(tok_encode(t, "pr", 2, 0, ids, 8, err, sizeof err), 2);
    assert_int_equal(ids[0], 'p');
    assert_int_equal(ids[1], 'r');
    assert_int_equal(tok_encode(t, "pqr", 3, 0, ids, 8, err, sizeof err), -1);
    assert_non_null(strstr(err, "0x71"));
    tok_free(t);
}

/* ---- llama2.c tokenizer.bin ------------------------------------------------- */

typedef struct {
    const char *s; /* as llama2.c's export writes it: U+2581 as ' ' */
    float score;
} l2_tok;

static size_t l2_write(uint8_t *out, const l2_tok *v, uint32_t n, int32_t maxlen)
{
    size_t at = 0;
    memcpy(out + at, &maxlen, 4);
    at += 4;
    for (uint32_t i = 0; i < n; i++) {
        int32_t l = (int32_t)strlen(v[i].s);
        memcpy(out + at, &v[i].score, 4);
        memcpy(out + at + 4, &l, 4);
        memcpy(out + at + 8, v[i].s, (size_t)l);
        at += 8 + (size_t)l;
    }
    return at;
}

static void write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void test_llama2c(void **state)
{
    (void)state;
    enum { NT = 266 };
    static char bytes[256][8];
    l2_tok v[NT] = {{"<unk>", 0}, {"\n<s>\n", 0}, {"\n</s>\n", 0}};
    for (int b = 0; b < 256; b++) {
        snprintf(bytes[b], 8, "<0x%02X>", b);
        v[3 + b] = (l2_tok){bytes[b], 0};
    }
    v[259] = (l2_tok){" ", -1000};
    v[260] = (l2_tok){"h", -1000};
    v[261] = (l2_tok){"i", -1000};
    v[262] = (l2_tok){"hi", -1};
    v[263] = (l2_tok){" hi", -2};
    v[264] = (l2_tok){"ih", -0.5f}; /* beats hi in "hih" */
    v[265] = (l2_tok){"\xc3\xa9", -3};
    static uint8_t file[8192];
    size_t size = l2_write(file, v, NT, 6);
    char path[] = "/tmp/kvtd_tok_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    write_file(path, file, size);
    tokenizer *t = NULL;
    char err[256] = "";
    if (tok_from_llama2c(&t, path, NT, err, sizeof err))
        fail_msg("tok_from_llama2c: %s", err);
    assert_int_equal(tok_get_kind(t), TOK_SPM);
    assert_int_equal(tok_vocab(t), NT);
    assert_int_equal(tok_bos(t), 1);
    assert_int_equal(tok_eos(t), 2);
    int32_t ids[32];
    /* "hi hi" -> ▁hi▁hi: hi, hi (leftmost first), ▁hi, ▁hi. */
    assert_int_equal(tok_encode(t, "hi hi", 5, 1, ids, 32, err, sizeof err), 3);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 263);
    assert_int_equal(ids[2], 263);
    /* "hih" -> ▁ h i h: ih (-0.5) beats hi (-1); "▁h" is no piece. */
    assert_int_equal(tok_encode(t, "hih", 3, 0, ids, 32, err, sizeof err), 3);
    assert_int_equal(ids[0], 259);
    assert_int_equal(ids[1], 260);
    assert_int_equal(ids[2], 264);
    /* é is a piece; ü (C3 BC) is not: bytes 3 + 0xC3, 3 + 0xBC. */
    assert_int_equal(tok_encode(t, "\xc3\xa9\xc3\xbc", 4, 0, ids, 32, err, sizeof err), 4);
    assert_int_equal(ids[0], 259);
    assert_int_equal(ids[1], 265);
    assert_int_equal(ids[2], 3 + 0xc3);
    assert_int_equal(ids[3], 3 + 0xbc);
    /* Every piece decodes to what the file holds (bytes for <0xNN>). */
    for (int32_t id = 3; id < NT; id++) {
        size_t n;
        const char *p = dec(t, 0, id, &n);
        if (id < 259) {
            assert_int_equal(n, 1);
            assert_int_equal((uint8_t)p[0], id - 3);
        } else {
            assert_int_equal(n, strlen(v[id].s));
            assert_memory_equal(p, v[id].s, n);
        }
    }
    size_t n;
    const char *p = dec(t, 1, 263, &n);
    assert_int_equal(n, 2);
    assert_memory_equal(p, "hi", 2);
    expect_round_trip(t, "hi hih ih \xc3\xa9\xc3\xbc\n", 15);
    tok_free(t);

    /* A smaller vocab_size reads the first tokens only. */
    assert_int_equal(tok_from_llama2c(&t, path, 10, err, sizeof err), 0);
    assert_int_equal(tok_vocab(t), 10);
    tok_free(t);

    /* Every truncation fails with a message. */
    for (size_t cut = 0; cut < size; cut++) {
        write_file(path, file, cut);
        err[0] = 0;
        t = (tokenizer *)(uintptr_t)1;
        assert_int_equal(tok_from_llama2c(&t, path, NT, err, sizeof err), -1);
        assert_null(t);
        assert_true(strlen(err) > 0);
    }
    /* More tokens asked for than the file has. */
    write_file(path, file, size);
    assert_int_equal(tok_from_llama2c(&t, path, NT + 1, err, sizeof err), -1);
    assert_non_null(strstr(err, "truncated"));
    /* Absurd lengths: negative, past max_token_length, huge. */
    int32_t bad[] = {-1, 7, 0x7fffffff};
    size_t len_at = 4 + 8 + 5 + 4; /* token 1's length field */
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint8_t copy[8192];
        memcpy(copy, file, size);
        memcpy(copy + len_at, &bad[i], 4);
        write_file(path, copy, size);
        err[0] = 0;
        assert_int_equal(tok_from_llama2c(&t, path, NT, err, sizeof err), -1);
        assert_non_null(strstr(err, "length"));
    }
    int32_t bad_max[] = {0, -5, 0x40000000};
    for (size_t i = 0; i < sizeof bad_max / sizeof bad_max[0]; i++) {
        uint8_t copy[8192];
        memcpy(copy, file, size);
        memcpy(copy, &bad_max[i], 4);
        write_file(path, copy, size);
        err[0] = 0;
        assert_int_equal(tok_from_llama2c(&t, path, NT, err, sizeof err), -1);
        assert_non_null(strstr(err, "max_token_length"));
    }
    unlink(path);
    err[0] = 0;
    assert_int_equal(tok_from_llama2c(&t, path, NT, err, sizeof err), -1);
    assert_non_null(strstr(err, path));
    assert_int_equal(tok_from_llama2c(&t, "/nonexistent", 0, err, sizeof err), -1);
}

/* ---- GGUF ------------------------------------------------------------------ */

typedef struct {
    uint8_t *p;
    size_t n, cap;
    uint64_t n_kv;
} gbuf;

static void gb_put(gbuf *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}
static void gb_u32(gbuf *b, uint32_t v)
{
    gb_put(b, &v, 4);
}
static void gb_u64(gbuf *b, uint64_t v)
{
    gb_put(b, &v, 8);
}
static void gb_str(gbuf *b, const char *s)
{
    gb_u64(b, strlen(s));
    gb_put(b, s, strlen(s));
}
static void gb_key(gbuf *b, const char *k, uint32_t type)
{
    gb_str(b, k);
    gb_u32(b, type);
    b->n_kv++;
}
static void gb_kv_str(gbuf *b, const char *k, const char *s)
{
    gb_key(b, k, GGUF_T_STRING);
    gb_str(b, s);
}
static void gb_kv_u32(gbuf *b, const char *k, uint32_t v)
{
    gb_key(b, k, GGUF_T_U32);
    gb_u32(b, v);
}
static void gb_kv_strs(gbuf *b, const char *k, const char *const *v, uint32_t n)
{
    gb_key(b, k, GGUF_T_ARRAY);
    gb_u32(b, GGUF_T_STRING);
    gb_u64(b, n);
    for (uint32_t i = 0; i < n; i++)
        gb_str(b, v[i]);
}
/* Header (v3, no tensors) + the kv bytes in body. */
static void gb_finish(gbuf *out, const gbuf *body)
{
    memset(out, 0, sizeof *out);
    gb_put(out, "GGUF", 4);
    gb_u32(out, 3);
    gb_u64(out, 0);
    gb_u64(out, body->n_kv);
    gb_put(out, body->p, body->n);
    static const uint8_t zero[32] = {0};
    gb_put(out, zero, 32 - out->n % 32);
}

static void test_gguf_spm(void **state)
{
    (void)state;
    spm_vocab sv;
    spm_vocab_make(&sv);
    gbuf body = {0}, file;
    gb_kv_str(&body, "general.architecture", "llama");
    gb_kv_str(&body, "tokenizer.ggml.model", "llama");
    gb_kv_strs(&body, "tokenizer.ggml.tokens", sv.v, SPM_N);
    gb_key(&body, "tokenizer.ggml.scores", GGUF_T_ARRAY);
    gb_u32(&body, GGUF_T_F32);
    gb_u64(&body, SPM_N);
    gb_put(&body, sv.sc, sizeof sv.sc);
    gb_key(&body, "tokenizer.ggml.token_type", GGUF_T_ARRAY);
    gb_u32(&body, GGUF_T_I32);
    gb_u64(&body, SPM_N);
    for (uint32_t i = 0; i < SPM_N; i++)
        gb_u32(&body, i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1);
    gb_kv_u32(&body, "tokenizer.ggml.bos_token_id", 1);
    gb_kv_u32(&body, "tokenizer.ggml.eos_token_id", 2);
    gb_key(&body, "tokenizer.ggml.add_bos_token", GGUF_T_BOOL);
    gb_put(&body, "\x01", 1);
    gb_finish(&file, &body);
    gguf g;
    char err[256] = "";
    if (gguf_parse(file.p, file.n, &g, err, sizeof err))
        fail_msg("gguf_parse: %s", err);
    tokenizer *t = NULL;
    if (tok_from_gguf(&t, &g, err, sizeof err))
        fail_msg("tok_from_gguf: %s", err);
    assert_int_equal(tok_get_kind(t), TOK_SPM);
    assert_int_equal(tok_vocab(t), SPM_N);
    assert_int_equal(tok_bos(t), 1);
    assert_int_equal(tok_eos(t), 2);
    expect_enc(t, sv.v, SPM_N, "hello world", 1,
               (const char *[]){U2581 "hello", U2581 "world", NULL});
    expect_enc(t, sv.v, SPM_N, "pqs h\xc3\xa9", 0,
               (const char *[]){U2581, "p", "qs", U2581, "h", "<0xC3>", "<0xA9>", NULL});
    expect_round_trip(t, "hello w\xc3\xb6rld", 12);
    tok_free(t);
    gguf_close(&g);
    free(file.p);

    /* Without bos/eos ids: -1; an unknown model: a message. */
    gbuf b2 = {0};
    gb_kv_str(&b2, "tokenizer.ggml.model", "llama");
    gb_kv_strs(&b2, "tokenizer.ggml.tokens", sv.v, SPM_N);
    gb_key(&b2, "tokenizer.ggml.scores", GGUF_T_ARRAY);
    gb_u32(&b2, GGUF_T_F32);
    gb_u64(&b2, SPM_N);
    gb_put(&b2, sv.sc, sizeof sv.sc);
    gb_finish(&file, &b2);
    assert_int_equal(gguf_parse(file.p, file.n, &g, err, sizeof err), 0);
    assert_int_equal(tok_from_gguf(&t, &g, err, sizeof err), 0);
    assert_int_equal(tok_bos(t), -1);
    assert_int_equal(tok_eos(t), -1);
    expect_enc(t, sv.v, SPM_N, "hello", 1, (const char *[]){U2581 "hello", NULL});
    tok_free(t);
    gguf_close(&g);
    free(file.p);
    free(b2.p);

    gbuf b3 = {0};
    gb_kv_str(&b3, "tokenizer.ggml.model", "t5");
    gb_kv_strs(&b3, "tokenizer.ggml.tokens", sv.v, 3);
    gb_finish(&file, &b3);
    assert_int_equal(gguf_parse(file.p, file.n, &g, err, sizeof err), 0);
    err[0] = 0;
    assert_int_equal(tok_from_gguf(&t, &g, err, sizeof err), -1);
    assert_null(t);
    assert_non_null(strstr(err, "t5"));
    gguf_close(&g);
    free(file.p);
    free(b3.p);

    /* Scores missing; BOS out of range; no model at all. */
    gbuf b4 = {0};
    gb_kv_str(&b4, "tokenizer.ggml.model", "llama");
    gb_kv_strs(&b4, "tokenizer.ggml.tokens", sv.v, SPM_N);
    gb_finish(&file, &b4);
    assert_int_equal(gguf_parse(file.p, file.n, &g, err, sizeof err), 0);
    assert_int_equal(tok_from_gguf(&t, &g, err, sizeof err), -1);
    assert_non_null(strstr(err, "scores"));
    gguf_close(&g);
    free(file.p);
    gb_kv_u32(&b4, "tokenizer.ggml.bos_token_id", 100000);
    gb_key(&b4, "tokenizer.ggml.scores", GGUF_T_ARRAY);
    gb_u32(&b4, GGUF_T_F32);
    gb_u64(&b4, SPM_N);
    gb_put(&b4, sv.sc, sizeof sv.sc);
    gb_finish(&file, &b4);
    assert_int_equal(gguf_parse(file.p, file.n, &g, err, sizeof err), 0);
    assert_int_equal(tok_from_gguf(&t, &g, err, sizeof err), -1);
    assert_non_null(strstr(err, "bos_token_id"));
    gguf_close(&g);
    free(file.p);
    free(b4.p);
    gbuf b5 = {0};
    gb_kv_u32(&b5, "general.alignment", 32);
    gb_finish(&file, &b5);
    assert_int_equal(gguf_parse(file.p, file.n, &g, err, sizeof err), 0);
    assert_int_equal(tok_from_gguf(&t, &g, err, sizeof err), -1);
    assert_non_null(strstr(err, "tokenizer.ggml.model"));
    gguf_close(&g);
    free(file.p);
    free(b5.p);
    free(body.p);
}

static void test_gguf_bpe(void **state)
{
    (void)state;
    bpe_vocab bv;
    static const char *const extra[] = {BPE_SP "t", "he", "in", "ing", BPE_SP "the", BPE_SP "th",
                                        BPE_SP "thing", "the", "<|begin|>", "<|end|>", NULL};
    bpe_vocab_make(&bv, extra, -1);
    uint32_t nm = 0;
    while (bpe_merges[nm])
        nm++;
    gbuf body = {0}, file;
    gb_kv_str(&body, "tokenizer.ggml.model", "gpt2");
    gb_kv_str(&body, "tokenizer.ggml.pre", "llama-bpe");
    gb_kv_strs(&body, "tokenizer.ggml.tokens", bv.v, bv.n);
    gb_kv_strs(&body, "tokenizer.ggml.merges", bpe_merges, nm);
    gb_key(&body, "tokenizer.ggml.token_type", GGUF_T_ARRAY);
    gb_u32(&body, GGUF_T_I32);
    gb_u64(&body, bv.n);
    for (uint32_t i = 0; i < bv.n; i++)
        gb_u32(&body, i + 2 >= bv.n ? 3 : 1);
    gb_kv_u32(&body, "tokenizer.ggml.bos_token_id", bv.n - 2);
    gb_kv_u32(&body, "tokenizer.ggml.eos_token_id", bv.n - 1);
    gb_finish(&file, &body);
    gguf g;
    char err[256] = "";
    if (gguf_parse(file.p, file.n, &g, err, sizeof err))
        fail_msg("gguf_parse: %s", err);
    tokenizer *t = NULL;
    if (tok_from_gguf(&t, &g, err, sizeof err))
        fail_msg("tok_from_gguf: %s", err);
    assert_int_equal(tok_get_kind(t), TOK_BPE);
    assert_int_equal(tok_bos(t), (int32_t)bv.n - 2);
    assert_int_equal(tok_eos(t), (int32_t)bv.n - 1);
    expect_enc(t, bv.v, bv.n, "the thing the", 1,
               (const char *[]){"the", BPE_SP "thing", BPE_SP "the", NULL});
    size_t n;
    dec(t, -1, tok_bos(t), &n); /* control tokens decode to nothing */
    assert_int_equal(n, 0);
    expect_round_trip(t, "the \xff\x00 thing", 12);
    tok_free(t);
    gguf_close(&g);
    free(file.p);
    free(body.p);

    /* gpt2 without merges: a message. */
    gbuf b2 = {0};
    gb_kv_str(&b2, "tokenizer.ggml.model", "gpt2");
    gb_kv_strs(&b2, "tokenizer.ggml.tokens", bv.v, bv.n);
    gb_finish(&file, &b2);
    assert_int_equal(gguf_parse(file.p, file.n, &g, err, sizeof err), 0);
    assert_int_equal(tok_from_gguf(&t, &g, err, sizeof err), -1);
    assert_non_null(strstr(err, "merges"));
    gguf_close(&g);
    free(file.p);
    free(b2.p);
}

/* ---- argument errors ---------------------------------------------------------- */

static void test_errors(void **state)
{
    (void)state;
    const char *v[] = {"a", "b", "ab"};
    float sc[] = {0, 0, -1};
    tokenizer *t = NULL;
    char err[256];
    err[0] = 0;
    assert_int_equal(tok_from_arrays(&t, TOK_SPM, v, sc, 0, NULL, 0, -1, -1, err, sizeof err),
                     -1);
    assert_true(strlen(err) > 0);
    err[0] = 0;
    assert_int_equal(tok_from_arrays(&t, TOK_SPM, v, NULL, 3, NULL, 0, -1, -1, err, sizeof err),
                     -1);
    assert_non_null(strstr(err, "scores"));
    err[0] = 0;
    assert_int_equal(tok_from_arrays(&t, TOK_SPM, v, sc, 3, NULL, 0, 3, -1, err, sizeof err),
                     -1);
    assert_non_null(strstr(err, "BOS"));
    err[0] = 0;
    assert_int_equal(tok_from_arrays(&t, (tok_kind)7, v, sc, 3, NULL, 0, -1, -1, err,
                                     sizeof err),
                     -1);
    assert_true(strlen(err) > 0);
    err[0] = 0;
    assert_int_equal(tok_from_arrays(&t, TOK_SPM, NULL, sc, 3, NULL, 0, -1, -1, err,
                                     sizeof err),
                     -1);
    assert_true(strlen(err) > 0);
    const char *vn[] = {"a", NULL, "ab"};
    err[0] = 0;
    assert_int_equal(tok_from_arrays(&t, TOK_SPM, vn, sc, 3, NULL, 0, -1, -1, err, sizeof err),
                     -1);
    assert_true(strlen(err) > 0);
    assert_int_equal(tok_from_arrays(NULL, TOK_SPM, v, sc, 3, NULL, 0, -1, -1, NULL, 0), -1);
    assert_int_equal(tok_from_gguf(&t, NULL, err, sizeof err), -1);
    assert_null(t);
    /* A usable one for encode's argument checks. */
    assert_int_equal(tok_from_arrays(&t, TOK_SPM, v, sc, 3, NULL, 0, -1, -1, err, sizeof err),
                     0);
    int32_t ids[4];
    err[0] = 0;
    assert_int_equal(tok_encode(t, NULL, 3, 0, ids, 4, err, sizeof err), -1);
    assert_true(strlen(err) > 0);
    assert_int_equal(tok_encode(t, "ab", 2, 0, NULL, 4, err, sizeof err), -1);
    assert_int_equal(tok_encode(NULL, "ab", 2, 0, ids, 4, err, sizeof err), -1);
    assert_int_equal(tok_encode(t, NULL, 0, 0, ids, 4, err, sizeof err), 0);
    assert_null(tok_decode(NULL, -1, 0, NULL));
    assert_non_null(tok_decode(t, -1, 2, NULL));
    tok_free(t);
    tok_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spm_hand),
        cmocka_unit_test(test_spm_decode),
        cmocka_unit_test(test_spm_round_trip),
        cmocka_unit_test(test_spm_missing_byte),
        cmocka_unit_test(test_bpe_hand),
        cmocka_unit_test(test_bpe_rank_order),
        cmocka_unit_test(test_bpe_decode_round_trip),
        cmocka_unit_test(test_bpe_missing_byte),
        cmocka_unit_test(test_llama2c),
        cmocka_unit_test(test_gguf_spm),
        cmocka_unit_test(test_gguf_bpe),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
