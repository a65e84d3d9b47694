#!/usr/bin/env bash
# Device run 4 (lead): the served path on the GPU (strata serve, async scheduling) against offline eager greedy,
# then offline throughput hybrid async vs sync with the warm-up fixed after run 3.
# Run from the repo root on the device: bash benchmarks/gpu_run4.sh   (writes under $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1
OUTDIR=${OUT:-.}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 benchmarks/gpu_serve_check.py 2>&1 | tail -5
python3 benchmarks/gpu_bench.py --run 4 --budget-s 200 --only throughput-hybrid,throughput-hybrid-sync \
  2>&1 | tee "$OUTDIR/bench.log" | tail -12
