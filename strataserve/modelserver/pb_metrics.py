"""Triton's custom metrics for Python models (`pb_utils.MetricFamily` / `Metric`), on the server's /metrics.

    family = pb_utils.MetricFamily(name="requests_seen", description="...", kind=pb_utils.MetricFamily.COUNTER)
    metric = family.Metric(labels={"model": "m"})     # HISTOGRAM: family.Metric(labels=..., buckets=[...])
    metric.increment(1); metric.value()

Every family of a server lives in one `CustomMetrics` collector registered in the ModelServer's Prometheus
registry, read at scrape time. As with the server's own Triton-style counters (stats.py), a COUNTER keeps its
name exactly (exposed untyped, no `_total` added). Not available in an isolated (child process) model.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from typing import Iterable

from prometheus_client.core import Metric as PromMetric

from strataserve.modelserver.pb_errors import TritonModelException as MetricError

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
#: the server's own metrics' namespaces: a model's family there would duplicate a name on /metrics (two TYPE lines,
#: repeated series), which Prometheus refuses to scrape
RESERVED_PREFIXES = ("strata:", "strata_", "process_", "python_")


class CustomMetrics:
    """The prometheus_client collector of one server's custom metric families."""

    def __init__(self) -> None:
        self.families: dict[str, "MetricFamily"] = {}
        self.lock = threading.Lock()

    def family(self, name: str, description: str, kind: int, owner: tuple[str, str]) -> "MetricFamily":
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise MetricError(f"metric family name {name!r} is not a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)")
        if name.startswith(RESERVED_PREFIXES):
            raise MetricError(f"metric family '{name}': names starting with {', '.join(RESERVED_PREFIXES)} are the "
                              "server's own metrics; choose another name")
        with self.lock:
            fam = self.families.get(name)
            if fam is None:
                fam = self.families[name] = object.__new__(MetricFamily)
                fam._init(name, description, kind, owner)
            elif fam.kind != kind:
                raise MetricError(f"metric family '{name}' already exists with another kind")
            return fam

    def drop(self, owner: tuple[str, str]) -> None:
        """The families a model version declared end with it (unloaded: its series leave /metrics, and a reload
        starts from zero, as Triton's stub process takes them down with it)."""
        with self.lock:
            for name in [n for n, f in self.families.items() if f.owner == owner]:
                del self.families[name]

    def describe(self) -> list:
        return []  # families come and go with models: collected at scrape time only

    def collect(self) -> Iterable[PromMetric]:
        with self.lock:
            families = list(self.families.values())
        for fam in families:
            yield fam.collect()


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
    _TYPES = {0: "unknown", 1: "gauge", 2: "histogram"}

    def __new__(cls, name: str, description: str, kind: int):
        from strataserve.modelserver import pb_runtime

        if kind not in cls._TYPES:
            raise MetricError(f"metric family '{name}': kind must be MetricFamily.COUNTER, GAUGE or HISTOGRAM")
        server = pb_runtime.current_server()
        registry = getattr(server, "custom_metrics", None)
        if registry is None:
            raise MetricError("pb_utils.MetricFamily needs the server's metrics registry: it works in in-process "
                              "Python models, not with EXECUTION_ISOLATION 'process'")
        ctx = pb_runtime.current()
        owner = (ctx.model_name, ctx.model_version) if ctx is not None else ("", "")
        return registry.family(name, description, kind, owner)

    def _init(self, name: str, description: str, kind: int, owner: tuple[str, str]) -> None:
        self.name, self.description, self.kind, self.owner = name, description, kind, owner
        self.metrics: dict[tuple, Metric] = {}
        self.lock = threading.Lock()

    def Metric(self, labels: dict | None = None, buckets: list[float] | None = None) -> "Metric":  # noqa: N802
        labels = {str(k): str(v) for k, v in (labels or {}).items()}
        bad = next((k for k in labels if not _LABEL.fullmatch(k) or k.startswith("__")), None)
        if bad is not None:
            raise MetricError(f"metric family '{self.name}': label name {bad!r} is not a Prometheus label name")
        if self.kind == self.HISTOGRAM:
            if buckets is None:
                raise MetricError(f"metric family '{self.name}': a HISTOGRAM metric needs buckets (a list; [] "
                                  "counts into +Inf only)")
            buckets = [float(b) for b in buckets]
            if any(b >= c for b, c in zip(buckets, buckets[1:])):
                raise MetricError(f"metric family '{self.name}': buckets must be strictly increasing, got {buckets}")
        elif buckets:
            raise MetricError(f"metric family '{self.name}': buckets are only for HISTOGRAM metrics")
        key = tuple(sorted(labels.items()))
        with self.lock:
            metric = self.metrics.get(key)
            if metric is None:
                metric = self.metrics[key] = Metric(self, labels, buckets)
            return metric

    def collect(self) -> PromMetric:
        out = PromMetric(self.name, self.description, self._TYPES[self.kind])
        with self.lock:
            metrics = list(self.metrics.values())
        for m in metrics:
            with m.lock:
                if self.kind != self.HISTOGRAM:
                    out.add_sample(self.name, m.labels, m._value)
                    continue
                for bound, count in zip(m.buckets + [math.inf], m._cumulative()):
                    le = "+Inf" if bound == math.inf else repr(bound)
                    out.add_sample(f"{self.name}_bucket", {**m.labels, "le": le}, count)
                out.add_sample(f"{self.name}_count", m.labels, float(m._count))
                out.add_sample(f"{self.name}_sum", m.labels, m._value)
        return out


class Metric:
    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None):
        self.family, self.labels, self.buckets = family, labels, buckets or []
        self.lock = threading.Lock()
        self._value = 0.0  # a histogram's sum
        self._count = 0
        self._counts = [0] * (len(self.buckets) + 1)

    def _cumulative(self) -> list[float]:
        out, total = [], 0
        for c in self._counts:
            total += c
            out.append(float(total))
        return out

    def increment(self, value: float) -> None:
        kind = self.family.kind
        if kind == MetricFamily.HISTOGRAM:
            raise MetricError("increment() is not for HISTOGRAM metrics: use observe()")
        if kind == MetricFamily.COUNTER and value < 0:
            raise MetricError(f"a COUNTER cannot be incremented by a negative value ({value})")
        with self.lock:
            self._value += float(value)

    def set(self, value: float) -> None:
        if self.family.kind != MetricFamily.GAUGE:
            raise MetricError("set() is only for GAUGE metrics")
        with self.lock:
            self._value = float(value)

    def observe(self, value: float) -> None:
        if self.family.kind != MetricFamily.HISTOGRAM:
            raise MetricError("observe() is only for HISTOGRAM metrics")
        with self.lock:
            self._counts[bisect.bisect_left(self.buckets, float(value))] += 1
            self._count += 1
            self._value += float(value)

    def value(self) -> float:
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise MetricError("value() is not supported for HISTOGRAM metrics")
        with self.lock:
            return self._value
