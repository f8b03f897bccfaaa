#!/bin/sh
# Every public function has its man3 page, and every page renders without
# a groff warning.
set -eu
command -v groff >/dev/null 2>&1 || { echo "groff not installed: skipped"; exit 77; }
fail=0
for f in $(cat include/kvtier/*.h | grep -oE 'KVT_API [^;]*\bkvt_[a-z0-9_]+\(' | grep -oE 'kvt_[a-z0-9_]+\($' | tr -d '(' | sort -u); do
  [ -f "man/man3/$f.3" ] || { echo "no man page: man/man3/$f.3"; fail=1; }
done
[ -f man/man7/kvtier.7 ] || { echo "no man/man7/kvtier.7"; fail=1; }
for p in man/man1/*.1 man/man3/*.3 man/man5/*.5 man/man7/*.7; do
  out=$(groff -ww -z -man "$p" 2>&1) || { echo "$p: groff failed"; fail=1; }
  [ -z "$out" ] || { echo "$p:"; echo "$out"; fail=1; }
done
[ $fail -eq 0 ] && echo "man pages: $(ls man/man1/*.1 | wc -l) man1 + $(ls man/man3/*.3 | wc -l) man3 + $(ls man/man5/*.5 | wc -l) man5 + kvtier.7, all render cleanly"
exit $fail
