// CPU emulation of the CUDA execution model: the fibers. Each CUDA thread of
// a block is a fiber with its own stack (mapped with a guard page, reused
// across launches), switched by a few instructions of assembly on x86-64, by
// ucontext makecontext/swapcontext elsewhere or with -DKVT_EMU_UCONTEXT;
// the host thread's Runner owns them. Also the abort helper (die) and the
// landing of a fiber's cp.async copies. See emu_int.h for the overview.
#include "emu_int.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define KVT_EMU_VALGRIND 1
#endif

__thread kvt_emu_ctx *kvt_emu_cur_;

namespace kvt_emu_detail {

// The host thread's runner: a plain TLS pointer (no TLS wrapper calls on the
// switch paths), owned by a thread_local that unmaps the stacks at thread
// exit.
__thread Runner *g_rp = nullptr;

Runner::~Runner()
{
    for (auto &f : fibers) {
#ifdef KVT_EMU_VALGRIND
        VALGRIND_STACK_DEREGISTER(f->vg_id);
#endif
        munmap(f->map, f->stack_size + (size_t)sysconf(_SC_PAGESIZE));
    }
}

namespace {
struct RunnerOwner {
    std::unique_ptr<Runner> r;
    ~RunnerOwner() { g_rp = nullptr; }
};
} // namespace

Runner &runner()
{
    if (__builtin_expect(g_rp == nullptr, 0)) {
        static thread_local RunnerOwner owner;
        owner.r.reset(new Runner);
        g_rp = owner.r.get();
    }
    return *g_rp;
}

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

namespace {
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
} // namespace

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
namespace {
void fiber_main();
} // namespace

#ifdef KVT_EMU_FAST_SWITCH
namespace {
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
} // namespace

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

namespace {
void switch_ctx(Fiber *f, bool to_main)
{
    Runner &r = *g_rp;
    if (to_main)
        kvt_emu_swap_(&f->sp, r.main_sp);
    else
        kvt_emu_swap_(&r.main_sp, f->sp);
}
} // namespace
#else
namespace {
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
} // namespace

void init_ctx(Fiber *f)
{
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = f->stack_size;
    f->uc.uc_stack.ss_flags = 0;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, fiber_main, 0);
}

namespace {
void switch_ctx(Fiber *f, bool to_main)
{
    Runner &r = *g_rp;
    const int rc = to_main ? real_swapcontext()(&f->uc, &r.main_uc)
                           : real_swapcontext()(&r.main_uc, &f->uc);
    if (rc != 0)
        die("swapcontext: %s", strerror(errno));
}
} // namespace
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

namespace {
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
} // namespace

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

} // namespace kvt_emu_detail
