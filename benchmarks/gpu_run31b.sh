#!/usr/bin/env bash
# Device run 31b: the top-p kernel's warps per program end to end (run 31's launch sweep had 8 beating the shipped
# 16 on the cut-off alone). A copy of the tree with num_warps=8 as top_p_cutoff's default against this tree,
# benchmarks/sampling_throughput.py on the Qwen3-0.6B shape, ROUNDS alternating rounds (each a fresh process).
# From the repo root on the device, with .whl carried:   bash benchmarks/gpu_run31b.sh [ROUNDS]   (~5.5 min for 3)
set -u
source benchmarks/device_setup.sh sampling
ROUNDS=${1:-3}
rm -rf /tmp/w8 && mkdir -p /tmp/w8 && cp -r strataserve benchmarks tests /tmp/w8/
sed -i 's/num_warps: int = 16,/num_warps: int = 8,/' /tmp/w8/strataserve/kernels/top_p.py
grep -c "num_warps: int = 8," /tmp/w8/strataserve/kernels/top_p.py
CKPT=/tmp/q06
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
for r in $(seq 0 $((ROUNDS - 1))); do
  if (( r % 2 == 0 )); then order="w16 w8"; else order="w8 w16"; fi
  for v in $order; do
    if (( SECONDS > 480 )); then echo "stopping before $v-r$r: ${SECONDS}s used"; break 2; fi
    if [[ $v == w8 ]]; then dir=/tmp/w8; else dir=.; fi
    (cd $dir && PYTHONPATH=/tmp/site:.:tests STRATA_TOP_P=kernel timeout 90 python3 benchmarks/sampling_throughput.py \
      $CKPT --workloads greedy,topp,topp_seeded --label "$v-r$r" 2>/dev/null) | tee -a "$OUTDIR/sampling_warps.jsonl" \
      | python3 -c 'import json, sys
for d in map(json.loads, sys.stdin):
    print(d["label"], d["workload"], d["tok_per_s"], d["strataserve"])'
  done
done
