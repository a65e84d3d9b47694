"""Repository and model control: version policy, explicit load/unload, poll mode, path escapes, bad configs."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
from _model_repos import (
    add_ensemble,
    add_onnx_mlp,
    add_python_scale,
    add_torchscript,
    mlp_reference,
    write_config,
    write_python_model,
)
from ms_helpers import expect_error, outputs, request, run, serving

from strataserve.modelserver.server import ModelServer

X = np.arange(8, dtype=np.float32).reshape(2, 4) / 8


def _index(server) -> dict[tuple[str, str], tuple[str, str]]:
    return {(e["name"], e["version"]): (e["state"], e["reason"]) for e in server.repository_index()}


@pytest.mark.parametrize("policy, ready", [
    ("", [3]),
    ("version_policy: { latest: { num_versions: 2 } }", [2, 3]),
    ("version_policy: { all: {} }", [1, 2, 3]),
    ("version_policy: { specific: { versions: [1, 3] } }", [1, 3]),
])
def test_version_policy(tmp_path, policy, ready):
    weights = add_onnx_mlp(tmp_path, versions=(1, 2, 3), config=f'platform: "onnxruntime_onnx"\n{policy}\n')

    async def main():
        async with serving(tmp_path) as server:
            meta = server.model_metadata("onnx_mlp")
            got = {v: outputs(await server.infer(request("onnx_mlp", str(v), INPUT0=X)))["OUTPUT0"] for v in ready}
            latest = await server.infer(request("onnx_mlp", INPUT0=X))
            missing = [v for v in (1, 2, 3) if v not in ready]
            for v in missing:
                await expect_error("not_found", server.infer(request("onnx_mlp", str(v), INPUT0=X)),
                                   f"no ready version {v}")
                assert not server.model_ready("onnx_mlp", str(v))
            return meta, got, latest

    meta, got, latest = run(main())
    assert meta["versions"] == [str(v) for v in ready]
    for v in ready:  # each version serves its own weights
        np.testing.assert_allclose(got[v], mlp_reference(X, weights[v]), rtol=1e-5, atol=1e-5)
    assert latest.model_version == str(max(ready))


def test_missing_specific_version_is_a_config_error(tmp_path):
    add_onnx_mlp(tmp_path, versions=(1,), config='version_policy: { specific: { versions: [4] } }')

    async def main():
        async with serving(tmp_path) as server:
            return _index(server)

    state, reason = run(main())[("onnx_mlp", "")]
    assert state == "UNAVAILABLE"
    assert "config.pbtxt: field 'version_policy.specific.versions'" in reason and "[4]" in reason


def test_onnx_without_config_is_auto_completed(tmp_path):
    weights = add_onnx_mlp(tmp_path, config=None)[1]

    async def main():
        async with serving(tmp_path) as server:
            resp = await server.infer(request("onnx_mlp", INPUT0=X))
            return server.model_config("onnx_mlp"), server.model_metadata("onnx_mlp"), resp

    cfg, meta, resp = run(main())
    assert cfg["max_batch_size"] == 4 and cfg["backend"] == "onnxruntime" and "dynamic_batching" in cfg
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [("INPUT0", "TYPE_FP32", [4])]
    assert [(o["name"], o["data_type"], o["dims"]) for o in cfg["output"]] == [("OUTPUT0", "TYPE_FP32", [3])]
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}]
    np.testing.assert_allclose(outputs(resp)["OUTPUT0"], mlp_reference(X, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config, field, what", [
    ('max_batch_size: 8\noptimisation { }', "optimisation", "has no field named"),
    ('max_batch_size: 8\nsequence_batching { }', "sequence_batching", "not supported"),
    ('input [ { name: "INPUT0" data_type: TYPE_FLOAT dims: [4] } ]', "data_type", "TYPE_FP32"),
    ('max_batch_size: -2', "max_batch_size", "negative"),
    ('max_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 16 ] }', "dynamic_batching.preferred_batch_size",
     "between 1 and max_batch_size"),
    ('input [ { name: "NOT_THERE" } ]', "input[0].name", "not an input of model.onnx"),
    ('input [ { name: "INPUT0" data_type: TYPE_INT64 } ]', "input[0].data_type", "model.onnx has TYPE_FP32"),
    ('name: "other"', "name", "differs from the model folder name"),
    ('max_batch_size: 4\ndynamic_batching { priority_levels: 2 default_priority_level: 3 }',
     "dynamic_batching.default_priority_level", "between 1 and priority_levels"),
])
def test_invalid_config_names_file_and_field_and_others_still_load(tmp_path, config, field, what):
    add_onnx_mlp(tmp_path, name="broken", config=config)
    add_onnx_mlp(tmp_path, name="fine")

    async def main():
        async with serving(tmp_path) as server:
            ok = await server.infer(request("fine", INPUT0=X))
            err = await expect_error("unavailable", server.infer(request("broken", INPUT0=X)), "not ready")
            return _index(server), ok, err

    index, ok, err = run(main())
    state, reason = index[("broken", "")]
    assert state == "UNAVAILABLE"
    assert reason.startswith(str(tmp_path / "broken" / "config.pbtxt")), reason
    assert f"field '{field}'" in reason and what in reason, reason
    assert index[("fine", "1")] == ("READY", "") and ok.outputs[0].shape == [2, 3]
    assert f"field '{field}'" in err.message


def test_config_without_model_file_support_is_refused(tmp_path):
    add_python_scale(tmp_path)
    (tmp_path / "py_scale" / "config.pbtxt").unlink()  # only ONNX can be auto-completed

    async def main():
        async with serving(tmp_path) as server:
            return _index(server)

    state, reason = run(main())[("py_scale", "")]
    assert state == "UNAVAILABLE" and "field 'config.pbtxt': is missing" in reason


def test_explicit_load_unload_and_config_override(tmp_path):
    weights = add_onnx_mlp(tmp_path)[1]
    add_torchscript(tmp_path)
    add_python_scale(tmp_path)
    add_ensemble(tmp_path)

    async def main():
        async with serving(tmp_path, control_mode="explicit") as server:
            assert _index(server)[("onnx_mlp", "")] == ("", "")  # listed, never loaded
            await expect_error("not_found", server.infer(request("onnx_mlp", INPUT0=X)), "unknown model")
            await server.load("onnx_mlp")
            assert server.model_ready("onnx_mlp")
            first = outputs(await server.infer(request("onnx_mlp", INPUT0=X)))["OUTPUT0"]
            await server.unload("onnx_mlp")
            assert not server.model_ready("onnx_mlp")
            assert _index(server)[("onnx_mlp", "1")] == ("UNAVAILABLE", "unloaded")
            await expect_error("unavailable", server.infer(request("onnx_mlp", INPUT0=X)), "unloaded")
            # Loading an ensemble loads its steps; unload_dependents takes it down with a step.
            await server.load("pipeline")
            assert all(server.model_ready(m) for m in ("pipeline", "onnx_mlp", "torch_affine", "py_scale"))
            await server.unload("py_scale", unload_dependents=True)
            assert not server.model_ready("pipeline") and server.model_ready("onnx_mlp")
            # A Triton-style JSON config override replaces config.pbtxt.
            override = json.dumps({"platform": "onnxruntime_onnx", "max_batch_size": 2,
                                   "instance_group": [{"count": 2, "kind": "KIND_CPU"}]})
            await server.load("onnx_mlp", {"config": override})
            cfg = server.model_config("onnx_mlp")
            await expect_error("invalid_argument", server.infer(request("onnx_mlp", INPUT0=np.zeros((3, 4), np.float32))),
                               "max_batch_size (2)")
            await expect_error("invalid_argument", server.load("onnx_mlp", {"config": "{not json"}),
                               "config override for model 'onnx_mlp'", "cannot parse the JSON")
            await expect_error("not_found", server.load("no_such_model"), "not in the model repository")
            return first, cfg

    first, cfg = run(main())
    np.testing.assert_allclose(first, mlp_reference(X, weights), rtol=1e-5, atol=1e-5)
    assert cfg["max_batch_size"] == 2 and cfg["instance_group"][0]["count"] == 2


def test_explicit_initial_models_and_none_mode_refuses_control(tmp_path):
    add_onnx_mlp(tmp_path, name="a")
    add_onnx_mlp(tmp_path, name="b")

    async def main():
        async with serving(tmp_path, control_mode="explicit", load_models=["b"]) as server:
            explicit = (server.model_ready("a"), server.model_ready("b"))
        async with serving(tmp_path) as server:
            await expect_error("failed_precondition", server.load("a"), "control mode is 'none'")
            await expect_error("failed_precondition", server.unload("a"), "explicit")
            none_mode = (server.model_ready("a"), server.model_ready("b"))
        return explicit, none_mode

    assert run(main()) == ((False, True), (True, True))


IDENTITY = """
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                                .as_numpy())]) for r in requests]
"""


def add_identity(repo, name: str = "ident", datatype: str = "TYPE_FP32", dims: str = "[ 4 ]", mbs: int = 8) -> None:
    write_python_model(repo, name, IDENTITY, f"""
        backend: "python"
        max_batch_size: {mbs}
        input [ {{ name: "IN" data_type: {datatype} dims: {dims} }} ]
        output [ {{ name: "OUT" data_type: {datatype} dims: {dims} }} ]
    """)


def test_ensemble_validation_errors(tmp_path):
    add_onnx_mlp(tmp_path)
    add_identity(tmp_path)
    cases = {
        "unknown_model": ('{ model_name: "ghost" input_map { key: "INPUT0" value: "X" } '
                          'output_map { key: "OUTPUT0" value: "Y" } }', "step[0].model_name", "'ghost'"),
        "twice": ('{ model_name: "onnx_mlp" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } },'
                  '{ model_name: "onnx_mlp" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } }',
                  "step[1].output_map", "'Y' is already produced by step 0"),
        "no_producer": ('{ model_name: "onnx_mlp" input_map { key: "INPUT0" value: "Z" } '
                        'output_map { key: "OUTPUT0" value: "Y" } }', "step[0].input_map", "'Z' is produced by no step"),
        "cycle": ('{ model_name: "ident" input_map { key: "IN" value: "P" } output_map { key: "OUT" value: "Q" } },'
                  '{ model_name: "ident" input_map { key: "IN" value: "Q" } output_map { key: "OUT" value: "P" } },'
                  '{ model_name: "onnx_mlp" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } }',
                  "ensemble_scheduling.step", "steps [0, 1] form a cycle"),
    }
    for name, (steps, _, _) in cases.items():
        write_config(tmp_path / name, f"""
            platform: "ensemble"
            max_batch_size: 8
            input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
            output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 3 ] }} ]
            ensemble_scheduling {{ step [ {steps} ] }}
        """)

    async def main():
        async with serving(tmp_path) as server:
            return _index(server)

    index = run(main())
    for name, (_, field, what) in cases.items():
        state, reason = index[(name, "")]
        assert state == "UNAVAILABLE" and field in reason and what in reason, (name, reason)
    assert index[("onnx_mlp", "1")] == ("READY", "")


def test_poll_mode_picks_up_new_changed_and_removed_models(tmp_path):
    w1 = add_onnx_mlp(tmp_path, name="a")[1]

    async def wait_for(predicate):
        for _ in range(400):
            if predicate():
                return
            await asyncio.sleep(0.025)
        raise AssertionError("poll mode did not pick up the change")

    async def main():
        async with serving(tmp_path, control_mode="poll", poll_interval_s=0.05) as server:
            assert server.model_ready("a") and not server.model_ready("b")
            add_onnx_mlp(tmp_path, name="b")
            await wait_for(lambda: server.model_ready("b"))
            w2 = add_onnx_mlp(tmp_path, name="a", versions=(2,), config=None)[2]  # a new version folder
            await wait_for(lambda: server.model_ready("a", "2"))
            new = outputs(await server.infer(request("a", INPUT0=X)))["OUTPUT0"]
            import shutil

            shutil.rmtree(tmp_path / "b")
            await wait_for(lambda: not server.model_ready("b"))
            await expect_error("not_found", server.infer(request("b", INPUT0=X)), "unknown model 'b'")
            # A broken config is reported, and picked up again once fixed.
            add_onnx_mlp(tmp_path, name="c", config='max_batch_size: "many"')
            await wait_for(lambda: _index(server).get(("c", ""), ("",))[0] == "UNAVAILABLE")
            write_config(tmp_path / "c", "max_batch_size: 2")
            await wait_for(lambda: server.model_ready("c"))
            return w2, new

    w2, new = run(main())
    np.testing.assert_allclose(new, mlp_reference(X, w2), rtol=1e-5, atol=1e-5)
    assert not np.allclose(new, mlp_reference(X, w1))


def test_names_escaping_the_repository_are_refused(tmp_path):
    repo = tmp_path / "repo"
    add_onnx_mlp(repo)
    outside = tmp_path / "outside"
    add_onnx_mlp(outside, name="secret")
    os.symlink(outside / "secret", repo / "link_out")

    async def main():
        async with serving(repo, control_mode="explicit") as server:
            for name in ("..", "../outside/secret", str(outside / "secret"), "a/b", "link_out", "", ".", "a\\b"):
                await expect_error("invalid_argument", server.load(name), "model repository")
            await expect_error("invalid_argument", server.unload("../outside"), "model repository")
            return _index(server)

    index = run(main())
    assert not any("secret" in name or name == "link_out" for name, _ in index)


def test_server_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="control mode"):
        ModelServer(tmp_path, control_mode="sometimes")
    with pytest.raises(ValueError, match="not a folder"):
        ModelServer(tmp_path / "missing")


def test_triton_only_tuning_blocks_are_ignored(tmp_path):
    weights = add_onnx_mlp(tmp_path, config="""
        platform: "onnxruntime_onnx"  # a config as Triton users write it
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_FP32 format: FORMAT_NONE dims: [ 4 ] } ]
        optimization { execution_accelerators { gpu_execution_accelerator: [
          { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } ] } }
        model_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 4 ]
          zero_data: true } } } ]
        response_cache { enable: true }
    """)[1]

    async def main():
        async with serving(tmp_path) as server:
            return await server.infer(request("onnx_mlp", INPUT0=X)), server.model_config("onnx_mlp")

    resp, cfg = run(main())
    np.testing.assert_allclose(outputs(resp)["OUTPUT0"], mlp_reference(X, weights), rtol=1e-5, atol=1e-5)
    assert "optimization" not in cfg and cfg["output"][0]["name"] == "OUTPUT0"


def test_config_json_form_prints_defaults_and_numbers(tmp_path):
    from _model_repos import PY_SCALE, write_python_model

    write_python_model(tmp_path, "py", PY_SCALE, """
        backend: "python"
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1, 3 ] }, { name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] } ]
        version_policy { specific { versions: [ 1 ] } }
    """)

    async def main():
        async with serving(tmp_path) as server:
            return server.model_config("py")

    cfg = run(main())
    assert cfg["name"] == "py" and cfg["max_batch_size"] == 0 and cfg["backend"] == "python"
    assert cfg["input"][0]["dims"] == [-1, 3] and cfg["version_policy"] == {"specific": {"versions": [1]}}
    assert [(g["name"], g["count"], g["kind"]) for g in cfg["instance_group"]] == [("py", 1, "KIND_CPU")]
    assert cfg["model_transaction_policy"] == {"decoupled": False} and cfg["parameters"] == {}


def test_bf16_on_onnxruntime_is_a_config_error(tmp_path):
    """onnxruntime's Python API passes no bfloat16 arrays: a BF16 tensor in an ONNX model's config is refused at
    load, naming the tensor and what to use instead (the pytorch and Python backends take BF16)."""
    from onnx import TensorProto, helper, save

    graph = helper.make_graph([helper.make_node("Identity", ["X"], ["Y"])], "g",
                              [helper.make_tensor_value_info("X", TensorProto.BFLOAT16, [2])],
                              [helper.make_tensor_value_info("Y", TensorProto.BFLOAT16, [2])])
    (tmp_path / "bf16" / "1").mkdir(parents=True)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "bf16" / "1" / "model.onnx"))
    write_config(tmp_path / "bf16", """
        name: "bf16"
        platform: "onnxruntime_onnx"
        input [ { name: "X" data_type: TYPE_BF16 dims: [ 2 ] } ]
        output [ { name: "Y" data_type: TYPE_BF16 dims: [ 2 ] } ]
    """)

    async def main():
        async with serving(tmp_path) as server:
            return _index(server)

    index = run(main())
    state, reason = next(v for k, v in index.items() if k[0] == "bf16")
    assert state == "UNAVAILABLE" and "'X'" in reason and "BF16" in reason and "pytorch" in reason, reason
