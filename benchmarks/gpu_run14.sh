#!/usr/bin/env bash
# Device run 14 (issue 12: the served 8B path with an fp8 KV cache). From the repo root on the device, with .whl
# carried:  bash benchmarks/gpu_run14.sh PHASES [ROUNDS]
#   kvserve  benchmarks/serve_load_gpu.py, 8B shape, two servers side by side: bf16 cache against
#            --kv-cache-dtype fp8 (same block count), closed loop c=64 and Poisson 16 req/s, ROUNDS alternating
#   fresh    gpu_run13.sh's phase: nano-vllm's protocol, fresh process + empty Triton cache, fp8 and bf16, ROUNDS
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-1}

if phase kvserve; then  # (run 14 wrote serve_stdout.jsonl and logs.tgz; serve_ab names them kvserve*)
  serve_ab kvserve "$ROUNDS" "bf16=." "fp8=. --kv-cache-dtype fp8"
fi
if phase fresh; then
  bash benchmarks/gpu_run13.sh fresh "$ROUNDS" | grep -v '^torch\|^NVIDIA'
fi
