#!/usr/bin/env bash
# Device run for issue 15's replica figure (2 H200s: nvidia-h200-x2). From the repo root on the device, with
# .whl carried (the usual wheels: msgspec, pyzmq, fastapi, ...):
#   bash benchmarks/replicas_run.sh [ROUNDS]
# Ray is not in the device image and its py3.12 wheel (79 MB) is over one call's 64 MiB carry, so the figure is
# taken with `--placement local` (one engine process per GPU: the same zmq wire and router path as Ray actors);
# when `import ray` works there, the Ray placement runs too. Everything lands under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
OUTDIR=${OUT:-.}
ROUNDS=${1:-3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 420 python3 benchmarks/replicas_bench.py --placement local --rounds "$ROUNDS" --out "$OUTDIR/replicas.jsonl" \
  2>&1 | tee "$OUTDIR/replicas_local.log" | grep -v 'Writing\|Loading' | tail -12
if python3 -c "import ray" 2>/dev/null; then
  timeout 420 python3 benchmarks/replicas_bench.py --placement ray --rounds "$ROUNDS" --out "$OUTDIR/replicas.jsonl" \
    2>&1 | tee "$OUTDIR/replicas_ray.log" | grep -v 'Writing\|Loading' | tail -12
fi
