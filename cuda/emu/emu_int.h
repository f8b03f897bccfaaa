// Private header of the CPU emulation of the CUDA execution model and of the
// runtime API subset libkvtier uses (see kvt_emu.h for what is and is not
// emulated); what the emulation's files share. Kernels include kvt_emu.h
// (through kvt_cuda_rt.cuh), never this.
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
//
// The files:
//   fiber.cpp    fibers: the host thread's runner, stacks, context switching,
//                cp.async completion, the abort helper (die)
//   exec.cpp     the scheduler: a kernel's grid and blocks, barriers, warp
//                operations, shared memory, deadlock / divergence reports,
//                the kernel-side entry points, launches, the stats counter
//   stream.cpp   deferred stream work: the queues and running them
//   rtapi.cpp  the runtime API: memory, copies, streams, events, device
//                properties, errors
// What they share is in namespace kvt_emu_detail below (hidden visibility:
// the emulation is linked into libkvtier-emu.a only, and none of it is for
// the library's users); what one file alone uses stays in an anonymous
// namespace there.
#ifndef KVTIER_CUDA_EMU_INT_H
#define KVTIER_CUDA_EMU_INT_H

#include "kvt_emu.h"

#include <ucontext.h>

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

namespace kvt_emu_detail __attribute__((visibility("hidden"))) {

// ---- limits of the emulated device (an H100 SXM, scaled down to 8 SMs) ------
constexpr size_t kSmemDefault = 48 * 1024;     // per block without opt-in
constexpr size_t kSmemOptin = 232448;          // 227 KiB per block with opt-in
constexpr size_t kSmemStaticMax = 48 * 1024;   // ptxas: static __shared__ <= 0xc000
constexpr size_t kSmemPerSm = 233472;          // 228 KiB
constexpr unsigned kMaxThreads = 1024;
constexpr int kSmCount = 8;

// ---- fibers (fiber.cpp) -----------------------------------------------------
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

// The host thread's fibers, the launch it runs and the block it is at.
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
    ~Runner(); // unmaps the stacks (fiber.cpp)
};

// The host thread's runner (nullptr until runner() made it): a plain TLS
// pointer, no TLS wrapper calls on the switch paths.
extern __thread Runner *g_rp;
Runner &runner();

// Prints "kvt_emu: " and the message to stderr, then aborts.
[[noreturn]] void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// The running emulated thread; aborts when none runs (what: the caller).
inline Fiber *need_fiber(const char *what)
{
    Fiber *f = g_rp ? g_rp->cur : nullptr;
    if (!f)
        die("%s called outside a kernel (no emulated thread is running)", what);
    return f;
}

// A new fiber (stack mapped, guard page below it) appended to g_rp->fibers.
Fiber *new_fiber();
// Lands f's cp.async copies but those of its last keep_groups committed
// groups (all of them: keep_groups < 0).
void cp_complete(Fiber *f, int keep_groups);
// A fresh context on f's stack that starts the launch's kernel.
void init_ctx(Fiber *f);
// From the fiber f, back to the scheduler (exiting: f never resumes).
void fiber_to_main(Fiber *f, bool exiting);
// From the scheduler, runs f until it blocks or exits.
void run_fiber(Fiber *f);

// ---- errors (rtapi.cpp) ------------------------------------------------------
extern __thread cudaError_t g_last;
// Records e for cudaGetLastError and returns it.
cudaError_t fail(cudaError_t e);

// ---- allocations, streams, events (rtapi.cpp, stream.cpp) ------------------
enum AllocKind { DEVICE_MEM, HOST_MEM, REGISTERED_MEM }; // the last: cudaHostRegister
struct Alloc {
    size_t size;
    AllocKind kind;
};
constexpr uint32_t kStreamMagic = 0x5354524du, kEventMagic = 0x45564e54u;
struct EmuStream;
// Work queued on a stream, run when something waits for it (see "deferred
// stream work" in stream.cpp).
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

extern std::mutex g_mu; // guards allocations, handles and max_dyn()
// kvt_emu_set_max_dyn_shared values by kernel name (under g_mu).
std::unordered_map<std::string, size_t> &max_dyn();
// A null / legacy / per-thread stream or a live stream created here.
bool stream_ok(const void *s);

// ---- running a kernel (exec.cpp) -----------------------------------------------
// Runs a queued kernel's whole grid on this thread.
void run_kernel(const Op &op);

// ---- deferred stream work (stream.cpp) -------------------------------------------
extern std::recursive_mutex g_exec; // queues and running them; taken before g_mu, never under it
std::vector<EmuStream *> &streams(); // live streams, in creation order
// Destroyed streams and events (kept: queued ops and later waits may still
// name them).
std::vector<void *> &retired();
// Runs the stream's queued work.
void drain(EmuStream *s);
// The null stream, cudaStreamLegacy or cudaStreamPerThread.
bool legacy_stream(const void *stream);
// Work of the legacy default stream waits for the blocking streams'.
void drain_blocking();
// Every stream's queued work.
void drain_all();
// The stream's work (a legacy stream: the blocking streams').
void drain_stream(void *stream);
// Until the event's last record has run.
void drain_event(EmuEvent *e);
// Queues op on the stream (runs it now on a legacy stream, after the
// blocking streams' work).
cudaError_t enqueue(void *stream, Op &&op);

} // namespace kvt_emu_detail

#endif // KVTIER_CUDA_EMU_INT_H
