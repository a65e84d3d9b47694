"""A fresh prompt's causal attention on CPU: PyTorch SDPA (what the CPU backend used for prompts with no cached
context) against the paged C kernel reading the same K/V from cache blocks (``runner/cpu_paged_attention.c``), and
that kernel with torch's sgemm withheld (``rows``: every query row alone; with it, prompts of 128+ rows take the
tiles of ``cpu_attention_gemm.h``).

Per shape (query heads, KV heads, head dim, prompt tokens), float32, torch's threads: all sides warmed up, then
timed over ``--reps`` calls each, in rotating order per round. One line per (round, shape):

    round=1 hq=8 hkv=4 d=32 tokens=144 sdpa_us=... kernel_us=... rows_us=... ratio=... tiles_ratio=...
    (ratio = kernel / sdpa time; tiles_ratio = kernel / rows time)

    python benchmarks/cpu_prefill_attention.py --rounds 3
"""
from __future__ import annotations

import argparse
import ctypes
import time

import strataserve  # noqa: F401  (its OpenMP defaults, before torch loads)
import torch
import torch.nn.functional as F

from strataserve.runner import cpu_kernel

SHAPES = [(8, 4, 32, n) for n in (32, 144, 256, 1024)] + [(16, 8, 128, n) for n in (128, 256, 2048)] + [(16, 8, 64, 512), (32, 8, 128, 64), (32, 8, 128, 512),
                                                          (14, 2, 64, 2048)]


def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    lib, blas = cpu_kernel.load(), cpu_kernel.torch_blas()
    if lib is None or blas is None:
        raise SystemExit("needs the C kernel and torch's MKL sgemm")
    blas = [ctypes.c_void_p(a) for a in blas]
    for r in range(1, args.rounds + 1):
        for hq, hkv, d, n in SHAPES:
            q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
            bs = args.block_size
            blocks = -(-n // bs)
            k_cache, v_cache = torch.zeros(blocks, bs, hkv, d), torch.zeros(blocks, bs, hkv, d)
            k_cache.view(-1, hkv, d)[:n], v_cache.view(-1, hkv, d)[:n] = k, v
            table = torch.arange(blocks, dtype=torch.int32)[None]
            i32 = lambda x: torch.tensor([x], dtype=torch.int32)  # noqa: E731
            out = torch.empty(n, hq, d)

            def sdpa():
                return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                      is_causal=True, enable_gqa=hq != hkv)

            def kernel():
                cpu_kernel.paged_attention(q, out, k_cache, v_cache, table, i32(0), i32(n), i32(n), d ** -0.5)

            def rows():
                lib.strata_set_blas(None, None)
                try:
                    kernel()
                finally:
                    lib.strata_set_blas(*blas)

            sides = {"sdpa": sdpa, "kernel": kernel, "rows": rows}
            names = list(sides)
            order = names[r % 3:] + names[:r % 3]
            us = {name: _time(sides[name], args.reps) for name in order}
            kernel()
            err = (out - sdpa().transpose(0, 1)).abs().max().item()
            print(f"round={r} hq={hq} hkv={hkv} d={d} tokens={n} sdpa_us={us['sdpa']:.0f} "
                  f"kernel_us={us['kernel']:.0f} rows_us={us['rows']:.0f} ratio={us['kernel'] / us['sdpa']:.3f} "
                  f"tiles_ratio={us['kernel'] / us['rows']:.3f} max_abs_diff={err:.1e}", flush=True)


if __name__ == "__main__":
    main()
