"""Batch-1 GEMV launch configurations against cuBLAS (``gpu_kernels_bench.gemv_sweep``: every configuration over
enough weight copies to defeat L2, in one CUDA graph), over a grid of block sizes, warps, split-K, the weights'
eviction policy and the K loop's pipeline depth. One JSON line per shape: each configuration's fraction of copy
bandwidth, cuBLAS's, and the best:

    python benchmarks/gemv_sweep.py --shapes qkv,gate_up,down             # run 16's grid (stages had no effect)
    python benchmarks/gemv_sweep.py --grid stages --shapes qkv,o,gate_up,down,lm_head,06_qkv,06_gate_up

``--grid stages`` (run 17): the K loop pipelined 1-4 tiles deep (``GemvConfig.num_stages``; 1 is the loop as it
was before run 17, each tile's loads waiting for the previous tile's math), evict-first loads throughout.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import gpu_kernels_bench as kb  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096),  # Llama-3.1-8B
          "06_qkv": (4096, 1024), "06_o": (1024, 2048), "06_gate_up": (6144, 1024), "06_down": (1024, 3072)}  # 0.6B
GRIDS = {  # (block_n, block_k, split_k, warps, stages, evict_first)
    "run16": [(bn, bk, sk, nw, ns, ef) for bn, bk, nw, ns, sk, ef in
              itertools.product((8, 16, 32), (512, 1024), (4, 8), (2, 4), (1, 2), (False, True))],
    "stages": [(bn, bk, sk, nw, ns, True) for bn, bk, nw, ns, sk in
               itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (1, 2, 3, 4), (1, 2))
               if bn * bk * 2 * ns <= 160 * 1024],  # shared memory per program (the H200 has 227 KB per SM)
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,gate_up,down")
    p.add_argument("--grid", choices=sorted(GRIDS), default="run16")
    args = p.parse_args()
    bw = kb.copy_bandwidth()
    print(f'{{"copy_TBps": {bw / 1e12:.3f}, "grid": "{args.grid}", "configs": {len(GRIDS[args.grid])}}}', flush=True)
    kb.gemv_sweep(bw, {k: SHAPES[k] for k in args.shapes.split(",")}, GRIDS[args.grid])


if __name__ == "__main__":
    main()
