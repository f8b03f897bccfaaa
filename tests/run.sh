#!/bin/sh
# Runs test binaries and scripts, each under a timeout; exit 77 = skipped.
# VALGRIND, when set, prefixes every binary (not the scripts).
pass=0; fail=0; skip=0; failed=""
for t in "$@"; do
  case "$t" in
    *.sh) cmd="sh $t" ;;
    *) cmd="${VALGRIND:+$VALGRIND }$t" ;;
  esac
  name=$(basename "$t")
  echo "=== $name"
  timeout "${KVT_TEST_TIMEOUT:-600}" $cmd
  rc=$?
  case $rc in
    0) pass=$((pass+1)); echo "--- $name: ok" ;;
    77) skip=$((skip+1)); echo "--- $name: skipped" ;;
    124) fail=$((fail+1)); failed="$failed $name"; echo "--- $name: TIMEOUT" ;;
    *) fail=$((fail+1)); failed="$failed $name"; echo "--- $name: FAILED (exit $rc)" ;;
  esac
done
[ -n "$failed" ] && echo "failed:$failed"
echo "check: $pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
