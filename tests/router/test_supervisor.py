"""EngineSupervisor on fake engines: a dead engine is replaced and counted, a crash loop backs off (doubling up
to the cap), a failed restart is retried, and a core that stayed up long enough restarts at once."""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from strataserve.types.errors import EngineDeadError
from strataserve.router.supervisor import EngineSupervisor, RestartMetrics


class FakeEngine:
    def __init__(self, n: int) -> None:
        self.n = n
        self.errored = False  # never set: the supervisor must not rely on it
        self.dead_error: Exception | None = None
        self.shut = False

    def die(self) -> None:  # as a killed process: only check_health (which polls it) notices
        self.dead_error = RuntimeError(f"engine {self.n} killed")

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    def shutdown(self) -> None:
        self.shut = True


def _supervisor(failures: int = 0, stable_s: float = 10.0):
    registry = CollectorRegistry()
    box = {"engine": FakeEngine(0)}
    made: list[FakeEngine] = []
    fails = [failures]

    def factory() -> FakeEngine:
        if fails[0] > 0:
            fails[0] -= 1
            raise RuntimeError("model failed to load")
        made.append(FakeEngine(len(made) + 1))
        return made[-1]

    sup = EngineSupervisor("m", lambda: box["engine"], lambda e: box.__setitem__("engine", e), factory,
                           RestartMetrics(registry), poll_s=0.005, min_backoff_s=0.02, max_backoff_s=0.08,
                           stable_s=stable_s)
    return sup, box, made, registry


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)


def test_a_dead_engine_is_replaced_and_a_crash_loop_backs_off():
    async def main():
        sup, box, made, registry = _supervisor()
        sup.start()
        assert sup.status() == "serving"
        backoffs = []
        for i in range(5):
            old = box["engine"]
            old.die()
            await _until(lambda: sup.restarts == i + 1 and sup.status() == "serving")
            assert old.shut and box["engine"] is made[-1]
            backoffs.append(sup._backoff)
        await sup.stop()
        # one family, as the server's others: no prometheus-client ``_created`` gauge beside it
        assert {s.name for m in registry.collect() for s in m.samples} == {"strata:engine_restarts_total"}
        return backoffs, sup.last_error, registry.get_sample_value("strata:engine_restarts_total",
                                                                   {"model_name": "m"})

    backoffs, last_error, counted = asyncio.run(main())
    assert backoffs == [0.02, 0.04, 0.08, 0.08, 0.08]  # each crash came soon after a start: doubling, capped
    assert "engine 4 killed" in last_error
    assert counted == 5.0


def test_a_failed_restart_is_retried_and_a_stable_engine_restarts_at_once():
    async def main():
        sup, box, made, _ = _supervisor(failures=2, stable_s=0.0)
        sup.start()
        box["engine"].die()
        await _until(lambda: sup.status() == "restarting")
        assert sup.status() == "restarting"
        await _until(lambda: sup.restarts == 1)
        first = sup._backoff
        box["engine"].die()  # this one ran "long enough" (stable_s=0): no wait
        await _until(lambda: sup.restarts == 2)
        await sup.stop()
        return first, sup._backoff, len(made)

    first, second, n = asyncio.run(main())
    assert first > 0  # the two failed loads backed off
    assert second == 0.0 and n == 2
