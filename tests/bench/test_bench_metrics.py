"""Bench metric aggregation against numpy computed independently from the raw per-request values."""
from __future__ import annotations

import numpy as np
import pytest

from strataserve.bench.client import RequestResult
from strataserve.bench.metrics import compute_metrics, parse_goodput, summarize


def _res(ttft: float, itl: list[float], out: int, prompt: int = 10, ok: bool = True) -> RequestResult:
    return RequestResult(success=ok, prompt_len=prompt, output_tokens=out, ttft=ttft, itl=itl, latency=ttft + sum(itl), error="" if ok else "boom")


def _check(stats: dict[str, float], values: list[float]) -> None:
    a = np.array(values)
    assert stats["mean_"] == pytest.approx(a.mean())
    assert stats["median_"] == pytest.approx(np.percentile(a, 50))
    assert stats["std_"] == pytest.approx(a.std())
    assert stats["p95_"] == pytest.approx(np.percentile(a, 95))
    assert stats["p99_"] == pytest.approx(np.percentile(a, 99))


def test_compute_metrics_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    results = []
    for i in range(37):
        n = int(rng.integers(1, 9))
        results.append(_res(float(rng.uniform(0.01, 0.5)), [float(x) for x in rng.uniform(0.001, 0.05, n - 1)], n, prompt=i + 1))
    results.append(_res(0.2, [], 0, prompt=1000, ok=False))
    results.append(_res(0.3, [0.1], 2, prompt=1000, ok=False))
    m = compute_metrics(results, duration_s=4.0)
    ok = results[:37]
    assert m["completed"] == 37 and m["failed"] == 2
    assert m["total_input_tokens"] == sum(range(1, 38))
    out = sum(r.output_tokens for r in ok)
    assert m["total_output_tokens"] == out
    assert m["request_throughput"] == pytest.approx(37 / 4.0)
    assert m["output_throughput"] == pytest.approx(out / 4.0)
    assert m["total_token_throughput"] == pytest.approx((out + sum(range(1, 38))) / 4.0)
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [sum(r.itl) * 1000 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x * 1000 for r in ok for x in r.itl]
    e2el = [(r.ttft + sum(r.itl)) * 1000 for r in ok]
    assert len(tpot) < 37  # single-token requests have no TPOT
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        _check({k.replace(f"{name}_ms", ""): v for k, v in m.items() if k.endswith(f"_{name}_ms")}, values)
    assert m["request_goodput"] is None and m["cost_per_1m_output_tokens"] is None


def test_goodput_and_cost() -> None:
    results = [
        _res(0.1, [0.02] * 4, 5),  # ttft 100, tpot 20, e2el 180
        _res(0.3, [0.02] * 4, 5),  # ttft 300, e2el 380
        _res(0.1, [0.06] * 4, 5),  # tpot 60, e2el 340
        _res(0.05, [], 1),  # no tpot: only ttft and e2el count
    ]
    dur = 2.0
    assert compute_metrics(results, dur, {"ttft": 200})["request_goodput"] == pytest.approx(3 / dur)
    assert compute_metrics(results, dur, {"ttft": 200, "tpot": 50})["request_goodput"] == pytest.approx(2 / dur)
    assert compute_metrics(results, dur, {"e2el": 200})["request_goodput"] == pytest.approx(2 / dur)
    assert compute_metrics(results, dur, {"e2el": 100})["request_goodput"] == pytest.approx(1 / dur)
    cost = compute_metrics(results, dur, None, gpu_cost_per_hour=3.6)["cost_per_1m_output_tokens"]
    assert cost == pytest.approx(3.6 * (dur / 3600) / 16 * 1e6)


def test_empty_and_bad_inputs() -> None:
    m = compute_metrics([_res(0.1, [], 0, ok=False)], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0
    assert compute_metrics([], 1.0, gpu_cost_per_hour=2.0)["cost_per_1m_output_tokens"] is None
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], 0.0)
    assert summarize([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p95": 0.0, "p99": 0.0}


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:200", "tpot:12.5", "e2el:1000"]) == {"ttft": 200.0, "tpot": 12.5, "e2el": 1000.0}
    for bad, msg in (("ttft", "NAME:MS"), ("itl:5", "NAME:MS"), ("ttft:abc", "not a number"), ("tpot:0", "> 0")):
        with pytest.raises(ValueError, match=msg):
            parse_goodput([bad])


def test_goodput_ttft_needs_a_first_token_and_percentile_selection() -> None:
    """A request without output had TTFT 0 and met any TTFT SLO."""
    results = [_res(0.05, [0.01], 2), _res(0.0, [], 0)]
    assert compute_metrics(results, 1.0, {"ttft": 100})["request_goodput"] == pytest.approx(1.0)
    assert compute_metrics(results, 1.0, {"e2el": 100})["request_goodput"] == pytest.approx(2.0)
    m = compute_metrics(results, 1.0, metrics=("ttft", "e2el"), percentiles=(50.0, 99.9))
    assert {k for k in m if k.endswith("_ms")} == {f"{s}_{n}_ms" for n in ("ttft", "e2el")
                                                    for s in ("mean", "median", "std", "p50", "p99.9")}


def test_peaks_as_vllm() -> None:
    a = RequestResult(True, 1, output_tokens=3, ttft=0.1, itl=[0.2, 0.3], latency=0.6, start_time=10.0)
    b = RequestResult(True, 1, output_tokens=2, ttft=0.5, itl=[0.8], latency=1.3, start_time=10.2)
    c = RequestResult(True, 1, output_tokens=1, ttft=0.1, itl=[], latency=0.1, start_time=11.6)  # opens after a, b close
    m = compute_metrics([a, b, c], 2.0)
    # output chunks at 0.1, 0.3, 0.6 (a), 0.7, 1.5 (b), 1.7 (c) s from the first send: 4 in second 0
    assert m["max_output_tokens_per_s"] == 4.0 and m["max_concurrent_requests"] == 2
    assert compute_metrics([], 1.0)["max_concurrent_requests"] == 0
