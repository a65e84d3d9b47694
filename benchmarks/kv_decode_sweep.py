"""Paged decode attention alone at long context: bf16 vs fp8 vs int8 caches over launch configurations
(block_n, num_warps, num_stages, programs per SM), Llama-3.1-8B attention shape (32 q heads, 8 KV heads, 128).

    python benchmarks/kv_decode_sweep.py [--batch 32] [--ctx 8192]

Per configuration: median of 20 timed calls (CUDA events) after 3 warm-ups, as a fraction of copy bandwidth
(4.27 TB/s) over the K and V bytes read. One JSON line per point to stdout and $OUT/h200.jsonl.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_quant_bench import BW, KV, emit  # noqa: E402

from strataserve.kernels.decode_attention import default_num_splits, paged_decode_attention  # noqa: E402
from strataserve.kernels.kv_quant import quantize_ref  # noqa: E402

CONFIGS = [(64, 4, 2, 16), (128, 4, 2, 16), (64, 8, 2, 16), (64, 4, 3, 16), (64, 4, 2, 32)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=8192)
    args = ap.parse_args()
    B, L, Hq, Hkv, D, bs = args.batch, args.ctx, 32, 8, 128, 16
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nb = B * (L // bs) + 1
    tables = torch.randperm(nb - 1, device=dev)[: B * (L // bs)].view(B, L // bs).to(torch.int32)
    ctx = torch.full((B,), L, dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
    scale = torch.full((Hkv,), 4.0 / 448, device=dev)
    for name, dt in KV.items():
        x = torch.randn(nb, bs, Hkv, D, device=dev)
        kc = x.to(dt) if name == "auto" else quantize_ref(x, scale, dt)
        vc = kc.clone()
        del x
        sc = {} if name == "auto" else {"k_scale": scale, "v_scale": scale}
        nbytes = 2 * B * L * Hkv * D * dt.itemsize
        for bn, warps, stages, pps in CONFIGS:
            splits = default_num_splits(B, Hkv, sms, programs_per_sm=pps)
            out = torch.empty_like(q)

            def call():
                paged_decode_attention(q, kc, vc, tables, ctx, D ** -0.5, num_splits=splits, out=out, block_n=bn,
                                       num_warps=warps, num_stages=stages, **sc)
            try:
                for _ in range(3):
                    call()
                times = []
                for _ in range(20):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    call()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) / 1e3)
                t = sorted(times)[len(times) // 2]
                emit("kv_decode_kernel_sweep", kv_cache_dtype=name, batch=B, ctx=L, block_n=bn, num_warps=warps,
                     num_stages=stages, programs_per_sm=pps, splits=splits, us=round(t * 1e6, 1),
                     bw_fraction=round(nbytes / t / BW, 3))
            except Exception as exc:  # a configuration the GPU cannot run (shared memory) just drops out
                emit("kv_decode_kernel_sweep", kv_cache_dtype=name, block_n=bn, num_warps=warps, num_stages=stages,
                     programs_per_sm=pps, error=repr(exc)[:200])
        del kc, vc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
