#!/usr/bin/env bash
# Device run 29: the two figures no run had measured. From the repo root on the device, with .whl carried (the
# serving wheels, xgrammar + apache-tvm-ffi, qwen-tts-hf + einops + sox, and .whl/tok_q3: the byte-level BPE
# tokenizer that benchmarks/byte_bpe_tokenizer.py trains):   bash benchmarks/gpu_run29.sh PHASES [ROUNDS]
#   structured  issue 13's H200 half: benchmarks/structured_throughput.py on the Qwen3-0.6B shape (random
#               weights, that tokenizer, so JSON is spelled in bytes as Qwen's tokenizer spells it), 256 requests x
#               256 tokens, every token under the JSON schema vs unconstrained, ROUNDS alternating rounds, for
#               each STRATA_GRAMMAR_THREADS value in $STRUCT_THREADS (default: the default only)
#   fill        benchmarks/grammar_fill_threads.py: xgrammar's batch bitmask fill, 64 / 256 rows, 1-16 threads
#   ttsconc     benchmarks/tts_serve_concurrency.py: served Qwen3-TTS 1.7B at concurrency 1/8/16/32, ROUNDS
#   ttsbench    benchmarks/tts_bench.py engine-only (no codec, no HTTP) at batch 1/8/16/32, the same call
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-3}
python3 -c "import importlib.metadata as m; print('xgrammar', m.version('xgrammar'), 'transformers', m.version('transformers'))"
if phase fill; then
  timeout 200 python3 benchmarks/grammar_fill_threads.py .whl/tok_q3 --rows 64,256 --threads 1,2,4,8,16 2>&1 \
    | tee "$OUTDIR/grammar_fill.txt" | grep -E '^#|FILL|APPLY|Error'
fi
if phase structured; then  # STRUCT_THREADS: the STRATA_GRAMMAR_THREADS values to run (empty = the default)
  CKPT=/tmp/q06s
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
  rm -f $CKPT/tokenizer.json $CKPT/tokenizer_config.json $CKPT/special_tokens_map.json && cp .whl/tok_q3/* $CKPT/
  for th in ${STRUCT_THREADS:-default}; do
    [ "$th" = default ] && unset STRATA_GRAMMAR_THREADS || export STRATA_GRAMMAR_THREADS=$th
    echo "# STRATA_GRAMMAR_THREADS=${STRATA_GRAMMAR_THREADS:-default}" | tee -a "$OUTDIR/structured_h200.txt"
    timeout 300 python3 benchmarks/structured_throughput.py --model $CKPT --device cuda --dtype bfloat16 \
      --num-requests 256 --output-len 256 --kv-cache-memory-gib 16 --rounds "$ROUNDS" 2>&1 \
      | tee -a "$OUTDIR/structured_h200.txt" | grep -E '^#|ratio_min|Error|error' | tail -12
  done
  unset STRATA_GRAMMAR_THREADS
fi
if phase ttsconc; then
  SHAPE=1.7B CONC=1,8,16,32 ROUNDS=$ROUNDS FRAMES=100 timeout 400 python3 benchmarks/tts_serve_concurrency.py \
    > "$OUTDIR/tts_serve_concurrency.txt" 2>&1; echo "ttsconc rc=$?"
  grep -E 'TTSCONC|RESULT|Error' "$OUTDIR/tts_serve_concurrency.txt" | tail -20
fi
if phase ttsbench; then
  SHAPES=1.7B SKIP_REF=1 SKIP_TTFA=1 BATCHES=1,8,16,32 FRAMES=100 ROUNDS=$ROUNDS timeout 300 \
    python3 benchmarks/tts_bench.py > "$OUTDIR/tts_bench_engine.txt" 2>&1; echo "ttsbench rc=$?"
  grep -E 'TTSBENCH|RESULT|Error' "$OUTDIR/tts_bench_engine.txt" | tail -16
fi
