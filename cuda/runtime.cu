// CUDA runtime glue: device probe, memory, streams and events, each failure
// turned into a KVT_E* code whose message carries the CUDA error.
#include "kvt_cuda_rt.cuh"

#include <stdio.h>

// A failed call also leaves its error as the thread's "last error", which the
// next kernel launch (KVT_LAUNCH reads cudaGetLastError) would report as its
// own failure: clear it (a sticky error stays; later calls report it anyway).
#define KVT_CU_ERR(code, e, what)                                                          \
    ((void)cudaGetLastError(),                                                             \
     kvt__err((code), "%s: %s (%s)", (what), cudaGetErrorName(e), cudaGetErrorString(e)))

extern "C" {

int kvt__cu_device_count(const char **why)
{
    static char msg[256];
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); // not sticky: clear it for later calls
        snprintf(msg, sizeof msg, "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
        if (why)
            *why = msg;
        return 0;
    }
    if (n <= 0 && why)
        *why = "cudaGetDeviceCount found no device";
    else if (why)
        *why = "";
    return n;
}

int kvt__cu_malloc(void **d_out, size_t bytes)
{
    const cudaError_t e = cudaMalloc(d_out, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *d_out = NULL;
        return KVT_CU_ERR(KVT_ENOMEM, e, "cudaMalloc");
    }
    return 0;
}

void kvt__cu_free(void *d)
{
    if (d)
        (void)cudaFree(d);
}

int kvt__cu_host_alloc(void **h_out, size_t bytes)
{
    const cudaError_t e =
        cudaHostAlloc(h_out, bytes ? bytes : 1, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
        *h_out = NULL;
        return KVT_CU_ERR(KVT_ENOMEM, e, "cudaHostAlloc");
    }
    return 0;
}

void kvt__cu_host_free(void *h)
{
    if (h)
        (void)cudaFreeHost(h);
}

int kvt__cu_host_register(void *h, size_t bytes)
{
    const cudaError_t e =
        cudaHostRegister(h, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaHostRegister");
}

void kvt__cu_host_unregister(void *h)
{
    if (h)
        (void)cudaHostUnregister(h);
}

int kvt__cu_host_ptr_direct(int device)
{
    int ua = 0, direct = 0;
    if (cudaDeviceGetAttribute(&ua, cudaDevAttrUnifiedAddressing, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&direct, cudaDevAttrCanUseHostPointerForRegisteredMem, device) !=
            cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return ua && direct;
}

void *kvt__cu_host_device_ptr(void *h)
{
    void *d = NULL;
    if (cudaHostGetDevicePointer(&d, h, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return d;
}

// Setup and test helpers, never on a per-layer path: cudaMemcpy and
// cudaMemset may return before a device-side copy or set is done and do not
// order with the non-blocking streams the kernels run on (they go to the
// legacy default stream), so both start and finish with a device
// synchronisation: after all earlier work (a kernel still reading or
// writing the buffer), before all later work.
static uint64_t kvt__cu_device_syncs;

uint64_t kvt__cu_device_sync_count(void)
{
#ifdef KVT_CUDA_EMU
    return kvt_emu_device_syncs();
#else
    return __atomic_load_n(&kvt__cu_device_syncs, __ATOMIC_RELAXED);
#endif
}

int kvt__cu_memcpy(void *dst, const void *src, size_t bytes)
{
    __atomic_fetch_add(&kvt__cu_device_syncs, 1, __ATOMIC_RELAXED);
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess)
        e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
    if (e == cudaSuccess)
        e = cudaDeviceSynchronize();
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaMemcpy");
}

int kvt__cu_memset(void *d, int value, size_t bytes)
{
    __atomic_fetch_add(&kvt__cu_device_syncs, 1, __ATOMIC_RELAXED);
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess)
        e = cudaMemset(d, value, bytes);
    if (e == cudaSuccess)
        e = cudaDeviceSynchronize();
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaMemset");
}

int kvt__cu_copy_sync(void *dst, const void *src, size_t bytes, void *stream)
{
    if (bytes == 0)
        return 0;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                    static_cast<cudaStream_t>(stream));
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaMemcpyAsync");
}

int kvt__cu_memset_sync(void *d, int value, size_t bytes, void *stream)
{
    if (bytes == 0)
        return 0;
    cudaError_t e = cudaMemsetAsync(d, value, bytes, static_cast<cudaStream_t>(stream));
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaMemsetAsync");
}

int kvt__cu_stream_create(void **stream, int low_priority)
{
    int lo = 0, hi = 0;
    cudaStream_t s = NULL;
    // Numerically larger = lower priority. The least priority is also the
    // default one (0), so a copy stream ranks below decode only when the
    // decode runs on a stream made with a higher priority.
    cudaError_t e = cudaDeviceGetStreamPriorityRange(&lo, &hi);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, low_priority ? lo : hi);
    if (e != cudaSuccess) {
        *stream = NULL;
        return KVT_CU_ERR(KVT_EIO, e, "cudaStreamCreateWithPriority");
    }
    *stream = s;
    return 0;
}

void kvt__cu_stream_destroy(void *stream)
{
    if (stream)
        (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

int kvt__cu_stream_sync(void *stream)
{
    const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaStreamSynchronize");
}

int kvt__cu_event_create(void **event)
{
    cudaEvent_t ev = NULL;
    const cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        *event = NULL;
        return KVT_CU_ERR(KVT_EIO, e, "cudaEventCreateWithFlags");
    }
    *event = ev;
    return 0;
}

void kvt__cu_event_destroy(void *event)
{
    if (event)
        (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

int kvt__cu_event_record(void *event, void *stream)
{
    const cudaError_t e =
        cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream));
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaEventRecord");
}

int kvt__cu_stream_wait_event(void *stream, void *event)
{
    const cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                              static_cast<cudaEvent_t>(event), 0);
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaStreamWaitEvent");
}

int kvt__cu_event_query(void *event)
{
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaSuccess)
        return 1;
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return 0;
    }
    return KVT_CU_ERR(KVT_EIO, e, "cudaEventQuery");
}

int kvt__cu_event_sync(void *event)
{
    const cudaError_t e = cudaEventSynchronize(static_cast<cudaEvent_t>(event));
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaEventSynchronize");
}

int kvt__cu_set_device(int device)
{
    const cudaError_t e = cudaSetDevice(device);
    return e == cudaSuccess ? 0 : KVT_CU_ERR(KVT_EIO, e, "cudaSetDevice");
}

} // extern "C"
