#!/bin/sh
# The Rust consumer (examples/rust): make install into a temporary DESTDIR,
# then `cargo test --offline` on a copy of the crate, which finds the
# installed library through `pkg-config --cflags --libs kvtier` only (no
# path into the source tree): the layout test (every options struct against
# a C program compiled with the installed headers) and a tiered decode loop.
# Exits 77 (skipped) when cargo is not installed.
set -eu
O=${O:-build}
MAKE=${MAKE:-make}

if ! command -v cargo >/dev/null 2>&1; then
  if [ -n "${HOME:-}" ] && [ -x "$HOME/.cargo/bin/cargo" ]; then
    PATH="$HOME/.cargo/bin:$PATH"
    export PATH
  else
    echo "test_rust: cargo not installed; skipped"
    exit 77
  fi
fi
command -v pkg-config >/dev/null 2>&1 || { echo "test_rust: pkg-config not installed"; exit 1; }

top=$(pwd)
tmp=$(mktemp -d /tmp/kvtier-rust.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
dest="$tmp/dest"

$MAKE -s O="$O" install DESTDIR="$dest" PREFIX=/usr LIBDIR=/usr/lib >/dev/null
export PKG_CONFIG_PATH="$dest/usr/lib/pkgconfig"
export PKG_CONFIG_SYSROOT_DIR="$dest"
echo "test_rust: pkg-config --cflags --libs kvtier: $(pkg-config --cflags --libs kvtier)"

# A copy of the crate, so that neither target/ nor Cargo.lock lands in the tree.
mkdir "$tmp/crate"
cp -R "$top/examples/rust/." "$tmp/crate/"
rm -rf "$tmp/crate/target" "$tmp/crate/Cargo.lock"
export CARGO_TARGET_DIR="$tmp/target"
unset LD_LIBRARY_PATH || true  # the tests must find the library by the rpath

cd "$tmp/crate"
cargo test --offline

# The test programs load the installed library (rpath from pkg-config's -L).
if command -v ldd >/dev/null 2>&1; then
  for t in "$CARGO_TARGET_DIR"/debug/deps/decode-*; do
    if [ ! -f "$t" ] || [ ! -x "$t" ]; then continue; fi
    so=$(ldd "$t" | sed -n 's/.*libkvtier\.so[^ ]* => \([^ ]*\).*/\1/p')
    case "$so" in
      "$dest"/usr/lib/*) ;;
      *) echo "test_rust: $t loads libkvtier from '${so:-nowhere}', not $dest/usr/lib"; exit 1 ;;
    esac
  done
fi
echo "test_rust: ok (libkvtier from ${so:-?})"
