// Whether this build carries the CUDA backend (kvt_build_features). The
// pool side of the backend is lib/backend/cuda_pool.c, which calls the
// kernels of this directory through kvt_cuda.h.
#include "kvt_cuda_rt.cuh"

extern "C" {

KVT__HIDDEN bool kvt__cuda_built(void)
{
    return true;
}

} // extern "C"
