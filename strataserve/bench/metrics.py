"""Aggregate per-request timings into the benchmark's figures (the names vLLM's bench prints and saves).

Definitions, over successful requests:
- TTFT: send -> first content chunk.  ITL: every gap between consecutive content chunks, pooled over requests.
- TPOT: per request, (latency - TTFT) / (output_tokens - 1), for requests with at least two output tokens.
- E2EL: send -> end of stream.
- Throughputs divide by ``duration_s`` (first send -> last completion of the measured run).
- Goodput: requests per second that met every given SLO (``ttft``, ``tpot``, ``e2el`` in milliseconds).
- Cost per 1M output tokens: ``gpu_cost_per_hour * duration_h / output_tokens * 1e6``.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from strataserve.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p95", "p99")
SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds); ValueError says what's wrong."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def summarize(values_ms: Sequence[float]) -> dict[str, float]:
    """mean / median / std / p95 / p99 (numpy's linear-interpolation percentiles); all 0.0 for no values."""
    if len(values_ms) == 0:
        return {s: 0.0 for s in STATS}
    a = np.asarray(values_ms, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
    }


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    ms = {"ttft": r.ttft * 1e3, "tpot": (r.tpot or 0.0) * 1e3, "e2el": r.latency * 1e3}
    return all(ms[k] <= limit for k, limit in slos.items())


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    goodput_slos: dict[str, float] | None = None,
    gpu_cost_per_hour: float | None = None,
) -> dict[str, float | int | None]:
    """The flat result dict: counts, throughputs, ``{stat}_{metric}_ms`` for every metric and stat, goodput, cost."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be > 0")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    series = {
        "ttft": [r.ttft * 1e3 for r in ok if r.output_tokens > 0],
        "tpot": [t * 1e3 for r in ok if (t := r.tpot) is not None],
        "itl": [x * 1e3 for r in ok for x in r.itl],
        "e2el": [r.latency * 1e3 for r in ok],
    }
    out: dict[str, float | int | None] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    for name in METRICS:
        for stat, value in summarize(series[name]).items():
            out[f"{stat}_{name}_ms"] = value
    out["request_goodput"] = sum(_meets(r, goodput_slos) for r in ok) / duration_s if goodput_slos else None
    out["cost_per_1m_output_tokens"] = (
        gpu_cost_per_hour * duration_s / 3600.0 / total_out * 1e6 if gpu_cost_per_hour is not None and total_out else None
    )
    return out
