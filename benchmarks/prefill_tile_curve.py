"""Prefill step cost against its token count: is it smooth, or a staircase at the GEMM tile sizes?

A paced step's token count comes out of a time budget (``engine/step_budget.py``), so it is arbitrary (873, 925,
...). If cuBLAS computes whole 128- or 256-row tiles, a step of 925 tokens costs what 1,024 would, and the budget
wastes up to a tile of work per step. For the model shape's decoder matmuls (every layer's qkv, o, gate_up and
down, each weight read once, in one CUDA graph) this prints the time per token count from ``--start`` to
``--stop`` in steps of ``--step``, and the effective TFLOP/s. One JSON line per token count.

    PYTHONPATH=.:benchmarks python benchmarks/prefill_tile_curve.py [--model llama8b] [--start 768 --stop 2112]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from skinny_gemm_sweep import MODELS, projection_shapes  # noqa: E402
from strataserve.runner.gemv_tuning import _graph_seconds  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama8b", choices=tuple(MODELS))
    p.add_argument("--start", type=int, default=768)
    p.add_argument("--stop", type=int, default=2112)
    p.add_argument("--step", type=int, default=32)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    shapes = projection_shapes(args.model)
    layers = next(iter(shapes.values()))[1]
    ws = [[torch.randn(*shape, dtype=dt, device=dev) * 0.02 for (shape, _) in shapes.values()] for _ in range(layers)]
    flop_per_token = 2 * sum(n * k for (n, k), _ in shapes.values()) * layers
    for m in range(args.start, args.stop + 1, args.step):
        xs = {k: torch.randn(m, k, dtype=dt, device=dev) for (_, k), _ in shapes.values()}

        def fwd():
            for layer in ws:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)
        us = _graph_seconds(fwd, args.reps) * 1e6
        print(json.dumps({"bench": "prefill_tile_curve", "model": args.model, "tokens": m, "us": round(us, 1),
                          "us_per_token": round(us / m, 3), "tflops": round(flop_per_token * m / us / 1e6, 1),
                          "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
