#!/bin/sh
# make install into a DESTDIR, then build out-of-tree C and C++ programs (the
# minimal example, the header consumer, examples/cpp's tiered loop) with
# `pkg-config --cflags --libs kvtier` against it and run them; then check
# that make uninstall removes every installed file. Then: a program linked
# from a non-system prefix finds the library at run time through an rpath
# (README), and fails to without one; and a build directory made with
# CUDA=0 installs a CUDA-less library (the configuration is remembered).
# (The Rust consumer is built against an installed tree by
# tests/test_rust.sh.)
set -eu
O=${O:-build}
MAKE=${MAKE:-make}
CC=${CC:-cc}
CXX=${CXX:-c++}
top=$(pwd)
dest=$(mktemp -d /tmp/kvtier-install.XXXXXX)
work=$(mktemp -d /tmp/kvtier-consumer.XXXXXX)
trap 'rm -rf "$dest" "$work"' EXIT

$MAKE -s O="$O" install DESTDIR="$dest" PREFIX=/usr LIBDIR=/usr/lib >/dev/null
for f in usr/include/kvtier/kvtier.h usr/include/kvtier/pool.h usr/lib/libkvtier.a \
         usr/lib/libkvtier.so usr/lib/libkvtier.so.0 usr/lib/pkgconfig/kvtier.pc \
         usr/share/man/man7/kvtier.7 usr/share/man/man3/kvt_pool_create.3 \
         usr/share/man/man5/kvtier-profile.5 usr/share/man/man1/kvtier-decode.1 \
         usr/include/kvtier/policy.h \
         usr/bin/kvtier-profile \
         usr/bin/kvtier-pool-demo; do
  [ -e "$dest/$f" ] || { echo "not installed: $f"; exit 1; }
done
[ "$(readlink "$dest/usr/lib/libkvtier.so")" = libkvtier.so.0 ] || { echo "bad .so link"; exit 1; }
ls "$dest"/usr/lib/libkvtier.so.0.* >/dev/null

export PKG_CONFIG_PATH="$dest/usr/lib/pkgconfig"
export PKG_CONFIG_SYSROOT_DIR="$dest"
flags=$(pkg-config --cflags --libs kvtier)
echo "pkg-config --cflags --libs kvtier: $flags"
cp "$top/examples/minimal.c" "$work/consumer.c"
cp "$top/tests/test_cxx_headers.cpp" "$work/consumer.cpp"
# The C++ example (RAII wrapper + tiered decode loop), out of the tree.
cp "$top/examples/cpp/kvtier.hpp" "$top/examples/cpp/tiered_loop.cpp" "$work/"
cd "$work"
$CC -std=c11 -Wall -Wextra -Werror consumer.c -o consumer_c $flags
$CXX -std=c++17 -Wall -Wextra -Werror consumer.cpp -o consumer_cxx $flags
$CXX -std=c++17 -Wall -Wextra -Werror -O2 tiered_loop.cpp -o tiered_loop $flags
LD_LIBRARY_PATH="$dest/usr/lib" ./consumer_c
LD_LIBRARY_PATH="$dest/usr/lib" ./consumer_cxx
LD_LIBRARY_PATH="$dest/usr/lib" ./tiered_loop | tail -n 1
# The static library links too (private deps from Libs.private/Requires.private).
# (no sysroot here: it would also prefix the CUDA toolkit's -L path)
sflags=$(PKG_CONFIG_SYSROOT_DIR= pkg-config --static --cflags --libs \
         --define-variable=libdir="$dest/usr/lib" --define-variable=includedir="$dest/usr/include" kvtier)
$CC -std=c11 consumer.c -o consumer_static "$dest/usr/lib/libkvtier.a" $(echo "$sflags" | sed 's/-lkvtier//')
./consumer_static

# A non-system prefix: the rpath README shows, and without it no library.
libdir=$(pkg-config --variable=libdir kvtier)
$CC -std=c11 consumer.c -o consumer_rpath $flags -Wl,-rpath,"$libdir"
env -u LD_LIBRARY_PATH ./consumer_rpath >/dev/null
if env -u LD_LIBRARY_PATH ./consumer_c >/dev/null 2>&1; then
  echo "a consumer without rpath ran: is libkvtier installed system-wide? (skipping that half)"
fi

cd "$top"
# make finds its own dependencies (hiredis's include dir) with the system's
# pkg-config: not through the installed tree's settings above.
unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR
$MAKE -s O="$O" uninstall DESTDIR="$dest" PREFIX=/usr LIBDIR=/usr/lib >/dev/null
left=$(find "$dest" -type f -o -type l)
[ -z "$left" ] || { echo "left after uninstall:"; echo "$left"; exit 1; }
# CUDA=0 is remembered by the build directory: `make install` there
# installs the CUDA-less library without compiling a kernel.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  ob=$(mktemp -d /tmp/kvtier-o.XXXXXX)
  d2=$(mktemp -d /tmp/kvtier-install2.XXXXXX)
  $MAKE -s O="$ob" lib CUDA=0 >/dev/null
  $MAKE -s O="$ob" install DESTDIR="$d2" PREFIX=/usr LIBDIR=/usr/lib >/dev/null
  if [ -d "$ob/obj/cuda" ] || nm "$d2/usr/lib/libkvtier.so.0" | grep -q "kvt__cu_malloc"; then
    echo "make install rebuilt with nvcc after make lib CUDA=0"; rm -rf "$ob" "$d2"; exit 1
  fi
  [ ! -d "$ob/bin" ] || { echo "make install built the example programs"; rm -rf "$ob" "$d2"; exit 1; }
  rm -rf "$ob" "$d2"
fi
echo "install/consumer/uninstall: ok"
