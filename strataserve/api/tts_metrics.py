"""Prometheus metrics of a served TTS model (``strata:tts_*``), in the style of ``api/metrics.py``: per-request
timings arrive on the event loop through ``AsyncTTS.observers`` (lock-free histograms), the engine's running /
waiting counts are read at scrape time."""
from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from strataserve.api.metrics import LoopHistogram
from strataserve.types.speech import SpeechTiming

_TTFA_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 12.5, 25.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


class TTSMetrics(Collector):
    def __init__(self, tts: Any, registry: CollectorRegistry | None) -> None:
        """``registry`` None: the caller exposes it (several speech models share a ``MetricsGroup``)."""
        self.tts = tts
        self.model_name = tts.name
        h = LoopHistogram
        self.ttfa = h("strata:tts_time_to_first_audio_seconds", "Arrival to the first audio chunk.", _TTFA_BUCKETS)
        self.rtf = h("strata:tts_real_time_factor", "Wall seconds per second of audio, per request.", _RTF_BUCKETS)
        self.queue = h("strata:tts_request_queue_time_seconds", "Arrival to first scheduled.", _QUEUE_BUCKETS)
        self.fps = h("strata:tts_request_frames_per_second", "Codec frames per wall second, per request.",
                     _FPS_BUCKETS)
        self._histograms = (self.ttfa, self.rtf, self.queue, self.fps)
        self.audio_seconds = 0.0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        tts.observers.append(self.observe)
        if registry is not None:
            registry.register(self)

    def observe(self, t: SpeechTiming) -> None:
        self.finished[t.finish_reason] = self.finished.get(t.finish_reason, 0) + 1
        self.queue.observe(t.queue_time)
        self.audio_seconds += t.audio_seconds
        if t.time_to_first_audio is not None:
            self.ttfa.observe(t.time_to_first_audio)
        if t.frames and t.finish_reason != "abort":
            self.rtf.observe(t.real_time_factor)
            self.fps.observe(t.frames / t.wall_seconds)

    def collect(self) -> Iterable[Metric]:
        label = [self.model_name]

        def family(cls, name: str, doc: str, value: float):
            f = cls(name, doc, labels=["model_name"])
            f.add_metric(label, value)
            return f

        yield family(GaugeMetricFamily, "strata:tts_num_requests_running", "Speech requests in the running batch.",
                     self.tts.num_running)
        yield family(GaugeMetricFamily, "strata:tts_num_requests_waiting", "Speech requests waiting.",
                     self.tts.num_waiting)
        yield family(CounterMetricFamily, "strata:tts_frames", "Codec frames generated.", self.tts.frames_generated)
        yield family(CounterMetricFamily, "strata:tts_audio_seconds", "Seconds of audio delivered.",
                     self.audio_seconds)
        success = CounterMetricFamily("strata:tts_request_success", "Finished speech requests, by reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in self.finished.items():
            success.add_metric([self.model_name, reason], n)
        yield success
        for hist in self._histograms:
            yield hist.family(label)
