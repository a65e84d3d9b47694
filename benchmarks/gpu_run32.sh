#!/usr/bin/env bash
# Device run 32: token logprobs in one pass (kernels/token_logprobs.py) against the torch path (log_softmax copy,
# gather, rank count, topk). Phases (comma list, $1): tests (the new kernel's and the sampler's GPU tests), suite (the
# whole kernel suite), micro (benchmarks/logprobs_ab.py), e2e (benchmarks/sampling_throughput.py on the Qwen3-0.6B shape, greedy
# and greedy + logprobs 1 / 5, STRATA_LOGPROBS=torch against kernel, ROUNDS alternating rounds, each a fresh
# process). From the repo root on the device, with .whl carried:
#   bash benchmarks/gpu_run32.sh tests,micro,e2e 3          (~8 min)
set -u
source benchmarks/device_setup.sh "${1:-tests,micro,e2e}"
ROUNDS=${2:-3}
if phase tests; then
  STRATA_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_token_logprobs.py \
    tests/kernels/test_sampler_sync_gpu.py 2>&1 | tee "$OUTDIR/gpu_logprobs_tests.log" | tail -3
fi
if phase suite; then kernel_tests 200; fi
if phase micro; then
  timeout 150 python3 benchmarks/logprobs_ab.py 2>&1 | tee "$OUTDIR/logprobs_ab.jsonl" | tail -12
fi
if phase e2e; then
  CKPT=/tmp/q06
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
  for r in $(seq 0 $((ROUNDS - 1))); do
    if (( r % 2 == 0 )); then order="torch kernel"; else order="kernel torch"; fi
    for v in $order; do
      if (( SECONDS > ${STOP_AT:-470} )); then echo "stopping before $v-r$r: ${SECONDS}s used"; break 2; fi
      STRATA_LOGPROBS=$v timeout 120 python3 benchmarks/sampling_throughput.py $CKPT \
        --workloads greedy,logprobs,logprobs5 --label "$v-r$r" 2>/dev/null | tee -a "$OUTDIR/sampling_logprobs.jsonl" \
        | python3 -c 'import json, sys
for d in map(json.loads, sys.stdin):
    print(d["label"], d["workload"], d["tok_per_s"])'
    done
  done
fi
echo "total ${SECONDS}s"
