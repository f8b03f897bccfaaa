#!/bin/sh
# The GPU session's runbook (examples/bench/RESULTS.md) as stages that each
# fit one 10-minute call on a lent GPU machine, run from the repository
# root:
#
#   sh examples/bench/gpu-session.sh build   # the GPU tests and kvtier-bench, with nvcc
#                                            # (sm_80, sm_90, PTX)
#   sh examples/bench/gpu-session.sh tests   # the GPU tests (what make check-gpu runs
#   sh examples/bench/gpu-session.sh memcheck  # first), then under compute-sanitizer's
#   sh examples/bench/gpu-session.sh racecheck # memcheck and racecheck, one call each
#   sh examples/bench/gpu-session.sh bench   # kvtier-bench --backend cuda all, tier
#
# The machine reaches no package registry: when the folder $KVT_GPU_DEPS
# (default .gpu-deps) holds the .deb files that `sh examples/bench/gpu-deps.sh
# fetch .gpu-deps` downloaded here (carry it), every stage unpacks them
# first (gpu-deps.sh install), so the build finds liburing, libnuma and
# cmocka there. Only what the GPU session needs is built (not the example
# decoder, whose OpenBLAS is not carried); the CPU tests are CI's.
#
# Logs and JSON go to $OUT (default build/gpu-session); stdout gets one
# line per step with its exit status and the benchmarks' summary lines,
# which hold the figures RESULTS.md records against the issue's targets.
# Exits 77 when no CUDA device is usable (nothing to measure), 1 when a
# step failed, else 0.
set -u

o=${O:-build} # the Makefile's build folder
out=${OUT:-$o/gpu-session}
stage=${1:-}
mkdir -p "$out" || exit 1
jobs=$(nproc 2>/dev/null || echo 4)
fail=0

# step NAME LOG COMMAND...: runs COMMAND with its stdout in $out/LOG and its
# stderr in $out/LOG.err, then prints NAME, the exit status and stdout's
# last line (and stderr's last lines when it failed).
step() {
    name=$1 log=$2
    shift 2
    "$@" > "$out/$log" 2> "$out/$log.err"
    rc=$?
    printf '%s: rc=%d (%s) %s\n' "$name" "$rc" "$out/$log" "$(tail -n 1 "$out/$log")"
    if [ "$rc" -ne 0 ]; then
        tail -n 5 "$out/$log.err"
        fail=1
    fi
    return "$rc"
}

have_gpu() {
    command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > "$out/gpus.txt" 2>&1 &&
        grep -q '^GPU' "$out/gpus.txt"
}

deps=${KVT_GPU_DEPS:-.gpu-deps}
if [ -d "$deps" ]; then
    env_line=$(sh examples/bench/gpu-deps.sh install "$deps") || exit 1
    eval "$env_line"
fi

case $stage in
build)
    { date -u; uname -a; nvidia-smi; command -v nvcc && nvcc --version; } > "$out/device.txt" 2>&1
    have_gpu || { echo "no CUDA device (see $out/device.txt)"; exit 77; }
    cat "$out/gpus.txt"
    step "make" build.log make -j"$jobs" gpu-tests "$o/bin/kvtier-bench"
    ;;
tests | memcheck | racecheck)
    have_gpu || { echo "no CUDA device"; exit 77; }
    bins=$(ls "$o"/tests/gpu/test_cu_* 2> /dev/null | grep -v -- '-emu$')
    [ -n "$bins" ] || { echo "no GPU test binaries in $o/tests/gpu: run the build stage"; exit 1; }
    if [ "$stage" = tests ]; then
        # shellcheck disable=SC2086 # one argument per binary
        step "GPU tests" "$stage.log" sh tests/run.sh $bins
    else
        cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null)
        [ -n "$cs" ] || { echo "compute-sanitizer not found"; exit 1; }
        VALGRIND="$cs --tool $stage --error-exitcode 1" # tests/run.sh prefixes each binary
        export VALGRIND
        # shellcheck disable=SC2086
        step "GPU tests under $stage" "$stage.log" sh tests/run.sh $bins
    fi
    grep -E -- '--- .*: (FAILED|TIMEOUT)|ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: [1-9]' \
        "$out/$stage.log" | head -n 20
    ;;
bench)
    have_gpu || { echo "no CUDA device"; exit 77; }
    step "bench cuda all" cuda.json "$o/bin/kvtier-bench" --backend cuda all --json-only
    step "bench cuda tier" cuda-tier.json \
        "$o/bin/kvtier-bench" --backend cuda tier --batch 1,8,40 --json-only
    # One JSON object a line on stdout (progress is in the .err files); the
    # summaries are the lines RESULTS.md quotes.
    grep -h '"summary"' "$out/cuda.json" "$out/cuda-tier.json"
    ;;
*)
    echo "usage: sh examples/bench/gpu-session.sh build|tests|memcheck|racecheck|bench" \
        "(OUT=dir for the logs)" >&2
    exit 2
    ;;
esac
exit "$fail"
