"""The dashboard feed (api/console.py) without a browser: histogram quantiles against numpy's exact percentiles,
and the 1 s samples (rates, windowed quantiles, ring buffer, `since`) over a real Router and RouterMetrics, with
a fake clock (no test here waits or measures wall-clock time)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from strataserve.api import console
from strataserve.api.console import ConsoleFeed, bucket_quantile
from strataserve.api.metrics import LoopHistogram
from strataserve.types.protocol import SchedulerStats
from strataserve.router.cost import CostMeter
from strataserve.router.metrics import RouterMetrics, RouteTrace
from strataserve.router.router import Router
from strataserve.router.types import Backend, ModelCard, Payload


def _bucket_of(bounds: list[float], x: float) -> tuple[float, float]:
    i = int(np.searchsorted(bounds, x, side="left"))
    return (bounds[i - 1] if i else 0.0), bounds[i]


@pytest.mark.parametrize("q", [0.5, 0.95])
@pytest.mark.parametrize("seed", [0, 1])
def test_bucket_quantile_lands_in_the_bucket_of_the_exact_percentile(q, seed):
    rng = np.random.default_rng(seed)
    values = rng.lognormal(mean=-3.0, sigma=1.0, size=5000)
    h = LoopHistogram("x", "x", tuple(np.geomspace(1e-4, 10, 40)))
    for v in values:
        h.observe(float(v))
    est = bucket_quantile(h.bounds, h.counts, q)
    lo, hi = _bucket_of(h.bounds, float(np.quantile(values, q)))
    assert lo <= est <= hi


def test_bucket_quantile_edges():
    bounds = [0.1, 1.0, float("inf")]
    assert bucket_quantile(bounds, [0, 0, 0], 0.5) is None
    assert bucket_quantile(bounds, [0, 0, 4], 0.5) == 1.0  # above the last finite bound: report that bound
    assert bucket_quantile(bounds, [2, 2, 0], 0.5) == pytest.approx(0.1)  # exactly the first bucket's top


class _Engine:
    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None

    def check_health(self) -> None:
        pass


class _State:
    def __init__(self) -> None:
        self.engine = _Engine()
        self.inflight_seqs = 0


class _Local(Backend):
    """Quacks like LocalLLMBackend for the feed: `state.engine.stats` and `state.inflight_seqs`."""

    payload = Payload.TEXT

    def __init__(self, name: str) -> None:
        super().__init__(name, 3.6)
        self.state = _State()

    def ready(self) -> bool:
        return True

    def card(self) -> ModelCard:
        return ModelCard(self.name, Payload.TEXT, "local-llm", True)


class _Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(console.time, "time", c)
    return c


def test_feed_rates_quantiles_and_history(clock):
    router = Router(metrics=RouterMetrics(None))
    llm = _Local("m")
    router.add(llm)
    feed = ConsoleFeed(router, history=5)
    llm.state.engine.stats = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25,
                                            generation_tokens=100, prefix_cache_queries=50, prefix_cache_hits=10)
    first = feed.take()
    assert first["engines"]["m"]["tps"] == 0.0  # no previous sample: no rate yet
    assert (first["running"], first["waiting"], first["tokens_total"]) == (2, 1, 100)

    # Two seconds later: 300 more tokens, 2 preemptions, 50 of 50 new prefix lookups hit; one finished request.
    clock.t += 2.0
    llm.state.engine.stats = SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.5, generation_tokens=400,
                                            num_preemptions=2, prefix_cache_queries=100, prefix_cache_hits=60)
    trace = RouteTrace(router.metrics, "m", "default", CostMeter(3.6))
    trace.on_tokens(1)
    trace.on_tokens(9)
    trace.finish("ok")
    RouteTrace(router.metrics, "m", "default", CostMeter(3.6)).finish("aborted")
    s = feed.take()
    e = s["engines"]["m"]
    assert e["tps"] == pytest.approx(150.0)
    assert e["preemptions"] == pytest.approx(1.0)
    assert e["prefix_hit_rate"] == pytest.approx(50 / 50)  # over the window since the first sample
    assert e["kv_usage"] == 0.5 and s["running"] == 0
    row = s["series"]["m/default"]
    assert (row["tokens_total"], row["ok"], row["errors"], row["aborted"]) == (10, 1, 0, 1)  # aborted: no error
    ttft = router.metrics.of("m", "default").ttft
    lo, hi = _bucket_of(ttft.bounds, ttft.sum)  # one observation: its value is the sum
    assert lo <= row["ttft_p50"] <= hi and lo <= row["ttft_p95"] <= hi
    assert row["cost_p50"] is not None and row["cost_p50"] >= 0

    # The ring buffer keeps `history` samples; `since` returns only the newer ones, as valid JSON.
    for _ in range(6):
        clock.t += 1.0
        feed.take()
    doc = json.loads(feed.encoded_since(0))
    assert len(doc["samples"]) == 5 and doc["history"] == 5
    ts = [x["t"] for x in doc["samples"]]
    assert ts == sorted(ts)
    newer = json.loads(feed.encoded_since(ts[2]))["samples"]
    assert [x["t"] for x in newer] == ts[3:]
    assert json.loads(feed.encoded_since(ts[-1]))["samples"] == []


def test_upstream_tokens_count_from_the_router(clock):
    """A model without a local engine (an upstream) counts the tokens the router saw at the end of requests."""
    router = Router(metrics=RouterMetrics(None))
    feed = ConsoleFeed(router)
    feed.take()
    clock.t += 1.0
    t = RouteTrace(router.metrics, "remote", "default", CostMeter(None))
    t.on_tokens(5)
    t.finish("ok", output_tokens=7)
    s = feed.take()
    assert s["tokens_total"] == 7 and s["tps"] == pytest.approx(7.0)
    assert s["series"]["remote/default"]["cost_p50"] is None  # no GPU price: no cost


def test_local_tokens_are_the_ones_metrics_exposes(clock):
    """A local model's output tokens come from its ServerMetrics (what /metrics exposes as
    strata:generation_tokens_total), not from the engine's SchedulerStats, which also counts a token sampled for a
    request aborted before it was sent."""

    class _Metrics:
        generation_tokens = 0

    router = Router(metrics=RouterMetrics(None))
    llm = _Local("m")
    llm.state.metrics = _Metrics()
    router.add(llm)
    feed = ConsoleFeed(router)
    llm.state.engine.stats = SchedulerStats(generation_tokens=101)
    llm.state.metrics.generation_tokens = 100
    feed.take()
    clock.t += 1.0
    llm.state.engine.stats = SchedulerStats(generation_tokens=161)
    llm.state.metrics.generation_tokens = 150
    s = feed.take()
    assert s["engines"]["m"]["tokens_total"] == s["tokens_total"] == 150
    assert s["engines"]["m"]["tps"] == pytest.approx(50.0)
