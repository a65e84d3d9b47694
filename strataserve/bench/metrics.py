"""Aggregate per-request timings into the benchmark's figures (the names vLLM's bench prints and saves).

Definitions, over successful requests:
- TTFT: send -> first chunk with generated output (requests that produced no token have none).
- ITL: every gap between consecutive output chunks, pooled over requests.
- TPOT: per request, (latency - TTFT) / (output_tokens - 1), for requests with at least two output tokens.
- E2EL: send -> last chunk with generated output (vLLM's ``latencies``).
- Throughputs divide by ``duration_s`` (start of the measured run -> last completion).
- Goodput: requests per second that met every given SLO (``ttft``, ``tpot``, ``e2el`` in milliseconds); a request
  without a first token misses a TTFT SLO.
- Peak output tokens/s and peak concurrency as vLLM computes them: output chunks counted into 1-second buckets
  from the first send; the most requests open at once over [send, last output).
- Cost per 1M output tokens: ``gpu_cost_per_hour * duration_h / output_tokens * 1e6``.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from strataserve.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (95.0, 99.0)
STATS = ("mean", "median", "std", "p95", "p99")  # the stat names with DEFAULT_PERCENTILES
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


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """``--percentile-metrics ttft,e2el`` -> ``("ttft", "e2el")``."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in METRICS]
    if not names or bad:
        raise ValueError(f"--percentile-metrics {text!r}: give a comma-separated subset of {','.join(METRICS)}")
    return names


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``--metric-percentiles 50,90,99.9`` -> ``(50.0, 90.0, 99.9)``."""
    try:
        values = tuple(dict.fromkeys(float(p) for p in text.split(",") if p.strip()))
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: give comma-separated numbers, e.g. 50,90,99") from None
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: each percentile must be in [0, 100]")
    return values


def percentile_name(p: float) -> str:
    """vLLM's key spelling: 99 -> ``p99``, 99.9 -> ``p99.9``."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def stat_names(percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> tuple[str, ...]:
    return ("mean", "median", "std", *(percentile_name(p) for p in percentiles))


def summarize(values_ms: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean / median / std / p<N> (numpy's linear-interpolation percentiles); all 0.0 for no values."""
    if len(values_ms) == 0:
        return {s: 0.0 for s in stat_names(percentiles)}
    a = np.asarray(values_ms, dtype=np.float64)
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in percentiles:
        out[percentile_name(p)] = float(np.percentile(a, p))
    return out


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    if "ttft" in slos and r.output_tokens == 0:
        return False  # no first token: its TTFT is not 0, it is missing
    ms = {"ttft": r.ttft * 1e3, "tpot": (r.tpot or 0.0) * 1e3, "e2el": r.latency * 1e3}
    return all(ms[k] <= limit for k, limit in slos.items())


def peaks(ok: Sequence[RequestResult]) -> tuple[float, int]:
    """(most output chunks in one 1-second bucket from the first send, most requests open at once), as vLLM."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    times = [r.start_time + r.ttft + c - t0 for r in ok if r.output_tokens > 0 for c in np.cumsum([0.0, *r.itl])]
    buckets = np.bincount(np.asarray(times, dtype=np.int64)) if times else np.zeros(1)
    # sweep over half-open [start, end): an end at the same instant as a start is counted first
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    open_now = peak = 0
    for _, delta in events:
        open_now += delta
        peak = max(peak, open_now)
    return float(buckets.max()), peak


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    goodput_slos: dict[str, float] | None = None,
    gpu_cost_per_hour: float | None = None,
    metrics: Sequence[str] = METRICS,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, float | int | None]:
    """The flat result dict: counts, throughputs, ``{stat}_{metric}_ms`` for the chosen metrics and percentiles,
    peaks, goodput, cost."""
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
    for name in metrics:
        for stat, value in summarize(series[name], percentiles).items():
            out[f"{stat}_{name}_ms"] = value
    out["max_output_tokens_per_s"], out["max_concurrent_requests"] = peaks(ok)
    out["request_goodput"] = sum(_meets(r, goodput_slos) for r in ok) / duration_s if goodput_slos else None
    out["cost_per_1m_output_tokens"] = (
        gpu_cost_per_hour * duration_s / 3600.0 / total_out * 1e6 if gpu_cost_per_hour is not None and total_out else None
    )
    return out
