#!/bin/sh
# The C++17 consumer example (examples/cpp): tiered_loop.cpp and its RAII
# wrapper kvtier.hpp compile with warnings fatal against the build tree's
# headers and shared library, and the tiered decode loop runs and matches
# its own reference attention ("C++ tiered loop: ok").
# Environment: O (build tree, default build), CXX (default c++), CXXFLAGS
# (default -O2 -g). Exit 77 (skipped) when no C++ compiler is found.
set -eu
O=${O:-build}
CXX=${CXX:-c++}
CXXFLAGS=${CXXFLAGS:--O2 -g}
command -v "${CXX%% *}" >/dev/null 2>&1 || { echo "no C++ compiler ($CXX): skipped"; exit 77; }
[ -e "$O/lib/libkvtier.so" ] || { echo "$O/lib/libkvtier.so missing: run make first"; exit 1; }
libdir=$(cd "$O/lib" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvt_cpp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086 # CXX and CXXFLAGS may hold several words
$CXX -std=c++17 -Wall -Wextra -Wpedantic -Werror $CXXFLAGS -Iinclude -Iexamples/cpp \
  examples/cpp/tiered_loop.cpp -o "$tmp/tiered_loop" \
  -L"$libdir" -lkvtier -Wl,-rpath,"$libdir"
"$tmp/tiered_loop" > "$tmp/out" 2>&1 || { cat "$tmp/out"; echo "tiered_loop failed"; exit 1; }
cat "$tmp/out"
grep -q '^C++ tiered loop: ok$' "$tmp/out" || { echo "tiered_loop: no ok line"; exit 1; }
