"""Layer 2: the one door between the API layer and every engine.

The API layer parses and validates a request, then asks the router for the backend serving its model and
payload kind (text, speech, tensors) and for the request's SLA class. The router owns the registry of backends
(local LLM engines, TTS runners, upstream OpenAI and KServe servers, the local model repository through
``TensorRouter``), admission control per class, the per-model / per-class metrics, and their lifecycle.
"""
from __future__ import annotations

import asyncio
from typing import Iterable

from starlette.requests import Request

from strataserve.api.errors import APIError
from strataserve.router.admission import AdmissionController
from strataserve.router.metrics import RouterMetrics, RouteTrace
from strataserve.router.quota import KeyQuota
from strataserve.router.sla import SLA, SLA_HEADER, SLAPolicy, bearer_key
from strataserve.router.tensors import TensorRouter
from strataserve.router.types import Backend, ModelCard, Payload

_ROUTE_HINT = {Payload.TEXT: "/v1/completions or /v1/chat/completions", Payload.SPEECH: "/v1/audio/speech",
               Payload.TENSORS: "the KServe v2 routes (/v2/models/NAME/infer)"}


class Router:
    def __init__(self, policy: SLAPolicy | None = None, metrics: RouterMetrics | None = None,
                 quota: KeyQuota | None = None) -> None:
        self.policy = policy or SLAPolicy.single()
        self.metrics = metrics or RouterMetrics(None)
        self.quota = quota or KeyQuota()  # per-key requests / tokens per minute
        self.backends: dict[str, Backend] = {}
        self.tensors: TensorRouter | None = None
        self._upstream_admission: dict[str, AdmissionController] = {}

    # ------------------------------------------------------------------ registry
    def add(self, backend: Backend) -> None:
        if backend.name in self.backends:
            raise ValueError(f"model name {backend.name!r} is served twice: give each model its own name")
        self.backends[backend.name] = backend

    def of_kind(self, payload: Payload) -> list[Backend]:
        return [b for b in self.backends.values() if b.payload == payload]

    def cards(self) -> list[ModelCard]:
        return [b.card() for b in self.backends.values()]

    def non_tensor_cards(self) -> list[ModelCard]:
        return [b.card() for b in self.backends.values() if b.payload != Payload.TENSORS]

    def names(self) -> list[str]:
        names = list(self.backends)
        if self.tensors is not None and self.tensors.local is not None:
            names += [m["name"] for m in self.tensors.local.repository_index(ready_only=True)]
        return names

    def resolve(self, model: str | None, payload: Payload) -> Backend:
        """The backend for ``model`` (any of ``payload``'s backends when the request names none and there is
        exactly one); 404 for an unknown name, 400 for a model of another payload kind."""
        if model is None:
            candidates = self.of_kind(payload)
            if len(candidates) == 1:
                return candidates[0]
            served = ", ".join(b.name for b in candidates) or "none"
            raise APIError(400, f"give `model`: this server serves several {payload.value} models ({served})",
                           param="model", code="model_required")
        backend = self.backends.get(model)
        if backend is None:
            raise APIError(404, f"The model `{model}` does not exist; this server serves: "
                           f"{', '.join(self.names()) or 'no models'}.", param="model", code="model_not_found")
        if backend.payload != payload:
            raise APIError(400, f"model `{model}` serves {backend.payload.value}, not {payload.value}: use "
                           f"{_ROUTE_HINT[backend.payload]}", param="model", code="wrong_model_kind")
        return backend

    # ------------------------------------------------------------------ service levels
    def sla(self, request: Request) -> SLA:
        return self.policy.resolve(request.headers.get(SLA_HEADER), bearer_key(request.headers.get("authorization")))

    def _admission(self, backend: Backend) -> AdmissionController:
        own = getattr(backend, "admission", None)
        if own is not None:
            return own
        ctl = self._upstream_admission.get(backend.name)
        if ctl is None:
            ctl = self._upstream_admission[backend.name] = AdmissionController(backend.name)
        return ctl

    def check_admission(self, backend: Backend, sla: SLA, work: float, seqs: int = 1) -> None:
        """429 + Retry-After when the slots held and the work queued ahead would make this request miss its
        class's TTFT."""
        try:
            self._admission(backend).check(sla.priority, work, sla.ttft_ms, seqs)
        except APIError:
            self.metrics.reject(backend.name, sla.name)
            raise

    def trace(self, backend: Backend, sla: SLA, work: float, seqs: int = 1,
              budget: float | None = None) -> RouteTrace:
        """Start tracking an admitted request (its queue position counts for later admissions until its first
        token, its ``seqs`` slots until it ends; ``budget``: its max_tokens); call ``finish`` on it exactly once."""
        ctl = self._admission(backend)
        ticket = ctl.enter(sla.priority, work, seqs, budget)
        return RouteTrace(self.metrics, backend.name, sla.name, backend.cost, ctl, ticket)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for b in self.backends.values():
            await b.start()

    async def stop(self) -> None:
        await asyncio.gather(*(b.stop() for b in self.backends.values()), return_exceptions=True)

    def local_text_backends(self) -> Iterable[Backend]:
        """The local LLM engines."""
        return (b for b in self.backends.values() if b.payload == Payload.TEXT and not b.upstream)

    def local_backends(self) -> Iterable[Backend]:
        """Backends whose engine runs in this process tree (their death makes /health 503)."""
        return (b for b in self.backends.values() if not b.upstream and b.payload != Payload.TENSORS)


def outcome_of(exc: BaseException | None) -> str:
    """The metrics outcome of a request that ended with ``exc`` (None: success)."""
    if exc is None:
        return "ok"
    if isinstance(exc, APIError):
        if exc.status == 499:
            return "aborted"
        if exc.status == 429:
            return "rejected"
        if exc.status < 500:
            return "client_error"
        return "upstream_error" if exc.status in (502, 504) else "unavailable"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "aborted"
    return "unavailable"
