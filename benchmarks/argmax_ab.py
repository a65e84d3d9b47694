"""The greedy token's argmax: ``kernels/argmax.py`` against ``torch.argmax`` over bf16 logits rows, each timed in a
CUDA graph that calls it 32 times on rotating inputs (as a decode graph calls it once per step, the logits fresh
from the lm_head), rounds alternating which goes first. One JSON line per (round, shape):

    python benchmarks/argmax_ab.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from gpu_kernels_bench import _graph_t  # noqa: E402
from strataserve.kernels.argmax import argmax_rows  # noqa: E402

SHAPES = ((1, 128256), (8, 128256), (64, 128256), (1, 151936), (256, 151936))  # Llama-3.1 and Qwen3 vocabularies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    for rnd in range(args.rounds):
        for B, V in SHAPES:
            xs = [torch.randn(B, V, dtype=torch.bfloat16, device="cuda") for _ in range(32)]
            same = all(torch.equal(argmax_rows(x), x.argmax(-1)) for x in xs)
            sides = {"torch": lambda x: x.argmax(-1), "kernel": argmax_rows}
            t = {}
            for name in (("torch", "kernel") if rnd % 2 == 0 else ("kernel", "torch")):
                t[name] = _graph_t([lambda x=x, f=sides[name]: f(x) for x in xs]) * 1e6
            print(json.dumps({"bench": "argmax_ab", "round": rnd, "batch": B, "vocab": V, "same": same,
                              "torch_us": round(t["torch"], 2), "kernel_us": round(t["kernel"], 2),
                              "speedup": round(t["torch"] / t["kernel"], 2)}), flush=True)


if __name__ == "__main__":
    main()
