#!/usr/bin/env bash
# Device run of issue 15 on nvidia-h200-x2, from a copy of the tree with its wheels in ./whl:
#   bash benchmarks/tp_run.sh
# 8B TP=2 vs TP=1 (agreement, batch-1 step, 3 alternating rounds), 70B TP=2, tiny fp32 agreement vs HF, then the
# 8B comparison again with STRATA_TP_ALLREDUCE=symm_mem. Each phase is time-boxed; everything lands under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1
O=${OUT:-.}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$O/env.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "nccl", torch.cuda.nccl.version())' | tee -a "$O/env.txt"
env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)' | tee -a "$O/env.txt"
timeout -k 5 110 python3 benchmarks/tp_bench.py 8b > "$O/8b.log" 2>&1; echo "8b rc=$?"
timeout -k 5 140 python3 benchmarks/tp_bench.py 70b > "$O/70b.log" 2>&1; echo "70b rc=$?"
timeout -k 5 60 python3 benchmarks/tp_bench.py agree-tiny > "$O/tiny.log" 2>&1; echo "tiny rc=$?"
STRATA_TP_ALLREDUCE=symm_mem timeout -k 5 80 python3 benchmarks/tp_bench.py 8b > "$O/symm.log" 2>&1
echo "symm rc=$?"
cat "$O/tp_bench.jsonl"
for f in 8b 70b tiny symm; do echo "== $f"; grep -v '^{' "$O/$f.log" | grep -iE 'error|Traceback|raise|File ' | tail -8; done
