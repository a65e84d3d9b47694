"""Is the few-rows GEMM at 64 rows bound by re-reading x? The same launch configurations at 16 and 64 rows.

With ``BLOCK_M`` = 64 a 16-row launch runs the same programs over the same weight tiles; only the x rows past 16 are
masked, so they are never loaded. If a shape's time falls from 64 to 16 rows, the x tiles every program re-reads
(from L2: one [64, K-range] tile per program, twice its weight tile's bytes at ``BLOCK_N`` = 32) are what it waits
on, and wider tiles over split K ranges are the fix. Per shape of the Llama-3.1-8B decoder (all 32 layers' weights
in one CUDA graph, the start-up tuner's timing, PDL as the runner launches it), per configuration: µs per layer at
each row count, split ones both with the in-kernel combine and with the reduce launch ("+reduce"); plus gate_up
with its SiLU epilogue against gate_up's best plain configuration + ``silu_and_mul``. One JSON line per (shape,
rows):

    python benchmarks/skinny_rows_probe.py [--rows 16,64]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from strataserve.kernels.activation import silu_and_mul  # noqa: E402
from strataserve.kernels.skinny_gemm import GemmConfig, skinny_gemm, skinny_gemm_silu_mul  # noqa: E402
from strataserve.runner.gemv_tuning import _graph_seconds  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
SMEM = 200 * 1024


def plain_configs() -> list[GemmConfig]:
    out = []
    for bn, split in ((32, 1), (64, 1), (128, 1), (64, 2), (128, 2), (128, 4), (256, 4), (256, 8)):
        bk = {32: 256, 64: 128, 128: 128, 256: 64}[bn]
        stages = min(4, SMEM // ((64 + bn) * bk * 2))
        out.append(GemmConfig(64, bn, bk, split, 4 if bn <= 64 else 8, stages, evict_first=True))
    return out


SILU = (GemmConfig(64, 64, 128, 1, 8, 4), GemmConfig(64, 64, 128, 1, 4, 4), GemmConfig(64, 64, 128, 1, 8, 3),
        GemmConfig(64, 128, 64, 1, 8, 4), GemmConfig(64, 64, 64, 1, 4, 5), GemmConfig(64, 32, 256, 1, 4, 3),
        GemmConfig(64, 32, 128, 1, 4, 4), GemmConfig(64, 64, 128, 1, 8, 4, evict_first=True))


def us(fn, n: int) -> float:
    try:
        return round(_graph_seconds(fn, 7) / n * 1e6, 2)
    except Exception as exc:  # noqa: BLE001 - out of resources: reported, not fatal
        return repr(exc)[:80]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="16,64")
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    tickets = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(LAYERS)]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, dtype=dt, device=dev)
            row = {"bench": "skinny_rows_probe", "proj": name, "rows": m, "shape": [n, k],
                   "cublas": us(lambda: [F.linear(x, w) for w in ws], LAYERS)}
            for c in plain_configs():
                row[str(c)] = us(lambda c=c: [skinny_gemm(x, w, config=c, tickets=tickets) for w in ws], LAYERS)
                if c.split_k > 1:
                    row[str(c) + "+reduce"] = us(lambda c=c: [skinny_gemm(x, w, config=c) for w in ws], LAYERS)
            if name == "gate_up":
                best = min((c for c in plain_configs() if isinstance(row[str(c)], float)), key=lambda c: row[str(c)])
                row["unfused:" + str(best)] = us(lambda: [silu_and_mul(skinny_gemm(x, w, config=best,
                                                                                   tickets=tickets)) for w in ws],
                                                 LAYERS)
                for c in SILU:
                    row["silu:" + str(c)] = us(lambda c=c: [skinny_gemm_silu_mul(x, w, c) for w in ws], LAYERS)
            print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
