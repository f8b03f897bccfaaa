/* The portable build of the CPU kernels (see kern_impl.h). */
#define KVT__ISA 0
#define KVT__KERN_NAME kvt__kern_portable
#define KVT__KERN_STR "portable"
#include "kern_impl.h"
