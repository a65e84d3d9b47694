#!/usr/bin/env bash
# Device run 11 (issue 12 item 4: the fp8/int8 cache read as unpacked words; decode splits for short batches). From
# the repo root on the device, with .whl carried and the previous kernels in old_kernels/ (untracked, so carried):
#   K=strataserve/kernels; mkdir -p old_kernels
#   git show cb0e299:$K/decode_attention.py > old_kernels/decode_attention_r10.py    # run 10's kernels
#   git show cb0e299:$K/prefill_attention.py > old_kernels/prefill_attention_r10.py
#   git show 4f0d419:$K/decode_attention.py > old_kernels/decode_attention_words.py    # words, run 8's split rule
#   bash benchmarks/gpu_run11.sh PHASES
# PHASES, comma-separated:
#   tests  kernel tests on the GPU (fp32/fp16/bf16; fp8/int8 caches through the inline-PTX unpacking)
#   ab     benchmarks/kv_quant_kernels_ab.py: both attention kernels, old vs new, bf16/fp8/int8 caches
#          (AB_ONLY: its --only, e.g. prefill,sweep; AB_CASES: its --cases; OLD_DECODE: the "old" decode module)
#   long   benchmarks/kv_quant_bench.py: model-level decode at 8k context (bf16/fp8/int8) and greedy agreement
#   tput   benchmarks/gpu_bench.py --only throughput-kv: the nano-vllm workload with bf16 / fp8 / int8 caches
#   e2e    float32 greedy of every runner mode vs eager and HF
# Everything lands under $OUT.
set -u
source benchmarks/device_setup.sh "$1"
if phase tests; then kernel_tests 120; fi
if phase ab; then
  timeout "${AB_S:-170}" python3 benchmarks/kv_quant_kernels_ab.py \
    --old-decode "${OLD_DECODE:-old_kernels/decode_attention_r10.py}" \
    --old-prefill old_kernels/prefill_attention_r10.py --only "${AB_ONLY:-decode,prefill}" \
    --cases "${AB_CASES:-}" 2>&1 \
    | tee -a "$OUTDIR/kv_ab.log" | grep '^{' \
    | tee "$OUTDIR/kv_ab.jsonl" | cut -c1-330
fi
if phase long; then
  timeout 120 python3 benchmarks/kv_quant_bench.py --only "${LONG_ONLY:-decode,accuracy}" 2>&1 \
    | tee "$OUTDIR/kv_quant_bench.log" | grep '^{' | cut -c1-400
fi
if phase tput; then
  timeout 240 python3 benchmarks/gpu_bench.py --only throughput-kv --budget-s 230 --run 11 2>&1 \
    | tee "$OUTDIR/gpu_bench.log" | grep '^{' | cut -c1-330
fi
if phase e2e; then e2e_check 3; fi
