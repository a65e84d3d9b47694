"""Batch-1 matmuls: cuBLAS or the Triton GEMV, chosen per weight shape once at start-up by measuring both.

Which is faster depends on the shape and the GPU (docs/gpu_notes.md, run 2: on the H200 cuBLAS won the large
gate_up / lm_head matrices and lost the small o projection), so nothing is hard-coded: every candidate runs over
all of the model's weights of one shape in a CUDA graph, as a decode step reads them (each matrix once, so the L2
cache holds none of them), and a GEMV configuration replaces cuBLAS only if it is ``min_gain`` faster.

Then the prologues (``tune_prologues``): the add + RMSNorm before qkv and gate_up and the SiLU-mul before down,
each as its own kernel + the matmul just chosen, against one GEMV that runs the op as its prologue. On the H200
the fused GEMV won every projection of the Qwen3-0.6B shape (run 16: 1.12-1.20x); at the Llama-3.1-8B shape, with
the pipelined GEMV of run 17, it wins qkv (1.11x), ties gate_up and wins down by ~3-5%. The choices are kept on
disk for the next start (``apply_tuning``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from strataserve.kernels.activation import silu_and_mul
from strataserve.kernels.gemv import GemvConfig, gemv, gemv_rms_norm, gemv_silu_mul
from strataserve.kernels.rms_norm import fused_add_rms_norm

log = logging.getLogger(__name__)

# The K loop pipelined 3-4 tiles deep (cp.async), evict-first weight loads: run 17's sweep of 136 configurations on
# the H200 (docs/gpu_notes.md) had these within 1% of the best on every Llama-3.1-8B and Qwen3-0.6B projection, and
# every one of those bests faster than cuBLAS (gate_up 1.008 of copy bandwidth against 0.991, o 0.786 against 0.635).
# Plus one split-K configuration and one unpipelined, for shapes with few rows or a GPU with less shared memory.
CANDIDATES = tuple(GemvConfig(*c, evict_first=True) for c in (
    (8, 512, 1, 4, 4), (8, 256, 1, 4, 3), (8, 1024, 1, 4, 4), (8, 512, 1, 4, 3), (16, 256, 1, 4, 4),
    (16, 512, 1, 4, 4), (8, 512, 2, 4, 3), (16, 512, 1, 4, 1)))
# The GEMV with a prologue tries the same set (``benchmarks/gemv_prologue_ab.py`` adds taller row blocks, which
# re-read the x row for the RMS statistics in fewer programs: they won only where the fused kernel lost anyway).
PROLOGUE_CANDIDATES = CANDIDATES


@dataclass(frozen=True)
class ShapeChoice:
    shape: tuple[int, int]
    baseline_us: float  # cuBLAS (plain GEMVs); the op's own kernel + the matmul chosen for the shape (prologues)
    best_us: float
    config: GemvConfig | None  # None: the baseline stays
    prologue: str = ""  # "", "norm" or "silu"
    ranked: tuple[GemvConfig, ...] = ()  # the two fastest configurations, best first (not kept on disk)


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


def rank_configs(make, candidates, reps: int = 5, n: int = 1) -> list[tuple[float, GemvConfig]]:
    """``(seconds per call, config)`` of every candidate that runs, fastest first: ``make(config)`` returns a
    function doing ``n`` calls, timed in a CUDA graph. A configuration the GPU cannot run (e.g. out of shared
    memory) is left out."""
    timed = []
    for c in candidates:
        try:
            timed.append((_graph_seconds(make(c), reps) / n, c))
        except Exception as exc:  # noqa: BLE001 - any compile or launch failure just loses
            log.debug("gemv %s failed: %s", c, exc)
    return sorted(timed, key=lambda tc: tc[0])


def _choice(shape: tuple[int, int], t_base: float, timed: list[tuple[float, GemvConfig]], min_gain: float,
            prologue: str = "") -> ShapeChoice:
    best_t, best_c = timed[0] if timed else (float("inf"), None)
    return ShapeChoice(shape, t_base * 1e6, best_t * 1e6, best_c if best_t < t_base * (1 - min_gain) else None,
                       prologue, tuple(c for _, c in timed[:2]))


@torch.inference_mode()
def tune_gemv(weights: dict[tuple[int, int], list[torch.Tensor]], candidates=None, min_gain: float = 0.03,
              reps: int = 5) -> list[ShapeChoice]:
    """Measure cuBLAS and every candidate (default ``CANDIDATES``) per shape; return the choice for each (CUDA
    only)."""
    choices = []
    t0 = time.perf_counter()
    for shape, ws in weights.items():
        x = torch.randn(1, shape[1], dtype=ws[0].dtype, device=ws[0].device)
        t_cublas = _graph_seconds(lambda: [F.linear(x, w) for w in ws], reps) / len(ws)
        timed = rank_configs(lambda c: lambda: [gemv(x, w, config=c) for w in ws], candidates or CANDIDATES, reps,
                             len(ws))
        choices.append(_choice(shape, t_cublas, timed, min_gain))
    log.info("batch-1 GEMV tuning (%.1f s): %s", time.perf_counter() - t0,
             "; ".join(f"{c.shape}: cuBLAS {c.baseline_us:.1f} us, best GEMV {c.best_us:.1f} us -> "
                       f"{'GEMV ' + str(c.config) if c.config else 'cuBLAS'}" for c in choices))
    return choices


@torch.inference_mode()
def tune_prologues(weights: dict[tuple[str, tuple[int, int]], list[torch.Tensor]],
                   plain: dict[tuple[int, int], GemvConfig], candidates=None, min_gain: float = 0.03,
                   reps: int = 5, ranked: dict[tuple[int, int], tuple[GemvConfig, ...]] | None = None
                   ) -> list[ShapeChoice]:
    """Per (prologue, shape): the op's kernel + the matmul ``plain`` chose (cuBLAS when absent) against the GEMV
    with the op as its prologue in each candidate configuration (CUDA only). Candidates: ``ranked[shape]`` (the
    plain GEMV's fastest configurations for that shape: in run 16 the fused kernel's best was always among them,
    and each candidate is a compile on an empty Triton cache) and, for the norm, their 32-row versions, when given;
    else ``candidates``, else ``PROLOGUE_CANDIDATES``."""
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
            fused = lambda c: lambda: [gemv_silu_mul(x, w, config=c) for w in ws]  # noqa: E731
        else:  # in place, as in the decoder: r grows over the replays, harmless (no value-dependent work)
            t_base = _graph_seconds(lambda: [mm(fused_add_rms_norm(x, r, nw, 1e-6)[0], w) for w in ws], reps) / n
            fused = lambda c: lambda: [gemv_rms_norm(x, r, nw, 1e-6, w, config=c) for w in ws]  # noqa: E731
        configs = (ranked or {}).get(shape) or candidates or PROLOGUE_CANDIDATES
        if kind == "norm" and ranked and shape in ranked:  # each program re-reads x for the RMS statistics: taller
            # blocks do that in fewer programs (run 17: with 8-row blocks the fused gate_up lost ~5 us to it)
            configs = tuple(dict.fromkeys([*configs, *(replace(c, block_n=32) for c in configs if c.block_n < 32)]))
        choices.append(_choice(shape, t_base, rank_configs(fused, configs, reps, n), min_gain, kind))
    log.info("batch-1 prologue tuning (%.1f s): %s", time.perf_counter() - t0,
             "; ".join(f"{c.prologue} {c.shape}: separate {c.baseline_us:.1f} us, fused {c.best_us:.1f} us -> "
                       f"{'fused ' + str(c.config) if c.config else 'separate'}" for c in choices))
    return choices


def apply_tuning(model: torch.nn.Module, ops) -> list[ShapeChoice]:
    """Tune ``model``'s batch-1 matmuls (and, with ``STRATA_GEMV_PROLOGUE``, their prologues) and install the
    winners in its ``TritonOps``; returns every choice (for the start-up log and benchmarks). The choices are kept
    on disk (``runner/tuning_cache.py``): a restart on the same GPU, versions and shapes reuses them, which spares
    the timing and, on an empty Triton cache, compiling every candidate (~13 s for the 8B shape, run 16)."""
    from strataserve import envs
    from strataserve.runner import tuning_cache

    plain = one_row_weights(model)
    fused = prologue_weights(model) if envs.STRATA_GEMV_PROLOGUE else {}
    key = _record_key(plain, fused)
    path = tuning_cache.record_path("gemv", key)
    record = tuning_cache.load(path)
    choices = _from_record(record) if record is not None else None
    if choices is None:
        choices = tune_gemv(plain)
        if fused:
            choices += tune_prologues(fused, {c.shape: c.config for c in choices if c.config is not None},
                                      ranked={c.shape: c.ranked for c in choices})
        tuning_cache.save(path, key, [_to_record(c) for c in choices])
    else:
        log.info("batch-1 GEMV choices from %s: %d GEMV, %d prologue", path,
                 sum(1 for c in choices if c.config and not c.prologue),
                 sum(1 for c in choices if c.config and c.prologue))
    ops.gemv_plan = {c.shape: c.config for c in choices if c.config is not None and not c.prologue}
    ops.prologue_plan = {(c.prologue, c.shape): c.config for c in choices if c.config is not None and c.prologue}
    return choices


def _record_key(plain: dict, fused: dict) -> dict:
    """Everything the measured choice depends on."""
    from strataserve.kernels import gemv as gemv_module
    from strataserve.runner.tuning_cache import environment_key

    return {**environment_key(next(iter(plain.values()))[0], gemv_module.__file__),
            "plain": sorted([list(s), len(ws)] for s, ws in plain.items()),
            "prologue": sorted([k, list(s), len(ws)] for (k, s), ws in fused.items()),
            "candidates": [asdict(c) for c in CANDIDATES], "prologue_candidates": [asdict(c) for c in
                                                                                   PROLOGUE_CANDIDATES]}


def _to_record(c: ShapeChoice) -> dict:
    return {"shape": list(c.shape), "baseline_us": c.baseline_us, "best_us": c.best_us, "prologue": c.prologue,
            "config": asdict(c.config) if c.config is not None else None}


def _from_record(rows) -> list[ShapeChoice] | None:
    try:
        return [ShapeChoice(tuple(r["shape"]), float(r["baseline_us"]), float(r["best_us"]),
                            GemvConfig(**r["config"]) if r["config"] is not None else None, str(r["prologue"]))
                for r in rows]
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring a malformed GEMV tuning record (%s): measuring again", exc)
        return None
