"""A request whose client goes away while it is still queued (Triton's dynamic batcher): it leaves the queue at
once (its max_queue_size slot, the pending-request gauge, its timeout timer and its tensors are released then, not
when the busy instance next forms a batch), it is never executed nor counted as a success, and the requests behind
it are batched as if it had never come. In-process ModelServer, Python models that sleep."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import weakref

import numpy as np
from _model_repos import add_python_scale, add_python_seq

from strataserve.modelserver.server import ModelServer
from strataserve.types.tensors import InferRequest, InferTensor, kserve_dtype_of


@contextlib.asynccontextmanager
async def serving(repo):
    server = ModelServer(repo)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def request(model: str, **inputs: np.ndarray) -> InferRequest:
    return InferRequest(model, "", inputs=[InferTensor(k, kserve_dtype_of(v), list(v.shape), v)
                                           for k, v in inputs.items()])


def outputs(response) -> dict[str, np.ndarray]:
    return {t.name: t.data for t in response.outputs}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def _seq_request(sleep_ms: float):
    return request("py_seq", SLEEP_MS=np.array([[sleep_ms]], np.float32))


def _pending_gauge(server, model: str) -> float:
    return server.registry.get_sample_value("strata:inference_pending_request_count",
                                            {"model": model, "version": "1"})


def test_a_queued_request_whose_client_left_frees_its_slot_while_the_instance_is_busy(tmp_path):
    # max_queue_size 1 at the default level; a queue timeout long enough to outlive the test (its timer would hold
    # the request if it were not stopped)
    add_python_seq(tmp_path, max_queue_size=1, default_timeout_us=60_000_000)

    async def main():
        async with serving(tmp_path) as server:
            scheduler = server._version("py_seq").scheduler
            blocker = asyncio.create_task(server.infer(_seq_request(1500)))
            while not scheduler.running:  # the only instance is now asleep in execute()
                await asyncio.sleep(0.005)
            gone = asyncio.create_task(server.infer(_seq_request(0)))
            while not scheduler.queued():
                await asyncio.sleep(0.001)
            assert _pending_gauge(server, "py_seq") == 2
            queued_request = weakref.ref(next(iter(scheduler.queues[-1])).request)

            gone.cancel()  # the client disconnects while its request is queued
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            del gone  # its traceback holds the request; so, for one loop turn, do the loop's wake-up callbacks
            await asyncio.sleep(0.01)
            gc.collect()
            # released now, while the instance is still busy with the blocker
            assert not blocker.done()
            assert scheduler.queued() == 0
            assert _pending_gauge(server, "py_seq") == 1
            assert queued_request() is None
            # its slot is free: a new request is admitted, not refused as "queue full"
            after = asyncio.create_task(server.infer(_seq_request(0)))
            await asyncio.sleep(0.05)
            assert not after.done() and scheduler.queued() == 1
            seqs = [int(outputs(r)["SEQ"][0, 0]) for r in await asyncio.gather(blocker, after)]
            return seqs, server.statistics("py_seq")["model_stats"][0], _pending_gauge(server, "py_seq")

    seqs, stats, gauge = run(main())
    assert seqs == [0, 1]  # the cancelled request never ran: the one after it is the model's second execution
    assert (stats["execution_count"], stats["inference_count"]) == (2, 2)
    assert stats["inference_stats"]["success"]["count"] == 2
    assert stats["inference_stats"]["fail"]["count"] == 1  # the cancelled one: a failure, never a success
    assert gauge == 0


def test_cancelling_the_oldest_queued_request_lets_the_rest_batch_without_waiting_for_its_window(tmp_path):
    # a 5 s batching window; 2 rows is a preferred batch size, 3 rows is not (and is below the largest, 4)
    add_python_scale(tmp_path, max_queue_delay_us=5_000_000, preferred=(2, 4))

    async def main():
        async with serving(tmp_path) as server:
            scheduler = server._version("py_scale").scheduler
            gone = asyncio.create_task(server.infer(request("py_scale", IN=np.zeros((1, 3), np.float32))))
            while not scheduler.queued():
                await asyncio.sleep(0.001)
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            kept = asyncio.create_task(server.infer(request("py_scale", IN=x)))
            await asyncio.sleep(0.1)
            assert not kept.done() and scheduler.queued() == 2  # 1 + 2 rows: waiting for the window
            t0 = time.monotonic()
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            # what is left (2 rows) is a preferred batch size: it goes now, not when the cancelled one's window ends
            response = await asyncio.wait_for(kept, 4)
            took = time.monotonic() - t0
            return x, outputs(response), took, server.statistics("py_scale")["model_stats"][0]

    x, out, took, stats = run(main())
    assert took < 1.0, f"the remaining request waited {took:.2f} s after the cancel"
    np.testing.assert_allclose(out["OUT"], x * 3 - 1)
    assert out["BATCH"].reshape(-1).tolist() == [2, 2]  # the execution held only its 2 rows: the cancelled one never ran
    assert (stats["execution_count"], stats["inference_count"]) == (1, 2)
    assert (stats["inference_stats"]["success"]["count"], stats["inference_stats"]["fail"]["count"]) == (1, 1)
