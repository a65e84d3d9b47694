"""The sampler's top-p step on the GPU: the full sort of every row (``STRATA_TOP_P=sort``) against the sort-free
cut-off kernel (``kernels/top_p.py``, the default), at the Qwen3 vocabulary over float32 logits, p = 0.95.

Logits (fixed seed): "model" = normal with std 2.5 divided by temperature 0.8; "peaked" = the same with a few tokens
raised by 8-16 (one token holds most of the mass, as in confident model steps); "uniform" = std 0.05 (near-uniform:
the nucleus is most of the vocabulary). Each path is timed with CUDA events around the call on a fresh copy of the
logits (warm-up first; rounds alternate the order); "cutoff" lines time the kernel alone in a few launch
configurations. The kept tokens of both paths are compared: rows that differ must lie within rounding of p at the
boundary (float64 mass of the smaller kept set and above the lower cut-off both within 1e-5 of p).

    python benchmarks/top_p_ab.py [--rounds 3] [--iters 20]
One JSON line per (shape, logits, path or configuration, round), then one "agree" line per (shape, logits).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strataserve.kernels.top_p import top_p_cutoff  # noqa: E402
from strataserve.runner.sampling_filters import _top_k_top_p_kernel, _top_k_top_p_sorted  # noqa: E402

SHAPES = ((256, 151_936), (64, 151_936), (16, 151_936))
P = 0.95
RTOL = 1e-5
# (block, splits, cap, num_warps); the first is the wrapper's default
CONFIGS = ((1024, 16, 16384, 16), (1024, 16, 8192, 16), (1024, 16, 32768, 16), (1024, 16, 16384, 8),
           (512, 16, 16384, 8), (1024, 8, 16384, 16), (2048, 8, 16384, 16))


def logits(kind: str, rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=g, device="cuda")
    if kind == "uniform":
        return x * 0.05
    x = x * 2.5
    if kind == "peaked":
        idx = torch.randint(0, vocab, (rows, 4), generator=g, device="cuda")
        x.scatter_add_(1, idx, 8.0 + 8.0 * torch.rand(rows, 4, generator=g, device="cuda"))
    return x / 0.8


def time_ms(fn, x: torch.Tensor, iters: int, fresh: bool) -> list[float]:
    """Per-call device times (ms); ``fresh``: each call gets its own copy of ``x`` (the paths filter in place)."""
    out = []
    for i in range(iters + 3):
        y = x.clone() if fresh else x
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(y)
        b.record()
        b.synchronize()
        if i >= 3:
            out.append(a.elapsed_time(b))
    return out


def agreement(x: torch.Tensor, ks: list[int], ps: list[float]) -> dict:
    s, k = x.clone(), x.clone()
    _top_k_top_p_sorted(s, ks, ps)
    _top_k_top_p_kernel(k, ks, ps)
    ks_, kk = torch.isfinite(s), torch.isfinite(k)
    differ = (ks_ != kk).any(dim=-1)
    probs = torch.softmax(x.double(), dim=-1)
    small = (probs * (ks_ & kk)).sum(dim=-1)
    union = probs * (ks_ | kk)
    lo = torch.minimum(torch.where(ks_, x, float("inf")).amin(-1, keepdim=True),
                       torch.where(kk, x, float("inf")).amin(-1, keepdim=True))
    above_lo = (union * (x > lo)).sum(dim=-1)
    boundary = ((small - P).abs() <= RTOL * P) & ((above_lo - P).abs() <= RTOL * P)
    stats = torch.zeros(x.shape[0], 2, dtype=torch.int32, device="cuda")
    top_p_cutoff(x, torch.full((x.shape[0],), P, device="cuda"), stats=stats)
    st = stats.float()
    return {"rows_differ": int(differ.sum()), "rows_differ_beyond_rounding": int((differ & ~boundary).sum()),
            "tokens_differ_max": int((ks_ != kk).sum(dim=-1).max()),
            "kept_mean": round(ks_.sum(-1).float().mean().item(), 1),
            "row_reads_mean": round(st[:, 0].mean().item(), 2), "row_reads_max": int(st[:, 0].max()),
            "buffer_reads_mean": round(st[:, 1].mean().item(), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    import triton

    g = torch.Generator(device="cuda").manual_seed(0)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for rows, vocab in SHAPES:
        ks, ps = [vocab] * rows, [P] * rows
        p_t = torch.full((rows,), P, device="cuda")
        for kind in ("model", "peaked", "uniform"):
            x = logits(kind, rows, vocab, g)
            paths = {"sort": lambda y: _top_k_top_p_sorted(y, ks, ps),
                     "kernel": lambda y: _top_k_top_p_kernel(y, ks, ps)}
            head = {"bench": "top_p_ab", "rows": rows, "vocab": vocab, "logits": kind, "p": P}
            for rnd in range(args.rounds):
                for name in (("sort", "kernel") if rnd % 2 == 0 else ("kernel", "sort")):
                    t = time_ms(paths[name], x, args.iters, fresh=True)
                    print(json.dumps({**head, "path": name, "round": rnd, "ms_p50": round(statistics.median(t), 4),
                                      "ms_min": round(min(t), 4)}), flush=True)
            for block, splits, cap, warps in CONFIGS:
                t = time_ms(lambda y: top_p_cutoff(y, p_t, block=block, splits=splits, cap=cap, num_warps=warps),
                            x, args.iters, fresh=False)
                print(json.dumps({**head, "path": "cutoff", "block": block, "splits": splits, "cap": cap,
                                  "num_warps": warps, "ms_p50": round(statistics.median(t), 4),
                                  "ms_min": round(min(t), 4)}), flush=True)
            print(json.dumps({**head, "path": "agree", **agreement(x, ks, ps), **meta}), flush=True)
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
