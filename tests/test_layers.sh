#!/bin/sh
# The layering of lib/ (lib/README.md): ../shared/tools/layers.py prints
# which area calls functions of which other area and fails on a cycle; this
# test also fails on any call that goes up the documented order
#   core < select, attn, policy < backend < tier < step < api
# (an area may call only areas of a lower rank; the three of rank 1 do not
# call each other). Skipped (77) where the tool or Universal Ctags is absent.
tool=${KVT_LAYERS_TOOL:-../shared/tools/layers.py}
[ -f "$tool" ] || { echo "skipped: $tool not found"; exit 77; }
command -v ctags > /dev/null 2>&1 || { echo "skipped: Universal Ctags not installed"; exit 77; }
command -v python3 > /dev/null 2>&1 || { echo "skipped: python3 not installed"; exit 77; }
out=$(python3 "$tool" .)
rc=$?
echo "$out" | grep -v '^    '
[ $rc -eq 0 ] || { echo "$out" | grep '^    '; echo "FAIL: layers.py exit $rc (a cycle)"; exit 1; }
rank() {
    case $1 in
    core) echo 0 ;; select | attn | policy) echo 1 ;; backend) echo 2 ;; tier) echo 3 ;;
    step) echo 4 ;; api) echo 5 ;; *) echo x ;;
    esac
}
fail=0
edges=$(echo "$out" | sed -n 's/^\([a-z]*\) -> \(.*\)$/\1 \2/p' | tr -d ',')
[ -n "$edges" ] || { echo "FAIL: layers.py printed no edges"; exit 1; }
echo "$edges" | {
    while read -r from tos; do
        for to in $tos; do
            rf=$(rank "$from") rt=$(rank "$to")
            if [ "$rf" = x ] || [ "$rt" = x ]; then
                echo "FAIL: area $from or $to has no place in lib/README.md's order"
                fail=1
            elif [ "$rt" -ge "$rf" ]; then
                echo "FAIL: $from (rank $rf) calls $to (rank $rt): calls go down only"
                fail=1
            fi
        done
    done
    [ $fail -eq 0 ] && echo "layers: every call goes down core < select, attn, policy < backend < tier < step < api"
    exit $fail
}
