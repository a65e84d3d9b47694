"""Paged decode attention over launch configurations at the runner's launch, and the rotary + KV store inside it
against its own launch at batch > 1 (issue 12, run 21).

Cases as ``decode_attention_ab.py`` (bf16, head_dim 128, shuffled 16-token pages, caches rotated past the L2, each
call replayed in a CUDA graph), the split launch as ``runner/triton_ops.decode_launch`` chooses it. Configurations:
every (block_n, num_warps, num_stages) of ``--configs``. One JSON line per (case, configuration) with µs per call
and the fraction of copy bandwidth over the K/V bytes, then one ``best`` line per case against the runner's
default (64, 4, 2). ``--rope``: for the 8B cases of more than one row, [rotary_store_kv + attention] against
[attention with ``rope=``] (PDL as the runner launches it), each at the default and at the case's best config,
rounds alternating which goes first.

    python benchmarks/decode_attention_probe.py [--cases 8b_b64_ctx576,...] [--rope] [--rounds 3]
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import gpu_kernels_bench as kb  # noqa: E402
from decode_attention_ab import runner_case  # noqa: E402

from strataserve.kernels.decode_attention import paged_decode_attention  # noqa: E402
from strataserve.kernels.rotary import DecodeRope  # noqa: E402
from strataserve.kernels.rotary_kv import rotary_store_kv  # noqa: E402

CASES = {  # name: (q heads, kv heads, context lengths)
    "8b_b1_ctx576": (32, 8, [576]),
    "8b_b16_ctx576": (32, 8, [576] * 16),
    "8b_b24_ctx576": (32, 8, [576] * 24),
    "8b_b32_ctx300": (32, 8, [300] * 32),
    "8b_b32_ctx576": (32, 8, [576] * 32),
    "8b_b40_ctx576": (32, 8, [576] * 40),
    "8b_b48_ctx576": (32, 8, [576] * 48),
    "8b_b64_ctx576": (32, 8, [576] * 64),
    "0.6b_b96_ctx800": (16, 8, [800] * 96),
    "0.6b_b128_ctx800": (16, 8, [800] * 128),
    "0.6b_b256_ctx800": (16, 8, [800] * 256),
    "0.6b_mixed_b176": (16, 8, sorted(random.Random(0).randint(100, 2048) for _ in range(176))),
}
DEFAULT = (64, 4, 2)


def _rope_inputs(lens: list[int], hkv: int, tables: torch.Tensor, d: int = 128) -> DecodeRope:
    B = len(lens)
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int64, device="cuda")
    slots = (tables[torch.arange(B, device="cuda"), pos // 16].long() * 16 + pos % 16)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    f = torch.outer(torch.arange(4096, device="cuda").float(), inv)
    cs = torch.cat([f.cos(), f.sin()], dim=-1)
    k = torch.randn(B, hkv, d, dtype=torch.bfloat16, device="cuda")
    return DecodeRope(pos, k, torch.randn_like(k), cs, slots)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--configs", default="32,64,128:2,4,8:1,2,3,4", help="block_ns:warps:stages")
    ap.add_argument("--rope", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    bw = kb.copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = list(itertools.product(*([int(x) for x in part.split(",")] for part in args.configs.split(":"))))
    for name in args.cases.split(","):
        hq, hkv, lens = CASES[name]
        B = len(lens)
        sets, q, ctx, kw, nbytes = runner_case(hq, hkv, lens, sms)
        splits, target = kw["num_splits"], kw["split_target"]
        ref = paged_decode_attention(q, sets[0][0], sets[0][1], sets[0][2], ctx, 0.088, **kw).float()
        times: dict = {}
        for bn, warps, stages in configs:
            cfg = dict(kw, block_n=bn, num_warps=warps, num_stages=stages)
            row = {"bench": "decode_attention_probe", "case": name, "splits": splits, "split_target": target,
                   "block_n": bn, "num_warps": warps, "num_stages": stages}
            try:
                got = paged_decode_attention(q, sets[0][0], sets[0][1], sets[0][2], ctx, 0.088, **cfg).float()
                row["max_abs_diff"] = round(float((got - ref).abs().max()), 5)
                t = kb._graph_t([lambda kc=kc, vc=vc, tb=tb: paged_decode_attention(q, kc, vc, tb, ctx, 0.088, **cfg)
                                 for kc, vc, tb in sets])
                times[(bn, warps, stages)] = t
                row.update(us=round(t * 1e6, 2), bw_frac=round(nbytes / t / bw, 3))
            except Exception as exc:  # shared memory or registers out of range: that point drops out
                row["error"] = repr(exc)[:160]
            print(json.dumps(row), flush=True)
        best = min(times, key=times.get)
        print(json.dumps({"bench": "decode_attention_probe", "case": name, "best": list(best),
                          "best_us": round(times[best] * 1e6, 2), "default_us": round(times[DEFAULT] * 1e6, 2),
                          "best_over_default": round(times[best] / times[DEFAULT], 4)}), flush=True)
        if args.rope and name.startswith("8b") and B > 1:
            _rope_ab(name, q, sets, ctx, lens, hkv, kw, {"default": DEFAULT, "best": best}, args.rounds, bw, nbytes)
        del sets
        torch.cuda.empty_cache()


def _rope_ab(name, q, sets, ctx, lens, hkv, kw, cfgs, rounds, bw, nbytes) -> None:
    """[rotary_store_kv, attention] against [attention(rope=)] in one graph each, per config."""
    ropes = [_rope_inputs(lens, hkv, tb) for _, _, tb in sets]
    B = len(lens)
    for tag, (bn, warps, stages) in cfgs.items():
        cfg = dict(kw, block_n=bn, num_warps=warps, num_stages=stages)

        def separate(kc, vc, tb, r):
            rotary_store_kv(q, r.k, r.v, r.positions, r.cos_sin_cache, kc, vc, r.slot_mapping, 128)
            return paged_decode_attention(q, kc, vc, tb, ctx, 0.088, **cfg)

        def inside(kc, vc, tb, r):
            return paged_decode_attention(q, kc, vc, tb, ctx, 0.088, rope=r, **cfg)
        variants = {"separate": separate, "inside": inside}
        for rnd in range(rounds):
            order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
            row = {"bench": "decode_attention_probe_rope", "case": name, "config": tag, "block_n": bn,
                   "num_warps": warps, "num_stages": stages, "round": rnd + 1, "rows": B}
            for v in order:
                fn = variants[v]
                t = kb._graph_t([lambda kc=kc, vc=vc, tb=tb, r=r, fn=fn: fn(kc, vc, tb, r)
                                 for (kc, vc, tb), r in zip(sets, ropes)])
                row[f"{v}_us"] = round(t * 1e6, 2)
            row["inside_over_separate"] = round(row["inside_us"] / row["separate_us"], 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
