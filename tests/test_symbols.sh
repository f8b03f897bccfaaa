#!/bin/sh
# The shared library exports exactly the functions listed in the version
# script, all named kvt_*, all in a KVTIER_* version node; and every public
# header declaration is exported.
set -eu
O=${O:-build}
so=$(ls "$O"/lib/libkvtier.so.*.*.* | head -n 1)
exported=$(readelf --dyn-syms -W "$so" | awk '$5 == "GLOBAL" && $7 != "UND" && $7 != "ABS" {print $8}' | sort)
bad=$(printf '%s\n' "$exported" | grep -v '^kvt_[a-z0-9_]*@@KVTIER_[0-9.]*$' || true)
[ -z "$bad" ] || { echo "exported symbols outside kvt_*@@KVTIER_*:"; echo "$bad"; exit 1; }
names=$(printf '%s\n' "$exported" | sed 's/@@.*//' | sort)
listed=$(sed 's:/\*.*\*/::' lib/libkvtier.map | grep -oE '\bkvt_[a-z0-9_]+;' | tr -d ';' | sort)
declared=$(cat include/kvtier/*.h | grep -oE 'KVT_API [^;]*\bkvt_[a-z0-9_]+\(' | grep -oE 'kvt_[a-z0-9_]+\($' | tr -d '(' | sort -u)
[ "$names" = "$listed" ] || { echo "exported vs version script differ:"; \
  printf '%s\n' "$names" > /tmp/kvt_e.$$; printf '%s\n' "$listed" > /tmp/kvt_l.$$; \
  diff /tmp/kvt_e.$$ /tmp/kvt_l.$$; rm -f /tmp/kvt_e.$$ /tmp/kvt_l.$$; exit 1; }
[ "$names" = "$declared" ] || { echo "exported vs KVT_API declarations differ:"; \
  printf '%s\n' "$names" > /tmp/kvt_e.$$; printf '%s\n' "$declared" > /tmp/kvt_d.$$; \
  diff /tmp/kvt_e.$$ /tmp/kvt_d.$$; rm -f /tmp/kvt_e.$$ /tmp/kvt_d.$$; exit 1; }
# soname and links
readelf -d "$so" | grep -q 'SONAME.*\[libkvtier.so.0\]' || { echo "bad soname"; exit 1; }
echo "symbols: $(printf '%s\n' "$names" | wc -l) exported, all kvt_*, matching lib/libkvtier.map and the headers"
