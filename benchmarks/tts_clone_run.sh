#!/bin/bash
# Device run for issue 10 (branch clone): batch-16 throughput with the argmax-only code-predictor graphs, from
# this tree's root on the H200 with the wheels in .whl_tts carried (qwen-tts-hf, librosa and its deps). Results
# go to $OUT: the benchmark (alternating rounds vs the reference at batch 1), the same-process A/B of the two
# graph sets at batch 16 (frames identical?), and a profile of the batch-16 run (CUDA kernel time vs wall).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl_tts/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c \
  "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  python3 -m pip show qwen-tts-hf 2>/dev/null | grep -E '^(Name|Version)'; } > "$OUT/env.txt" 2>&1
FRAMES=64 ROUNDS=3 SKIP_FASTER=1 SKIP_TTFA=1 STEP_AB=1 OUT=$OUT timeout "${BENCH_S:-150}" \
  python3 benchmarks/tts_bench.py > "$OUT/tts_bench.log" 2>&1
echo "bench rc=$?"; grep -h -E "^TTSBENCH|Error" "$OUT/tts_bench.log" | cut -c1-330
