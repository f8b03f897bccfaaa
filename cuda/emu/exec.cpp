// CPU emulation of the CUDA execution model: the scheduler. A launch's grid
// runs block after block (in a scrambled but deterministic order) on the
// host thread that runs the kernel; in a block, every runnable fiber runs
// until it blocks (barrier, warp operation) or exits, then the warps / the
// barrier whose threads have all arrived are released; when nothing can make
// progress the emulation aborts with a description of every thread. Also the
// kernel-side entry points (shared memory, barriers, warp operations,
// cp.async), the launch (validation, queueing) and the KVT_EMU_STATS
// counter. See emu_int.h for the overview.
#include "emu_int.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include <atomic>
#include <mutex>
#include <string>

namespace kvt_emu_detail {
namespace {

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
} // namespace kvt_emu_detail

using namespace kvt_emu_detail;

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

namespace kvt_emu_detail {
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
} // namespace

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

} // namespace kvt_emu_detail
