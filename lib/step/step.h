/* What the pool lifecycle (lib/api) needs of the step. */
#ifndef KVTIER_STEP_API_H
#define KVTIER_STEP_API_H

#include "../core/store.h"

/* The step workspace of a pool (lib/step/step.c). */
KVT__HIDDEN void kvt__step_free(struct kvt_step *st);
KVT__HIDDEN bool kvt__step_is_open(const struct kvt_step *st);
/* Whether st is open and includes sequence s. */
KVT__HIDDEN bool kvt__step_has_seq(const struct kvt_step *st, const kvt__seq *s);

#endif /* KVTIER_STEP_API_H */
