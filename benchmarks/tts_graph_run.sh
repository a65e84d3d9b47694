#!/bin/bash
# Device run for issue 10's follow-up (talker decode in CUDA graphs), from the repo root on the H200 with the
# wheels in .whl carried (qwen-tts-hf + librosa deps, faster-qwen3-tts, fastapi/uvicorn/pydantic, openai, pyzmq,
# msgspec). Results go to $OUT: tests, graph-vs-eager check, benchmark, served time to first audio.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c \
  "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  python3 -m pip show qwen-tts-hf faster-qwen3-tts 2>/dev/null | grep -E '^(Name|Version)'; } > "$OUT/env.txt" 2>&1
# CPU tests on cores 8-15 (no GPU) alongside the GPU work, which runs on cores 0-7
(CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=8 timeout 450 taskset -c 8-15 python3 -m pytest -x -q -p no:cacheprovider \
  --basetemp=/tmp/pt-ttsg tests/tts > "$OUT/tests_tts.log" 2>&1; echo "rc=$?" >> "$OUT/tests_tts.log") &
timeout 100 taskset -c 0-7 python3 benchmarks/tts_graph_check.py > "$OUT/graph_check.log" 2>&1; echo "rc=$?" >> "$OUT/graph_check.log"
grep -h GRAPHCHECK "$OUT/graph_check.log"
FRAMES=64 ROUNDS=3 timeout 250 taskset -c 0-7 python3 benchmarks/tts_bench.py > "$OUT/tts_bench.log" 2>&1
echo "bench rc=$?"; grep -h -E "TTSBENCH|Error|error" "$OUT/tts_bench.log" | tail -40
SHAPE=1.7B N=20 timeout 120 taskset -c 0-7 python3 benchmarks/tts_serve_ttfa.py > "$OUT/ttfa.log" 2>&1
echo "ttfa rc=$?"; tail -3 "$OUT/ttfa.log"
wait
tail -3 "$OUT/tests_tts.log"
