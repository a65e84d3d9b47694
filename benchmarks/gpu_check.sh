#!/usr/bin/env bash
# GPU correctness: the kernel tests in fp32/fp16/bf16 on the device, then the end-to-end greedy check of every
# runner mode against eager mode and HF transformers. Run from the repo root: bash benchmarks/gpu_check.sh
set -u
# The device lacks the serving wheels (msgspec, pyzmq...): install the carried .whl/ aside when it is there.
SITE=
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && SITE=/tmp/site:
fi
export PYTHONPATH=$SITE.:tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 STRATA_TEST_DEVICE=cuda
OUTDIR=${OUT:-.}
rc=0
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")  # Triton compiles are CPU-bound: spread them
python3 -m pytest -q -p no:cacheprovider $XDIST tests/kernels 2>&1 | tee "$OUTDIR/gpu_kernel_tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
python3 benchmarks/gpu_e2e_check.py 2>&1 | tee "$OUTDIR/gpu_e2e.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "gpu_check: rc=$rc"
exit $rc
