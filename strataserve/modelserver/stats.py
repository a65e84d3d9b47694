"""Per model-version statistics (Triton's statistics extension) and their Prometheus view.

`ModelStats` is the single source: `/stats` reads `as_dict()`, and `StatsCollector` turns the same numbers
into Prometheus metrics with Triton's names under `strata:`. Triton exposes its counters without a `_total`
suffix; prometheus_client would append one to a "counter" family, so the cumulative ones are exposed untyped
(Prometheus treats them like counters for rate()) under exactly Triton's names.

A failed request counts under one of Triton's failure reasons (`reason` label of the failure counter):
REJECTED (refused before it ran: bad input, queue full, timed out in the queue), CANCELED (the client cancelled
or went away), BACKEND (the model's code raised, timed out or answered wrongly), OTHER (anything else, e.g. an
ensemble whose step failed). The statistics extension's `fail` stays the total, as in Triton.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable, Iterable

from prometheus_client.core import Metric

_CUMULATIVE = "unknown"  # exposed as "untyped", see the module docstring
_PHASES = ("queue", "compute_input", "compute_infer", "compute_output")
REJECTED, CANCELED, BACKEND, OTHER = "REJECTED", "CANCELED", "BACKEND", "OTHER"
FAILURE_REASONS = (REJECTED, CANCELED, BACKEND, OTHER)


class _Duration:
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict:
        return {"count": self.count, "ns": self.ns}


class ModelStats:
    def __init__(self, name: str, version: str):
        self.name, self.version = name, version
        self._lock = threading.Lock()
        self.last_inference_ms = 0
        self.inference_count = 0  # batch rows served
        self.execution_count = 0  # backend executions (batches)
        self.pending = 0  # requests queued or executing
        self.restarts = 0  # model processes restarted after they died (EXECUTION_ISOLATION: process)
        self.success = _Duration()
        self.fail = _Duration()
        self.fail_reasons = dict.fromkeys(FAILURE_REASONS, 0)  # each failure once, under its reason
        self.phases = {p: _Duration() for p in _PHASES}
        self.batch: dict[int, dict[str, _Duration]] = defaultdict(lambda: {p: _Duration() for p in _PHASES[1:]})

    def request_done(self, ok: bool, duration_ns: int, queue_ns: int = 0, reason: str = OTHER) -> None:
        """One request ended; `reason` (one of FAILURE_REASONS) says why when it failed."""
        if reason not in self.fail_reasons:
            raise ValueError(f"unknown failure reason {reason!r}; use one of {FAILURE_REASONS}")
        with self._lock:
            (self.success if ok else self.fail).add(duration_ns)
            if ok:
                self.phases["queue"].add(queue_ns)
            else:
                self.fail_reasons[reason] += 1
            self.last_inference_ms = int(time.time() * 1000)

    def execution_done(self, requests: int, rows: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One backend execution serving `requests` requests with `rows` batch rows in all."""
        with self._lock:
            self.execution_count += 1
            self.inference_count += rows
            # Triton: per-request phase counts, batch-level phase times split evenly across its requests.
            for phase, ns in (("compute_input", input_ns), ("compute_infer", infer_ns), ("compute_output", output_ns)):
                self.phases[phase].add(ns, requests)
                self.batch[rows][phase].add(ns)

    def restarted(self) -> None:
        with self._lock:
            self.restarts += 1

    def failures(self) -> dict[str, int]:
        with self._lock:
            return dict(self.fail_reasons)

    def add_pending(self, delta: int) -> None:
        with self._lock:
            self.pending += delta

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "name": self.name,
                "version": self.version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    "success": self.success.as_dict(),
                    "fail": self.fail.as_dict(),
                    **{p: d.as_dict() for p, d in self.phases.items()},
                },
                "batch_stats": [
                    {"batch_size": size, **{p: d.as_dict() for p, d in phases.items()}}
                    for size, phases in sorted(self.batch.items())
                ],
            }


_METRICS = (
    # name, help, type, value(stats): a number, or {reason: number} for one sample per failure reason
    ("strata:inference_request_success", "Number of successful inference requests", _CUMULATIVE,
     lambda s: s.success.count),
    ("strata:inference_request_failure", "Number of failed inference requests, by reason (REJECTED, CANCELED, "
     "BACKEND, OTHER)", _CUMULATIVE, lambda s: s.failures()),
    ("strata:inference_count", "Number of inferences performed (batch rows)", _CUMULATIVE, lambda s: s.inference_count),
    ("strata:inference_exec_count", "Number of model executions (batches)", _CUMULATIVE, lambda s: s.execution_count),
    ("strata:model_restarts", "Model processes restarted after they died", _CUMULATIVE, lambda s: s.restarts),
    ("strata:inference_pending_request_count", "Requests queued or executing", "gauge", lambda s: s.pending),
    ("strata:inference_request_duration_us", "Cumulative end-to-end duration of successful requests", _CUMULATIVE,
     lambda s: s.success.ns // 1000),
    ("strata:inference_queue_duration_us", "Cumulative queue time of requests", _CUMULATIVE,
     lambda s: s.phases["queue"].ns // 1000),
    ("strata:inference_compute_input_duration_us", "Cumulative compute-input time", _CUMULATIVE,
     lambda s: s.phases["compute_input"].ns // 1000),
    ("strata:inference_compute_infer_duration_us", "Cumulative compute-infer time", _CUMULATIVE,
     lambda s: s.phases["compute_infer"].ns // 1000),
    ("strata:inference_compute_output_duration_us", "Cumulative compute-output time", _CUMULATIVE,
     lambda s: s.phases["compute_output"].ns // 1000),
)


class StatsCollector:
    """A prometheus_client collector over the live ModelStats objects (read at scrape time)."""

    def __init__(self, stats: Callable[[], Iterable[ModelStats]]):
        self._stats = stats

    def describe(self) -> list[Metric]:
        return [Metric(name, doc, kind) for name, doc, kind, _ in _METRICS]

    def collect(self) -> Iterable[Metric]:
        all_stats = list(self._stats())
        for name, doc, kind, value in _METRICS:
            m = Metric(name, doc, kind)
            for s in all_stats:
                labels, v = {"model": s.name, "version": s.version}, value(s)
                if isinstance(v, dict):  # every reason, zeros included (Triton's too), so rate() sees the first one
                    for reason, n in v.items():
                        m.add_sample(name, {**labels, "reason": reason}, float(n))
                else:
                    m.add_sample(name, labels, float(v))
            yield m
