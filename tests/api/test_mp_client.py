"""MPCoreClient against a real engine-core process (EngineCore over a fake runner): round trip, aborts that
free blocks, start-up errors, death detection and clean shutdown."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
from api_fakes import failing_core, fake_core
from engine.engine_fakes import engine_config, reference_output

from strataserve.types.errors import EngineDeadError
from strataserve.engine.mp_client import MPCoreClient
from strataserve.types.errors import EngineStartupError
from strataserve.types.protocol import EngineCoreRequest
from strataserve.types.sampling import SamplingParams


def _req(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def _drain(client: MPCoreClient, want: set[str]) -> tuple[dict[str, list[int]], dict[str, str], object]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    stats = None
    while not want <= set(reasons):
        batch = await asyncio.wait_for(client.get_outputs(), 10)
        stats = batch.stats or stats
        for o in batch.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    return tokens, reasons, stats


def test_round_trip_abort_and_shutdown():
    client = MPCoreClient(engine_config(), core_factory=fake_core)
    pid, tmpdir = client.pid, client._tmpdir
    try:
        assert client.info.num_blocks == 64 and client.info.max_model_len == 256

        async def run():
            prompts = {f"r{i}": list(range(10 + i, 30 + 2 * i)) for i in range(4)}
            for rid, p in prompts.items():
                client.add_request(_req(rid, p, 8))
            tokens, reasons, _ = await _drain(client, set(prompts))
            for rid, p in prompts.items():
                assert tokens[rid] == reference_output(p, 8), rid
                assert reasons[rid] == "length"
            # A long request aborted mid-way: the core reports its blocks freed.
            client.add_request(_req("long", list(range(5, 40)), 200))
            first = await asyncio.wait_for(client.get_outputs(), 10)
            assert first.stats.num_free_blocks < first.stats.num_total_blocks
            client.abort_requests(["long", "never-existed"])
            for _ in range(50):
                batch = await asyncio.wait_for(client.get_outputs(), 10)
                if batch.stats.num_running == 0 and batch.stats.num_free_blocks == batch.stats.num_total_blocks:
                    return
            pytest.fail("blocks were not freed after the abort")

        asyncio.run(run())
    finally:
        client.shutdown()
    assert not os.path.exists(tmpdir)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_startup_error_is_reported_not_hung():
    with pytest.raises(EngineStartupError, match="has no config.json"):
        MPCoreClient(engine_config(), core_factory=failing_core, startup_timeout_s=60)


def test_engine_death_fails_waiters_and_commands():
    client = MPCoreClient(engine_config(), core_factory=fake_core)
    try:
        async def run():
            client.add_request(_req("a", list(range(5, 20)), 10_000 // 100))
            waiter = asyncio.ensure_future(_drain(client, {"never"}))
            await asyncio.sleep(0.2)
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(waiter, 10)
            assert client.errored
            with pytest.raises(EngineDeadError):
                client.add_request(_req("b", [5, 6, 7], 4))
            client.abort_requests(["a"])  # harmless on a dead core

        asyncio.run(run())
    finally:
        client.shutdown()


def test_spawn_now_wait_later_reports_startup_phases():
    """wait=False returns while the engine loads; wait_ready then hands over the engine's start-up phases."""
    client = MPCoreClient(engine_config(), core_factory=fake_core, wait=False)
    try:
        assert client.ready_info is None and client.spawned_at >= 0
        info = client.wait_ready(60)
        assert client.wait_ready() is info and client.info.num_blocks == 64
        names = [name for name, _ in info.startup]
        assert names[:2] == ["process spawn", "imports"] and names[-1] == "engine core", names
        assert all(sec >= 0 for _, sec in info.startup) and info.startup[0][1] > 0  # a new process takes time
    finally:
        client.shutdown()


def test_unwaited_client_shuts_down_cleanly():
    client = MPCoreClient(engine_config(), core_factory=fake_core, wait=False)
    pid = client.pid
    client.shutdown()
    assert not client._proc.is_alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("factory", [fake_core, failing_core], ids=["loads", "fails"])
def test_engine_exits_quietly_when_the_front_left_during_start_up(tmp_path, capfd, factory):
    """Ctrl-C while the model loads stops the front first: the engine then finds nobody at the handshake pipe and
    exits with status 0 and no BrokenPipeError traceback, whether its start-up succeeded or failed."""
    import multiprocessing

    from strataserve.engine.core_proc import run_engine_core

    ctx = multiprocessing.get_context("spawn")
    front_end, engine_end = ctx.Pipe(duplex=False)
    front_end.close()  # the front is gone before the engine reports
    proc = ctx.Process(target=run_engine_core, args=(engine_config(), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out",
                                                     engine_end, factory, None))
    proc.start()
    engine_end.close()
    proc.join(60)
    assert proc.exitcode == 0
    assert "BrokenPipeError" not in capfd.readouterr().err
