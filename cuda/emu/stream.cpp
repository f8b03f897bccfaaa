// CPU emulation of the CUDA runtime: deferred stream work, the queues of the
// streams created here and running them. See emu_int.h for the overview.
#include "emu_int.h"

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
namespace kvt_emu_detail {

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

namespace {
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
} // namespace

void drain(EmuStream *s) { drain_to(s, s->enq); }

namespace {
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
} // namespace

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

} // namespace kvt_emu_detail
