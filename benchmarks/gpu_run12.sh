#!/usr/bin/env bash
# Device run 12 (issue 12: no kernel compiles in the middle of a run). From the repo root on the device, with .whl
# carried:  bash benchmarks/gpu_run12.sh PHASES [ROUNDS] [KVS]
#   tests  kernel tests on the GPU (fp32/fp16/bf16)
#   e2e    float32 greedy of every runner mode vs eager and HF
#   fresh  benchmarks/first_pass_diag.py in a fresh process with an empty Triton cache (as on a new machine), per
#          round and KV dtype (KVS, default "auto fp8 int8", rotated each round): start, gpu_bench's warm-up, then
#          the nano-vllm workload twice, with every Triton compile and mixed-graph capture of each phase
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-1}
read -r -a KVS <<< "${3:-auto fp8 int8}"
if phase tests; then kernel_tests 150; fi
if phase e2e; then e2e_check 3; fi
if phase fresh; then
  CKPT=/tmp/qwen3-0.6b-run12
  for ((r = 0; r < ROUNDS; r++)); do
    n=${#KVS[@]}
    for ((i = 0; i < n; i++)); do
      kv=${KVS[$(((i + r) % n))]}
      TRITON_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/first_pass_diag.py --kv "$kv" --ckpt $CKPT 2>&1 \
        | tee -a "$OUTDIR/fresh.log" | grep '^{' | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    r.pop("compiled", None); r.pop("buckets", None); r.pop("slowest_steps_ms", None)
    print(json.dumps(r))'
    done
  done
fi
