"""ReplicatedEngine over fake engines: least-outstanding spread, prefix affinity on token ids, a replica that
dies before a request's first output is skipped (the request runs elsewhere), one that dies mid-stream fails its
request with EngineDeadError, all down is EngineDeadError naming each replica, stats add up; the config keys of
replicas and their errors; the message when Ray is missing."""
from __future__ import annotations

import asyncio
import sys

import pytest

from strataserve.types.errors import EngineDeadError
from strataserve.types.protocol import SchedulerStats
from strataserve.router.config import ConfigError, parse_config
from strataserve.router.local_replicas import ReplicatedEngine, resolve_gpus, tensor_parallel_size


class FakeEngine:
    """An AsyncLLM stand-in: yields ``n`` outputs per request, one per loop tick; ``die`` kills it."""

    def __init__(self, name: str, num_blocks: int = 10, free: int = 10) -> None:
        self.name = name
        self.config = self.tokenizer = self.vocab_size = None
        self.max_model_len = 64
        self.dead: str | None = None
        self.requests: list[str] = []
        self.aborted: list[str] = []
        self.stats = SchedulerStats(num_running=1, num_total_blocks=num_blocks, num_free_blocks=free,
                                    generation_tokens=5)
        self.core = self

    def check_health(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def die(self) -> None:
        self.dead = f"{self.name} killed"

    async def generate(self, prompt, params, request_id, priority=0):
        self.check_health()
        self.requests.append(request_id)
        finished = False
        try:
            for i in range(params):
                await asyncio.sleep(0)
                self.check_health()
                finished = i == params - 1
                yield (self.name, i)
        finally:
            if not finished:
                self.aborted.append(request_id)

    def shutdown(self) -> None:
        self.dead = "shut down"


async def _collect(engine, prompt, n, rid):
    return [out async for out in engine.generate(prompt, n, rid)]


def test_requests_spread_by_load_and_stick_by_prefix():
    async def main():
        a, b = FakeEngine("a"), FakeEngine("b")
        rep = ReplicatedEngine("m", [a, b], affinity_chars=256, slack=0)
        # concurrent short prompts: least outstanding alternates between the two
        await asyncio.gather(*(_collect(rep, [1, 2, 3], 5, f"s{i}") for i in range(6)))
        assert len(a.requests) == 3 and len(b.requests) == 3
        # a shared prefix longer than the affinity window (256 chars = 64 token ids) goes to one replica while
        # the load is even; different prefixes land on both (without affinity the idle first one takes all)
        a.requests.clear(), b.requests.clear()
        for k in range(8):
            for i in range(3):
                await _collect(rep, [k] * 70 + [i], 2, f"p{k}-{i}")
        homes = [{"a" if f"p{k}-{i}" in a.requests else "b" for i in range(3)} for k in range(8)]
        assert all(len(h) == 1 for h in homes)
        assert {"a", "b"} == set().union(*homes)
        return rep

    rep = asyncio.run(main())
    assert sum(r["served"] for r in rep.describe()) == 30
    assert all(r["outstanding"] == 0 for r in rep.describe())


def test_a_dead_replica_is_skipped_and_mid_stream_death_fails_the_request():
    async def main():
        a, b = FakeEngine("a"), FakeEngine("b")
        rep = ReplicatedEngine("m", [a, b])
        a.die()
        out = await _collect(rep, [1], 3, "r1")
        assert [o[0] for o in out] == ["b"] * 3 and rep.alive() == [False, True]
        # b dies after its first output: the request fails (its text was partly streamed), nothing is retried
        a.dead = None
        agen = rep.generate([1], 5, "r2")
        first = await agen.__anext__()
        victim = a if first[0] == "a" else b
        victim.die()
        with pytest.raises(EngineDeadError, match="killed"):
            await agen.__anext__()
        await agen.aclose()
        assert victim.aborted == ["r2"]
        # both down: EngineDeadError naming each replica
        a.die(), b.die()
        with pytest.raises(EngineDeadError, match=r"all 2 replicas are down \(m\[0\]: a killed; m\[1\]: b killed\)"):
            await _collect(rep, [1], 1, "r3")
        assert rep.errored

    asyncio.run(main())


def test_a_replica_that_dies_before_any_output_hands_the_request_on():
    async def main():
        a, b = FakeEngine("a"), FakeEngine("b")
        rep = ReplicatedEngine("m", [a, b])
        orig = a.generate

        async def dies_at_start(prompt, params, request_id, priority=0):
            a.die()  # accepted, then the core died before the first step
            async for o in orig(prompt, params, request_id, priority):
                yield o

        a.generate = dies_at_start
        out = await _collect(rep, [1], 2, "r")
        assert [o[0] for o in out] == ["b", "b"]
        replacement = FakeEngine("a2")
        rep.replace(0, replacement)
        assert rep.alive() == [True, True] and not rep.errored

    asyncio.run(main())


def test_stats_add_up_over_replicas():
    rep = ReplicatedEngine("m", [FakeEngine("a", 10, 10), FakeEngine("b", 30, 10)])
    s = rep.stats
    assert (s.num_running, s.num_total_blocks, s.num_free_blocks, s.generation_tokens) == (2, 40, 20, 10)
    assert s.kv_cache_usage == pytest.approx(20 / 40)


def test_gpus_per_replica_default():
    from strataserve.config import EngineConfig, ModelConfig

    def cfg(device):
        return EngineConfig(model=ModelConfig(model="x", device=device))

    assert tensor_parallel_size(cfg("cpu")) == 1
    assert resolve_gpus(None, cfg("cpu"), 8) == 0
    assert resolve_gpus(None, cfg("auto"), 0) == 0
    assert resolve_gpus(None, cfg("auto"), 2) == 1
    assert resolve_gpus(None, cfg("cuda"), 0) == 1
    assert resolve_gpus(0.5, cfg("cuda"), 2) == 0.5


@pytest.mark.parametrize("entry, message", [
    ({"replicas": 0}, "models[0] (m).replicas: Input should be greater than or equal to 1"),
    ({"placement": "cluster"}, "models[0] (m).placement: Input should be 'local' or 'ray'"),
    ({"ray_address": "auto"}, "models[0] (m): ray_address is only used with placement: ray"),
    ({"replicas": 2, "num_gpus_per_replica": 1}, "models[0] (m): num_gpus_per_replica needs placement"),
    ({"placement": "local", "num_gpus_per_replica": 0.5}, "placement local takes whole GPUs"),
    ({"placement": "ray", "num_gpus_per_replica": -1}, "models[0] (m).num_gpus_per_replica: Input should be"),
    ({"placement": "ray", "ray_address": "ray://head:10001"}, "models[0] (m).ray_address: Ray Client (ray://) is not"),
])
def test_replica_config_errors_name_the_key(tmp_path, entry, message):
    with pytest.raises(ConfigError) as err:
        parse_config({"models": [{"name": "m", "path": str(tmp_path), **entry}]})
    assert message in str(err.value)


def test_two_ray_clusters_are_refused_and_a_good_entry_parses(tmp_path):
    with pytest.raises(ConfigError, match="ray_address: every placement: ray model must use the same Ray cluster"):
        parse_config({"models": [{"name": "a", "path": str(tmp_path), "placement": "ray", "ray_address": "h:1"},
                                 {"name": "b", "path": str(tmp_path), "placement": "ray"}]})
    m = parse_config({"models": [{"name": "a", "path": str(tmp_path), "replicas": 3}]}).models[0]
    assert (m.replicas, m.placement, m.replicated) == (3, None, True)
    assert not parse_config({"models": [{"name": "a", "path": str(tmp_path)}]}).models[0].replicated


def test_without_ray_placement_ray_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: find_spec and import both fail
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"models\[0\] \(m\)\.placement: Ray is not installed: "
                                          r"pip install 'strataserve\[ray\]'"):
        parse_config({"models": [{"name": "m", "path": str(tmp_path), "placement": "ray"}]})
    from strataserve.engine.ray_client import require_ray

    with pytest.raises(ImportError, match=r"pip install 'strataserve\[ray\]'"):
        require_ray()
    # local replicas need no Ray
    assert parse_config({"models": [{"name": "m", "path": str(tmp_path), "placement": "local"}]})
