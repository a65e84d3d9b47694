#!/usr/bin/env bash
# Device run 24 (issue 12 item 2: the few-rows GEMM tuning for decode steps of 65-256 rows). From the repo root on the
# device, with .whl carried:   bash benchmarks/gpu_run24.sh PHASES [ROUNDS]
#   nanoab    benchmarks/nano_env_ab.py (nano-vllm's protocol, bf16 cache, a fresh process each, alternating):
#             base (row classes 16 / 64, PDL up to 64 rows), wide (classes 16 / 64 / 128 / 256, PDL up to 256 rows)
#             and pdl256 (PDL up to 256 rows alone); NANO_ARGS (--variant / --env items) replaces them; writes
#             $OUT/nanoab.jsonl
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-2}
CKPT=/tmp/q06
if phase nanoab; then
  [ -d $CKPT ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path
import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
  args=(--variant base --variant wide --variant pdl256 --env wide:STRATA_GEMM_ROWS=16,64,128,256
        --env wide:STRATA_PDL_MAX_ROWS=256 --env pdl256:STRATA_PDL_MAX_ROWS=256)
  [ -n "${NANO_ARGS:-}" ] && read -r -a args <<< "$NANO_ARGS"
  timeout "${NANO_TIMEOUT:-540}" python3 benchmarks/nano_env_ab.py $CKPT --rounds "$ROUNDS" "${args[@]}" \
    | tee -a "$OUTDIR/nanoab.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["round"], r["variant"], r.get("tok_per_s"), r.get("init_s"), r.get("error", "")[-300:])'
fi
