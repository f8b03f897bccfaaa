#!/bin/sh
# examples/bench/gpu-session.sh's dry run (KVT_GPU_DRYRUN=1): every stage of
# the GPU call on the CUDA emulation, so the call on a lent GPU cannot fail
# for a reason visible here. Checks that each stage's files land in $OUT
# with the content a reader of the GPU run needs (test logs that close with
# "N passed, 0 failed", benchmark JSON with its summary line, one
# stages.json line a stage), that the sanitizer stages' reduced set
# (KVT_GPU_REDUCED) launches fewer kernels than the full tests, that
# --budget drops the stages with the largest estimates first, that a stage
# past its timeout is recorded as such with its partial log, and the
# refusals of bad arguments.
O=${O:-build}
set -u
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }
script=examples/bench/gpu-session.sh

# ---- the full dry run --------------------------------------------------------
KVT_GPU_DRYRUN=1 O="$O" OUT="$t/all" KVT_GPU_WORK="$t/gpu-session-work" sh "$script" all \
    > "$t/all.out" 2>&1
rc=$?
[ $rc -eq 0 ] || { bad "dry run exit $rc"; cat "$t/all.out"; }
for f in device.txt build.log stages.json summary.txt tests.log sanitizer.log bench.json \
         logs.tar.gz; do
    [ -s "$t/all/$f" ] || bad "dry run: $f missing or empty"
done
mkdir -p "$t/logs" && tar -xzf "$t/all/logs.tar.gz" -C "$t/logs" || bad "logs.tar.gz does not unpack"
w=$t/logs/gpu-session-work
for st in kernels pools memcheck racecheck; do
    tail -n 1 "$w/$st.log" | grep -Eq '^check: [1-9][0-9]* passed, 0 failed' ||
        bad "$st.log does not close with 'N passed, 0 failed': $(tail -n 1 "$w/$st.log")"
    grep -q "^==== $st: stdout" "$t/all/$([ $st = kernels ] || [ $st = pools ] && echo tests ||
        echo sanitizer).log" || bad "$st not in its combined log"
done
n=$(grep -c '"status":"ok"' "$t/all/stages.json")
[ "$n" -eq 8 ] || bad "stages.json: $n of 8 stages ok"
grep -q '"cmd":"attn","case":"summary"' "$t/all/bench.json" || bad "bench-attn: no summary"
grep -q '"cmd":"copy","case":"summary"' "$t/all/bench.json" || bad "bench-copy: no summary"
grep -q '"cmd":"tier"' "$t/all/bench.json" || bad "bench-tier: no tier line"
grep -vq '^{' "$t/all/bench.json" && bad "bench.json holds a line that is not JSON"
launches() { awk -F'[= ]' '{l += $2} END {print l + 0}' "$w/$1.launches" 2> /dev/null; }
full=$(($(launches kernels) + $(launches pools)))
red=$(launches memcheck)
[ "$red" -gt 0 ] && [ "$red" -lt "$full" ] ||
    bad "reduced set: $red launches under memcheck, $full in the full tests"
echo "dry run: 8 stages ok; the sanitizer set launches $red kernels of the full $full"

# ---- --budget: the largest estimates go first, build stays -------------------
out=$(OUT="$t/plan" KVT_GPU_WORK="$t/planwork" sh "$script" all --budget 200 --plan 2>&1) || bad "--plan exit $?"
case $out in
*"plan: build kernels pools bench-copy bench-tier (est 165s of 200s)"*) ;;
*) bad "--budget 200: planned '$out'" ;;
esac
order=$(printf '%s\n' "$out" | sed -n 's/: dropped.*//p' | tr '\n' ' ')
[ "$order" = "racecheck memcheck bench-attn " ] || bad "drop order '$order'"
out=$(OUT="$t/plan" KVT_GPU_WORK="$t/planwork" sh "$script" all --budget 0 --plan 2>&1)
case $out in *"plan: build (est 45s"*) ;; *) bad "--budget 0: planned '$out'" ;; esac

# ---- a stage past its timeout --------------------------------------------------
KVT_GPU_DRYRUN=1 KVT_GPU_STAGE_CAP=1 O="$O" OUT="$t/cap" KVT_GPU_WORK="$t/capwork" sh "$script" pools \
    > "$t/cap.out" 2>&1
rc=$?
[ $rc -eq 1 ] || bad "a stage past its timeout: exit $rc, not 1"
grep -q '"stage":"pools","status":"timeout","rc":124' "$t/cap/stages.json" ||
    bad "timeout not recorded: $(cat "$t/cap/stages.json")"
grep -q '^=== test_cu_pool-emu' "$t/cap/tests.log" || bad "no partial log after the timeout"

# ---- the GPU path, up to the device: a stand-in nvidia-smi ----------------------
# (the real binaries exit 77 here: a GPU test that finds no device fails its
# stage on a GPU run; the build asks for the device's arch alone)
if command -v nvidia-smi > /dev/null 2>&1; then
    echo "nvidia-smi present: the stand-in GPU path is not checked"
else
    mkdir -p "$t/bin"
    printf '#!/bin/sh\ncase "$*" in\n*-L*) echo "GPU 0: stand-in H100" ;;\n*compute_cap*) echo "9.0" ;;\n*) echo stand-in ;;\nesac\n' \
        > "$t/bin/nvidia-smi"
    chmod +x "$t/bin/nvidia-smi"
    PATH="$t/bin:$PATH" KVT_GPU_DEPS="$t/none" O="$O" OUT="$t/gpu" KVT_GPU_WORK="$t/gpuwork" sh "$script" build kernels \
        > "$t/gpu.out" 2>&1
    rc=$?
    [ $rc -eq 1 ] || bad "stand-in GPU: exit $rc, not 1"
    grep -q "NVCC_ARCH='-gencode arch=compute_90,code=sm_90' gpu-bins" "$t/gpu/summary.txt" ||
        bad "stand-in GPU: the build did not ask for sm_90 alone: $(head -n 3 "$t/gpu/summary.txt")"
    grep -q '"stage":"kernels","status":"failed","rc":77' "$t/gpu/stages.json" ||
        bad "stand-in GPU: skipped GPU tests not a failure: $(cat "$t/gpu/stages.json")"
    n=$(ls "$t/gpu" | wc -l)
    [ "$n" -le 8 ] || bad "stand-in GPU: $n files in OUT (the device tool brings back 8)"
fi
n=$(ls "$t/all" | wc -l)
[ "$n" -le 8 ] || bad "dry run: $n files in OUT (the device tool brings back 8)"

# ---- refusals ------------------------------------------------------------------
for args in "" "nonsense" "all --budget" "all --budget 5m"; do
    # shellcheck disable=SC2086
    sh "$script" $args > /dev/null 2>&1
    rc=$?
    [ $rc -eq 2 ] || bad "gpu-session.sh $args: exit $rc, not 2"
done
[ $fail -eq 0 ] && echo "gpu-session dry run: stages, files, budget, timeout and refusals ok"
exit $fail
