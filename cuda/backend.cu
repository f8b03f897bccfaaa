// CUDA backend glue of the pool. The kernels (cuda/*.cu, declared in
// kvt_cuda.h) are built and tested kernel by kernel (tests/gpu); pools do
// not run on them yet, so asking for KVT_BACKEND_CUDA explicitly returns
// KVT_ENOTSUP with the reason (the CUDA error when there is no usable
// device), and KVT_BACKEND_AUTO resolves to the CPU backend.
#include "kvt_cuda_rt.cuh"

extern "C" {

KVT__HIDDEN int kvt__cuda_pool_init(int32_t device)
{
    const char *why = "";
    const int n = kvt__cu_device_count(&why);
    if (n <= 0)
        return kvt__err(KVT_ENOTSUP, "opts->backend: KVT_BACKEND_CUDA needs a usable CUDA "
                        "device: %s", why);
    if (device < 0 || device >= n)
        return kvt__err(KVT_EINVAL, "opts->cuda_device: %d, the machine has %d CUDA device%s",
                        (int)device, n, n == 1 ? "" : "s");
    return kvt__err(KVT_ENOTSUP, "opts->backend: CUDA device %d is present, but pools on the "
                    "CUDA backend are not built in this release (the kernels are, in cuda/, "
                    "tested by tests/gpu); use KVT_BACKEND_CPU or KVT_BACKEND_AUTO",
                    (int)device);
}

KVT__HIDDEN bool kvt__cuda_built(void)
{
    return true;
}

} // extern "C"
