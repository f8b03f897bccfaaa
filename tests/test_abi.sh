#!/bin/sh
# ABI guard (make abi-check): the library built under $O against the
# baseline lib/libkvtier.abi written by make abi-dump at the last release.
#   1. tests/test_symbols.sh: readelf --dyn-syms matches lib/libkvtier.map.
#   2. symbol versions: no baseline symbol is gone or moved, and every new
#      symbol is in a version node the baseline does not have (a new node
#      of lib/libkvtier.map, e.g. KVTIER_0.2 { global: ...; } KVTIER_0.1;).
#   3. abidiff (the baseline has public-header types only): fails on an
#      error, on an incompatible change and on any change other than an
#      addition (a type whose layout changed, a function whose parameters
#      changed). Structs whose first member is struct_size may grow at
#      their end: that is how this API extends them. The report is by leaf
#      change (-l), so that this allowance covers only the struct_size
#      struct's own new members: a struct it embeds that grows, or a
#      member inserted before its end, is still reported.
set -eu
O=${O:-build}
ABI_FILE=${ABI_FILE:-lib/libkvtier.abi}
ABI_HDRS=${ABI_HDRS:-include/kvtier}
so=$(ls "$O"/lib/libkvtier.so.*.*.* | head -n 1)
fail=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

[ -f "$ABI_FILE" ] || { echo "abi: no baseline $ABI_FILE (make abi-dump)"; exit 1; }
readelf -S -W "$so" | grep -q '\.debug_info' || {
  echo "abi: $so has no debug info: build it with CFLAGS containing -g"; exit 1; }

# 1. exports against the version script and the headers
O=$O sh tests/test_symbols.sh || fail=1

# 2. symbol versions: name@node, baseline (abixml) and current (readelf)
sed -n "s/.*<elf-symbol name='\([^']*\)' version='\([^']*\)'.*/\1@\2/p" "$ABI_FILE" \
  | sort -u > "$tmp/base"
[ -s "$tmp/base" ] || { echo "abi: no versioned symbols in $ABI_FILE"; exit 1; }
readelf --dyn-syms -W "$so" \
  | awk '($5 == "GLOBAL" || $5 == "WEAK") && $7 != "UND" && $7 != "ABS" {print $8}' \
  | sed 's/@@*/@/' | sort -u > "$tmp/cur"
sed 's/.*@//' "$tmp/base" | sort -u > "$tmp/nodes"
gone=$(comm -23 "$tmp/base" "$tmp/cur")
if [ -n "$gone" ]; then
  echo "abi: baseline symbols missing from $so (removed, or moved to another node):"
  printf '    %s\n' $gone; fail=1
fi
for s in $(comm -13 "$tmp/base" "$tmp/cur"); do
  node=${s#*@}
  case $node in "$s") node="";; esac       # unversioned
  if [ -z "$node" ] || grep -qxF "$node" "$tmp/nodes"; then
    echo "abi: new symbol ${s%@*} is in node ${node:-(none)}, which is already released;"
    echo "     list it in a new node of lib/libkvtier.map, e.g."
    echo "     KVTIER_0.2 { global: ${s%@*}; } $(tail -n 1 "$tmp/nodes");"
    fail=1
  fi
done

# 3. abidiff. The baseline holds only what the public headers declare
# (abidw --headers-dir include/kvtier --drop-private-types): the library's
# own types appear there as declarations only, so their changes are not
# compared. The current library is read without --headers-dir2: with it,
# abidiff 2.2 also filters out changes to types defined outside
# include/kvtier (a uint32_t parameter made uint64_t passed), and with
# --headers-dir1 on an abixml file it asserts.
# Exit status bits: 1 error, 2 usage error, 4 ABI change, 8 incompatible
# ABI change (abidiff sets 8 only for removals: a layout change is 4).
for t in $(awk '/^typedef struct [a-z0-9_]+ \{/ {n = $3; getline; if ($2 == "struct_size;") print n}' \
           "$ABI_HDRS"/*.h); do
  printf '[suppress_type]\n  label = %s grows at its end (struct_size)\n  type_kind = struct\n  name = %s\n  has_data_member_inserted_at = end\n\n' \
    "$t" "$t"
done > "$tmp/grow.suppr"
rc=0
abidiff --exported-interfaces-only --no-architecture --no-corpus-path --leaf-changes-only \
  --fail-no-debug-info --suppressions "$tmp/grow.suppr" \
  "$ABI_FILE" "$so" > "$tmp/diff" 2>&1 || rc=$?
if [ $((rc & 3)) -ne 0 ]; then
  cat "$tmp/diff"; echo "abi: abidiff failed (exit $rc)"; exit 1
fi
if [ $((rc & 8)) -ne 0 ]; then
  cat "$tmp/diff"; echo "abi: INCOMPATIBLE ABI change against $ABI_FILE"; fail=1
elif [ $((rc & 4)) -ne 0 ]; then
  # Additions alone are fine (their nodes were checked above); anything
  # changed or removed is not.
  if grep -qE 'leaf types summary: [1-9]|(^|[^0-9])[1-9][0-9]* (Removed|Changed)' "$tmp/diff"; then
    cat "$tmp/diff"; echo "abi: ABI change against $ABI_FILE (types or functions changed)"; fail=1
  else
    sed 's/^/    /' "$tmp/diff"
  fi
fi
[ $fail = 0 ] || exit 1
echo "abi: $(wc -l < "$tmp/cur") symbols; compatible with $ABI_FILE" \
  "(nodes $(tr '\n' ' ' < "$tmp/nodes" | sed 's/ $//'))"
