"""A local text-to-speech engine behind the router: ``AsyncTTS`` (Qwen3-TTS on the engine core) or
``AsyncOmniVoice`` (the non-autoregressive runner), in-process."""
from __future__ import annotations

from typing import Any

from strataserve.api.metrics import MetricsGroup
from strataserve.api.nar_metrics import NARMetrics
from strataserve.api.tts_metrics import TTSMetrics
from strataserve.router.types import Backend, ModelCard, Payload


class TTSBackend(Backend):
    """The engine is owned by whoever started it (``api/server.py`` shuts it down after the event loop)."""

    payload = Payload.SPEECH

    def __init__(self, tts: Any, metrics_group: MetricsGroup | None = None,
                 gpu_cost_per_hour: float | None = None) -> None:
        super().__init__(tts.name, gpu_cost_per_hour)
        self.tts = tts
        self.metrics = TTSMetrics(tts, None)
        # a non-autoregressive runner batches whole requests: its batch sizes and padding are metrics too
        self.batch_metrics = NARMetrics(tts) if hasattr(tts, "batch_observers") else None
        if metrics_group is not None:
            metrics_group.add(self.metrics)
            if self.batch_metrics is not None:
                metrics_group.add(self.batch_metrics)

    def ready(self) -> bool:
        try:
            self.tts.check_health()
        except Exception:  # noqa: BLE001 -- any failure of the engine thread means "not ready"
            return False
        return True

    def card(self) -> ModelCard:
        ok = self.ready()
        return ModelCard(self.name, Payload.SPEECH, "tts", ok, "" if ok else "speech engine is not running",
                         extra={"voices": list(self.tts.voices), "languages": list(self.tts.languages)})
