#!/usr/bin/env bash
# Device run 16. From the repo root on the device, with .whl carried:
#   bash benchmarks/gpu_run16.sh PHASES [ROUNDS]
#   check     the kernel tests on the GPU (fp32/fp16/bf16) and float32 greedy of every runner mode vs HF
#   prologue  benchmarks/gemv_prologue_ab.py: batch-1 qkv / gate_up / down with the op before each fused into
#             the GEMV, against that op's kernel + cuBLAS or the best plain GEMV (SHAPES, default 8b,0.6b)
#   decode    benchmarks/decode_prologue_ab.py: batch-1 decode steps with the tuned prologues against without
#             (8B and Qwen3-0.6B shapes, hybrid mode), ROUNDS alternating rounds in one process (VARIANTS: 16d ran
#             prologue,separate; the default adds "before", run 15's GEMV candidates without prologues)
#   tts       benchmarks/tts_bench.py (ours only: SKIP_REF) with the talker's batch-1 tuning against
#             STRATA_GEMV_TUNE=0 (the code before run 16), processes in A B B A order (16e)
#   ttsab     benchmarks/tts_tuning_ab.py: the same two engines side by side in one process, ROUNDS rounds
#   startup   benchmarks/serve_startup.py, 8B shape: this tree against tmp/wt_old (the tree before run 16),
#             3 alternating rounds (the extra prologue tuning must keep start-up under 15 s)
#   decode06  decode_prologue_ab.py on the Qwen3-0.6B shape only
#   sweep     benchmarks/gemv_sweep.py: 96 GEMV configurations (with and without evict-first weight loads)
#             against cuBLAS on the 8B qkv / gate_up / down shapes
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-3}

if phase check; then
  kernel_tests 240
  e2e_check 14
fi
if phase prologue; then
  timeout 400 python3 benchmarks/gemv_prologue_ab.py --rounds "$ROUNDS" --shapes "${SHAPES:-8b,0.6b}" 2> "$OUTDIR/gemv_prologue_ab.err" \
    | tee "$OUTDIR/gemv_prologue_ab.jsonl"
  tail -3 "$OUTDIR/gemv_prologue_ab.err"
fi
if phase decode; then
  timeout 420 python3 benchmarks/decode_prologue_ab.py --shapes 8b,0.6b --rounds "$ROUNDS" \
    --variants "${VARIANTS:-prologue,separate,before}" \
    2> "$OUTDIR/decode_prologue_ab.err" | tee "$OUTDIR/decode_prologue_ab.jsonl" \
    | python3 -c 'import json,sys; [print(r["shape"], r["round"], r["variant"], r["ms_per_step"], r["roofline_fraction"]) for r in map(json.loads, sys.stdin)]'
  tail -2 "$OUTDIR/decode_prologue_ab.err"
fi
if phase tts; then
  i=0
  for v in tuned untuned untuned tuned; do
    i=$((i + 1)); tune=1; [ $v = untuned ] && tune=0
    STRATA_GEMV_TUNE=$tune SKIP_REF=1 SKIP_FASTER=1 SHAPES=${TTS_SHAPES:-0.6B,1.7B} BATCHES=1,8 ROUNDS=1 FRAMES=64 \
      timeout 200 python3 benchmarks/tts_bench.py > "$OUTDIR/tts_${i}_$v.log" 2>&1  # (16e: one log per variant)
    echo "$v rc=$?"; grep -h -E "TTSBENCH" "$OUTDIR/tts_${i}_$v.log" | cut -c1-220 | tail -8
  done
fi
if phase ttsab; then
  FRAMES=64 timeout 300 python3 benchmarks/tts_tuning_ab.py --shapes 0.6B,1.7B --rounds "$ROUNDS" \
    2> "$OUTDIR/tts_tuning_ab.err" | tee "$OUTDIR/tts_tuning_ab.jsonl" \
    | python3 -c 'import json,sys; [print(r["shape"], r["round"], r["batch"], r["variant"], r["fps"]) for r in map(json.loads, sys.stdin)]'
  tail -2 "$OUTDIR/tts_tuning_ab.err"
fi
if phase decode06; then
  timeout 200 python3 benchmarks/decode_prologue_ab.py --shapes 0.6b --rounds "$ROUNDS" 2>/dev/null \
    | tee "$OUTDIR/decode_prologue_ab_06b.jsonl" \
    | python3 -c 'import json,sys; [print(r["shape"], r["round"], r["variant"], r["ms_per_step"], r["roofline_fraction"]) for r in map(json.loads, sys.stdin)]'
fi
if phase startup; then
  mkdir -p "$OUTDIR/startup"
  OUT=$OUTDIR/startup timeout 400 python3 benchmarks/serve_startup.py --model /tmp/ckpt8b --write-8b \
    --tree before=tmp/wt_old --tree after=. --rounds 3 2>&1 | tail -8
fi
if phase sweep; then
  timeout 480 python3 benchmarks/gemv_sweep.py --shapes "${SWEEP_SHAPES:-qkv,gate_up,down}" \
    2> "$OUTDIR/gemv_sweep.err" | tee "$OUTDIR/gemv_sweep.jsonl" \
    | python3 -c 'import json,sys; [print(r.get("kernel"), "cublas", r.get("cublas_frac_copy_bw"), "best", r.get("best"), "copy", r.get("copy_TBps")) for r in map(json.loads, sys.stdin)]'
  tail -2 "$OUTDIR/gemv_sweep.err"
fi

