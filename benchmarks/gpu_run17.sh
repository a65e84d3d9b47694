#!/usr/bin/env bash
# Device run 17. From the repo root on the device, with .whl carried:
#   bash benchmarks/gpu_run17.sh PHASES [ROUNDS]
#   gemvtest  the GEMV kernel tests on the GPU (fp32/fp16/bf16), the K loop pipelined and not
#   sweep     benchmarks/gemv_sweep.py --grid stages: 136 GEMV configurations (pipeline depth 1-4) against cuBLAS
#             on the 8B and Qwen3-0.6B shapes (SWEEP_SHAPES)
#   check     all kernel tests on the GPU and float32 greedy of every runner mode vs HF
#   decode    benchmarks/decode_prologue_ab.py, batch-1 decode at the 8B and Qwen3-0.6B shapes (DECODE_SHAPES):
#             VARIANTS (default prologue,separate,run16: run 17's pipelined candidates with and without prologues,
#             and the code before run 17) side by side in one process, ROUNDS rounds
#   ttsab     benchmarks/tts_tuning_ab.py --variants tuned,run16: Qwen3-TTS with run 17's tuning against run 16's
#   prologue  benchmarks/gemv_prologue_ab.py: per projection, the op's kernel + the chosen matmul against the fused GEMV
#   argmax    benchmarks/argmax_ab.py: the argmax kernel against torch.argmax over bf16 logits, ROUNDS rounds
#   nano      benchmarks/nano_protocol.py (bf16 cache, a fresh process each): this tree against tmp/wt_old (the tree
#             before run 17), ROUNDS rounds alternating
#   profile   benchmarks/gpu_profile.py: the kernel table of batch-1 decode steps (8B and Qwen3-0.6B shapes, hybrid)
#   startup   benchmarks/serve_startup.py, 8B shape: this tree against tmp/wt_old (the tree before run 17), 3 rounds
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-3}

if phase gemvtest; then
  STRATA_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_gemv.py \
    tests/kernels/test_triton_ops.py 2>&1 | tee "$OUTDIR/gpu_gemv_tests.log" | tail -3
fi
if phase sweep; then
  timeout "${SWEEP_TIMEOUT:-420}" python3 benchmarks/gemv_sweep.py --grid stages \
    --shapes "${SWEEP_SHAPES:-gate_up,qkv,down,o,lm_head,06_qkv,06_o,06_gate_up,06_down}" \
    2> "$OUTDIR/gemv_sweep.err" | tee "$OUTDIR/gemv_sweep.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    if "kernel" not in r:
        print(r); continue
    s1 = max((v, k) for k, v in r.items() if isinstance(v, float) and k.endswith("_s1_ef"))
    print(r["kernel"], "cublas", r["cublas_frac_copy_bw"], "best", r["best"], "best_unpipelined", s1)'
  tail -2 "$OUTDIR/gemv_sweep.err"
fi
if phase check; then
  kernel_tests 240
  e2e_check 14
fi
if phase decode; then
  timeout "${DECODE_TIMEOUT:-420}" python3 benchmarks/decode_prologue_ab.py --shapes "${DECODE_SHAPES:-8b,0.6b}" \
    --rounds "$ROUNDS" --variants "${VARIANTS:-prologue,separate,run16}" 2> "$OUTDIR/decode_prologue_ab.err" \
    | tee "$OUTDIR/decode_prologue_ab.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["shape"], r["round"], r["variant"], r["ms_per_step"], r["roofline_fraction"], json.dumps(r.get("gemv"))[:400])'
  tail -2 "$OUTDIR/decode_prologue_ab.err"
fi
if phase ttsab; then
  FRAMES=64 timeout 300 python3 benchmarks/tts_tuning_ab.py --shapes 0.6B,1.7B --rounds "$ROUNDS" --variants tuned,run16 \
    2> "$OUTDIR/tts_tuning_ab.err" | tee "$OUTDIR/tts_tuning_ab.jsonl" \
    | python3 -c 'import json,sys; [print(r["shape"], r["round"], r["batch"], r["variant"], r["fps"]) for r in map(json.loads, sys.stdin)]'
  tail -2 "$OUTDIR/tts_tuning_ab.err"
fi
if phase startup; then
  mkdir -p "$OUTDIR/startup"
  OUT=$OUTDIR/startup timeout 400 python3 benchmarks/serve_startup.py --model /tmp/ckpt8b --write-8b \
    --tree before=tmp/wt_old --tree after=. --rounds 3 2>&1 | tail -8
fi
if phase profile; then
  for m in llama8b qwen06b; do
    PYTHONPATH=$PYTHONPATH:benchmarks timeout 150 python3 benchmarks/gpu_profile.py decode $m hybrid 1 512 \
      > "$OUTDIR/profile_decode_${m}_b1.txt" 2> "$OUTDIR/profile_decode_${m}_b1.err"
    head -30 "$OUTDIR/profile_decode_${m}_b1.txt"
  done
fi
if phase prologue; then
  timeout 300 python3 benchmarks/gemv_prologue_ab.py --rounds "$ROUNDS" --shapes "${SHAPES:-8b,0.6b}" 2> "$OUTDIR/gemv_prologue_ab.err" \
    | tee "$OUTDIR/gemv_prologue_ab.jsonl" | cut -c1-300
  tail -3 "$OUTDIR/gemv_prologue_ab.err"
fi
if phase argmax; then
  timeout 120 python3 benchmarks/argmax_ab.py --rounds "$ROUNDS" 2> "$OUTDIR/argmax_ab.err" | tee "$OUTDIR/argmax_ab.jsonl"
  tail -2 "$OUTDIR/argmax_ab.err"
fi
if phase nano; then
  CKPT=/tmp/q06
  [ -d $CKPT ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
  for ((r = 0; r < ROUNDS; r++)); do
    order="after before"; [ $((r % 2)) = 1 ] && order="before after"
    for t in $order; do
      tree=.; [ $t = before ] && tree=tmp/wt_old
      PYTHONPATH=/tmp/site:$tree:tests timeout 150 python3 $tree/benchmarks/nano_protocol.py $CKPT 2>>"$OUTDIR/nano.err" \
        | python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'tree': '$t', 'round': $r})) for l in sys.stdin]" \
        | tee -a "$OUTDIR/nano.jsonl" | cut -c1-200
    done
  done
fi
