"""The few-rows Triton GEMM (``kernels/skinny_gemm.py``) against cuBLAS as a decode step runs them (run 19).

Run 13 timed each projection alone (``skinny_gemm_sweep.py``): at batch 64 of the Llama-3.1-8B shape cuBLAS ran qkv
at 0.72 of copy bandwidth, o at 0.66 and down at 0.77, and the Triton GEMM was no better. Those are short kernels
(8-36 us) whose ramp and tail are a large share. Run 18's programmatic dependent launch (PDL) and L2 prefetch of
the first weight tiles before the wait hide exactly that, but only between our own kernels. So here the whole
step's matmuls run in their order (per layer qkv, o, gate_up, down; then lm_head) in one CUDA graph:

- ``cublas``: ``F.linear`` throughout;
- ``skinny``: each projection's fastest Triton configuration (timed alone, without PDL);
- ``skinny-pdl``: the fastest with PDL and the prefetch (timed alone that way);
- ``skinny-pdl-nopf``: the same configurations with PDL, without the prefetch;
- ``mixed-pdl``: per projection whichever of cuBLAS and the PDL Triton GEMM was faster alone.

First one line per PDL mode with each shape's timings alone (µs per launch; run 19a's file has them summed over
the shape's layers, from this script's first form). Then one JSON line per (batch, round, variant): microseconds
per step, the weights' floor (bytes at the measured copy bandwidth) over it, the configurations.

    python benchmarks/skinny_chain_ab.py --batches 64 --rounds 3
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
import gpu_model_bench as mb  # noqa: E402
from strataserve import envs  # noqa: E402
from strataserve.kernels import _common  # noqa: E402
from strataserve.kernels.skinny_gemm import GemmConfig, skinny_gemm  # noqa: E402
from strataserve.runner.gemm_tuning import tune_gemm  # noqa: E402
from strataserve.runner.gemv_tuning import _graph_seconds  # noqa: E402

# run 13's best few at batch 64 per projection (skinny_gemm_sweep), their evict-first versions, and split ones
# that combine in-kernel (no reduce launch)
CANDIDATES = tuple(GemmConfig(*c) for c in (
    (64, 64, 128, 1, 4, 4), (64, 64, 256, 1, 4, 3), (64, 32, 128, 1, 4, 4), (64, 32, 256, 1, 4, 4),
    (64, 256, 64, 1, 4, 4), (64, 128, 128, 1, 4, 4), (64, 128, 128, 1, 8, 4), (64, 128, 128, 2, 4, 4),
    (64, 64, 128, 2, 4, 4), (64, 32, 128, 4, 4, 4))) + tuple(GemmConfig(*c, evict_first=True) for c in (
    (64, 64, 128, 1, 4, 4), (64, 32, 256, 1, 4, 4), (64, 256, 64, 1, 4, 4), (64, 128, 128, 1, 4, 4),
    (64, 64, 256, 1, 4, 3), (64, 64, 128, 2, 4, 4)))
TICKETS: dict[torch.device, torch.Tensor] = {}


def set_pdl(on: bool | None, prefetch: bool = True) -> None:
    """PDL for launches of any row count (on), batch 1 only (off, run 18's), or the runner's default (None,
    ``STRATA_PDL_MAX_ROWS``): ``_common.PDL_MAX_ROWS``."""
    envs.STRATA_PDL_PREFETCH = prefetch
    _common.PDL_MAX_ROWS = envs.STRATA_PDL_MAX_ROWS if on is None else 1 << 20 if on else 1


def tickets(dev: torch.device) -> torch.Tensor:
    if dev not in TICKETS:
        TICKETS[dev] = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    return TICKETS[dev]


def mm(x: torch.Tensor, w: torch.Tensor, c: GemmConfig | None) -> torch.Tensor:
    return F.linear(x, w) if c is None else skinny_gemm(x, w, config=c, tickets=tickets(x.device))


def tune(weights: dict[tuple[int, int], list[torch.Tensor]], m: int, pdl: bool, reps: int = 7,
         candidates=CANDIDATES) -> dict[tuple[int, int], tuple[float, float, GemmConfig]]:
    """Per weight shape: (cuBLAS us, best Triton us, best configuration), per layer, at ``m`` rows (the runner's
    start-up timing, ``gemm_tuning.tune_gemm``, over this wider candidate list)."""
    set_pdl(pdl)
    return {c.shape: (c.cublas_us, c.best_us, c.config)  # (no margin: the fastest configuration, whatever cuBLAS does)
            for c in tune_gemm(weights, candidates, min_gain=-float("inf"), reps=reps, row_classes=((m, m),))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="cublas,skinny,skinny-pdl,skinny-pdl-nopf,mixed-pdl")
    args = p.parse_args()
    bw = kb.copy_bandwidth()
    cfg = mb.llama31_8b()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    layers = [{"qkv": torch.randn(q + 2 * kv, h, dtype=dt, device=dev) * 0.02,
               "o": torch.randn(h, q, dtype=dt, device=dev) * 0.02,
               "gate_up": torch.randn(2 * inter, h, dtype=dt, device=dev) * 0.02,
               "down": torch.randn(h, inter, dtype=dt, device=dev) * 0.02} for _ in range(cfg.num_layers)]
    lm_head = torch.randn(cfg.vocab_size, h, dtype=dt, device=dev) * 0.02
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    for layer in layers:
        for w in layer.values():
            groups.setdefault(tuple(w.shape), []).append(w)
    groups[tuple(lm_head.shape)] = [lm_head]
    floor_us = sum(w.numel() * 2 for ws in groups.values() for w in ws) / bw * 1e6
    for m in map(int, args.batches.split(",")):
        x, xo, xi = (torch.randn(m, k, dtype=dt, device=dev) for k in (h, q, inter))
        alone = {pdl: tune(groups, m, pdl) for pdl in (False, True)}
        for pdl, res in alone.items():
            print(json.dumps({"bench": "skinny_chain_ab", "alone": True, "batch": m, "pdl": pdl,
                              "shapes": {f"{s[0]}x{s[1]}": [round(a, 1), round(b, 1), str(c)]
                                         for s, (a, b, c) in res.items()}}), flush=True)
        plans = {"cublas": ({}, False, True),
                 "skinny": ({s: c for s, (_, _, c) in alone[False].items()}, False, True),
                 "skinny-pdl": ({s: c for s, (_, _, c) in alone[True].items()}, True, True),
                 "skinny-pdl-nopf": ({s: c for s, (_, _, c) in alone[True].items()}, True, False),
                 "mixed-pdl": ({s: c for s, (a, b, c) in alone[True].items() if b < a}, True, True)}

        def step(plan):
            for layer in layers:
                for name, inp in (("qkv", x), ("o", xo), ("gate_up", x), ("down", xi)):
                    mm(inp, layer[name], plan.get(tuple(layer[name].shape)))
            mm(x, lm_head, plan.get(tuple(lm_head.shape)))

        order = args.variants.split(",")
        for rnd in range(args.rounds):
            for variant in (order if rnd % 2 == 0 else order[::-1]):
                plan, pdl, prefetch = plans[variant]
                set_pdl(pdl, prefetch)
                us = _graph_seconds(lambda: step(plan), 9) * 1e6
                print(json.dumps({"bench": "skinny_chain_ab", "batch": m, "round": rnd, "variant": variant,
                                  "us_per_step": round(us, 1), "floor_us": round(floor_us, 1),
                                  "floor_fraction": round(floor_us / us, 3), "copy_TBps": round(bw / 1e12, 3),
                                  "plan": {f"{s[0]}x{s[1]}": str(c) for s, c in plan.items()},
                                  "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
