/* kvtier-decode --prefill-ab: the prompt's prefill timed through the
 * engine's own GEMM attention (kvt_seq_append of the prompt's K/V) and
 * through kvtier's chunked prefill (dense steps of several new tokens,
 * kvt_step_opts.n_new), in a dense cache and in a tiered one whose pages go
 * to the host tier as they fill. */
#ifndef KVTD_PREFILL_AB_H
#define KVTD_PREFILL_AB_H

#include <stdint.h>

#include "engine.h"

/* Median of 3 of each; prints a summary on stderr and, with json, one JSON
 * line (chunked_prefill_over_gemm, ...) on stdout. Returns 0. */
int prefill_ab(const model *m, const int32_t *prompt, uint32_t T, const engine_opts *eo,
               uint32_t ctx, int json);

#endif /* KVTD_PREFILL_AB_H */
