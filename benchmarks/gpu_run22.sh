#!/usr/bin/env bash
# Device run 22 (issue 12: the GPU-only checks after run 21; the TTS talker's 2-64-row tuning). From the repo
# root on the device, with .whl carried:   bash benchmarks/gpu_run22.sh PHASES [ROUNDS]
# The phases of gpu_run21.sh / gpu_run20.sh / gpu_run19.sh (same variables), plus
#   verify    the GPU-only tests (CUDA graphs with the deferred capture, PDL, the weight streamer), the few-rows GEMM
#             and TritonOps-in-the-decoder tests, the sm_90 compile checks
#             (fp32/fp16/bf16, pytest-timeout per test: a kernel that hangs fails instead), then
#             benchmarks/gpu_serve_check.py (served greedy text against the offline LLM, deferred capture on)
#   serve     benchmarks/serve_load_gpu.py, 8B shape, this tree alone: closed loop at concurrency 64 (192 prompts)
#             and Poisson 16 req/s (160 prompts), ROUNDS rounds (serve_ab in device_setup.sh)
set -u
if [[ ,$1, == *,verify,* ]]; then
  (source benchmarks/device_setup.sh verify
   STRATA_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 90 \
     --timeout-method=thread \
     tests/kernels/test_skinny_gemm.py tests/kernels/test_triton_ops.py tests/kernels/test_pdl_gpu.py \
     tests/kernels/test_cuda_graph_gpu.py tests/kernels/test_weight_stream_gpu.py tests/kernels/test_sm90_compile.py \
     2>&1 | tee "$OUTDIR/gpu_kernel_tests.log" | grep -E "passed|failed|Error" | tail -6
   timeout 150 python3 benchmarks/gpu_serve_check.py 2>&1 | tail -3)
fi
if [[ ,$1, == *,serve,* ]]; then
  (source benchmarks/device_setup.sh serve; serve_ab serve "${2:-2}" "final=.")
fi
exec bash benchmarks/gpu_run21.sh "$@"
