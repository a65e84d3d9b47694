#!/bin/bash
# Second device run (issue 10 follow-up): tests/tts and the served time to first audio, which the first run
# (tts_graph_run.sh) lost to fastapi's missing opentelemetry-api wheel; plus where in-process first audio goes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
(CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=8 timeout 230 taskset -c 8-15 python3 -m pytest -x -q -p no:cacheprovider \
  --basetemp=/tmp/pt-ttsg tests/tts > "$OUT/tests_tts.log" 2>&1; echo "rc=$?" >> "$OUT/tests_tts.log") &
SHAPE=1.7B N=20 timeout 130 taskset -c 0-7 python3 benchmarks/tts_serve_ttfa.py > "$OUT/ttfa.log" 2>&1
echo "ttfa rc=$?"; grep TTFA "$OUT/ttfa.log" || tail -5 "$OUT/ttfa.log"
timeout 90 taskset -c 0-7 python3 benchmarks/tts_ttfa_parts.py > "$OUT/ttfa_parts.log" 2>&1
echo "parts rc=$?"; grep TTFAPARTS "$OUT/ttfa_parts.log" || tail -5 "$OUT/ttfa_parts.log"
wait
tail -3 "$OUT/tests_tts.log"
