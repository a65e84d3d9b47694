"""Prometheus metrics of the LLM server, vLLM's names under ``strata:`` so dashboards port by a prefix swap.

Two sources: the engine's latest ``SchedulerStats`` (gauges and cumulative counters) and per-request timings
taken in the API process (histograms, token and finish counters). Everything is exposed by one collector in the
server's own registry, labelled by ``model_name``. Why not prometheus-client's Counter/Histogram objects: they take
a lock per update, and the per-token path (inter-token latency, token counts) runs thousands of times a second
on the event loop; here an update is a list increment, and both updates and scrapes run on that one thread.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from strataserve.types.outputs import RequestMetrics, RequestOutput
from strataserve.types.protocol import SchedulerStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 80.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0)
_REASONS = ("stop", "length", "abort")


def _token_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class LoopHistogram:
    """A histogram updated only from the event-loop thread (no lock): counts per bucket plus the sum."""

    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc = name, doc
        self.bounds = list(buckets) + [float("inf")]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # first bucket whose bound is >= value ("le")
        self.sum += value

    def family(self, label: list[str], labelnames: tuple[str, ...] = ("model_name",)) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=list(labelnames))
        self.add_to(fam, label)
        return fam

    def add_to(self, fam: HistogramMetricFamily, label: list[str]) -> None:
        cumulative, total = [], 0
        for bound, count in zip(self.bounds, self.counts):
            total += count
            cumulative.append((floatToGoString(bound), total))
        fam.add_metric(label, cumulative, self.sum)


class ServerMetrics(Collector):
    """All metrics of one served LLM, registered in ``registry`` (what ``/metrics`` exposes)."""

    def __init__(self, model_name: str, max_model_len: int, stats_source: Callable[[], SchedulerStats | None],
                 registry: CollectorRegistry | None = None, *, register: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.stats_source = stats_source
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = dict.fromkeys(_REASONS, 0)
        h = LoopHistogram
        self.ttft = h("strata:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = h("strata:inter_token_latency_seconds", "Time between streamed tokens.", _ITL_BUCKETS)
        self.tpot = h("strata:time_per_output_token_seconds", "Mean time per output token after the first.",
                      _ITL_BUCKETS)
        self.e2e = h("strata:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = h("strata:request_queue_time_seconds", "Time waiting before first scheduled.",
                       _LATENCY_BUCKETS)
        self.prefill = h("strata:request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS)
        self.decode = h("strata:request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS)
        tokens = _token_buckets(max(max_model_len, 1))
        self.req_prompt_tokens = h("strata:request_prompt_tokens", "Prompt length per request.", tokens)
        self.req_generation_tokens = h("strata:request_generation_tokens", "Generated tokens per request.", tokens)
        self._histograms = (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode,
                            self.req_prompt_tokens, self.req_generation_tokens)
        # the engine's own counters restart from zero with a restarted engine: carry what the old one counted
        self._carried: dict[str, float] = {}
        self._last: dict[str, float] = {}
        if register:  # several served models share one registry through a MetricsGroup instead
            self.registry.register(self)

    def _monotonic(self, name: str, value: float) -> float:
        last = self._last.get(name, 0.0)
        if value < last:  # a new engine (or none for a moment): what the old one counted stays counted
            self._carried[name] = self._carried.get(name, 0.0) + last
        self._last[name] = value
        return self._carried.get(name, 0.0) + value

    def success(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def track(self, num_prompt_tokens: int, n: int = 1) -> "RequestTimer":
        """The timer of one engine request of ``n`` sequences (parallel sampling)."""
        return RequestTimer(self, num_prompt_tokens, n)

    def collect(self) -> Iterable[Metric]:
        stats = self.stats_source() or SchedulerStats()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        def engine_counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return counter(name, doc, self._monotonic(name, value))

        yield gauge("strata:num_requests_running", "Requests in the engine's running batch.", stats.num_running)
        yield gauge("strata:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("strata:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                    stats.kv_cache_usage)
        yield gauge("strata:kv_cache_used_blocks", "KV-cache blocks held by requests.",
                    stats.num_total_blocks - stats.num_free_blocks)
        yield gauge("strata:kv_cache_total_blocks", "KV-cache blocks in the pool.", stats.num_total_blocks)
        yield engine_counter("strata:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield engine_counter("strata:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits)
        yield engine_counter("strata:num_preemptions", "Requests preempted (recomputed later) by the scheduler.",
                      stats.num_preemptions)
        yield counter("strata:prompt_tokens", "Prompt tokens of requests that started generating.",
                      self.prompt_tokens)
        yield counter("strata:generation_tokens", "Tokens generated.", self.generation_tokens)
        success = CounterMetricFamily("strata:request_success", "Finished requests, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, count in self.finished.items():
            success.add_metric([self.model_name, reason], count)
        yield success
        for hist in self._histograms:
            yield hist.family(label)


class MetricsGroup(Collector):
    """Several collectors exposing the same metric names (one per served model) as one set of families: a
    Prometheus registry refuses two collectors that both define ``strata:num_requests_running``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.members: list[Collector] = []
        registry.register(self)

    def add(self, member: Collector) -> None:
        self.members.append(member)

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for member in self.members:
            for fam in member.collect():
                have = merged.get(fam.name)
                if have is None:
                    merged[fam.name] = fam
                else:
                    have.samples.extend(fam.samples)
        return list(merged.values())


class _Child:
    """The API-side timestamps of one of a request's ``n`` sequences (perf_counter clock)."""

    __slots__ = ("num_generated", "first", "last", "end")

    def __init__(self) -> None:
        self.num_generated = 0
        self.first: float | None = None
        self.last = 0.0
        self.end: float | None = None  # when its finish reason arrived


class RequestTimer:
    """Timestamps of one engine request, seen from the API process (monotonic clock). Each of its ``n``
    sequences counts as a request of its own, as vLLM counts the n child requests of parallel sampling: its own
    TTFT, prompt tokens, end-to-end latency and token histograms, so their counts agree with
    ``request_success_total`` (one per sequence)."""

    __slots__ = ("m", "num_prompt", "arrival", "children")

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, n: int = 1) -> None:
        self.m = metrics
        self.num_prompt = num_prompt_tokens
        self.arrival = time.perf_counter()
        self.children = [_Child() for _ in range(max(n, 1))]

    def on_output(self, out: RequestOutput) -> None:
        """One (delta) output of the engine: the new tokens and finish of each sequence."""
        now = time.perf_counter()
        for c in out.outputs:
            self._tokens(c.index, len(c.token_ids), now)
            if c.finish_reason is not None:
                self._child(c.index).end = now

    def _child(self, index: int) -> _Child:
        while index >= len(self.children):  # more sequences than ``track`` was told: count them all
            self.children.append(_Child())
        return self.children[index]

    def _tokens(self, index: int, n: int, now: float) -> None:
        if n <= 0:
            return
        child, m = self._child(index), self.m
        if child.first is None:
            child.first = now
            m.ttft.observe(now - self.arrival)
            m.prompt_tokens += self.num_prompt  # per sequence, as vLLM counts each child's prompt
        else:
            m.itl.observe(now - child.last)
        child.last = now
        child.num_generated += n
        m.generation_tokens += n

    def finish(self, engine_metrics: RequestMetrics | None = None) -> None:
        """Record the request-level histograms, once per sequence (finish reasons are counted per sequence by the
        caller); a sequence with no finish reason yet (aborted) ends now."""
        now = time.perf_counter()
        to_wall = time.time() - now  # the engine's timestamps are wall-clock
        for child in self.children:
            self._finish_child(child, child.end if child.end is not None else now, to_wall, engine_metrics)

    def _finish_child(self, child: _Child, end: float, to_wall: float, em: RequestMetrics | None) -> None:
        m = self.m
        m.e2e.observe(end - self.arrival)
        m.req_prompt_tokens.observe(self.num_prompt)
        m.req_generation_tokens.observe(child.num_generated)
        if child.first is not None and child.num_generated > 1:
            m.tpot.observe((child.last - child.first) / (child.num_generated - 1))
        if em is not None and em.first_scheduled_time is not None:
            m.queue.observe(max(0.0, em.first_scheduled_time - em.arrival_time))
            if em.first_token_time is not None:
                m.prefill.observe(max(0.0, em.first_token_time - em.first_scheduled_time))
                # the request's end, or this sequence's own when it finished before its siblings
                ends = [t for t in (em.finished_time, end + to_wall if child.end is not None else None)
                        if t is not None]
                m.decode.observe(max(0.0, (min(ends) if ends else time.time()) - em.first_token_time))
        elif child.first is not None:
            # The engine did not report its timestamps: the API-side view is the best we have.
            m.prefill.observe(child.first - self.arrival)
            m.decode.observe(end - child.first)
