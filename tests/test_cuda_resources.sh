#!/bin/sh
# Resource limits of the CUDA kernels, checked where no GPU is needed: the
# emulation (cuda/emu) has no registers, occupancy or local memory, so a
# kernel that a real GPU refuses to launch ("too many resources requested")
# or that spills to local memory would pass every emulated test. Compiles
# each cuda/*.cu to PTX and to cubins for the arches the Makefile builds and
# checks that
#  - every kernel entry declares its largest block (__launch_bounds__ ->
#    .maxntid in the PTX), so ptxas keeps its registers within what a block
#    of that size may use on every arch;
#  - ptxas reports no spill stores or loads and no stack frame (local
#    memory) for any kernel on sm_80 and sm_90 (static shared memory above
#    48 KiB ptxas refuses itself).
# Prints every kernel's registers and shared memory (the figures quoted in
# examples/bench/RESULTS.md). Exits 77 without nvcc.
set -u
NVCC=${NVCC:-$(command -v nvcc 2>/dev/null || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
[ -x "$NVCC" ] || { echo "nvcc not found: skipped"; exit 77; }
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }
flags="-std=c++17 -O2 -Iinclude -Icuda"
kernels=0
for f in cuda/*.cu; do
    b=$(basename "$f" .cu)
    "$NVCC" $flags -ptx -arch=compute_80 "$f" -o "$t/$b.ptx" 2> "$t/$b.ptx.err" ||
        { cat "$t/$b.ptx.err"; bad "$f: nvcc -ptx failed"; continue; }
    # An entry's directives (.maxntid ...) sit between its parameter list
    # and its body's opening brace.
    awk -v f="$f" '
        /^(\.visible )?\.entry / { name = $NF; sub(/\($/, "", name); inent = 1; bounded = 0; next }
        inent && /\.maxntid/ { bounded = 1 }
        inent && /^\{/ { if (!bounded) { print "FAIL: " f ": kernel " name " has no __launch_bounds__"; bad = 1 }
                         n++; inent = 0 }
        END { print n + 0 > "/dev/stderr"; exit bad }' "$t/$b.ptx" 2> "$t/$b.n" || fail=1
    kernels=$((kernels + $(cat "$t/$b.n")))
    for sm in 80 90; do
        "$NVCC" $flags -cubin -arch=sm_$sm -Xptxas -v "$f" -o "$t/$b.$sm.cubin" \
            > "$t/$b.$sm.log" 2>&1 || { cat "$t/$b.$sm.log"; bad "$f: sm_$sm cubin failed"; continue; }
        # ptxas prints, per entry: "Compiling entry function 'NAME' for
        # 'sm_XX'", then the stack frame and spills, then "Used N registers,
        # ... S bytes smem".
        awk -v f="$f" -v sm="$sm" '
            /Compiling entry function/ { split($0, q, "'\''"); name = q[2] }
            /bytes stack frame/ {
                if ($0 !~ /^[ \t]*0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads/) {
                    print "FAIL: " f " sm_" sm " " name ": " $0; bad = 1 } }
            /Used [0-9]+ registers/ {
                regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
                smem = 0
                if ($0 ~ /bytes smem/) { smem = $0; sub(/ bytes smem.*/, "", smem); sub(/.*, /, "", smem) }
                printf "  sm_%s %-4s regs %6s B smem  %s\n", sm, regs, smem, name }
            END { exit bad }' "$t/$b.$sm.log" > "$t/$b.$sm.out" || fail=1
        if command -v c++filt > /dev/null 2>&1; then c++filt < "$t/$b.$sm.out"; else cat "$t/$b.$sm.out"; fi
    done
done
[ "$kernels" -gt 0 ] || bad "no kernel entry found in the PTX"
echo "kernels checked: $kernels"
[ "$fail" -eq 0 ] && echo "cuda resources: ok"
exit "$fail"
