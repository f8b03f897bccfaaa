#!/bin/sh
# The GPU session's scripts (examples/bench/gpu-deps.sh, gpu-session.sh).
# gpu-deps.sh install, fed stand-in .deb files built here with dpkg-deb,
# unpacks them (with dpkg, and again with ar + tar where dpkg is missing)
# and writes build configs that point at them; it refuses a folder with no
# .deb files or without a needed library. gpu-session.sh exits 77 at every
# stage where there is no GPU (its dry run is tests/test_gpu_session.sh). Both print their usage on bad arguments.
set -u
command -v dpkg-deb > /dev/null 2>&1 || { echo "dpkg-deb not installed: skipped"; exit 77; }
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }

# standin DIR WITHOUT: a package with the libraries and headers gpu-deps.sh
# checks for, less the file named WITHOUT.
standin() {
    p=$t/pkg-$2
    mkdir -p "$p/DEBIAN" "$p/usr/lib/x86_64-linux-gnu" "$p/usr/include" "$1"
    printf 'Package: kvt-standin\nVersion: 1\nArchitecture: amd64\nMaintainer: kvtier <kvtier@localhost>\nDescription: test\n' \
        > "$p/DEBIAN/control"
    for f in lib/x86_64-linux-gnu/liburing.so lib/x86_64-linux-gnu/libnuma.so \
             lib/x86_64-linux-gnu/libcmocka.so include/liburing.h include/numa.h include/cmocka.h; do
        [ "$(basename "$f")" = "$2" ] || echo "$f" > "$p/usr/$f"
    done
    dpkg-deb -Zgzip --build "$p" "$1/standin.deb" > /dev/null || bad "dpkg-deb --build"
}

check_install() { # $1: label, $2: PATH for the script
    rm -rf "$t/o" "$t/deps"
    line=$(PATH=$2 O="$t/o" KVT_DEPS="$t/deps" sh examples/bench/gpu-deps.sh install "$t/good") ||
        bad "$1: install failed"
    lib=$t/deps/usr/lib/x86_64-linux-gnu
    [ "$line" = "export LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" ] ||
        bad "$1: printed '$line'"
    [ "$(cat "$lib/libnuma.so" 2> /dev/null)" = "lib/x86_64-linux-gnu/libnuma.so" ] ||
        bad "$1: libnuma.so not unpacked"
    grep -qx "DEP_CFLAGS := -I$t/deps/usr/include" "$t/o/config.mk" || bad "$1: DEP_CFLAGS"
    grep -qx "DEP_LIBS := -L$lib -luring -lnuma" "$t/o/config.mk" || bad "$1: DEP_LIBS"
    grep -qx "CMOCKA_LIBS := -L$lib -lcmocka" "$t/o/config-test.mk" || bad "$1: CMOCKA_LIBS"
    grep -qx "BLAS_LIBS :=" "$t/o/config-decode.mk" || bad "$1: config-decode.mk"
}

standin "$t/good" none
check_install "dpkg" "$PATH"
# Without dpkg: a PATH holding only the tools the ar + tar path uses.
mkdir -p "$t/bin"
for x in sh mkdir mktemp rm ar tar xz gzip zstd dirname basename cat ls; do
    p=$(command -v "$x") && ln -s "$p" "$t/bin/$x"
done
if [ -e "$t/bin/ar" ] && [ -e "$t/bin/tar" ] && [ -e "$t/bin/gzip" ]; then
    check_install "ar + tar" "$t/bin"
else
    echo "ar, tar or gzip missing: the path without dpkg is not checked"
fi

standin "$t/nonuma" libnuma.so
out=$(O="$t/o2" KVT_DEPS="$t/deps2" sh examples/bench/gpu-deps.sh install "$t/nonuma" 2>&1) &&
    bad "a package set without libnuma.so was accepted"
case $out in *libnuma.so\ missing*) ;; *) bad "no libnuma.so: said '$out'" ;; esac
mkdir -p "$t/empty"
out=$(sh examples/bench/gpu-deps.sh install "$t/empty" 2>&1) && bad "an empty folder was accepted"
case $out in *"no .deb files"*) ;; *) bad "empty folder: said '$out'" ;; esac
sh examples/bench/gpu-deps.sh 2> /dev/null
[ $? -eq 2 ] || bad "gpu-deps.sh without arguments: not exit 2"

sh examples/bench/gpu-session.sh nonsense 2> /dev/null
[ $? -eq 2 ] || bad "gpu-session.sh nonsense: not exit 2"
if command -v nvidia-smi > /dev/null 2>&1; then
    echo "nvidia-smi present: the no-GPU exits are not checked"
else
    for st in all build kernels pools memcheck racecheck bench-attn bench-copy bench-tier; do
        O="$t/o3" KVT_GPU_DEPS="$t/none" sh examples/bench/gpu-session.sh "$st" > /dev/null 2>&1
        rc=$?
        [ $rc -eq 77 ] || bad "gpu-session.sh $st without a GPU: exit $rc, not 77"
    done
fi
[ $fail -eq 0 ] && echo "gpu scripts: install (dpkg, ar + tar), refusals and no-GPU exits ok"
exit $fail
