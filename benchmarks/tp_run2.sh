#!/usr/bin/env bash
# Second device run of issue 15 (after async scheduling across TP ranks), inside a ~80 s command budget:
#   bash benchmarks/tp_run2.sh
# 8B TP=2 vs TP=1 (agreement, batch-1 step, 3 alternating rounds), then 70B TP=2 batch 1 in the time left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1
O=${OUT:-.}
SECONDS=0
timeout -k 3 42 python3 benchmarks/tp_bench.py 8b > "$O/8b.log" 2>&1; echo "8b rc=$? at ${SECONDS}s"
LEFT=$((80 - SECONDS))
[ $LEFT -gt 22 ] && { timeout -k 3 $LEFT python3 benchmarks/tp_bench.py 70b --no-batch64 --rounds 2 > "$O/70b.log" 2>&1;
  echo "70b rc=$? at ${SECONDS}s"; }
cat "$O/tp_bench.jsonl"
for f in 8b 70b; do echo "== $f"; grep -v '^{' "$O/$f.log" 2>/dev/null | grep -iE 'error|Traceback|File ' | tail -6; done
