/* kvtier-bench --backend cuda: the CUDA backend's kernels on a GPU (see
 * examples/bench/README.md and bench_cuda.c):
 *
 *   kvtier-bench --backend cuda attn|copy|all|tier [--smoke] [--reps N]
 *                [--batch LIST] [--ctx LIST] [--sizes LIST] [--json-only]
 *
 * attn: dense against sparse (top-K) decode attention and the page
 * selection kernels, against a device-to-device HBM bandwidth probe; copy:
 * scattered pinned host pages -> device blocks through the zero-copy kernel
 * and through cudaMemcpyAsync, against a host-to-device probe, and the
 * slowdown a concurrent copy causes to decode; tier: not available on this
 * backend yet (exit 77).
 */
#ifndef KVTIER_BENCH_CUDA_H
#define KVTIER_BENCH_CUDA_H

/* argv as main() received it (argv[0] the program; "--backend cuda" or
 * "--backend=cuda" may appear anywhere and is skipped). Returns the process
 * exit status: 0, 1 (failure, or a --smoke check failed), 2 (usage) or 77
 * (no CUDA device, or the tier subcommand). */
int kvt_bench_cuda_main(int argc, char **argv);

#endif /* KVTIER_BENCH_CUDA_H */
