# Sourced by the device-run scripts (gpu_run9.sh, gpu_run11.sh): the carried wheels installed aside, the paths, the
# machine's versions printed, and the two checks every run repeats (``phase NAME`` tests the phase list in $1).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1
OUTDIR=${OUT:-.}
PHASES=${1:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

phase() { [[ ,$PHASES, == *,$1,* ]]; }

kernel_tests() {  # the kernel tests on the GPU in fp32/fp16/bf16
  STRATA_TEST_DEVICE=cuda timeout "${1:-150}" python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels 2>&1 \
    | tee "$OUTDIR/gpu_kernel_tests.log" | tail -4
}

e2e_check() {  # float32 greedy of every runner mode against eager and HF
  timeout 150 python3 benchmarks/gpu_e2e_check.py float32 2>&1 | tee "$OUTDIR/gpu_e2e.log" | tail -"${1:-14}"
}

serve_summary() {  # one short line per serve_load_gpu.py JSON line (start lines as they are)
  python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    if "round" not in r:
        print(l.strip()); continue
    print(r["round"], r["variant"], r["workload"], r["output_throughput"], "ttft p50", r["median_ttft_ms"], "itl p99", r["p99_itl_ms"], "decode ms p50", r.get("decode_ms_p50"), "prefill step ms p50", r.get("prefill_step_ms_p50"), "tokens p50", r.get("prefill_tokens_p50"))'
}

serve_ab() {  # NAME ROUNDS VARIANT...: serve_load_gpu.py, 8B shape, variants side by side, closed 192 / Poisson 160
  # prompts; stdout to $OUTDIR/NAME.jsonl (+ a summary), step/server/client logs to $OUTDIR/NAME_logs.tgz
  local name=$1 rounds=$2 args=()
  shift 2
  for v in "$@"; do args+=(--variant "$v"); done
  mkdir -p "$OUTDIR/${name}_logs"
  LOGS=$OUTDIR/${name}_logs timeout 500 python3 benchmarks/serve_load_gpu.py --model /tmp/llama8b --rounds "$rounds" \
    --blocks 5120 --closed-prompts 192 --poisson-prompts 160 "${args[@]}" | tee "$OUTDIR/$name.jsonl" | serve_summary
  (cd "$OUTDIR/${name}_logs" && tar czf "../${name}_logs.tgz" . && cd .. && rm -rf "${name}_logs")
}
