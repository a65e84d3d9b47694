#!/usr/bin/env bash
# Device run 13 (issue 12: the decode matmuls; the gap between nano-vllm's protocol and gpu_bench's). From the repo
# root on the device, with .whl carried:  bash benchmarks/gpu_run13.sh PHASES [ROUNDS]
#   tests  the skinny-GEMM kernel tests on the GPU (fp32/fp16/bf16)
#   sweep  benchmarks/skinny_gemm_sweep.py: Qwen3-0.6B shapes at batch 16-256, Llama-3.1-8B at 16 and 64
#   curve  benchmarks/prefill_tile_curve.py: the 8B decoder matmuls at 768-2,112 tokens, every 32
#   serve  benchmarks/serve_load_gpu.py, 8B shape: a tree in .wt_old (carried; `git archive REV strataserve`) against
#          this one, side by side, ROUNDS (13d: 21de2df against the tile trim of 7c4a6c7, since reverted)
#   fresh  benchmarks/nano_protocol.py, fresh process + empty Triton cache each, fp8 and bf16 cache, ROUNDS
#   pdl    GPU kernel tests with programmatic dependent launch, 8B decode b=1 / b=64 with STRATA_PDL=0 / 1 (ROUNDS),
#          float32 greedy against HF (13f ran it on 29f6af5; PDL was reverted after, so STRATA_PDL is now ignored)
#   budget benchmarks/nano_protocol.py, fp8 cache: max_num_batched_tokens 4096 (the LLM default) vs 8192, ROUNDS
#   gc     benchmarks/nano_protocol.py --gc default|freeze|relaxed, fp8 and bf16, ROUNDS (Triton cache shared)
#   proto  benchmarks/nano_protocol.py (fp8 cache), a fresh process each (Triton cache shared): the LLM defaults,
#          then each of gpu_bench's differences alone (token budget 8192, pacing auto, model len 2048 + memory
#          0.85, gpu_bench's warm-up), ROUNDS times with the order reversed every other round
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-1}
CKPT=/tmp/q06

sweep_summary() {  # one short line per skinny_gemm_sweep.py JSON line
  python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r["model"], r["proj"], r["batch"], "cublas", r["cublas_us"], "best", r["best_us"], r["gain"], r["top"][0][1], "no-combine", r.get("best_without_combine_us"), r["max_abs_diff_vs_cublas"], r["sweep_s"])'
}

q06_checkpoint() {  # the random Qwen3-0.6B-shaped checkpoint the nano_protocol phases share, written once
  [ -d $CKPT ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
}

if phase tests; then
  STRATA_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm.py \
    tests/kernels/test_gemv.py tests/kernels/test_specialization.py 2>&1 | tee "$OUTDIR/gpu_kernel_tests.log" | tail -3
fi
if phase sweep; then
  timeout 280 python3 benchmarks/skinny_gemm_sweep.py --model llama8b --batches 16,64 \
    | tee -a "$OUTDIR/sweep.jsonl" | sweep_summary
  timeout 280 python3 benchmarks/skinny_gemm_sweep.py --model qwen06b --batches 16,64,128,256 \
    | tee -a "$OUTDIR/sweep.jsonl" | sweep_summary
fi
if phase proto; then
  q06_checkpoint
  VARIANTS=("" "--max-num-batched-tokens 8192" "--target-step-ms auto" "--max-model-len 2048 --gpu-memory-utilization 0.85" "--warmup bench")
  for ((r = 0; r < ROUNDS; r++)); do
    n=${#VARIANTS[@]}
    for ((i = 0; i < n; i++)); do
      j=$(( r % 2 == 0 ? i : n - 1 - i ))
      timeout 120 python3 benchmarks/nano_protocol.py $CKPT --kv-cache-dtype fp8 \
        ${VARIANTS[$j]} 2>>"$OUTDIR/proto.err" | tee -a "$OUTDIR/proto.jsonl"
    done
  done
fi
if phase curve; then
  timeout 200 python3 benchmarks/prefill_tile_curve.py --model llama8b --start 768 --stop 2112 --step 32 \
    | tee -a "$OUTDIR/curve.jsonl" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r["tokens"], r["us"], r["us_per_token"], r["tflops"])'
fi
if phase serve; then  # .wt_old's tree against this one, side by side, alternating
  mkdir -p "$OUTDIR/logs"
  LOGS=$OUTDIR/logs timeout 330 python3 benchmarks/serve_load_gpu.py --model /tmp/llama8b --rounds "$ROUNDS" \
    --blocks 5120 --closed-prompts 192 --poisson-prompts 160 --variant "old=.wt_old" --variant "new=." \
    | tee -a "$OUTDIR/serve_load.jsonl" | serve_summary
  (cd "$OUTDIR/logs" && tar czf ../logs.tgz . && cd .. && rm -rf logs)
fi
if phase fresh; then  # nano-vllm's protocol, each run a fresh process with an empty Triton cache, KV dtypes rotated
  q06_checkpoint
  KVS=(fp8 auto)
  for ((r = 0; r < ROUNDS; r++)); do
    for ((i = 0; i < 2; i++)); do
      kv=${KVS[$(((i + r) % 2))]}
      TRITON_CACHE_DIR=$(mktemp -d) timeout 120 python3 benchmarks/nano_protocol.py $CKPT --kv-cache-dtype $kv \
        2>>"$OUTDIR/fresh.err" | tee -a "$OUTDIR/fresh.jsonl"
    done
  done
fi
if phase gc; then  # Python GC during the timed generate: as is, the start-up heap frozen, frozen + fewer gen0 passes
  q06_checkpoint
  GCS=(default freeze relaxed)
  for ((r = 0; r < ROUNDS; r++)); do
    for kv in fp8 auto; do
      for ((i = 0; i < 3; i++)); do
        g=${GCS[$(( r % 2 == 0 ? i : 2 - i ))]}
        timeout 120 python3 benchmarks/nano_protocol.py $CKPT --kv-cache-dtype $kv --gc $g 2>>"$OUTDIR/gc.err" \
          | tee -a "$OUTDIR/gc.jsonl" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r["kv_cache_dtype"], r["gc"], r["tok_per_s"], r["gc_count_ms_max"])'
      done
    done
  done
fi
if phase pdl; then  # programmatic dependent launch: the GPU kernel tests with it on, then 8B decode b=1 / b=64 with
  # STRATA_PDL=0 and 1 in separate processes (ROUNDS, order alternating), then float32 greedy against HF
  STRATA_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels 2>&1 \
    | tee "$OUTDIR/gpu_kernel_tests.log" | tail -3
  for ((r = 0; r < ROUNDS; r++)); do
    for p in $( ((r % 2 == 0)) && echo "0 1" || echo "1 0"); do
      STRATA_PDL=$p timeout 120 python3 benchmarks/gpu_bench.py --only decode1-hybrid,decode64-hybrid --run 13 \
        2>>"$OUTDIR/pdl.err" | grep '"decode"' | sed "s/^{/{\"pdl\": $p, /" | tee -a "$OUTDIR/pdl.jsonl" \
        | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print("pdl", r["pdl"], "batch", r["batch"], r.get("ms_per_step"), r["tok_per_s"], r["roofline_fraction"])'
    done
  done
  e2e_check 14
fi
if phase budget; then  # the offline LLM's token budget: its default (4096) against 8192, fp8 cache, ROUNDS alternating
  q06_checkpoint
  for ((r = 0; r < ROUNDS; r++)); do
    for b in $( ((r % 2 == 0)) && echo "4096 8192" || echo "8192 4096"); do
      timeout 120 python3 benchmarks/nano_protocol.py $CKPT --kv-cache-dtype fp8 --max-num-batched-tokens $b \
        2>>"$OUTDIR/budget.err" | tee -a "$OUTDIR/budget.jsonl" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r["max_num_batched_tokens"], r["tok_per_s"])'
    done
  done
fi
