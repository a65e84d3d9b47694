"""Batch-1 matmuls: cuBLAS or the Triton GEMV, chosen per weight shape once at start-up by measuring both.

Which is faster depends on the shape and the GPU (docs/gpu_notes.md, run 2: on the H200 cuBLAS won the large
gate_up / lm_head matrices and lost the small o projection), so nothing is hard-coded: every candidate runs over
all of the model's weights of one shape in a CUDA graph, as a decode step reads them (each matrix once, so the L2
cache holds none of them), and a GEMV configuration replaces cuBLAS only if it is ``min_gain`` faster.

Then the prologues (``tune_prologues``): the add + RMSNorm before qkv and gate_up and the SiLU-mul before down,
each as its own kernel + the matmul just chosen, against one GEMV that runs the op as its prologue. On the H200
(run 16) the fused GEMV won every projection of the Qwen3-0.6B shape (1.12-1.20x) and lost every one of the
Llama-3.1-8B shape (0.90-0.96x: there the saved ~2 us launch is smaller than cuBLAS's lead on large matrices).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strataserve.kernels.activation import silu_and_mul
from strataserve.kernels.gemv import GemvConfig, gemv, gemv_rms_norm, gemv_silu_mul
from strataserve.kernels.rms_norm import fused_add_rms_norm

log = logging.getLogger(__name__)

# The configurations that won some shape in the run-6 sweep of 16 (8B and 0.6B projections, docs/gpu_notes.md):
# split-K for the shapes with few rows, plain row blocks for the tall ones.
CANDIDATES = (GemvConfig(16, 512, 1, 4, 3), GemvConfig(16, 512, 2, 4, 3), GemvConfig(4, 512, 1, 4, 4),
              GemvConfig(16, 1024, 2, 8, 3), GemvConfig(8, 1024, 1, 8, 3), GemvConfig(16, 512, 3, 4, 4))
# The same for the GEMV with a prologue: in run 16's sweep (``benchmarks/gemv_prologue_ab.py``, which adds taller
# row blocks: fewer programs re-reading the x row for the RMS statistics) those won only shapes where the fused
# kernel lost anyway (the 8B shape's), so start-up compiles no more than these.
PROLOGUE_CANDIDATES = CANDIDATES


@dataclass(frozen=True)
class ShapeChoice:
    shape: tuple[int, int]
    cublas_us: float  # the baseline: cuBLAS (plain), the op's kernel + the chosen matmul (prologues)
    best_us: float
    config: GemvConfig | None  # None: the baseline stays
    prologue: str = ""  # "", "norm" or "silu"


def one_row_weights(model: torch.nn.Module) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The decoder's matmul weights grouped by [N, K] shape, in the order a decode step reads them."""
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    for layer in model.layers:
        for w in (layer.self_attn.qkv_weight, layer.self_attn.o_weight, layer.mlp.gate_up_weight,
                  layer.mlp.down_weight):
            groups.setdefault(tuple(w.shape), []).append(w)
    groups.setdefault(tuple(model.lm_head.shape), []).append(model.lm_head)
    return groups


def prologue_weights(model: torch.nn.Module) -> dict[tuple[str, tuple[int, int]], list[torch.Tensor]]:
    """The matmul weights that follow an RMSNorm ("norm": qkv, gate_up) or SiLU-mul ("silu": down), by shape."""
    groups: dict[tuple[str, tuple[int, int]], list[torch.Tensor]] = {}
    for layer in model.layers:
        for kind, w in (("norm", layer.self_attn.qkv_weight), ("norm", layer.mlp.gate_up_weight),
                        ("silu", layer.mlp.down_weight)):
            groups.setdefault((kind, tuple(w.shape)), []).append(w)
    return groups


def _graph_seconds(fn, reps: int) -> float:
    """Seconds per call of ``fn`` replayed in a CUDA graph (median of ``reps`` timed replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compiles / picks kernels outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del g
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def tune_gemv(weights: dict[tuple[int, int], list[torch.Tensor]], candidates=CANDIDATES, min_gain: float = 0.03,
              reps: int = 5) -> list[ShapeChoice]:
    """Measure cuBLAS and every candidate per shape; return the choice for each (CUDA only)."""
    choices = []
    t0 = time.perf_counter()
    for shape, ws in weights.items():
        x = torch.randn(1, shape[1], dtype=ws[0].dtype, device=ws[0].device)
        n = len(ws)
        t_cublas = _graph_seconds(lambda: [F.linear(x, w) for w in ws], reps) / n
        best_t, best_c = float("inf"), None
        for c in candidates:
            try:
                t = _graph_seconds(lambda c=c: [gemv(x, w, config=c) for w in ws], reps) / n
            except Exception as exc:  # a config the GPU cannot run (e.g. out of shared memory) just loses
                log.debug("gemv %s on %s failed: %s", c, shape, exc)
                continue
            if t < best_t:
                best_t, best_c = t, c
        chosen = best_c if best_t < t_cublas * (1 - min_gain) else None
        choices.append(ShapeChoice(shape, t_cublas * 1e6, best_t * 1e6, chosen))
    log.info("batch-1 GEMV tuning (%.1f s): %s", time.perf_counter() - t0,
             "; ".join(f"{c.shape}: cuBLAS {c.cublas_us:.1f} us, best GEMV {c.best_us:.1f} us -> "
                       f"{'GEMV ' + str(c.config) if c.config else 'cuBLAS'}" for c in choices))
    return choices


@torch.inference_mode()
def tune_prologues(weights: dict[tuple[str, tuple[int, int]], list[torch.Tensor]],
                   plain: dict[tuple[int, int], GemvConfig], candidates=PROLOGUE_CANDIDATES, min_gain: float = 0.03,
                   reps: int = 5) -> list[ShapeChoice]:
    """Per (prologue, shape): the op's kernel + the matmul ``plain`` chose (cuBLAS when absent) against the GEMV
    with the op as its prologue in each candidate configuration (CUDA only)."""
    choices = []
    t0 = time.perf_counter()
    for (kind, shape), ws in weights.items():
        dev, dt, n = ws[0].device, ws[0].dtype, len(ws)
        x = torch.randn(1, shape[1] * (2 if kind == "silu" else 1), dtype=dt, device=dev)
        r, nw = torch.randn(1, shape[1], dtype=dt, device=dev), torch.ones(shape[1], dtype=dt, device=dev)
        c0 = plain.get(shape)

        def mm(a, w):
            return gemv(a, w, config=c0) if c0 is not None else F.linear(a, w)

        if kind == "silu":
            t_base = _graph_seconds(lambda: [mm(silu_and_mul(x), w) for w in ws], reps) / n
        else:  # in place, as in the decoder: r grows over the replays, harmless (no value-dependent work)
            t_base = _graph_seconds(lambda: [mm(fused_add_rms_norm(x, r, nw, 1e-6)[0], w) for w in ws], reps) / n
        best_t, best_c = float("inf"), None
        for c in candidates:
            fused = ((lambda c=c: [gemv_silu_mul(x, w, config=c) for w in ws]) if kind == "silu" else
                     (lambda c=c: [gemv_rms_norm(x, r, nw, 1e-6, w, config=c) for w in ws]))
            try:
                t = _graph_seconds(fused, reps) / n
            except Exception as exc:  # a config the GPU cannot run (e.g. out of shared memory) just loses
                log.debug("%s-prologue gemv %s on %s failed: %s", kind, c, shape, exc)
                continue
            if t < best_t:
                best_t, best_c = t, c
        chosen = best_c if best_t < t_base * (1 - min_gain) else None
        choices.append(ShapeChoice(shape, t_base * 1e6, best_t * 1e6, chosen, kind))
    log.info("batch-1 prologue tuning (%.1f s): %s", time.perf_counter() - t0,
             "; ".join(f"{c.prologue} {c.shape}: separate {c.cublas_us:.1f} us, fused {c.best_us:.1f} us -> "
                       f"{'fused ' + str(c.config) if c.config else 'separate'}" for c in choices))
    return choices


def apply_tuning(model: torch.nn.Module, ops) -> list[ShapeChoice]:
    """Tune ``model``'s batch-1 matmuls (and, with ``STRATA_GEMV_PROLOGUE``, their prologues) and install the
    winners in its ``TritonOps``; returns every choice (for the start-up log and benchmarks)."""
    from strataserve import envs

    choices = tune_gemv(one_row_weights(model))
    ops.gemv_plan = {c.shape: c.config for c in choices if c.config is not None}
    if envs.STRATA_GEMV_PROLOGUE:
        fused = tune_prologues(prologue_weights(model), ops.gemv_plan)
        ops.prologue_plan = {(c.prologue, c.shape): c.config for c in fused if c.config is not None}
        choices += fused
    return choices
