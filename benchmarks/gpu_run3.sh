#!/usr/bin/env bash
# Device run 3 (perf helper): float32 e2e greedy check of every mode (async scheduling on, plus hybrid-sync), then
# offline throughput hybrid async vs sync, a cProfile of the async run, and the 8B decode items in hybrid mode.
# Run from the repo root on the device: bash benchmarks/gpu_run3.sh   (writes under $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1 STRATA_TEST_DEVICE=cuda
OUTDIR=${OUT:-.}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
timeout 170 python3 benchmarks/gpu_e2e_check.py float32 2>&1 | tee "$OUTDIR/gpu_e2e.log" | tail -12
python3 benchmarks/gpu_bench.py --run 3 --budget-s 260 \
  --only throughput-hybrid,throughput-hybrid-sync,throughput-hybrid-profile,decode1-hybrid,decode64-hybrid \
  2>&1 | tee "$OUTDIR/bench.log" | tail -25
