#!/usr/bin/env python3
"""Differential fuzz of the CPU paged-attention kernel (``runner/cpu_paged_attention.c``: the decode rows, the
AVX-512 row, the prompt tiles on torch's sgemm) against float64 dense attention, over random configurations for a
fixed time: query / KV heads (GQA ratios 1-8), head dims 16-256 (multiples of 16 take the AVX-512 row, others not),
float32 / bfloat16 / float16, block sizes 1-32, sliding windows, 1-6 sequences each a decode row, a short chunk or a
long one (128-400 rows: the tiles) after 0-300 cached tokens, one or two threads. Each case is
``tests/runner/test_cpu_attention.py``'s check (scattered blocks, strided q, an untouched gap row after each
sequence). Seeded, so a failure replays; exit status 1 on any failure.

    python scripts/fuzz_cpu_attention.py [--seconds 300] [--seed 0]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "runner")]

import torch  # noqa: E402
from test_cpu_attention import _against_dense  # noqa: E402


def case(rng: random.Random) -> dict:
    hkv = rng.choice([1, 2, 4, 8])
    q_len, kv_len = [], []
    for _ in range(rng.randint(1, 6)):
        kind = rng.random()
        ql = 1 if kind < 0.4 else rng.randint(2, 127) if kind < 0.7 else rng.randint(128, 400)
        q_len.append(ql)
        kv_len.append(ql + rng.choice([0, 0, rng.randint(1, 300)]))
    return dict(dtype=rng.choice([torch.float32] * 4 + [torch.bfloat16, torch.float16]), hkv=hkv,
                hq=hkv * rng.choice([1, 2, 3, 4, 7, 8]), d=rng.choice([16, 24, 32, 48, 64, 80, 96, 112, 128, 256]),
                window=rng.choice([None, None, 1, 2, rng.randint(3, 300)]), bs=rng.choice([1, 2, 4, 16, 32]),
                q_len=q_len, kv_len=kv_len, threads=rng.choice([1, 2]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    end = time.monotonic() + args.seconds
    n = fails = 0
    while time.monotonic() < end:
        c = case(rng)
        torch.set_num_threads(c["threads"])
        try:
            _against_dense(c["dtype"], c["hq"], c["hkv"], c["d"], c["window"], c["q_len"], c["kv_len"], bs=c["bs"],
                           seed=n)
        except AssertionError as exc:
            fails += 1
            print(f"FAIL case {n}: {c}\n  {str(exc)[:400]}", flush=True)
        n += 1
    print(f"cases={n} failures={fails} seed={args.seed}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
