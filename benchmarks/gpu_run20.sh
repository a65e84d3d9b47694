#!/usr/bin/env bash
# Device run 20 (issue 12 item 1 at batch 64: gate_up with the SiLU-and-mul epilogue, runner/gemm_tuning.py). From
# the repo root on the device, with .whl carried:   bash benchmarks/gpu_run20.sh PHASES [ROUNDS]
# The phases of gpu_run19.sh (compile, check, chain, decode, profile, startup, ttsab, nano; same variables), plus
#   ktests    the few-rows GEMM, TritonOps-in-the-decoder and PDL kernel tests alone on the GPU (fp32/fp16/bf16)
#   e2e       float32 greedy of every runner mode against eager and HF (gpu_e2e_check.py) alone
# Run 20's decode variants: nosilu (STRATA_GEMM_SILU=0), gemmall (every 2-64-row matmul on Triton).
set -u
if [[ ,$1, == *,ktests,* ]]; then
  (source benchmarks/device_setup.sh ktests
   STRATA_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_skinny_gemm.py \
     tests/kernels/test_triton_ops.py tests/kernels/test_pdl_gpu.py tests/kernels/test_sm90_compile.py 2>&1 \
     | tee "$OUTDIR/gpu_kernel_tests.log" | tail -4)
fi
if [[ ,$1, == *,e2e,* ]]; then
  (source benchmarks/device_setup.sh e2e; e2e_check 14)
fi
exec bash benchmarks/gpu_run19.sh "$@"
