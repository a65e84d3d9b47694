"""A fresh prompt's causal attention on CPU: PyTorch SDPA (what the CPU backend used for prompts with no cached
context) against the paged C kernel reading the same K/V from cache blocks (``runner/cpu_paged_attention.c``).

Per shape (query heads, KV heads, head dim, prompt tokens), float32, torch's threads: both sides warmed up, then
timed over ``--reps`` calls each, in alternating order per round. One line per (round, shape):

    round=1 hq=8 hkv=4 d=32 tokens=144 sdpa_us=... kernel_us=... ratio=...   (ratio = kernel / sdpa time)

    python benchmarks/cpu_prefill_attention.py --rounds 3
"""
from __future__ import annotations

import argparse
import time

import strataserve  # noqa: F401  (its OpenMP defaults, before torch loads)
import torch
import torch.nn.functional as F

from strataserve.runner import cpu_kernel

SHAPES = [(8, 4, 32, n) for n in (32, 144, 256, 1024)] + [(16, 8, 64, 512), (32, 8, 128, 64), (32, 8, 128, 512),
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

            sides = {"sdpa": sdpa, "kernel": kernel}
            order = list(sides) if r % 2 else list(sides)[::-1]
            us = {name: _time(sides[name], args.reps) for name in order}
            kernel()
            err = (out - sdpa().transpose(0, 1)).abs().max().item()
            print(f"round={r} hq={hq} hkv={hkv} d={d} tokens={n} sdpa_us={us['sdpa']:.0f} "
                  f"kernel_us={us['kernel']:.0f} ratio={us['kernel'] / us['sdpa']:.3f} max_abs_diff={err:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
