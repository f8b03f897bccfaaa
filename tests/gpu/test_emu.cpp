// The CPU emulation of the CUDA execution model (cuda/emu) on its own:
// small kernels in the dialect of kvt_cuda_rt.cuh, each result checked
// against a plain host computation, plus the emulator's error paths
// (launch validation, runtime API errors) and its aborts on kernel bugs
// (divergence, deadlock, misaligned cp.async), the latter in forked
// children.
//
// Build (emulated only; there is no GPU build of this test):
//   g++ -std=c++17 -O1 -g -Wall -Wextra -DKVT_CUDA_EMU -Iinclude -Icuda
//       -I/usr/local/cuda/include tests/gpu/test_emu.cpp cuda/emu/*.cpp -lcmocka
#ifndef KVT_CUDA_EMU
#error "test_emu.cpp tests the CUDA emulator: build it with -DKVT_CUDA_EMU"
#endif

#include "kvt_cuda_rt.cuh"

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

extern "C" {
#include <cmocka.h>
}

#define CU_OK(x) assert_int_equal((int)(x), (int)cudaSuccess)

// ---- kernels -------------------------------------------------------------------
// Block sum of in[block * n ...] by a shared-memory tree (blockDim.x = n, a
// power of two), plus every thread's coordinates.
KVT_KERNEL k_reduce(const float *in, float *out, uint32_t *coords)
{
    KVT_SHARED(float, s, 256);
    const unsigned nt = blockDim.x * blockDim.y * blockDim.z;
    const unsigned t = threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
    const unsigned b = blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
    s[t] = in[b * nt + t];
    KVT_SYNC();
    for (unsigned h = nt / 2; h > 0; h /= 2) {
        if (t < h)
            s[t] += s[t + h];
        KVT_SYNC();
    }
    if (t == 0)
        out[b] = s[0];
    uint32_t *c = coords + 6 * (b * nt + t);
    c[0] = threadIdx.x;
    c[1] = threadIdx.y;
    c[2] = threadIdx.z;
    c[3] = blockIdx.x;
    c[4] = blockIdx.y;
    c[5] = blockIdx.z;
}

// out[i] = in[i] + add for i < n (one block).
KVT_KERNEL k_add(const int *in, int *out, int add, unsigned n)
{
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x)
        out[i] = in[i] + add;
}

// Threads >= n leave early; the others still meet at the barriers.
KVT_KERNEL k_early_exit(unsigned n, unsigned *out)
{
    KVT_SHARED(unsigned, s, 128);
    const unsigned t = threadIdx.x;
    if (t >= n)
        return;
    s[t] = t + 1;
    KVT_SYNC();
    out[t] = s[n - 1 - t];
    KVT_SYNC();
}

// Warp butterfly sums (float, int), broadcast, ballot.
KVT_KERNEL k_warp(const float *in, float *fsum, int *isum, uint32_t *bcast, uint32_t *ballot)
{
    const unsigned t = threadIdx.x;
    const unsigned lane = t % 32;
    float v = in[t];
    int iv = (int)t - 40;
    for (int m = 16; m > 0; m /= 2) {
        v += kvt_shfl_xor(v, m);
        iv += kvt_shfl_xor(iv, m);
    }
    fsum[t] = v;
    isum[t] = iv;
    const uint32_t b = kvt_shfl((uint32_t)(t * 7u), 5);
    const int rot = kvt_shfl((int)t, (int)((lane + 1) % 32));
    bcast[t] = b + ((uint32_t)rot << 16);
    kvt_syncwarp();
    ballot[t] = kvt_ballot(lane % 3 == 0 || t >= 96);
}

// Warps are 32 consecutive linear thread ids, also in 2D blocks (16 x 4:
// rows y = 0,1 form warp 0). Lane masks and source lanes wrap modulo 32.
KVT_KERNEL k_warp2d(uint32_t *out)
{
    const uint32_t y = threadIdx.y, x = threadIdx.x;
    const uint32_t t = x + y * blockDim.x;
    const uint32_t other = kvt_shfl_xor(y, 16);
    const uint32_t wrap = kvt_shfl(t, 32 + 3);
    const uint32_t xorwrap = kvt_shfl_xor(t, 32 + 1);
    const uint32_t bal = kvt_ballot(y == 1 && x < 4);
    out[4 * t + 0] = other;
    out[4 * t + 1] = wrap;
    out[4 * t + 2] = xorwrap;
    out[4 * t + 3] = bal;
}

// A missing barrier: thread 0 publishes, the others read without KVT_SYNC.
// Threads run in increasing order in even-numbered blocks (of the run order)
// and decreasing in odd ones, so one of two blocks reads the 0xff fill.
KVT_KERNEL k_missing_sync(uint32_t *out)
{
    KVT_SHARED(uint32_t, flag, 1);
    if (threadIdx.x == 0)
        flag[0] = 7;
    out[blockIdx.x * blockDim.x + threadIdx.x] = flag[0];
}

// Dynamic shared memory: first reads (must be 0xff bytes), then a round trip.
KVT_KERNEL k_dyn(uint32_t n_words, uint32_t *out)
{
    KVT_DYN_SHARED(uint32_t, d);
    const unsigned t = threadIdx.x;
    if (t == 0)
        out[0] = d[n_words - 1];
    KVT_SYNC();
    for (uint32_t i = t; i < n_words; i += blockDim.x)
        d[i] = i * 3u;
    KVT_SYNC();
    uint32_t acc = 0;
    for (uint32_t i = t; i < n_words; i += blockDim.x)
        acc += d[n_words - 1 - i];
    atomicAdd(&out[1], acc);
}

KVT_KERNEL k_nop(void) {}

KVT_KERNEL k_atomics(unsigned *u, int *i, unsigned long long *ull, float *f, int *mx,
                          unsigned *mn, int *cas_counter, unsigned *exch)
{
    const unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(u, 1u);
    atomicAdd(i, (g % 2) ? 3 : -1);
    atomicAdd(ull, 1ull << 33);
    atomicAdd(f, 1.0f);
    atomicMax(mx, (int)(g * 37u % 1000u) - 500);
    atomicMin(mn, 100000u - g);
    int old = *cas_counter, seen;
    while ((seen = atomicCAS(cas_counter, old, old + 2)) != old)
        old = seen;
    atomicExch(exch, g);
}

// Each block takes a ticket: the order blocks ran in.
KVT_KERNEL k_order(unsigned *ticket, unsigned *order)
{
    if (threadIdx.x == 0)
        order[atomicAdd(ticket, 1u)] = blockIdx.x;
}

// cp.async of n16 16-byte chunks in two groups; snapshot after wait<1>.
KVT_KERNEL k_cp_async(const float *g, float *out, float *snap, unsigned n16)
{
    KVT_SHARED(float, s, 256);
    const unsigned t = threadIdx.x;
    const unsigned half = n16 / 2;
    if (t < half)
        kvt_cp_async16(s + 4 * t, g + 4 * t);
    kvt_cp_async_commit();
    if (t < half)
        kvt_cp_async16(s + 4 * (half + t), g + 4 * (half + t));
    kvt_cp_async_commit();
    kvt_cp_async_wait_groups<1>();
    if (t < half) {
        for (int k = 0; k < 4; k++) {
            snap[4 * t + k] = s[4 * t + k];
            snap[4 * (half + t) + k] = s[4 * (half + t) + k];
        }
    }
    kvt_cp_async_wait_all();
    KVT_SYNC();
    for (unsigned i = t; i < 4 * n16; i += blockDim.x)
        out[i] = s[4 * n16 - 1 - i];
}

// KVT_SHARED at one call site is one array per block, also inside a loop.
KVT_KERNEL k_shared_loop(unsigned *out)
{
    const unsigned t = threadIdx.x;
    for (unsigned it = 0; it < 3; it++) {
        KVT_SHARED(unsigned, s, 64);
        if (it == 0)
            s[t] = t;
        else
            s[t] += 100;
        KVT_SYNC();
        if (it == 2)
            out[t] = s[63 - t];
        KVT_SYNC();
    }
}

// Kernel bugs the emulator must refuse (run in forked children).
KVT_KERNEL k_divergent_sync(void)
{
    if (threadIdx.x < 32) {
        KVT_SYNC();
    } else {
        KVT_SYNC();
    }
}

KVT_KERNEL k_warp_exit(float *out)
{
    if (threadIdx.x == 7)
        return;
    out[threadIdx.x] = kvt_shfl_xor(1.0f, 1);
}

KVT_KERNEL k_warp_partial(float *out) { out[threadIdx.x] = kvt_shfl_xor(1.0f, 1); }

KVT_KERNEL k_cp_misaligned(const float *g)
{
    KVT_SHARED(float, s, 64);
    kvt_cp_async16(s + 4 * threadIdx.x, g + 1);
    kvt_cp_async_wait_all();
}

KVT_KERNEL k_big_static(float *out)
{
    KVT_SHARED(float, s, 13000); // 52000 bytes > 48 KiB
    s[threadIdx.x] = 1.0f;
    out[threadIdx.x] = s[threadIdx.x];
}

KVT_KERNEL k_sync_vs_warp(void)
{
    if (threadIdx.x < 48) // warp 1 is split between the barrier and a warp op
        KVT_SYNC();
    else
        kvt_syncwarp();
}

// ---- helpers ---------------------------------------------------------------------
template <class T> static T *dalloc(size_t n)
{
    void *p = nullptr;
    CU_OK(cudaMalloc(&p, n * sizeof(T)));
    return static_cast<T *>(p);
}

// Runs fn in a child; it must abort with `needle` on stderr.
static void expect_abort(void (*fn)(void), const char *needle)
{
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(pfd[1], 2);
        close(pfd[0]);
        fn();
        _exit(0);
    }
    close(pfd[1]);
    std::string err;
    char buf[4096];
    ssize_t n;
    while ((n = read(pfd[0], buf, sizeof buf)) > 0)
        err.append(buf, (size_t)n);
    close(pfd[0]);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    if (!WIFSIGNALED(st) || WTERMSIG(st) != SIGABRT || err.find(needle) == std::string::npos)
        fail_msg("expected an abort mentioning \"%s\"; status 0x%x, stderr:\n%s", needle, st,
                 err.c_str());
}

// ---- tests -------------------------------------------------------------------------
static void test_block_reduce_and_coords(void **state)
{
    (void)state;
    const dim3 grid(2, 3, 2), block(8, 4, 2); // 12 blocks of 64 threads
    const unsigned nb = 12, nt = 64;
    std::vector<float> h(nb * nt);
    for (unsigned i = 0; i < nb * nt; i++)
        h[i] = (float)((i * 7919u) % 1000u) * 0.25f; // exact sums in f32
    float *in = dalloc<float>(nb * nt), *out = dalloc<float>(nb);
    uint32_t *coords = dalloc<uint32_t>(6 * nb * nt);
    CU_OK(cudaMemcpy(in, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
    CU_OK(KVT_LAUNCH(k_reduce, grid, block, 0, nullptr, in, out, coords));
    std::vector<float> o(nb);
    std::vector<uint32_t> c(6 * nb * nt);
    CU_OK(cudaMemcpy(o.data(), out, nb * sizeof(float), cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(c.data(), coords, c.size() * 4, cudaMemcpyDeviceToHost));
    for (unsigned b = 0; b < nb; b++) {
        double want = 0;
        for (unsigned t = 0; t < nt; t++)
            want += h[b * nt + t];
        assert_true((double)o[b] == want);
        for (unsigned t = 0; t < nt; t++) {
            const uint32_t *e = &c[6 * (b * nt + t)];
            assert_int_equal(e[0], t % 8);
            assert_int_equal(e[1], (t / 8) % 4);
            assert_int_equal(e[2], t / 32);
            assert_int_equal(e[3], b % 2);
            assert_int_equal(e[4], (b / 2) % 3);
            assert_int_equal(e[5], b / 6);
        }
    }
    CU_OK(cudaFree(in));
    CU_OK(cudaFree(out));
    CU_OK(cudaFree(coords));
}

static void test_early_exit_barrier(void **state)
{
    (void)state;
    unsigned *out = dalloc<unsigned>(128);
    CU_OK(KVT_LAUNCH(k_early_exit, 1, 128, 0, nullptr, 50u, out));
    unsigned h[128];
    CU_OK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
    for (unsigned t = 0; t < 50; t++)
        assert_int_equal(h[t], 50 - t);
    assert_int_equal(h[50], 0xa5a5a5a5u); // untouched: cudaMalloc garbage
    CU_OK(cudaFree(out));
}

static void test_warp_ops(void **state)
{
    (void)state;
    const unsigned n = 128;
    std::vector<float> h(n);
    for (unsigned i = 0; i < n; i++)
        h[i] = (float)(i % 17) - 3.5f;
    float *in = dalloc<float>(n), *fsum = dalloc<float>(n);
    int *isum = dalloc<int>(n);
    uint32_t *bc = dalloc<uint32_t>(n), *bal = dalloc<uint32_t>(n);
    CU_OK(cudaMemcpy(in, h.data(), n * 4, cudaMemcpyHostToDevice));
    CU_OK(KVT_LAUNCH(k_warp, 2, n, 0, nullptr, in, fsum, isum, bc, bal));
    std::vector<float> fs(n);
    std::vector<int> is(n);
    std::vector<uint32_t> b(n), ba(n);
    CU_OK(cudaMemcpy(fs.data(), fsum, n * 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(is.data(), isum, n * 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(b.data(), bc, n * 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(ba.data(), bal, n * 4, cudaMemcpyDeviceToHost));
    for (unsigned t = 0; t < n; t++) {
        const unsigned w = t / 32, lane = t % 32;
        double fw = 0;
        int iw = 0;
        uint32_t bw = 0;
        for (unsigned l = 0; l < 32; l++) {
            fw += h[w * 32 + l];
            iw += (int)(w * 32 + l) - 40;
            bw |= (uint32_t)(l % 3 == 0 || w * 32 + l >= 96) << l;
        }
        assert_true((double)fs[t] == fw); // halves and small integers: exact
        assert_int_equal(is[t], iw);
        assert_int_equal(b[t], (w * 32 + 5) * 7u + ((w * 32 + (lane + 1) % 32) << 16));
        assert_int_equal(ba[t], bw);
    }
    CU_OK(cudaFree(in));
    CU_OK(cudaFree(fsum));
    CU_OK(cudaFree(isum));
    CU_OK(cudaFree(bc));
    CU_OK(cudaFree(bal));
}

static void test_warp_2d_and_wrap(void **state)
{
    (void)state;
    uint32_t *out = dalloc<uint32_t>(4 * 64);
    CU_OK(KVT_LAUNCH(k_warp2d, 1, dim3(16, 4), 0, nullptr, out));
    uint32_t h[4 * 64];
    CU_OK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
    for (uint32_t t = 0; t < 64; t++) {
        const uint32_t y = t / 16, w = t / 32, lane = t % 32;
        assert_int_equal(h[4 * t + 0], y ^ 1u);
        assert_int_equal(h[4 * t + 1], w * 32 + 3);
        assert_int_equal(h[4 * t + 2], w * 32 + (lane ^ 1u));
        assert_int_equal(h[4 * t + 3], w == 0 ? 0xfu << 16 : 0u);
    }
    CU_OK(cudaFree(out));
}

static void test_missing_barrier_shows(void **state)
{
    (void)state;
    uint32_t *out = dalloc<uint32_t>(2 * 64);
    CU_OK(KVT_LAUNCH(k_missing_sync, 2, 64, 0, nullptr, out));
    uint32_t h[2 * 64];
    CU_OK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
    unsigned stale = 0;
    for (unsigned i = 0; i < 2 * 64; i++) {
        assert_true(h[i] == 7 || h[i] == 0xffffffffu);
        stale += h[i] == 0xffffffffu;
    }
    assert_int_equal(stale, 63); // all but thread 0 of the block run in reverse
    CU_OK(cudaFree(out));
}

static void test_intrinsics(void **state)
{
    (void)state;
    assert_int_equal(__popc(0xf0f0u), 8);
    assert_int_equal(__popcll(~0ull), 64);
    assert_int_equal(__clz(0), 32);
    assert_int_equal(__clz(1), 31);
    assert_int_equal(__clz(-1), 0);
    assert_int_equal(__clzll(1), 63);
    assert_int_equal(__ffs(0), 0);
    assert_int_equal(__ffs(0x50), 5);
    assert_int_equal(__ffsll(1ll << 40), 41);
    assert_int_equal(__brev(1u), 0x80000000u);
    assert_int_equal(__brev(0x12345678u), 0x1e6a2c48u);
    assert_int_equal(__float_as_uint(1.0f), 0x3f800000u);
    assert_true(__uint_as_float(0xbf800000u) == -1.0f);
    assert_int_equal(__float_as_int(-0.0f), (int)0x80000000u);
    assert_true(__int_as_float(0x40000000) == 2.0f);
    assert_true(__expf(0.0f) == 1.0f);
    assert_true(__logf(1.0f) == 0.0f);
    assert_true(__fdividef(1.0f, 4.0f) == 0.25f);
    const int v = 42;
    assert_int_equal(__ldg(&v), 42);
    __threadfence();
    int x = 5;
    assert_int_equal(atomicExch(&x, 9), 5);
    assert_int_equal(atomicCAS(&x, 8, 1), 9);
    assert_int_equal(atomicCAS(&x, 9, 1), 9);
    assert_int_equal(x, 1);
    float fx = 1.5f;
    assert_true(atomicExch(&fx, 2.5f) == 1.5f);
    assert_true(atomicAdd(&fx, 0.25f) == 2.5f && fx == 2.75f);
    int neg = 0x7fffffff;
    assert_int_equal(atomicAdd(&neg, 1), 0x7fffffff); // wraps like the GPU, no UB
    assert_int_equal(neg, (int)0x80000000u);
}

static void test_dyn_shared_limit(void **state)
{
    (void)state;
    uint32_t *out = dalloc<uint32_t>(2);
    const uint32_t words = 16384; // 64 KiB
    (void)cudaGetLastError();
    assert_int_equal(KVT_LAUNCH(k_dyn, 1, 256, words * 4, nullptr, words, out), cudaErrorInvalidValue);
    assert_int_equal(cudaPeekAtLastError(), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaSuccess);
    // 48 KiB works without opting in
    CU_OK(cudaMemset(out, 0, 8));
    CU_OK(KVT_LAUNCH(k_dyn, 1, 256, 12288 * 4, nullptr, 12288u, out));
    assert_int_equal(KVT_SET_MAX_DYN_SHARED(k_dyn, 232448 + 1), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    CU_OK(KVT_SET_MAX_DYN_SHARED(k_dyn, words * 4));
    CU_OK(cudaMemset(out, 0, 8));
    CU_OK(KVT_LAUNCH(k_dyn, 2, 256, words * 4, nullptr, words, out));
    uint32_t h[2];
    CU_OK(cudaMemcpy(h, out, 8, cudaMemcpyDeviceToHost));
    assert_int_equal(h[0], 0xffffffffu); // unwritten shared memory reads as 0xff bytes
    uint32_t want = 0;
    for (uint32_t i = 0; i < words; i++)
        want += i * 3u;
    assert_int_equal(h[1], 2 * want);
    // above the raised limit: refused again
    assert_int_equal(KVT_LAUNCH(k_dyn, 1, 256, words * 4 + 16, nullptr, words, out),
                     cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    CU_OK(cudaFree(out));
}

static void test_bad_config(void **state)
{
    (void)state;
    (void)cudaGetLastError();
    const struct {
        dim3 g, b;
    } bad[] = {
        {dim3(1), dim3(0)},          {dim3(0), dim3(32)},         {dim3(1), dim3(1025)},
        {dim3(1), dim3(32, 33)},     {dim3(1), dim3(1, 1, 65)},   {dim3(1, 65536), dim3(32)},
        {dim3(1, 1, 65536), dim3(32)}, {dim3(0x80000000u), dim3(32)}, {dim3(1), dim3(2048, 1)},
    };
    for (const auto &c : bad) {
        assert_int_equal(KVT_LAUNCH(k_nop, c.g, c.b, 0, nullptr), cudaErrorInvalidConfiguration);
        assert_int_equal(cudaGetLastError(), cudaErrorInvalidConfiguration);
    }
    // the last error stays until read, through successful calls
    assert_int_equal(KVT_LAUNCH(k_nop, 1, 0, 0, nullptr), cudaErrorInvalidConfiguration);
    CU_OK(KVT_LAUNCH(k_nop, 1, 1024, 0, nullptr));
    CU_OK(cudaDeviceSynchronize());
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidConfiguration);
    assert_int_equal(cudaGetLastError(), cudaSuccess);
    // limits themselves are fine
    CU_OK(KVT_LAUNCH(k_nop, dim3(3, 65535, 1), dim3(1), 0, nullptr));
    CU_OK(KVT_LAUNCH(k_nop, dim3(1), dim3(1, 1, 64), 0, nullptr));
    // an unknown stream
    int junk = 0;
    assert_int_equal(KVT_LAUNCH(k_nop, 1, 32, 0, &junk), cudaErrorInvalidResourceHandle);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidResourceHandle);
    assert_string_equal(cudaGetErrorName(cudaErrorInvalidConfiguration),
                        "cudaErrorInvalidConfiguration");
    assert_string_equal(cudaGetErrorString(cudaErrorInvalidConfiguration),
                        "invalid configuration argument");
    assert_string_equal(cudaGetErrorName(cudaErrorInvalidValue), "cudaErrorInvalidValue");
    assert_string_equal(cudaGetErrorString(cudaSuccess), "no error");
}

static void test_atomics_many_blocks(void **state)
{
    (void)state;
    const unsigned nb = 40, nt = 96, n = nb * nt;
    unsigned *u = dalloc<unsigned>(1), *mn = dalloc<unsigned>(1), *ex = dalloc<unsigned>(1);
    int *i = dalloc<int>(1), *mx = dalloc<int>(1), *cas = dalloc<int>(1);
    unsigned long long *ull = dalloc<unsigned long long>(1);
    float *f = dalloc<float>(1);
    const int mx0 = -100000;
    const unsigned mn0 = 0xffffffffu;
    CU_OK(cudaMemset(u, 0, 4));
    CU_OK(cudaMemset(i, 0, 4));
    CU_OK(cudaMemset(cas, 0, 4));
    CU_OK(cudaMemset(ull, 0, 8));
    CU_OK(cudaMemset(f, 0, 4));
    CU_OK(cudaMemcpy(mx, &mx0, 4, cudaMemcpyHostToDevice));
    CU_OK(cudaMemcpy(mn, &mn0, 4, cudaMemcpyHostToDevice));
    CU_OK(KVT_LAUNCH(k_atomics, nb, nt, 0, nullptr, u, i, ull, f, mx, mn, cas, ex));
    unsigned hu, hmn, hex;
    int hi, hmx, hcas;
    unsigned long long hull;
    float hf;
    CU_OK(cudaMemcpy(&hu, u, 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(&hmn, mn, 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(&hex, ex, 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(&hi, i, 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(&hmx, mx, 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(&hcas, cas, 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(&hull, ull, 8, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(&hf, f, 4, cudaMemcpyDeviceToHost));
    assert_int_equal(hu, n);
    assert_int_equal(hi, (int)(n / 2) * 3 - (int)(n / 2));
    assert_true(hull == (unsigned long long)n << 33);
    assert_true(hf == (float)n);
    int want_mx = mx0;
    for (unsigned g = 0; g < n; g++)
        want_mx = (int)(g * 37u % 1000u) - 500 > want_mx ? (int)(g * 37u % 1000u) - 500 : want_mx;
    assert_int_equal(hmx, want_mx);
    assert_int_equal(hmn, 100000u - (n - 1));
    assert_int_equal(hcas, 2 * (int)n);
    assert_true(hex < n);
    void *ptrs[] = {u, mn, ex, i, mx, cas, ull, f};
    for (void *p : ptrs)
        CU_OK(cudaFree(p));
}

static void test_block_order_scrambled(void **state)
{
    (void)state;
    for (unsigned nb : {2u, 3u, 7u, 16u, 100u}) {
        unsigned *ticket = dalloc<unsigned>(1), *order = dalloc<unsigned>(nb);
        std::vector<unsigned> first(nb), second(nb);
        for (int rep = 0; rep < 2; rep++) {
            CU_OK(cudaMemset(ticket, 0, 4));
            CU_OK(KVT_LAUNCH(k_order, nb, 32, 0, nullptr, ticket, order));
            CU_OK(cudaMemcpy(rep ? second.data() : first.data(), order, nb * 4,
                             cudaMemcpyDeviceToHost));
        }
        std::vector<int> seen(nb, 0);
        bool identity = true;
        for (unsigned s = 0; s < nb; s++) {
            assert_true(first[s] < nb);
            seen[first[s]]++;
            identity = identity && first[s] == s;
            assert_int_equal(first[s], second[s]); // deterministic
        }
        for (unsigned b = 0; b < nb; b++)
            assert_int_equal(seen[b], 1); // every block once
        assert_false(identity);
        CU_OK(cudaFree(ticket));
        CU_OK(cudaFree(order));
    }
}

static void test_cp_async(void **state)
{
    (void)state;
    const unsigned n16 = 64; // 256 floats
    std::vector<float> h(4 * n16);
    for (unsigned i = 0; i < h.size(); i++)
        h[i] = (float)i + 0.5f;
    float *g = dalloc<float>(4 * n16), *out = dalloc<float>(4 * n16), *snap = dalloc<float>(4 * n16);
    CU_OK(cudaMemcpy(g, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    CU_OK(KVT_LAUNCH(k_cp_async, 1, 64, 0, nullptr, g, out, snap, n16));
    std::vector<float> o(4 * n16), s(4 * n16);
    CU_OK(cudaMemcpy(o.data(), out, o.size() * 4, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(s.data(), snap, s.size() * 4, cudaMemcpyDeviceToHost));
    for (unsigned i = 0; i < 4 * n16; i++)
        assert_true(o[i] == h[4 * n16 - 1 - i]);
    // after wait_groups<1>: the first group landed, the second not yet (the
    // emulator defers copies to the wait; shared memory starts as 0xff = NaN)
    for (unsigned i = 0; i < 2 * n16; i++)
        assert_true(s[i] == h[i]);
    for (unsigned i = 2 * n16; i < 4 * n16; i++)
        assert_true(isnan(s[i]));
    CU_OK(cudaFree(g));
    CU_OK(cudaFree(out));
    CU_OK(cudaFree(snap));
}

static void test_shared_one_array_per_site(void **state)
{
    (void)state;
    unsigned *out = dalloc<unsigned>(64);
    CU_OK(KVT_LAUNCH(k_shared_loop, 3, 64, 0, nullptr, out));
    unsigned h[64];
    CU_OK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
    for (unsigned t = 0; t < 64; t++)
        assert_int_equal(h[t], 63 - t + 200);
    CU_OK(cudaFree(out));
}

static void test_big_blocks_reuse_stacks(void **state)
{
    (void)state;
    // 1024 threads, twice, then a small block: fibers and stacks are reused
    unsigned *out = dalloc<unsigned>(128);
    for (int rep = 0; rep < 2; rep++)
        CU_OK(KVT_LAUNCH(k_nop, 2, 1024, 0, nullptr));
    CU_OK(KVT_LAUNCH(k_early_exit, 1, 128, 0, nullptr, 128u, out));
    unsigned h[128];
    CU_OK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
    for (unsigned t = 0; t < 128; t++)
        assert_int_equal(h[t], 128 - t);
    CU_OK(cudaFree(out));
}

static void test_memory_api(void **state)
{
    (void)state;
    (void)cudaGetLastError();
    void *d = nullptr, *d2 = nullptr;
    CU_OK(cudaMalloc(&d, 1000));
    assert_int_equal((uintptr_t)d % 256, 0);
    unsigned char h[1000];
    CU_OK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    for (unsigned i = 0; i < sizeof h; i++)
        assert_int_equal(h[i], 0xa5);
    CU_OK(cudaMemset(d, 7, 1000));
    CU_OK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDefault));
    assert_int_equal(h[999], 7);
    // ranges beyond the allocation, unknown device pointers, bad kinds
    assert_int_equal(cudaMemcpy(h, (char *)d + 1, 1000, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    assert_int_equal(cudaMemcpy((char *)d + 500, h, 501, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    assert_int_equal(cudaMemcpy(h, h + 10, 10, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    assert_int_equal(cudaMemcpy(d, h, 10, (cudaMemcpyKind)17), cudaErrorInvalidMemcpyDirection);
    assert_int_equal(cudaMemset((char *)d + 10, 0, 991), cudaErrorInvalidValue);
    assert_int_equal(cudaMemset(h, 0, 10), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    CU_OK(cudaMemcpy(h, h + 10, 10, cudaMemcpyHostToHost));
    CU_OK(cudaMemcpy(h, h + 10, 10, cudaMemcpyDefault));
    CU_OK(cudaMemcpyAsync((char *)d + 10, h, 990, cudaMemcpyHostToDevice, nullptr));
    CU_OK(cudaMemsetAsync(d, 1, 1000, nullptr));
    // frees
    assert_int_equal(cudaFree(h), cudaErrorInvalidValue);
    assert_int_equal(cudaFree((char *)d + 256), cudaErrorInvalidValue);
    CU_OK(cudaFree(nullptr));
    CU_OK(cudaMalloc(&d2, 0));
    assert_null(d2);
    // pinned host memory: the device pointer is the same address
    void *ph = nullptr, *pd = nullptr;
    CU_OK(cudaHostAlloc(&ph, 4096, cudaHostAllocMapped | cudaHostAllocPortable));
    CU_OK(cudaHostGetDevicePointer(&pd, ph, 0));
    assert_ptr_equal(ph, pd);
    CU_OK(cudaHostGetDevicePointer(&pd, (char *)ph + 100, 0));
    assert_ptr_equal((char *)ph + 100, pd);
    assert_int_equal(cudaHostGetDevicePointer(&pd, d, 0), cudaErrorInvalidValue);
    assert_int_equal(cudaHostAlloc(&pd, 16, 0x100), cudaErrorInvalidValue);
    CU_OK(cudaMemcpy(d, ph, 1000, cudaMemcpyDefault));
    assert_int_equal(cudaFree(ph), cudaErrorInvalidValue);
    assert_int_equal(cudaFreeHost(d), cudaErrorInvalidValue);
    CU_OK(cudaFreeHost(ph));
    assert_int_equal(cudaFreeHost(ph), cudaErrorInvalidValue); // double free
    void *mh = nullptr;
    CU_OK(cudaMallocHost(&mh, 64));
    CU_OK(cudaFreeHost(mh));
    CU_OK(cudaFree(d));
    assert_int_equal(cudaFree(d), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaSuccess);
}

// cudaHostRegister / cudaHostUnregister and what kernels may reach
// (kvt_emu_gpu_visible): device, pinned and registered memory, whole
// ranges only; plus the count of device synchronisations.
static void test_registered_memory(void **state)
{
    (void)state;
    (void)cudaGetLastError();
    std::vector<unsigned char> buf(8192), other(64);
    void *d = nullptr, *ph = nullptr;
    CU_OK(cudaMalloc(&d, 100));
    CU_OK(cudaHostAlloc(&ph, 100, cudaHostAllocMapped));
    assert_true(kvt_emu_gpu_visible(d, 100));
    assert_false(kvt_emu_gpu_visible(d, 101));
    assert_true(kvt_emu_gpu_visible((char *)ph + 99, 1));
    assert_true(kvt_emu_gpu_visible(other.data(), 0));
    assert_false(kvt_emu_gpu_visible(other.data(), 1)); // pageable
    unsigned char *b = buf.data();
    assert_false(kvt_emu_gpu_visible(b + 1000, 8));
    CU_OK(cudaHostRegister(b + 1000, 4096, cudaHostRegisterMapped | cudaHostRegisterPortable));
    assert_true(kvt_emu_gpu_visible(b + 1000, 4096));
    assert_true(kvt_emu_gpu_visible(b + 3000, 2096));
    assert_false(kvt_emu_gpu_visible(b + 3000, 2097)); // runs past the range
    assert_false(kvt_emu_gpu_visible(b + 999, 2));
    void *dp = nullptr;
    CU_OK(cudaHostGetDevicePointer(&dp, b + 1200, 0));
    assert_ptr_equal(dp, b + 1200);
    // overlapping ranges (inside, straddling either end), bad arguments
    assert_int_equal(cudaHostRegister(b + 2000, 16, 0), cudaErrorHostMemoryAlreadyRegistered);
    assert_int_equal(cudaHostRegister(b + 900, 200, 0), cudaErrorHostMemoryAlreadyRegistered);
    assert_int_equal(cudaHostRegister(b + 5000, 200, 0), cudaErrorHostMemoryAlreadyRegistered);
    assert_int_equal(cudaHostRegister(ph, 16, 0), cudaErrorHostMemoryAlreadyRegistered);
    assert_int_equal(cudaHostRegister(b, 0, 0), cudaErrorInvalidValue);
    assert_int_equal(cudaHostRegister(nullptr, 16, 0), cudaErrorInvalidValue);
    assert_int_equal(cudaHostRegister(b, 16, 0x1000), cudaErrorInvalidValue);
    CU_OK(cudaHostRegister(b, 1000, 0)); // adjacent, not overlapping
    // unregister: exactly the registered start, once
    assert_int_equal(cudaHostUnregister(b + 1001), cudaErrorHostMemoryNotRegistered);
    assert_int_equal(cudaHostUnregister(ph), cudaErrorHostMemoryNotRegistered);
    CU_OK(cudaHostUnregister(b + 1000));
    assert_false(kvt_emu_gpu_visible(b + 1000, 1));
    assert_int_equal(cudaHostUnregister(b + 1000), cudaErrorHostMemoryNotRegistered);
    CU_OK(cudaHostUnregister(b));
    (void)cudaGetLastError();
    // device synchronisations are counted
    const uint64_t n0 = kvt_emu_device_syncs();
    CU_OK(cudaDeviceSynchronize());
    CU_OK(cudaDeviceSynchronize());
    assert_true(kvt_emu_device_syncs() == n0 + 2);
    CU_OK(cudaFreeHost(ph));
    CU_OK(cudaFree(d));
}

// Deferred stream work: a launch runs when something waits for it, with
// its arguments as they were at the launch; event waits order streams; a
// copy with pageable memory is done when it returns; destroying a stream,
// freeing memory and device synchronisation run what is queued.
static void test_deferred_streams(void **state)
{
    (void)state;
    (void)cudaGetLastError();
    enum { N = 64 };
    int *a = nullptr, *b = nullptr, *pin = nullptr;
    CU_OK(cudaMalloc((void **)&a, N * sizeof(int)));
    CU_OK(cudaMalloc((void **)&b, N * sizeof(int)));
    CU_OK(cudaHostAlloc((void **)&pin, N * sizeof(int), cudaHostAllocMapped));
    cudaStream_t s1, s2;
    CU_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CU_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    for (int i = 0; i < N; i++)
        pin[i] = i;
    // queued, not run: the destination keeps its fill until a wait
    CU_OK(cudaMemcpyAsync(a, pin, N * sizeof(int), cudaMemcpyHostToDevice, s1));
    int add = 5;
    const int *padd = &add;
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s1, a, b, *padd, (unsigned)N));
    add = 1000; // the launch evaluated its arguments already
    assert_int_equal((unsigned)a[0], 0xa5a5a5a5u);
    pin[3] = -7; // a pinned source rewritten before the copy ran: read new
    // s2 waits for s1's work so far, then doubles b's entries into a
    cudaEvent_t ev;
    CU_OK(cudaEventCreate(&ev));
    CU_OK(cudaEventRecord(ev, s1));
    CU_OK(cudaStreamWaitEvent(s2, ev, 0));
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s2, b, a, 100, (unsigned)N));
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s1, a, a, 1, (unsigned)N)); // after the record: not waited for
    CU_OK(cudaStreamSynchronize(s2)); // runs s1 up to the record, then s2
    for (int i = 0; i < N; i++)
        assert_int_equal(a[i], (i == 3 ? -7 : i) + 5 + 100);
    CU_OK(cudaEventSynchronize(ev));
    CU_OK(cudaStreamSynchronize(s1)); // the last launch
    assert_int_equal(a[0], 106);
    // a copy with pageable memory: done at return, after the stream's work
    std::vector<int> page(N, 0);
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s1, a, b, 1, (unsigned)N));
    CU_OK(cudaMemcpyAsync(page.data(), b, N * sizeof(int), cudaMemcpyDeviceToHost, s1));
    assert_int_equal(page[0], 107);
    // a re-recorded event: a wait takes the record as it is at the wait
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s1, a, b, 10, (unsigned)N)); // b = 116
    CU_OK(cudaEventRecord(ev, s1));
    CU_OK(cudaMemsetAsync(b, 0, N * sizeof(int), s1)); // after the record: not waited for
    CU_OK(cudaStreamWaitEvent(s2, ev, 0));
    CU_OK(cudaEventRecord(ev, s1)); // later than the wait: not waited for
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s2, b, pin, 0, (unsigned)N));
    CU_OK(cudaStreamSynchronize(s2));
    assert_int_equal(pin[0], 116);
    CU_OK(cudaStreamSynchronize(s1));
    assert_int_equal(b[0], 0); // the set ran
    // destroy lets the queued work complete; free and device
    // synchronisation run what is queued
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s2, a, b, 2, (unsigned)N));
    CU_OK(cudaStreamDestroy(s2));
    CU_OK(cudaDeviceSynchronize());
    assert_int_equal(b[0], 108);
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s1, a, b, 3, (unsigned)N));
    CU_OK(cudaDeviceSynchronize());
    assert_int_equal(b[0], 109);
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s1, a, pin, 4, (unsigned)N));
    assert_int_equal(pin[0], 116); // queued, not run
    CU_OK(cudaFree(b));
    assert_int_equal(pin[0], 110);
    // a wait on an event never recorded waits for nothing
    cudaEvent_t never;
    CU_OK(cudaEventCreate(&never));
    CU_OK(cudaStreamWaitEvent(s1, never, 0));
    CU_OK(KVT_LAUNCH(k_add, 1, 32, 0, s1, a, pin, 1, (unsigned)N));
    CU_OK(cudaStreamSynchronize(s1));
    assert_int_equal(pin[0], 107);
    CU_OK(cudaEventDestroy(never));
    CU_OK(cudaEventDestroy(ev));
    CU_OK(cudaStreamDestroy(s1));
    CU_OK(cudaFreeHost(pin));
    CU_OK(cudaFree(a));
}

static void test_streams_events_device(void **state)
{
    (void)state;
    (void)cudaGetLastError();
    int n = 0, v = 0, lo = 1, hi = 1;
    CU_OK(cudaGetDeviceCount(&n));
    assert_int_equal(n, 1);
    CU_OK(cudaGetDevice(&v));
    assert_int_equal(v, 0);
    CU_OK(cudaSetDevice(0));
    assert_int_equal(cudaSetDevice(1), cudaErrorInvalidDevice);
    CU_OK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0));
    assert_int_equal(v, 8);
    CU_OK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    assert_int_equal(v, 232448);
    CU_OK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlock, 0));
    assert_int_equal(v, 49152);
    CU_OK(cudaDeviceGetAttribute(&v, cudaDevAttrWarpSize, 0));
    assert_int_equal(v, 32);
    CU_OK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxThreadsPerBlock, 0));
    assert_int_equal(v, 1024);
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrTccDriver, 0), cudaErrorInvalidValue);
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrWarpSize, 1), cudaErrorInvalidDevice);

    CU_OK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    assert_true(hi <= lo);
    cudaStream_t s1, s2, s3;
    CU_OK(cudaStreamCreate(&s1));
    CU_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    CU_OK(cudaStreamCreateWithPriority(&s3, cudaStreamNonBlocking, hi));
    assert_int_equal(cudaStreamCreateWithFlags(&s1, 0x40), cudaErrorInvalidValue);
    cudaEvent_t e1, e2, e3;
    CU_OK(cudaEventCreate(&e1));
    CU_OK(cudaEventCreateWithFlags(&e2, cudaEventDisableTiming));
    CU_OK(cudaEventCreate(&e3));
    CU_OK(cudaEventQuery(e1)); // never recorded: complete
    float ms = -1;
    assert_int_equal(cudaEventElapsedTime(&ms, e1, e3), cudaErrorInvalidResourceHandle);
    CU_OK(cudaEventRecord(e1, s1));
    CU_OK(cudaEventRecord(e3, s1));
    CU_OK(cudaEventRecord(e2, s2));
    CU_OK(cudaEventElapsedTime(&ms, e1, e3));
    assert_true(ms == 0.0f);
    assert_int_equal(cudaEventElapsedTime(&ms, e1, e2), cudaErrorInvalidResourceHandle);
    CU_OK(cudaStreamWaitEvent(s3, e2, 0));
    CU_OK(cudaEventQuery(e2));
    CU_OK(cudaEventSynchronize(e2));
    CU_OK(cudaStreamQuery(s3));
    CU_OK(cudaStreamSynchronize(s3));
    CU_OK(cudaStreamSynchronize(nullptr));
    CU_OK(KVT_LAUNCH(k_nop, 1, 32, 0, s3));
    assert_int_equal(cudaStreamWaitEvent(s3, (cudaEvent_t)s1, 0), cudaErrorInvalidResourceHandle);
    assert_int_equal(cudaEventRecord((cudaEvent_t)s1, s1), cudaErrorInvalidResourceHandle);
    CU_OK(cudaEventDestroy(e1));
    CU_OK(cudaEventDestroy(e2));
    CU_OK(cudaEventDestroy(e3));
    assert_int_equal(cudaEventDestroy(e3), cudaErrorInvalidResourceHandle);
    CU_OK(cudaStreamDestroy(s1));
    CU_OK(cudaStreamDestroy(s2));
    CU_OK(cudaStreamDestroy(s3));
    assert_int_equal(cudaStreamDestroy(s3), cudaErrorInvalidResourceHandle);
    assert_int_equal(cudaStreamSynchronize(s3), cudaErrorInvalidResourceHandle);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidResourceHandle);
    CU_OK(cudaGetLastError());
}

// ---- aborts on kernel bugs (forked children) --------------------------------------
static void run_divergent_sync(void) { (void)KVT_LAUNCH(k_divergent_sync, 1, 64, 0, nullptr); }
static void run_warp_exit(void)
{
    float *o = nullptr;
    (void)cudaMalloc((void **)&o, 64 * 4);
    (void)KVT_LAUNCH(k_warp_exit, 1, 64, 0, nullptr, o);
}
static void run_warp_partial(void)
{
    float *o = nullptr;
    (void)cudaMalloc((void **)&o, 48 * 4);
    (void)KVT_LAUNCH(k_warp_partial, 1, 48, 0, nullptr, o);
}
static void run_cp_misaligned(void)
{
    float *g = nullptr;
    (void)cudaMalloc((void **)&g, 1024);
    (void)KVT_LAUNCH(k_cp_misaligned, 1, 16, 0, nullptr, g);
}
static void run_big_static(void)
{
    float *o = nullptr;
    (void)cudaMalloc((void **)&o, 1024);
    (void)KVT_LAUNCH(k_big_static, 1, 32, 0, nullptr, o);
}
static void run_sync_vs_warp(void) { (void)KVT_LAUNCH(k_sync_vs_warp, 1, 64, 0, nullptr); }
static void run_outside(void) { (void)kvt_shfl_xor(1.0f, 1); }
static void run_thread_idx_outside(void) { printf("%u\n", threadIdx.x); }

static void test_aborts_on_kernel_bugs(void **state)
{
    (void)state;
    expect_abort(run_divergent_sync, "divergent KVT_SYNC in kernel 'k_divergent_sync' block (0,0,0)");
    expect_abort(run_warp_exit, "deadlock in kernel 'k_warp_exit'");
    expect_abort(run_warp_exit, "thread 7: exited");
    expect_abort(run_warp_partial, "not a multiple of 32");
    expect_abort(run_cp_misaligned, "kvt_cp_async16 in kernel 'k_cp_misaligned' block (0,0,0) "
                                    "thread (0,0,0): global address");
    expect_abort(run_big_static, "exceed 48 KiB");
    expect_abort(run_sync_vs_warp, "deadlock in kernel 'k_sync_vs_warp'");
    expect_abort(run_outside, "kvt_shfl_xor called outside a kernel");
    expect_abort(run_thread_idx_outside, "used outside a kernel");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_block_reduce_and_coords),
        cmocka_unit_test(test_early_exit_barrier),
        cmocka_unit_test(test_warp_ops),
        cmocka_unit_test(test_warp_2d_and_wrap),
        cmocka_unit_test(test_missing_barrier_shows),
        cmocka_unit_test(test_intrinsics),
        cmocka_unit_test(test_dyn_shared_limit),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_atomics_many_blocks),
        cmocka_unit_test(test_block_order_scrambled),
        cmocka_unit_test(test_cp_async),
        cmocka_unit_test(test_shared_one_array_per_site),
        cmocka_unit_test(test_big_blocks_reuse_stacks),
        cmocka_unit_test(test_memory_api),
        cmocka_unit_test(test_registered_memory),
        cmocka_unit_test(test_deferred_streams),
        cmocka_unit_test(test_streams_events_device),
        cmocka_unit_test(test_aborts_on_kernel_bugs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
