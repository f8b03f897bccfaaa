/* kvtier-bench io: the disk tier's page reads against a plain io_uring
 * reader of the same file (bench_io.c; see examples/bench/README.md). */
#ifndef KVTIER_BENCH_IO_H
#define KVTIER_BENCH_IO_H

/* argv[0] is "io"; returns the process exit status. */
int bench_io_main(int argc, char **argv);

#endif /* KVTIER_BENCH_IO_H */
