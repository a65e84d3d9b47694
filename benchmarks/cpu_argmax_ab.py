"""The greedy token on CPU: ``torch.argmax(dim=-1)``, ``torch.max(dim=-1).indices`` and the C pass of
``runner/cpu_layer_ops.c`` (the sampler's ``row_argmax`` for float32; all three the same first index of the
largest value) over float32 logits rows, torch's threads (``--threads``), the order rotating per round. One line per
(round, shape):

    round=1 rows=64 vocab=4096 argmax_us=... max_us=... c_us=... ratio=... c_ratio=...
    (ratio = max / argmax time, c_ratio = C / max time)

    python benchmarks/cpu_argmax_ab.py --rounds 3
"""
from __future__ import annotations

import argparse
import time

import strataserve  # noqa: F401  (its OpenMP defaults, before torch loads)
import torch

from strataserve.runner.sampler import row_argmax

SHAPES = ((1, 4096), (64, 4096), (256, 4096), (64, 32000), (256, 151936))


def _time(fn, x: torch.Tensor, reps: int) -> float:
    for _ in range(5):
        fn(x)
    t = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--threads", type=int, default=0, help="torch (and OpenMP) threads; 0 = torch's default")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sides = {"argmax": lambda x: x.argmax(dim=-1), "max": lambda x: x.max(dim=-1).indices, "c": row_argmax}
    for r in range(1, args.rounds + 1):
        for rows, vocab in SHAPES:
            x = torch.randn(rows, vocab, generator=gen)
            assert torch.equal(sides["argmax"](x), sides["max"](x)) and torch.equal(sides["c"](x), sides["max"](x))
            names = list(sides)
            order = names[r % 3:] + names[:r % 3]
            us = {name: _time(sides[name], x, args.reps) for name in order}
            print(f"round={r} rows={rows} vocab={vocab} argmax_us={us['argmax']:.1f} max_us={us['max']:.1f} "
                  f"c_us={us['c']:.1f} ratio={us['max'] / us['argmax']:.3f} c_ratio={us['c'] / us['max']:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
