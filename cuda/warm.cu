// kvt_seq_warmup's page importance on the GPU: many queries (the prompt's
// last n_obs tokens x the G query heads of a group) against every page's
// landmarks, a true matrix product, so it goes to cuBLAS.
//
// Per call, for the n_heads heads of one layer:
//  1. a gather kernel converts each page's landmark rows from the metadata
//     store into an f32 matrix Lm[h][page][W]: [kmax | kmin] (W = 2D) for
//     MINMAX, kmean (W = D) for MEAN;
//  2. S[h][row][page] = Q[h][row] . Lm[h][page] for the R = n_obs * G
//     prepared query rows ([qa | qb] or q, built by the caller): one
//     strided batched SGEMM, cuBLAS's when a handle is given, else the
//     tiled kernel below (the fallback where libcublas cannot be loaded);
//  3. SOFTVOTE only: per (head, row) the maximum and the sum of exp over the
//     pages (one block per row);
//  4. the vote kernel: per (head, page), query by query in order, the vote
//     of lib/select/selector.c over the G rows of the query (NaN -> +inf),
//     added to d_imp - the CPU's order, so importance is the CPU's up to the
//     rounding of the products' sums.
// cuBLAS is not linked: it is loaded with dlopen at the first handle, so
// libkvtier.so loads (and the rest of the backend works) where the toolkit
// libraries are missing.
#include "kvt_cuda_rt.cuh"
#include "kvtier/selector.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef KVT_CUDA_EMU
#include <cublas_api.h>
#include <dlfcn.h>
#endif

namespace {

constexpr uint32_t KVT_WM_TILE = 16;      // fallback GEMM: 16 x 16 outputs a block
constexpr uint32_t KVT_WM_THREADS = 256;  // gather, stats, vote

uint32_t kvt_wm_width(const kvt__cu_warm_args *a)
{
    return a->method == KVT_SCORE_MINMAX ? 2u * a->D : a->D;
}

// Lm[h][page][c]: MINMAX c < D kmax, c >= D kmin (plane 1 of the store:
// the slot's min row, its max row right after); MEAN kmean (plane 2, after
// all meta_slots slots' min and max rows). Grid (pages / threads, heads).
KVT_KERNEL __launch_bounds__(KVT_WM_THREADS) kvt_wm_gather(const kvt__cu_warm_args a, float *lm)
{
    const uint32_t W = a.method == KVT_SCORE_MINMAX ? 2u * a.D : a.D;
    const uint64_t n = (uint64_t)a.n_pages * W;
    const uint64_t base = (uint64_t)blockIdx.y * n;
    const uint64_t row = (uint64_t)a.D * kvt_dtype_bytes(a.dtype);
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        const uint32_t page = (uint32_t)(i / W), c = (uint32_t)(i % W);
        const uint64_t slot = a.d_slots[(uint64_t)blockIdx.y * a.n_pages + page];
        float x;
        if (a.method == KVT_SCORE_MINMAX) {
            const uint8_t *mm = a.d_meta_base + slot * 2u * row;
            x = c < a.D ? kvt_load(mm + row, c, a.dtype) : kvt_load(mm, c - a.D, a.dtype);
        } else {
            const uint8_t *mean = a.d_meta_base + (uint64_t)a.meta_slots * 2u * row + slot * row;
            x = kvt_load(mean, c, a.dtype);
        }
        lm[base + i] = x;
    }
}

// The fallback SGEMM: S[h][r][j] = sum_c Q[h][r][c] * Lm[h][j][c]. Grid
// (pages / 16, rows / 16, heads), block 16 x 16, K in tiles of 16.
KVT_KERNEL __launch_bounds__(KVT_WM_TILE *KVT_WM_TILE)
    kvt_wm_gemm(const float *q, const float *lm, float *s, uint32_t R, uint32_t np, uint32_t W)
{
    KVT_SHARED(float, tq, KVT_WM_TILE * (KVT_WM_TILE + 1));
    KVT_SHARED(float, tl, KVT_WM_TILE * (KVT_WM_TILE + 1));
    const uint32_t tx = threadIdx.x, ty = threadIdx.y;
    const uint32_t r = blockIdx.y * KVT_WM_TILE + ty, j = blockIdx.x * KVT_WM_TILE + tx;
    const float *qh = q + (uint64_t)blockIdx.z * R * W;
    const float *lh = lm + (uint64_t)blockIdx.z * np * W;
    float acc = 0.0f;
    for (uint32_t c0 = 0; c0 < W; c0 += KVT_WM_TILE) {
        // tq[ty][tx] = Q[r][c0 + tx]; tl[ty][tx] = Lm[page j0 + ty][c0 + tx].
        const uint32_t rq = blockIdx.y * KVT_WM_TILE + ty, jl = blockIdx.x * KVT_WM_TILE + ty;
        const uint32_t c = c0 + tx;
        tq[ty * (KVT_WM_TILE + 1) + tx] = rq < R && c < W ? qh[(uint64_t)rq * W + c] : 0.0f;
        tl[ty * (KVT_WM_TILE + 1) + tx] = jl < np && c < W ? lh[(uint64_t)jl * W + c] : 0.0f;
        KVT_SYNC();
        for (uint32_t e = 0; e < KVT_WM_TILE; e++)
            acc = fmaf(tq[ty * (KVT_WM_TILE + 1) + e], tl[tx * (KVT_WM_TILE + 1) + e], acc);
        KVT_SYNC();
    }
    if (r < R && j < np)
        s[((uint64_t)blockIdx.z * R + r) * np + j] = acc;
}

// SOFTVOTE statistics of one (head, row): st[3 * x + {0,1,2}] = maximum of
// scale * S, 1 / sum of exp(scale * S - max), and 1 when the row is special
// (a NaN or +inf score, or every score -inf: the CPU's rule). Grid: rows.
KVT_KERNEL __launch_bounds__(KVT_WM_THREADS) kvt_wm_stats(const kvt__cu_warm_args a, const float *s,
                                                          float *st)
{
    KVT_SHARED(float, red, KVT_WM_THREADS);
    KVT_SHARED(uint32_t, redf, KVT_WM_THREADS);
    const uint32_t np = a.n_pages;
    const float *row = s + (uint64_t)blockIdx.x * np;
    float m = -INFINITY;
    uint32_t f = 0;
    for (uint32_t j = threadIdx.x; j < np; j += blockDim.x) {
        const float r = kvt_mul_rn(row[j], a.vote_scale);
        f |= r != r ? 1u : 0u;
        m = r > m ? r : m;
    }
    red[threadIdx.x] = m;
    redf[threadIdx.x] = f;
    KVT_SYNC();
    for (uint32_t w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) {
            const float o = red[threadIdx.x + w];
            red[threadIdx.x] = o > red[threadIdx.x] ? o : red[threadIdx.x];
            redf[threadIdx.x] |= redf[threadIdx.x + w];
        }
        KVT_SYNC();
    }
    const float M = red[0];
    const bool special = redf[0] != 0 || isinf(M);
    KVT_SYNC();
    float sum = 0.0f;
    if (!special)
        for (uint32_t j = threadIdx.x; j < np; j += blockDim.x)
            sum += expf(kvt_mul_rn(row[j], a.vote_scale) - M);
    red[threadIdx.x] = sum;
    KVT_SYNC();
    for (uint32_t w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w)
            red[threadIdx.x] += red[threadIdx.x + w];
        KVT_SYNC();
    }
    if (threadIdx.x == 0) {
        st[3u * blockIdx.x] = M;
        st[3u * blockIdx.x + 1] = special ? 0.0f : 1.0f / red[0];
        st[3u * blockIdx.x + 2] = special ? 1.0f : 0.0f;
    }
}

// imp[h][j] += vote of query o over its G rows, for o = 0 .. n_obs - 1 in
// order. Grid (pages / threads, heads).
KVT_KERNEL __launch_bounds__(KVT_WM_THREADS) kvt_wm_vote(const kvt__cu_warm_args a, const float *s,
                                                         const float *st)
{
    const uint32_t np = a.n_pages, G = a.G, R = a.n_obs * a.G;
    const uint32_t j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= np)
        return;
    const uint64_t hb = (uint64_t)blockIdx.y * R;
    float imp = a.d_imp[(uint64_t)blockIdx.y * np + j];
    for (uint32_t o = 0; o < a.n_obs; o++) {
        float v = 0.0f;
        for (uint32_t g = 0; g < G; g++) {
            const uint64_t x = hb + (uint64_t)o * G + g;
            const float r = s[x * np + j];
            if (a.vote == KVT_VOTE_SUM) {
                v = g == 0 ? r : kvt_add_rn(v, r);
            } else if (a.vote == KVT_VOTE_MAX) {
                v = g == 0 || r > v || r != r ? r : v;
            } else {
                const float rs = kvt_mul_rn(r, a.vote_scale);
                const float c = st[3u * x + 2] != 0.0f
                                    ? ((rs != rs || rs == INFINITY) ? INFINITY : 0.0f)
                                    : kvt_mul_rn(expf(rs - st[3u * x]), st[3u * x + 1]);
                v = kvt_add_rn(v, c);
            }
        }
        imp = kvt_add_rn(imp, v != v ? INFINITY : v);
    }
    a.d_imp[(uint64_t)blockIdx.y * np + j] = imp;
}

// ---- cuBLAS, loaded at run time -------------------------------------------
#ifdef KVT_CUDA_EMU
// The emulation's cuBLAS: the same column-major strided batched SGEMM, as
// a kernel of one thread on the handle's stream.
typedef int cublasStatus_t;
typedef void *cublasHandle_t;
typedef int cublasOperation_t;
#define CUBLAS_STATUS_SUCCESS 0
#define CUBLAS_OP_N 0
#define CUBLAS_OP_T 1
#else
#define KVT_BLAS_STR2(x) #x
#define KVT_BLAS_STR(x) KVT_BLAS_STR2(x)
#endif
typedef cublasStatus_t (*kvt_blas_create_fn)(cublasHandle_t *);
typedef cublasStatus_t (*kvt_blas_destroy_fn)(cublasHandle_t);
typedef cublasStatus_t (*kvt_blas_stream_fn)(cublasHandle_t, cudaStream_t);
typedef cublasStatus_t (*kvt_blas_gemm_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t,
                                           int, int, int, const float *, const float *, int,
                                           long long, const float *, int, long long,
                                           const float *, float *, int, long long, int);
#ifdef KVT_CUDA_EMU
struct kvt_emu_blas_handle {
    cudaStream_t stream;
};
cublasStatus_t kvt_emu_blas_create(cublasHandle_t *h)
{
    *h = new kvt_emu_blas_handle{nullptr};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t kvt_emu_blas_destroy(cublasHandle_t h)
{
    delete static_cast<kvt_emu_blas_handle *>(h);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t kvt_emu_blas_stream(cublasHandle_t h, cudaStream_t s)
{
    static_cast<kvt_emu_blas_handle *>(h)->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
// C[i + j ldc] = alpha sum_l op(A)[i][l] op(B)[l][j] + beta C (beta 0: C not
// read): one emulated thread, queued on the handle's stream as cuBLAS's
// kernels are.
KVT_KERNEL kvt_emu_gemm_k(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                          float alpha, const float *A, int lda, long long sa, const float *B,
                          int ldb, long long sb, float beta, float *C, int ldc, long long sc,
                          int batch)
{
    for (int b = 0; b < batch; b++)
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                float acc = 0.0f;
                for (int l = 0; l < k; l++) {
                    const float x = ta == CUBLAS_OP_N ? A[b * sa + i + (long long)l * lda]
                                                      : A[b * sa + l + (long long)i * lda];
                    const float y = tb == CUBLAS_OP_N ? B[b * sb + l + (long long)j * ldb]
                                                      : B[b * sb + j + (long long)l * ldb];
                    acc = fmaf(x, y, acc);
                }
                float *c = C + b * sc + i + (long long)j * ldc;
                *c = beta == 0.0f ? alpha * acc : alpha * acc + beta * *c;
            }
}
cublasStatus_t kvt_emu_blas_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                 int m, int n, int k, const float *alpha, const float *A, int lda,
                                 long long sa, const float *B, int ldb, long long sb,
                                 const float *beta, float *C, int ldc, long long sc, int batch)
{
    const cudaError_t e = KVT_LAUNCH(kvt_emu_gemm_k, 1, 1, 0,
                                     static_cast<kvt_emu_blas_handle *>(h)->stream, ta, tb, m, n,
                                     k, *alpha, A, lda, sa, B, ldb, sb, *beta, C, ldc, sc, batch);
    return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : 13; // CUBLAS_STATUS_EXECUTION_FAILED
}
#endif

struct kvt_blas_lib {
    kvt_blas_create_fn create;
    kvt_blas_destroy_fn destroy;
    kvt_blas_stream_fn stream;
    kvt_blas_gemm_fn gemm;
    char why[256]; // why it could not be loaded ("" = loaded)
};
kvt_blas_lib kvt_blas;
pthread_once_t kvt_blas_once = PTHREAD_ONCE_INIT;
bool kvt_blas_forbidden;

void kvt_blas_load(void)
{
#ifdef KVT_CUDA_EMU
    kvt_blas.create = kvt_emu_blas_create;
    kvt_blas.destroy = kvt_emu_blas_destroy;
    kvt_blas.stream = kvt_emu_blas_stream;
    kvt_blas.gemm = kvt_emu_blas_gemm;
#else
    // The major version the library was built against first (its ABI).
    static const char *const names[] = {"libcublas.so." KVT_BLAS_STR(CUBLAS_VER_MAJOR), "libcublas.so"};
    void *lib = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(kvt_blas.why, sizeof kvt_blas.why, "dlopen %s: %s", names[0], e ? e : "failed");
        return;
    }
    kvt_blas.create = (kvt_blas_create_fn)dlsym(lib, "cublasCreate_v2");
    kvt_blas.destroy = (kvt_blas_destroy_fn)dlsym(lib, "cublasDestroy_v2");
    kvt_blas.stream = (kvt_blas_stream_fn)dlsym(lib, "cublasSetStream_v2");
    kvt_blas.gemm = (kvt_blas_gemm_fn)dlsym(lib, "cublasSgemmStridedBatched");
    if (!kvt_blas.create || !kvt_blas.destroy || !kvt_blas.stream || !kvt_blas.gemm) {
        snprintf(kvt_blas.why, sizeof kvt_blas.why, "%s lacks a cuBLAS entry point", names[0]);
        kvt_blas.create = NULL;
        dlclose(lib);
        return;
    }
    // Kept loaded for the life of the process (handles may outlive a pool).
#endif
}

} // namespace

extern "C" {

void kvt__cu_blas_forbid(int forbid)
{
    kvt_blas_forbidden = forbid != 0;
}

int kvt__cu_blas_create(void **handle, void *stream)
{
    *handle = NULL;
    if (kvt_blas_forbidden)
        return kvt__err(KVT_ENOTSUP, "cuBLAS: turned off (kvt__cu_blas_forbid)");
    pthread_once(&kvt_blas_once, kvt_blas_load);
    if (!kvt_blas.create)
        return kvt__err(KVT_ENOTSUP, "cuBLAS: %s", kvt_blas.why);
    cublasHandle_t h = NULL;
    cublasStatus_t s = kvt_blas.create(&h);
    if (s != CUBLAS_STATUS_SUCCESS)
        return kvt__err(KVT_ENOTSUP, "cuBLAS: cublasCreate failed (status %d)", (int)s);
    s = kvt_blas.stream(h, static_cast<cudaStream_t>(stream));
    if (s != CUBLAS_STATUS_SUCCESS) {
        kvt_blas.destroy(h);
        return kvt__err(KVT_EIO, "cuBLAS: cublasSetStream failed (status %d)", (int)s);
    }
    *handle = h;
    return 0;
}

void kvt__cu_blas_destroy(void *handle)
{
    if (handle && kvt_blas.destroy)
        kvt_blas.destroy(static_cast<cublasHandle_t>(handle));
}

size_t kvt__cu_warm_workspace_bytes(const kvt__cu_warm_args *a)
{
    const uint64_t H = a->n_heads, np = a->n_pages, R = (uint64_t)a->n_obs * a->G;
    const uint64_t W = kvt_wm_width(a);
    const uint64_t f = H * np * W + H * R * np + 3u * H * R;
    return (size_t)(f * sizeof(float));
}

int kvt__cu_warm(const kvt__cu_warm_args *a, void *stream)
{
    KVT_CU_NEED(a, d_slots);
    KVT_CU_NEED(a, d_meta_base);
    KVT_CU_NEED(a, d_q);
    KVT_CU_NEED(a, d_imp);
    KVT_CU_NEED(a, d_work);
    if (a->method != KVT_SCORE_MINMAX && a->method != KVT_SCORE_MEAN)
        return kvt__err(KVT_EINVAL, "a->method: %u is not a KVT_SCORE_*", a->method);
    if (a->vote > KVT_VOTE_SOFTVOTE)
        return kvt__err(KVT_EINVAL, "a->vote: %u is not a KVT_VOTE_*", a->vote);
    if (a->G == 0 || a->D == 0)
        return kvt__err(KVT_EINVAL, "a->G, a->D: must not be 0");
    if (a->dtype != KVT_DTYPE_F16 && a->dtype != KVT_DTYPE_BF16 && a->dtype != KVT_DTYPE_F32)
        return kvt__err(KVT_EINVAL, "a->dtype: %u is not F16, BF16 or F32", a->dtype);
    if (int rc = kvt_meta_check(a->D, a->dtype, a->meta_bytes, a->meta_slots))
        return rc;
    const uint64_t R = (uint64_t)a->n_obs * a->G, W = kvt_wm_width(a);
    if (R > 0x7fffffffu || (uint64_t)a->n_pages * W > 0x7fffffffu || R * W > 0x7fffffffu ||
        R * a->n_pages > 0x7fffffffu || R * a->n_heads > 0x7fffffffu || a->n_heads > 65535u)
        return kvt__err(KVT_EINVAL, "a: %u heads x %llu rows x %u pages is too large for one call",
                        a->n_heads, (unsigned long long)R, a->n_pages);
    if (a->n_heads == 0 || a->n_pages == 0 || a->n_obs == 0)
        return 0;
    const uint64_t H = a->n_heads, np = a->n_pages;
    float *lm = static_cast<float *>(a->d_work);
    float *s = lm + H * np * W;
    float *st = s + H * R * np;

    const uint32_t gx = (uint32_t)kvt_umin64((np * W + KVT_WM_THREADS - 1) / KVT_WM_THREADS, 4096);
    cudaError_t e = KVT_LAUNCH(kvt_wm_gather, dim3(gx, (uint32_t)H), dim3(KVT_WM_THREADS), 0, stream,
                               *a, lm);
    if (e != cudaSuccess)
        return KVT_CU_LAUNCHED(e, "kvt_wm_gather");

    if (a->blas) {
        // Column-major: C (np x R, ld np) = Lm^T (np x W) * Q (W x R);
        // row-major that is S[r][j] = Q[r] . Lm[j].
        const float one = 1.0f, zero = 0.0f;
        const cublasStatus_t bs = kvt_blas.gemm(
            static_cast<cublasHandle_t>(a->blas), CUBLAS_OP_T, CUBLAS_OP_N, (int)np, (int)R, (int)W,
            &one, lm, (int)W, (long long)(np * W), a->d_q, (int)W, (long long)(R * W), &zero, s,
            (int)np, (long long)(R * np), (int)H);
        if (bs != CUBLAS_STATUS_SUCCESS)
            return kvt__err(KVT_EIO, "cuBLAS: cublasSgemmStridedBatched failed (status %d)", (int)bs);
    } else {
        const dim3 grid((uint32_t)((np + KVT_WM_TILE - 1) / KVT_WM_TILE),
                        (uint32_t)((R + KVT_WM_TILE - 1) / KVT_WM_TILE), (uint32_t)H);
        if (grid.y > 65535u)
            return kvt__err(KVT_EINVAL, "a->n_obs: %llu query rows need cuBLAS (at most %u without)",
                            (unsigned long long)R, 65535u * KVT_WM_TILE);
        e = KVT_LAUNCH(kvt_wm_gemm, grid, dim3(KVT_WM_TILE, KVT_WM_TILE), 0, stream, a->d_q, lm, s,
                       (uint32_t)R, (uint32_t)np, (uint32_t)W);
        if (e != cudaSuccess)
            return KVT_CU_LAUNCHED(e, "kvt_wm_gemm");
    }
    if (a->vote == KVT_VOTE_SOFTVOTE) {
        e = KVT_LAUNCH(kvt_wm_stats, dim3((uint32_t)(H * R)), dim3(KVT_WM_THREADS), 0, stream, *a, s,
                       st);
        if (e != cudaSuccess)
            return KVT_CU_LAUNCHED(e, "kvt_wm_stats");
    }
    e = KVT_LAUNCH(kvt_wm_vote, dim3((uint32_t)((np + KVT_WM_THREADS - 1) / KVT_WM_THREADS), (uint32_t)H),
                   dim3(KVT_WM_THREADS), 0, stream, *a, s, st);
    return KVT_CU_LAUNCHED(e, "kvt_wm_vote");
}

} // extern "C"
