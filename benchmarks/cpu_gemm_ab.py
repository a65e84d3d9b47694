"""CPU float32 matmuls: ``F.linear`` (MKL, packs the weight on every call) against oneDNN over a weight packed once
(``torch.ops.mkldnn._linear_pointwise``, what vLLM's CPU backend does), on the tiny Llama's five weight shapes
(hidden 256, intermediate 688, vocab 4096: the issue-16 CPU workload).

Two figures per round, the order of the two sides alternating between rounds:
- ``fixed``: every shape at one row count M, many calls (what a per-shape microbenchmark sees);
- ``varying``: every M from 40 to 299 once, as an engine's steps see them (decodes + a prefill chunk); ``first``
  is the first pass (oneDNN creates a primitive per new M), ``again`` a second pass over the same Ms.

    python benchmarks/cpu_gemm_ab.py [--rounds 3] [--rows 1,2,8,64,128,256,512]

One line per (round, figure): ``cpu_gemm_ab round=R figure=... M=... mkl_us=... onednn_us=... ratio=...``.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (256, 512), "o": (256, 256), "gate_up": (256, 1376), "down": (688, 256), "lm_head": (256, 4096)}


def _time(fn, reps: int) -> float:
    for _ in range(max(2, reps // 10)):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,2,8,64,128,256,512")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = {n: torch.randn(nout, k) for n, (k, nout) in SHAPES.items()}
    mkl = lambda x, w, pw: F.linear(x, w)  # noqa: E731
    dnn = lambda x, w, pw: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")  # noqa: E731
    for r in range(1, args.rounds + 1):
        sides = [("mkl", mkl), ("onednn", dnn)] if r % 2 else [("onednn", dnn), ("mkl", mkl)]
        for m in (int(s) for s in args.rows.split(",")):
            us = {}
            for name, f in sides:
                total = 0.0
                for n, w in weights.items():
                    x = torch.randn(m, w.shape[1])
                    pw = torch.ops.mkldnn._reorder_linear_weight(w, 64)
                    total += _time(lambda: f(x, w, pw), max(20, 20000 // m))
                us[name] = total * 1e6
            print(f"cpu_gemm_ab round={r} figure=fixed M={m} mkl_us={us['mkl']:.0f} onednn_us={us['onednn']:.0f} "
                  f"ratio={us['mkl'] / us['onednn']:.2f}", flush=True)
        w = weights["gate_up"]
        xs = [torch.randn(m, w.shape[1]) for m in range(40, 300)]
        for name, f in sides:
            pw = torch.ops.mkldnn._reorder_linear_weight(w, 64)  # fresh packing: primitives for new Ms again
            passes = []
            for _ in range(2):
                t = time.perf_counter()
                for x in xs:
                    f(x, w, pw)
                passes.append((time.perf_counter() - t) * 1e3)
            print(f"cpu_gemm_ab round={r} figure=varying shape=gate_up side={name} first_ms={passes[0]:.1f} "
                  f"again_ms={passes[1]:.1f}", flush=True)


if __name__ == "__main__":
    main()
