"""The few-rows Triton GEMM (``kernels/skinny_gemm.py``) against cuBLAS, per projection and decode batch size.

For a model shape, each projection's weights over all layers (each read once, as a decode step reads them) are
multiplied in a CUDA graph by cuBLAS (``F.linear``) and by every launch configuration of a grid; the timing is the
start-up tuner's (median replay). One JSON line per (model, batch, projection): cuBLAS, the floor (weight bytes
at the measured copy bandwidth), the best configurations (a split one both with its reduce launch and with the
in-kernel combine, "+c"), and the best one's largest difference to cuBLAS.

    PYTHONPATH=.:benchmarks python benchmarks/skinny_gemm_sweep.py [--model qwen06b] [--batches 16,64,128,256]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpu_kernels_bench as kb  # noqa: E402
import gpu_model_bench as mb  # noqa: E402
from strataserve.kernels.skinny_gemm import GemmConfig, skinny_gemm  # noqa: E402
from strataserve.runner.gemv_tuning import _graph_seconds  # noqa: E402

MODELS = {"qwen06b": mb.qwen3_06b, "llama8b": mb.llama31_8b}


def projection_shapes(model: str) -> dict[str, tuple[tuple[int, int], int]]:
    """Each decoder projection's weight [N, K] and the layer count, from the model shape's config."""
    c = MODELS[model]()
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv": ((q + 2 * kv, c.hidden_size), c.num_layers), "o": ((c.hidden_size, q), c.num_layers),
            "gate_up": ((2 * c.intermediate_size, c.hidden_size), c.num_layers),
            "down": ((c.hidden_size, c.intermediate_size), c.num_layers)}


SMEM = 200 * 1024


def grid(m: int) -> list[GemmConfig]:
    bms = [16] if m <= 16 else [32, 64] if m <= 64 else [64, 128]
    bns = (32, 64, 128, 256) if m <= 64 else (32, 64, 128)
    out = []
    for bm, bn, bk, split in itertools.product(bms, bns, (64, 128, 256), (1, 2, 4, 8)):
        stage = (bm + bn) * bk * 2
        stages = min(4, SMEM // stage)
        if stages < 2:
            continue
        for warps in ((4, 8) if bm * bn >= 64 * 128 else (4,)):
            out.append(GemmConfig(bm, bn, bk, split, warps, stages))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen06b", choices=tuple(MODELS))
    p.add_argument("--batches", default="16,64,128,256")
    p.add_argument("--groups", default="qkv,o,gate_up,down")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    bw = kb.copy_bandwidth()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    tickets = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    for proj in args.groups.split(","):
        (n, k), layers = projection_shapes(args.model)[proj]
        ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(layers)]
        floor = layers * n * k * 2 / bw * 1e6
        for m in map(int, args.batches.split(",")):
            x = torch.randn(m, k, dtype=dt, device=dev)
            t0 = time.perf_counter()
            cublas = _graph_seconds(lambda: [F.linear(x, w) for w in ws], args.reps) * 1e6
            results = []
            runs = {}
            for c in grid(m):
                # a split launch both ways: partials added by a reduce launch, or in-kernel by tickets ("+c")
                for tk in ((None, tickets) if c.split_k > 1 else (None,)):
                    name = str(c) + ("+c" if tk is not None else "")
                    runs[name] = (c, tk)
                    try:
                        us = _graph_seconds(lambda c=c, tk=tk: [skinny_gemm(x, w, config=c, tickets=tk) for w in ws],
                                            args.reps) * 1e6
                    except Exception as exc:  # out of resources: this configuration just loses
                        results.append((float("inf"), name, type(exc).__name__))
                        continue
                    results.append((us, name, ""))
            results.sort()
            best = results[0]
            c_best, tk_best = runs[best[1]]
            got = skinny_gemm(x, ws[0], config=c_best, tickets=tk_best)
            diff = (got.float() - F.linear(x, ws[0]).float()).abs().max().item()
            best_reduce = min(r[0] for r in results if not r[1].endswith("+c"))
            print(json.dumps({"bench": "skinny_gemm_sweep", "model": args.model, "proj": proj, "batch": m,
                              "shape": [n, k], "layers": layers, "copy_TBps": round(bw / 1e12, 3),
                              "floor_us": round(floor, 1), "cublas_us": round(cublas, 1),
                              "cublas_frac": round(floor / cublas, 3), "best_us": round(best[0], 1),
                              "best_frac": round(floor / best[0], 3), "gain": round(cublas / best[0], 3),
                              "best_without_combine_us": round(best_reduce, 1),
                              "top": [[round(u, 1), s] for u, s, _ in results[:5]],
                              "failed": sum(1 for r in results if r[2]), "configs": len(results),
                              "max_abs_diff_vs_cublas": round(diff, 5), "sweep_s": round(time.perf_counter() - t0, 1),
                              "torch": torch.__version__}), flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
