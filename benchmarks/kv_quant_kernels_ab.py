"""Both attention kernels over bf16, fp8 and int8 caches: this tree's kernels against other versions of the two
modules, at the runner's launches, in one run.

Decode cases (head_dim 128, 16-token pages shuffled over the pool): the 8B shape (32 q / 8 kv heads) at batch 32
x 8,192 tokens (KV reads dominate), 64 x 576, 32 x 576 and 20 x 2,048, the Qwen3-0.6B shape (16 q / 8 kv heads) at
batch 256 x 800, 24 x 4,096 and on mixed lengths. Decode launches are ``runner/triton_ops.decode_launch``'s
(adaptive splits, rows last to first), replayed in a CUDA graph over caches rotated past the L2. Prefill cases:
one fresh 1,024-token 8B prompt, the 0.6B shape's 16 x 1,024, four 512-token 8B chunks after 1,536 cached tokens
(default launch). Rounds alternate
which version goes first. Quantised caches hold random values quantised with a per-head scale of 4 / 448.

One JSON line per (kernel, case, cache dtype, round): microseconds per call for each version, the fraction of copy
bandwidth over the K/V bytes (decode) or TFLOP/s (prefill), and the largest difference between the versions.

    python benchmarks/kv_quant_kernels_ab.py --old-decode FILE --old-prefill FILE [--rounds 3] [--kv auto,fp8,int8] \
        [--cases NAME,...]

``--only sweep``: this tree's decode kernel alone over launch configurations (key tile, warps, stages, split
target) on the 8B long-context, 8B batch-64 and 0.6B mixed cases, one JSON line per point.
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
from decode_attention_ab import _caches  # noqa: E402
from prefill_attention_sweep import _case  # noqa: E402

from strataserve.kernels import decode_attention as new_decode  # noqa: E402
from strataserve.kernels import prefill_attention as new_prefill  # noqa: E402
from strataserve.kernels.kv_quant import KV_QUANT_DTYPES, quantize_ref  # noqa: E402
from strataserve.runner.triton_ops import decode_launch  # noqa: E402

DECODE = {  # name: (q heads, kv heads, context lengths)
    "8b_b32_ctx8192": (32, 8, [8192] * 32),
    "8b_b64_ctx576": (32, 8, [576] * 64),
    "8b_b32_ctx576": (32, 8, [576] * 32),
    "8b_b20_ctx2048": (32, 8, [2048] * 20),
    "0.6b_b24_ctx4096": (16, 8, [4096] * 24),
    "0.6b_b256_ctx800": (16, 8, [800] * 256),
    "0.6b_mixed_b176": (16, 8, sorted(random.Random(0).randint(100, 2048) for _ in range(176))),
}
PREFILL = {  # name: (q heads, kv heads, new tokens per segment, cached tokens per segment, segments)
    "8b_1x1024": (32, 8, 1024, 0, 1),
    "0.6b_16x1024": (16, 8, 1024, 0, 16),
    "8b_4x512+1536": (32, 8, 512, 1536, 4),
}
SCALE = 4.0 / 448


def _quantise(kc: torch.Tensor, vc: torch.Tensor, kv: str):
    """The caches in dtype ``kv`` ("auto" = unchanged) and the scale kwargs of the kernels."""
    if kv == "auto":
        return kc, vc, {}
    hkv = kc.shape[2]
    s = torch.full((hkv,), SCALE, device=kc.device)
    dt = KV_QUANT_DTYPES[kv]
    return quantize_ref(kc.float(), s, dt), quantize_ref(vc.float(), s, dt), {"k_scale": s, "v_scale": s}


def _decode_set(lens: list[int], hkv: int, kv: str):
    kc, vc, tables = _caches(lens, hkv)
    return (*_quantise(kc, vc, kv), tables)


def _ab(rounds: int, row0: dict, versions, fns, out_of) -> None:
    """Time each version's calls (a list of thunks over rotating inputs), the order reversed every other round;
    the difference is between the first two versions' outputs."""
    diff = float((out_of(versions[0][1]) - out_of(versions[1][1])).abs().max())
    for r in range(rounds):
        row = {**row0, "round": r + 1, "max_abs_diff_old_new": round(diff, 5)}
        for tag, mod in (versions if r % 2 == 0 else versions[::-1]):
            row[f"{tag}_us"] = round(kb._graph_t(fns(mod)) * 1e6, 2)
        print(json.dumps(row), flush=True)


def bench_decode(old, kvs: list[str], rounds: int, bw: float, sms: int, cases: list[str]) -> None:
    for name in cases or DECODE:
        hq, hkv, lens = DECODE[name]
        B = len(lens)
        q = torch.randn(B, hq, 128, dtype=torch.bfloat16, device="cuda")
        ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
        splits, target = decode_launch(B, hkv, sms, 16, 6)  # the runner's defaults
        sems = torch.zeros(max(B * hkv, 4096), dtype=torch.int32, device="cuda")
        kw = dict(num_splits=splits, reverse=True, split_target=target, num_sms=sms,
                  semaphores=sems if target else None)
        for kv in kvs:
            item = 2 if kv == "auto" else 1
            nbytes = 2 * sum(lens) * hkv * 128 * item
            sets = kb._rotating(lambda kv=kv: _decode_set(lens, hkv, kv), 512 << 20, nbytes)
            kc0, vc0, sc0, tb0 = sets[0]

            def fns(mod, sets=sets):
                return [lambda kc=kc, vc=vc, sc=sc, tb=tb: mod.paged_decode_attention(
                    q, kc, vc, tb, ctx, 0.088, **kw, **sc) for kc, vc, sc, tb in sets]

            row0 = {"bench": "kv_quant_kernels_ab", "kernel": "decode", "case": name, "kv_cache_dtype": kv,
                    "kv_bytes": nbytes, "copy_bw": round(bw / 1e12, 3)}
            _ab(rounds, row0, [("old", old), ("new", new_decode)], fns,
                lambda mod: mod.paged_decode_attention(q, kc0, vc0, tb0, ctx, 0.088, **kw, **sc0).float())
            del sets
            torch.cuda.empty_cache()


def bench_prefill(old, kvs: list[str], rounds: int) -> None:
    for name, (hq, hkv, n, prefix, s) in PREFILL.items():
        q, kc, vc, tables, cu, lens, max_q, _, flops = _case(hq, hkv, n, prefix, s)
        for kv in kvs:
            qk, qv, sc = _quantise(kc, vc, kv)

            def fns(mod, qk=qk, qv=qv, sc=sc):
                return [lambda: mod.prefill_attention(q, qk, qv, tables, cu, lens, max_q, 0.088, **sc)] * 4

            row0 = {"bench": "kv_quant_kernels_ab", "kernel": "prefill", "case": name, "kv_cache_dtype": kv,
                    "tflop": round(flops / 1e12, 4)}
            _ab(rounds, row0, [("old", old), ("new", new_prefill)], fns,
                lambda mod, qk=qk, qv=qv, sc=sc: mod.prefill_attention(q, qk, qv, tables, cu, lens, max_q, 0.088,
                                                                      **sc).float())
        del q, kc, vc
        torch.cuda.empty_cache()


SWEEP = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (64, 8, 2), (128, 8, 3), (32, 4, 3)]


def sweep_decode(kvs: list[str], bw: float, sms: int) -> None:
    for name in ("8b_b32_ctx8192", "8b_b64_ctx576", "0.6b_mixed_b176"):
        hq, hkv, lens = DECODE[name]
        B = len(lens)
        q = torch.randn(B, hq, 128, dtype=torch.bfloat16, device="cuda")
        ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
        sems = torch.zeros(max(B * hkv, 4096), dtype=torch.int32, device="cuda")
        for kv in kvs:
            nbytes = 2 * sum(lens) * hkv * 128 * (2 if kv == "auto" else 1)
            sets = kb._rotating(lambda kv=kv: _decode_set(lens, hkv, kv), 512 << 20, nbytes)
            for target in (6, 12):
                splits, tgt = decode_launch(B, hkv, sms, 16, target)
                for bn, warps, stages in SWEEP if kv != "auto" else SWEEP[:1]:
                    kw = dict(num_splits=splits, reverse=True, split_target=tgt, num_sms=sms, block_n=bn,
                              num_warps=warps, num_stages=stages, semaphores=sems if tgt else None)
                    try:
                        t = kb._graph_t([lambda kc=kc, vc=vc, sc=sc, tb=tb: new_decode.paged_decode_attention(
                            q, kc, vc, tb, ctx, 0.088, **kw, **sc) for kc, vc, sc, tb in sets])
                        res = {"us": round(t * 1e6, 2), "bw_frac": round(nbytes / t / bw, 3)}
                    except Exception as exc:  # a configuration out of resources must not end the sweep
                        res = {"error": str(exc).splitlines()[0][:160]}
                    print(json.dumps({"bench": "kv_decode_sweep11", "case": name, "kv_cache_dtype": kv,
                                      "block_n": bn, "num_warps": warps, "num_stages": stages, "splits": splits,
                                      "split_target": tgt, **res}), flush=True)
            del sets
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-decode", help="another version of kernels/decode_attention.py")
    ap.add_argument("--old-prefill", help="another version of kernels/prefill_attention.py")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv", default="auto,fp8,int8")
    ap.add_argument("--only", default="decode,prefill")
    ap.add_argument("--cases", default="", help="decode cases to run (default: all)")
    args = ap.parse_args()
    kvs = args.kv.split(",")
    bw = kb.copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if "decode" in args.only:
        bench_decode(load_module(args.old_decode, "old_decode"), kvs, args.rounds, bw, sms,
                     list(filter(None, args.cases.split(","))))
    if "prefill" in args.only:
        bench_prefill(load_module(args.old_prefill, "old_prefill"), kvs, args.rounds)
    if "sweep" in args.only:
        sweep_decode(kvs, bw, sms)


if __name__ == "__main__":
    main()
