"""Prefill attention on the GPU: launch configurations of ``kernels/prefill_attention.py`` against flash SDPA.

Shapes (bf16, head_dim 128, 16-token pages in a shuffled page pool):
  8b_1x1024      one fresh 1,024-token prompt, 32 q / 8 kv heads (the served path's one-prompt step)
  8b_8x512       eight fresh 512-token prompts
  8b_4x512+1536  four 512-token chunks after 1,536 cached tokens each
  0.6b_16x1024   sixteen fresh 1,024-token prompts, 16 q / 8 kv heads (a throughput run's prefill step)
Each configuration (query positions per program, key tile, warps, stages, heads per program) is checked against
SDPA's output (max abs difference) and timed with triton.testing.do_bench (median). One JSON line per shape:
TFLOP/s of the causal work for each configuration and for SDPA on the same data laid out densely. ``--old FILE``
also times another version of the module (e.g. ``git show HEAD~1:strataserve/kernels/prefill_attention.py``).

    python benchmarks/prefill_attention_sweep.py [--old FILE]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing
from _module_file import load_module

from strataserve.kernels.prefill_attention import prefill_attention

DT = torch.bfloat16
SHAPES = {  # name: (q heads, kv heads, new tokens per segment, cached tokens per segment, segments)
    "8b_1x1024": (32, 8, 1024, 0, 1),
    "8b_8x512": (32, 8, 512, 0, 8),
    "8b_4x512+1536": (32, 8, 512, 1536, 4),
    "0.6b_16x1024": (16, 8, 1024, 0, 16),
}


def _case(hq: int, hkv: int, n: int, prefix: int, s: int, bs: int = 16, d: int = 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    L = n + prefix
    k = torch.randn(s, L, hkv, d, dtype=DT, device="cuda", generator=g)
    v = torch.randn(s, L, hkv, d, dtype=DT, device="cuda", generator=g)
    q = torch.randn(s, n, hq, d, dtype=DT, device="cuda", generator=g)
    nbps = -(-L // bs)
    pool = s * nbps + 7
    tables = torch.randperm(pool, device="cuda", generator=g)[: s * nbps].view(s, nbps).to(torch.int32)
    kc = torch.zeros(pool, bs, hkv, d, dtype=DT, device="cuda")
    vc = torch.zeros_like(kc)
    pos = torch.arange(L, device="cuda")
    for i in range(s):
        kc[tables[i, pos // bs].long(), pos % bs] = k[i]
        vc[tables[i, pos // bs].long(), pos % bs] = v[i]
    cu = torch.arange(0, s * n + 1, n, dtype=torch.int32, device="cuda")
    lens = torch.full((s,), L, dtype=torch.int32, device="cuda")
    # SDPA on the dense layout: the new rows attend to every cached key plus their causal part
    qd, kd, vd = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    mask = torch.ones(n, L, dtype=torch.bool, device="cuda").tril(prefix)
    sdpa = (lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)) if prefix == 0 \
        else (lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True))
    flops = 4 * s * hq * d * (n * prefix + n * (n + 1) // 2)
    return q.reshape(s * n, hq, d), kc, vc, tables, cu, lens, n, sdpa, flops


def _configs(group: int) -> list[tuple[int, int, int, int, int]]:
    """(positions per program, key tile, warps, stages, heads per program) for 64- and 128-row programs."""
    out = []
    for pack in sorted({1, min(2, group), group}):
        for rows in (64, 128):
            for bn in (64, 128):
                for stages in (2, 3):
                    out.append((rows // pack, bn, 4 if rows == 64 else 8, stages, pack))
    return out


def _tflops(fn, flops: int) -> float:
    return round(flops / (triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") / 1e3) / 1e12, 1)


def _sweep_shape(name: str, hq: int, hkv: int, n: int, prefix: int, s: int, old) -> dict:
    """One shape's row: SDPA, the other module at its defaults, and every configuration of this tree's kernel."""
    q, kc, vc, tables, cu, lens, max_q, sdpa, flops = _case(hq, hkv, n, prefix, s)
    ref = sdpa().transpose(1, 2).reshape(q.shape)
    row: dict = {"shape": name, "unit": "TFLOP/s", "sdpa": _tflops(sdpa, flops)}
    if old is not None:
        row["old_default"] = _tflops(lambda: old.prefill_attention(q, kc, vc, tables, cu, lens, max_q, 0.088), flops)
    worst = 0.0
    for bm, bn, nw, ns, pack in _configs(hq // hkv):
        key = f"m{bm}_n{bn}_w{nw}_s{ns}_p{pack}"
        try:
            def fn(bm=bm, bn=bn, nw=nw, ns=ns, pack=pack):
                return prefill_attention(q, kc, vc, tables, cu, lens, max_q, 128 ** -0.5, block_m=bm,
                                         block_n=bn, num_warps=nw, num_stages=ns, pack=pack)
            worst = max(worst, float((fn().float() - ref.float()).abs().max()))
            row[key] = _tflops(fn, flops)
        except Exception as exc:  # a configuration that does not fit the SM (shared memory) is reported
            row[key] = repr(exc)[:60]
    row["max_abs_diff_vs_sdpa"] = round(worst, 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="another version of kernels/prefill_attention.py to time at its defaults")
    args = ap.parse_args()
    old = None
    if args.old:
        old = load_module(args.old, "old_prefill")
    for name, shape in SHAPES.items():
        print(json.dumps(_sweep_shape(name, *shape, old)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
