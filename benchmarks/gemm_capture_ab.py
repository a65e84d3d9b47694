"""cuBLAS inside and outside a CUDA graph: the 8B shape's prefill matmuls at mixed-step token counts.

Run 15's kernel table of one mixed step (1,024 prompt tokens + 59 decodes, `mixed_step_profile.py --kernels`)
showed cuBLAS running other kernels in the graph-replayed step (nvjet 192x192 "TNN", 144x128) than in the eager
one (128x272 "TNT", 256x104), 8% slower. This separates the two causes: the token count (graphs pad to a bucket)
and the capture itself. For each M and weight shape: F.linear timed eagerly (CUDA events, median of 30) and as one
replayed graph, with the kernel each ran (torch.profiler). One JSON line per (M, shape).

    python benchmarks/gemm_capture_ab.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels_bench import event_us  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def kernel_of(fn) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA" and "Memcpy" not in e.key]
    return ",".join(n[:48] for n in names)


def main() -> None:
    torch.manual_seed(0)
    for m in (1024, 1056, 1083, 1088, 1120, 2048):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            eager = lambda: F.linear(x, w)  # noqa: E731
            for _ in range(5):
                eager()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                eager()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                F.linear(x, w)
            row = {"bench": "gemm_capture_ab", "m": m, "shape": name, "eager_us": round(event_us(eager, reps=30, warmup=0), 1),
                   "graph_us": round(event_us(g.replay, reps=30, warmup=0), 1), "eager_kernel": kernel_of(eager),
                   "graph_kernel": kernel_of(g.replay)}
            print(json.dumps(row), flush=True)
            del g


if __name__ == "__main__":
    main()
