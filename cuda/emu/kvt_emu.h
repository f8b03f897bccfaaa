// CPU emulation of the CUDA execution model (KVT_CUDA_EMU builds of cuda/).
//
// Every CUDA thread of a block runs as a cooperative coroutine (a fiber with
// its own stack, KVT_EMU_STACK_KB = 256 KiB by default, 512 under ASan) on
// a host thread; blocks run one after another, in a scrambled but
// deterministic order. A launch (like an async copy, set or event record)
// is queued on its stream and runs when the host waits for that work
// (stream or event synchronisation, a wait queued on another stream that
// runs, a device synchronisation), on the thread that waits: work used
// without a wait is not there yet, as on a GPU that is behind. Block barriers and
// full-warp operations switch between the fibers. Shared memory is a heap
// buffer per declaration and block, filled with 0xff bytes (unwritten
// floats read as NaN); cp.async copies are deferred until the wait that
// covers them (a missing wait reads stale shared memory, as on the GPU).
// Bugs the emulator aborts on, naming kernel, block and threads: divergent
// or deadlocked KVT_SYNC / warp operations, warp operations with blockDim
// not a multiple of 32, misaligned cp.async or one outside shared memory,
// more than 48 KiB of static shared memory, static + dynamic above the
// launch's limit, device code run outside a kernel.
//
// What this is not: no memory model (a thread runs alone until its next
// barrier / warp operation or its end, so everything looks sequentially
// consistent and races show up only as ordering: threads run in increasing
// order in even-numbered blocks of the run order, decreasing in odd ones;
// lanes of a warp are not in lock step between warp operations), no
// preemption (a thread spinning on a flag another thread or block sets
// hangs), no concurrency between blocks or kernels (a stream's queued work
// runs when the host waits for it, in issue order), no timing, no
// coalescing or bank conflicts, no register or occupancy limits. Device
// memory is host memory (cudaMalloc = 256-byte aligned malloc filled with
// 0xa5), so ASan sees out-of-bounds device and shared memory accesses.
// Device allocations, pinned host allocations and registered host ranges
// are tracked: kvt_emu_gpu_visible tells kernels that take host addresses
// whether a GPU could reach them (a kernel reading pageable memory would
// fault on a GPU but not here), and kvt_emu_fault aborts where one would.
//
// Only kernel code written in the dialect of kvt_cuda_rt.cuh is supported;
// include that header, not this one.
#ifndef KVTIER_CUDA_EMU_H
#define KVTIER_CUDA_EMU_H

#ifndef __cplusplus
#error "kvt_emu.h is C++ (compile cuda/*.cu with g++ -x c++ -DKVT_CUDA_EMU)"
#endif

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmath>

#include <cuda_runtime_api.h>

// ---- the current emulated thread ------------------------------------------
struct kvt_emu_ctx {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};

// Set while an emulated thread runs (NULL on the host).
extern __thread kvt_emu_ctx *kvt_emu_cur_;
[[noreturn]] void kvt_emu_no_ctx(const char *what);

inline const kvt_emu_ctx *kvt_emu_ctx_get(void)
{
    const kvt_emu_ctx *c = kvt_emu_cur_;
    if (__builtin_expect(c == nullptr, 0))
        kvt_emu_no_ctx("threadIdx/blockIdx/blockDim/gridDim");
    return c;
}

#define threadIdx (kvt_emu_ctx_get()->thread_idx)
#define blockIdx (kvt_emu_ctx_get()->block_idx)
#define blockDim (kvt_emu_ctx_get()->block_dim)
#define gridDim (kvt_emu_ctx_get()->grid_dim)
static const int warpSize = 32;

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

// ---- shared memory, barriers ----------------------------------------------
// A source location, one static object per textual use of KVT_SHARED /
// KVT_SYNC (per template instantiation), so code the compiler duplicates
// (unrolling, tail duplication) still names one declaration / barrier.
struct kvt_emu_site {
    const char *file;
    int line;
};
#define KVT_EMU_SITE_()                                         \
    ([]() -> const kvt_emu_site * {                             \
        static const kvt_emu_site kvt_emu_site_ = {__FILE__, __LINE__}; \
        return &kvt_emu_site_;                                  \
    }())

// Static shared memory: one block-wide array per declaration (like a static
// __shared__ declaration: inside a loop it is the same array every
// iteration); every thread of the block gets the same buffer, filled with
// 0xff bytes when the block starts.
void *kvt_emu_shared_at(size_t bytes, size_t align, const kvt_emu_site *site);
void *(kvt_emu_shared)(size_t bytes, size_t align); // keyed by the caller's address
#define kvt_emu_shared(bytes, align) kvt_emu_shared_at((bytes), (align), KVT_EMU_SITE_())
// The launch's dynamic shared memory (16-byte aligned, 0xff bytes).
void *kvt_emu_dyn_shared(void);
// __syncthreads(): releases when every thread of the block that has not
// exited waits at the same barrier (KVT_SYNC use); aborts on divergence.
void kvt_emu_syncthreads_at(const kvt_emu_site *site);
void(kvt_emu_syncthreads)(void); // keyed by the caller's address
#define kvt_emu_syncthreads() kvt_emu_syncthreads_at(KVT_EMU_SITE_())

// ---- warp operations (full warp: all 32 lanes; blockDim a multiple of 32) --
enum { KVT_EMU_SHFL_XOR = 1, KVT_EMU_SHFL = 2, KVT_EMU_BALLOT = 3, KVT_EMU_SYNCWARP = 4 };
uint32_t kvt_emu_warp(int op, uint32_t value, int arg);

inline uint32_t kvt_emu_f2u_(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
inline float kvt_emu_u2f_(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

inline float kvt_shfl_xor(float v, int m)
{
    return kvt_emu_u2f_(kvt_emu_warp(KVT_EMU_SHFL_XOR, kvt_emu_f2u_(v), m));
}
inline uint32_t kvt_shfl_xor(uint32_t v, int m) { return kvt_emu_warp(KVT_EMU_SHFL_XOR, v, m); }
inline int kvt_shfl_xor(int v, int m)
{
    return static_cast<int>(kvt_emu_warp(KVT_EMU_SHFL_XOR, static_cast<uint32_t>(v), m));
}
inline float kvt_shfl(float v, int src)
{
    return kvt_emu_u2f_(kvt_emu_warp(KVT_EMU_SHFL, kvt_emu_f2u_(v), src));
}
inline uint32_t kvt_shfl(uint32_t v, int src) { return kvt_emu_warp(KVT_EMU_SHFL, v, src); }
inline int kvt_shfl(int v, int src)
{
    return static_cast<int>(kvt_emu_warp(KVT_EMU_SHFL, static_cast<uint32_t>(v), src));
}
inline uint32_t kvt_ballot(int pred) { return kvt_emu_warp(KVT_EMU_BALLOT, pred != 0, 0); }
inline void kvt_syncwarp(void) { (void)kvt_emu_warp(KVT_EMU_SYNCWARP, 0, 0); }

// ---- cp.async ---------------------------------------------------------------
// The 16-byte copy is queued and done at the wait that covers its group
// (wait_all: everything; wait_groups<N>: all but the N most recent committed
// groups); both addresses must be 16-byte aligned, smem inside this block's
// shared memory.
void kvt_cp_async16(void *smem, const void *gmem);
void kvt_cp_async_commit(void);
void kvt_emu_cp_async_wait(int n); // n < 0: wait_all
inline void kvt_cp_async_wait_all(void) { kvt_emu_cp_async_wait(-1); }
template <int N> inline void kvt_cp_async_wait_groups(void)
{
    static_assert(N >= 0, "kvt_cp_async_wait_groups<N>: N >= 0");
    kvt_emu_cp_async_wait(N);
}

// ---- launch -----------------------------------------------------------------
// Validates the configuration like an H100 (block dims > 0, <= 1024 threads,
// block.z <= 64, grid.x < 2^31, grid.y/z <= 65535, dynamic shared memory <=
// 48 KiB or the kernel's KVT_SET_MAX_DYN_SHARED value, a known stream) and
// queues the grid on the stream; it runs, whole, when something waits for
// the stream's work (see "deferred stream work" in stream.cpp). A bad configuration returns
// (and records for cudaGetLastError) cudaErrorInvalidConfiguration /
// cudaErrorInvalidValue / cudaErrorInvalidResourceHandle.
// fn: a heap copy of the kernel's closure, which the launch takes over
// (run, then freed with destroy).
cudaError_t kvt_emu_launch_erased(dim3 grid, dim3 block, size_t dyn_smem, void *stream,
                                  const char *name, void (*call)(void *), void (*destroy)(void *),
                                  void *fn);

template <class F>
inline cudaError_t kvt_emu_launch(dim3 grid, dim3 block, size_t dyn_smem, void *stream,
                                  const char *name, F fn)
{
    return kvt_emu_launch_erased(
        grid, block, dyn_smem, stream, name, [](void *p) { (*static_cast<F *>(p))(); },
        [](void *p) { delete static_cast<F *>(p); }, new F(fn));
}

// cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
// bytes), keyed by the kernel's name (bytes <= 227 KiB).
cudaError_t kvt_emu_set_max_dyn_shared(const char *name, size_t bytes);
// Whether [p, p + n) lies in memory a GPU kernel may access: one device
// allocation, pinned host allocation or registered host range. (The
// emulation cannot fault on pageable memory inside a kernel, so kernels
// that take host addresses check them with this under KVT_CUDA_EMU.)
bool kvt_emu_gpu_visible(const void *p, size_t n);
// cudaDeviceSynchronize calls so far (tests check a pool's calls make none).
uint64_t kvt_emu_device_syncs(void);
// In a kernel: aborts, naming the kernel, block and thread, where a GPU
// would fault (e.g. an address it cannot reach).
[[noreturn]] void kvt_emu_fault(const char *what);

// ---- atomics (return the old value) -----------------------------------------
inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline int atomicAdd(int *p, int v)
{
    // two's complement wrap-around like the GPU, without signed overflow
    return static_cast<int>(__atomic_fetch_add(reinterpret_cast<unsigned *>(p),
                                               static_cast<unsigned>(v), __ATOMIC_RELAXED));
}
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float *p, float v)
{
    uint32_t *u = reinterpret_cast<uint32_t *>(p);
    uint32_t old = __atomic_load_n(u, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(u, &old, kvt_emu_f2u_(kvt_emu_u2f_(old) + v), true,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return kvt_emu_u2f_(old);
}
template <class T> inline T kvt_emu_atomic_max_(T *p, T v)
{
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {
    }
    return old;
}
template <class T> inline T kvt_emu_atomic_min_(T *p, T v)
{
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old > v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {
    }
    return old;
}
inline int atomicMax(int *p, int v) { return kvt_emu_atomic_max_(p, v); }
inline unsigned atomicMax(unsigned *p, unsigned v) { return kvt_emu_atomic_max_(p, v); }
inline int atomicMin(int *p, int v) { return kvt_emu_atomic_min_(p, v); }
inline unsigned atomicMin(unsigned *p, unsigned v) { return kvt_emu_atomic_min_(p, v); }
template <class T> inline T kvt_emu_atomic_cas_(T *p, T cmp, T v)
{
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return cmp;
}
inline int atomicCAS(int *p, int cmp, int v) { return kvt_emu_atomic_cas_(p, cmp, v); }
inline unsigned atomicCAS(unsigned *p, unsigned cmp, unsigned v)
{
    return kvt_emu_atomic_cas_(p, cmp, v);
}
inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long cmp,
                                    unsigned long long v)
{
    return kvt_emu_atomic_cas_(p, cmp, v);
}
inline int atomicExch(int *p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicExch(unsigned *p, unsigned v)
{
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}
inline float atomicExch(float *p, float v)
{
    return kvt_emu_u2f_(
        __atomic_exchange_n(reinterpret_cast<uint32_t *>(p), kvt_emu_f2u_(v), __ATOMIC_RELAXED));
}

// ---- intrinsics ---------------------------------------------------------------
// glibc's <math.h> already declares __expf / __logf (C linkage): macros.
#define __expf(x) (::expf(x))
#define __logf(x) (::logf(x))
inline float __fdividef(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float f) { return kvt_emu_f2u_(f); }
inline float __uint_as_float(unsigned u) { return kvt_emu_u2f_(u); }
inline int __float_as_int(float f) { return static_cast<int>(kvt_emu_f2u_(f)); }
inline float __int_as_float(int i) { return kvt_emu_u2f_(static_cast<uint32_t>(i)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x)
{
    return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x)
{
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
template <class T> inline T __ldg(const T *p) { return *p; }
inline void __threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

#endif // KVTIER_CUDA_EMU_H
