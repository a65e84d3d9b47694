#!/usr/bin/env bash
# Device run 26 (issue 12 item 1: decode attention's fixed splits combined in the kernel at batch 1, under PDL). From
# the repo root on the device, with .whl carried:   bash benchmarks/gpu_run26.sh PHASES [ROUNDS]
#   verify    decode attention (the in-kernel combine included), TritonOps and sm_90 compile tests on the GPU
#             (fp32/fp16/bf16)
#   decode    benchmarks/decode_prologue_ab.py at batch 1, SHAPES (default 8b,0.6b): reduce (the default: a reduce
#             launch after the split attention) against combine (STRATA_DECODE_COMBINE=1), ROUNDS alternating rounds
#   e2e       float32 greedy of every runner mode against eager and HF, with STRATA_DECODE_COMBINE=1
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
  timeout "${DECODE_TIMEOUT:-420}" python3 benchmarks/decode_prologue_ab.py --shapes "${SHAPES:-8b,0.6b}" \
    --rounds "$ROUNDS" --batch 1 --variants "${VARIANTS:-reduce,combine}" 2>> "$OUTDIR/decode.err" \
    | tee -a "$OUTDIR/decode.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["shape"], r["batch"], r["round"], r["variant"], r["ms_per_step"], r["roofline_fraction"])'
  tail -2 "$OUTDIR/decode.err"
fi
if phase e2e; then
  STRATA_DECODE_COMBINE=1 e2e_check
fi
