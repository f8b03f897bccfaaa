// The dialect every kernel in cuda/ is written in: real CUDA under nvcc, the
// CPU emulation of cuda/emu under the host C++ compiler (KVT_CUDA_EMU).
//
// Rules for kernel code (so both builds mean the same thing):
//  - kernels are `KVT_KERNEL name(...)` (the macro carries `static __global__ void`), launched only through
//    KVT_LAUNCH (never <<< >>> directly);
//  - shared memory only through KVT_SHARED (fixed size) and KVT_DYN_SHARED
//    (the launch's dynamic bytes); never a bare __shared__ and never
//    sizeof() of a shared array;
//  - block barriers KVT_SYNC(); warp operations are full-warp (every lane of
//    the warp calls them; blockDim.x a multiple of 32): kvt_shfl_xor,
//    kvt_shfl, kvt_ballot, kvt_syncwarp;
//  - cp.async through kvt_cp_async16 / kvt_cp_async_commit /
//    kvt_cp_async_wait_all (16-byte aligned both sides);
//  - atomics: atomicAdd, atomicMax, atomicMin, atomicCAS, atomicExch on
//    32-bit integers and atomicAdd on float;
//  - math: expf, logf, sqrtf, fmaxf, fminf, fabsf, isnan, isinf, __expf,
//    __logf, __fdividef, __float_as_uint, __uint_as_float, __popc, __clz,
//    __ffs; integer min/max through kvt_umin/kvt_umax (not min/max);
//  - element conversion through the kvt_* functions below (bit-identical to
//    lib/core/convert.c, the CPU reference, except NaN payloads).
#ifndef KVTIER_CUDA_RT_CUH
#define KVTIER_CUDA_RT_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvt_cuda.h"
#include "../lib/core/forced.h" // the forced-page rule, shared with the library

#ifdef KVT_CUDA_EMU
#include "emu/kvt_emu.h"
#include <tuple>
#include <type_traits>
#include <utility>
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

extern "C" {
KVT__HIDDEN int kvt__err(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
}

#ifdef KVT_CUDA_EMU
#define KVT_HD inline
#define KVT_DEV inline
#define KVT_KERNEL static void
#define KVT_SHARED(T, name, n) T *name = static_cast<T *>(kvt_emu_shared(sizeof(T) * (n), alignof(T)))
#define KVT_DYN_SHARED(T, name) T *name = static_cast<T *>(kvt_emu_dyn_shared())
#define KVT_SYNC() kvt_emu_syncthreads()
// Launch: returns cudaError_t of the launch itself (bad configuration). The
// arguments are converted to the kernel's parameter types and copied now,
// as a launch does, since the grid runs later (queued on its stream).
#define KVT_LAUNCH(kern, grid, block, smem, stream, ...) \
    kvt_emu_launch_args((grid), (block), (size_t)(smem), (stream), #kern, kern, ##__VA_ARGS__)
template <class... P, class... A>
inline cudaError_t kvt_emu_launch_args(dim3 grid, dim3 block, size_t smem, void *stream,
                                       const char *name, void (*kern)(P...), A &&...args)
{
    static_assert(sizeof...(P) == sizeof...(A), "KVT_LAUNCH: wrong number of kernel arguments");
    return kvt_emu_launch(grid, block, smem, stream, name,
                          [kern, t = std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)]() {
                              std::apply(kern, t);
                          });
}
#define KVT_SET_MAX_DYN_SHARED(kern, bytes) kvt_emu_set_max_dyn_shared(#kern, (size_t)(bytes))
#else
#define KVT_HD __host__ __device__ __forceinline__
#define KVT_DEV __device__ __forceinline__
#define KVT_KERNEL static __global__ void
#define KVT_SHARED(T, name, n) __shared__ T name[n]
#define KVT_DYN_SHARED(T, name)                                   \
    extern __shared__ __align__(16) unsigned char kvt_dyn_smem_[]; \
    T *name = reinterpret_cast<T *>(kvt_dyn_smem_)
#define KVT_SYNC() __syncthreads()
#define KVT_LAUNCH(kern, grid, block, smem, stream, ...)                                  \
    (kern<<<(grid), (block), (size_t)(smem), static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__), \
     cudaGetLastError())
#define KVT_SET_MAX_DYN_SHARED(kern, bytes) \
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(bytes))

KVT_DEV float kvt_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
KVT_DEV uint32_t kvt_shfl_xor(uint32_t v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
KVT_DEV int kvt_shfl_xor(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
KVT_DEV float kvt_shfl(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
KVT_DEV uint32_t kvt_shfl(uint32_t v, int src) { return __shfl_sync(0xffffffffu, v, src); }
KVT_DEV int kvt_shfl(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
KVT_DEV uint32_t kvt_ballot(int pred) { return __ballot_sync(0xffffffffu, pred); }
KVT_DEV void kvt_syncwarp(void) { __syncwarp(); }

// cp.async (sm_80+: every architecture this library builds for).
KVT_DEV void kvt_cp_async16(void *smem, const void *gmem)
{
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
KVT_DEV void kvt_cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::); }
KVT_DEV void kvt_cp_async_wait_all(void) { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
template <int N> KVT_DEV void kvt_cp_async_wait_groups(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

KVT_HD uint32_t kvt_umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

// f32 products and sums rounded one at a time, like the CPU reference's
// (never contracted with a neighbouring operation into an FMA).
KVT_DEV float kvt_mul_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
KVT_DEV float kvt_add_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
KVT_HD uint32_t kvt_umax(uint32_t a, uint32_t b) { return a > b ? a : b; }
KVT_HD uint64_t kvt_umin64(uint64_t a, uint64_t b) { return a < b ? a : b; }

// ---- element conversion (bit-identical to lib/core/convert.c) -------------
#define KVT_RN 0
#define KVT_RD 1
#define KVT_RU 2

KVT_HD uint32_t kvt_f32_bits(float f)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}
KVT_HD float kvt_bits_f32(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

KVT_HD float kvt_f16_to_f32(uint16_t h)
{
#if defined(__CUDA_ARCH__)
    // The hardware widening is exact (every f16 is an f32); only a NaN's
    // payload bits may differ from the integer path below.
    return __half2float(__ushort_as_half(h));
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        const float f = (float)man * 5.9604644775390625e-08f; /* 2^-24 */
        return sign ? -f : f;
    }
    if (exp == 31)
        return kvt_bits_f32(sign | 0x7f800000u | (man << 13));
    return kvt_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

KVT_HD float kvt_bf16_to_f32(uint16_t h) { return kvt_bits_f32((uint32_t)h << 16); }

KVT_HD uint16_t kvt_f16_rn(float f)
{
    uint32_t x = kvt_f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u)
        return (uint16_t)(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (x >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u);
    if (x < 0x38800000u) {
        const float g = kvt_bits_f32(x) + 0.5f;
        return (uint16_t)(sign | (kvt_f32_bits(g) - 0x3f000000u));
    }
    x += 0xc8000fffu + ((x >> 13) & 1u);
    return (uint16_t)(sign | (x >> 13));
}

KVT_HD uint16_t kvt_f32_to_f16(float f, int mode)
{
    uint16_t h = kvt_f16_rn(f);
    if (mode == KVT_RN || f != f)
        return h;
    const float back = kvt_f16_to_f32(h);
    if (mode == KVT_RD && back > f)
        h = h == 0x0000u ? (uint16_t)0x8001u
                         : ((h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u));
    else if (mode == KVT_RU && back < f)
        h = h == 0x8000u ? (uint16_t)0x0001u
                         : ((h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u));
    if ((h & 0x7fffu) == 0)
        h = (uint16_t)((kvt_f32_bits(f) & 0x80000000u) ? 0x8000u : 0u);
    return h;
}

KVT_HD uint16_t kvt_f32_to_bf16(float f, int mode)
{
    const uint32_t u = kvt_f32_bits(f);
    if (f != f)
        return (uint16_t)((u >> 16) | 0x0040u);
    const uint32_t sign = u & 0x80000000u;
    const uint32_t lost = u & 0xffffu;
    uint32_t t = u >> 16;
    if (mode == KVT_RN)
        return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    const int up = (mode == KVT_RU && !sign) || (mode == KVT_RD && sign);
    if (up && lost != 0 && (u & 0x7fffffffu) < 0x7f800000u)
        t += 1;
    return (uint16_t)t;
}

// Element i of an array of dtype dt (KVT_DTYPE_F16, BF16 or F32) as f32.
KVT_HD float kvt_load(const void *p, uint64_t i, kvt_dtype dt)
{
    if (dt == KVT_DTYPE_F32)
        return static_cast<const float *>(p)[i];
    const uint16_t h = static_cast<const uint16_t *>(p)[i];
    return dt == KVT_DTYPE_BF16 ? kvt_bf16_to_f32(h) : kvt_f16_to_f32(h);
}
// Stores f (rounded as given) as element i of an array of dtype dt.
KVT_HD void kvt_store(void *p, uint64_t i, kvt_dtype dt, float f, int mode)
{
    if (dt == KVT_DTYPE_F32)
        static_cast<float *>(p)[i] = f;
    else if (dt == KVT_DTYPE_BF16)
        static_cast<uint16_t *>(p)[i] = kvt_f32_to_bf16(f, mode);
    else
        static_cast<uint16_t *>(p)[i] = kvt_f32_to_f16(f, mode);
}
KVT_HD uint32_t kvt_dtype_bytes(kvt_dtype dt) { return dt == KVT_DTYPE_F32 ? 4u : 2u; }

// A launcher's check of the metadata store it is given (a->meta_bytes,
// a->meta_slots): the two planes (kvt_cuda.h) have no room for padding, rows
// are D * elem bytes apart (a multiple of 16 for D % 8 == 0, so rows stay
// 16-byte aligned with d_meta_base), and the store has slots.
static inline int kvt_meta_check(uint32_t D, kvt_dtype dt, uint64_t meta_bytes,
                                 uint32_t meta_slots)
{
    const uint64_t elem = kvt_dtype_bytes(dt);
    if (meta_bytes != 3ull * D * elem)
        return kvt__err(KVT_EINVAL, "a->meta_bytes: %llu is not 3 * D * %llu = %llu",
                        (unsigned long long)meta_bytes, (unsigned long long)elem,
                        (unsigned long long)(3ull * D * elem));
    if (meta_slots == 0)
        return kvt__err(KVT_EINVAL, "a->meta_slots: must not be 0 (the slots of the metadata "
                        "store)");
    return 0;
}

// A launcher's required pointer argument a->field.
#define KVT_CU_NEED(a, field)                                                         \
    do {                                                                              \
        if (!(a)->field)                                                              \
            return kvt__err(KVT_EINVAL, "a->" #field ": must not be NULL");           \
    } while (0)

// Launch error -> KVT_EIO with the CUDA error, naming the kernel.
#define KVT_CU_LAUNCHED(e, what)                                                        \
    ((e) == cudaSuccess ? 0                                                             \
                        : kvt__err(KVT_EIO, "%s: launch failed: %s (%s)", (what),       \
                                   cudaGetErrorName(e), cudaGetErrorString(e)))

#endif // KVTIER_CUDA_RT_CUH
