"""Stream-K against the tile grid and cuBLAS for the few-rows GEMM, per Llama-3.1-8B projection (run 25).

Timed as the start-up tuner times (``gemv_tuning._graph_seconds``): all 32 layers' weights of a shape in one CUDA
graph, PDL as the runner launches it. Per (shape, rows): cuBLAS, every tile-grid candidate of the tuner, and the
stream-K configurations below (one or more programs per SM as the tile's shared memory allows); µs per layer and
the fraction of the weight-read floor at the copy bandwidth measured first. One JSON line per (shape, rows):

    python benchmarks/stream_k_probe.py [--rows 16,64]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpu_kernels_bench as kb  # noqa: E402
from skinny_rows_probe import us  # noqa: E402
from strataserve.kernels.skinny_gemm import GemmConfig, skinny_gemm  # noqa: E402
from strataserve.runner.gemm_tuning import STREAM_K_CANDIDATES, TILE_CANDIDATES  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
LAYERS = 32
SMEM = 220 * 1024


def stream_k_configs() -> list[GemmConfig]:
    out = []
    for bm, bn, bk, warps, stages in ((64, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 8, 4),
                                      (64, 32, 256, 4, 3), (64, 128, 128, 8, 3), (64, 64, 128, 4, 3),
                                      (64, 32, 128, 4, 4)):
        smem = (bm + bn) * bk * 2 * stages
        for per_sm in (1, 2, 3):
            if per_sm * smem <= SMEM:
                out.append(GemmConfig(bm, bn, bk, 1, warps, stages, evict_first=True, stream_k=per_sm))
    out.append(GemmConfig(64, 64, 128, 1, 4, 4, stream_k=1))  # without evict-first
    return list(dict.fromkeys([*STREAM_K_CANDIDATES, *out]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="16,64")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = kb.copy_bandwidth()
    torch.manual_seed(0)
    tickets = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(LAYERS)]
        floor_us = n * k * 2 / bw * 1e6
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, dtype=dt, device=dev)
            ref = F.linear(x, ws[0])
            row = {"bench": "stream_k_probe", "proj": name, "rows": m, "shape": [n, k], "floor_us": round(floor_us, 2),
                   "copy_TBps": round(bw / 1e12, 3), "cublas": us(lambda: [F.linear(x, w) for w in ws], LAYERS)}
            for c in (*TILE_CANDIDATES, *stream_k_configs()):
                got = skinny_gemm(x, ws[0], config=c, tickets=tickets)
                err = (got.float() - ref.float()).abs().max().item()
                row[str(c)] = us(lambda c=c: [skinny_gemm(x, w, config=c, tickets=tickets) for w in ws], LAYERS) \
                    if err < 0.05 else f"wrong: max err {err:.3g}"
            timed = {key: v for key, v in row.items() if "/" in key and isinstance(v, float)}
            best = min(timed, key=timed.get)
            best_tile = min((key for key in timed if "/sk" not in key), key=timed.get)
            row.update(best=best, best_us=timed[best], best_tile=best_tile, best_tile_us=timed[best_tile],
                       best_floor_fraction=round(floor_us / timed[best], 3))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
