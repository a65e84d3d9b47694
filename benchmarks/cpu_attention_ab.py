"""The CPU paged-attention kernel of two source trees, A/B on one thread (``runner/cpu_paged_attention.c``).

Each tree's kernel is built with the runner's flags into a temporary folder and loaded side by side. Per shape
(query heads, KV heads, head dim) two cases, float32, blocks of 16 scattered through the pool as a running engine
leaves them: ``decode``, 64 sequences with one query row each and U[64, 512] keys; ``prefill``, 4 fresh prompts of
U[100, 256] tokens. Each side is warmed up, then timed over ``--reps`` calls, alternating which goes first per round;
outputs are checked against the first tree's. One line per (round, shape, case):

    round=1 hq=8 hkv=4 d=32 case=decode new_us=... old_us=... ratio=... keys=... max_abs_diff=...

(``ratio``: first tree's time over the second's; ``keys``: key rows read per call.)

    python benchmarks/cpu_attention_ab.py --tree new=. --tree old=/path/to/worktree --rounds 3
"""
from __future__ import annotations

import argparse
import ctypes
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from strataserve.runner import cpu_kernel

SHAPES = [(8, 4, 32), (16, 8, 64), (32, 8, 128), (14, 2, 64)]


def build(tree: Path, out: Path) -> ctypes.CDLL:
    src = tree / "strataserve" / "runner" / "cpu_paged_attention.c"
    subprocess.run(["cc", *cpu_kernel._FLAGS, "-o", str(out), str(src)], check=True)
    lib = ctypes.CDLL(str(out))
    restype, argtypes = cpu_kernel._SIGNATURES["cpu_paged_attention"]["strata_paged_attention"]
    lib.strata_paged_attention.restype, lib.strata_paged_attention.argtypes = restype, argtypes
    return lib


def case(kind: str, hq: int, hkv: int, d: int, bs: int, seed: int) -> dict:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    kv = [rng.randint(64, 512) for _ in range(64)] if kind == "decode" else [rng.randint(100, 256) for _ in range(4)]
    q_len = [1] * len(kv) if kind == "decode" else list(kv)
    blocks = [-(-n // bs) for n in kv]
    perm = torch.randperm(sum(blocks) + 8, generator=gen).to(torch.int32)
    table = torch.zeros(len(kv), max(blocks), dtype=torch.int32)
    at = 0
    for s, n in enumerate(blocks):
        table[s, :n] = perm[at:at + n]
        at += n
    k_cache, v_cache = (torch.randn(len(perm), bs, hkv, d, generator=gen) for _ in range(2))
    rows = sum(q_len)
    starts = [sum(q_len[:s]) for s in range(len(kv))]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return {"q": torch.randn(rows, hq, d, generator=gen), "out": torch.empty(rows, hq, d), "k": k_cache,
            "v": v_cache, "table": table, "starts": i32(starts), "q_len": i32(q_len), "kv": i32(kv),
            "shape": (hq, hkv, d, bs), "keys": sum(kv) if kind == "decode" else sum(n * (n + 1) // 2 for n in kv)}


def call(lib: ctypes.CDLL, c: dict) -> None:
    hq, hkv, d, bs = c["shape"]
    i32p = lambda t: ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_int32))  # noqa: E731
    rc = lib.strata_paged_attention(c["q"].data_ptr(), c["q"].stride(0), c["out"].data_ptr(), c["k"].data_ptr(),
                                    c["v"].data_ptr(), i32p(c["table"]), c["table"].stride(0), i32p(c["starts"]),
                                    i32p(c["q_len"]), i32p(c["kv"]), len(c["kv"]), hq, hkv, d, bs, d ** -0.5, 0, 0)
    if rc != 0:
        raise RuntimeError(f"kernel returned {rc}")


def timed(lib: ctypes.CDLL, c: dict, reps: int) -> float:
    call(lib, c)
    t = time.perf_counter()
    for _ in range(reps):
        call(lib, c)
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="NAME=SOURCE_TREE (twice)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)  # the kernels' OpenMP threads too: one core, no pool
    trees = [(name, Path(tree).resolve()) for name, _, tree in (t.partition("=") for t in args.tree)]
    if len(trees) != 2:
        raise SystemExit("give exactly two --tree NAME=PATH")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(tree, Path(tmp) / f"{name}.so") for name, tree in trees}
        names = list(libs)
        for r in range(1, args.rounds + 1):
            for hq, hkv, d in SHAPES:
                for kind in ("decode", "prefill"):
                    c = case(kind, hq, hkv, d, args.block_size, seed=hq * d)
                    order = names if r % 2 else names[::-1]
                    us = {n: timed(libs[n], c, args.reps) for n in order}
                    outs = {}
                    for n in names:
                        call(libs[n], c)
                        outs[n] = c["out"].clone()
                    diff = (outs[names[0]] - outs[names[1]]).abs().max().item()
                    print(f"round={r} hq={hq} hkv={hkv} d={d} case={kind} " + " ".join(f"{n}_us={us[n]:.0f}" for n in names)
                          + f" ratio={us[names[0]] / us[names[1]]:.3f} keys={c['keys']} max_abs_diff={diff:.1e}",
                          flush=True)


if __name__ == "__main__":
    main()
