#!/bin/sh
# kvtier-profile end to end on a small synthetic model: a recorded trace
# built into a profile, the same run profiled live through the step plan
# (the two must mark the same unstable heads: compare prints 1.000), the
# designed unstable heads found exactly, show, a trace-level error, and
# the documented exit status for usage errors.
set -eu
O=${O:-build}
bin="$O/bin/kvtier-profile"
work=$(mktemp -d /tmp/kvtier-profile.XXXXXX)
trap 'rm -rf "$work"' EXIT
src="--layers 2 --kv-heads 8 --gqa 2 --head-dim 32 --prompt 512 --steps 48 --budget 128 --seed 7"

"$bin" record $src -o "$work/t.trace" >/dev/null 2>"$work/record.err"
"$bin" build "$work/t.trace" -o "$work/built.kvtprof" >"$work/build.out" 2>/dev/null
"$bin" live $src -o "$work/live.kvtprof" >/dev/null 2>&1
"$bin" compare "$work/built.kvtprof" "$work/live.kvtprof" >"$work/cmp.out"
grep -q '^  \[ 0\]  1.000  1.000$' "$work/cmp.out" || { cat "$work/cmp.out"; echo "live and built profiles differ"; exit 1; }

# The designed unstable heads (from the model's stderr line) are the ones marked U.
designed=$(sed -n 's/^synthetic model:.*designed unstable://p' "$work/record.err" | tr ' ' '\n' | grep . | sort)
marked=$(awk '/^  layer/ { l = $2 + 0; for (h = 3; h <= NF; h++) if ($h == "U") printf "L%d.H%d\n", l, h - 3 }' "$work/build.out" | sort)
[ -n "$designed" ] && [ "$designed" = "$marked" ] || { echo "designed: $designed"; echo "marked: $marked"; exit 1; }

"$bin" show "$work/built.kvtprof" --ctx 4096 | grep -q '^unstable: 4 heads (25.0%)' || { echo "show: wrong summary"; exit 1; }

# A damaged trace is refused with a message, a damaged profile too.
# (cut inside the last record, wherever the records' boundaries fall)
head -c $(( $(wc -c < "$work/t.trace") - 3 )) "$work/t.trace" > "$work/cut.trace"
if "$bin" build "$work/cut.trace" -o "$work/x.kvtprof" 2>"$work/err"; then echo "cut trace accepted"; exit 1; fi
grep -q truncated "$work/err" || { cat "$work/err"; exit 1; }
head -c 100 "$work/built.kvtprof" > "$work/cut.kvtprof"
if "$bin" show "$work/cut.kvtprof" 2>"$work/err" >/dev/null; then echo "cut profile accepted"; exit 1; fi
grep -q KVT_ECORRUPT "$work/err" || { cat "$work/err"; exit 1; }

# Usage errors exit 2.
set +e
"$bin" frobnicate >/dev/null 2>&1; [ $? -eq 2 ] || { echo "unknown command: not 2"; exit 1; }
"$bin" live --model decoder -o "$work/y" >/dev/null 2>&1; [ $? -eq 2 ] || { echo "--model decoder: not 2"; exit 1; }
"$bin" compare "$work/built.kvtprof" >/dev/null 2>&1; [ $? -eq 2 ] || { echo "compare of one: not 2"; exit 1; }
set -e
echo "kvtier-profile: record/build, live, compare, show and errors behave"
