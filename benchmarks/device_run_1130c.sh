#!/usr/bin/env bash
# One nvidia-h200-x2 call (2026-11-30): Qwen3-TTS batch 16 vs the reference at batch 1 (3 alternating rounds, both
# shapes, argmax-only code-predictor graphs in), then one replica round with --skip-tokenizer-init (is the API
# process's detokenising the limit of 2 replicas?). From the repo root with .whl carried.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/tts" "$OUT/replicas"
FRAMES=64 ROUNDS=3 BATCHES=1,16 SKIP_FASTER=1 SKIP_TTFA=1 OUT=$OUT/tts CUDA_VISIBLE_DEVICES=0 \
  timeout "${TTS_S:-200}" python3 benchmarks/tts_bench.py > "$OUT/tts/tts_bench.log" 2>&1
grep -h -E "^TTSBENCH|Error" "$OUT/tts/tts_bench.log" | cut -c1-300 | tail -12
[ -n "${REP_S:-}" ] && timeout "$REP_S" python3 benchmarks/replicas_bench.py --placement local --rounds 1 --skip-tokenizer-init \
  --out "$OUT/replicas/replicas.jsonl" > "$OUT/replicas/replicas_skip_tok.log" 2>&1
[ -n "${REP_S:-}" ] && tail -3 "$OUT/replicas/replicas_skip_tok.log"
