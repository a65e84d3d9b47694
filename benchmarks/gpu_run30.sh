#!/usr/bin/env bash
# Device run 30 (issue 12 item 2: the sampler without host syncs; seeds, logprobs, penalties and min_tokens no
# longer keep a request synchronous). From the repo root on the device, with .whl and .oldtree carried (.oldtree:
# `git archive` of the tree before, strataserve/ without its assets):   bash benchmarks/gpu_run30.sh PHASES [ROUNDS]
#   sync        tests/kernels/test_sampler_sync_gpu.py: every request kind sampled under sync debug mode "error"
#   sampling    benchmarks/sampling_throughput.py on the Qwen3-0.6B shape, the tree before vs this one, ROUNDS
#               alternating rounds (each a fresh process per tree running every workload)
#   structured  benchmarks/structured_throughput.py (run 29's phase; its seeded requests are now asynchronous)
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-2}
if phase sync; then
  STRATA_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sampler_sync_gpu.py \
    2>&1 | tee "$OUTDIR/sampler_sync_gpu.log" | tail -15
fi
if phase sampling; then
  CKPT=/tmp/q06
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
  for r in $(seq 0 $((ROUNDS - 1))); do
    if (( r % 2 == 0 )); then order="old new"; else order="new old"; fi
    for v in $order; do
      src=.; [ "$v" = old ] && src=.oldtree
      PYTHONPATH=/tmp/site:$src:tests timeout 240 python3 benchmarks/sampling_throughput.py $CKPT --label "$v-r$r" \
        2>"$OUTDIR/sampling_${v}_r$r.err" | tee -a "$OUTDIR/sampling_throughput.jsonl" \
        | python3 -c 'import json,sys; [print(d["label"], d["workload"], d["tok_per_s"], d["strataserve"]) for d in map(json.loads, sys.stdin)]'
      tail -3 "$OUTDIR/sampling_${v}_r$r.err" | grep -i error
    done
  done
fi
if phase structured; then
  CKPT=/tmp/q06s
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
  rm -f $CKPT/tokenizer.json $CKPT/tokenizer_config.json $CKPT/special_tokens_map.json && cp .whl/tok_q3/* $CKPT/
  timeout 200 python3 benchmarks/structured_throughput.py --model $CKPT --device cuda --dtype bfloat16 \
    --num-requests 256 --output-len 256 --kv-cache-memory-gib 16 --rounds "$ROUNDS" 2>&1 \
    | tee -a "$OUTDIR/structured_h200.txt" | grep -E '^#|ratio_min|Error|error' | tail -8
fi
