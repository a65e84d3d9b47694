"""Strict readiness follows an isolated Python model's process: while it is being restarted after it died, the
server is not ready (the model's own state stays READY: its requests wait for the new process); once the new
process runs, the server is ready again. The request that was running when the process died failed in the
backend: it counts under the BACKEND failure reason. Without strict readiness the server stays ready."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
from _model_repos import write_python_model
from ms_helpers import outputs, request, run, serving

from strataserve.types.tensors import ModelServerError

# X=0: answers its process id; else sleeps X seconds and answers X
PID_OR_SLEEP = """
    import os
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                time.sleep(float(x[0]))
                y = np.array([os.getpid()], np.int64) if x[0] == 0 else x
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
            return out
"""
CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "X" data_type: TYPE_INT64 dims: [1] } ]
    output [ { name: "Y" data_type: TYPE_INT64 dims: [1] } ]
    parameters { key: "EXECUTION_ISOLATION" value: { string_value: "process" } }
"""


def _x(v: int):
    return request("iso", X=np.array([v], np.int64))


async def _until(predicate, timeout_s: float) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_the_server_is_not_ready_while_an_isolated_process_restarts(tmp_path, strict):
    write_python_model(tmp_path, "iso", PID_OR_SLEEP, CONFIG)

    async def main():
        async with serving(tmp_path, strict_readiness=strict) as server:
            ready_before = server.ready()
            pid = int(outputs(await server.infer(_x(0)))["Y"][0])
            in_flight = asyncio.ensure_future(server.infer(_x(2)))
            await asyncio.sleep(0.3)
            seen = []  # server.ready() and the model's readiness, each time one of them changes
            watch = asyncio.ensure_future(_watch(server, seen))
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ModelServerError) as died:
                await in_flight
            new_pid = int(outputs(await server.infer(_x(0)))["Y"][0])  # waits for the new process
            await _until(lambda: seen[-1] == (True, True), 10)  # the new process is running, and seen so
            watch.cancel()
            failures = server._version("iso").stats.failures()
            return ready_before, died.value, new_pid != pid, seen, failures

    ready_before, died, restarted, seen, failures = run(main())
    assert ready_before and restarted
    assert died.code == "unavailable" and "exited" in died.message
    assert failures == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 1, "OTHER": 0}
    assert all(model_ready for _, model_ready in seen)  # the model stays READY: its requests wait
    if strict:
        assert [server_ready for server_ready, _ in seen] == [True, False, True], seen
    else:
        assert [server_ready for server_ready, _ in seen] == [True], seen


async def _watch(server, seen: list) -> None:
    while True:
        now = (server.ready(), server.model_ready("iso"))
        if not seen or seen[-1] != now:
            seen.append(now)
        await asyncio.sleep(0.002)
