"""Dynamic batcher: real batching, preferred sizes, queue policy (full, timeout REJECT/DELAY), priorities,
parallel instances."""

from __future__ import annotations

import asyncio

import numpy as np
from _model_repos import (
    add_onnx_mlp,
    add_python_scale,
    add_python_seq,
    mlp_reference,
    write_python_model,
)
from ms_helpers import expect_error, outputs, request, run, serving

from strataserve.types.tensors import ModelServerError


def test_concurrent_requests_are_batched_and_split_back(tmp_path):
    weights = add_onnx_mlp(tmp_path, max_queue_delay_us=20_000)[1]
    add_python_scale(tmp_path, max_queue_delay_us=20_000)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1 + i % 3, 4)).astype(np.float32) for i in range(32)]
    hs = [rng.standard_normal((1 + i % 2, 3)).astype(np.float32) for i in range(32)]

    async def main():
        async with serving(tmp_path) as server:
            onnx = await asyncio.gather(*(server.infer(request("onnx_mlp", INPUT0=x)) for x in xs))
            py = await asyncio.gather(*(server.infer(request("py_scale", IN=h)) for h in hs))
            return onnx, py, server.statistics("onnx_mlp")["model_stats"][0]

    onnx, py, stats = run(main())
    for x, resp in zip(xs, onnx):  # every request gets exactly its own rows back
        np.testing.assert_allclose(outputs(resp)["OUTPUT0"], mlp_reference(x, weights), rtol=1e-5, atol=1e-5)
    for h, resp in zip(hs, py):
        np.testing.assert_allclose(outputs(resp)["OUT"], h * 3 - 1, rtol=1e-6)
    assert stats["inference_count"] == sum(len(x) for x in xs)
    assert stats["execution_count"] <= 16, stats  # 32 requests, batches of up to 8 rows
    assert max(b["batch_size"] for b in stats["batch_stats"]) > 3
    assert sum(b["compute_infer"]["count"] for b in stats["batch_stats"]) == stats["execution_count"]
    # The Python model saw several requests per execute() call.
    assert max(int(outputs(r)["BATCH"][0, 0]) for r in py) > 2


def test_preferred_batch_size_cuts_batches(tmp_path):
    add_onnx_mlp(tmp_path, config="""
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 5000000 }
    """)

    async def main():
        async with serving(tmp_path) as server:
            xs = [np.full((1, 4), i, np.float32) for i in range(8)]
            await asyncio.gather(*(server.infer(request("onnx_mlp", INPUT0=x)) for x in xs))
            return server.statistics("onnx_mlp")["model_stats"][0]

    stats = run(main())
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(4, 2)]


async def _until_executing(server, name: str) -> None:
    """Wait until the model's only instance has taken a request (it then sleeps in execute())."""
    scheduler = server._version(name).scheduler
    while not scheduler.running:
        await asyncio.sleep(0.005)


def _sleep(ms: float) -> np.ndarray:
    return np.array([[ms]], np.float32)


def _at(model: str, priority: int):
    """A request that sleeps 0 ms, at this priority."""
    req = request(model, SLEEP_MS=_sleep(0))
    req.priority = priority
    return req


def _seq(resp) -> int:
    return int(outputs(resp)["SEQ"][0, 0])


def test_full_queue_rejects(tmp_path):
    add_python_seq(tmp_path, max_queue_size=2)

    async def main():
        async with serving(tmp_path) as server:
            blocker = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(500))))
            await _until_executing(server, "py_seq")
            queued = [asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(0)))) for _ in range(2)]
            await asyncio.sleep(0)
            await expect_error("unavailable", server.infer(request("py_seq", SLEEP_MS=_sleep(0))), "queue full",
                               "max_queue_size 2")
            return await asyncio.gather(blocker, *queued)

    assert sorted(_seq(r) for r in run(main())) == [0, 1, 2]


def test_timed_out_request_gets_its_error(tmp_path):
    add_python_seq(tmp_path)

    async def main():
        async with serving(tmp_path) as server:
            blocker = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(500))))
            await _until_executing(server, "py_seq")
            late = request("py_seq", SLEEP_MS=_sleep(0))
            late.timeout_us = 20_000
            await expect_error("deadline_exceeded", server.infer(late), "model 'py_seq'", "timed out after 20000 us")
            await blocker
            after = await server.infer(request("py_seq", SLEEP_MS=_sleep(0)))
            return _seq(after), server.statistics("py_seq")["model_stats"][0]

    seq, stats = run(main())
    assert seq == 1  # the timed-out request never executed
    assert stats["inference_stats"]["fail"]["count"] == 1 and stats["execution_count"] == 2


def test_delay_action_moves_timed_out_requests_back(tmp_path):
    # Priority 1 times out after 10 ms with DELAY; the default level 2 has no timeout (a request could only
    # shorten a default, so the request that must not time out sits at a level without one).
    add_python_seq(tmp_path, level1_policy="default_timeout_microseconds: 10000 timeout_action: DELAY")

    async def main():
        async with serving(tmp_path) as server:
            blocker = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(500))))
            await _until_executing(server, "py_seq")
            first = request("py_seq", SLEEP_MS=_sleep(0))
            first.priority = 1
            first = asyncio.create_task(server.infer(first))
            await asyncio.sleep(0.05)  # `first` exceeds its 10 ms queue timeout: delayed, not rejected
            second = request("py_seq", SLEEP_MS=_sleep(0))
            results = await asyncio.gather(blocker, first, server.infer(second))
            return [_seq(r) for r in results]

    assert run(main()) == [0, 2, 1]  # the delayed request runs after every one that has not timed out


def test_priorities_reorder_the_queue(tmp_path):
    add_python_seq(tmp_path)

    async def main():
        async with serving(tmp_path) as server:
            blocker = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(400))))
            await _until_executing(server, "py_seq")
            low = [asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(0)))) for _ in range(2)]
            await asyncio.sleep(0)
            high = request("py_seq", SLEEP_MS=_sleep(0))
            high.priority = 1
            results = await asyncio.gather(blocker, server.infer(high), *low)
            return [_seq(r) for r in results]

    assert run(main()) == [0, 1, 2, 3]


def test_priority_outside_the_levels_gets_the_default_level(tmp_path):
    """Triton's InferenceRequest::SetPriority: 0 or a priority above priority_levels means the default level
    (here 2 of 3), never an error."""
    add_python_seq(tmp_path, "seq3", priority_levels=3, default_level=2)

    async def main():
        async with serving(tmp_path) as server:
            blocker = asyncio.create_task(server.infer(request("seq3", SLEEP_MS=_sleep(300))))
            await _until_executing(server, "seq3")
            jobs = []
            for priority in (3, 7, 0, 1):  # queued in this order behind the blocker
                jobs.append(asyncio.create_task(server.infer(_at("seq3", priority))))
                await asyncio.sleep(0)
            results = await asyncio.gather(blocker, *jobs)
            return [_seq(r) for r in results]

    # level 1 first, then level 2 (7 and 0, in arrival order), then level 3
    assert run(main()) == [0, 4, 2, 3, 1]


def test_request_timeout_may_shorten_but_not_extend_the_default(tmp_path):
    """allow_timeout_override (model_config.proto): a request may set a timeout less than the default, but may
    not increase it: min(request, default)."""
    add_python_seq(tmp_path, default_timeout_us=100_000)

    async def main():
        async with serving(tmp_path) as server:
            blocker = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(600))))
            await _until_executing(server, "py_seq")
            longer = request("py_seq", SLEEP_MS=_sleep(0))
            longer.timeout_us = 10_000_000  # asks for 10 s: the default 100 ms still applies
            shorter = request("py_seq", SLEEP_MS=_sleep(0))
            shorter.timeout_us = 20_000
            results = await asyncio.gather(server.infer(longer), server.infer(shorter), return_exceptions=True)
            await blocker
            return results

    longer, shorter = run(main())
    assert isinstance(longer, ModelServerError) and longer.code == "deadline_exceeded", longer
    assert "timed out after 100000 us" in longer.message
    assert isinstance(shorter, ModelServerError) and "timed out after 20000 us" in shorter.message, shorter


MEET = """
    import time
    from pathlib import Path
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.dir = Path(args["model_repository"]).parent  # the repository: shared by every model
            self.me = args["model_instance_name"]

        def execute(self, requests):
            (self.dir / ("arrived_" + self.me)).touch()
            met = 0  # 1 when another instance / model is inside execute() at the same time (bounded wait)
            for _ in range(500):
                if len(list(self.dir.glob("arrived_*"))) >= 2:
                    met = 1
                    break
                time.sleep(0.01)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("MET", np.array([met], np.int32))])
                    for _ in requests]
"""


def test_instances_run_in_parallel(tmp_path):
    write_python_model(tmp_path, "pair", MEET, """
        backend: "python"
        max_batch_size: 0
        input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "MET" data_type: TYPE_INT32 dims: [ 1 ] } ]
        instance_group [ { count: 2 kind: KIND_CPU } ]
    """)

    async def main():
        async with serving(tmp_path) as server:
            x = np.array([1], np.int32)
            return await asyncio.gather(server.infer(request("pair", X=x)), server.infer(request("pair", X=x)))

    assert [int(outputs(r)["MET"][0]) for r in run(main())] == [1, 1]


def test_cancelled_request_is_dropped_and_unload_drains_the_queue(tmp_path):
    add_python_seq(tmp_path)

    async def main():
        async with serving(tmp_path, control_mode="explicit", load_models=["py_seq"]) as server:
            blocker = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(400))))
            await _until_executing(server, "py_seq")
            gone = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(0))))
            await asyncio.sleep(0.01)
            gone.cancel()  # a client that disconnects while queued
            after = await server.infer(request("py_seq", SLEEP_MS=_sleep(0)))
            first = await blocker
            # Unloading refuses new requests at once but finishes what is running and queued.
            blocker = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(400))))
            await _until_executing(server, "py_seq")
            queued = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(0))))
            await asyncio.sleep(0.01)
            unloading = asyncio.create_task(server.unload("py_seq"))
            await asyncio.sleep(0.01)
            await expect_error("unavailable", server.infer(request("py_seq", SLEEP_MS=_sleep(0))), "unloaded")
            await unloading
            return [_seq(r) for r in (first, after, await blocker, await queued)]

    assert run(main()) == [0, 1, 2, 3]


def test_independent_ensemble_steps_run_in_parallel(tmp_path):
    io = """
        backend: "python"
        max_batch_size: 0
        input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "MET" data_type: TYPE_INT32 dims: [ 1 ] } ]
    """
    write_python_model(tmp_path, "left", MEET, io)
    write_python_model(tmp_path, "right", MEET, io)
    (tmp_path / "both" / "1").mkdir(parents=True)
    (tmp_path / "both" / "config.pbtxt").write_text("""
        platform: "ensemble"
        input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "L" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "R" data_type: TYPE_INT32 dims: [ 1 ] } ]
        ensemble_scheduling { step [
          { model_name: "left" input_map { key: "X" value: "X" } output_map { key: "MET" value: "L" } },
          { model_name: "right" input_map { key: "X" value: "X" } output_map { key: "MET" value: "R" } }
        ] }
    """)

    async def main():
        async with serving(tmp_path) as server:
            return outputs(await server.infer(request("both", X=np.array([1], np.int32))))

    out = run(main())
    assert (int(out["L"][0]), int(out["R"][0])) == (1, 1)


def test_priority_queue_policy_applies_per_level(tmp_path):
    add_python_seq(tmp_path, level1_policy="max_queue_size: 1")

    async def main():
        async with serving(tmp_path) as server:
            blocker = asyncio.create_task(server.infer(request("py_seq", SLEEP_MS=_sleep(500))))
            await _until_executing(server, "py_seq")
            queued = [asyncio.create_task(server.infer(_at("py_seq", p))) for p in (2, 2, 2, 1)]
            await asyncio.sleep(0)
            await expect_error("unavailable", server.infer(_at("py_seq", 1)), "queue full", "priority level 1")
            return [_seq(r) for r in await asyncio.gather(blocker, *queued)]

    assert run(main()) == [0, 2, 3, 4, 1]
