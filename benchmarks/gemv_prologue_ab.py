"""Batch-1 projections with the op before them fused into the GEMV, against that op + the matmul (H200).

For each projection that follows an elementwise op at batch 1 -- qkv after add + RMSNorm, gate_up after add +
RMSNorm, down after SiLU-and-mul -- of the Llama-3.1-8B shape (32 layers) and the Qwen3-0.6B shape (28 layers; also
the Qwen3-TTS talker's), every layer's weight (distinct matrices, so L2 holds few of them, as in a decode step) runs
in one CUDA graph, timed as ``runner/gemv_tuning.py`` times at start-up:

    unfused_cublas   the op's Triton kernel, then cuBLAS           (today's path where cuBLAS won the shape)
    unfused_gemv     the op's Triton kernel, then the best GEMV    (today's path where a GEMV won)
    fused            kernels/gemv.py with the op as its prologue   (best of the candidate configurations)

One JSON line per (round, shape, projection) with microseconds per layer and the best fused configuration:

    python benchmarks/gemv_prologue_ab.py --rounds 3 --shapes 8b,0.6b
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strataserve.kernels.activation import silu_and_mul  # noqa: E402
from strataserve.kernels.gemv import gemv, gemv_rms_norm, gemv_silu_mul  # noqa: E402
from strataserve.kernels.rms_norm import fused_add_rms_norm  # noqa: E402
from strataserve.kernels.gemv import GemvConfig  # noqa: E402
from strataserve.runner.gemv_tuning import CANDIDATES, _graph_seconds, rank_configs  # noqa: E402

# run 16 swept these beside the runner's candidates: taller row blocks, fewer programs re-reading x for the norm
TALL = (GemvConfig(32, 512, 1, 4, 3), GemvConfig(32, 256, 1, 4, 4), GemvConfig(64, 256, 1, 8, 3),
        GemvConfig(32, 512, 2, 8, 3))
SHAPES = {"8b": dict(H=4096, I=14336, QKV=6144, LAYERS=32), "0.6b": dict(H=1024, I=3072, QKV=4096, LAYERS=28)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--shapes", default="8b", help=f"comma-separated, of {sorted(SHAPES)}")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        run_shape(shape, args)


def run_shape(shape: str, args: argparse.Namespace) -> None:
    H, I, QKV, LAYERS = (SHAPES[shape][k] for k in ("H", "I", "QKV", "LAYERS"))
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    weights = {"qkv": [torch.randn(QKV, H, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)],
               "gate_up": [torch.randn(2 * I, H, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)],
               "down": [torch.randn(H, I, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]}
    nw = torch.rand(H, device=dev, dtype=dt) + 0.5
    x, r = torch.randn(1, H, device=dev, dtype=dt), torch.randn(1, H, device=dev, dtype=dt)
    gu = torch.randn(1, 2 * I, device=dev, dtype=dt)
    configs = list(dict.fromkeys(CANDIDATES + TALL))

    def unfused(name, mm):
        ws = weights[name]
        if name == "down":
            return lambda: [mm(silu_and_mul(gu), w) for w in ws]
        # the in-place add grows x over replays; harmless for timing (no data-dependent work)
        return lambda: [mm(fused_add_rms_norm(x, r, nw, 1e-5)[0], w) for w in ws]

    def fused(name, c):
        ws = weights[name]
        if name == "down":
            return lambda: [gemv_silu_mul(gu, w, config=c) for w in ws]
        return lambda: [gemv_rms_norm(x, r, nw, 1e-5, w, config=c) for w in ws]

    def best(make) -> tuple[float, str]:
        t, c = rank_configs(make, configs, args.reps, LAYERS)[0]  # the runner's own ranking
        return t * 1e6, f"{c.block_n}x{c.block_k}/s{c.split_k}/w{c.num_warps}/st{c.num_stages}"

    for rnd in range(args.rounds):
        for name in ("qkv", "gate_up", "down"):
            sides = ["unfused", "fused"] if rnd % 2 == 0 else ["fused", "unfused"]
            row = {"bench": "gemv_prologue_ab", "shape": shape, "round": rnd, "proj": name, "order": sides[0]}
            for side in sides:
                if side == "unfused":
                    row["unfused_cublas_us"] = round(_graph_seconds(unfused(name, F.linear), args.reps)
                                                     / LAYERS * 1e6, 2)
                    t, c = best(lambda c: unfused(name, lambda a, w: gemv(a, w, config=c)))
                    row["unfused_gemv_us"], row["unfused_gemv_config"] = round(t, 2), c
                else:
                    t, c = best(lambda c: fused(name, c))
                    row["fused_us"], row["fused_config"] = round(t, 2), c
            row["gain_vs_best_unfused"] = round(min(row["unfused_cublas_us"], row["unfused_gemv_us"])
                                                / row["fused_us"], 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
