#!/usr/bin/env bash
# Device run 7 (issue 12 items 3-4: served start-up, fp8/int8 KV cache). From the repo root on the device, with this
# branch copied to .wt_kvq and the wheels in .whl (both carried):
#   cd .wt_kvq && bash benchmarks/kvq_run7.sh
# "before" = the repo root's tree (main), "after" = this tree. Everything lands under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1 LOGS=/tmp/logs
mkdir -p $LOGS
# the demo model's weights travel once, in main's tree
[ -f strataserve/assets/demo_llama/model.safetensors ] || cp ../strataserve/assets/demo_llama/model.safetensors strataserve/assets/demo_llama/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
STRATA_TEST_DEVICE=cuda timeout 45 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_kv_quant.py \
  tests/kernels/test_attention.py 2>&1 | tee $LOGS/gpu_kernel_tests.log | tail -3
timeout 90 python3 benchmarks/kv_quant_bench.py 2>&1 | tee -a $LOGS/bench.log | grep '^{' | cut -c1-400
timeout 180 python3 benchmarks/serve_startup.py --model /tmp/ckpt8b --write-8b --tree before=.. --tree after=. \
  --rounds 3 2>&1 | tee -a $LOGS/bench.log | grep '^{' | cut -c1-700
cp $OUT/serve_startup.jsonl $LOGS/ 2>/dev/null
tar czf $OUT/logs.tgz -C /tmp logs
