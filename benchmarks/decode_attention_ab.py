"""Paged decode attention, this tree's kernel against another version of the module, at the runner's launch.

Cases (bf16, head_dim 128, 16-token pages shuffled over the pool): the 8B shape (32 q / 8 kv heads) at batch 1 and
64, the Qwen3-0.6B shape (16 q / 8 kv heads) at batch 256 and on mixed lengths. Each launch is what
``runner/triton_ops.py`` does (``decode_launch``: adaptive splits, rows last to first), replayed in a CUDA graph
over caches rotated past the L2; rounds alternate which version goes first. One JSON line per (case, round):
microseconds per call and the fraction of copy bandwidth over the K/V bytes.

    python benchmarks/decode_attention_ab.py --old FILE [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels_bench as kb  # noqa: E402
from _module_file import load_module  # noqa: E402

from strataserve.kernels import decode_attention as new  # noqa: E402
from strataserve.runner.triton_ops import decode_launch  # noqa: E402

CASES = {  # name: (q heads, kv heads, context lengths)
    "8b_b1_ctx576": (32, 8, [576]),
    "8b_b64_ctx576": (32, 8, [576] * 64),
    "0.6b_b256_ctx800": (16, 8, [800] * 256),
    "0.6b_mixed_b176": (16, 8, sorted(random.Random(0).randint(100, 2048) for _ in range(176))),
}


def _caches(lens: list[int], hkv: int, bs: int = 16, d: int = 128):
    need = sum(-(-n // bs) for n in lens)
    kc = torch.randn(need + 1, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    width = max(-(-n // bs) for n in lens)
    perm = torch.randperm(need, device="cuda").to(torch.int32)
    tables = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(lens):
        tables[i, :-(-n // bs)] = perm[at:at + -(-n // bs)]
        at += -(-n // bs)
    return kc, vc, tables


def runner_case(hq: int, hkv: int, lens: list[int], sms: int):
    """One case's inputs at the runner's launch: (rotating cache sets, q, context lengths, the launch keywords,
    the K/V bytes one call reads)."""
    B = len(lens)
    nbytes = 2 * sum(lens) * hkv * 128 * 2
    sets = kb._rotating(lambda: _caches(lens, hkv), 512 << 20, nbytes)
    q = torch.randn(B, hq, 128, dtype=torch.bfloat16, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    splits, target = decode_launch(B, hkv, sms, 16, 6)  # the runner's defaults (long-first, target 6)
    sems = torch.zeros(max(B * hkv, 4096), dtype=torch.int32, device="cuda")
    kw = dict(num_splits=splits, reverse=True, split_target=target, num_sms=sms, semaphores=sems if target else None)
    return sets, q, ctx, kw, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="another version of kernels/decode_attention.py")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    old = load_module(args.old, "old_decode")
    bw = kb.copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (hq, hkv, lens) in CASES.items():
        sets, q, ctx, kw, nbytes = runner_case(hq, hkv, lens, sms)
        splits, target = kw["num_splits"], kw["split_target"]
        ref = new.paged_decode_attention(q, *sets[0][:2], sets[0][2], ctx, 0.088, **kw).float()
        diff = float((old.paged_decode_attention(q, *sets[0][:2], sets[0][2], ctx, 0.088, **kw).float()
                      - ref).abs().max())
        for r in range(args.rounds):
            order = [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
            row: dict = {"bench": "decode_attention_ab", "case": name, "round": r + 1, "splits": splits,
                         "split_target": target, "max_abs_diff_old_new": round(diff, 5)}
            for tag, mod in order:
                t = kb._graph_t([lambda kc=kc, vc=vc, tb=tb, mod=mod: mod.paged_decode_attention(
                    q, kc, vc, tb, ctx, 0.088, **kw) for kc, vc, tb in sets])
                row[f"{tag}_us"] = round(t * 1e6, 2)
                row[f"{tag}_bw_frac"] = round(nbytes / t / bw, 3)
            print(json.dumps(row), flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
