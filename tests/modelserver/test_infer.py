"""Outputs of every backend (and an ensemble of them) equal the models' direct outputs; bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _model_repos import build_standard_repo, mlp_reference
from ms_helpers import expect_error, outputs, request, run, serving, tensor

from strataserve.types.tensors import InferRequest


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    refs = build_standard_repo(repo)
    return repo, refs


def test_every_backend_and_the_ensemble_match_direct_outputs(repo):
    repo, refs = repo
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    h = mlp_reference(x, refs["onnx_weights"][1])
    affine = refs["torch_module"](torch.from_numpy(h)).numpy()

    async def main():
        async with serving(repo) as server:
            onnx_out = outputs(await server.infer(request("onnx_mlp", INPUT0=x)))
            torch_out = outputs(await server.infer(request("torch_affine", INPUT__0=h)))
            py_out = outputs(await server.infer(request("py_scale", IN=h)))
            ens = await server.infer(request("pipeline", X=x))
            return onnx_out, torch_out, py_out, ens

    onnx_out, torch_out, py_out, ens = run(main())
    np.testing.assert_allclose(onnx_out["OUTPUT0"], h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(torch_out["OUTPUT__0"], affine, rtol=1e-6)
    np.testing.assert_allclose(py_out["OUT"], h * 3 - 1, rtol=1e-6)
    assert [t.name for t in ens.outputs] == ["A", "S"]
    assert ens.model_name == "pipeline" and ens.model_version == "1"
    np.testing.assert_allclose(outputs(ens)["A"], affine, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs(ens)["S"], h * 3 - 1, rtol=1e-5, atol=1e-4)


def test_requested_outputs_and_metadata(repo):
    repo, _ = repo
    x = np.ones((1, 3), np.float32)

    async def main():
        async with serving(repo) as server:
            req = request("py_scale", IN=x)
            req.requested_outputs = ["BATCH"]
            resp = await server.infer(req)
            return resp, server.model_metadata("py_scale"), server.model_config("pipeline"), server.server_metadata()

    resp, meta, cfg, smeta = run(main())
    assert [t.name for t in resp.outputs] == ["BATCH"] and resp.outputs[0].datatype == "INT32"
    assert meta == {"name": "py_scale", "versions": ["1"], "platform": "python",
                    "inputs": [{"name": "IN", "datatype": "FP32", "shape": [-1, 3]}],
                    "outputs": [{"name": "OUT", "datatype": "FP32", "shape": [-1, 3]},
                                {"name": "BATCH", "datatype": "INT32", "shape": [-1, 1]}]}
    assert cfg["platform"] == "ensemble" and cfg["max_batch_size"] == 8
    assert cfg["ensemble_scheduling"]["step"][1]["input_map"] == {"INPUT__0": "H"}
    assert cfg["input"][0]["dims"] == [4] and cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert smeta["name"] == "strataserve" and "statistics" in smeta["extensions"]


def test_decoupled_model_streams_several_responses(repo):
    repo, _ = repo

    async def main():
        async with serving(repo) as server:
            assert server.is_decoupled("py_decoupled") and not server.is_decoupled("py_scale")
            got = [outputs(r)["OUT"].tolist()
                   async for r in server.infer_stream(request("py_decoupled", COUNT=np.array([4], np.int32)))]
            none = [r async for r in server.infer_stream(request("py_decoupled", COUNT=np.array([0], np.int32)))]
            one = [r async for r in server.infer_stream(request("py_scale", IN=np.zeros((1, 3), np.float32)))]
            await expect_error("internal", _drain(server.infer_stream(
                request("py_decoupled", COUNT=np.array([-1], np.int32)))), "COUNT must be >= 0")
            await expect_error("failed_precondition", server.infer(
                request("py_decoupled", COUNT=np.array([2], np.int32))), "decoupled", "2 responses")
            return got, none, one

    got, none, one = run(main())
    assert got == [[0], [1], [2], [3]]
    assert none == [] and len(one) == 1


async def _drain(stream):
    return [r async for r in stream]


def test_generate_maps_fields_to_tensors(repo):
    repo, _ = repo

    async def main():
        async with serving(repo) as server:
            out = await server.generate("py_text", "", {"text_input": "hello world"}, {})
            await expect_error("invalid_argument", server.generate("py_text", "", {"prompt": "x"}, {}),
                               "no input 'prompt'")
            streamed = [c async for c in server.generate_stream("py_decoupled", "1", {"COUNT": 2}, {})]
            return out, streamed

    out, streamed = run(main())
    assert out == {"model_name": "py_text", "model_version": "1", "text_output": "HELLO WORLD"}
    assert [c["OUT"] for c in streamed] == [0, 1]


def test_bad_inputs_get_clear_errors_and_the_server_keeps_serving(repo):
    repo, _ = repo
    x = np.zeros((2, 4), np.float32)

    async def main():
        async with serving(repo) as server:
            await expect_error("not_found", server.infer(request("nope", INPUT0=x)), "unknown model 'nope'")
            await expect_error("not_found", server.infer(request("onnx_mlp", "7", INPUT0=x)), "no ready version 7")
            await expect_error("invalid_argument", server.infer(request("onnx_mlp", "x1", INPUT0=x)), "not a number")
            await expect_error("invalid_argument", server.infer(request("onnx_mlp", WRONG=x)), "no input 'WRONG'")
            await expect_error("invalid_argument", server.infer(InferRequest("onnx_mlp")), "missing inputs ['INPUT0']")
            await expect_error("invalid_argument", server.infer(request("onnx_mlp", INPUT0=x.astype(np.float64))),
                               "'INPUT0' has datatype FP64 but the model expects FP32")
            await expect_error("invalid_argument", server.infer(request("onnx_mlp", INPUT0=np.zeros((2, 5), np.float32))),
                               "shape [2, 5]", "[-1, 4]")
            await expect_error("invalid_argument", server.infer(request("onnx_mlp", INPUT0=np.zeros((9, 4), np.float32))),
                               "batch size 9", "max_batch_size (8)")
            bad = InferRequest("onnx_mlp", inputs=[tensor("INPUT0", np.zeros(7, np.float32))])
            bad.inputs[0].shape = [2, 4]
            await expect_error("invalid_argument", server.infer(bad), "7 elements", "needs 8")
            req = request("onnx_mlp", INPUT0=x)
            req.requested_outputs = ["NOPE"]
            await expect_error("invalid_argument", server.infer(req), "no outputs ['NOPE']")
            # A model's own error response, with its code.
            await expect_error("invalid_argument", server.infer(request("py_scale", IN=np.full((1, 3), np.inf, np.float32))),
                               "model 'py_scale'", "IN must be finite")
            # An ensemble step failure names the ensemble, the step and the model.
            await expect_error("invalid_argument", server.infer(request("pipeline", X=np.full((1, 4), np.nan, np.float32))),
                               "ensemble 'pipeline' step 2 (model 'py_scale')", "IN must be finite")
            ok = await server.infer(request("onnx_mlp", INPUT0=x))
            return ok, server.statistics("onnx_mlp")["model_stats"][0]

    ok, stats = run(main())
    assert ok.outputs[0].shape == [2, 3]
    assert stats["inference_stats"]["fail"]["count"] >= 7 and stats["inference_stats"]["success"]["count"] >= 1


def test_torch_export_program(tmp_path):
    from _model_repos import add_torch_export

    module = add_torch_export(tmp_path)
    x = np.random.default_rng(2).standard_normal((5, 3)).astype(np.float32)
    y = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)

    async def main():
        async with serving(tmp_path) as server:
            return outputs(await server.infer(request("torch_export", x=x, y=y)))

    got = run(main())
    want = [t.numpy() for t in module(torch.from_numpy(x), torch.from_numpy(y))]
    np.testing.assert_allclose(got["xy"], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["xsum"], want[1], rtol=1e-5, atol=1e-6)


def test_reshape_between_client_and_model_shapes(tmp_path):
    from _model_repos import add_onnx_mlp

    weights = add_onnx_mlp(tmp_path, config="""
        platform: "onnxruntime_onnx"
        max_batch_size: 4
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape: { shape: [ 4 ] } } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 3, 1 ] reshape: { shape: [ 3 ] } } ]
    """)[1]
    x = np.arange(12, dtype=np.float32).reshape(3, 2, 2) / 10

    async def main():
        async with serving(tmp_path) as server:
            meta = server.model_metadata("onnx_mlp")
            resp = await server.infer(request("onnx_mlp", INPUT0=x))
            await expect_error("invalid_argument", server.infer(request("onnx_mlp", INPUT0=x.reshape(3, 4))),
                               "[3, 4]", "[-1, 2, 2]")
            return meta, resp

    meta, resp = run(main())
    assert meta["inputs"][0]["shape"] == [-1, 2, 2] and meta["outputs"][0]["shape"] == [-1, 3, 1]
    assert resp.outputs[0].shape == [3, 3, 1]
    np.testing.assert_allclose(outputs(resp)["OUTPUT0"], mlp_reference(x.reshape(3, 4), weights)[:, :, None],
                               rtol=1e-5, atol=1e-5)
