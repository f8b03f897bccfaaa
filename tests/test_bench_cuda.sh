#!/bin/sh
# kvtier-bench --backend cuda: the smoke runs (tiny sizes; results checked
# against host references, copies byte-exact, the tiered loop's outputs
# against a device-only pool's) on the CPU emulation of CUDA, and on the GPU
# when there is one (exit 77 from the GPU build = no device).
O=${O:-build}
set -e
for cmd in all tier; do
  "$O/bin/kvtier-bench-emu" --backend cuda $cmd --smoke --json-only > "$O/bench-cuda-emu-$cmd.json"
  grep -q "\"cmd\":\"$([ $cmd = all ] && echo attn || echo tier)\"" "$O/bench-cuda-emu-$cmd.json"
  rc=0
  "$O/bin/kvtier-bench" --backend cuda $cmd --smoke --json-only > "$O/bench-cuda-$cmd.json" || rc=$?
  case $rc in
    0|77) ;;
    *) echo "kvtier-bench --backend cuda $cmd --smoke failed (exit $rc)"; cat "$O/bench-cuda-$cmd.json"; exit 1 ;;
  esac
done
echo "test_bench_cuda: emulated smoke runs ok; GPU run exit $rc (77 = no device)"
