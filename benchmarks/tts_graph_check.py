"""GPU check (issue 10): the talker's all-decode steps replayed as CUDA graphs give the same frames as the same
runner without graphs (same ops, same weights). Random weights in the 0.6B shape, greedy talker and code
predictor, mixed-length texts (early steps mix prefill and decode and run eagerly; later ones replay), batches
that fill a bucket (4) and that need padding rows (3). float32: frames must be identical; bfloat16: the share of
identical frames is reported (different kernels per bucket size may flip near-tied argmaxes of random weights).

Prints ``GRAPHCHECK {...}`` lines; exits 1 if a float32 comparison differs or no step replayed a graph.

    python benchmarks/tts_graph_check.py
"""
from __future__ import annotations

import dataclasses
import json
import sys

import torch

import tts_bench as tb


def run(model, texts: list[list[int]], tag: str) -> tuple[list, int, int]:
    core, runner = tb.build_core(model, max_num_seqs=8, max_num_batched_tokens=4096, kv_cache_memory_gib=1.0)
    for i, t in enumerate(texts):
        tb.add(core, runner, model, f"{tag}-{i}", t)
    while core.has_unfinished_requests():
        core.step()
    frames = [runner.states[f"{tag}-{i}"].frames for i in range(len(texts))]
    steps = (runner.fused_steps, runner.graph_steps)
    core.shutdown()
    return frames, *steps


def main() -> int:
    raw, codec_raw = tb.shape("0.6B")
    gen = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in (40, 23, 57, 31)]
    tb.FRAMES = 48
    ok = True
    for dt in (torch.float32, torch.bfloat16):
        tb.DT = dt
        graphs = tb.our_model(raw, codec_raw)
        if not graphs.cuda_graphs:
            print("GRAPHCHECK " + json.dumps({"error": f"mode {tb.MODE} captures no graphs on {tb.DEV}"}))
            return 1
        plain = dataclasses.replace(graphs, cuda_graphs=False)  # the same weights and ops, no capture
        for batch in (4, 3):
            a, fused_a, graph_a = run(graphs, texts[:batch], f"g{batch}")
            b, fused_b, graph_b = run(plain, texts[:batch], f"e{batch}")
            pairs = [(x, y) for fa, fb in zip(a, b) for x, y in zip(fa, fb)]
            same = sum(x == y for x, y in pairs)
            identical = a == b
            row = dict(dtype=str(dt).split(".")[-1], batch=batch, frames=len(pairs), identical_frames=same,
                       all_identical=identical, graph_steps=graph_a, fused_steps=fused_a,
                       eager_run_fused_steps=fused_b, eager_run_graph_steps=graph_b)
            print("GRAPHCHECK " + json.dumps(row), flush=True)
            if graph_a == 0 or graph_b != 0 or (dt == torch.float32 and not identical):
                ok = False
        del graphs, plain
        torch.cuda.empty_cache()
    print("GRAPHCHECK " + json.dumps({"ok": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
