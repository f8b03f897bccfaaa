// CPU emulation of the CUDA execution model and of the runtime API subset
// libkvtier uses (see kvt_emu.h for what is and is not emulated).
//
// One emulated device (an H100-like "kvtier CPU emulation", 8 SMs). Kernels
// run synchronously inside the launch, on the launching host thread: each
// CUDA thread of a block is a fiber with its own stack (reused across
// launches; switched by a few instructions of assembly on x86-64, by
// ucontext makecontext/swapcontext elsewhere or with -DKVT_EMU_UCONTEXT); a
// scheduler on the host stack runs every runnable fiber until it blocks
// (barrier, warp operation) or exits, then releases the warps / the barrier
// whose threads have all arrived, and aborts with a description of every
// thread when nothing can make progress.
#include "kvt_emu.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define KVT_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVT_EMU_ASAN 1
#endif
#endif
#ifdef KVT_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__x86_64__) && !defined(KVT_EMU_UCONTEXT)
#define KVT_EMU_FAST_SWITCH 1
#endif
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define KVT_EMU_VALGRIND 1
#endif

__thread kvt_emu_ctx *kvt_emu_cur_;

namespace {

// ---- limits of the emulated device (an H100 SXM, scaled down to 8 SMs) ------
constexpr size_t kSmemDefault = 48 * 1024;     // per block without opt-in
constexpr size_t kSmemOptin = 232448;          // 227 KiB per block with opt-in
constexpr size_t kSmemStaticMax = 48 * 1024;   // ptxas: static __shared__ <= 0xc000
constexpr size_t kSmemPerSm = 233472;          // 228 KiB
constexpr unsigned kMaxThreads = 1024;
constexpr int kSmCount = 8;

enum FiberState { RUNNABLE, AT_BAR, AT_WARP, EXITED };

struct CpCopy {
    void *dst;
    const void *src;
    uint32_t group;
};

struct Fiber {
    kvt_emu_ctx ctx;
#ifdef KVT_EMU_FAST_SWITCH
    void *sp = nullptr; // saved stack pointer while switched out
#else
    ucontext_t uc;
#endif
    char *map = nullptr; // guard page + stack
    char *stack = nullptr;
    size_t stack_size = 0;
    unsigned vg_id = 0;
    unsigned tid = 0; // linear thread id in the block
    FiberState state = EXITED;
    const void *bar_key = nullptr; // a kvt_emu_site or a code address
    const kvt_emu_site *bar_site = nullptr;
    int wop = 0;
    uint32_t wval = 0;
    int warg = 0;
    uint32_t wres = 0;
    std::vector<CpCopy> cp;
    uint32_t cp_group = 0; // groups committed so far; cp_group = the open group
    void *asan_fake = nullptr;
};

struct SharedArr {
    const void *key;
    const kvt_emu_site *site;
    size_t bytes, align;
    void *p;
};

struct Runner {
    std::vector<std::unique_ptr<Fiber>> fibers;
#ifdef KVT_EMU_FAST_SWITCH
    void *main_sp = nullptr;
#else
    ucontext_t main_uc;
#endif
    Fiber *cur = nullptr;
    bool running = false;
    // the launch
    const char *name = "";
    dim3 grid, block;
    unsigned nthreads = 0;
    size_t dyn = 0, dyn_limit = kSmemDefault;
    bool raised = false;
    void (*call)(void *) = nullptr;
    void *fn = nullptr;
    // the block
    uint3 bidx = {0, 0, 0};
    uint64_t block_seq = 0;
    std::vector<SharedArr> shared;
    size_t static_bytes = 0;
    void *dyn_ptr = nullptr;
    // ASan fiber bookkeeping
    void *main_fake = nullptr;
    const void *main_bottom = nullptr;
    size_t main_size = 0;

    Runner()
    {
#ifndef KVT_EMU_FAST_SWITCH
        memset(&main_uc, 0, sizeof main_uc);
#endif
    }
    ~Runner()
    {
        for (auto &f : fibers) {
#ifdef KVT_EMU_VALGRIND
            VALGRIND_STACK_DEREGISTER(f->vg_id);
#endif
            munmap(f->map, f->stack_size + (size_t)sysconf(_SC_PAGESIZE));
        }
    }
};

// The host thread's runner: a plain TLS pointer (no TLS wrapper calls on the
// switch paths), owned by a thread_local that unmaps the stacks at thread
// exit.
__thread Runner *g_rp = nullptr;
struct RunnerOwner {
    std::unique_ptr<Runner> r;
    ~RunnerOwner() { g_rp = nullptr; }
};
Runner &runner()
{
    if (__builtin_expect(g_rp == nullptr, 0)) {
        static thread_local RunnerOwner owner;
        owner.r.reset(new Runner);
        g_rp = owner.r.get();
    }
    return *g_rp;
}

[[noreturn]] void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("kvt_emu: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
    abort();
}

// "kernel 'k' block (x,y,z) thread (x,y,z)"
std::string where(const Fiber *f)
{
    const Runner &r = *g_rp;
    char buf[256];
    if (f)
        snprintf(buf, sizeof buf, "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u)", r.name,
                 r.bidx.x, r.bidx.y, r.bidx.z, f->ctx.thread_idx.x, f->ctx.thread_idx.y,
                 f->ctx.thread_idx.z);
    else
        snprintf(buf, sizeof buf, "kernel '%s' block (%u,%u,%u)", r.name, r.bidx.x, r.bidx.y,
                 r.bidx.z);
    return buf;
}

// "file:line", or a code address as "0xabs (file+0xoff)" for addr2line.
std::string site_str(const void *key, const kvt_emu_site *site)
{
    char buf[512];
    if (site) {
        snprintf(buf, sizeof buf, "%s:%d", site->file, site->line);
        return buf;
    }
    Dl_info di;
    if (key && dladdr(key, &di) && di.dli_fname) {
        const char *base = strrchr(di.dli_fname, '/');
        snprintf(buf, sizeof buf, "%p (%s+0x%lx%s%s)", key, base ? base + 1 : di.dli_fname,
                 (unsigned long)((const char *)key - (const char *)di.dli_fbase),
                 di.dli_sname ? ", in " : "", di.dli_sname ? di.dli_sname : "");
    } else {
        snprintf(buf, sizeof buf, "%p", key);
    }
    return buf;
}

Fiber *need_fiber(const char *what)
{
    Fiber *f = g_rp ? g_rp->cur : nullptr;
    if (!f)
        die("%s called outside a kernel (no emulated thread is running)", what);
    return f;
}

size_t stack_bytes()
{
    static size_t sz = 0;
    if (!sz) {
        size_t kb = 256;
#ifdef KVT_EMU_ASAN
        kb = 512;
#endif
        if (const char *e = getenv("KVT_EMU_STACK_KB")) {
            const long v = strtol(e, nullptr, 10);
            if (v >= 64 && v <= 65536)
                kb = (size_t)v;
        }
        sz = kb * 1024;
    }
    return sz;
}

Fiber *new_fiber()
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t sz = stack_bytes();
    void *m = mmap(nullptr, sz + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (m == MAP_FAILED)
        die("cannot map a %zu KiB fiber stack: %s", sz / 1024, strerror(errno));
    if (mprotect(m, page, PROT_NONE) != 0) // guard page: overflow = SIGSEGV
        die("mprotect: %s", strerror(errno));
    std::unique_ptr<Fiber> f(new Fiber);
    f->map = static_cast<char *>(m);
    f->stack = f->map + page;
    f->stack_size = sz;
#ifndef KVT_EMU_FAST_SWITCH
    if (getcontext(&f->uc) != 0)
        die("getcontext: %s", strerror(errno));
#endif
#ifdef KVT_EMU_VALGRIND
    f->vg_id = VALGRIND_STACK_REGISTER(f->stack, f->stack + sz);
#endif
    Fiber *p = f.get();
    g_rp->fibers.push_back(std::move(f));
    return p;
}

void cp_complete(Fiber *f, int keep_groups)
{
    if (f->cp.empty())
        return;
    size_t w = 0;
    for (size_t i = 0; i < f->cp.size(); i++) {
        const CpCopy &c = f->cp[i];
        const bool done = keep_groups < 0 ||
                          (uint64_t)c.group + (uint64_t)keep_groups < (uint64_t)f->cp_group;
        if (done)
            memcpy(c.dst, c.src, 16);
        else
            f->cp[w++] = c;
    }
    f->cp.resize(w);
}

// ---- context switch -----------------------------------------------------------
void fiber_main();

#ifdef KVT_EMU_FAST_SWITCH
// kvt_emu_swap_(save, to): pushes the callee-saved registers (SysV x86-64:
// rbp rbx r12-r15), stores rsp in *save, loads `to` and pops the same frame
// there. MXCSR and the x87 control word are not switched: kernels do not
// change rounding modes (ldmxcsr/fldcw would cost a third of a switch).
extern "C" void kvt_emu_swap_(void **save, void *to) __asm__("kvt_emu_swap_");
__asm__(".text\n"
        ".p2align 4\n"
        ".hidden kvt_emu_swap_\n"
        ".type kvt_emu_swap_,@function\n"
        "kvt_emu_swap_:\n"
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n"
        ".size kvt_emu_swap_, .-kvt_emu_swap_\n");

// A fresh frame at the top of the stack that kvt_emu_swap_ "returns" into
// fiber_main with the ABI's entry alignment (rsp + 8 a multiple of 16).
void init_ctx(Fiber *f)
{
    uintptr_t top = ((uintptr_t)(f->stack + f->stack_size)) & ~(uintptr_t)15;
    uint64_t *sp = reinterpret_cast<uint64_t *>(top);
    *--sp = 0;                                // fiber_main's return address: none
    *--sp = (uint64_t)(uintptr_t)&fiber_main; // popped by ret
    for (int i = 0; i < 6; i++)
        *--sp = 0;                            // rbp rbx r12-r15
    f->sp = sp;
}

void switch_ctx(Fiber *f, bool to_main)
{
    Runner &r = *g_rp;
    if (to_main)
        kvt_emu_swap_(&f->sp, r.main_sp);
    else
        kvt_emu_swap_(&r.main_sp, f->sp);
}
#else
typedef int (*swapcontext_fn)(ucontext_t *, const ucontext_t *);

// glibc's swapcontext itself: ASan's interceptor would clear the shadow of
// the whole target stack on every switch (and warn once); the fibers are
// annotated below instead.
swapcontext_fn real_swapcontext()
{
    static swapcontext_fn fn = nullptr;
    if (!fn) {
#ifdef KVT_EMU_ASAN
        if (void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD))
            fn = reinterpret_cast<swapcontext_fn>(dlsym(libc, "swapcontext"));
#endif
        if (!fn)
            fn = &swapcontext;
    }
    return fn;
}

void init_ctx(Fiber *f)
{
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = f->stack_size;
    f->uc.uc_stack.ss_flags = 0;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, fiber_main, 0);
}

void switch_ctx(Fiber *f, bool to_main)
{
    Runner &r = *g_rp;
    const int rc = to_main ? real_swapcontext()(&f->uc, &r.main_uc)
                           : real_swapcontext()(&r.main_uc, &f->uc);
    if (rc != 0)
        die("swapcontext: %s", strerror(errno));
}
#endif

// ---- fiber switching --------------------------------------------------------
void fiber_to_main(Fiber *f, bool exiting)
{
    kvt_emu_cur_ = nullptr;
#ifdef KVT_EMU_ASAN
    __sanitizer_start_switch_fiber(exiting ? nullptr : &f->asan_fake, g_rp->main_bottom,
                                   g_rp->main_size);
#else
    (void)exiting;
#endif
    switch_ctx(f, true);
#ifdef KVT_EMU_ASAN
    __sanitizer_finish_switch_fiber(f->asan_fake, nullptr, nullptr);
#endif
}

void fiber_main()
{
    Runner &r = *g_rp;
#ifdef KVT_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &r.main_bottom, &r.main_size);
#endif
    r.call(r.fn);
    Fiber *f = r.cur;
    cp_complete(f, -1); // outstanding cp.async copies land anyway
    f->state = EXITED;
    fiber_to_main(f, true);
    die("an exited emulated thread was resumed");
}

void run_fiber(Fiber *f)
{
    Runner &r = *g_rp;
    r.cur = f;
    kvt_emu_cur_ = &f->ctx;
#ifdef KVT_EMU_ASAN
    __sanitizer_start_switch_fiber(&r.main_fake, f->stack, f->stack_size);
#endif
    switch_ctx(f, false);
#ifdef KVT_EMU_ASAN
    __sanitizer_finish_switch_fiber(r.main_fake, nullptr, nullptr);
#endif
    kvt_emu_cur_ = nullptr;
    r.cur = nullptr;
}

const char *op_name(int op)
{
    switch (op) {
    case KVT_EMU_SHFL_XOR: return "kvt_shfl_xor";
    case KVT_EMU_SHFL: return "kvt_shfl";
    case KVT_EMU_BALLOT: return "kvt_ballot";
    case KVT_EMU_SYNCWARP: return "kvt_syncwarp";
    }
    return "?";
}

std::string describe(const Fiber *f)
{
    switch (f->state) {
    case RUNNABLE: return "runnable";
    case EXITED: return "exited";
    case AT_BAR: {
        std::string d = "wait at KVT_SYNC at " + site_str(f->bar_key, f->bar_site);
        if (f->bar_site) { // two KVT_SYNC on one line differ by the key only
            char k[32];
            snprintf(k, sizeof k, " (barrier %p)", f->bar_key);
            d += k;
        }
        return d;
    }
    case AT_WARP: return std::string("wait at ") + op_name(f->wop);
    }
    return "?";
}

// Every thread's state, consecutive threads with the same state as a range.
std::string describe_block()
{
    Runner &r = *g_rp;
    std::string out;
    unsigned i = 0, groups = 0;
    while (i < r.nthreads) {
        const std::string d = describe(r.fibers[i].get());
        unsigned j = i + 1;
        while (j < r.nthreads && describe(r.fibers[j].get()) == d)
            j++;
        char buf[64];
        if (j - i == 1)
            snprintf(buf, sizeof buf, "  thread %u: ", i);
        else
            snprintf(buf, sizeof buf, "  threads %u-%u: ", i, j - 1);
        if (++groups <= 64)
            out += buf + d + "\n";
        i = j;
    }
    if (groups > 64)
        out += "  ... (" + std::to_string(groups - 64) + " more groups)\n";
    out += "  (linear thread id = x + y*blockDim.x + z*blockDim.x*blockDim.y; warp = id/32; "
           "addresses: addr2line -e FILE 0xOFFSET)";
    return out;
}

// Releases every warp whose 32 lanes all wait at a warp operation.
bool release_warps()
{
    Runner &r = *g_rp;
    if (r.nthreads % 32 != 0)
        return false;
    bool any = false;
    for (unsigned w = 0; w < r.nthreads / 32; w++) {
        Fiber *lane[32];
        for (unsigned l = 0; l < 32; l++)
            lane[l] = r.fibers[w * 32 + l].get();
        bool all = true;
        for (unsigned l = 0; l < 32 && all; l++)
            all = lane[l]->state == AT_WARP;
        if (!all)
            continue;
        const int op = lane[0]->wop;
        for (unsigned l = 1; l < 32; l++)
            if (lane[l]->wop != op)
                die("divergent warp operations in %s, warp %u: lane 0 calls %s, lane %u calls "
                    "%s (warp operations must be called by all 32 lanes together)\n%s",
                    where(nullptr).c_str(), w, op_name(op), l, op_name(lane[l]->wop),
                    describe_block().c_str());
        uint32_t v[32], ballot = 0;
        for (unsigned l = 0; l < 32; l++) {
            v[l] = lane[l]->wval;
            ballot |= (v[l] & 1u) << l;
        }
        for (unsigned l = 0; l < 32; l++) {
            Fiber *f = lane[l];
            switch (op) {
            case KVT_EMU_SHFL_XOR: f->wres = v[l ^ ((unsigned)f->warg & 31u)]; break;
            case KVT_EMU_SHFL: f->wres = v[(unsigned)f->warg & 31u]; break;
            case KVT_EMU_BALLOT: f->wres = ballot; break;
            default: f->wres = 0; break;
            }
            f->state = RUNNABLE;
        }
        any = true;
    }
    return any;
}

void free_shared()
{
    Runner &r = *g_rp;
    for (SharedArr &a : r.shared)
        free(a.p);
    r.shared.clear();
    free(r.dyn_ptr);
    r.dyn_ptr = nullptr;
    r.static_bytes = 0;
}

void run_block(uint64_t lb)
{
    Runner &r = *g_rp;
    r.bidx.x = (unsigned)(lb % r.grid.x);
    r.bidx.y = (unsigned)((lb / r.grid.x) % r.grid.y);
    r.bidx.z = (unsigned)(lb / ((uint64_t)r.grid.x * r.grid.y));
    const unsigned n = r.nthreads;

    free_shared();
    void *d = nullptr;
    if (posix_memalign(&d, 16, r.dyn) != 0 || !d) {
        if (posix_memalign(&d, 16, 16) != 0)
            die("out of memory for %zu bytes of dynamic shared memory", r.dyn);
    }
    memset(d, 0xff, r.dyn);
    r.dyn_ptr = d;

    for (unsigned i = 0; i < n; i++) {
        Fiber *f = r.fibers[i].get();
        f->tid = i;
        f->ctx.thread_idx.x = i % r.block.x;
        f->ctx.thread_idx.y = (i / r.block.x) % r.block.y;
        f->ctx.thread_idx.z = i / (r.block.x * r.block.y);
        f->ctx.block_idx = r.bidx;
        f->ctx.block_dim = r.block;
        f->ctx.grid_dim = r.grid;
        f->state = RUNNABLE;
        f->cp.clear();
        f->cp_group = 0;
        f->asan_fake = nullptr;
#ifdef KVT_EMU_ASAN
        // frames the previous fiber on this stack left behind when it switched
        // away for good
        const size_t top = f->stack_size < 16384 ? f->stack_size : 16384;
        __asan_unpoison_memory_region(f->stack + f->stack_size - top, top);
#endif
        init_ctx(f);
    }

    const bool rev = (r.block_seq & 1) != 0;
    for (;;) {
        for (unsigned k = 0; k < n; k++) {
            Fiber *f = r.fibers[rev ? n - 1 - k : k].get();
            if (f->state == RUNNABLE)
                run_fiber(f);
        }
        unsigned n_exit = 0, n_bar = 0;
        for (unsigned i = 0; i < n; i++) {
            const FiberState s = r.fibers[i]->state;
            n_exit += s == EXITED;
            n_bar += s == AT_BAR;
        }
        if (n_exit == n)
            break;
        if (release_warps())
            continue;
        if (n_bar != 0 && n_bar == n - n_exit) {
            const void *key = nullptr;
            for (unsigned i = 0; i < n; i++) {
                const Fiber *f = r.fibers[i].get();
                if (f->state != AT_BAR)
                    continue;
                if (!key)
                    key = f->bar_key;
                else if (f->bar_key != key)
                    die("divergent KVT_SYNC in %s: threads wait at different barriers (every "
                        "thread of the block must reach the same KVT_SYNC):\n%s",
                        where(nullptr).c_str(), describe_block().c_str());
            }
            for (unsigned i = 0; i < n; i++)
                if (r.fibers[i]->state == AT_BAR)
                    r.fibers[i]->state = RUNNABLE;
            continue;
        }
        die("deadlock in %s: no thread can make progress (a warp operation needs all 32 lanes "
            "of its warp, a KVT_SYNC every thread that has not exited):\n%s",
            where(nullptr).c_str(), describe_block().c_str());
    }
    free_shared();
}

// ---- errors ------------------------------------------------------------------
__thread cudaError_t g_last = cudaSuccess;

cudaError_t fail(cudaError_t e)
{
    g_last = e;
    return e;
}

// ---- allocations, streams, events -------------------------------------------
enum AllocKind { DEVICE_MEM, HOST_MEM, REGISTERED_MEM }; // the last: cudaHostRegister
struct Alloc {
    size_t size;
    AllocKind kind;
};
constexpr uint32_t kStreamMagic = 0x5354524du, kEventMagic = 0x45564e54u;
struct EmuStream;
// Work queued on a stream, run when something waits for it (see "deferred
// stream work" below).
struct Op {
    enum Kind { KERNEL, COPY, SET, RECORD, WAIT } kind;
    // KERNEL
    dim3 grid, block;
    size_t dyn, dyn_limit;
    bool raised;
    const char *name;
    void (*call)(void *);
    void (*destroy)(void *);
    void *fn;
    // COPY, SET
    void *dst;
    const void *src;
    size_t n;
    int value;
    // RECORD: the event and its record number; WAIT: stream `from` must have
    // run its first `upto` ops
    struct EmuEvent *ev;
    uint64_t seq;
    EmuStream *from;
    uint64_t upto;
};
struct EmuStream {
    uint32_t magic;
    unsigned flags;
    int priority;
    std::deque<Op> q{}; // queued, not yet run
    uint64_t enq = 0;  // ops queued so far
    uint64_t done = 0; // ops run so far
};
struct EmuEvent {
    uint32_t magic;
    unsigned flags;
    bool recorded;
    uint64_t rec_seq = 0;           // records asked for
    uint64_t done_seq = 0;          // records that have run
    EmuStream *rec_stream = nullptr; // where the last record was queued
    uint64_t rec_op = 0;            // its op number there
};

std::mutex g_mu; // guards everything below
std::map<uintptr_t, Alloc> &allocs()
{
    static auto *m = new std::map<uintptr_t, Alloc>;
    return *m;
}
std::map<void *, int> &handles() // stream or event -> 1
{
    static auto *m = new std::map<void *, int>;
    return *m;
}
std::unordered_map<std::string, size_t> &max_dyn()
{
    static auto *m = new std::unordered_map<std::string, size_t>;
    return *m;
}

// The tracked allocation holding p, or nullptr.
const Alloc *find_alloc(const void *p, uintptr_t *base)
{
    auto &m = allocs();
    const uintptr_t a = (uintptr_t)p;
    auto it = m.upper_bound(a);
    if (it == m.begin())
        return nullptr;
    --it;
    if (a - it->first >= it->second.size)
        return nullptr;
    *base = it->first;
    return &it->second;
}

// 0 ok; cudaErrorInvalidValue when [p, p+n) leaves the allocation holding p,
// or p is in none and must be (device side of a copy).
cudaError_t check_range(const void *p, size_t n, bool must_be_tracked)
{
    std::lock_guard<std::mutex> lk(g_mu);
    uintptr_t base = 0;
    const Alloc *a = find_alloc(p, &base);
    if (!a)
        return must_be_tracked ? cudaErrorInvalidValue : cudaSuccess;
    if (n > a->size - ((uintptr_t)p - base))
        return cudaErrorInvalidValue;
    return cudaSuccess;
}

bool stream_ok(const void *s)
{
    if (s == nullptr || s == (const void *)cudaStreamLegacy || s == (const void *)cudaStreamPerThread)
        return true;
    std::lock_guard<std::mutex> lk(g_mu);
    auto &h = handles();
    return h.count(const_cast<void *>(s)) &&
           static_cast<const EmuStream *>(s)->magic == kStreamMagic;
}

EmuEvent *event_of(void *e)
{
    std::lock_guard<std::mutex> lk(g_mu);
    auto &h = handles();
    if (!e || !h.count(e) || static_cast<EmuEvent *>(e)->magic != kEventMagic)
        return nullptr;
    return static_cast<EmuEvent *>(e);
}

cudaError_t host_alloc(void **p, size_t size, AllocKind kind)
{
    if (!p)
        return fail(cudaErrorInvalidValue);
    *p = nullptr;
    if (size == 0)
        return cudaSuccess;
    void *m = nullptr;
    if (posix_memalign(&m, 256, size) != 0 || !m)
        return fail(cudaErrorMemoryAllocation);
    memset(m, 0xa5, size); // garbage, like fresh device memory
    std::lock_guard<std::mutex> lk(g_mu);
    allocs()[(uintptr_t)m] = Alloc{size, kind};
    *p = m;
    return cudaSuccess;
}

cudaError_t host_free(void *p, AllocKind kind)
{
    if (!p)
        return cudaSuccess;
    {
        std::lock_guard<std::mutex> lk(g_mu);
        auto &m = allocs();
        auto it = m.find((uintptr_t)p);
        if (it == m.end() || it->second.kind != kind)
            return fail(cudaErrorInvalidValue);
        m.erase(it);
    }
    free(p);
    return cudaSuccess;
}

uint64_t gcd64(uint64_t a, uint64_t b)
{
    while (b) {
        const uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

} // namespace

// ---- kernel-side entry points -------------------------------------------------
void kvt_emu_fault(const char *what)
{
    Fiber *f = need_fiber("kvt_emu_fault");
    die("%s in %s (a GPU would fault here)", what, where(f).c_str());
}

void kvt_emu_no_ctx(const char *what)
{
    die("%s used outside a kernel (no emulated thread is running)", what);
}

namespace {
void *shared_at(size_t bytes, size_t align, const void *key, const kvt_emu_site *site)
{
    Fiber *f = need_fiber("KVT_SHARED");
    Runner &r = *g_rp;
    for (const SharedArr &a : r.shared)
        if (a.key == key) {
            if (a.bytes != bytes || a.align != align)
                die("KVT_SHARED at %s: %s asks for %zu bytes (align %zu), an earlier thread "
                    "for %zu (align %zu); shared arrays have one compile-time size",
                    site_str(key, site).c_str(), where(f).c_str(), bytes, align, a.bytes,
                    a.align);
            return a.p;
        }
    if (bytes == 0)
        die("KVT_SHARED of 0 bytes at %s in %s (zero-size arrays do not compile with nvcc)",
            site_str(key, site).c_str(), where(f).c_str());
    const size_t req_align = align;
    if (align < 16)
        align = 16;
    if (align & (align - 1))
        die("KVT_SHARED alignment %zu is not a power of two", align);
    r.static_bytes = ((r.static_bytes + align - 1) & ~(align - 1)) + bytes;
    if (r.static_bytes > kSmemStaticMax)
        die("kernel '%s': %zu bytes of static shared memory (KVT_SHARED) exceed 48 KiB: ptxas "
            "rejects this; use KVT_DYN_SHARED (with KVT_SET_MAX_DYN_SHARED above 48 KiB)",
            r.name, r.static_bytes);
    if (r.static_bytes + r.dyn > (r.raised ? kSmemOptin : kSmemDefault))
        die("kernel '%s': %zu bytes of static + %zu of dynamic shared memory exceed %s (%zu): "
            "the launch fails on the GPU",
            r.name, r.static_bytes, r.dyn,
            r.raised ? "the 227 KiB opt-in limit" : "48 KiB (raise it with KVT_SET_MAX_DYN_SHARED)",
            r.raised ? kSmemOptin : kSmemDefault);
    if (r.raised && r.static_bytes + r.dyn_limit > kSmemOptin)
        die("kernel '%s': KVT_SET_MAX_DYN_SHARED(%zu) plus %zu bytes of static shared memory "
            "exceed 227 KiB: cudaFuncSetAttribute fails on the GPU",
            r.name, r.dyn_limit, r.static_bytes);
    void *p = nullptr;
    if (posix_memalign(&p, align, bytes) != 0 || !p)
        die("out of memory for %zu bytes of shared memory", bytes);
    memset(p, 0xff, bytes);
    r.shared.push_back(SharedArr{key, site, bytes, req_align, p});
    return p;
}

void syncthreads_at(const void *key, const kvt_emu_site *site)
{
    Fiber *f = need_fiber("KVT_SYNC");
    f->state = AT_BAR;
    f->bar_key = key;
    f->bar_site = site;
    fiber_to_main(f, false);
}
} // namespace

void *kvt_emu_shared_at(size_t bytes, size_t align, const kvt_emu_site *site)
{
    return shared_at(bytes, align, site, site);
}

void *(kvt_emu_shared)(size_t bytes, size_t align)
{
    return shared_at(bytes, align, __builtin_return_address(0), nullptr);
}

void kvt_emu_syncthreads_at(const kvt_emu_site *site) { syncthreads_at(site, site); }

void(kvt_emu_syncthreads)(void) { syncthreads_at(__builtin_return_address(0), nullptr); }

void *kvt_emu_dyn_shared(void)
{
    need_fiber("KVT_DYN_SHARED");
    return g_rp->dyn_ptr;
}


uint32_t kvt_emu_warp(int op, uint32_t value, int arg)
{
    Fiber *f = need_fiber(op_name(op));
    Runner &r = *g_rp;
    if (r.nthreads % 32 != 0)
        die("%s in %s: the block has %u threads (%ux%ux%u), not a multiple of 32; warp "
            "operations are full-warp only",
            op_name(op), where(f).c_str(), r.nthreads, r.block.x, r.block.y, r.block.z);
    f->state = AT_WARP;
    f->wop = op;
    f->wval = value;
    f->warg = arg;
    fiber_to_main(f, false);
    return f->wres;
}

void kvt_cp_async16(void *smem, const void *gmem)
{
    Fiber *f = need_fiber("kvt_cp_async16");
    Runner &r = *g_rp;
    if ((uintptr_t)smem & 15u)
        die("kvt_cp_async16 in %s: shared address %p is not 16-byte aligned", where(f).c_str(),
            smem);
    if ((uintptr_t)gmem & 15u)
        die("kvt_cp_async16 in %s: global address %p is not 16-byte aligned", where(f).c_str(),
            gmem);
    const uintptr_t s = (uintptr_t)smem;
    bool in = s >= (uintptr_t)r.dyn_ptr && s + 16 <= (uintptr_t)r.dyn_ptr + r.dyn;
    for (size_t i = 0; !in && i < r.shared.size(); i++)
        in = s >= (uintptr_t)r.shared[i].p && s + 16 <= (uintptr_t)r.shared[i].p + r.shared[i].bytes;
    if (!in)
        die("kvt_cp_async16 in %s: destination %p..+16 is not inside this block's shared memory",
            where(f).c_str(), smem);
    f->cp.push_back(CpCopy{smem, gmem, f->cp_group});
}

void kvt_cp_async_commit(void)
{
    Fiber *f = need_fiber("kvt_cp_async_commit");
    f->cp_group++;
}

void kvt_emu_cp_async_wait(int n)
{
    Fiber *f = need_fiber("kvt_cp_async_wait");
    if (n < 0) { // cp.async.wait_all = commit_group + wait_group 0
        f->cp_group++;
        cp_complete(f, -1);
    } else {
        cp_complete(f, n);
    }
}

cudaError_t kvt_emu_set_max_dyn_shared(const char *name, size_t bytes)
{
    if (!name || bytes > kSmemOptin)
        return fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lk(g_mu);
    max_dyn()[name] = bytes;
    return cudaSuccess;
}

namespace {
void run_kernel(const Op &op);
cudaError_t enqueue(void *stream, Op &&op);
} // namespace

cudaError_t kvt_emu_launch_erased(dim3 grid, dim3 block, size_t dyn_smem, void *stream,
                                  const char *name, void (*call)(void *), void (*destroy)(void *),
                                  void *fn)
{
    struct Owner { // the closure, until it is queued
        void (*destroy)(void *);
        void *fn;
        ~Owner() { if (fn) destroy(fn); }
    } own{destroy, fn};
    Runner &r = runner();
    if (!name)
        name = "?";
    if (r.running)
        die("kernel '%s' launched from inside kernel '%s' (dynamic parallelism is not emulated)",
            name, r.name);
    if (block.x == 0 || block.y == 0 || block.z == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0)
        return fail(cudaErrorInvalidConfiguration);
    if (block.x > kMaxThreads || block.y > kMaxThreads || block.z > 64 ||
        (uint64_t)block.x * block.y * block.z > kMaxThreads)
        return fail(cudaErrorInvalidConfiguration);
    if (grid.x > 0x7fffffffu || grid.y > 65535u || grid.z > 65535u)
        return fail(cudaErrorInvalidConfiguration);
    size_t limit = kSmemDefault;
    bool raised = false;
    {
        std::lock_guard<std::mutex> lk(g_mu);
        auto &m = max_dyn();
        auto it = m.find(name);
        if (it != m.end() && it->second > kSmemDefault) {
            limit = it->second;
            raised = true;
        }
    }
    if (dyn_smem > limit)
        return fail(cudaErrorInvalidValue);
    if (!stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    Op op{};
    op.kind = Op::KERNEL;
    op.grid = grid;
    op.block = block;
    op.dyn = dyn_smem;
    op.dyn_limit = limit;
    op.raised = raised;
    op.name = name;
    op.call = call;
    op.destroy = destroy;
    op.fn = fn;
    own.fn = nullptr; // the op owns it now
    return enqueue(stream, std::move(op));
}

namespace {
// KVT_EMU_STATS=FILE: at exit, append "launches=N threads=T" (kernels run,
// CUDA threads run) to FILE. gpu-session.sh sizes the compute-sanitizer
// stages with it: the sanitizers' cost grows with launches and threads.
std::atomic<uint64_t> g_launches{0}, g_threads{0};

void write_stats()
{
    const char *path = getenv("KVT_EMU_STATS");
    FILE *f = path && *path ? fopen(path, "a") : nullptr;
    if (!f)
        return;
    fprintf(f, "launches=%llu threads=%llu\n", (unsigned long long)g_launches.load(),
            (unsigned long long)g_threads.load());
    fclose(f);
}

void count_launch(uint64_t threads)
{
    static std::once_flag once;
    std::call_once(once, [] {
        if (getenv("KVT_EMU_STATS"))
            atexit(write_stats);
    });
    g_launches.fetch_add(1, std::memory_order_relaxed);
    g_threads.fetch_add(threads, std::memory_order_relaxed);
}

// Runs a queued kernel's whole grid on this thread.
void run_kernel(const Op &op)
{
    Runner &r = runner();
    const dim3 grid = op.grid, block = op.block;
    count_launch((uint64_t)grid.x * grid.y * grid.z * block.x * block.y * block.z);
    r.name = op.name;
    r.grid = grid;
    r.block = block;
    r.nthreads = block.x * block.y * block.z;
    r.dyn = op.dyn;
    r.dyn_limit = op.dyn_limit;
    r.raised = op.raised;
    r.call = op.call;
    r.fn = op.fn;
    while (r.fibers.size() < r.nthreads)
        new_fiber();

    // scrambled block order: s -> (off + s * step) mod n, step coprime with n
    const uint64_t nb = (uint64_t)grid.x * grid.y * grid.z;
    uint64_t step = 1, off = 0;
    if (nb > 2) {
        step = nb * 618 / 1000;
        if (step == 0)
            step = 1;
        while (gcd64(step, nb) != 1)
            step++;
        off = nb / 2;
    }
    r.running = true;
    for (uint64_t s = 0; s < nb; s++) {
        const uint64_t lb =
            nb <= 2 ? nb - 1 - s : (uint64_t)(((unsigned __int128)s * step + off) % nb);
        r.block_seq = s;
        run_block(lb);
    }
    r.running = false;
    r.name = "";
}
} // namespace

// ---- deferred stream work -------------------------------------------------------
// Work queued on a stream (kernels, async copies and sets, event records and
// waits) runs only when something waits for it: cudaStreamSynchronize or
// cudaStreamQuery on the stream, cudaEventSynchronize or cudaEventQuery on
// an event recorded after it, a cudaStreamWaitEvent queued on another
// stream when that stream's work runs, cudaDeviceSynchronize, the calls
// that synchronise the device (cudaFree, cudaFreeHost, cudaHostUnregister),
// a cudaMemcpyAsync with pageable host memory (its stream), and work on the
// legacy default stream (the blocking streams). So work that another stream
// or the host uses without waiting for it is not there yet, as on a GPU that
// is behind, and a host buffer rewritten before queued work read it is read
// with its new contents. Whichever host thread waits runs the work.
namespace {
std::recursive_mutex g_exec; // queues and running them; taken before g_mu, never under it
std::vector<EmuStream *> &streams() // live streams, in creation order
{
    static auto *m = new std::vector<EmuStream *>;
    return *m;
}
// Destroyed streams and events are kept (queued ops and later waits may
// still name them), reachable so that leak checkers do not report them.
std::vector<void *> &retired()
{
    static auto *v = new std::vector<void *>;
    return *v;
}

void run_op(Op &op);
void drain_to(EmuStream *s, uint64_t upto)
{
    while (s->done < upto && !s->q.empty()) {
        Op op = std::move(s->q.front());
        s->q.pop_front();
        run_op(op);
        s->done++;
    }
}

void drain(EmuStream *s) { drain_to(s, s->enq); }

void run_op(Op &op)
{
    switch (op.kind) {
    case Op::KERNEL:
        run_kernel(op);
        op.destroy(op.fn);
        op.fn = nullptr;
        break;
    case Op::COPY:
        memmove(op.dst, op.src, op.n);
        break;
    case Op::SET:
        memset(op.dst, op.value, op.n);
        break;
    case Op::RECORD:
        if (op.ev->done_seq < op.seq)
            op.ev->done_seq = op.seq;
        break;
    case Op::WAIT:
        drain_to(op.from, op.upto);
        break;
    }
}

bool legacy_stream(const void *stream)
{
    return stream == nullptr || stream == (const void *)cudaStreamLegacy ||
           stream == (const void *)cudaStreamPerThread;
}

// Work of the legacy default stream waits for the blocking streams'.
void drain_blocking()
{
    std::lock_guard<std::recursive_mutex> lk(g_exec);
    for (EmuStream *st : streams())
        if (!(st->flags & cudaStreamNonBlocking))
            drain(st);
}

void drain_all()
{
    std::lock_guard<std::recursive_mutex> lk(g_exec);
    for (EmuStream *st : streams())
        drain(st);
}

void drain_stream(void *stream)
{
    std::lock_guard<std::recursive_mutex> lk(g_exec);
    if (legacy_stream(stream))
        drain_blocking();
    else
        drain(static_cast<EmuStream *>(stream));
}

// Until the event's last record has run.
void drain_event(EmuEvent *e)
{
    std::lock_guard<std::recursive_mutex> lk(g_exec);
    if (e->rec_stream && e->done_seq < e->rec_seq)
        drain_to(e->rec_stream, e->rec_op);
}

cudaError_t enqueue(void *stream, Op &&op)
{
    std::lock_guard<std::recursive_mutex> lk(g_exec);
    if (legacy_stream(stream)) { // runs now, after the blocking streams' work
        drain_blocking();
        if (op.kind == Op::RECORD)
            op.ev->rec_stream = nullptr;
        run_op(op);
        return cudaSuccess;
    }
    EmuStream *s = static_cast<EmuStream *>(stream);
    if (s->magic != kStreamMagic) { // destroyed since the caller checked it
        if (op.kind == Op::KERNEL)
            op.destroy(op.fn);
        return fail(cudaErrorInvalidResourceHandle);
    }
    s->q.push_back(std::move(op));
    s->enq++;
    if (s->q.back().kind == Op::RECORD) {
        s->q.back().ev->rec_stream = s;
        s->q.back().ev->rec_op = s->enq;
    }
    return cudaSuccess;
}
} // namespace

// ---- runtime API --------------------------------------------------------------
cudaError_t cudaGetDeviceCount(int *count)
{
    if (!count)
        return fail(cudaErrorInvalidValue);
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    if (!device)
        return fail(cudaErrorInvalidValue);
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice);
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
    if (!value)
        return fail(cudaErrorInvalidValue);
    if (device != 0)
        return fail(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = kSmCount; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)kSmemOptin; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)kSmemDefault; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = (int)kSmemPerSm; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = (int)kMaxThreads; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
    case cudaDevAttrMaxBlockDimX: *value = 1024; break;
    case cudaDevAttrMaxBlockDimY: *value = 1024; break;
    case cudaDevAttrMaxBlockDimZ: *value = 64; break;
    case cudaDevAttrMaxGridDimX: *value = 0x7fffffff; break;
    case cudaDevAttrMaxGridDimY: *value = 65535; break;
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrCanMapHostMemory: *value = 1; break;
    case cudaDevAttrUnifiedAddressing: *value = 1; break;
    case cudaDevAttrCanUseHostPointerForRegisteredMem: *value = 1; break;
    case cudaDevAttrConcurrentKernels: *value = 1; break;
    default: return fail(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **devPtr, size_t size) { return host_alloc(devPtr, size, DEVICE_MEM); }
// cudaFree, cudaFreeHost and cudaHostUnregister synchronise the device.
cudaError_t cudaFree(void *devPtr)
{
    if (devPtr)
        drain_all();
    return host_free(devPtr, DEVICE_MEM);
}

cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned int flags)
{
    if (flags & ~(unsigned)(cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined))
        return fail(cudaErrorInvalidValue);
    return host_alloc(pHost, size, HOST_MEM);
}
cudaError_t cudaMallocHost(void **ptr, size_t size) { return host_alloc(ptr, size, HOST_MEM); }
cudaError_t cudaFreeHost(void *ptr)
{
    if (ptr)
        drain_all();
    return host_free(ptr, HOST_MEM);
}

// Registered host memory is tracked like an allocation, so copies and the
// visibility check below know the GPU may reach it.
cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
    if (!ptr || size == 0 ||
        (flags & ~(unsigned)(cudaHostRegisterPortable | cudaHostRegisterMapped |
                             cudaHostRegisterIoMemory | cudaHostRegisterReadOnly)))
        return fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lk(g_mu);
    auto &m = allocs();
    const uintptr_t a = (uintptr_t)ptr;
    uintptr_t base = 0;
    auto next = m.lower_bound(a);
    if (find_alloc(ptr, &base) || (next != m.end() && next->first - a < size))
        return fail(cudaErrorHostMemoryAlreadyRegistered);
    m[a] = Alloc{size, REGISTERED_MEM};
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *ptr)
{
    drain_all();
    std::lock_guard<std::mutex> lk(g_mu);
    auto &m = allocs();
    auto it = m.find((uintptr_t)ptr);
    if (it == m.end() || it->second.kind != REGISTERED_MEM)
        return fail(cudaErrorHostMemoryNotRegistered);
    m.erase(it);
    return cudaSuccess;
}

bool kvt_emu_gpu_visible(const void *p, size_t n)
{
    if (n == 0)
        return true;
    std::lock_guard<std::mutex> lk(g_mu);
    uintptr_t base = 0;
    const Alloc *a = find_alloc(p, &base);
    return a && n <= a->size - ((uintptr_t)p - base);
}

cudaError_t cudaHostGetDevicePointer(void **pDevice, void *pHost, unsigned int flags)
{
    if (!pDevice || flags != 0)
        return fail(cudaErrorInvalidValue);
    {
        std::lock_guard<std::mutex> lk(g_mu);
        uintptr_t base = 0;
        const Alloc *a = find_alloc(pHost, &base);
        if (!a || a->kind == DEVICE_MEM)
            return fail(cudaErrorInvalidValue);
    }
    *pDevice = pHost; // UVA: the same address
    return cudaSuccess;
}

namespace {
// A copy's direction and ranges; *none: nothing to copy.
cudaError_t copy_args(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                      bool *none)
{
    *none = count == 0;
    bool dst_dev = false, src_dev = false;
    switch (kind) {
    case cudaMemcpyHostToHost: break;
    case cudaMemcpyHostToDevice: dst_dev = true; break;
    case cudaMemcpyDeviceToHost: src_dev = true; break;
    case cudaMemcpyDeviceToDevice: dst_dev = src_dev = true; break;
    case cudaMemcpyDefault: break;
    default: return fail(cudaErrorInvalidMemcpyDirection);
    }
    if (count == 0)
        return cudaSuccess;
    if (!dst || !src)
        return fail(cudaErrorInvalidValue);
    cudaError_t e = check_range(dst, count, dst_dev);
    if (e == cudaSuccess)
        e = check_range(src, count, src_dev);
    if (e != cudaSuccess)
        return fail(e);
    return cudaSuccess;
}
} // namespace

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    bool none = false;
    const cudaError_t e = copy_args(dst, src, count, kind, &none);
    if (e != cudaSuccess || none)
        return e;
    drain_blocking(); // the legacy default stream
    memmove(dst, src, count);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream)
{
    if (!stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    bool none = false;
    const cudaError_t e = copy_args(dst, src, count, kind, &none);
    if (e != cudaSuccess || none)
        return e;
    // Pageable host memory: the copy is done, after the stream's earlier
    // work, when the call returns.
    const bool pageable = !kvt_emu_gpu_visible(dst, count) || !kvt_emu_gpu_visible(src, count);
    Op op{};
    op.kind = Op::COPY;
    op.dst = dst;
    op.src = src;
    op.n = count;
    std::lock_guard<std::recursive_mutex> lk(g_exec);
    enqueue(stream, std::move(op));
    if (pageable)
        drain_stream(stream);
    return cudaSuccess;
}

cudaError_t cudaMemset(void *devPtr, int value, size_t count)
{
    if (count == 0)
        return cudaSuccess;
    const cudaError_t e = check_range(devPtr, count, true);
    if (e != cudaSuccess)
        return fail(e);
    drain_blocking(); // the legacy default stream
    memset(devPtr, value, count);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream)
{
    if (!stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    if (count == 0)
        return cudaSuccess;
    const cudaError_t e = check_range(devPtr, count, true);
    if (e != cudaSuccess)
        return fail(e);
    Op op{};
    op.kind = Op::SET;
    op.dst = devPtr;
    op.value = value;
    op.n = count;
    return enqueue(stream, std::move(op));
}

cudaError_t cudaDeviceGetStreamPriorityRange(int *leastPriority, int *greatestPriority)
{
    if (leastPriority)
        *leastPriority = 0;
    if (greatestPriority)
        *greatestPriority = -5;
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t *pStream, unsigned int flags, int priority)
{
    if (!pStream || (flags & ~(unsigned)cudaStreamNonBlocking))
        return fail(cudaErrorInvalidValue);
    if (priority > 0)
        priority = 0;
    if (priority < -5)
        priority = -5;
    EmuStream *s = new EmuStream{kStreamMagic, flags, priority};
    {
        std::lock_guard<std::recursive_mutex> lx(g_exec);
        streams().push_back(s);
    }
    std::lock_guard<std::mutex> lk(g_mu);
    handles()[s] = 1;
    *pStream = reinterpret_cast<cudaStream_t>(s);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags)
{
    return cudaStreamCreateWithPriority(pStream, flags, 0);
}

cudaError_t cudaStreamCreate(cudaStream_t *pStream)
{
    return cudaStreamCreateWithPriority(pStream, 0, 0);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    // The stream's work completes (CUDA lets it finish after the call).
    std::lock_guard<std::recursive_mutex> lx(g_exec);
    if (!stream || legacy_stream(stream) || !stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    EmuStream *s = reinterpret_cast<EmuStream *>(stream);
    drain(s);
    auto &v = streams();
    v.erase(std::find(v.begin(), v.end(), s));
    std::lock_guard<std::mutex> lk(g_mu);
    handles().erase(stream);
    s->magic = 0;
    retired().push_back(s);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    if (!stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    drain_stream(stream);
    return cudaSuccess;
}

// Runs the stream's work first: code that polls would otherwise never see
// it finish (nothing runs on its own here).
cudaError_t cudaStreamQuery(cudaStream_t stream) { return cudaStreamSynchronize(stream); }

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)
{
    EmuEvent *e = event_of(event);
    if (!stream_ok(stream) || !e)
        return fail(cudaErrorInvalidResourceHandle);
    if (flags & ~(unsigned)cudaEventWaitExternal)
        return fail(cudaErrorInvalidValue);
    std::lock_guard<std::recursive_mutex> lx(g_exec);
    if (!e->rec_stream || e->done_seq >= e->rec_seq)
        return cudaSuccess; // never recorded, or its last record has run
    Op op{};
    op.kind = Op::WAIT;
    op.from = e->rec_stream;
    op.upto = e->rec_op; // the record as it is now, as in CUDA
    return enqueue(stream, std::move(op));
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags)
{
    if (!event || (flags & ~(unsigned)(cudaEventBlockingSync | cudaEventDisableTiming |
                                       cudaEventInterprocess)))
        return fail(cudaErrorInvalidValue);
    if ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming))
        return fail(cudaErrorInvalidValue);
    EmuEvent *e = new EmuEvent{kEventMagic, flags, false};
    std::lock_guard<std::mutex> lk(g_mu);
    handles()[e] = 1;
    *event = reinterpret_cast<cudaEvent_t>(e);
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
    EmuEvent *e = event_of(event);
    if (!e || !stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    std::lock_guard<std::recursive_mutex> lx(g_exec);
    e->recorded = true;
    Op op{};
    op.kind = Op::RECORD;
    op.ev = e;
    op.seq = ++e->rec_seq;
    return enqueue(stream, std::move(op));
}

// Runs the work before the event's last record first (see cudaStreamQuery).
cudaError_t cudaEventQuery(cudaEvent_t event)
{
    EmuEvent *e = event_of(event);
    if (!e)
        return fail(cudaErrorInvalidResourceHandle);
    drain_event(e);
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) { return cudaEventQuery(event); }

cudaError_t cudaEventDestroy(cudaEvent_t event)
{
    std::lock_guard<std::recursive_mutex> lx(g_exec);
    std::lock_guard<std::mutex> lk(g_mu);
    auto &h = handles();
    auto it = h.find(event);
    if (!event || it == h.end() || reinterpret_cast<EmuEvent *>(event)->magic != kEventMagic)
        return fail(cudaErrorInvalidResourceHandle);
    h.erase(it);
    // Queued records may still name it: kept, not freed.
    reinterpret_cast<EmuEvent *>(event)->magic = 0;
    retired().push_back(event);
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    if (!ms)
        return fail(cudaErrorInvalidValue);
    EmuEvent *a = event_of(start), *b = event_of(end);
    if (a)
        drain_event(a);
    if (b)
        drain_event(b);
    if (!a || !b || !a->recorded || !b->recorded || (a->flags & cudaEventDisableTiming) ||
        (b->flags & cudaEventDisableTiming))
        return fail(cudaErrorInvalidResourceHandle);
    *ms = 0.0f;
    return cudaSuccess;
}

std::atomic<uint64_t> g_device_syncs{0};
uint64_t kvt_emu_device_syncs(void) { return g_device_syncs.load(); }
cudaError_t cudaDeviceSynchronize(void)
{
    g_device_syncs++; // counted for the tests
    drain_all();
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void)
{
    const cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) { return g_last; }

namespace {
struct ErrText {
    cudaError_t code;
    const char *name, *text;
};
const ErrText kErrs[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources",
     "too many resources requested for launch"},
    {cudaErrorInvalidDeviceFunction, "cudaErrorInvalidDeviceFunction", "invalid device function"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress", "misaligned address"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};
const ErrText *err_text(cudaError_t e)
{
    for (const ErrText &t : kErrs)
        if (t.code == e)
            return &t;
    return nullptr;
}
} // namespace

const char *cudaGetErrorName(cudaError_t error)
{
    const ErrText *t = err_text(error);
    return t ? t->name : "unrecognized error code";
}

const char *cudaGetErrorString(cudaError_t error)
{
    const ErrText *t = err_text(error);
    return t ? t->text : "unrecognized error code";
}
