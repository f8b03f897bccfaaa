/* The avx2 build of the CPU kernels (see kern_impl.h). */
#define KVT__ISA 1
#define KVT__KERN_NAME kvt__kern_avx2
#define KVT__KERN_STR "avx2"
#include "kern_impl.h"
