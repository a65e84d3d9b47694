"""Batch-1 GEMV launch configurations against cuBLAS on the 8B shapes (``gpu_kernels_bench.gemv_sweep``: every
configuration over enough weight copies to defeat L2, in one CUDA graph), over a grid of block sizes, warps,
stages, split-K and the weights' eviction policy. One JSON line per shape: each configuration's fraction of copy
bandwidth, cuBLAS's, and the best:

    python benchmarks/gemv_sweep.py --shapes qkv,gate_up,down
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import gpu_kernels_bench as kb  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,gate_up,down")
    args = p.parse_args()
    grid = [(bn, bk, sk, nw, ns, ef) for bn, bk, nw, ns, sk, ef in
            itertools.product((8, 16, 32), (512, 1024), (4, 8), (2, 4), (1, 2), (False, True))]
    bw = kb.copy_bandwidth()
    print(f'{{"copy_TBps": {bw / 1e12:.3f}}}', flush=True)
    kb.gemv_sweep(bw, {k: SHAPES[k] for k in args.shapes.split(",")}, grid)


if __name__ == "__main__":
    main()
