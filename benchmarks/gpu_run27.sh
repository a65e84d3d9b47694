#!/usr/bin/env bash
# Device run 27 (issue 12 items 1-2: decode attention's grid with a row's kv heads next to each other). From the repo
# root on the device, with .whl carried:   bash benchmarks/gpu_run27.sh PHASES [ROUNDS]
#   verify    decode attention (both grid orders), TritonOps and sm_90 compile tests on the GPU (fp32/fp16/bf16)
#   decode    benchmarks/decode_prologue_ab.py at the 8B shape, BATCHES (default 64): rows (the default grid) against
#             heads (STRATA_DECODE_HEADS_FIRST=1), ROUNDS alternating rounds
#   nano      benchmarks/nano_env_ab.py (nano-vllm's protocol, bf16 cache, a fresh process each): base against heads
#   e2e       float32 greedy of every runner mode against eager and HF, with STRATA_DECODE_HEADS_FIRST=1
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-3}
if phase verify; then
  STRATA_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 90 \
    --timeout-method=thread tests/kernels/test_attention.py tests/kernels/test_triton_ops.py \
    tests/kernels/test_sm90_compile.py 2>&1 | tee "$OUTDIR/gpu_kernel_tests.log" | grep -E "passed|failed|Error" | tail -6
fi
if phase decode; then
  for b in ${BATCHES:-64}; do
    timeout "${DECODE_TIMEOUT:-420}" python3 benchmarks/decode_prologue_ab.py --shapes 8b --rounds "$ROUNDS" \
      --batch "$b" --variants "${VARIANTS:-rows,heads}" 2>> "$OUTDIR/decode.err" | tee -a "$OUTDIR/decode.jsonl" \
      | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["shape"], r["batch"], r["round"], r["variant"], r["ms_per_step"], r["roofline_fraction"])'
  done
  tail -2 "$OUTDIR/decode.err"
fi
if phase nano; then
  [ -d /tmp/q06 ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path
import gpu_bench; gpu_bench.write_random_qwen3(Path('/tmp/q06'))"
  timeout "${NANO_TIMEOUT:-420}" python3 benchmarks/nano_env_ab.py /tmp/q06 --rounds "$ROUNDS" --variant base \
    --variant heads --env heads:STRATA_DECODE_HEADS_FIRST=1 | tee -a "$OUTDIR/nano.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["round"], r["variant"], r.get("tok_per_s"), r.get("init_s"), r.get("error", "")[-300:])'
fi
if phase e2e; then
  STRATA_DECODE_HEADS_FIRST=1 e2e_check
fi
