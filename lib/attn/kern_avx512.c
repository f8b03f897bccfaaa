/* The avx512 build of the CPU kernels (see kern_impl.h). */
#define KVT__ISA 2
#define KVT__KERN_NAME kvt__kern_avx512
#define KVT__KERN_STR "avx512"
#include "kern_impl.h"
