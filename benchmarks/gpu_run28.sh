#!/usr/bin/env bash
# Device run 28 (issue 12 item 3: the served path with the start-up heap frozen, STRATA_GC_FREEZE). From the repo
# root on the device, with .whl carried:   bash benchmarks/gpu_run28.sh [ROUNDS]
# serve_load_gpu.py, 8B shape, closed loop at concurrency 64 (192 prompts) and Poisson 16 req/s (160 prompts),
# "freeze" (the default) and "no_freeze" (STRATA_GC_FREEZE=0) side by side, alternating; every Python process also
# records its garbage collections (benchmarks/gc_pauses.py's probe, as sitecustomize) into $OUT/gc_probe/PID.json,
# and the rows carry their wall-clock window (t0, t1), so the pauses inside each run can be counted afterwards.
set -u
source benchmarks/device_setup.sh serve
mkdir -p /tmp/gcprobe "$OUTDIR/gc_probe"
python3 -c "import ast; t = ast.parse(open('benchmarks/gc_pauses.py').read()); print(next(n.value.value for n in \
  t.body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'PROBE'))" > /tmp/gcprobe/sitecustomize.py
export PYTHONPATH=/tmp/gcprobe:$PYTHONPATH GC_PROBE_DIR=$OUTDIR/gc_probe
serve_ab gc "${1:-3}" "freeze=." "no_freeze=. STRATA_GC_FREEZE=0"
tar czf "$OUTDIR/gc_probe.tgz" -C "$OUTDIR/gc_probe" . && rm -rf "$OUTDIR/gc_probe"  # too many files to bring back
