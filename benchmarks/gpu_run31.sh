#!/usr/bin/env bash
# Device run 31 (top-p without a sort: kernels/top_p.py against run 30's full sort of every row, STRATA_TOP_P).
# From the repo root on the device, with .whl carried:   bash benchmarks/gpu_run31.sh PHASES [ROUNDS]
#   kernel    tests/kernels/test_top_p.py on the GPU (the kernel against the sorted reference, 1,000-151,936
#             entries) and tests/kernels/test_sampler_sync_gpu.py (both top-p paths under sync debug mode "error")
#   micro     benchmarks/top_p_ab.py: sort vs kernel at 256/64/16 x 151,936 float32, p 0.95, model-like, peaked and
#             near-uniform logits, plus the kernel's launch configurations and whether the kept tokens agree
#   sampling  benchmarks/sampling_throughput.py on the Qwen3-0.6B shape, greedy (control) + the two top-p workloads,
#             STRATA_TOP_P=sort vs kernel, ROUNDS alternating rounds (each a fresh process)
# Estimate for `kernel,micro,sampling 3` on the H200: set-up ~15 s, kernel ~60 s, micro ~45 s, checkpoint ~20 s,
# sampling 6 processes x ~50 s (start-up ~20 s, greedy ~6 s, top-p 2 x 7-9 s, warm-ups) ~300 s: ~7.5 min. No
# sampling process starts after 450 s (each is cut at 90 s), so the call ends within ~9 min whatever happens.
set -u
source benchmarks/device_setup.sh "$1"
ROUNDS=${2:-2}
if phase kernel; then
  STRATA_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_top_p.py \
    tests/kernels/test_sampler_sync_gpu.py 2>&1 | tee "$OUTDIR/top_p_kernel_tests.log" | tail -15
fi
if phase micro; then
  timeout 120 python3 benchmarks/top_p_ab.py --rounds 3 --iters 20 2>"$OUTDIR/top_p_ab.err" >"$OUTDIR/top_p_ab.jsonl"
  tail -3 "$OUTDIR/top_p_ab.err"
  python3 - "$OUTDIR/top_p_ab.jsonl" <<'EOF'
import json, sys
for d in map(json.loads, open(sys.argv[1])):
    key = f"{d['rows']}x{d['vocab']} {d['logits']:8s} {d['path']:6s}"
    if d["path"] == "agree":
        print(key, {k: v for k, v in d.items() if k.startswith(("rows_", "tokens_", "kept", "row_", "buffer_"))})
    elif d["path"] == "cutoff":
        print(key, f"b{d['block']} s{d['splits']} c{d['cap']} w{d['num_warps']}", d["ms_p50"], "ms")
    else:
        print(key, "r", d["round"], d["ms_p50"], "ms")
EOF
fi
if phase sampling; then
  CKPT=/tmp/q06
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_bench; gpu_bench.write_random_qwen3(Path('$CKPT'))"
  for r in $(seq 0 $((ROUNDS - 1))); do
    if (( r % 2 == 0 )); then order="sort kernel"; else order="kernel sort"; fi
    for v in $order; do
      if (( SECONDS > 450 )); then echo "stopping before $v-r$r: ${SECONDS}s used (the call's 600 s)"; break 2; fi
      STRATA_TOP_P=$v timeout 90 python3 benchmarks/sampling_throughput.py $CKPT --workloads greedy,topp,topp_seeded \
        --label "$v-r$r" 2>"$OUTDIR/sampling_${v}_r$r.err" | tee -a "$OUTDIR/sampling_throughput.jsonl" \
        | python3 -c 'import json, sys
for d in map(json.loads, sys.stdin):
    print(d["label"], d["workload"], d["tok_per_s"], d["time_s"])'
      tail -3 "$OUTDIR/sampling_${v}_r$r.err" | grep -i error
    done
  done
  python3 - "$OUTDIR/sampling_throughput.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tps = {}
for d in rows:
    tps.setdefault((d["label"].split("-")[0], d["workload"]), []).append(d["tok_per_s"])
for (path, wl), v in sorted(tps.items()):
    print(f"{path:6s} {wl:12s} median {statistics.median(v):9.1f} tok/s  rounds {v}")
for wl in ("topp", "topp_seeded"):
    for path in ("sort", "kernel"):
        if (path, wl) in tps and (path, "greedy") in tps:
            print(f"{wl} / greedy ({path}): {statistics.median(tps[path, wl]) / statistics.median(tps[path, 'greedy']):.3f}")
EOF
fi
