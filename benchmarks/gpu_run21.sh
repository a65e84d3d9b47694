#!/usr/bin/env bash
# Device run 21 (issue 12 items 1-3: decode attention's launch configuration, the rotary + KV store inside it at
# batch > 1, the served start-up). From the repo root on the device, with .whl carried:
#   bash benchmarks/gpu_run21.sh PHASES [ROUNDS]
# The phases of gpu_run20.sh / gpu_run19.sh (same variables), plus
#   aprobe    benchmarks/decode_attention_probe.py: every launch configuration (PROBE_CONFIGS) per case (PROBE_CASES,
#             default all) and, unless PROBE_ROPE=0, the rotary inside attention against its own launch; writes
#             $OUT/aprobe.jsonl
#   ropeab    benchmarks/decode_prologue_ab.py at the 8B shape, BATCHES (default 64): prologue, ropein, and with
#             aprobe's best configuration for 8b_b64_ctx576 (unless ATTN=BxWxS is given) attnBxWxS, ropein-attnBxWxS;
#             AB_VARIANTS replaces that list
#   startab   benchmarks/serve_startup.py, 8B shape: this tree, this tree with STRATA_WEIGHT_STREAM=0, with
#             STRATA_SERVE_DEFER_GRAPHS=0 and (if present) the tree under tmp/before, ROUNDS rounds in alternating
#             order (the first start compiles and tunes)
set -u
if [[ ,$1, == *,aprobe,* ]]; then
  (source benchmarks/device_setup.sh aprobe
   rope=--rope; [ "${PROBE_ROPE:-1}" = 0 ] && rope=
   timeout "${PROBE_TIMEOUT:-300}" python3 benchmarks/decode_attention_probe.py $rope --rounds "${2:-3}" \
     ${PROBE_CASES:+--cases $PROBE_CASES} ${PROBE_CONFIGS:+--configs $PROBE_CONFIGS} 2>> "$OUTDIR/aprobe.err" \
     | tee -a "$OUTDIR/aprobe.jsonl" \
     | grep -E '"best"|_rope"' | cut -c1-240
   tail -3 "$OUTDIR/aprobe.err")
fi
if [[ ,$1, == *,ropeab,* ]]; then
  (source benchmarks/device_setup.sh ropeab
   attn=${ATTN:-$(python3 -c '
import json, sys
best = [r["best"] for r in map(json.loads, open(sys.argv[1])) if r.get("case") == "8b_b64_ctx576" and "best" in r]
print("x".join(map(str, best[-1])) if best and best[-1] != [64, 4, 2] else "")' "$OUTDIR/aprobe.jsonl" 2>/dev/null)}
   variants=${AB_VARIANTS:-prologue,ropein${attn:+,attn$attn,ropein-attn$attn}}
   echo "ropeab variants: $variants"
   for b in ${BATCHES:-64}; do
     timeout "${DECODE_TIMEOUT:-420}" python3 benchmarks/decode_prologue_ab.py --shapes 8b --rounds "${2:-3}" \
       --batch "$b" --variants "$variants" 2>> "$OUTDIR/decode.err" | tee -a "$OUTDIR/decode.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print(r["shape"], r["batch"], r["round"], r["variant"], r["ms_per_step"], r["roofline_fraction"])'
   done
   tail -2 "$OUTDIR/decode.err")
fi
if [[ ,$1, == *,startab,* ]]; then
  (source benchmarks/device_setup.sh startab
   mkdir -p "$OUTDIR/startab"
   trees=(--tree final=. --tree stream0=. --env stream0:STRATA_WEIGHT_STREAM=0 --tree defer0=.
          --env defer0:STRATA_SERVE_DEFER_GRAPHS=0)
   [ -d tmp/before ] && trees+=(--tree before=tmp/before)
   OUT=$OUTDIR/startab timeout "${STARTUP_TIMEOUT:-420}" python3 benchmarks/serve_startup.py --model /tmp/ckpt8b \
     --write-8b "${trees[@]}" --rounds "${2:-3}" 2>&1 | python3 -c '
import json, sys
for l in sys.stdin:
    try:
        r = json.loads(l)
    except ValueError:
        continue
    print(r.get("round"), r.get("tree"), r.get("ready_s"), r.get("engine_spawned_s"), r.get("engine_phases") or r)')
fi
exec bash benchmarks/gpu_run20.sh "$@"
