"""Types shared by the router, its backends and the API layer: payload kinds, model cards, the backend ABC."""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any

from strataserve.router.cost import CostMeter


class Payload(str, enum.Enum):
    TEXT = "text"  # OpenAI completions / chat
    SPEECH = "speech"  # /v1/audio/speech
    TENSORS = "tensors"  # KServe v2 infer


@dataclass(frozen=True)
class ModelCard:
    """One servable model as the listings show it (``/v1/models``, the KServe repository index)."""

    name: str
    payload: Payload
    backend: str  # "local-llm", "upstream-openai", "upstream-kserve", "repository", "tts"
    ready: bool
    reason: str = ""
    max_model_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Backend(abc.ABC):
    """Something that serves one model name. Invariants: ``start`` before the first request, ``stop`` is
    idempotent and releases every process, socket and task the backend owns."""

    name: str
    payload: Payload
    upstream: bool = False

    def __init__(self, name: str, gpu_cost_per_hour: float | None = None) -> None:
        self.name = name
        self.cost = CostMeter(gpu_cost_per_hour)

    async def start(self) -> None:  # noqa: B027 -- optional hook
        """Begin health checks or other background work."""

    async def stop(self) -> None:  # noqa: B027 -- optional hook
        """Release what the backend owns; safe to call twice."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """True when a request sent now can be served."""

    def status(self) -> str:
        """One word for ``/health``: "serving", or why not ("dead", "restarting", ...)."""
        return "serving" if self.ready() else "unavailable"

    @abc.abstractmethod
    def card(self) -> ModelCard:
        ...
