#!/bin/sh
# The library's Redis Cluster key slots against a redis-server's own
# CLUSTER KEYSLOT: one cluster-enabled node on a unix socket in a temp dir
# (no TCP port), 500 keys - random ones, hash tags, empty and unbalanced
# braces - then the server is shut down. Exit 77 when redis-server is not
# installed (CI installs it: .ci/run).
set -eu
O=${O:-build}
BIN="$O/tests/test_redis_slot"
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || {
  echo "redis-server/redis-cli not installed: skipped"; exit 77; }
[ -x "$BIN" ] || { echo "no $BIN"; exit 1; }
TMP=$(mktemp -d)
SOCK="$TMP/redis.sock"
stop() {
  redis-cli -s "$SOCK" shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$TMP"
}
trap stop EXIT
redis-server --port 0 --unixsocket "$SOCK" --unixsocketperm 700 --cluster-enabled yes \
  --cluster-config-file "$TMP/nodes.conf" --dir "$TMP" --save "" --appendonly no \
  --daemonize yes --logfile "$TMP/redis.log"
i=0
until redis-cli -s "$SOCK" ping 2>/dev/null | grep -q PONG; do
  i=$((i + 1)); [ $i -lt 100 ] || { cat "$TMP/redis.log"; echo "FAIL: redis-server did not start"; exit 1; }
  sleep 0.05
done
# Keys: fixed edge cases, then pseudo-random ones (awk, seeded).
{
  printf '%s\n' "foo" "bar" "hello" "{user1000}.following" "foo{}{bar}" "foo{{bar}}zap" \
    "foo{bar" "}{" "{}" "{a}" "x{y}z{w}" "kvt:m1:{p7}:c3"
  awk 'BEGIN { srand(26); for (i = 0; i < 488; i++) { n = 1 + int(rand() * 24); s = "";
       for (j = 0; j < n; j++) { c = int(rand() * 64);
         s = s substr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}:.", c + 1, 1) }
       print s } }'
} >"$TMP/keys"
"$BIN" - <"$TMP/keys" >"$TMP/ours"
while IFS= read -r k; do redis-cli -s "$SOCK" cluster keyslot "$k"; done <"$TMP/keys" >"$TMP/theirs"
n=$(wc -l <"$TMP/keys")
[ "$n" -eq 500 ] || { echo "FAIL: $n keys"; exit 1; }
if ! cmp -s "$TMP/ours" "$TMP/theirs"; then
  paste "$TMP/keys" "$TMP/ours" "$TMP/theirs" | awk -F'\t' '$2 != $3' | head -5
  echo "FAIL: key slots differ from redis-server's CLUSTER KEYSLOT"; exit 1
fi
echo "redis key slots: $n keys agree with redis-server $(redis-server --version | sed -n 's/.*v=\([^ ]*\).*/\1/p')"
