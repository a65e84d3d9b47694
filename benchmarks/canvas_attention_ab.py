"""OmniVoice canvas attention (bidirectional, key-padding mask, GQA 16 q / 8 kv heads, head_dim 128): ways to run
one group of N rows of length L through SDPA, from the strided q/k/v views of the qkv output to ``[N * L, Hq * D]``.

- ``repeat``: k/v ``repeat_interleave``d to 16 heads, SDPA with the boolean mask, output transposed back (run 15's code);
- ``gqa``: SDPA's ``enable_gqa=True`` on the 8 kv heads, same mask;
- ``fold``: the query heads of one kv head folded into the query axis (bidirectional, so query order is free):
  q copied to ``[N, Hkv, G * L, D]``, SDPA over 8 heads, output unfolded.

Each is checked against ``repeat`` (max abs diff) and timed with CUDA events (median of 50, after 10 warm-ups),
3 rounds in rotating order. One JSON line per (shape, round).

    python benchmarks/canvas_attention_ab.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels_bench import event_us  # noqa: E402

HQ, HKV, D = 16, 8, 128
G = HQ // HKV


def inputs(n: int, length: int, real: int):
    qkv = torch.randn(n * length, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
    lengths = torch.full((n,), real, device="cuda")
    mask = (torch.arange(length, device="cuda")[None, :] < lengths[:, None]).view(n, 1, 1, length)
    return q, k, v, mask


def repeat(q, k, v, mask, n, length):
    q4 = q.reshape(n, length, HQ, D).transpose(1, 2)
    k4 = k.reshape(n, length, HKV, D).transpose(1, 2).repeat_interleave(G, dim=1)
    v4 = v.reshape(n, length, HKV, D).transpose(1, 2).repeat_interleave(G, dim=1)
    o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)
    return o.transpose(1, 2).reshape(n * length, HQ * D)


def gqa(q, k, v, mask, n, length):
    q4 = q.reshape(n, length, HQ, D).transpose(1, 2)
    k4 = k.reshape(n, length, HKV, D).transpose(1, 2)
    v4 = v.reshape(n, length, HKV, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
    return o.transpose(1, 2).reshape(n * length, HQ * D)


def fold(q, k, v, mask, n, length):
    # [N, L, Hkv, G, D] -> [N, Hkv, G, L, D] -> [N, Hkv, G * L, D] (one copy of q)
    qf = q.reshape(n, length, HKV, G, D).permute(0, 2, 3, 1, 4).reshape(n, HKV, G * length, D)
    k4 = k.reshape(n, length, HKV, D).transpose(1, 2)
    v4 = v.reshape(n, length, HKV, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(qf, k4, v4, attn_mask=mask)
    # [N, Hkv, G * L, D] -> [N, L, Hkv, G, D]
    return o.view(n, HKV, G, length, D).permute(0, 3, 1, 2, 4).reshape(n * length, HQ * D)


def main() -> None:
    torch.manual_seed(0)
    fns = {"repeat": repeat, "gqa": gqa, "fold": fold}
    for n, length, real in ((32, 224, 210), (32, 208, 200), (1, 224, 210), (8, 224, 210)):
        q, k, v, mask = inputs(n, length, real)
        want = repeat(q, k, v, mask, n, length).float()
        diffs = {}
        for name, fn in fns.items():
            try:
                diffs[name] = round(float((fn(q, k, v, mask, n, length).float() - want)[:, :].abs().max()), 5)
            except Exception as exc:  # noqa: BLE001 -- a backend that refuses the case is reported
                diffs[name] = repr(exc)[:120]
        names = [x for x in fns if isinstance(diffs[x], float)]
        for r in range(3):
            order = names[r % len(names):] + names[:r % len(names)]
            row = {"bench": "canvas_attention_ab", "n": n, "L": length, "real": real, "round": r + 1,
                   "max_abs_diff_vs_repeat": diffs}
            for name in order:
                row[f"{name}_us"] = round(event_us(lambda f=fns[name]: f(q, k, v, mask, n, length)), 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
