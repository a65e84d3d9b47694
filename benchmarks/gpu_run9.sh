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
source benchmarks/device_setup.sh "$1"
if phase tests; then kernel_tests 150; fi
if phase e2e; then e2e_check 14; fi
if phase idle; then
  timeout 150 python3 benchmarks/mixed_graph_idle_check.py --model /tmp/llama8b 2>&1 | grep -v Loading | tail -3
fi
if phase profile; then
  for v in 1 0; do
    mkdir -p "$OUTDIR/profile_mixed$v"
    OUT="$OUTDIR/profile_mixed$v" STRATA_MIXED_GRAPHS=$v timeout 200 python3 benchmarks/mixed_step_profile.py \
      --model /tmp/llama8b 2>&1 | grep '^{' | sed "s/^/mixed=$v /"
  done
fi
if phase load; then
  mkdir -p "$OUTDIR/logs"
  IFS='|' read -ra specs <<< "${VARIANTS:-graphs=.|eager=. STRATA_MIXED_GRAPHS=0}"
  vargs=(); for v in "${specs[@]}"; do vargs+=(--variant "$v"); done
  LOGS=$OUTDIR/logs timeout "${LIMIT_S:-540}" python3 benchmarks/serve_load_gpu.py --model /tmp/llama8b \
    --rounds "${ROUNDS:-3}" --blocks "${BLOCKS:-5120}" "${vargs[@]}" ${EXTRA:-} 2>&1 | grep '^{' | cut -c1-400
  for f in "$OUTDIR"/logs/steps_*.log; do [ -f "$f" ] && tail -c 1000000 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
  (cd "$OUTDIR/logs" && tar czf ../logs.tgz . ) && rm -rf "$OUTDIR/logs"
fi
