"""Faults in user code stay with the requests that caused them: a model raising on some requests of a batch, an
output of the wrong shape, a hang past EXECUTION_TIMEOUT_MS (in-process and isolated), and a SIGKILLed isolated
model process, which is restarted while the model keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
from _model_repos import write_python_model
from ms_helpers import outputs, request, run, serving

from strataserve.types.tensors import ModelServerError

ISOLATED = 'parameters { key: "EXECUTION_ISOLATION" value: { string_value: "process" } }\n'

# Raises for the whole execute() when any request in it has X % 10 == 9: the batcher must find the culprit.
FLAKY = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            xs = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
            bad = [int(x[0, 0]) for x in xs if int(x[0, 0]) % 10 == 9]
            if bad:
                raise ValueError(f"cannot handle X={bad[0]}")
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]) for x in xs]
"""

# X=1: hangs (bounded, so the abandoned thread ends); X=2: answers a wrong shape; X=3: reports its pid after a
# short sleep (a request in flight when the test kills the process); X=8: floats for the INT64 output; X=9: Y = X + 1
# as int32 (cast); else: Y = X + 1.
MISBEHAVING = """
    import os
    import threading
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                if x[0] == 1:
                    threading.Event().wait(5)
                if x[0] == 2:
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros((2, 2), np.int64))]))
                    continue
                if x[0] in (8, 9):
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 0.5 if x[0] == 8
                                                                           else (x + 1).astype(np.int32))]))
                    continue
                if x[0] == 3:
                    time.sleep(1.0)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([os.getpid()], np.int64)
                                                                       if x[0] == 4 else x + 1)]))
            return out
"""


def _config(extra: str = "", mbs: int = 0, dims: str = "[1]") -> str:
    return (f'backend: "python"\nmax_batch_size: {mbs}\n'
            f'input [ {{ name: "X" data_type: TYPE_INT64 dims: {dims} }} ]\n'
            f'output [ {{ name: "Y" data_type: TYPE_INT64 dims: {dims} }} ]\n{extra}')


def test_a_model_raising_on_every_tenth_request_fails_only_those(tmp_path):
    write_python_model(tmp_path, "flaky", FLAKY, _config("dynamic_batching { max_queue_delay_microseconds: 20000 }",
                                                         mbs=8))

    async def main():
        async with serving(tmp_path) as server:
            jobs = [server.infer(request("flaky", X=np.array([[i]], np.int64))) for i in range(40)]
            return await asyncio.gather(*jobs, return_exceptions=True), server.statistics("flaky")

    results, stats = run(main())
    failed = {i for i, r in enumerate(results) if isinstance(r, BaseException)}
    assert failed == {9, 19, 29, 39}
    for i in failed:
        err = results[i]
        assert isinstance(err, ModelServerError) and err.code == "internal"
        assert "model 'flaky'" in err.message and f"cannot handle X={i}" in err.message
    for i, r in enumerate(results):
        if i not in failed:
            np.testing.assert_array_equal(outputs(r)["Y"], [[2 * i]])
    batches = stats["model_stats"][0]["batch_stats"]
    assert any(b["batch_size"] > 1 for b in batches)  # the requests really were batched together


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "isolated"])
def test_wrong_shapes_and_hangs_fail_only_their_requests(tmp_path, isolated):
    extra = 'parameters { key: "EXECUTION_TIMEOUT_MS" value: { string_value: "400" } }\n'
    write_python_model(tmp_path, "odd", MISBEHAVING, _config(extra + (ISOLATED if isolated else "")))

    async def main():
        async with serving(tmp_path) as server:
            x = lambda v: request("odd", X=np.array([v], np.int64))  # noqa: E731
            with pytest.raises(ModelServerError) as shape:
                await server.infer(x(2))
            with pytest.raises(ModelServerError, match="output 'Y' is float64, but its config declares INT64"):
                await server.infer(x(8))  # truncated to ints it would be wrong data
            assert outputs(await server.infer(x(9)))["Y"].tolist() == [10]  # int32 into INT64: cast
            hang = asyncio.ensure_future(server.infer(x(1)))
            await asyncio.sleep(0.05)
            later = [asyncio.ensure_future(server.infer(x(v))) for v in (5, 6, 7)]
            with pytest.raises(ModelServerError) as timeout:
                await hang
            answers = [outputs(await r)["Y"][0] for r in later]
            return shape.value, timeout.value, answers, server.statistics("odd")

    shape, timeout, answers, stats = run(main())
    assert shape.code == "internal" and "model 'odd'" in shape.message and "output 'Y'" in shape.message
    assert "[2, 2]" in shape.message and "[1]" in shape.message
    assert timeout.code == "deadline_exceeded" and "model 'odd'" in timeout.message
    assert "EXECUTION_TIMEOUT_MS" in timeout.message
    assert answers == [6, 7, 8]  # the model's later requests were served
    assert stats["model_stats"][0]["inference_stats"]["fail"]["count"] == 3


def test_sigkilled_isolated_model_restarts_and_only_its_inflight_request_fails(tmp_path):
    write_python_model(tmp_path, "iso", MISBEHAVING, _config(ISOLATED))

    async def main():
        async with serving(tmp_path) as server:
            x = lambda v: request("iso", X=np.array([v], np.int64))  # noqa: E731
            pid = int(outputs(await server.infer(x(4)))["Y"][0])
            in_flight = asyncio.ensure_future(server.infer(x(3)))
            await asyncio.sleep(0.4)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ModelServerError) as died:
                await in_flight
            new_pid = int(outputs(await server.infer(x(4)))["Y"][0])  # waits for the new process
            after = outputs(await server.infer(x(10)))["Y"][0]
            restarts = server.registry.get_sample_value("strata:model_restarts", {"model": "iso", "version": "1"})
            return died.value, pid, new_pid, after, restarts

    died, pid, new_pid, after, restarts = run(main())
    assert died.code == "unavailable" and "model 'iso'" in died.message and "exited" in died.message
    assert new_pid != pid  # benchmarks/restart_bench.py measures how fast
    assert after == 11
    assert restarts == 1.0


def test_a_bad_execution_timeout_is_a_load_error(tmp_path):
    extra = 'parameters { key: "EXECUTION_TIMEOUT_MS" value: { string_value: "soon" } }\n'
    write_python_model(tmp_path, "bad", MISBEHAVING, _config(extra))

    async def main():
        async with serving(tmp_path) as server:
            return server.repository_index()

    index = {m["name"]: m for m in run(main())}
    assert index["bad"]["state"] == "UNAVAILABLE"
    assert "EXECUTION_TIMEOUT_MS" in index["bad"]["reason"] and "'soon'" in index["bad"]["reason"]
