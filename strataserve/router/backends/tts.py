"""A local text-to-speech engine (``AsyncTTS``: Qwen3-TTS on the engine core, in-process) behind the router."""
from __future__ import annotations

from typing import Any

from strataserve.api.metrics import MetricsGroup
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
        if metrics_group is not None:
            metrics_group.add(self.metrics)

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
