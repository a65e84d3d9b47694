"""Run-6 launch-config sweeps on the GPU (used by gpu_bench.py's "sweeps6" item), each timed inside a CUDA graph:

- decode attention over mixed context lengths sorted ascending, as the runner lays decode rows out (the
  throughput workload's shape: Qwen3-0.6B, 8 kv heads of 128, G = 2): launch order (``reverse``) x splits x
  (block_n, warps, stages);
- the batch-1 small kernels of an 8B step: fused add + RMSNorm warps, rotary + KV store heads per program;
- the batch-1 GEMV against cuBLAS on the small projections of both shapes, with more split-K configurations.
"""
from __future__ import annotations

import json
import random

import torch

import gpu_kernels_bench as kb
from strataserve.kernels.decode_attention import default_num_splits, paged_decode_attention
from strataserve.kernels.rms_norm import fused_add_rms_norm
from strataserve.kernels.rotary_kv import rotary_store_kv
from strataserve.models.hf_config import RopeScaling
from strataserve.models.rope import build_cos_sin_cache

DT = torch.bfloat16


def decode_mixed_sweep(bw: float) -> list[dict]:
    rows = []
    for B in (60, 176, 256):
        rng = random.Random(B)
        lens = sorted(rng.randint(100, 1024) + rng.randint(0, 1024) for _ in range(B))
        ctx = max(lens)
        kc, vc, tables = kb._paged(B, ctx)
        q = torch.randn(B, 16, 128, dtype=DT, device="cuda")
        cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        nbytes = 2 * sum(lens) * 8 * 128 * 2
        row = {"kernel": f"decode_mixed_b{B}", "mean_ctx": round(sum(lens) / B), "default_splits":
               default_num_splits(B, 8)}
        for rev in (False, True):
            for splits in sorted({default_num_splits(B, 8), 2, 4}):
                for bn, nw, ns in ((64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 8, 2)):
                    key = f"rev{int(rev)}_sp{splits}_bn{bn}_w{nw}_s{ns}"
                    try:
                        t = kb._graph_t([lambda: paged_decode_attention(q, kc, vc, tables, cl, 0.088,
                                                                        num_splits=splits, block_n=bn,
                                                                        num_warps=nw, num_stages=ns,
                                                                        reverse=rev)] * 4)
                        row[key] = round(nbytes / t / bw, 3)
                    except Exception as exc:
                        row[key] = repr(exc)[:80]
        best = max((v, k) for k, v in row.items() if isinstance(v, float))
        row["best"] = best
        rows.append(row)
        print(json.dumps(row), flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    return rows


def small_kernel_sweep() -> list[dict]:
    """Microseconds per call at batch 1 (8B shapes), 32 different inputs per graph as in a step's 32 layers."""
    rows = []
    H = 4096
    xs = [torch.randn(1, H, dtype=DT, device="cuda") for _ in range(32)]
    rs = [torch.randn(1, H, dtype=DT, device="cuda") for _ in range(32)]
    w = torch.randn(H, dtype=DT, device="cuda")
    row = {"kernel": "fused_add_rms_norm_b1_h4096_us"}
    for nw in (1, 2, 4, 8, 16):
        t = kb._graph_t([lambda x=x, r=r, nw=nw: fused_add_rms_norm(x, r, w, 1e-5, num_warps=nw)
                         for x, r in zip(xs, rs)])
        row[f"w{nw}"] = round(t * 1e6, 2)
    rows.append(row)
    print(json.dumps(row), flush=True)
    cache = build_cos_sin_cache(128, 4096, 5e5, RopeScaling(), device="cuda")
    for T, hq, name in ((1, 32, "llama8b"), (256, 16, "qwen3")):
        qkvs = [torch.randn(T, (hq + 16) * 128, dtype=DT, device="cuda") for _ in range(8)]
        kc = torch.zeros(4 * T + 4, 16, 8, 128, dtype=DT, device="cuda")
        vc = torch.zeros_like(kc)
        pos = torch.arange(T, device="cuda") + 500
        slots = torch.arange(T, device="cuda") * 16 + 3
        row = {"kernel": f"rotary_store_kv_{name}_T{T}_us"}
        for hpp in (1, 2, 4, 8, 16, 32):
            def call(qkv, hpp=hpp):
                q, k, v = qkv.split([hq * 128, 1024, 1024], dim=-1)
                rotary_store_kv(q, k, v, pos, cache, kc, vc, slots, 128, heads_per_program=hpp)
            row[f"hpp{hpp}"] = round(kb._graph_t([lambda qkv=qkv: call(qkv) for qkv in qkvs]) * 1e6, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def gemv_sweep6(bw: float) -> list[dict]:
    shapes = {"qkv_8b": (6144, 4096), "o_8b": (4096, 4096), "down_8b": (4096, 14336), "gate_up_8b": (28672, 4096),
              "qkv_06b": (4096, 1024), "o_06b": (1024, 2048), "down_06b": (1024, 3072)}
    configs = [(16, 512, 1, 4, 3), (8, 512, 1, 4, 4), (16, 512, 2, 4, 3), (8, 512, 2, 4, 4), (16, 256, 4, 4, 4),
               (32, 256, 2, 4, 4), (4, 512, 1, 4, 4), (8, 256, 1, 4, 6), (16, 256, 2, 4, 6), (32, 128, 2, 4, 6),
               (8, 1024, 1, 8, 3), (16, 1024, 2, 8, 3), (64, 128, 4, 4, 4), (8, 512, 4, 4, 4), (32, 512, 1, 8, 3),
               (16, 512, 3, 4, 4)]
    return kb.gemv_sweep(bw, shapes, configs)
