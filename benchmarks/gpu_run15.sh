#!/usr/bin/env bash
# Device run 15. From the repo root on the device, with .whl (and tmp/wt_old for `omni`) carried:
#   bash benchmarks/gpu_run15.sh PHASES [ROUNDS]
#   overlap  benchmarks/overlap_probe.py: a decode step's batch as two halves on two CUDA streams, against one
#   omni     benchmarks/omnivoice_bench.py on this tree (ROUNDS rounds), then on tmp/wt_old (1 round; made by
#            `git archive 50ba418 strataserve benchmarks tests | tar -x -C tmp/wt_old`)
#   long     benchmarks/serve_load_gpu.py, 8B shape, closed loop c=64 with 1,000 prompts (vLLM's benchmark
#            default) and with 192 (runs 12-14), ROUNDS alternating
#   eager    serve_load_gpu.py, two servers side by side: default (mixed-step graphs, paced at 27 ms) against
#            STRATA_MIXED_GRAPHS=0 with an explicit --target-step-ms 27 (eager prompt steps, same pacing),
#            closed loop c=64 (192 prompts) and Poisson 16 req/s (160), ROUNDS alternating
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-1}

if phase overlap; then
  timeout 300 python3 benchmarks/overlap_probe.py --rounds "$ROUNDS" 2>&1 | tee "$OUTDIR/overlap_probe.jsonl" | tail -12
fi
if phase omni; then  # this tree ROUNDS rounds (the bench alternates reference / ours), then the old tree, 1 round
  for tree in new old; do
    dir=.; n=$ROUNDS; [ $tree = old ] && dir=tmp/wt_old && n=1
    (cd "$dir" && WHL_DIR=$OLDPWD/.whl ROUNDS=$n BENCH_TIMEOUT=300 bash benchmarks/omnivoice_run.sh) \
      > "$OUTDIR/omni_$tree.log" 2>&1
    echo "$tree: $(grep -o '"speedup_vs_reference_bs1_per_round": [^]]*]' "$OUTDIR/omni_$tree.log")"
    grep '"bs": 32' "$OUTDIR/omni_$tree.log" | grep strataserve | cut -c1-160
  done
fi
if phase eager; then  # (run 15j wrote eager.jsonl and eager_logs.tgz)
  serve_ab eager "$ROUNDS" "graphs=." "eager=. --target-step-ms 27 STRATA_MIXED_GRAPHS=0"
fi
if phase long; then
  mkdir -p "$OUTDIR/logs"
  for r in $(seq "$ROUNDS"); do
    for n in 1000 192; do
      [ $((r % 2)) = 0 ] && n=$([ $n = 1000 ] && echo 192 || echo 1000)
      LOGS=$OUTDIR/logs timeout 280 python3 benchmarks/serve_load_gpu.py --model /tmp/llama8b --rounds 1 \
        --blocks 5120 --workloads closed --closed-prompts "$n" --variant "bf16_$n=." | tee -a "$OUTDIR/long.jsonl" \
        | serve_summary
    done
  done
  (cd "$OUTDIR/logs" && tar czf ../logs.tgz . && cd .. && rm -rf logs)
fi
