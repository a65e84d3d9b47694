#!/usr/bin/env bash
# Device run 9 (issue 12: CUDA graphs for steps with prompt tokens, runner/mixed_graph.py). From the repo root on
# the device, with .whl carried:  bash benchmarks/gpu_run9.sh PHASES
# PHASES, comma-separated:
#   tests   kernel tests on the GPU (fp32/fp16/bf16; the mixed-step graph captured and replayed against eager)
#   e2e     float32 greedy of every runner mode vs eager and HF (hybrid now replays mixed-step graphs)
#   idle    benchmarks/mixed_graph_idle_check.py: every bucket captured through the idle hook, then steps replay
#   profile benchmarks/mixed_step_profile.py (8B shape) with the graphs (default) and STRATA_MIXED_GRAPHS=0
#   load    benchmarks/serve_load_gpu.py, 8B shape, ROUNDS alternating rounds of VARIANTS ('|'-separated
#           serve_load_gpu.py variants; default: graphs vs STRATA_MIXED_GRAPHS=0)
# Everything lands under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1
OUTDIR=${OUT:-.}
PHASE=$1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [[ ,$PHASE, == *,tests,* ]]; then
  STRATA_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels 2>&1 \
    | tee "$OUTDIR/gpu_kernel_tests.log" | tail -4
fi
if [[ ,$PHASE, == *,e2e,* ]]; then
  timeout 150 python3 benchmarks/gpu_e2e_check.py float32 2>&1 | tee "$OUTDIR/gpu_e2e.log" | tail -14
fi
if [[ ,$PHASE, == *,idle,* ]]; then
  timeout 150 python3 benchmarks/mixed_graph_idle_check.py --model /tmp/llama8b 2>&1 | grep -v Loading | tail -3
fi
if [[ ,$PHASE, == *,profile,* ]]; then
  for v in 1 0; do
    mkdir -p "$OUTDIR/profile_mixed$v"
    OUT="$OUTDIR/profile_mixed$v" STRATA_MIXED_GRAPHS=$v timeout 200 python3 benchmarks/mixed_step_profile.py \
      --model /tmp/llama8b 2>&1 | grep '^{' | sed "s/^/mixed=$v /"
  done
fi
if [[ ,$PHASE, == *,load,* ]]; then
  mkdir -p "$OUTDIR/logs"
  IFS='|' read -ra specs <<< "${VARIANTS:-graphs=.|eager=. STRATA_MIXED_GRAPHS=0}"
  vargs=(); for v in "${specs[@]}"; do vargs+=(--variant "$v"); done
  LOGS=$OUTDIR/logs timeout "${LIMIT_S:-540}" python3 benchmarks/serve_load_gpu.py --model /tmp/llama8b \
    --rounds "${ROUNDS:-3}" --blocks "${BLOCKS:-5120}" "${vargs[@]}" ${EXTRA:-} 2>&1 | grep '^{' | cut -c1-400
  for f in "$OUTDIR"/logs/steps_*.log; do [ -f "$f" ] && tail -c 1000000 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
  (cd "$OUTDIR/logs" && tar czf ../logs.tgz . ) && rm -rf "$OUTDIR/logs"
fi
