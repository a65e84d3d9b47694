"""Decode matmuls over 2-64 rows: cuBLAS or the few-rows Triton GEMM (``kernels/skinny_gemm.py``), chosen per weight
shape once at start-up by measuring both, as ``gemv_tuning.py`` does for one row.

Run 13 timed the Triton GEMM alone against cuBLAS and it won only the down projection. Run 19 timed a whole decode
step's matmuls in their order (``benchmarks/skinny_chain_ab.py``, Llama-3.1-8B shape, 64 rows): with each shape's
faster of the two, 0.837 of the weights' floor against cuBLAS's 0.803, and the full batch-64 step 0.787 of the
roofline against 0.760 (gate_up, down and lm_head go to the Triton GEMM; qkv and o stay cuBLAS). Two row counts are
timed, 16 (for steps of 2-16 rows) and 64 (17-64); with ``BLOCK_M`` = 64 the weights are read once either way, and
fewer rows only leave some of each tile's rows masked. Larger steps keep cuBLAS, unless ``STRATA_GEMM_ROWS`` adds
classes: run 24 timed 128 and 256 at the Qwen3-0.6B shape, where the Triton GEMM won 2 of 10 (shape, class) pairs
by 2-3% and the SiLU epilogue 1 of 2 by 7%, and nano-vllm's workload gained 0.5-0.7% (inside the spread between
rounds), so the default stays. Then gate_up with the SiLU-and-mul as its epilogue (``skinny_gemm_silu_mul``) is
timed against the pair it replaces (gate_up's choice + the activation's launch), run 20. The choices are kept on
disk beside the batch-1 ones.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from strataserve import envs
from strataserve.kernels.skinny_gemm import GemmConfig, skinny_gemm, skinny_gemm_silu_mul
from strataserve.runner.gemv_tuning import _graph_seconds, one_row_weights, rank_configs

log = logging.getLogger(__name__)

#: (largest row count a plan applies to, the row count it is timed at): by default steps of 2-16 rows, then 17-64
#: (``STRATA_GEMM_ROWS``)
ROW_CLASSES = tuple((rows, rows) for rows in envs.STRATA_GEMM_ROWS)
MAX_ROWS = ROW_CLASSES[-1][0]
# Run 19's fastest per 8B projection at 64 rows out of 16 (skinny_chain_ab.CANDIDATES): gate_up 64x256x64, down
# 64x32x256, lm_head 64x128x128 / 64x256x64, qkv 64x64x128, o 64x32x256 (evict-first: within 1%), plus a split one
# (down with PDL). Each candidate is a compile on an empty Triton cache, so the list stays short: three split-4
# configurations (64x128x128, 64x64x128, 64x256x64) were tried in 19c-19d and chosen for no shape.
CANDIDATES = (GemmConfig(64, 64, 128, 1, 4, 4), GemmConfig(64, 32, 256, 1, 4, 4),
              GemmConfig(64, 256, 64, 1, 4, 4), GemmConfig(64, 128, 128, 1, 8, 4),
              GemmConfig(64, 32, 256, 1, 4, 4, evict_first=True), GemmConfig(64, 64, 128, 2, 4, 4, evict_first=True))


# The gate_up matmul with the SiLU-and-mul as its epilogue (``skinny_gemm_silu_mul``): two accumulators per tile
# (gate and up columns over one x tile), so a BLOCK_N of 64 covers 128 of the weight's rows, as the plain GEMM's
# best gate_up tile (64x128x128) does. Run 20's probe (benchmarks/skinny_rows_probe.py, 8B gate_up, 64 rows): the
# first three within 1.2% of each other, 61.5-62.2 us per layer against 62.8 unfused; the 32-column one for
# narrower shapes.
SILU_CANDIDATES = (GemmConfig(64, 64, 128, 1, 4, 4), GemmConfig(64, 64, 128, 1, 8, 4, evict_first=True),
                   GemmConfig(64, 64, 64, 1, 4, 5), GemmConfig(64, 32, 128, 1, 4, 4))


@dataclass(frozen=True)
class GemmChoice:
    shape: tuple[int, int]
    rows: int  # the row class's largest row count (the plan's key)
    cublas_us: float  # "silu": the plain matmul's choice + the activation's launch
    best_us: float
    config: GemmConfig | None  # None: cuBLAS (or, "silu", the unfused pair) stays
    kind: str = "plain"  # "plain": x W^T; "silu": gate_up with the SiLU-and-mul epilogue


def plan_rows(rows: int) -> int | None:
    """The row class (its largest row count) a matmul over ``rows`` rows takes its plan from; None: cuBLAS."""
    if rows < 2:
        return None
    return next((top for top, _ in ROW_CLASSES if rows <= top), None)


def _tune_shapes(weights: dict[tuple[int, int], list[torch.Tensor]], baseline, fused, candidates, min_gain: float,
                 reps: int, row_classes, kind: str) -> list[GemmChoice]:
    """The timing loop both tunings share: per shape and row class, ``baseline(x, w, top, shape)`` and every
    candidate ``fused(x, w, c)`` over all that shape's weights in a CUDA graph; a candidate wins by ``min_gain``."""
    choices = []
    for shape, ws in weights.items():
        n = len(ws)
        for top, m in row_classes:
            x = torch.randn(m, shape[1], dtype=ws[0].dtype, device=ws[0].device)
            t_base = _graph_seconds(lambda: [baseline(x, w, top, shape) for w in ws], reps) / n
            timed = rank_configs(lambda c: lambda: [fused(x, w, c) for w in ws], candidates, reps, n)
            best_t, best_c = timed[0] if timed else (float("inf"), None)
            choices.append(GemmChoice(shape, top, t_base * 1e6, best_t * 1e6,
                                      best_c if best_t < t_base * (1 - min_gain) else None, kind))
    return choices


def _tickets(weights: dict[tuple[int, int], list[torch.Tensor]]) -> torch.Tensor:
    return torch.zeros(1 << 16, dtype=torch.int32, device=next(iter(weights.values()))[0].device)


@torch.inference_mode()
def tune_gemm(weights: dict[tuple[int, int], list[torch.Tensor]], candidates=CANDIDATES, min_gain: float = 0.005,
              reps: int = 5, row_classes=ROW_CLASSES) -> list[GemmChoice]:
    """Per shape and row class: cuBLAS against every candidate over all that shape's weights (CUDA only). The
    margin is small: timed alone, the Triton gate_up at the 8B shape was 1.9-6% faster than cuBLAS (19a-19c), and
    inside the step it paid more (19a: the batch-64 step 0.787 of the roofline with it, 19c: 0.770 without)."""
    t0 = time.perf_counter()
    tickets = _tickets(weights)
    choices = _tune_shapes(weights, lambda x, w, top, shape: F.linear(x, w),
                           lambda x, w, c: skinny_gemm(x, w, config=c, tickets=tickets), candidates, min_gain, reps,
                           row_classes, "plain")
    log.info("decode GEMM tuning (%.1f s): %s", time.perf_counter() - t0,
             "; ".join(f"{c.shape} <= {c.rows} rows: cuBLAS {c.cublas_us:.1f} us, Triton {c.best_us:.1f} us -> "
                       f"{c.config or 'cuBLAS'}" for c in choices))
    return choices


@torch.inference_mode()
def tune_gate_up_silu(weights: dict[tuple[int, int], list[torch.Tensor]], plain: list[GemmChoice],
                      candidates=SILU_CANDIDATES, min_gain: float = 0.005, reps: int = 5,
                      row_classes=ROW_CLASSES) -> list[GemmChoice]:
    """Per gate_up shape and row class: the SiLU-and-mul epilogue against the unfused pair it replaces, the
    matmul ``plain`` chose (cuBLAS or a Triton configuration) then ``silu_and_mul`` (CUDA only)."""
    from strataserve.kernels.activation import silu_and_mul

    chosen = {(c.rows, c.shape): c.config for c in plain}
    tickets = _tickets(weights)

    def unfused(x, w, top, shape):
        c0 = chosen.get((top, shape))
        return silu_and_mul(F.linear(x, w) if c0 is None else skinny_gemm(x, w, config=c0, tickets=tickets))

    choices = _tune_shapes(weights, unfused, lambda x, w, c: skinny_gemm_silu_mul(x, w, config=c), candidates,
                           min_gain, reps, row_classes, "silu")
    log.info("gate_up + SiLU epilogue tuning: %s", "; ".join(
        f"{c.shape} <= {c.rows} rows: unfused {c.cublas_us:.1f} us, fused {c.best_us:.1f} us -> "
        f"{c.config or 'unfused'}" for c in choices))
    return choices


def gate_up_weights(model: torch.nn.Module) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The decoder's fused [gate; up] weights by shape."""
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    for layer in model.layers:
        groups.setdefault(tuple(layer.mlp.gate_up_weight.shape), []).append(layer.mlp.gate_up_weight)
    return groups


def apply_gemm_tuning(model: torch.nn.Module, ops) -> list[GemmChoice]:
    """Tune ``model``'s decode matmuls of 2-``MAX_ROWS`` rows and its gate_up + SiLU pairs (or read the choices
    from disk) and install the winners in its ``TritonOps`` (``gemm_plan``, ``silu_plan``: the latter unless
    ``STRATA_GEMM_SILU=0``); returns every choice."""
    from strataserve.runner import tuning_cache

    weights = one_row_weights(model)
    key = _record_key(weights)
    path = tuning_cache.record_path("gemm", key)
    record = tuning_cache.load(path)
    choices = _from_record(record) if record is not None else None
    if choices is None:
        choices = tune_gemm(weights)
        choices += tune_gate_up_silu(gate_up_weights(model), choices)
        tuning_cache.save(path, key, [_to_record(c) for c in choices])
    else:
        log.info("decode GEMM choices from %s: %d Triton", path, sum(1 for c in choices if c.config))
    ops.gemm_plan = {(c.rows, c.shape): c.config for c in choices if c.config is not None and c.kind == "plain"}
    ops.silu_plan = {(c.rows, c.shape): c.config for c in choices
                     if c.config is not None and c.kind == "silu" and envs.STRATA_GEMM_SILU}
    return choices


def _record_key(weights: dict) -> dict:
    from strataserve.kernels import _common
    from strataserve.kernels import skinny_gemm as gemm_module
    from strataserve.runner.tuning_cache import environment_key

    # PDL changes the timings (the tuned launches use it up to PDL_MAX_ROWS rows)
    return {**environment_key(next(iter(weights.values()))[0], gemm_module.__file__),
            "shapes": sorted([list(s), len(ws)] for s, ws in weights.items()), "rows": ROW_CLASSES,
            "candidates": [asdict(c) for c in CANDIDATES], "silu_candidates": [asdict(c) for c in SILU_CANDIDATES],
            "pdl_max_rows": _common.PDL_MAX_ROWS}


def _to_record(c: GemmChoice) -> dict:
    return {"shape": list(c.shape), "rows": c.rows, "cublas_us": c.cublas_us, "best_us": c.best_us,
            "config": asdict(c.config) if c.config is not None else None, "kind": c.kind}


def _from_record(rows) -> list[GemmChoice] | None:
    try:
        return [GemmChoice(tuple(r["shape"]), int(r["rows"]), float(r["cublas_us"]), float(r["best_us"]),
                           GemmConfig(**r["config"]) if r["config"] is not None else None,
                           str(r.get("kind", "plain"))) for r in rows]
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring a malformed GEMM tuning record (%s): measuring again", exc)
        return None
