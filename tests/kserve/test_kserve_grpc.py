"""KServe v2 over gRPC, driven by NVIDIA's tritonclient.grpc (sync, streaming and aio clients)."""

from __future__ import annotations

import asyncio
import json
import queue

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from _model_repos import mlp_reference


@pytest.fixture(scope="module")
def client(kserve):
    c = grpcclient.InferenceServerClient(kserve.grpc)
    yield c
    c.close()


def _input(name, x, datatype="FP32"):
    inp = grpcclient.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def _rows(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def _status(err: InferenceServerException) -> str:
    return str(err.status()).rsplit(".", 1)[-1]


# ------------------------------------------------------------------------------------------ health + metadata
def test_health_and_metadata(client):
    assert client.is_server_live()
    assert not client.is_server_ready()  # strict readiness (the default): 'broken' failed to load
    assert client.is_model_ready("onnx_mlp") and client.is_model_ready("onnx_mlp", "1")
    assert not client.is_model_ready("no_such_model")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "strataserve" and "binary_tensor_data" in meta["extensions"]
    m = client.get_model_metadata("onnx_mlp", as_json=True)
    assert m["name"] == "onnx_mlp" and m["versions"] == ["1"]
    assert m["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1", "4"]}]
    cfg = client.get_model_config("onnx_mlp", as_json=True)["config"]
    assert cfg["name"] == "onnx_mlp" and cfg["max_batch_size"] == 8
    assert cfg["input"][0]["data_type"] == "TYPE_FP32" and cfg["input"][0]["dims"] == ["4"]
    assert "max_queue_delay_microseconds" in cfg["dynamic_batching"]
    ens = client.get_model_config("pipeline").config  # the protobuf message as tritonclient decodes it
    assert [s.model_name for s in ens.ensemble_scheduling.step] == ["onnx_mlp", "torch_affine", "py_scale"]
    assert client.get_model_config("py_decoupled").config.model_transaction_policy.decoupled


# ------------------------------------------------------------------------------------------ inference
def test_onnx_torch_python_ensemble(client, kserve):
    x4, x3 = _rows(3, 4, 11), _rows(2, 3, 12)
    w = kserve.refs["onnx_weights"][1]
    res = client.infer("onnx_mlp", [_input("INPUT0", x4)], request_id="g1",
                       outputs=[grpcclient.InferRequestedOutput("OUTPUT0")])
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), mlp_reference(x4, w), rtol=1e-5, atol=1e-5)
    assert res.get_response().id == "g1" and res.get_response().model_version == "1"
    res = client.infer("torch_affine", [_input("INPUT__0", x3)], model_version="1")
    np.testing.assert_allclose(res.as_numpy("OUTPUT__0"), kserve.refs["torch_module"](torch.from_numpy(x3)).numpy(), rtol=1e-6)
    res = client.infer("py_scale", [_input("IN", x3)], compression_algorithm="gzip")
    np.testing.assert_allclose(res.as_numpy("OUT"), x3 * 3 - 1, rtol=1e-6)
    res = client.infer("pipeline", [_input("X", x4)])
    h = mlp_reference(x4, w)
    np.testing.assert_allclose(res.as_numpy("A"), np.maximum(h, 0) * 2 + 1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.as_numpy("S"), h * 3 - 1, rtol=1e-5, atol=1e-5)
    res = client.infer("py_text", [_input("text_input", np.array([b"gRPC"], dtype=object), "BYTES")])
    assert res.as_numpy("text_output").tolist() == [b"GRPC"]


def test_decoupled_stream_several_responses_per_request(client):
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("py_decoupled", [_input("COUNT", np.array([3], np.int32), "INT32")], request_id="a")
        client.async_stream_infer("py_decoupled", [_input("COUNT", np.array([2], np.int32), "INT32")], request_id="b",
                                  enable_empty_final_response=True)
        client.async_stream_infer("no_such_model", [_input("COUNT", np.array([1], np.int32), "INT32")], request_id="c")
        client.async_stream_infer("py_scale", [_input("IN", np.ones((1, 3), np.float32))], request_id="d")
        client.async_stream_infer("py_decoupled", [_input("COUNT", np.array([-1], np.int32), "INT32")], request_id="e")
        # a: 3 responses; b: 2 + the empty final one; c: one error; d: one response; e: the model's error
        items = [got.get(timeout=30) for _ in range(3 + 3 + 1 + 1 + 1)]
    finally:
        client.stop_stream()
    errors = sorted(e.message() for _, e in items if e is not None)
    assert len(errors) == 2 and "COUNT must be >= 0" in errors[0] and "no_such_model" in errors[1]
    by_id: dict[str, list] = {}
    for result, error in items:
        if error is None:
            by_id.setdefault(result.get_response().id, []).append(result)
    assert [r.as_numpy("OUT").tolist() for r in by_id["a"]] == [[0], [1], [2]]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in by_id["b"]]
    assert finals == [False, False, True] and by_id["b"][-1].as_numpy("OUT") is None
    assert [r.as_numpy("OUT").tolist() for r in by_id["b"][:2]] == [[0], [1]]
    np.testing.assert_allclose(by_id["d"][0].as_numpy("OUT"), np.full((1, 3), 2.0))


def test_aio_client_infer_and_stream(kserve):
    async def run():
        async with grpcaio.InferenceServerClient(kserve.grpc) as c:
            x = _rows(2, 3, 13)
            inp = grpcaio.InferInput("IN", [2, 3], "FP32")
            inp.set_data_from_numpy(x)
            res = await c.infer("py_scale", [inp])
            np.testing.assert_allclose(res.as_numpy("OUT"), x * 3 - 1, rtol=1e-6)

            async def requests():
                count = grpcaio.InferInput("COUNT", [1], "INT32")
                count.set_data_from_numpy(np.array([4], np.int32))
                yield {"model_name": "py_decoupled", "inputs": [count], "request_id": "s"}

            outs = []
            async for result, error in c.stream_infer(requests()):
                assert error is None
                outs.append(int(result.as_numpy("OUT")[0]))
                if len(outs) == 4:
                    break
            return outs

    assert asyncio.run(run()) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------ stats + repository
def test_statistics_and_repository(client, kserve):
    client.infer("py_scale", [_input("IN", _rows(2, 3, 14))])
    stats = client.get_inference_statistics("py_scale", as_json=True)["model_stats"]
    assert stats[0]["name"] == "py_scale" and int(stats[0]["inference_count"]) >= 2
    assert int(stats[0]["inference_stats"]["success"]["count"]) >= 1
    msg = client.get_inference_statistics("py_scale").model_stats[0]
    assert msg.execution_count >= 1 and msg.batch_stats[0].batch_size >= 1
    assert {"onnx_mlp", "pipeline"} <= {m.name for m in client.get_inference_statistics().model_stats}

    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["onnx_mlp"]["state"] == "READY"
    client.unload_model("onnx_spare")
    assert not client.is_model_ready("onnx_spare")
    with pytest.raises(InferenceServerException) as err:
        client.infer("onnx_spare", [_input("INPUT0", _rows(1, 4, 0))])
    assert _status(err.value) in ("UNAVAILABLE", "NOT_FOUND")
    client.load_model("onnx_spare")
    x = _rows(1, 4, 15)
    res = client.infer("onnx_spare", [_input("INPUT0", x)])
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), mlp_reference(x, kserve.refs["spare_weights"][1]), rtol=1e-5, atol=1e-5)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("no_such_model")
    assert "no_such_model" in err.value.message()


def test_unload_dependents_and_config_override_reach_the_server(client):
    # A step model unloaded: the ensemble stays loaded but is not ready, the index says why.
    client.unload_model("torch_affine", unload_dependents=True)
    try:
        assert not client.is_model_ready("torch_affine") and not client.is_model_ready("pipeline")
        assert client.is_model_ready("onnx_mlp")
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["pipeline"].state == "UNAVAILABLE" and "model 'torch_affine'" in index["pipeline"].reason
        # unload_dependents on the ensemble (Triton's meaning): the step loaded only for it goes too; the steps
        # loaded explicitly (--load-model *) stay.
        client.unload_model("pipeline")
        client.load_model("pipeline")  # loads torch_affine for it
        assert client.is_model_ready("pipeline") and client.is_model_ready("torch_affine")
        client.unload_model("pipeline", unload_dependents=True)
        assert not client.is_model_ready("pipeline") and not client.is_model_ready("torch_affine")
        assert client.is_model_ready("onnx_mlp") and client.is_model_ready("py_scale")
    finally:
        client.load_model("torch_affine")
        client.load_model("pipeline")
    assert client.is_model_ready("pipeline") and client.is_model_ready("torch_affine")

    cfg = client.get_model_config("onnx_spare", as_json=True)["config"]
    client.load_model("onnx_spare", config=json.dumps({**cfg, "max_batch_size": 4}))
    try:
        assert client.get_model_config("onnx_spare").config.max_batch_size == 4
    finally:
        client.load_model("onnx_spare")
    assert client.get_model_config("onnx_spare").config.max_batch_size == 8


# ------------------------------------------------------------------------------------------ bad inputs
def test_bad_inputs_and_server_keeps_serving(client, kserve):
    good = _rows(1, 4, 16)
    cases = [
        (lambda: client.infer("no_such_model", [_input("INPUT0", good)]), "NOT_FOUND", "no_such_model"),
        (lambda: client.infer("onnx_mlp", [_input("INPUT0", good)], model_version="5"), "NOT_FOUND", "5"),
        (lambda: client.infer("onnx_mlp", [_input("OTHER", good)]), "INVALID_ARGUMENT", "OTHER"),
        (lambda: client.infer("onnx_mlp", [_input("INPUT0", good.astype(np.float64), "FP64")]), "INVALID_ARGUMENT", "FP64"),
        (lambda: client.infer("onnx_mlp", [_input("INPUT0", _rows(1, 5, 0))]), "INVALID_ARGUMENT", "INPUT0"),
        (lambda: client.infer("py_decoupled", [_input("COUNT", np.array([1], np.int32), "INT32")]), "INVALID_ARGUMENT", "ModelStreamInfer"),
        (lambda: client.get_model_metadata("no_such_model"), "NOT_FOUND", "no_such_model"),
        (lambda: client.get_model_config("no_such_model"), "NOT_FOUND", "no_such_model"),
        (lambda: client.infer("broken", [_input("INPUT0", good)]), "UNAVAILABLE", "model.onnx"),
    ]
    for call, status, needle in cases:
        with pytest.raises(InferenceServerException) as err:
            call()
        assert _status(err.value) == status, err.value
        assert needle in err.value.message()
    # a priority outside py_seq's 2 levels is served at the default level (Triton's SetPriority), not refused
    res = client.infer("py_seq", [_input("SLEEP_MS", np.zeros((1, 1), np.float32))], priority=3)
    assert res.as_numpy("SEQ").shape == (1, 1)
    # missing input: a request with no tensors at all
    with pytest.raises(InferenceServerException) as err:
        client.infer("onnx_mlp", [])
    assert _status(err.value) == "INVALID_ARGUMENT" and "INPUT0" in err.value.message()
    # raw bytes that do not match the declared shape: declare [1, 4] but send 3 floats
    bad = grpcclient.InferInput("INPUT0", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
    bad.set_shape([1, 4])
    with pytest.raises(InferenceServerException) as err:
        client.infer("onnx_mlp", [bad])
    assert _status(err.value) == "INVALID_ARGUMENT" and "needs 16 bytes" in err.value.message()
    # extensions this server lacks: refused, not ignored (a client would read a region nobody wrote)
    shm = _input("INPUT0", good)
    shm.set_shared_memory("region0", 16)
    out = grpcclient.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("region1", 12)
    for inputs, outputs, needle in (([shm], None, "shared-memory"), ([_input("INPUT0", good)], [out], "shared-memory"),
                                    ([_input("INPUT0", good)], [grpcclient.InferRequestedOutput("OUTPUT0", class_count=2)],
                                     "classification"),
                                    ([_input("INPUT0", good)], [grpcclient.InferRequestedOutput("OUTPUT0")] * 2, "twice")):
        with pytest.raises(InferenceServerException) as err:
            client.infer("onnx_mlp", inputs, outputs=outputs)
        assert _status(err.value) == "INVALID_ARGUMENT" and needle in err.value.message()
    res = client.infer("onnx_mlp", [_input("INPUT0", good)])
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), mlp_reference(good, kserve.refs["onnx_weights"][1]), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ raw protocol
def test_typed_contents_and_malformed_messages(kserve):
    """Messages tritonclient never builds (typed `contents`, inconsistent raw entries), sent with tritonclient's
    own generated stub so the wire format is the public protocol's."""
    import grpc
    from tritonclient.grpc import service_pb2 as tpb
    from tritonclient.grpc import service_pb2_grpc as tpb_grpc

    x = _rows(2, 3, 17)
    with grpc.insecure_channel(kserve.grpc) as channel:
        stub = tpb_grpc.GRPCInferenceServiceStub(channel)
        req = tpb.ModelInferRequest(model_name="py_scale")
        t = req.inputs.add(name="IN", datatype="FP32", shape=[2, 3])
        t.contents.fp32_contents.extend(x.reshape(-1).tolist())
        resp = stub.ModelInfer(req, timeout=30)
        out = {o.name: i for i, o in enumerate(resp.outputs)}
        got = np.frombuffer(resp.raw_output_contents[out["OUT"]], np.float32).reshape(2, 3)
        np.testing.assert_allclose(got, x * 3 - 1, rtol=1e-6)

        req = tpb.ModelInferRequest(model_name="py_text")
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"typed")
        resp = stub.ModelInfer(req, timeout=30)
        assert resp.raw_output_contents[0] == b"\x05\x00\x00\x00TYPED"

        bad = []
        req = tpb.ModelInferRequest(model_name="py_scale")
        req.inputs.add(name="IN", datatype="FP32", shape=[2, 3]).contents.fp32_contents.extend([1.0] * 5)
        bad.append((req, "holds 5 elements"))
        req = tpb.ModelInferRequest(model_name="py_scale")
        req.inputs.add(name="IN", datatype="FP32", shape=[1, 3])
        req.raw_input_contents.extend([b"\0" * 12, b"\0" * 4])
        bad.append((req, "raw_input_contents has 2 entries"))
        req = tpb.ModelInferRequest(model_name="py_scale")
        req.inputs.add(name="IN", datatype="FP16", shape=[1, 3])
        bad.append((req, "raw_input_contents"))
        req = tpb.ModelInferRequest(model_name="py_scale")
        req.inputs.add(name="IN", datatype="FP32", shape=[1, -3])
        req.raw_input_contents.append(b"")
        bad.append((req, "non-negative"))
        bad.append((tpb.ModelInferRequest(), "model_name is empty"))
        for req, needle in bad:
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert needle in err.value.details()
        assert stub.ServerLive(tpb.ServerLiveRequest(), timeout=30).live

        # a stream error carries the failing request's id
        req = tpb.ModelInferRequest(model_name="no_such_model", id="zz")
        replies = list(stub.ModelStreamInfer(iter([req]), timeout=30))
        assert len(replies) == 1 and "no_such_model" in replies[0].error_message
        assert replies[0].infer_response.id == "zz"


def test_bf16_raw_contents(client):
    """BF16 travels as raw contents (it has no typed field): torch's bfloat16 result comes back."""
    import ml_dtypes

    x = _rows(2, 3, 22).astype(ml_dtypes.bfloat16)
    res = client.infer("torch_affine_bf16", [_input("INPUT__0", x, "BF16")])
    want = (torch.relu(torch.tensor(x.astype(np.float32)).bfloat16()) * 2.0 + 1.0).float().numpy()
    got = res.as_numpy("OUTPUT__0")
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), want)
