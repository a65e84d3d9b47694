"""Router metrics, per model and per SLA class, the same for local engines and upstream servers (measured at
the router): TTFT, inter-token latency, end-to-end latency and queue time histograms, requests by outcome, and
the cost per 1k output tokens (histogram, plus P50/P95 over the most recent requests as gauges).

Updated on the event loop only (see ``api/metrics.py`` for why these are not prometheus-client's locked
objects); exposed by one collector in the server's registry.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Iterable

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from strataserve.api.metrics import _ITL_BUCKETS, _LATENCY_BUCKETS, _TTFT_BUCKETS, LoopHistogram
from strataserve.router.admission import AdmissionController, Ticket
from strataserve.router.cost import CostMeter

OUTCOMES = ("ok", "rejected", "client_error", "upstream_error", "unavailable", "aborted")
_COST_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
                 2.0, 5.0, 10.0)
_LABELS = ("model_name", "sla_class")
COST_WINDOW = 1024  # requests behind the P50/P95 gauges


class _Series:
    """The metrics of one (model, class) pair."""

    def __init__(self) -> None:
        h = LoopHistogram
        self.ttft = h("strata:router_time_to_first_token_seconds", "Time to first token, at the router.",
                      _TTFT_BUCKETS)
        self.itl = h("strata:router_inter_token_latency_seconds", "Time between streamed tokens, at the router.",
                     _ITL_BUCKETS)
        self.e2e = h("strata:router_e2e_request_latency_seconds", "Arrival at the router to last byte.",
                     _LATENCY_BUCKETS)
        self.queue = h("strata:router_request_queue_time_seconds",
                       "Time waiting before the engine first scheduled the request (local engines).",
                       _LATENCY_BUCKETS)
        self.cost = h("strata:router_cost_per_1k_output_tokens", "GPU cost per 1k output tokens, per request "
                      "(gpu_cost_per_hour x the request's share of the backend's time).", _COST_BUCKETS)
        self.recent_cost: deque[float] = deque(maxlen=COST_WINDOW)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.output_tokens = 0

    def histograms(self) -> tuple[LoopHistogram, ...]:
        return (self.ttft, self.itl, self.e2e, self.queue, self.cost)


class RouterMetrics(Collector):
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.series: dict[tuple[str, str], _Series] = {}
        if registry is not None:
            registry.register(self)

    def of(self, model: str, sla: str) -> _Series:
        s = self.series.get((model, sla))
        if s is None:
            s = self.series[(model, sla)] = _Series()
        return s

    def reject(self, model: str, sla: str, outcome: str = "rejected") -> None:
        self.of(model, sla).outcomes[outcome] += 1

    def cost_quantiles(self, model: str, sla: str) -> tuple[float, float] | None:
        s = self.series.get((model, sla))
        if s is None or not s.recent_cost:
            return None
        p50, p95 = np.percentile(np.fromiter(s.recent_cost, float), [50, 95])
        return float(p50), float(p95)

    def collect(self) -> Iterable[Metric]:
        if not self.series:
            return []
        fams: list[Metric] = []
        first = next(iter(self.series.values()))
        for k, hist in enumerate(first.histograms()):
            fam = HistogramMetricFamily(hist.name, hist.doc, labels=list(_LABELS))
            for key, s in self.series.items():
                s.histograms()[k].add_to(fam, list(key))
            fams.append(fam)
        outcomes = CounterMetricFamily("strata:router_requests", "Requests by outcome (ok, rejected at admission, "
                                       "client_error, upstream_error, unavailable, aborted).",
                                       labels=[*_LABELS, "outcome"])
        tokens = CounterMetricFamily("strata:router_generation_tokens", "Output tokens through the router.",
                                     labels=list(_LABELS))
        cost = GaugeMetricFamily("strata:router_cost_per_1k_output_tokens_quantile",
                                 f"P50 / P95 of the cost per 1k output tokens over the last {COST_WINDOW} requests.",
                                 labels=[*_LABELS, "quantile"])
        for key, s in self.series.items():
            for outcome, n in s.outcomes.items():
                outcomes.add_metric([*key, outcome], n)
            tokens.add_metric(list(key), s.output_tokens)
            q = self.cost_quantiles(*key)
            if q is not None:
                cost.add_metric([*key, "0.5"], q[0])
                cost.add_metric([*key, "0.95"], q[1])
        return [*fams, outcomes, tokens, cost]


class RouteTrace:
    """One request's path through the router: admission ticket, cost share, latency and token counts."""

    __slots__ = ("series", "meter", "admission", "ticket", "arrival", "first", "last", "tokens", "entered",
                 "finished")

    def __init__(self, metrics: RouterMetrics, model: str, sla: str, meter: CostMeter,
                 admission: AdmissionController | None = None, ticket: Ticket | None = None) -> None:
        self.series = metrics.of(model, sla)
        self.meter = meter
        self.admission, self.ticket = admission, ticket
        self.arrival = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0
        self.entered = meter.enter()
        self.finished = False

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        ctl, ticket = self.admission, self.ticket
        if self.first is None:
            self.first = now
            self.series.ttft.observe(now - self.arrival)
            if ticket is not None and ctl is not None:
                ctl.first_token(ticket)
                ctl.on_tokens(ticket, n)
        else:
            self.series.itl.observe((now - self.last) / n)
            if ticket is not None and ctl is not None:
                ctl.on_tokens(ticket, n, now - self.last)
        self.last = now
        self.tokens += n

    def queue_time(self, seconds: float) -> None:
        self.series.queue.observe(max(0.0, seconds))

    def finish(self, outcome: str, output_tokens: int | None = None) -> None:
        """Record the end of the request once; ``output_tokens`` overrides the streamed count (usage)."""
        if self.finished:
            return
        self.finished = True
        if self.ticket is not None and self.admission is not None:
            self.admission.release(self.ticket)
        s = self.series
        s.outcomes[outcome] += 1
        share = self.meter.leave(self.entered)
        tokens = self.tokens if output_tokens is None else output_tokens
        s.output_tokens += tokens
        s.e2e.observe(time.perf_counter() - self.arrival)
        c = self.meter.cost_per_1k(share, tokens)
        if c is not None and outcome == "ok":
            s.cost.observe(c)
            s.recent_cost.append(c)


class NullTrace:
    """A trace that records nothing (tokenize / detokenize forwarded upstream)."""

    finished = False

    def on_tokens(self, n: int) -> None:
        pass

    def finish(self, outcome: str, output_tokens: int | None = None) -> None:
        self.finished = True
