"""Python backend specifics: process isolation, BLS calls, user-code failures reported with the file."""

from __future__ import annotations

import os

import numpy as np
from _model_repos import PY_DECOUPLED, PY_SCALE, add_onnx_mlp, mlp_reference, write_python_model
from ms_helpers import expect_error, outputs, request, run, serving

ISOLATED = '\n  parameters { key: "EXECUTION_ISOLATION" value: { string_value: "process" } }\n'

PID = """
    import os
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
                    for _ in requests]
"""

BLS = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "X")
                call = pb_utils.InferenceRequest(model_name="onnx_mlp", inputs=[pb_utils.Tensor("INPUT0", x.as_numpy())],
                                                 requested_output_names=["OUTPUT0"])
                resp = call.exec()
                if resp.has_error():
                    responses.append(pb_utils.InferenceResponse(error=resp.error()))
                    continue
                y = pb_utils.get_output_tensor_by_name(resp, "OUTPUT0").as_numpy()
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y * 10)]))
            return responses
"""


# Triton's async BLS form: ``async def execute`` awaiting ``async_exec`` calls gathered together; a call to a model
# that does not exist comes back as an error in its response, as with exec()
BLS_ASYNC = """
    import asyncio
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        async def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
                calls = [pb_utils.InferenceRequest(model_name=name, inputs=[pb_utils.Tensor("INPUT0", x * k)],
                                                   requested_output_names=["OUTPUT0"])
                         for name, k in (("onnx_mlp", 1), ("onnx_mlp", 2), ("missing", 1))]
                first, second, missing = await asyncio.gather(*[c.async_exec() for c in calls])
                assert missing.has_error() and "missing" in missing.error().message()
                y = [pb_utils.get_output_tensor_by_name(r, "OUTPUT0").as_numpy() for r in (first, second)]
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y[0] + y[1])]))
            return responses
"""


def _config(inputs: str, outputs_: str, extra: str = "", mbs: int = 0) -> str:
    return f'backend: "python"\nmax_batch_size: {mbs}\ninput [ {inputs} ]\noutput [ {outputs_} ]\n{extra}'


def test_process_isolation_runs_the_model_in_a_child(tmp_path):
    write_python_model(tmp_path, "pid", PID, _config('{ name: "X" data_type: TYPE_INT32 dims: [1] }',
                                                     '{ name: "PID" data_type: TYPE_INT64 dims: [1] }', ISOLATED))
    write_python_model(tmp_path, "scale", PY_SCALE, _config(
        '{ name: "IN" data_type: TYPE_FP32 dims: [3] }',
        '{ name: "OUT" data_type: TYPE_FP32 dims: [3] }, { name: "BATCH" data_type: TYPE_INT32 dims: [1] }',
        ISOLATED + "dynamic_batching { }", mbs=8))
    write_python_model(tmp_path, "dec", PY_DECOUPLED, _config(
        '{ name: "COUNT" data_type: TYPE_INT32 dims: [1] }', '{ name: "OUT" data_type: TYPE_INT32 dims: [1] }',
        ISOLATED + "model_transaction_policy { decoupled: true }"))
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)

    async def main():
        async with serving(tmp_path) as server:
            pid = outputs(await server.infer(request("pid", X=np.array([1], np.int32))))["PID"][0]
            scaled = outputs(await server.infer(request("scale", IN=x)))["OUT"]
            streamed = [outputs(r)["OUT"][0] async for r in server.infer_stream(request("dec", COUNT=np.array([3], np.int32)))]
            await expect_error("internal", _drain(server.infer_stream(request("dec", COUNT=np.array([-1], np.int32)))),
                               "COUNT must be >= 0")
            await expect_error("invalid_argument", server.infer(request("scale", IN=np.full((1, 3), np.nan, np.float32))),
                               "IN must be finite")
            return pid, scaled, streamed

    pid, scaled, streamed = run(main())
    assert pid != os.getpid()
    np.testing.assert_allclose(scaled, x * 3 - 1, rtol=1e-6)
    assert streamed == [0, 1, 2]


async def _drain(stream):
    return [r async for r in stream]


def test_bls_calls_another_model(tmp_path):
    weights = add_onnx_mlp(tmp_path)[1]
    io = ('{ name: "X" data_type: TYPE_FP32 dims: [4] }', '{ name: "Y" data_type: TYPE_FP32 dims: [3] }')
    write_python_model(tmp_path, "bls", BLS, _config(*io, mbs=4))
    write_python_model(tmp_path, "bls_async", BLS_ASYNC, _config(*io, mbs=4))
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)

    async def main():
        async with serving(tmp_path) as server:
            return [outputs(await server.infer(request(name, X=x)))["Y"] for name in ("bls", "bls_async")]

    plain, gathered = run(main())
    np.testing.assert_allclose(plain, mlp_reference(x, weights) * 10, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gathered, mlp_reference(x, weights) + mlp_reference(x * 2, weights), rtol=1e-5,
                               atol=1e-4)


def test_user_code_failures_name_the_file(tmp_path):
    io = ('{ name: "X" data_type: TYPE_INT32 dims: [1] }', '{ name: "Y" data_type: TYPE_INT32 dims: [1] }')
    write_python_model(tmp_path, "syntax", "def broken(:\n", _config(*io))
    write_python_model(tmp_path, "noclass", "X = 1\n", _config(*io))
    write_python_model(tmp_path, "badinit", "class TritonPythonModel:\n    def initialize(self, args):\n"
                       "        raise RuntimeError('no weights here')\n", _config(*io))
    write_python_model(tmp_path, "wrongcount", "class TritonPythonModel:\n    def execute(self, requests):\n"
                       "        return []\n", _config(*io))
    write_python_model(tmp_path, "raiser", "class TritonPythonModel:\n    def execute(self, requests):\n"
                       "        raise ValueError('bad day')\n", _config(*io))
    write_python_model(tmp_path, "badiso", "class TritonPythonModel:\n    pass\n", _config(
        *io, 'parameters { key: "EXECUTION_ISOLATION" value: { string_value: "container" } }'))
    write_python_model(tmp_path, "childinit", "class TritonPythonModel:\n    def initialize(self, args):\n"
                       "        raise RuntimeError('child says no')\n", _config(*io, ISOLATED))

    async def main():
        async with serving(tmp_path) as server:
            index = {e["name"]: e for e in server.repository_index()}
            await expect_error("internal", server.infer(request("wrongcount", X=np.array([1], np.int32))),
                               "model 'wrongcount'", "one response per request (1), got 0")
            for _ in range(2):  # the model keeps serving after its execute() raised
                await expect_error("internal", server.infer(request("raiser", X=np.array([1], np.int32))),
                                   "model 'raiser' version 1: ValueError: bad day")
            return index

    index = run(main())
    for name, what in (("syntax", "import failed: SyntaxError"), ("noclass", "no class TritonPythonModel"),
                       ("badinit", "initialize() failed: RuntimeError: no weights here"),
                       ("badiso", "field 'parameters.EXECUTION_ISOLATION': 'container' is not one of"),
                       ("childinit", "RuntimeError: child says no")):
        assert index[name]["state"] == "UNAVAILABLE", (name, index[name])
        assert what in index[name]["reason"] and str(tmp_path / name) in index[name]["reason"], (name, index[name])
    assert index["wrongcount"]["state"] == "READY" and index["raiser"]["state"] == "READY"


AUTO = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(auto_complete_model_config):
            auto_complete_model_config.add_input({"name": "A", "data_type": "TYPE_INT64", "dims": [2]})
            auto_complete_model_config.add_output({"name": "B", "data_type": "TYPE_INT64", "dims": [2]})
            auto_complete_model_config.set_max_batch_size(4)
            auto_complete_model_config.set_dynamic_batching()
            return auto_complete_model_config

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "B", pb_utils.get_input_tensor_by_name(r, "A").as_numpy() * 2)]) for r in requests]
"""


def test_auto_complete_config_of_a_python_model(tmp_path):
    (tmp_path / "auto" / "1").mkdir(parents=True)
    (tmp_path / "auto" / "1" / "model.py").write_text(AUTO.replace("\n    ", "\n"))
    write_python_model(tmp_path, "clash", AUTO, _config('{ name: "A" data_type: TYPE_FP32 dims: [2] }',
                                                        '{ name: "B" data_type: TYPE_INT64 dims: [2] }'))

    async def main():
        async with serving(tmp_path) as server:
            a = np.array([[1, 2], [3, 4]], np.int64)
            out = outputs(await server.infer(request("auto", A=a)))["B"]
            return out, server.model_config("auto"), {e["name"]: e for e in server.repository_index()}

    out, cfg, index = run(main())
    np.testing.assert_array_equal(out, [[2, 4], [6, 8]])
    assert cfg["max_batch_size"] == 4 and cfg["backend"] == "python" and "dynamic_batching" in cfg
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [("A", "TYPE_INT64", [2])]
    reason = index["clash"]["reason"]
    assert index["clash"]["state"] == "UNAVAILABLE"
    assert "field 'auto_complete_config'" in reason and "data_type='TYPE_INT64'" in reason and "TYPE_FP32" in reason


def test_model_py_imports_a_module_beside_it(tmp_path):
    code = """
        import numpy as np
        import triton_python_backend_utils as pb_utils
        from helper_for_double import double


        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "Y", double(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()))]) for r in requests]
    """
    io = ('{ name: "X" data_type: TYPE_INT32 dims: [1] }', '{ name: "Y" data_type: TYPE_INT32 dims: [1] }')
    for name, extra in (("inproc", ""), ("child", ISOLATED)):
        write_python_model(tmp_path, name, code, _config(*io, extra))
        (tmp_path / name / "1" / "helper_for_double.py").write_text("def double(x):\n    return x * 2\n")

    async def main():
        async with serving(tmp_path) as server:
            return [int(outputs(await server.infer(request(m, X=np.array([21], np.int32))))["Y"][0])
                    for m in ("inproc", "child")]

    assert run(main()) == [42, 42]
