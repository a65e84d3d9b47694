"""Self-healing local engines: one supervisor per ``LocalLLMBackend`` restarts its engine-core process after a
crash (OOM, segfault, CUDA error, SIGKILL).

What a client sees: requests in flight when the core dies get the 503 ``engine_dead`` error (the output pump
fails them); while the replacement loads, new requests get 503 with Retry-After and ``/health`` reports the
model as restarting; then the model serves again. Other models never notice. A crash loop backs off: a core that
dies within ``stable_s`` of its start doubles the wait before the next start (up to ``max_backoff_s``); a core
that stayed up that long resets the wait. Every restart counts in ``strata:engine_restarts_total{model_name}``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from strataserve.types.errors import EngineDeadError

log = logging.getLogger("strataserve.supervisor")


class _Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self) -> None:
        self.value += 1


class RestartMetrics:
    """``strata:engine_restarts_total{model_name}``, one counter family per server registry (a collector, as the
    server's other families: prometheus-client's Counter would add a ``_created`` gauge family beside it)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.counts: dict[str, _Count] = {}
        if registry is not None:
            registry.register(self)

    def model(self, name: str) -> _Count:
        return self.counts.setdefault(name, _Count())

    def collect(self) -> list[CounterMetricFamily]:
        fam = CounterMetricFamily("strata:engine_restarts", "Restarts of a crashed engine-core process",
                                  labels=["model_name"])
        for name, count in self.counts.items():
            fam.add_metric([name], count.value)
        return [fam]


class EngineSupervisor:
    """Watches ``state.engine`` and replaces it after a crash. ``factory`` builds a new engine (blocking: it
    spawns the core and waits for the model to load), so it runs on a worker thread."""

    def __init__(self, name: str, get_engine: Callable[[], Any], set_engine: Callable[[Any], None],
                 factory: Callable[[], Any], metrics: RestartMetrics, *, poll_s: float = 0.1,
                 min_backoff_s: float = 0.5, max_backoff_s: float = 30.0, stable_s: float = 60.0) -> None:
        self.name = name
        self._get, self._set, self._factory = get_engine, set_engine, factory
        self._counter = metrics.model(name)
        self.poll_s, self.stable_s = poll_s, stable_s
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.restarts = 0
        self.restarting = False
        self.last_error = ""
        self._backoff = 0.0
        self._started_at = time.monotonic()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def status(self) -> str:
        """"serving", "restarting" or "dead" (between the crash and the supervisor noticing it)."""
        if self.restarting:
            return "restarting"
        return "dead" if _dead(self._get()) else "serving"

    async def _run(self) -> None:
        while True:
            # Polling costs one waitpid per tick; the output pump already fails in-flight requests at once.
            while not _dead(self._get()):
                await asyncio.sleep(self.poll_s)
            await self._restart()

    def _next_backoff(self) -> float:
        if time.monotonic() - self._started_at >= self.stable_s:
            self._backoff = 0.0  # it ran long enough: this crash is not part of a loop
            return 0.0
        return self._grow()

    def _grow(self) -> float:
        self._backoff = min(max(self._backoff * 2, self.min_backoff_s), self.max_backoff_s)
        return self._backoff

    async def _restart(self) -> None:
        old = self._get()
        self.restarting = True
        self.last_error = str(old.dead_error or "engine died")
        try:
            wait = self._next_backoff()
            log.error("engine of model %s died (%s); restarting in %.1fs", self.name, self.last_error, wait)
            await asyncio.sleep(wait)
            old.shutdown()  # reaps the dead process and removes its socket files
            while True:
                try:
                    new = await asyncio.to_thread(self._factory)
                    break
                except Exception as exc:  # noqa: BLE001 -- a failed start is one more turn of the crash loop
                    self.last_error = f"restart failed: {exc}"
                    wait = self._grow()  # a load that fails will likely fail again: never retry hot
                    log.error("engine of model %s failed to restart (%s); next try in %.1fs", self.name, exc, wait)
                    await asyncio.sleep(wait)
            self._set(new)
            self._started_at = time.monotonic()
            self.restarts += 1
            self._counter.inc()
            log.warning("engine of model %s restarted (restart %d)", self.name, self.restarts)
        finally:
            self.restarting = False


def _dead(engine: Any) -> bool:
    """``check_health`` polls the process too (``errored`` alone only sees a death the output pump noticed)."""
    try:
        engine.check_health()
    except EngineDeadError:
        return True
    return False
