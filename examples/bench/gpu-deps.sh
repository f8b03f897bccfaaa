#!/bin/sh
# Build dependencies for a GPU machine that cannot fetch packages (the lent
# GPU machines reach no package registry, and the Makefile's apt-get install
# of missing dependencies fails there).
#
#   sh examples/bench/gpu-deps.sh fetch DIR     # here, with Debian's registry:
#                                               # the .deb files into DIR
#   sh examples/bench/gpu-deps.sh install DIR   # there: unpack DIR's .deb files
#                                               # into $KVT_DEPS (/tmp/kvt-deps)
#                                               # and write $O's (build's)
#                                               # config*.mk to use them
#
# install prints the LD_LIBRARY_PATH line the programs then need (eval it).
# Only what the library, the GPU tests and kvtier-bench link is fetched:
# liburing, libnuma, cmocka. The example decoder's OpenBLAS is not, so on
# such a machine build the targets of the GPU session (gpu-tests,
# kvtier-bench; see gpu-session.sh), not `make all`.
set -eu

pkgs="liburing-dev liburing2 libnuma-dev libnuma1 libcmocka-dev libcmocka0"
cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || {
    echo "usage: sh examples/bench/gpu-deps.sh fetch|install DIR" >&2
    exit 2
}

case $cmd in
fetch)
    mkdir -p "$dir"
    # apt-get download writes into the current directory.
    (cd "$dir" && apt-get download $pkgs)
    ls -l "$dir"
    ;;
install)
    dest=${KVT_DEPS:-/tmp/kvt-deps}
    o=${O:-build}
    n=0
    mkdir -p "$dest" "$o"
    for f in "$dir"/*.deb; do
        [ -e "$f" ] || continue
        if command -v dpkg > /dev/null 2>&1; then
            dpkg -x "$f" "$dest"
        else # a .deb is an ar archive holding data.tar.*
            t=$(mktemp -d)
            fa=$(cd "$(dirname "$f")" && pwd)/$(basename "$f")
            (cd "$t" && ar x "$fa" && tar -xf data.tar.* -C "$dest")
            rm -rf "$t"
        fi
        n=$((n + 1))
    done
    [ "$n" -gt 0 ] || { echo "gpu-deps: no .deb files in $dir (run fetch first)" >&2; exit 1; }
    lib=$dest/usr/lib/x86_64-linux-gnu
    inc=$dest/usr/include
    for need in "$lib/liburing.so" "$lib/libnuma.so" "$lib/libcmocka.so" "$inc/liburing.h" \
                "$inc/numa.h" "$inc/cmocka.h"; do
        [ -e "$need" ] || { echo "gpu-deps: $need missing after unpacking" >&2; exit 1; }
    done
    # The Makefile regenerates these only when they are older than it, and
    # then with pkg-config; written now, they are newer.
    printf 'DEP_CFLAGS := -I%s\nDEP_LIBS := -L%s -luring -lnuma\n' "$inc" "$lib" > "$o/config.mk"
    printf 'BLAS_CFLAGS :=\nBLAS_LIBS :=\n' > "$o/config-decode.mk"
    printf 'CMOCKA_CFLAGS := -I%s\nCMOCKA_LIBS := -L%s -lcmocka\n' "$inc" "$lib" \
        > "$o/config-test.mk"
    echo "export LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    ;;
*)
    echo "usage: sh examples/bench/gpu-deps.sh fetch|install DIR" >&2
    exit 2
    ;;
esac
