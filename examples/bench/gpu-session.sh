#!/bin/sh
# The GPU session in one call: build what a GPU run needs, run the GPU
# tests, the compute-sanitizer checks and the CUDA benchmarks, each stage
# under its own timeout, each writing its log and JSON under $OUT as soon as
# it finishes (a call that runs out of time still returns what it did).
#
#   sh examples/bench/gpu-session.sh all [--budget SECONDS]   # every stage
#   sh examples/bench/gpu-session.sh STAGE [STAGE...]         # only those
#   sh examples/bench/gpu-session.sh all --budget 200 --plan  # print what would
#       run and what the budget drops, run nothing
#   KVT_GPU_DRYRUN=1 sh examples/bench/gpu-session.sh all     # the same stages
#       on the CUDA emulation (cuda/emu), tiny shapes, no GPU needed
#       (tests/test_gpu_session.sh runs it in make check)
#
# On the lent GPU machine, from the agent's tool (first call of the window):
#   run(command="sh examples/bench/gpu-session.sh all", carry=[".gpu-deps"],
#       timeout_s=540)
# after `sh examples/bench/gpu-deps.sh fetch .gpu-deps` here (the machine
# reaches no package registry; the stages unpack .gpu-deps first).
#
# Stages, in the order they run. est: the seconds planned for an H100 (the
# build measured as below; the others sized from what they launch, counted on
# the emulation: KVT_EMU_STATS). cap: the stage's own timeout. --budget
# (default 420 s, 7 minutes) drops stages, the one with the largest est
# first, until the ests fit; while running, a stage's timeout is also cut to
# what is left of the budget, and a stage with under 10 s left is not begun.
#
#   stage      est  cap  what                                     appended to
#   build       45  180  make -j(cores): the GPU test binaries     build.log
#                        (tests/gpu, no -emu) and kvtier-bench,
#                        for the device's arch only (sm_90 on
#                        H100/H200; KVT_GPU_ARCH overrides);
#                        24 s on this 2-core machine, sm_90 only
#   kernels     20   90  the kernel tests: test_cu_{append,copy,   tests.log
#                        decode,recycle,select,selfinish}
#   pools       25   90  the pool-level tests: test_cu_{pool,      tests.log
#                        loop,tier}
#   memcheck    60  120  every GPU test under compute-sanitizer    sanitizer.log
#                        --tool memcheck, reduced shapes
#                        (KVT_GPU_REDUCED=5: every 5th case of the
#                        shape tables, timing-only variants skipped:
#                        2730 launches of the full 4399)
#   racecheck   75  150  the same under --tool racecheck           sanitizer.log
#   bench-attn  50  150  kvtier-bench --backend cuda attn          bench.json
#                        --batch 8,40 --ctx 10k,32k: dense vs
#                        sparse decode, selection, HBM probe
#   bench-copy  30   90  ... copy: UVA kernel vs cudaMemcpyAsync   bench.json
#                        vs the host->device probe, decode under
#                        transfers
#   bench-tier  45  120  ... tier --batch 1,8,40: a tiered pool's  bench.json
#                        steps vs a device-only pool's
#
# $OUT holds at most 8 files (what the device tool brings back): device.txt,
# build.log, tests.log, sanitizer.log, bench.json (each stage's stdout and
# stderr appended as the stage ends), stages.json (one line a stage:
# {"stage":..,"status":"ok"|"failed"|"timeout"|"unsupported"|"dropped"|
# "no-time","rc":..,"seconds":..}), summary.txt (the stage lines and the
# benchmarks' summary lines: the figures RESULTS.md records) and
# logs.tar.gz (every stage's own files, rewritten after each stage). A
# sanitizer that refuses the device ("Device not supported", as on gVisor
# machines) is "unsupported", not a finding.
#
# Exit: 0 when every stage that ran passed, 1 when one failed or timed out,
# 77 when there is no CUDA device (not in a dry run), 2 on bad arguments.
set -u

o=${O:-build} # the Makefile's build folder
out=${OUT:-$o/gpu-session}
dry=${KVT_GPU_DRYRUN:-0}
budget=420
all_stages="build kernels pools memcheck racecheck bench-attn bench-copy bench-tier"
kernel_tests="test_cu_append test_cu_copy test_cu_decode test_cu_recycle test_cu_select test_cu_selfinish"
pool_tests="test_cu_pool test_cu_loop test_cu_tier"

usage() {
    echo "usage: sh examples/bench/gpu-session.sh all|STAGE... [--budget SECONDS]" >&2
    echo "  stages: $all_stages (OUT=dir for the logs, KVT_GPU_DRYRUN=1 on the emulation)" >&2
    exit 2
}

est_of() {
    case $1 in
    build) echo 45 ;; kernels) echo 20 ;; pools) echo 25 ;; memcheck) echo 60 ;;
    racecheck) echo 75 ;; bench-attn) echo 50 ;; bench-copy) echo 30 ;; bench-tier) echo 45 ;;
    esac
}
cap_of() {
    case $1 in
    build) echo 180 ;; kernels | pools | bench-copy) echo 90 ;; memcheck) echo 120 ;;
    racecheck | bench-attn) echo 150 ;; bench-tier) echo 120 ;;
    esac
}

# ---- arguments ---------------------------------------------------------------
stages=""
plan_only=0
while [ $# -gt 0 ]; do
    case $1 in
    --plan) plan_only=1 ;;
    --budget)
        [ $# -ge 2 ] || usage
        budget=$2
        shift
        ;;
    --budget=*) budget=${1#--budget=} ;;
    all) stages="$stages $all_stages" ;;
    *)
        case " $all_stages " in
        *" $1 "*) stages="$stages $1" ;;
        *) echo "gpu-session.sh: unknown stage '$1'" >&2; usage ;;
        esac
        ;;
    esac
    shift
done
[ -n "$stages" ] || usage
case $budget in
'' | *[!0-9]*) echo "gpu-session.sh: --budget must be whole seconds, not '$budget'" >&2; usage ;;
esac

# Each stage's own files go to $work; $out gets the combined files.
work=${KVT_GPU_WORK:-$o/gpu-session-work}
rm -rf "$work"
mkdir -p "$out" "$work" || exit 1
: > "$out/stages.json"
: > "$out/summary.txt"
jobs=$(nproc 2> /dev/null || echo 4)
t0=$(date +%s)
fail=0

say() { echo "$*" | tee -a "$out/summary.txt"; }
record() { # STAGE STATUS RC SECONDS
    printf '{"stage":"%s","status":"%s","rc":%d,"seconds":%d,"dryrun":%s}\n' "$1" "$2" "$3" "$4" \
        "$([ "$dry" = 1 ] && echo true || echo false)" >> "$out/stages.json"
}

# ---- the budget: drop the stages with the largest est until the rest fit -----
plan=$stages
total() { s=0; for x in $plan; do s=$((s + $(est_of "$x"))); done; echo $s; }
dropped=""
while [ "$(total)" -gt "$budget" ]; do
    worst="" w=-1
    for x in $plan; do # build is never dropped: nothing runs without it
        [ "$x" = build ] && continue
        e=$(est_of "$x")
        [ "$e" -gt "$w" ] && { worst=$x; w=$e; }
    done
    [ -n "$worst" ] || break
    dropped="$dropped $worst"
    plan=$(for x in $plan; do [ "$x" = "$worst" ] || printf '%s ' "$x"; done)
done
for x in $dropped; do
    say "$x: dropped (budget ${budget}s)"
    record "$x" dropped 0 0
done
if [ "$plan_only" = 1 ]; then
    say "plan: $(echo $plan) (est $(total)s of ${budget}s)"
    exit 0
fi

# ---- the machine -------------------------------------------------------------
have_gpu() {
    command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > "$work/gpus.txt" 2>&1 &&
        grep -q '^GPU' "$work/gpus.txt"
}
if [ "$dry" = 1 ]; then
    { date -u; uname -a; echo "dry run: the CUDA emulation (cuda/emu), tiny shapes"; } \
        > "$out/device.txt"
    sfx=-emu
    bench=$o/bin/kvtier-bench-emu
    bench_args="--smoke"
else
    { date -u; uname -a; nvidia-smi; command -v nvcc && nvcc --version; } > "$out/device.txt" 2>&1
    have_gpu || { echo "no CUDA device (see $out/device.txt)"; exit 77; }
    sfx=""
    bench=$o/bin/kvtier-bench
    bench_args=""
    deps=${KVT_GPU_DEPS:-.gpu-deps}
    if [ -d "$deps" ]; then
        env_line=$(sh examples/bench/gpu-deps.sh install "$deps") || exit 1
        eval "$env_line"
    fi
fi

# The device's arch (compute capability 9.0 -> sm_90), one gencode only.
gpu_arch() {
    if [ -n "${KVT_GPU_ARCH:-}" ]; then
        echo "$KVT_GPU_ARCH"
        return
    fi
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2> /dev/null | head -n 1 | tr -d ' .')
    case $cc in '' | *[!0-9]*) cc=90 ;; esac
    echo "-gencode arch=compute_$cc,code=sm_$cc"
}

bins_of() { for b in "$@"; do printf '%s ' "$o/tests/gpu/$b$sfx"; done; }

# The combined file of $out that a stage's files are appended to.
combined_of() {
    case $1 in
    build) echo build.log ;; kernels | pools) echo tests.log ;;
    memcheck | racecheck) echo sanitizer.log ;; *) echo bench.json ;;
    esac
}

# publish STAGE LOG: the stage's stdout (LOG) and stderr appended to its
# combined file in $out, and logs.tar.gz rewritten with every stage's files.
publish() {
    c=$out/$(combined_of "$1")
    if [ "$c" = "$out/bench.json" ]; then # JSON lines stay JSON lines
        cat "$work/$2" >> "$c"
    else
        { echo "==== $1: stdout"; cat "$work/$2"; echo "==== $1: stderr"; cat "$work/$1.err"; } >> "$c"
    fi
    tar -czf "$work.tar.gz" -C "$(dirname "$work")" "$(basename "$work")" 2> /dev/null &&
        mv -f "$work.tar.gz" "$out/logs.tar.gz"
}

# run_stage STAGE LOGFILE COMMAND...: COMMAND under the stage's timeout, stdout
# to $work/LOGFILE, stderr to $work/STAGE.err, then its line in stages.json
# and its files published to $out.
run_stage() {
    st=$1 log=$2
    shift 2
    now=$(date +%s)
    left=$((budget - (now - t0)))
    lim=$(cap_of "$st")
    # KVT_GPU_STAGE_CAP: a lower cap for every stage (tests/test_gpu_session.sh)
    [ -n "${KVT_GPU_STAGE_CAP:-}" ] && [ "$KVT_GPU_STAGE_CAP" -lt "$lim" ] && lim=$KVT_GPU_STAGE_CAP
    [ "$left" -lt "$lim" ] && lim=$left
    if [ "$lim" -lt 10 ] && [ "$lim" -lt "${KVT_GPU_STAGE_CAP:-10}" ]; then
        say "$st: not begun, ${left}s of the budget left"
        record "$st" no-time 0 0
        fail=1
        return 1
    fi
    timeout -k 5 "$lim" "$@" > "$work/$log" 2> "$work/$st.err"
    rc=$?
    secs=$(($(date +%s) - now))
    case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
    esac
    # tests/run.sh counts a binary that exits 77 as skipped: on a GPU run
    # that is a GPU test that found no usable device, a failure here.
    if [ "$status" = ok ] && [ "$dry" != 1 ] && tail -n 1 "$work/$log" | grep -Eq ', [1-9][0-9]* skipped$'; then
        status=failed rc=77
    fi
    if [ "$status" = failed ] && grep -q 'Device not supported' "$work/$log" "$work/$st.err" 2> /dev/null; then
        status=unsupported
    fi
    record "$st" "$status" "$rc" "$secs"
    case $log in # the benchmarks' summary lines follow (bench stages)
    *.json) say "$st: $status rc=$rc ${secs}s (limit ${lim}s)" ;;
    *) say "$st: $status rc=$rc ${secs}s (limit ${lim}s): $(tail -n 1 "$work/$log")" ;;
    esac
    publish "$st" "$log"
    if [ "$rc" -ne 0 ]; then
        tail -n 5 "$work/$st.err"
        [ "$status" = unsupported ] || fail=1
    fi
    return "$rc"
}

# tests/run.sh over BINS with SANITIZER (compute-sanitizer; none in a dry
# run) before each binary and KVT_GPU_REDUCED; the emulated binaries count
# their launches into $work/STAGE.launches.
run_tests() {
    st=$1 san=$2 reduced=$3
    shift 3
    for b in "$@"; do
        [ -x "$b" ] || { say "$st: $b missing (did the build stage run?)"; record "$st" failed 1 0; fail=1; return 1; }
    done
    rm -f "$work/$st.launches"
    run_stage "$st" "$st.log" env VALGRIND="$san" KVT_GPU_REDUCED="$reduced" \
        KVT_EMU_STATS="$work/$st.launches" sh tests/run.sh "$@"
    grep -E -- '--- .*: (FAILED|TIMEOUT)|ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: [1-9]' \
        "$work/$st.log" | head -n 20 | tee -a "$out/summary.txt"
    if [ -s "$work/$st.launches" ]; then
        say "$st: $(awk -F'[= ]' '{l += $2; t += $4} END {printf "%d kernel launches, %d threads", l, t}' \
            "$work/$st.launches") on the emulation"
    fi
}

sanitizer() { # TOOL: the prefix tests/run.sh puts before each binary
    if [ "$dry" = 1 ]; then
        echo ""
        return
    fi
    ch=${CUDA_HOME:-/usr/local/cuda}
    cs=$(command -v compute-sanitizer || ls "$ch/bin/compute-sanitizer" \
        "$ch/compute-sanitizer/compute-sanitizer" 2> /dev/null | head -n 1)
    [ -n "$cs" ] || return 1
    echo "$cs --tool $1 --error-exitcode 1"
}

for st in $plan; do
    case $st in
    build)
        if [ "$dry" = 1 ]; then
            run_stage build build.log make -j"$jobs" O="$o" gpu-tests "$bench"
        else
            cat "$work/gpus.txt"
            say "build: make -j$jobs O=$o NVCC_ARCH='$(gpu_arch)' gpu-bins $bench"
            run_stage build build.log make -j"$jobs" O="$o" NVCC_ARCH="$(gpu_arch)" gpu-bins "$bench"
        fi
        # nothing else can run without the build
        [ $? -eq 0 ] || { say "build failed: the other stages are not run"; break; }
        ;;
    kernels)
        # shellcheck disable=SC2046 # one argument per binary
        run_tests kernels "" "" $(bins_of $kernel_tests)
        ;;
    pools)
        # shellcheck disable=SC2046
        run_tests pools "" "" $(bins_of $pool_tests)
        ;;
    memcheck | racecheck)
        san=$(sanitizer "$st") || {
            say "$st: compute-sanitizer not found"
            record "$st" failed 1 0
            fail=1
            continue
        }
        # shellcheck disable=SC2046
        run_tests "$st" "$san" 5 $(bins_of $kernel_tests $pool_tests)
        ;;
    bench-attn)
        # shellcheck disable=SC2086 # bench_args: zero or one word
        run_stage "$st" "$st.json" "$bench" --backend cuda attn $bench_args \
            $([ "$dry" = 1 ] || echo "--batch 8,40 --ctx 10k,32k") --json-only
        grep -h '"summary"' "$work/$st.json" >> "$out/summary.txt"
        ;;
    bench-copy)
        # shellcheck disable=SC2086
        run_stage "$st" "$st.json" "$bench" --backend cuda copy $bench_args --json-only
        grep -h '"summary"' "$work/$st.json" >> "$out/summary.txt"
        ;;
    bench-tier)
        # shellcheck disable=SC2086
        run_stage "$st" "$st.json" "$bench" --backend cuda tier $bench_args \
            $([ "$dry" = 1 ] || echo "--batch 1,8,40") --json-only
        grep -h '"summary"' "$work/$st.json" >> "$out/summary.txt"
        ;;
    esac
done
say "gpu-session: $(($(date +%s) - t0))s of a ${budget}s budget; logs in $out"
exit "$fail"
