#!/usr/bin/env bash
# One nvidia-h200-x2 call (2026-11-30, after merging the omni/ray/tp/kvq branches): the OmniVoice figures in bf16
# (GPU 0), then the 2-replica vs 1-replica throughput (both GPUs). Run from the repo root with .whl carried:
#   bash benchmarks/device_run_1130b.sh        (results under $OUT/omnivoice and $OUT/replicas)
set -u
mkdir -p "$OUT/omnivoice" "$OUT/replicas"
( export OUT="$OUT/omnivoice" WHL_DIR="$PWD/.whl" BENCH_TIMEOUT=${OMNI_TIMEOUT:-170}
  CUDA_VISIBLE_DEVICES=0 bash benchmarks/omnivoice_run.sh > "$OUT/omnivoice_bench.log" 2>&1 )
tail -8 "$OUT/omnivoice_bench.log"
( export OUT="$OUT/replicas"
  timeout ${REPLICAS_TIMEOUT:-290} bash benchmarks/replicas_run.sh ${ROUNDS:-3} > "$OUT/replicas_run.log" 2>&1 )
tail -14 "$OUT/replicas_run.log"
