#!/bin/sh
# kvtier-bench prefix, small: the summary carries the issue's keys; with a
# host tier that holds every distinct page the cache saves exactly what an
# ideal infinite cache would (nothing reclaimed) and attaches pages; with a
# device tier for an eighth of the KV and no host tier it must reclaim, and
# saves less. The bench itself checks the pool's counters against the
# sequences' and runs kvt_pool_check after each case.
set -eu
O=${O:-build}
BIN="$O/bin/kvtier-bench"
[ -x "$BIN" ] || { echo "no $BIN"; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
small="--convs 6 --system 256 --turns 3 --turn-tokens 48 --layers 2 --kv-heads 2 --head-dim 64 --runs 1"
key() { sed -n "s/.*\"$1\":\\([^,}]*\\).*/\\1/p" "$2" | tail -1; }

# shellcheck disable=SC2086
"$BIN" prefix $small >"$TMP/a" 2>"$TMP/e" || { cat "$TMP/e"; fail "kvtier-bench prefix"; }
grep -q '"summary":"prefix"' "$TMP/a" || fail "no summary line"
for k in prefix_saved_vs_ideal attach_ns_per_page bytes_vs_no_sharing workload_time_vs_no_cache; do
  [ -n "$(key $k "$TMP/a")" ] || fail "summary without $k"
done
[ "$(key prefix_saved_vs_ideal "$TMP/a")" = "1.0000" ] || fail "saved vs ideal: $(cat "$TMP/a")"
grep '"case":"cache"' "$TMP/a" | grep -q '"reclaimed_pages":0,' || fail "reclaimed with room for all"
[ "$(grep '"case":"no_cache"' "$TMP/a" | sed -n 's/.*"saved_tokens":\([0-9]*\).*/\1/p')" = 0 ] ||
  fail "the pool without the cache saved tokens"

# shellcheck disable=SC2086
"$BIN" prefix $small --device-frac 8 --host-num 0 >"$TMP/b" 2>"$TMP/e" ||
  { cat "$TMP/e"; fail "kvtier-bench prefix under pressure"; }
r=$(grep '"case":"cache"' "$TMP/b" | sed -n 's/.*"reclaimed_pages":\([0-9]*\).*/\1/p')
[ "$r" -gt 0 ] || fail "no page reclaimed with a device tier for 1/8 of the KV"
awk -v s="$(key prefix_saved_vs_ideal "$TMP/b")" 'BEGIN { exit !(s > 0 && s < 1) }' ||
  fail "saved vs ideal under pressure: $(key prefix_saved_vs_ideal "$TMP/b")"

# Bad command lines exit 2 with the usage.
for bad in "--convs 0" "--bogus 1" "--turns"; do
  rc=0
  # shellcheck disable=SC2086
  "$BIN" prefix $bad >/dev/null 2>"$TMP/e" || rc=$?
  [ $rc -eq 2 ] && grep -q "usage: kvtier-bench prefix" "$TMP/e" || fail "$bad: exit $rc (want 2 and the usage)"
done
echo "kvtier-bench prefix: keys, ideal with room, reclaim under pressure"
