"""Triton Python-backend behaviours: auto_complete_config, cancellation, mid-stream errors, the per-instance
event loop of ``async def execute``, BLS request/response parameters and timeouts."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from _model_repos import PY_ERROR_MID_STREAM, write_python_model
from ms_helpers import outputs, request, run, serving

from strataserve.modelserver.model import ErrorResponse
from strataserve.types.tensors import InferRequest, ModelServerError

ISOLATED = '\nparameters { key: "EXECUTION_ISOLATION" value: { string_value: "process" } }\n'
DECOUPLED = "\nmodel_transaction_policy { decoupled: true }\n"


def _config(inputs: str, outputs_: str, extra: str = "") -> str:
    return f'backend: "python"\nmax_batch_size: 0\ninput [ {inputs} ]\noutput [ {outputs_} ]\n{extra}'


N_IN = '{ name: "N" data_type: TYPE_INT32 dims: [1] }'
OUT_I = '{ name: "OUT" data_type: TYPE_INT32 dims: [1] }'

# NVIDIA's python_backend README example: reads config['input'] / config['output'] of a model with no config.pbtxt
README_AUTOCOMPLETE = """
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(auto_complete_model_config):
            inputs = [{'name': 'INPUT0', 'data_type': 'TYPE_FP32', 'dims': [4], 'optional': True},
                      {'name': 'INPUT1', 'data_type': 'TYPE_FP32', 'dims': [4]}]
            outputs = [{'name': 'OUTPUT0', 'data_type': 'TYPE_FP32', 'dims': [4]}]
            config = auto_complete_model_config.as_dict()
            input_names = [i['name'] for i in config['input']]
            output_names = [o['name'] for o in config['output']]
            for i in inputs:
                if i['name'] not in input_names:
                    auto_complete_model_config.add_input(i)
            for o in outputs:
                if o['name'] not in output_names:
                    auto_complete_model_config.add_output(o)
            auto_complete_model_config.set_max_batch_size(0)
            return auto_complete_model_config

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy())]) for r in requests]
"""


def _bare_model(repo, name: str, code: str) -> None:
    import textwrap

    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(code))


def test_auto_complete_readme_example_loads_and_any_model_exception_stays_with_its_model(tmp_path):
    _bare_model(tmp_path, "readme", README_AUTOCOMPLETE)
    _bare_model(tmp_path, "hook_raises", "class TritonPythonModel:\n    @staticmethod\n"
                "    def auto_complete_config(c):\n        return {}['nope']\n")
    write_python_model(tmp_path, "init_exits", "import sys\nclass TritonPythonModel:\n"
                       "    def initialize(self, args):\n        sys.exit(3)\n",
                       _config(N_IN, OUT_I))

    async def main():
        async with serving(tmp_path) as server:  # starting must survive every broken model
            x = np.arange(4, dtype=np.float32)
            out = outputs(await server.infer(request("readme", INPUT1=x)))["OUTPUT0"]
            return out, {e["name"]: e for e in server.repository_index()}

    out, index = run(main())
    np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32))
    assert index["readme"]["state"] == "READY"
    assert index["hook_raises"]["state"] == "UNAVAILABLE"
    assert "hook_raises" in index["hook_raises"]["reason"] and "KeyError: 'nope'" in index["hook_raises"]["reason"]
    assert index["init_exits"]["state"] == "UNAVAILABLE" and "SystemExit" in index["init_exits"]["reason"]


# Streams until the client cancels, polling both is_cancelled() forms, and records what it saw in LOG.
CANCEL = """
    import json, threading, time
    import numpy as np
    import triton_python_backend_utils as pb_utils
    LOG = __LOG__


    class TritonPythonModel:
        def execute(self, requests):
            for r in requests:
                s = r.get_response_sender()

                def run(s=s, r=r):
                    t0, i = time.time(), 0
                    while time.time() - t0 < 10 and not (s.is_cancelled() and r.is_cancelled()):
                        s.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
                        i += 1
                        time.sleep(0.02)
                    with open(LOG, "w") as f:
                        json.dump({"cancelled": s.is_cancelled(), "after_s": time.time() - t0}, f)
                    s.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                threading.Thread(target=run).start()
"""

# Not decoupled: execute() waits in-line for its request's cancellation.
CANCEL_PLAIN = """
    import json, time
    import numpy as np
    import triton_python_backend_utils as pb_utils
    LOG = __LOG__


    class TritonPythonModel:
        def execute(self, requests):
            t0 = time.time()
            while time.time() - t0 < 10 and not requests[0].is_cancelled():
                time.sleep(0.02)
            with open(LOG, "w") as f:
                json.dump({"cancelled": requests[0].is_cancelled(), "after_s": time.time() - t0}, f)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([0], np.int32))]) for _ in requests]
"""


@pytest.mark.parametrize("isolation", ["", ISOLATED], ids=["in_process", "isolated"])
def test_client_cancellation_reaches_the_model(tmp_path, isolation):
    logs = {name: tmp_path / f"{name}.json" for name in ("dec", "plain")}
    write_python_model(tmp_path / "repo", "dec", CANCEL.replace("__LOG__", repr(str(logs["dec"]))),
                       _config(N_IN, OUT_I, DECOUPLED + isolation))
    write_python_model(tmp_path / "repo", "plain", CANCEL_PLAIN.replace("__LOG__", repr(str(logs["plain"]))),
                       _config(N_IN, OUT_I, isolation))

    async def wait_log(path):
        for _ in range(200):
            if path.exists() and path.read_text():
                return json.loads(path.read_text())
            await asyncio.sleep(0.02)
        return None

    async def main():
        async with serving(tmp_path / "repo") as server:
            stream = server.infer_stream(request("dec", N=np.array([0], np.int32)))
            got = [await stream.__anext__() for _ in range(3)]
            await stream.aclose()  # the client goes away (gRPC cancel, HTTP hang-up)
            task = asyncio.ensure_future(server.infer(request("plain", N=np.array([0], np.int32))))
            await asyncio.sleep(0.3)
            task.cancel()
            return len(got), await wait_log(logs["dec"]), await wait_log(logs["plain"])

    count, dec, plain = run(main())
    assert count == 3
    assert dec is not None and dec["cancelled"] and dec["after_s"] < 5, dec
    assert plain is not None and plain["cancelled"] and plain["after_s"] < 5, plain


def test_an_error_response_mid_stream_does_not_end_the_stream(tmp_path):
    write_python_model(tmp_path, "dec", PY_ERROR_MID_STREAM, _config(N_IN, OUT_I, DECOUPLED))

    async def main():
        async with serving(tmp_path) as server:
            items = [r async for r in server.infer_stream(request("dec", N=np.array([0], np.int32)))]
            try:
                await server.infer(request("dec", N=np.array([0], np.int32)))
            except ModelServerError as e:
                return items, e
            return items, None

    items, collected = run(main())
    assert isinstance(items[1], ErrorResponse) and "mid-stream error" in items[1].error.message
    assert [outputs(r)["OUT"].tolist() for i, r in enumerate(items) if i != 1] == [[0], [2], [3]]
    assert [getattr(r, "final", None) for r in items] == [False, None, False, True]
    assert collected is not None and "mid-stream error" in collected.message  # non-streaming: the error wins


ASYNC_TASK = """
    import asyncio, time, json
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        async def _gen(self, s, n):
            for i in range(n):
                await asyncio.sleep(0.01)
                s.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
            s.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        async def execute(self, requests):
            for r in requests:
                n = int(pb_utils.get_input_tensor_by_name(r, "N").as_numpy()[0])
                if n >= 0:  # a task outliving execute(): the instance's loop keeps running it
                    asyncio.get_running_loop().create_task(self._gen(r.get_response_sender(), n))
                    continue
                await asyncio.sleep(0.6)  # waiting on something: another request may start meanwhile
                r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUT", np.array([int(time.monotonic() * 1000) % 1000000], np.int32))]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


@pytest.mark.parametrize("isolation", ["", ISOLATED], ids=["in_process", "isolated"])
def test_async_execute_runs_on_one_loop_per_instance(tmp_path, isolation):
    write_python_model(tmp_path, "dec", ASYNC_TASK, _config(N_IN, OUT_I, DECOUPLED + isolation))

    async def main():
        async with serving(tmp_path) as server:
            streamed = [outputs(r)["OUT"].tolist()
                        async for r in server.infer_stream(request("dec", N=np.array([3], np.int32)))]
            t0 = time.monotonic()
            await asyncio.gather(*[server.infer(request("dec", N=np.array([-1], np.int32))) for _ in range(2)])
            return streamed, time.monotonic() - t0

    streamed, both = run(main())
    assert streamed == [[0], [1], [2]]
    assert both < 1.1, f"two requests awaiting 0.6 s each took {both:.2f} s: they ran one after the other"


BLS_CALLER = """
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        async def execute(self, requests):
            out = []
            for r in requests:
                mode = pb_utils.get_input_tensor_by_name(r, "N").as_numpy()[0]
                info = {}
                if mode == 0:
                    req = pb_utils.InferenceRequest(model_name="echo", requested_output_names=["P"],
                        inputs=[pb_utils.Tensor("N", np.array([0], np.int32))], parameters={"p1": "v1", "p2": 7},
                        request_id="bls-rid", timeout=5_000_000, correlation_id=3)
                    for resp in (req.exec(), await req.async_exec()):
                        info.setdefault("seen", []).append(json.loads(
                            pb_utils.get_output_tensor_by_name(resp, "P").as_numpy()[0]))
                        info.setdefault("resp_params", []).append(json.loads(resp.parameters()))
                elif mode == 1:  # the callee sleeps 2 s: the BLS timeout (0.1 s) ends the call
                    resp = pb_utils.InferenceRequest(model_name="echo", requested_output_names=["P"],
                        inputs=[pb_utils.Tensor("N", np.array([1], np.int32))], timeout=100_000).exec()
                    info = {"error": resp.error().message(), "code": resp.error().code()}
                elif mode == 2:
                    resp = await pb_utils.InferenceRequest(model_name="missing", requested_output_names=["P"],
                        inputs=[pb_utils.Tensor("N", np.array([1], np.int32))]).async_exec()
                    info = {"error": resp.error().message(), "code": resp.error().code()}
                else:  # decoupled BLS, blocking and async iteration
                    req = pb_utils.InferenceRequest(model_name="counter", requested_output_names=["OUT"],
                        inputs=[pb_utils.Tensor("N", np.array([3], np.int32))])
                    info["sync"] = [int(x.output_tensors()[0].as_numpy()[0]) for x in req.exec(decoupled=True)]
                    info["async"] = [int(x.output_tensors()[0].as_numpy()[0])
                                     async for x in await req.async_exec(decoupled=True)]
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("P", np.array([json.dumps(info).encode()],
                                                                                    dtype=object))]))
            return out
"""

ECHO = """
    import json, time
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                if pb_utils.get_input_tensor_by_name(r, "N").as_numpy()[0] == 1:
                    time.sleep(2)
                seen = {"params": json.loads(r.parameters()), "id": r.request_id()}
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("P", np.array([json.dumps(seen).encode()],
                    dtype=object))], parameters={"answer": "yes", "n": 2, "ok": True}))
            return out
"""

COUNTER = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            for r in requests:
                s = r.get_response_sender()
                for i in range(int(pb_utils.get_input_tensor_by_name(r, "N").as_numpy()[0])):
                    s.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
                s.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

P_OUT = '{ name: "P" data_type: TYPE_STRING dims: [1] }'


def test_bls_request_parameters_id_timeout_and_response_parameters(tmp_path):
    write_python_model(tmp_path, "caller", BLS_CALLER, _config(N_IN, P_OUT))
    write_python_model(tmp_path, "echo", ECHO, _config(N_IN, P_OUT, 'instance_group [{ count: 2 kind: KIND_CPU }]'))
    write_python_model(tmp_path, "counter", COUNTER, _config(N_IN, OUT_I, DECOUPLED))

    async def main():
        async with serving(tmp_path) as server:
            infos = []
            for mode in range(4):
                resp = await server.infer(request("caller", N=np.array([mode], np.int32)))
                infos.append(json.loads(outputs(resp)["P"][0]))
            direct = await server.infer(InferRequest("echo", inputs=request("echo", N=np.array([0], np.int32)).inputs))
            return infos, direct.parameters

    (params, timeout, missing, decoupled), direct = run(main())
    assert params["seen"] == [{"params": {"p1": "v1", "p2": 7}, "id": "bls-rid"}] * 2
    assert params["resp_params"] == [{"answer": "yes", "n": 2, "ok": True}] * 2
    assert "timeout of 100000 us" in timeout["error"] and timeout["code"] == 4  # UNAVAILABLE, as Triton
    assert "unknown model 'missing'" in missing["error"] and missing["code"] == 2  # NOT_FOUND
    assert decoupled == {"sync": [0, 1, 2], "async": [0, 1, 2]}
    assert direct == {"answer": "yes", "n": 2, "ok": True}
