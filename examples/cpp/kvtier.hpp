// kvtier.hpp - a small header-only C++17 RAII wrapper over the libkvtier C API.
//
//   #include <kvtier/kvtier.h>
//   #include "kvtier.hpp"
//
// What it gives:
//   kvt::error          a std::runtime_error carrying the KVT_E* code and the
//                       kvt_last_error() detail of the failed call
//   kvt::check(rc, w)   throws kvt::error when rc != KVT_OK
//   kvt::pool_ptr, policy_ptr, selector_ptr, profiler_ptr
//                       std::unique_ptr aliases with the kvt_*_destroy deleters
//   kvt::pool_opts() ... the option structs, initialised by the *_opts_init
//                       functions (the C++ way to get the defaults)
//   kvt::Policy, Selector, Pool
//                       owning handles (move-only)
//   kvt::Sequence       a sequence id, released in the destructor
//   kvt::Step           an open step plan, finished in the destructor
//
// Lifetimes follow the C API: a Pool must outlive its Sequences and Steps,
// and the Policy and Selector named in the pool options must outlive the
// Pool (declare them first, so they are destroyed last). Destructors never
// throw; errors of the release calls they make are dropped (call release()
// or finish() explicitly to see them). Like the C objects, a Pool with its
// Sequences and Steps is used by one thread at a time.
#ifndef KVTIER_EXAMPLES_KVTIER_HPP
#define KVTIER_EXAMPLES_KVTIER_HPP

#include <kvtier/kvtier.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvt {

// ---- errors ---------------------------------------------------------------------------

class error : public std::runtime_error {
public:
    error(int code, const char *what_call, std::string detail)
        : std::runtime_error(format(code, what_call, detail)), code_(code),
          detail_(std::move(detail))
    {
    }
    // The KVT_E* code (negative).
    int code() const noexcept { return code_; }
    // Its symbolic name ("KVT_EINVAL").
    const char *name() const noexcept { return kvt_err_name(code_); }
    // kvt_last_error() at the time of the failure (names the bad argument).
    const std::string &detail() const noexcept { return detail_; }

private:
    static std::string format(int code, const char *what_call, const std::string &detail)
    {
        std::string s = what_call ? what_call : "kvtier";
        s += ": ";
        s += kvt_err_name(code);
        s += " (";
        s += kvt_strerror(code);
        s += ")";
        if (!detail.empty()) {
            s += ": ";
            s += detail;
        }
        return s;
    }
    int code_;
    std::string detail_;
};

// Throws kvt::error for a failed call; `what` names the call in the message.
inline void check(int rc, const char *what)
{
    if (rc != KVT_OK)
        throw error(rc, what, kvt_last_error());
}

// ---- unique_ptr aliases ---------------------------------------------------------------

struct pool_deleter {
    void operator()(kvt_pool *p) const noexcept { kvt_pool_destroy(p); }
};
struct policy_deleter {
    void operator()(kvt_policy *p) const noexcept { kvt_policy_destroy(p); }
};
struct selector_deleter {
    void operator()(kvt_selector *p) const noexcept { kvt_selector_destroy(p); }
};
struct profiler_deleter {
    void operator()(kvt_profiler *p) const noexcept { kvt_profiler_destroy(p); }
};
using pool_ptr = std::unique_ptr<kvt_pool, pool_deleter>;
using policy_ptr = std::unique_ptr<kvt_policy, policy_deleter>;
using selector_ptr = std::unique_ptr<kvt_selector, selector_deleter>;
using profiler_ptr = std::unique_ptr<kvt_profiler, profiler_deleter>;

// ---- options, initialised by the library ----------------------------------------------

inline kvt_pool_opts pool_opts()
{
    kvt_pool_opts o;
    check(kvt_pool_opts_init(&o), "kvt_pool_opts_init");
    return o;
}
inline kvt_seq_opts seq_opts()
{
    kvt_seq_opts o;
    check(kvt_seq_opts_init(&o), "kvt_seq_opts_init");
    return o;
}
inline kvt_step_opts step_opts()
{
    kvt_step_opts o;
    check(kvt_step_opts_init(&o), "kvt_step_opts_init");
    return o;
}
inline kvt_policy_opts policy_opts()
{
    kvt_policy_opts o;
    check(kvt_policy_opts_init(&o), "kvt_policy_opts_init");
    return o;
}
inline kvt_selector_opts selector_opts()
{
    kvt_selector_opts o;
    check(kvt_selector_opts_init(&o), "kvt_selector_opts_init");
    return o;
}
inline kvt_mover_opts mover_opts()
{
    kvt_mover_opts o;
    check(kvt_mover_opts_init(&o), "kvt_mover_opts_init");
    return o;
}
inline kvt_profiler_opts profiler_opts()
{
    kvt_profiler_opts o;
    check(kvt_profiler_opts_init(&o), "kvt_profiler_opts_init");
    return o;
}

// Output structs with struct_size set and everything else zero.
template <class T> inline T sized()
{
    T v;
    std::memset(&v, 0, sizeof v);
    v.struct_size = static_cast<uint32_t>(sizeof v);
    return v;
}

// ---- Policy ---------------------------------------------------------------------------

class Policy {
public:
    Policy() = default;
    explicit Policy(policy_ptr p) : p_(std::move(p)) {}

    // Every head with the options' values.
    static Policy create(const kvt_geometry &geom, const kvt_policy_opts &opts)
    {
        kvt_policy *p = nullptr;
        check(kvt_policy_create(&geom, &opts, &p), "kvt_policy_create");
        return Policy(policy_ptr(p));
    }
    // One class per (layer, kv_head), index layer * n_kv_heads + kv_head.
    static Policy create(const kvt_geometry &geom, const kvt_policy_opts &opts,
                         const std::vector<kvt_head_class> &classes)
    {
        kvt_policy_heads h = sized<kvt_policy_heads>();
        h.n_heads = static_cast<uint32_t>(classes.size());
        h.head_class = classes.data();
        kvt_policy *p = nullptr;
        check(kvt_policy_create_heads(&geom, &opts, &h, &p), "kvt_policy_create_heads");
        return Policy(policy_ptr(p));
    }
    static Policy load(const std::string &path, const kvt_geometry *expect = nullptr)
    {
        kvt_policy *p = nullptr;
        check(kvt_policy_load(path.c_str(), expect, &p), "kvt_policy_load");
        return Policy(policy_ptr(p));
    }

    const kvt_policy *get() const noexcept { return p_.get(); }
    explicit operator bool() const noexcept { return p_ != nullptr; }

    uint32_t count(kvt_head_class cls) const
    {
        uint32_t n = 0;
        check(kvt_policy_count_get(p_.get(), cls, &n), "kvt_policy_count_get");
        return n;
    }
    kvt_policy_head_info head(uint32_t layer, uint32_t kv_head) const
    {
        kvt_policy_head_info i = sized<kvt_policy_head_info>();
        check(kvt_policy_head_get(p_.get(), layer, kv_head, &i), "kvt_policy_head_get");
        return i;
    }
    std::string describe(uint64_t ctx_tokens = 0) const
    {
        size_t need = 0;
        check(kvt_policy_describe(p_.get(), ctx_tokens, nullptr, 0, &need), "kvt_policy_describe");
        std::string s(need + 1, '\0');
        check(kvt_policy_describe(p_.get(), ctx_tokens, &s[0], s.size(), &need),
              "kvt_policy_describe");
        s.resize(need);
        return s;
    }
    void save(const std::string &path) const
    {
        check(kvt_policy_save(p_.get(), path.c_str()), "kvt_policy_save");
    }

private:
    policy_ptr p_;
};

// ---- Selector -------------------------------------------------------------------------

class Selector {
public:
    Selector() = default;
    explicit Selector(selector_ptr p) : p_(std::move(p)) {}

    static Selector create(const kvt_geometry &geom, const kvt_selector_opts &opts)
    {
        kvt_selector *p = nullptr;
        check(kvt_selector_create(&geom, &opts, &p), "kvt_selector_create");
        return Selector(selector_ptr(p));
    }

    const kvt_selector *get() const noexcept { return p_.get(); }
    kvt_selector *get() noexcept { return p_.get(); }
    explicit operator bool() const noexcept { return p_ != nullptr; }

    void set_budget(uint32_t layer, uint32_t kv_head, uint32_t top_k, uint32_t sink,
                    uint32_t local)
    {
        check(kvt_selector_budget_set(p_.get(), layer, kv_head, top_k, sink, local),
              "kvt_selector_budget_set");
    }
    void set_rerank_interval(uint32_t layer, uint32_t kv_head, uint32_t interval)
    {
        check(kvt_selector_rerank_interval_set(p_.get(), layer, kv_head, interval),
              "kvt_selector_rerank_interval_set");
    }

private:
    selector_ptr p_;
};

// ---- Pool -----------------------------------------------------------------------------

class Pool {
public:
    explicit Pool(const kvt_pool_opts &opts)
    {
        kvt_pool *p = nullptr;
        kvt::check(kvt_pool_create(&opts, &p), "kvt_pool_create");
        p_.reset(p);
    }

    // What a pool with these options (target_tokens, target_seqs, policy,
    // geometry) needs; no pool is created.
    static kvt_pool_sizing sizing(const kvt_pool_opts &opts)
    {
        kvt_pool_sizing s = sized<kvt_pool_sizing>();
        kvt::check(kvt_pool_sizing_get(&opts, &s), "kvt_pool_sizing_get");
        return s;
    }

    kvt_pool *get() const noexcept { return p_.get(); }

    kvt_geometry geometry() const
    {
        kvt_geometry g;
        kvt::check(kvt_pool_geometry_get(p_.get(), &g), "kvt_pool_geometry_get");
        return g;
    }
    kvt_stats stats() const
    {
        kvt_stats s = sized<kvt_stats>();
        kvt::check(kvt_pool_stats_get(p_.get(), &s), "kvt_pool_stats_get");
        return s;
    }
    // Every internal invariant (kvt_pool_check); throws KVT_EINTERNAL.
    void check() const { kvt::check(kvt_pool_check(p_.get()), "kvt_pool_check"); }
    kvt_mover *mover() const
    {
        kvt_mover *m = nullptr;
        kvt::check(kvt_pool_mover_get(p_.get(), &m), "kvt_pool_mover_get");
        return m;
    }
    // Waits for every page move submitted so far.
    void wait_moves(uint64_t timeout_ns = UINT64_MAX) const
    {
        kvt::check(kvt_mover_wait(mover(), KVT_FENCE_ALL, timeout_ns), "kvt_mover_wait");
    }
    const char *kernel_isa() const
    {
        const char *isa = nullptr;
        kvt::check(kvt_pool_kernel_isa_get(p_.get(), &isa), "kvt_pool_kernel_isa_get");
        return isa;
    }

private:
    pool_ptr p_;
};

// ---- Sequence -------------------------------------------------------------------------

// KVT_SEQ_NONE without the C cast (clean under -Wold-style-cast).
constexpr kvt_seq_id no_seq = 0;

class Sequence {
public:
    explicit Sequence(Pool &pool, const kvt_seq_opts *opts = nullptr) : pool_(pool.get())
    {
        check(kvt_seq_create(pool_, opts, &id_), "kvt_seq_create");
    }
    ~Sequence() { reset(); }
    Sequence(const Sequence &) = delete;
    Sequence &operator=(const Sequence &) = delete;
    Sequence(Sequence &&o) noexcept
        : pool_(std::exchange(o.pool_, nullptr)), id_(std::exchange(o.id_, no_seq))
    {
    }
    Sequence &operator=(Sequence &&o) noexcept
    {
        if (this != &o) {
            reset();
            pool_ = std::exchange(o.pool_, nullptr);
            id_ = std::exchange(o.id_, no_seq);
        }
        return *this;
    }

    kvt_seq_id id() const noexcept { return id_; }
    explicit operator bool() const noexcept { return id_ != no_seq; }

    // Releases the sequence now, reporting errors.
    void release()
    {
        if (id_ == no_seq)
            return;
        const kvt_seq_id id = std::exchange(id_, no_seq);
        check(kvt_seq_release(pool_, id), "kvt_seq_release");
    }

    // n_tokens tokens of one layer; k and v are [n_tokens][n_kv_heads][head_dim]
    // (token_stride 0 = dense) in src_dtype.
    void append(uint32_t layer, const void *k, const void *v, uint32_t n_tokens,
                kvt_dtype src_dtype, uint64_t token_stride = 0)
    {
        check(kvt_seq_append(pool_, id_, layer, k, v, n_tokens, src_dtype, token_stride),
              "kvt_seq_append");
    }
    void append(uint32_t layer, const float *k, const float *v, uint32_t n_tokens)
    {
        append(layer, k, v, n_tokens, KVT_DTYPE_F32, 0);
    }
    // Importance-guided placement after prefill: obs is
    // [n_layers][n_obs][n_q_heads][head_dim] f32.
    void warmup(const float *obs, uint32_t n_obs)
    {
        check(kvt_seq_warmup(pool_, id_, obs, n_obs), "kvt_seq_warmup");
    }
    uint32_t length(uint32_t layer) const
    {
        uint32_t n = 0;
        check(kvt_seq_length_get(pool_, id_, layer, &n), "kvt_seq_length_get");
        return n;
    }
    kvt_seq_info info() const
    {
        kvt_seq_info i = sized<kvt_seq_info>();
        check(kvt_seq_info_get(pool_, id_, &i), "kvt_seq_info_get");
        return i;
    }
    // Stored K/V rows, in the pool's dtype, [n_tokens][head_dim] each.
    void read_kv(uint32_t layer, uint32_t kv_head, uint32_t first_token, uint32_t n_tokens,
                 void *k_out, void *v_out) const
    {
        check(kvt_seq_read_kv(pool_, id_, layer, kv_head, first_token, n_tokens, k_out, v_out),
              "kvt_seq_read_kv");
    }

private:
    void reset() noexcept
    {
        if (id_ != no_seq)
            (void)kvt_seq_release(pool_, id_); // a destructor does not throw
        id_ = no_seq;
    }
    kvt_pool *pool_ = nullptr;
    kvt_seq_id id_ = no_seq;
};

// ---- Step -----------------------------------------------------------------------------

class Step {
public:
    Step(Pool &pool, std::vector<kvt_seq_id> seqs, const kvt_step_opts &opts)
        : pool_(pool.get()), seqs_(std::move(seqs))
    {
        page_tokens_ = pool.geometry().page_tokens;
        check(kvt_step_plan(pool_, seqs_.data(), static_cast<uint32_t>(seqs_.size()), &opts,
                            &st_),
              "kvt_step_plan");
    }
    Step(Pool &pool, std::vector<kvt_seq_id> seqs) : Step(pool, std::move(seqs), step_opts()) {}
    ~Step()
    {
        if (st_)
            (void)kvt_step_finish(st_); // a destructor does not throw
    }
    Step(const Step &) = delete;
    Step &operator=(const Step &) = delete;
    Step(Step &&o) noexcept
        : pool_(o.pool_), seqs_(std::move(o.seqs_)), page_tokens_(o.page_tokens_),
          st_(std::exchange(o.st_, nullptr))
    {
    }
    Step &operator=(Step &&o) noexcept
    {
        if (this != &o) {
            if (st_)
                (void)kvt_step_finish(st_);
            pool_ = o.pool_;
            seqs_ = std::move(o.seqs_);
            page_tokens_ = o.page_tokens_;
            st_ = std::exchange(o.st_, nullptr);
        }
        return *this;
    }

    kvt_step *get() const noexcept { return st_; }
    bool open() const noexcept { return st_ != nullptr; }
    uint32_t size() const noexcept { return static_cast<uint32_t>(seqs_.size()); }

    // One token per sequence: n_kv_heads rows of head_dim for sequence i at
    // element i * seq_stride (0 = dense).
    void append(uint32_t layer, const void *k, const void *v, kvt_dtype src_dtype,
                uint64_t seq_stride = 0)
    {
        check(kvt_step_append(st_, layer, k, v, src_dtype, seq_stride), "kvt_step_append");
    }
    void append(uint32_t layer, const float *k, const float *v)
    {
        append(layer, k, v, KVT_DTYPE_F32, 0);
    }
    // kvt_step_select: in a tiered pool the fused rerank/recycle.
    void select(uint32_t layer, const float *q)
    {
        check(kvt_step_select(st_, layer, q), "kvt_step_select");
    }
    void decode(uint32_t layer, const float *q, float *out, float *lse = nullptr)
    {
        check(kvt_step_decode(st_, layer, q, out, lse), "kvt_step_decode");
    }
    void attend(uint32_t layer, const float *q, float *out, float *lse = nullptr)
    {
        check(kvt_step_attend(st_, layer, q, out, lse), "kvt_step_attend");
    }
    // Whether no page of sequence seq_index is on its way to the device tier.
    bool ready(uint32_t seq_index)
    {
        uint32_t r = 0;
        check(kvt_step_ready_get(st_, seq_index, &r), "kvt_step_ready_get");
        return r != 0;
    }
    // The pages the latest select of `layer` chose for
    // (sequence seq_index, kv_head), in increasing order.
    std::vector<uint32_t> selection(uint32_t layer, uint32_t seq_index, uint32_t kv_head,
                                    bool *reranked = nullptr) const
    {
        uint32_t len = 0;
        if (seq_index < seqs_.size())
            check(kvt_seq_length_get(pool_, seqs_[seq_index], layer, &len), "kvt_seq_length_get");
        std::vector<uint32_t> pages(len / page_tokens_ + 1);
        uint32_t n = 0, rr = 0;
        check(kvt_step_selection_get(st_, layer, seq_index, kv_head, pages.data(),
                                     static_cast<uint32_t>(pages.size()), &n, &rr),
              "kvt_step_selection_get");
        pages.resize(n);
        if (reranked)
            *reranked = rr != 0;
        return pages;
    }
    // Closes the step, reporting errors; the destructor then does nothing.
    void finish()
    {
        if (!st_)
            return;
        check(kvt_step_finish(std::exchange(st_, nullptr)), "kvt_step_finish");
    }

private:
    kvt_pool *pool_ = nullptr;
    std::vector<kvt_seq_id> seqs_;
    uint32_t page_tokens_ = 16;
    kvt_step *st_ = nullptr;
};

} // namespace kvt

#endif // KVTIER_EXAMPLES_KVTIER_HPP
