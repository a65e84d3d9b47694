"""A local LLM engine behind the router: one engine-core process driven by ``AsyncLLM``, or several replicas of
it (``router/local_replicas.py``: processes on this host or Ray actors). With ``EngineSupervisor``s attached
(one per engine core), a crashed core is replaced (``router/supervisor.py``)."""
from __future__ import annotations

from typing import Any

from strataserve.api.serving import ServerState
from strataserve.types.errors import EngineDeadError
from strataserve.router.admission import AdmissionController
from strataserve.router.local_replicas import ReplicatedEngine
from strataserve.router.supervisor import EngineSupervisor
from strataserve.router.types import Backend, ModelCard, Payload


class LocalLLMBackend(Backend):
    """The engine processes are owned by whoever started them (``api/server.py`` stops them after the event
    loop)."""

    payload = Payload.TEXT

    def __init__(self, state: ServerState, gpu_cost_per_hour: float | None = None) -> None:
        super().__init__(state.model_name, gpu_cost_per_hour)
        self.state = state
        self.admission = AdmissionController(state.model_name, state.max_running_seqs)
        self.supervisors: list[EngineSupervisor] = []

    async def start(self) -> None:
        for s in self.supervisors:
            s.start()

    async def stop(self) -> None:
        for s in self.supervisors:
            await s.stop()

    def status(self) -> str:
        """"serving"; "degraded" (some replicas are down, the others serve); "restarting" or "dead" (no core
        serves: no supervisor, or before it noticed)."""
        if not self.supervisors:
            return "serving" if self.ready() else "dead"
        states = [s.status() for s in self.supervisors]
        if all(st == "serving" for st in states):
            return "serving"
        if "serving" in states:
            return "degraded"
        return "restarting" if "restarting" in states else "dead"

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
        extra = {}
        if isinstance(self.state.engine, ReplicatedEngine):
            extra["replicas"] = self.state.engine.describe()
        return ModelCard(self.name, Payload.TEXT, "local-llm", ok, reason, max_model_len=self.state.max_model_len,
                         extra=extra)
