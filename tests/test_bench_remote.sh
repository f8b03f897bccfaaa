#!/bin/sh
# kvtier-bench remote, small: against a redis-server it starts itself on a
# unix socket, every value is written, fetched, checked and landed bit for
# bit (the bench exits 1 otherwise), and the summary carries the issue's
# keys with positive ratios. Exit 77 without redis-server/redis-benchmark,
# or when the library was built without hiredis (it must say so).
set -eu
O=${O:-build}
BIN="$O/bin/kvtier-bench"
[ -x "$BIN" ] || { echo "no $BIN"; exit 1; }
for p in redis-server redis-cli redis-benchmark; do
  command -v $p >/dev/null 2>&1 || { echo "$p not installed: skipped"; exit 77; }
done
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
key() { sed -n "s/.*\"$1\":\\([^,}]*\\).*/\\1/p" "$2" | tail -1; }
if ! "$BIN" remote --pages 16 --layers 2 --kv-heads 2 --head-dim 64 --runs 1 >"$TMP/a" 2>"$TMP/e"; then
  if grep -q "hiredis" "$TMP/e"; then echo "built without hiredis: skipped"; exit 77; fi
  cat "$TMP/e"; fail "kvtier-bench remote"
fi
grep -q '"summary":"remote"' "$TMP/a" || fail "no summary line"
for k in remote_put_vs_redis_benchmark remote_get_vs_redis_benchmark; do
  v=$(key $k "$TMP/a")
  [ -n "$v" ] || fail "summary without $k"
  awk -v v="$v" 'BEGIN { exit !(v ~ /^[0-9]+(\.[0-9]+)?$/ && v > 0) }' || fail "$k = $v"
done
[ "$(grep -c '"bench":"remote"' "$TMP/a")" = 1 ] || fail "want one run line"
[ "$(key values "$TMP/a")" = 16 ] || fail "values: $(cat "$TMP/a")"
echo "kvtier-bench remote: put $(key remote_put_vs_redis_benchmark "$TMP/a"), get $(key remote_get_vs_redis_benchmark "$TMP/a") of redis-benchmark (tiny run)"
