#!/usr/bin/env bash
# Device run 18 (issue 12 item 1: programmatic dependent launch). From the repo root on the device, with .whl carried:
#   bash benchmarks/gpu_run18.sh PHASES [ROUNDS]
#   check     all kernel tests on the GPU (PDL on, the default) and float32 greedy of every runner mode vs HF
#   decode    benchmarks/decode_prologue_ab.py at batch 1 (DECODE_SHAPES, default 8b,0.6b) and BATCHES (default
#             "1"): VARIANTS (default prologue,noprefetch,ropesep,nopdl,run17: decode_prologue_ab.py) side by side in one process, ROUNDS rounds
#   profile   benchmarks/gpu_profile.py: the kernel table of batch-1 decode steps (8B and Qwen3-0.6B shapes, hybrid)
#   nano      benchmarks/nano_protocol.py (bf16 cache, a fresh process each): the defaults against run 18's switches
#             off (STRATA_PDL=0 STRATA_DECODE_ROPE_IN_ATTENTION=0), ROUNDS rounds alternating
#   ttsab     benchmarks/tts_tuning_ab.py --variants tuned,run17: Qwen3-TTS frames/s with PDL on and off
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-3}

if phase check; then
  kernel_tests 240
  e2e_check 14
fi
if phase decode; then
  for b in ${BATCHES:-1}; do
    timeout "${DECODE_TIMEOUT:-300}" python3 benchmarks/decode_prologue_ab.py --shapes "${DECODE_SHAPES:-8b,0.6b}" \
      --rounds "$ROUNDS" --batch "$b" --variants "${VARIANTS:-prologue,noprefetch,ropesep,run17}" 2>> "$OUTDIR/decode_pdl_ab.err" \
      | tee -a "$OUTDIR/decode_pdl_ab.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["shape"], r["batch"], r["round"], r["variant"], r["ms_per_step"], r["roofline_fraction"])'
  done
  tail -2 "$OUTDIR/decode_pdl_ab.err"
fi
if phase profile; then
  for m in llama8b qwen06b; do
    PYTHONPATH=$PYTHONPATH:benchmarks timeout 150 python3 benchmarks/gpu_profile.py decode $m hybrid 1 512 \
      > "$OUTDIR/profile_decode_${m}_b1.txt" 2> "$OUTDIR/profile_decode_${m}_b1.err"
    head -14 "$OUTDIR/profile_decode_${m}_b1.txt"
  done
fi
if phase nano; then
  CKPT=/tmp/q06
  [ -d $CKPT ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
  for ((r = 0; r < ROUNDS; r++)); do
    order="1 0"; [ $((r % 2)) = 1 ] && order="0 1"
    for p in $order; do
      STRATA_PDL=$p STRATA_DECODE_ROPE_IN_ATTENTION=$p timeout 150 python3 benchmarks/nano_protocol.py $CKPT \
        2>>"$OUTDIR/nano.err" \
        | python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'run18': $p, 'round': $r})) for l in sys.stdin]" \
        | tee -a "$OUTDIR/nano.jsonl" | cut -c1-200
    done
  done
fi
if phase ttsab; then
  FRAMES=64 timeout 300 python3 benchmarks/tts_tuning_ab.py --shapes 0.6B,1.7B --rounds "$ROUNDS" --variants tuned,run17 \
    2> "$OUTDIR/tts_pdl_ab.err" | tee "$OUTDIR/tts_pdl_ab.jsonl" \
    | python3 -c 'import json,sys; [print(r["shape"], r["round"], r["batch"], r["variant"], r["fps"]) for r in map(json.loads, sys.stdin)]'
  tail -2 "$OUTDIR/tts_pdl_ab.err"
fi
