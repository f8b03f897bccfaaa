// CPU emulation of the CUDA runtime API subset libkvtier uses: device
// properties, memory (device, pinned and registered host allocations,
// tracked), copies and sets, streams, events, errors. Queued work runs as
// stream.cpp says. See emu_int.h for the overview.
#include "emu_int.h"

#include <stdlib.h>

#include <algorithm>
#include <atomic>

namespace kvt_emu_detail {

// ---- errors ------------------------------------------------------------------
__thread cudaError_t g_last = cudaSuccess;

cudaError_t fail(cudaError_t e)
{
    g_last = e;
    return e;
}

// ---- allocations, streams, events -------------------------------------------
std::mutex g_mu; // guards everything below
namespace {
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
} // namespace
std::unordered_map<std::string, size_t> &max_dyn()
{
    static auto *m = new std::unordered_map<std::string, size_t>;
    return *m;
}

namespace {
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
} // namespace

bool stream_ok(const void *s)
{
    if (s == nullptr || s == (const void *)cudaStreamLegacy || s == (const void *)cudaStreamPerThread)
        return true;
    std::lock_guard<std::mutex> lk(g_mu);
    auto &h = handles();
    return h.count(const_cast<void *>(s)) &&
           static_cast<const EmuStream *>(s)->magic == kStreamMagic;
}

namespace {
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
} // namespace

} // namespace kvt_emu_detail

using namespace kvt_emu_detail;

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

namespace {
std::atomic<uint64_t> g_device_syncs{0};
} // namespace
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
