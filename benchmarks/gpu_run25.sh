#!/usr/bin/env bash
# Device run 25 (issue 12 items 1-2: the few-rows GEMM as a stream-K launch). From the repo root on the device, with
# .whl carried:   bash benchmarks/gpu_run25.sh PHASES [ROUNDS]
#   verify    the few-rows GEMM (stream-K included) and TritonOps kernel tests on the GPU (fp32/fp16/bf16), the sm_90
#             compile checks
#   probe     benchmarks/stream_k_probe.py: stream-K against the tile grid and cuBLAS per 8B projection, 16 / 64 rows
#   decode    benchmarks/decode_prologue_ab.py at the 8B shape, BATCHES (default 64): prologue (the default, stream-K
#             among the tuner's candidates) against nosk (the tile grid only), ROUNDS alternating rounds
#   e2e       float32 greedy of every runner mode against eager and HF (benchmarks/gpu_e2e_check.py)
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-3}
if phase verify; then
  STRATA_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 90 \
    --timeout-method=thread tests/kernels/test_skinny_gemm.py tests/kernels/test_triton_ops.py \
    tests/kernels/test_sm90_compile.py 2>&1 | tee "$OUTDIR/gpu_kernel_tests.log" | grep -E "passed|failed|Error" | tail -6
fi
if phase probe; then
  timeout "${PROBE_TIMEOUT:-240}" python3 benchmarks/stream_k_probe.py --rows "${ROWS:-16,64}" 2>> "$OUTDIR/probe.err" \
    | tee "$OUTDIR/probe.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["proj"], r["rows"], "floor", r["floor_us"], "cublas", r["cublas"], "tile", r["best_tile"], r["best_tile_us"],
          "best", r["best"], r["best_us"], r["best_floor_fraction"])'
  tail -2 "$OUTDIR/probe.err"
fi
if phase decode; then
  for b in ${BATCHES:-64}; do
    timeout "${DECODE_TIMEOUT:-420}" python3 benchmarks/decode_prologue_ab.py --shapes 8b --rounds "$ROUNDS" \
      --batch "$b" --variants "${VARIANTS:-prologue,nosk}" 2>> "$OUTDIR/decode.err" | tee -a "$OUTDIR/decode.jsonl" \
      | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["shape"], r["batch"], r["round"], r["variant"], r["ms_per_step"], r["roofline_fraction"])'
  done
  tail -2 "$OUTDIR/decode.err"
fi
if phase e2e; then
  e2e_check
fi
