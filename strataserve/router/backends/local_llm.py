"""A local LLM engine (its own engine-core process, driven by ``AsyncLLM``) behind the router; with a
``EngineSupervisor`` attached, a crashed core is replaced (``router/supervisor.py``)."""
from __future__ import annotations

from typing import Any

from strataserve.api.serving import ServerState
from strataserve.engine.core_client import EngineDeadError
from strataserve.router.admission import AdmissionController
from strataserve.router.supervisor import EngineSupervisor
from strataserve.router.types import Backend, ModelCard, Payload


class LocalLLMBackend(Backend):
    """The engine process is owned by whoever started it (``api/server.py`` stops it after the event loop)."""

    payload = Payload.TEXT

    def __init__(self, state: ServerState, gpu_cost_per_hour: float | None = None) -> None:
        super().__init__(state.model_name, gpu_cost_per_hour)
        self.state = state
        self.admission = AdmissionController(state.model_name)
        self.supervisor: EngineSupervisor | None = None

    async def start(self) -> None:
        if self.supervisor is not None:
            self.supervisor.start()

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()

    def status(self) -> str:
        """"serving", "restarting" or "dead" (no supervisor, or before it noticed)."""
        if self.supervisor is not None:
            return self.supervisor.status()
        return "serving" if self.ready() else "dead"

    @property
    def engine(self) -> Any:
        return self.state.engine

    def ready(self) -> bool:
        try:
            self.state.engine.check_health()
        except EngineDeadError:
            return False
        return True

    def card(self) -> ModelCard:
        ok = self.ready()
        reason = "" if ok else ("engine process is restarting" if self.status() == "restarting"
                                else "engine process is not running")
        return ModelCard(self.name, Payload.TEXT, "local-llm", ok, reason, max_model_len=self.state.max_model_len)
