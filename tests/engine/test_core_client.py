"""InprocCoreClient contract (the same one MPCoreClient follows) and KV-manager level cache behaviour."""
from __future__ import annotations

import asyncio

import pytest
from engine_fakes import EOS, FakeRunner, engine_config, reference_output

from strataserve.engine.core_client import InprocCoreClient
from strataserve.types.errors import EngineDeadError
from strataserve.engine.engine_core import EngineCore
from strataserve.engine.kv_cache_manager import KVCacheManager
from strataserve.types.protocol import EngineCoreRequest
from strataserve.engine.request import Request
from strataserve.types.sampling import SamplingParams


def creq(rid, prompt, max_tokens=4):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, eos_token_id=EOS,
                             sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def client(**kw) -> InprocCoreClient:
    return InprocCoreClient(core=EngineCore(engine_config(), runner=FakeRunner(num_blocks=32, block_size=4, **kw)))


def test_outputs_stats_rejections_and_abort_publish():
    async def main():
        c = client(max_model_len=64)
        try:
            assert (c.info.max_model_len, c.info.num_blocks, c.info.block_size, c.info.max_pool_tokens) == (64, 32, 4, 128)
            with pytest.raises(ValueError, match="max_model_len"):
                c.add_request(creq("long", list(range(3, 70))))  # rejected in the caller's thread
            c.add_request(creq("a", [5, 6, 7], 6))
            c.add_request(creq("a", [5, 6, 7], 6))  # duplicate id: the core answers with an abort output
            toks, rejected, stats = [], None, None
            while len(toks) < 6:
                batch = await c.get_outputs()
                stats = batch.stats or stats
                for o in batch.outputs:
                    if o.finish_reason == "abort":
                        rejected = o
                    else:
                        toks += o.new_token_ids
            assert toks == reference_output([5, 6, 7], 6)
            assert rejected is not None and "already in use" in rejected.stop_reason
            # An abort publishes stats even though the engine goes idle right after.
            c.add_request(creq("b", [5, 6, 7], 100))
            await c.get_outputs()
            c.abort_requests(["b", "nope"])
            for _ in range(200):
                batch = await c.get_outputs()
                if batch.stats.num_running == 0 and batch.stats.num_free_blocks == 32:
                    break
            else:
                raise AssertionError("abort was not published")
        finally:
            c.shutdown()
            c.shutdown()
        with pytest.raises(EngineDeadError):
            await c.get_outputs()

    asyncio.run(main())


def test_core_crash_is_reported_not_hung():
    async def main():
        c = client(fail_at_step=1)
        c.add_request(creq("x", [5, 6]))
        with pytest.raises(EngineDeadError, match="exploded"):
            while True:
                await c.get_outputs()
        assert c.errored and isinstance(c.dead_error, RuntimeError)
        with pytest.raises(EngineDeadError):
            c.add_request(creq("y", [5]))
        c.shutdown()

    asyncio.run(main())


def _req(rid, toks):
    return Request(rid, toks, SamplingParams(), max_model_len=1000, max_pool_tokens=1000)


def test_kv_manager_frees_tail_blocks_first_so_shared_prefixes_survive_longest():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 token
    assert kv.allocate_slots(a, 7) is not None
    a.num_computed_tokens = 7
    kv.free(a)  # registers the 3 full blocks, frees tail first
    assert kv.num_free_blocks == 6
    # Take 4 blocks: the 2 never-used ones go first, then a's tail (partial block, then [5, 6]).
    filler = _req("f", [9] * 8)
    assert len(kv.allocate_slots(filler, 8)) == 4
    b = _req("b", [1, 2, 3, 4, 5, 6, 8])
    assert kv.get_computed_blocks(b)[1] == 4  # [1, 2] [3, 4] still cached
    filler2 = _req("g", [9])
    assert len(kv.allocate_slots(filler2, 1)) == 1  # evicts [3, 4] next, never the shared head first
    hit, n = kv.get_computed_blocks(b)
    assert n == 2 and len(hit) == 1
    kv.free(filler)
    kv.free(filler2)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(b) == ([], 0)


def test_allocate_slots_reports_none_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", list(range(10)))
    assert kv.allocate_slots(a, 10) is not None and kv.num_free_blocks == 0
    b = _req("b", [1])
    assert kv.allocate_slots(b, 1) is None and kv.num_blocks_of("b") == 0
    assert kv.allocate_slots(a, 2) is not None  # room inside a's last block
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 1) is None
    kv.free(a)
    kv.free(b)  # never allocated: a no-op
    kv.pool.check_invariants()
    assert kv.num_free_blocks == 3
