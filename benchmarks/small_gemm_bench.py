"""The decode step's weight matmuls alone, per projection and batch size, against the bandwidth floor.

For a model shape (default the Qwen3-0.6B one of the throughput workload), every projection's matmuls over all
layers (each weight read once per step, as a decode step does) are replayed in a CUDA graph, with cuBLAS through
``torch.backends.cuda.preferred_blas_library`` = "cublas" and "cublaslt". The floor is the weights' bytes at the
measured copy bandwidth. One JSON line per (batch, library).

    PYTHONPATH=.:benchmarks python benchmarks/small_gemm_bench.py [--model qwen06b] [--batches 1,16,...]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpu_kernels_bench as kb  # noqa: E402
import gpu_model_bench as mb  # noqa: E402
from strataserve.runner.gemv_tuning import _graph_seconds  # noqa: E402


def graph_us(fn, reps: int = 30) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph (the start-up tuner's timing: median replay)."""
    return _graph_seconds(fn, reps) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen06b", choices=("qwen06b", "llama8b"))
    p.add_argument("--batches", default="1,16,32,64,96,128,192,256")
    p.add_argument("--libs", default="cublas,cublaslt")
    args = p.parse_args()
    cfg = mb.qwen3_06b() if args.model == "qwen06b" else mb.llama31_8b()
    bw = kb.copy_bandwidth()
    dev, dt = torch.device("cuda"), torch.bfloat16
    model = mb.build_random_model(cfg, dt, dev, ops=mb.make_ops("eager", cfg), seed=0, max_positions=64)
    groups = {"qkv": [ly.self_attn.qkv_weight for ly in model.layers],
              "o": [ly.self_attn.o_weight for ly in model.layers],
              "gate_up": [ly.mlp.gate_up_weight for ly in model.layers],
              "down": [ly.mlp.down_weight for ly in model.layers],
              "lm_head": [model.lm_head]}
    for lib in args.libs.split(","):
        torch.backends.cuda.preferred_blas_library(lib)
        for m in map(int, args.batches.split(",")):
            row = {"bench": "small_gemm", "model": args.model, "lib": lib, "batch": m,
                   "copy_TBps": round(bw / 1e12, 3)}
            total_us = total_floor = 0.0
            for name, ws in groups.items():
                x = torch.randn(m, ws[0].shape[1], dtype=dt, device=dev)
                us = graph_us(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
                floor = sum(w.numel() * w.element_size() for w in ws) / bw * 1e6
                row[name] = {"us": round(us, 1), "floor_us": round(floor, 1), "frac": round(floor / us, 3),
                             "us_per_matmul": round(us / len(ws), 2)}
                total_us += us
                total_floor += floor
            row.update(total_us=round(total_us, 1), total_floor_us=round(total_floor, 1),
                       frac=round(total_floor / total_us, 3))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
