#!/usr/bin/env bash
# Issue 12 item 3 under load on the H200: `strata serve` 8B shape (dummy weights), closed loop at concurrency 64 and
# Poisson 16 req/s, variants side by side, alternating rounds (benchmarks/serve_load_gpu.py). Run from the device
# folder (a copy of this tree under main's checkout), wheels carried in ../.whl:
#   cd .wt_load && ROUNDS=3 bash benchmarks/serve_load_gpu.sh "main=.." "new=. --target-step-ms 30"
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p "$OUT/logs"
args=()
for v in "$@"; do args+=(--variant "$v"); done
LOGS=$OUT/logs timeout "${LIMIT_S:-540}" python3 benchmarks/serve_load_gpu.py --model /tmp/llama8b --rounds "${ROUNDS:-3}" \
  --blocks "${BLOCKS:-5120}" "${args[@]}" ${EXTRA:-}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# step logs are large: keep their tails only (the breakdown is already in each JSON line)
for f in "$OUT"/logs/steps_*.log; do [ -f "$f" ] && tail -c 2000000 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
cd "$OUT/logs" && tar czf ../logs.tgz . && cd .. && rm -rf logs
