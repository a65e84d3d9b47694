#!/usr/bin/env bash
# Device runs 6a-c (GPU helper, issue 12 items 1-2). From the repo root on the device, with .whl carried:
#   bash benchmarks/gpu_run6.sh PHASES ITEMS [RUN] [BUDGET_S]
# PHASES, comma-separated: tests (kernel tests fp32/fp16/bf16), e2e (float32 greedy of every mode vs eager and HF),
# anchor (shared_ref/gemv_ceiling.py, a copy of ../shared/reference/gemv_ceiling.py); then gpu_bench.py ITEMS.
# Everything lands under $OUT (logs, h200.jsonl, profiles).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1
OUTDIR=${OUT:-.}
PHASE=$1; ITEMS=$2; RUN=${3:-6}; BUDGET=${4:-170}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ ,$PHASE, == *,tests,* ]]; then
  STRATA_TEST_DEVICE=cuda timeout 130 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels 2>&1 \
    | tee "$OUTDIR/gpu_kernel_tests.log" | tail -4
fi
if [[ ,$PHASE, == *,e2e,* ]]; then
  timeout 150 python3 benchmarks/gpu_e2e_check.py float32 2>&1 | tee "$OUTDIR/gpu_e2e.log" | tail -14
fi
if [[ ,$PHASE, == *,anchor,* ]] && [ -f shared_ref/gemv_ceiling.py ]; then
  timeout 60 python3 shared_ref/gemv_ceiling.py 2>&1 | tee "$OUTDIR/gemv_ceiling.log" | tail -4
fi
timeout $((BUDGET + 60)) python3 benchmarks/gpu_bench.py --run "$RUN" --budget-s "$BUDGET" --only "$ITEMS" 2>&1 \
  | tee "$OUTDIR/bench.log" | grep -v '^{' | tail -60
