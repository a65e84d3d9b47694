#!/usr/bin/env bash
# Device run 19 (issue 12 item 1 at batch 64: the few-rows Triton GEMM with PDL). From the repo root on the device,
# with .whl carried:   bash benchmarks/gpu_run19.sh PHASES [ROUNDS]
#   compile   the sm_90 compile checks alone (tests/kernels/test_sm90_compile.py)
#   check     all kernel tests on the GPU and float32 greedy of every runner mode vs HF
#   chain     benchmarks/skinny_chain_ab.py: the 8B shape's matmuls of one decode step at BATCHES (default 64),
#             cuBLAS against the Triton GEMM without / with PDL (+ prefetch), ROUNDS rounds
#   decode    benchmarks/decode_prologue_ab.py at BATCHES: VARIANTS (default prologue,run18,pdlall)
#   profile   benchmarks/gpu_profile.py: the kernel table of 8B decode steps at PROFILE_BATCH (default 64)
#   startup   benchmarks/serve_startup.py, 8B shape, this tree, ROUNDS starts (the first on an empty tuning record);
#             needs the API's wheels in .whl too (fastapi, starlette, uvicorn, pydantic, aiohttp and their needs)
#   ttsab     benchmarks/tts_tuning_ab.py --variants TTS_VARIANTS (default tuned,pdl1: PDL up to 64 rows, batch 1 only)
#   nano      benchmarks/nano_protocol.py (bf16 cache, a fresh process each): NANO_VAR (default STRATA_GEMM_TUNE) at
#             each of NANO_VALUES (default "1 0"), the order reversed every other round
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-3}

if phase compile; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sm90_compile.py 2>&1 | tail -12
fi
if phase check; then
  kernel_tests 240
  e2e_check 14
fi
if phase chain; then
  timeout "${CHAIN_TIMEOUT:-240}" python3 benchmarks/skinny_chain_ab.py --batches "${BATCHES:-64}" --rounds "$ROUNDS" \
    2>> "$OUTDIR/chain.err" | tee -a "$OUTDIR/chain.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r) if r.get("alone") else print(r["batch"], r["round"], r["variant"], r["us_per_step"], r["floor_fraction"])'
  tail -3 "$OUTDIR/chain.err"
fi
if phase decode; then
  for b in ${BATCHES:-64}; do
    timeout "${DECODE_TIMEOUT:-300}" python3 benchmarks/decode_prologue_ab.py --shapes "${DECODE_SHAPES:-8b}" \
      --rounds "${DECODE_ROUNDS:-$ROUNDS}" --batch "$b" --variants "${VARIANTS:-prologue,run18,pdlall}" \
      2>> "$OUTDIR/decode.err" | tee -a "$OUTDIR/decode.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["shape"], r["batch"], r["round"], r["variant"], r["ms_per_step"], r["roofline_fraction"])'
  done
  tail -2 "$OUTDIR/decode.err"
fi
if phase profile; then
  b=${PROFILE_BATCH:-64}
  PYTHONPATH=$PYTHONPATH:benchmarks timeout 150 python3 benchmarks/gpu_profile.py decode llama8b hybrid $b 512 \
    > "$OUTDIR/profile_decode_llama8b_b$b.txt" 2> "$OUTDIR/profile_decode_llama8b_b$b.err"
  head -24 "$OUTDIR/profile_decode_llama8b_b$b.txt"
fi
if phase nano; then
  CKPT=/tmp/q06
  [ -d $CKPT ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
  for ((r = 0; r < ${NANO_ROUNDS:-$ROUNDS}; r++)); do
    order=${NANO_VALUES:-1 0}; [ $((r % 2)) = 1 ] && order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
    for p in $order; do
      env ${NANO_VAR:-STRATA_GEMM_TUNE}=$p timeout 150 python3 benchmarks/nano_protocol.py $CKPT 2>>"$OUTDIR/nano.err" \
        | python3 -c "import json,sys; [print(json.dumps({**json.loads(l), '${NANO_VAR:-STRATA_GEMM_TUNE}': $p, 'round': $r})) for l in sys.stdin]" \
        | tee -a "$OUTDIR/nano.jsonl" | cut -c1-200
    done
  done
fi
if phase ttsab; then
  FRAMES=64 timeout "${TTS_TIMEOUT:-300}" python3 benchmarks/tts_tuning_ab.py --shapes 0.6B,1.7B --rounds "$ROUNDS" --variants "${TTS_VARIANTS:-tuned,pdl1}" \
    2> "$OUTDIR/tts_pdl_ab.err" | tee "$OUTDIR/tts_pdl_ab.jsonl" \
    | python3 -c 'import json,sys; [print(r["shape"], r["round"], r["batch"], r["variant"], r["fps"]) for r in map(json.loads, sys.stdin)]'
  tail -2 "$OUTDIR/tts_pdl_ab.err"
fi
if phase startup; then
  mkdir -p "$OUTDIR/startup"
  OUT=$OUTDIR/startup timeout "${STARTUP_TIMEOUT:-400}" python3 benchmarks/serve_startup.py --model /tmp/ckpt8b \
    --write-8b --tree final=. --rounds "$ROUNDS" 2>&1 | tail -8
fi
