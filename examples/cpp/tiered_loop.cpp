// tiered_loop: a C++17 consumer of libkvtier through the RAII wrapper in
// kvtier.hpp. It runs the tiered decode loop of examples/decode/engine.c on
// synthetic data and checks the attention it gets:
//
//   policy (every 4th head unstable) + selector -> a tiered pool sized by
//   kvt_pool_sizing_get (device_bytes 0, target_tokens)
//   two sequences: prefill (kvt_seq_append), warm-up (kvt_seq_warmup)
//   each step, both sequences in one batch:
//       plan; per layer: append, select, decode; finish
//   kvt_pool_check after every step; one layer per step compared with a
//   double-precision reference over the pages kvt_step_selection_get reports
//   (K/V read back with kvt_seq_read_kv).
//
// Exits 0 and prints "C++ tiered loop: ok" when everything matches.
#include <kvtier/kvtier.h>

#include "kvtier.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

namespace {

// The model: 2 layers, 4 KV heads, 8 query heads (GQA groups of 2).
constexpr uint32_t L = 2, H = 4, QH = 8, D = 64, P = 16;
constexpr uint32_t G = QH / H;
constexpr uint32_t PROMPT = 2048; // prefill tokens per sequence
constexpr uint32_t CHUNK = 256;  // prefill tokens per kvt_seq_append
constexpr uint32_t STEPS = 40;    // decode steps
constexpr uint32_t NSEQ = 2;      // sequences, decoded as one batch
constexpr uint32_t NOBS = 8;      // prompt queries given to the warm-up
// K/V are stored as f32, so the library's f32 attention and a double
// reference over the same rows agree closely (f16 storage would need ~2e-3).
constexpr kvt_dtype DTYPE = KVT_DTYPE_F32;
constexpr double TOL = 1e-4;

// Deterministic pseudo-random numbers (splitmix64), uniform in [-1, 1).
struct Rng {
    uint64_t s;
    uint64_t next()
    {
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    float uniform() { return static_cast<float>(next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }
    void fill(std::vector<float> &v)
    {
        for (float &x : v)
            x = uniform();
    }
};

// Attention of one query head over the pages `pages` of (seq, layer,
// kv_head), in double precision from the stored K/V rows. Returns the
// largest error of out (relative to the row's largest value) and of lse.
struct Err {
    double out = 0, lse = 0;
};

Err reference_check(const kvt::Sequence &seq, uint32_t layer, uint32_t kv_head,
                    const std::vector<uint32_t> &pages, const float *q_group,
                    const float *out_group, const float *lse_group)
{
    const uint32_t len = seq.length(layer);
    std::vector<float> k, v;
    for (uint32_t p : pages) {
        const uint32_t t0 = p * P, n = std::min(P, len - t0);
        const size_t at = k.size();
        k.resize(at + static_cast<size_t>(n) * D);
        v.resize(at + static_cast<size_t>(n) * D);
        seq.read_kv(layer, kv_head, t0, n, k.data() + at, v.data() + at);
    }
    const size_t n_tok = k.size() / D;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    Err e;
    std::vector<double> s(n_tok);
    for (uint32_t g = 0; g < G; g++) {
        const float *q = q_group + static_cast<size_t>(g) * D;
        double m = -INFINITY;
        for (size_t t = 0; t < n_tok; t++) {
            double dot = 0;
            for (uint32_t d = 0; d < D; d++)
                dot += static_cast<double>(q[d]) * k[t * D + d];
            s[t] = dot * scale;
            m = std::max(m, s[t]);
        }
        double sum = 0;
        std::vector<double> o(D, 0.0);
        for (size_t t = 0; t < n_tok; t++) {
            const double w = std::exp(s[t] - m);
            sum += w;
            for (uint32_t d = 0; d < D; d++)
                o[d] += w * v[t * D + d];
        }
        double big = 1e-3, diff = 0;
        for (uint32_t d = 0; d < D; d++) {
            o[d] /= sum;
            big = std::max(big, std::fabs(o[d]));
            diff = std::max(diff, std::fabs(o[d] - out_group[static_cast<size_t>(g) * D + d]));
        }
        const double lse = m + std::log(sum);
        e.out = std::max(e.out, diff / big);
        e.lse = std::max(e.lse, std::fabs(lse - lse_group[g]) / std::max(1.0, std::fabs(lse)));
    }
    return e;
}

// The error-handling demonstrations: a kvt::error carries the code and the
// library's detail message, and the RAII handles stay consistent.
bool show_errors(kvt::Pool &pool, kvt::Sequence &seq)
{
    const uint32_t before = seq.length(0);
    std::vector<float> kv(static_cast<size_t>(H) * D, 0.5f);
    try {
        seq.append(L, kv.data(), kv.data(), 1); // layer out of range
        std::fprintf(stderr, "tiered_loop: appending to layer %u did not fail\n", L);
        return false;
    } catch (const kvt::error &e) {
        std::printf("caught %s: %s\n", e.name(), e.what());
        if (e.code() >= 0 || e.detail().empty() || seq.length(0) != before) {
            std::fprintf(stderr, "tiered_loop: bad error report\n");
            return false;
        }
    }
    try {
        kvt::Step open(pool, {seq.id()});
        kvt::Step second(pool, {seq.id()}); // one open step per pool
        std::fprintf(stderr, "tiered_loop: a second open step was planned\n");
        return false;
    } catch (const kvt::error &e) { // `open` was finished by its destructor
        std::printf("caught %s: %s\n", e.name(), e.what());
        if (e.code() != KVT_ESTATE) {
            std::fprintf(stderr, "tiered_loop: expected KVT_ESTATE\n");
            return false;
        }
    }
    pool.check();
    return true;
}

int run()
{
    kvt_geometry geom{};
    geom.n_layers = L;
    geom.n_kv_heads = H;
    geom.n_q_heads = QH;
    geom.head_dim = D;
    geom.page_tokens = P;
    geom.dtype = DTYPE;

    // Every 4th (layer, head) unstable: all its pages stay on the device.
    std::vector<kvt_head_class> classes(L * H);
    for (size_t i = 0; i < classes.size(); i++)
        classes[i] = i % 4 == 0 ? KVT_HEAD_UNSTABLE : KVT_HEAD_STABLE;
    kvt_policy_opts popt = kvt::policy_opts();
    popt.top_k_pages = 8;
    popt.window = 2;
    popt.stable_interval = 4;
    // The policy and selector outlive the pool (declared before it).
    const kvt::Policy policy = kvt::Policy::create(geom, popt, classes);
    const kvt::Selector selector = kvt::Selector::create(geom, kvt::selector_opts());

    kvt_pool_opts o = kvt::pool_opts();
    o.backend = KVT_BACKEND_CPU;
    o.geom = geom;
    o.policy = policy.get();
    o.selector = selector.get();
    o.max_seqs = 4;
    o.max_seq_tokens = PROMPT + STEPS;
    o.device_bytes = 0; // sized from the targets
    o.target_tokens = PROMPT + STEPS;
    o.target_seqs = NSEQ;
    const kvt_pool_sizing sz = kvt::Pool::sizing(o);
    o.host_bytes = sz.host_bytes;
    kvt::Pool pool(o);
    std::printf("pool: %u layers x %u KV heads (%u query heads), head_dim %u, %u unstable "
                "heads, kernels %s\n",
                L, H, QH, D, policy.count(KVT_HEAD_UNSTABLE), pool.kernel_isa());

    // Prefill and warm up both sequences. The prefill goes in chunks: the
    // device tier is sized for the decode, not for a whole prompt's pages at
    // once; after each append the library trims the device copies of stable
    // heads' full pages (the host tier keeps them), so only one chunk's new
    // pages need room.
    Rng rng{0x6b767469657221ull};
    std::vector<kvt::Sequence> seqs;
    std::vector<float> pk(static_cast<size_t>(PROMPT) * H * D), pv(pk.size());
    std::vector<float> obs(static_cast<size_t>(L) * NOBS * QH * D);
    for (uint32_t i = 0; i < NSEQ; i++) {
        seqs.emplace_back(pool);
        for (uint32_t l = 0; l < L; l++) {
            rng.fill(pk);
            rng.fill(pv);
            for (uint32_t t = 0; t < PROMPT; t += CHUNK)
                seqs[i].append(l, pk.data() + static_cast<size_t>(t) * H * D,
                               pv.data() + static_cast<size_t>(t) * H * D,
                               std::min(CHUNK, PROMPT - t));
        }
        rng.fill(obs);
        seqs[i].warmup(obs.data(), NOBS);
    }
    pool.check();
    if (!show_errors(pool, seqs[0]))
        return 1;

    // Decode: both sequences in every step.
    const std::vector<kvt_seq_id> batch{seqs[0].id(), seqs[1].id()};
    std::vector<float> q(static_cast<size_t>(NSEQ) * QH * D), out(q.size());
    std::vector<float> k(static_cast<size_t>(NSEQ) * H * D), v(k.size());
    std::vector<float> lse(static_cast<size_t>(NSEQ) * QH);
    Err worst;
    uint32_t reloading = 0, checked_heads = 0, sparse_heads = 0;
    for (uint32_t step = 0; step < STEPS; step++) {
        kvt::Step st(pool, batch);
        for (uint32_t i = 0; i < NSEQ; i++)
            reloading += st.ready(i) ? 0 : 1; // pages still landing: decoded last
        for (uint32_t l = 0; l < L; l++) {
            rng.fill(q);
            rng.fill(k);
            rng.fill(v);
            st.append(l, k.data(), v.data());
            st.select(l, q.data());
            st.decode(l, q.data(), out.data(), lse.data());
            if (l != step % L)
                continue;
            for (uint32_t i = 0; i < NSEQ; i++)
                for (uint32_t h = 0; h < H; h++) {
                    const std::vector<uint32_t> pages = st.selection(l, i, h);
                    const uint32_t all = (seqs[i].length(l) + P - 1) / P;
                    sparse_heads += pages.size() < all ? 1 : 0;
                    const size_t qh = static_cast<size_t>(i) * QH + h * G;
                    const Err e = reference_check(seqs[i], l, h, pages, q.data() + qh * D,
                                                  out.data() + qh * D, lse.data() + qh);
                    worst.out = std::max(worst.out, e.out);
                    worst.lse = std::max(worst.lse, e.lse);
                    checked_heads++;
                    if (!(e.out <= TOL && e.lse <= TOL)) {
                        std::fprintf(stderr,
                                     "tiered_loop: step %u layer %u seq %u head %u: output "
                                     "error %.3g, lse error %.3g (tolerance %g)\n",
                                     step, l, i, h, e.out, e.lse, TOL);
                        return 1;
                    }
                }
        }
        st.finish();
        pool.check();
    }
    for (const kvt::Sequence &s : seqs)
        if (s.length(L - 1) != PROMPT + STEPS) {
            std::fprintf(stderr, "tiered_loop: sequence length %u, expected %u\n",
                         s.length(L - 1), PROMPT + STEPS);
            return 1;
        }

    const kvt_stats s = pool.stats();
    const uint64_t dev = s.tier[KVT_TIER_DEVICE].bytes_total;
    const auto dbl = [](uint64_t x) { return static_cast<double>(x); };
    const double hit = s.sel_pages ? dbl(s.sel_resident) / dbl(s.sel_pages) : 1.0;
    std::printf("device tier %.2f MiB vs %.2f MiB dense (%.0f%%), host tier %.2f MiB\n",
                dbl(dev) / 1048576.0, dbl(sz.dense_bytes) / 1048576.0,
                100.0 * dbl(dev) / dbl(sz.dense_bytes),
                dbl(s.tier[KVT_TIER_HOST].bytes_total) / 1048576.0);
    std::printf("%u steps x %u sequences: hit rate %.1f%% (%llu/%llu pages), %llu promoted, "
                "%llu evicted, %u reloading at plan time\n",
                STEPS, NSEQ, 100.0 * hit, static_cast<unsigned long long>(s.sel_resident),
                static_cast<unsigned long long>(s.sel_pages),
                static_cast<unsigned long long>(s.promoted_pages),
                static_cast<unsigned long long>(s.evicted_pages), reloading);
    std::printf("reference: %u heads checked (%u sparse), max output error %.2e, max lse "
                "error %.2e\n",
                checked_heads, sparse_heads, worst.out, worst.lse);
    if (sparse_heads == 0) {
        std::fprintf(stderr, "tiered_loop: no sparse selection was checked\n");
        return 1;
    }
    if (dev >= sz.dense_bytes) {
        std::fprintf(stderr, "tiered_loop: the device tier is not smaller than dense\n");
        return 1;
    }
    seqs.clear(); // released here (the destructors would do it too)
    pool.check();
    std::printf("C++ tiered loop: ok\n");
    return 0;
}

} // namespace

int main()
{
    try {
        return run();
    } catch (const kvt::error &e) {
        std::fprintf(stderr, "tiered_loop: %s\n", e.what());
    } catch (const std::exception &e) {
        std::fprintf(stderr, "tiered_loop: %s\n", e.what());
    }
    return 1;
}
