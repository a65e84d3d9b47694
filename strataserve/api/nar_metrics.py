"""Prometheus metrics of a non-autoregressive speech runner's batches (``strata:tts_batch_*``): batch size, the
fraction of each bucketed canvas that was padding, and batch time. The runner's worker thread is the only writer
(``NARRunner.observers``), scrapes only read."""
from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from strataserve.api.metrics import LoopHistogram
from strataserve.types.speech import BatchStats

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
_WASTE_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 0.9)
_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class NARMetrics(Collector):
    def __init__(self, tts: Any) -> None:
        """``tts`` exposes ``name`` and ``batch_observers`` (e.g. ``AsyncOmniVoice``)."""
        self.model_name = tts.name
        self.size = LoopHistogram("strata:tts_batch_size", "Requests per runner batch.", _SIZE_BUCKETS)
        self.waste = LoopHistogram("strata:tts_batch_padding_waste", "Fraction of a batch's bucketed canvas that "
                                   "was padding.", _WASTE_BUCKETS)
        self.seconds = LoopHistogram("strata:tts_batch_seconds", "Wall time of one runner batch.", _SECONDS_BUCKETS)
        tts.batch_observers.append(self.observe)

    def observe(self, s: BatchStats) -> None:
        self.size.observe(s.batch_size)
        self.waste.observe(s.padding_waste)
        self.seconds.observe(s.seconds)

    def collect(self) -> Iterable[Metric]:
        for h in (self.size, self.waste, self.seconds):
            yield h.family([self.model_name])
