/* Every internal header of lib/, for the tests that reach into the library
 * (prefix kvt__, never exported). Library sources include only the headers
 * of the areas they use (lib/README.md): base.h, arena.h, threads.h,
 * store.h here, and each area's own header. */
#ifndef KVTIER_INTERNAL_H
#define KVTIER_INTERNAL_H

#include "base.h"
#include "arena.h"
#include "threads.h"
#include "store.h"
#include "../attn/kernels.h"
#include "../select/select_int.h"
#include "../policy/policy_int.h"
#include "../backend/backend.h"
#include "../step/step.h"

#endif /* KVTIER_INTERNAL_H */
