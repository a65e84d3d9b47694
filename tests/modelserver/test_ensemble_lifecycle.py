"""Ensembles against their step models, as Triton does it: config validation at load (datatypes, shapes,
max_batch_size, intermediate tensors), readiness that follows the steps, unload_dependents, and unloads that
drain in the background without holding up other control calls."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _model_repos import add_onnx_mlp, mlp_reference, write_config, write_python_model
from ms_helpers import expect_error, outputs, request, run, serving

from strataserve.modelserver.server import ModelServer
from strataserve.types.tensors import ModelServerError

X4 = np.arange(8, dtype=np.float32).reshape(2, 4) / 8

IDENTITY = """
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                                .as_numpy())]) for r in requests]
"""


def add_identity(repo, name: str, datatype: str = "TYPE_FP32", dims: str = "[ 4 ]", mbs: int = 8) -> None:
    write_python_model(repo, name, IDENTITY, f"""
        backend: "python"
        max_batch_size: {mbs}
        input [ {{ name: "IN" data_type: {datatype} dims: {dims} }} ]
        output [ {{ name: "OUT" data_type: {datatype} dims: {dims} }} ]
    """)


def add_ens(repo, name: str, steps: list[tuple[str, str, str]], mbs: int = 8, x: str = "TYPE_FP32 dims: [ 4 ]",
            y: str = "TYPE_FP32 dims: [ 4 ]", keys: tuple[str, str] = ("IN", "OUT")) -> None:
    """An ensemble X -> steps -> Y; each step is (model, input tensor, output tensor)."""
    body = ",".join(f'{{ model_name: "{m}" input_map {{ key: "{keys[0]}" value: "{i}" }} '
                    f'output_map {{ key: "{keys[1]}" value: "{o}" }} }}' for m, i, o in steps)
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    write_config(repo / name, f"""
        platform: "ensemble"
        max_batch_size: {mbs}
        input [ {{ name: "X" data_type: {x} }} ]
        output [ {{ name: "Y" data_type: {y} }} ]
        ensemble_scheduling {{ step [ {body} ] }}
    """)


def _index(server) -> dict[tuple[str, str], tuple[str, str]]:
    return {(e["name"], e["version"]): (e["state"], e["reason"]) for e in server.repository_index()}


def _state(server, name: str) -> tuple[str, str]:
    entries = [v for (n, _), v in _index(server).items() if n == name]
    assert len(entries) == 1, entries
    return entries[0]


# ------------------------------------------------------------------------------------- 1: load-time validation
def test_ensemble_config_must_agree_with_its_step_models(tmp_path):
    weights = add_onnx_mlp(tmp_path)[1]  # INPUT0 FP32 [-1,4] -> OUTPUT0 FP32 [-1,3], max_batch_size 8
    add_identity(tmp_path, "ident_i32", "TYPE_INT32", "[ 3 ]")
    mlp = ("INPUT0", "OUTPUT0")
    add_ens(tmp_path, "bad_shape", [("onnx_mlp", "X", "Y")], x="TYPE_FP32 dims: [ 3 ]", y="TYPE_FP32 dims: [ 3 ]",
            keys=mlp)
    add_ens(tmp_path, "bad_dtype", [("onnx_mlp", "X", "Y")], x="TYPE_INT32 dims: [ 4 ]", y="TYPE_FP32 dims: [ 3 ]",
            keys=mlp)
    add_ens(tmp_path, "bad_out_dtype", [("onnx_mlp", "X", "Y")], y="TYPE_INT32 dims: [ 3 ]", keys=mlp)
    add_ens(tmp_path, "big_batch", [("onnx_mlp", "X", "Y")], mbs=16, y="TYPE_FP32 dims: [ 3 ]", keys=mlp)
    # an intermediate tensor: FP32 out of onnx_mlp, into a step that takes INT32
    (tmp_path / "bad_middle" / "1").mkdir(parents=True)
    write_config(tmp_path / "bad_middle", """
        platform: "ensemble"
        max_batch_size: 8
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "Y" data_type: TYPE_INT32 dims: [ 3 ] } ]
        ensemble_scheduling { step [
          { model_name: "onnx_mlp" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "H" } },
          { model_name: "ident_i32" input_map { key: "IN" value: "H" } output_map { key: "OUT" value: "Y" } } ] }
    """)
    # Accepted, as by Triton: a non-batching ensemble spelling the batch dim out over a batching step, and a
    # smaller ensemble max_batch_size than the step's.
    add_ens(tmp_path, "no_batch", [("onnx_mlp", "X", "Y")], mbs=0, x="TYPE_FP32 dims: [ -1, 4 ]",
            y="TYPE_FP32 dims: [ -1, 3 ]", keys=mlp)
    add_ens(tmp_path, "small_batch", [("onnx_mlp", "X", "Y")], mbs=4, y="TYPE_FP32 dims: [ 3 ]", keys=mlp)

    async def main():
        async with serving(tmp_path) as server:
            err = await expect_error("unavailable", server.infer(request("bad_out_dtype", X=X4)), "not ready")
            ok = [outputs(await server.infer(request(n, X=X4)))["Y"] for n in ("no_batch", "small_batch")]
            return _index(server), err, ok

    index, err, ok = run(main())
    expect = {  # ensemble -> (field, fragments of the reason)
        "bad_shape": ("step[0].input_map", ["ensemble 'bad_shape' step 0 (model 'onnx_mlp')", "tensor 'X'",
                                            "inconsistent shapes", "the ensemble input 'X' is FP32 [-1,3]",
                                            "input 'INPUT0' of model 'onnx_mlp' (step 0) is FP32 [-1,4]"]),
        "bad_dtype": ("step[0].input_map", ["ensemble 'bad_dtype' step 0 (model 'onnx_mlp')", "tensor 'X'",
                                            "inconsistent data types", "the ensemble input 'X' is INT32 [-1,4]",
                                            "input 'INPUT0' of model 'onnx_mlp' (step 0) is FP32 [-1,4]"]),
        "bad_out_dtype": ("step[0].output_map", ["ensemble 'bad_out_dtype' step 0 (model 'onnx_mlp')", "tensor 'Y'",
                                                 "inconsistent data types",
                                                 "the ensemble output 'Y' is INT32 [-1,3]",
                                                 "output 'OUTPUT0' of model 'onnx_mlp' (step 0) is FP32 [-1,3]"]),
        "big_batch": ("max_batch_size", ["ensemble 'big_batch' step 0 (model 'onnx_mlp')",
                                         "max_batch_size 16", "allows only 8"]),
        "bad_middle": ("step[1].input_map", ["ensemble 'bad_middle' step 1 (model 'ident_i32')", "tensor 'H'",
                                             "inconsistent data types",
                                             "output 'OUTPUT0' of model 'onnx_mlp' (step 0) is FP32 [-1,3]",
                                             "input 'IN' of model 'ident_i32' (step 1) is INT32 [-1,3]"]),
    }
    for name, (field, fragments) in expect.items():
        state, reason = index[(name, "")]
        assert state == "UNAVAILABLE", (name, state, reason)
        assert reason.startswith(str(tmp_path / name / "config.pbtxt")) and f"{field}'" in reason, reason
        for f in fragments:
            assert f in reason, (name, f, reason)
        assert (name, "1") not in index
    assert "inconsistent data types" in err.message  # never the FP32 outputs truncated to INT32
    for y in ok:
        np.testing.assert_allclose(y, mlp_reference(X4, weights), rtol=1e-5, atol=1e-5)
    assert index[("no_batch", "1")] == ("READY", "") and index[("small_batch", "1")] == ("READY", "")


def test_ensemble_refuses_to_cast_an_output_of_another_datatype(tmp_path):
    """The run-time guard behind load-time validation: a step answering FP32 for an INT32 ensemble output is an
    error, not values truncated by a cast."""
    from strataserve.modelserver.ensemble import EnsembleVersion
    from strataserve.modelserver.repository import Repository
    from strataserve.modelserver.stats import ModelStats
    from strataserve.types.tensors import InferResponse, InferTensor

    add_ens(tmp_path, "ens", [("m", "X", "Y")], y="TYPE_INT32 dims: [ 4 ]")
    spec = Repository(tmp_path).load_source("ens").spec

    async def step(sub):
        y = sub.inputs[0].data + 0.75
        return InferResponse("m", "1", sub.id, [InferTensor("OUT", "FP32", list(y.shape), y)])

    async def main():
        return await expect_error("internal", EnsembleVersion(spec, 1, ModelStats("ens", "1"), step).infer(
            request("ens", X=X4)), "output 'Y' was produced as FP32", "declares INT32")

    run(main())


# ----------------------------------------------------------------------- 3: readiness follows the step models
def test_ensemble_readiness_follows_its_step_models(tmp_path):
    add_identity(tmp_path, "a")
    add_ens(tmp_path, "ens", [("a", "X", "Y")])
    add_ens(tmp_path, "outer", [("ens", "X", "Y")], keys=("X", "Y"))  # an ensemble of the ensemble

    async def main():
        async with serving(tmp_path, control_mode="explicit", load_models=["outer"]) as server:
            assert all(server.model_ready(m) for m in ("a", "ens", "outer"))
            await server.unload("a")
            down = {m: _state(server, m) for m in ("a", "ens", "outer")}
            ready = {m: server.model_ready(m) for m in ("ens", "outer")}
            ready_index = {e["name"] for e in server.repository_index(ready_only=True)}
            errs = [await expect_error("unavailable", server.infer(request(m, X=X4)), f"model '{m}' is not ready")
                    for m in ("ens", "outer")]
            with pytest.raises(ModelServerError, match="model 'a' is not ready"):
                server.model_metadata("ens")
            server_ready = server.ready()
            await server.load("a")  # the step is back: so are the ensembles
            up = {m: _state(server, m) for m in ("ens", "outer")}
            y = outputs(await server.infer(request("outer", X=X4)))["Y"]
            # a step model loaded again with a config that no longer fits: the ensembles say why
            add_identity(tmp_path, "a", "TYPE_INT32")
            await server.load("a")
            changed = _state(server, "ens")
            ok_again = server.model_ready("outer")
            return down, ready, ready_index, errs, server_ready, up, y, changed, ok_again

    down, ready, ready_index, errs, server_ready, up, y, changed, ok_again = run(main())
    assert down["a"] == ("UNAVAILABLE", "unloaded")
    state, reason = down["ens"]
    assert state == "UNAVAILABLE" and "ensemble 'ens' step 0: model 'a' is not ready (unloaded)" in reason, reason
    state, reason = down["outer"]
    assert state == "UNAVAILABLE" and "ensemble 'outer' step 0: model 'ens' is not ready" in reason, reason
    assert ready == {"ens": False, "outer": False} and not ready_index & {"a", "ens", "outer"}
    assert "model 'a' is not ready (unloaded)" in errs[0].message
    # The server itself stays ready, as for a model that failed to load (and as Triton's, whose ensemble then
    # reads "unloaded", which strict readiness ignores): one model's state must not take every model down.
    assert server_ready
    assert up == {"ens": ("READY", ""), "outer": ("READY", "")}
    np.testing.assert_array_equal(y, X4)
    assert changed[0] == "UNAVAILABLE" and "tensor 'X' has inconsistent data types" in changed[1], changed
    assert "input 'IN' of model 'a' (step 0) is INT32" in changed[1] and not ok_again


# ------------------------------------------------------------------------------------- 2: unload_dependents
def test_unload_dependents_unloads_the_steps_loaded_for_an_ensemble(tmp_path):
    for m in ("a", "b", "c"):
        add_identity(tmp_path, m)
    add_ens(tmp_path, "ens1", [("a", "X", "P"), ("b", "P", "Q"), ("c", "Q", "Y")])
    add_ens(tmp_path, "ens2", [("b", "X", "Y")])
    names = ("a", "b", "c", "ens1", "ens2")

    async def main():
        async with serving(tmp_path, control_mode="explicit", load_models=["c"]) as server:
            ready = lambda: {m for m in names if server.model_ready(m)}  # noqa: E731
            await server.load("ens1")  # loads a and b for it; c was loaded explicitly
            await server.load("ens2")  # b is already there
            await server.unload("ens1")  # without unload_dependents: the steps stay
            plain = ready()
            await server.load("ens1")
            await server.unload("ens1", unload_dependents=True)
            after_ens1 = ready()  # a goes; b serves ens2; c was loaded explicitly
            await server.unload("ens2", unload_dependents=True)
            after_ens2 = ready()  # b is no longer needed
            # Unloading a step model, with or without unload_dependents, leaves the ensembles loaded but waiting.
            await server.load("ens2")
            await server.unload("b", unload_dependents=True)
            after_step = (ready(), _state(server, "ens2"))
            await server.load("b")
            return plain, after_ens1, after_ens2, after_step, ready()

    plain, after_ens1, after_ens2, after_step, last = run(main())
    assert plain == {"a", "b", "c", "ens2"}
    assert after_ens1 == {"b", "c", "ens2"}
    assert after_ens2 == {"c"}
    assert after_step[0] == {"c"} and after_step[1][0] == "UNAVAILABLE" and "model 'b'" in after_step[1][1]
    assert last == {"b", "c", "ens2"}


# ------------------------------------------------------------------------------ 5: unload drains in background
GATE = """
    import time
    import uuid
    from pathlib import Path
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.gate = Path(args["model_repository"]).parent / "gate_open"  # the test opens it
            self.token = uuid.uuid4().int % (1 << 62)  # tells this load of the model from the next one
            self.finalized = Path(args["model_repository"]).parent / f"finalized_{self.token}"

        def execute(self, requests):
            out = []
            for r in requests:
                if pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0] == 1:
                    deadline = time.monotonic() + 30
                    while not self.gate.exists() and time.monotonic() < deadline:
                        time.sleep(0.005)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([self.token], np.int64))]))
            return out

        def finalize(self):
            self.finalized.touch()
"""
GATE_CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "X" data_type: TYPE_INT64 dims: [ 1 ] } ]
    output [ { name: "Y" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""


def _x(v: int) -> np.ndarray:
    return np.array([v], np.int64)


async def _until(predicate) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


def test_unload_returns_while_requests_drain_and_other_control_calls_go_on(tmp_path):
    write_python_model(tmp_path, "gate", GATE, GATE_CONFIG)
    add_identity(tmp_path, "other")
    add_identity(tmp_path, "third")

    async def main():
        server = ModelServer(tmp_path, control_mode="explicit", load_models=["gate", "third"])
        await server.start()
        try:
            old = server._version("gate")
            slow = asyncio.create_task(server.infer(request("gate", X=_x(1))))  # blocks until the gate opens
            await _until(lambda: old.scheduler.running)
            control = [asyncio.create_task(c) for c in (server.unload("gate"), server.load("other"),
                                                          server.unload("third"))]
            done, _ = await asyncio.wait(control, timeout=10)
            assert done == set(control), "a control call waited for the drain of another model"
            for t in control:
                t.result()
            draining = _state(server, "gate")
            refused = await expect_error("unavailable", server.infer(request("gate", X=_x(0))), "unloaded")
            assert server.model_ready("other") and not server.model_ready("third") and not slow.done()
            # Loading the same model again while its old version drains: new requests go to the new version.
            await server.load("gate")
            new = outputs(await server.infer(request("gate", X=_x(0))))["Y"][0]
            assert not slow.done()
            (tmp_path / "gate_open").touch()
            first = outputs(await slow)["Y"][0]
            await _until(lambda: not server._drains)
            return draining, refused, first, new, _state(server, "gate"), old
        finally:
            (tmp_path / "gate_open").touch()
            await server.stop()

    draining, refused, first, new, state, old = run(main())
    assert draining[0] == "UNLOADING" and "unloaded" in draining[1], draining
    assert first != new  # the request in flight finished on the old version, the new one served the next
    assert (tmp_path / f"finalized_{first}").exists()  # the drained version was closed after its last request
    assert state == ("READY", "")  # the finished drain does not mark the reloaded model unloaded


def test_stop_waits_for_requests_of_unloaded_models(tmp_path):
    write_python_model(tmp_path, "gate", GATE, GATE_CONFIG)

    async def main():
        server = ModelServer(tmp_path, control_mode="explicit", load_models=["gate"])
        await server.start()
        try:
            old = server._version("gate")
            slow = asyncio.create_task(server.infer(request("gate", X=_x(1))))
            await _until(lambda: old.scheduler.running)
            await server.unload("gate")
            stopping = asyncio.create_task(server.stop())
            await asyncio.sleep(0.2)
            waiting = not stopping.done() and not slow.done()
            (tmp_path / "gate_open").touch()
            await stopping
            return waiting, outputs(await slow)["Y"][0], _state(server, "gate")
        finally:
            (tmp_path / "gate_open").touch()
            await server.stop()

    waiting, token, state = run(main())
    assert waiting and (tmp_path / f"finalized_{token}").exists()
    assert state == ("UNAVAILABLE", "unloaded")
