#!/bin/sh
# kvtier-bench --backend cuda: the smoke run (tiny sizes; results checked
# against host references, copies byte-exact) on the CPU emulation of CUDA,
# and on the GPU when there is one (exit 77 from the GPU build = no device).
O=${O:-build}
set -e
"$O/bin/kvtier-bench-emu" --backend cuda all --smoke --json-only > "$O/bench-cuda-emu.json"
grep -q '"bench":"cuda"' "$O/bench-cuda-emu.json"
rc=0
"$O/bin/kvtier-bench" --backend cuda all --smoke --json-only > "$O/bench-cuda.json" || rc=$?
case $rc in
  0|77) ;;
  *) echo "kvtier-bench --backend cuda all --smoke failed (exit $rc)"; cat "$O/bench-cuda.json"; exit 1 ;;
esac
echo "test_bench_cuda: emulated smoke run ok; GPU run exit $rc (77 = no device)"
