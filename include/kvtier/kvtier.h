/* libkvtier - tiered KV cache and sparse decode attention for LLM inference.
 *
 * The umbrella header: include this one. See kvtier(7) for the model
 * (tiers, handles, step flow, thread safety, errors).
 */
#ifndef KVTIER_KVTIER_H
#define KVTIER_KVTIER_H

#include "kvtier/common.h"
#include "kvtier/version.h"
#include "kvtier/pool.h"
#include "kvtier/selector.h"
#include "kvtier/policy.h"
#include "kvtier/step.h"
#include "kvtier/mover.h"
#include "kvtier/prefix.h"
#include "kvtier/remote.h"

#endif /* KVTIER_KVTIER_H */
