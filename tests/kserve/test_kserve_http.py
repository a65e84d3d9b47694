"""KServe v2 over HTTP, driven by NVIDIA's tritonclient.http (plus raw httpx where the client has no call)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from _model_repos import mlp_reference


@pytest.fixture(scope="module")
def client(kserve):
    c = httpclient.InferenceServerClient(kserve.http)
    yield c
    c.close()


def _infer(client, model, name, x, datatype="FP32", binary=True, outputs=None, **kw):
    inp = httpclient.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x, binary_data=binary)
    outs = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs] if outputs else None
    return client.infer(model, [inp], outputs=outs, **kw)


def _rows(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


# ------------------------------------------------------------------------------------------ health + metadata
def test_health_and_server_metadata(client):
    assert client.is_server_live()
    assert not client.is_server_ready()  # strict readiness (the default): 'broken' failed to load
    meta = client.get_server_metadata()
    assert meta["name"] == "strataserve"
    assert {"binary_tensor_data", "statistics", "model_repository"} <= set(meta["extensions"])


def test_model_metadata_and_config(client):
    assert client.is_model_ready("onnx_mlp") and client.is_model_ready("onnx_mlp", "1")
    assert not client.is_model_ready("no_such_model")
    meta = client.get_model_metadata("onnx_mlp")
    assert meta["name"] == "onnx_mlp" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 3]}]
    assert client.get_model_metadata("onnx_mlp", "1")["versions"] == ["1"]
    cfg = client.get_model_config("py_scale")
    assert cfg["name"] == "py_scale" and cfg["max_batch_size"] == 16
    assert [o["name"] for o in cfg["output"]] == ["OUT", "BATCH"]
    assert client.get_model_config("py_decoupled")["model_transaction_policy"]["decoupled"] is True


# ------------------------------------------------------------------------------------------ inference
@pytest.mark.parametrize("binary", [True, False])
def test_onnx_matches_numpy(client, kserve, binary):
    x = _rows(3, 4, 1)
    res = _infer(client, "onnx_mlp", "INPUT0", x, binary=binary, outputs=["OUTPUT0"], request_id="abc")
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), mlp_reference(x, kserve.refs["onnx_weights"][1]), rtol=1e-5, atol=1e-5)
    assert res.get_response()["id"] == "abc"
    assert res.get_response()["model_version"] == "1"
    out = res.get_output("OUTPUT0")
    assert ("binary_data_size" in out.get("parameters", {})) == binary


def test_torchscript_matches_module(client, kserve):
    x = _rows(2, 3, 2)
    res = _infer(client, "torch_affine", "INPUT__0", x, model_version="1")
    expected = kserve.refs["torch_module"](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(res.as_numpy("OUTPUT__0"), expected, rtol=1e-6)


def test_python_model_and_gzip_request(client):
    x = _rows(4, 3, 3)
    inp = httpclient.InferInput("IN", [4, 3], "FP32")
    inp.set_data_from_numpy(x)
    res = client.infer("py_scale", [inp], request_compression_algorithm="gzip")
    np.testing.assert_allclose(res.as_numpy("OUT"), x * 3 - 1, rtol=1e-6)
    assert res.as_numpy("BATCH").shape == (4, 1)


def test_ensemble_matches_its_steps(client, kserve):
    x = _rows(2, 4, 4)
    res = _infer(client, "pipeline", "X", x, binary=False)
    h = mlp_reference(x, kserve.refs["onnx_weights"][1])
    np.testing.assert_allclose(res.as_numpy("A"), np.maximum(h, 0) * 2 + 1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.as_numpy("S"), h * 3 - 1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_tensors(client, binary):
    inp = httpclient.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array(["héllo"], dtype=object), binary_data=binary)
    res = client.infer("py_text", [inp], outputs=[httpclient.InferRequestedOutput("text_output", binary_data=binary)])
    # tritonclient hands JSON BYTES back as str and binary BYTES as bytes, as it does with Triton
    assert res.as_numpy("text_output").tolist() == ["HÉLLO".encode() if binary else "HÉLLO"]


def test_generate_and_generate_stream(kserve):
    r = httpx.post(f"{kserve.base}/v2/models/py_text/generate", json={"text_input": "abc"})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "ABC"
    with httpx.stream("POST", f"{kserve.base}/v2/models/py_text/generate_stream", json={"text_input": "xy"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["text_output"] == "XY" and "[DONE]" not in events  # every event is JSON (Triton)
    # U+2028 / U+0085 (raw in JSON, line breaks to iter_lines) stay inside their event
    text = "x\u2028y\x85z\u2029"
    with httpx.stream("POST", f"{kserve.base}/v2/models/py_text/generate_stream", json={"text_input": text}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert len(lines) == 1 and json.loads(lines[0][6:])["text_output"] == text.upper()


def test_decoupled_streams_over_http(kserve):
    body = {"inputs": [{"name": "COUNT", "datatype": "INT32", "shape": [1], "data": [4]}], "id": "d1"}
    url = f"{kserve.base}/v2/models/py_decoupled/infer"
    with httpx.stream("POST", url, json=body, headers={"Accept": "text/event-stream"}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    outs = [json.loads(e)["outputs"][0]["data"] for e in events[:-1]]
    assert outs == [[0], [1], [2], [3]]
    # without SSE: every response in one JSON body
    r = httpx.post(url, json=body)
    assert r.status_code == 200
    doc = r.json()
    assert doc["id"] == "d1" and [x["outputs"][0]["data"] for x in doc["responses"]] == [[0], [1], [2], [3]]
    r = httpx.post(url, json={**body, "inputs": [{**body["inputs"][0], "data": [0]}]})
    assert r.status_code == 200 and r.json()["responses"] == []


def test_decoupled_via_generate_stream_and_model_errors(kserve, client):
    with httpx.stream("POST", f"{kserve.base}/v2/models/py_decoupled/generate_stream", json={"COUNT": 3}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e)["OUT"] for e in events] == [0, 1, 2]
    # an error the model itself sends: reported with its message, before any event, and the model keeps working
    body = {"inputs": [{"name": "COUNT", "datatype": "INT32", "shape": [1], "data": [-1]}]}
    for headers in ({}, {"Accept": "text/event-stream"}):
        r = httpx.post(f"{kserve.base}/v2/models/py_decoupled/infer", json=body, headers=headers)
        assert r.status_code >= 400 and "COUNT must be >= 0" in r.json()["error"]
    r = httpx.post(f"{kserve.base}/v2/models/py_decoupled/infer", json={"inputs": [{**body["inputs"][0], "data": [1]}]})
    assert [x["outputs"][0]["data"] for x in r.json()["responses"]] == [[0]]


def test_priority_reaches_the_scheduler(client):
    # py_seq has 2 priority levels; as in Triton, a priority outside them (or 0) is served at the default level
    for priority in (1, 3, 0):
        res = _infer(client, "py_seq", "SLEEP_MS", np.zeros((1, 1), np.float32), priority=priority, timeout=10_000_000)
        assert res.as_numpy("SEQ").shape == (1, 1)


# ------------------------------------------------------------------------------------------ stats + repository
def test_statistics_shape(client):
    _infer(client, "onnx_mlp", "INPUT0", _rows(2, 4, 5))
    stats = client.get_inference_statistics("onnx_mlp")["model_stats"]
    assert len(stats) == 1 and stats[0]["name"] == "onnx_mlp" and stats[0]["version"] == "1"
    s = stats[0]
    assert s["inference_count"] >= 2 and 1 <= s["execution_count"] <= s["inference_count"]
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert set(s["inference_stats"][key]) == {"count", "ns"}
    assert s["inference_stats"]["success"]["count"] >= 1
    assert all({"batch_size", "compute_infer"} <= set(b) for b in s["batch_stats"])
    every = client.get_inference_statistics()["model_stats"]
    assert {"onnx_mlp", "torch_affine", "py_scale", "pipeline"} <= {m["name"] for m in every}
    assert client.get_inference_statistics("onnx_mlp", "1")["model_stats"][0]["version"] == "1"


def test_repository_index_load_unload(client, kserve):
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["onnx_mlp"]["state"] == "READY" and index["onnx_spare"]["state"] == "READY"
    x = _rows(1, 4, 6)
    client.unload_model("onnx_spare")
    assert not client.is_model_ready("onnx_spare")
    ready = {m["name"] for m in httpx.post(f"{kserve.base}/v2/repository/index", json={"ready": True}).json()}
    assert "onnx_spare" not in ready and "onnx_mlp" in ready
    with pytest.raises(InferenceServerException) as err:
        _infer(client, "onnx_spare", "INPUT0", x)
    assert err.value.status() in ("503", "404")
    client.load_model("onnx_spare")
    res = _infer(client, "onnx_spare", "INPUT0", x)
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), mlp_reference(x, kserve.refs["spare_weights"][1]), rtol=1e-5, atol=1e-5)
    client.load_model("onnx_spare", config=json.dumps({"max_batch_size": 2, "input": [], "output": []}))
    try:
        assert client.get_model_config("onnx_spare")["max_batch_size"] == 2
        with pytest.raises(InferenceServerException) as err:
            _infer(client, "onnx_spare", "INPUT0", _rows(3, 4, 0))
        assert err.value.status() == "400"
    finally:
        client.load_model("onnx_spare")
    assert client.get_model_config("onnx_spare")["max_batch_size"] == 8
    r = httpx.post(f"{kserve.base}/v2/repository/models/onnx_spare/load", json={"parameters": []})
    assert r.status_code == 400 and "parameters" in r.json()["error"]
    r = httpx.post(f"{kserve.base}/v2/repository/models/../etc/load")
    assert r.status_code in (400, 404)
    r = httpx.post(f"{kserve.base}/v2/repository/models/no_such_model/load")
    assert r.status_code in (400, 404) and "no_such_model" in r.json()["error"]


# ------------------------------------------------------------------------------------------ bad inputs
def _v2(name, datatype, shape, data):
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


BAD_JSON = [
    ("no_such_model", "", {"inputs": [_v2("INPUT0", "FP32", [1, 4], [0.0] * 4)]}, 404, "no_such_model"),
    ("onnx_mlp", "7", {"inputs": [_v2("INPUT0", "FP32", [1, 4], [0.0] * 4)]}, 404, "7"),
    ("onnx_mlp", "", {"inputs": []}, 400, "INPUT0"),
    ("onnx_mlp", "", {"inputs": [_v2("WRONG", "FP32", [1, 4], [0.0] * 4)]}, 400, "WRONG"),
    ("onnx_mlp", "", {"inputs": [_v2("INPUT0", "INT32", [1, 4], [0] * 4)]}, 400, "INT32"),
    ("onnx_mlp", "", {"inputs": [_v2("INPUT0", "FP32", [1, 5], [0.0] * 5)]}, 400, "INPUT0"),
    ("onnx_mlp", "", {"inputs": [_v2("INPUT0", "FP32", [1, 4], [0.0] * 3)]}, 400, "holds 3 elements"),
    ("onnx_mlp", "", {"inputs": [_v2("INPUT0", "FP32", [1, 4], ["a"] * 4)]}, 400, "numbers"),
    ("onnx_mlp", "", {"inputs": [_v2("INPUT0", "FP32", [9, 4], [0.0] * 36)]}, 400, "INPUT0"),  # > max_batch_size
]


@pytest.mark.parametrize("model,version,body,status,needle", BAD_JSON)
def test_bad_json_requests(kserve, model, version, body, status, needle):
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    r = httpx.post(kserve.base + path, json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]


def test_bad_binary_and_malformed_bodies(kserve):
    url = f"{kserve.base}/v2/models/onnx_mlp/infer"
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                     "parameters": {"binary_data_size": 12}}]}).encode()
    r = httpx.post(url, content=header + b"\0" * 12, headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 400 and "needs 16 bytes" in r.json()["error"]
    r = httpx.post(url, content=header + b"\0" * 8, headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 400 and "runs past" in r.json()["error"]
    r = httpx.post(url, content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = httpx.post(url, content=b"{}", headers={"Inference-Header-Content-Length": "100"})
    assert r.status_code == 400
    r = httpx.post(f"{kserve.base}/v2/models/py_text/generate", json={"nope": "x"})  # not an input: a parameter
    assert r.status_code == 400 and "text_input" in r.json()["error"]
    r = httpx.get(f"{kserve.base}/v2/models/no_such_model")
    assert r.status_code == 404 and "no_such_model" in r.json()["error"]
    r = httpx.get(f"{kserve.base}/v2/models/no_such_model/config")
    assert r.status_code == 404


def test_model_that_failed_to_load(client, kserve):
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["broken"]["state"] == "UNAVAILABLE" and "model.onnx" in index["broken"]["reason"]
    r = httpx.post(f"{kserve.base}/v2/models/broken/infer", json={"inputs": []})
    assert r.status_code == 503 and "model.onnx" in r.json()["error"]
    assert httpx.get(f"{kserve.base}/v2/models/broken").status_code == 503
    assert not client.is_model_ready("broken")


def test_tritonclient_sees_errors_and_server_keeps_serving(client, kserve):
    with pytest.raises(InferenceServerException) as err:
        _infer(client, "onnx_mlp", "INPUT0", np.zeros((1, 4), np.float64), datatype="FP64")
    assert err.value.status() == "400" and "FP64" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        _infer(client, "onnx_mlp", "INPUT0", _rows(1, 4, 0), model_version="3")
    assert err.value.status() == "404"
    x = _rows(2, 4, 9)
    res = _infer(client, "onnx_mlp", "INPUT0", x)
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), mlp_reference(x, kserve.refs["onnx_weights"][1]), rtol=1e-5, atol=1e-5)


def test_large_tensors_binary_and_json(client):
    # 1.5 MB tensors: decoded and encoded on a worker thread (> OFFLOAD_BYTES); results must not change
    text = np.array(["z" * 1_500_000], dtype=object)
    for binary in (True, False):
        t = httpclient.InferInput("text_input", [1], "BYTES")
        t.set_data_from_numpy(text, binary_data=binary)
        res = client.infer("py_text", [t], outputs=[httpclient.InferRequestedOutput("text_output", binary_data=binary)])
        got = res.as_numpy("text_output")[0]
        assert (got.decode() if isinstance(got, bytes) else got) == "Z" * 1_500_000


def test_extensions_the_server_lacks_are_clear_errors(client, kserve):
    """Shared memory, trace, logging, classification: tritonclient gets a KServe error it can print (an unknown
    /v2 route used to answer an OpenAI-shaped body that tritonclient failed to turn into a message), and tensor
    parameters of those extensions are refused, not ignored."""
    for call in (client.get_system_shared_memory_status, client.get_cuda_shared_memory_status,
                 client.get_trace_settings, client.get_log_settings):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert err.value.status() == "404" and "extension" in str(err.value)
    r = httpx.get(f"{kserve.base}/v2/models/onnx_mlp/infer")
    assert r.status_code == 405 and isinstance(r.json()["error"], str)
    x = _rows(1, 4, 3)
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_shared_memory("region0", 16)
    out = httpclient.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("region1", 12)
    for inputs, outputs in (([inp], None), ([_input(x)], [out])):
        with pytest.raises(InferenceServerException) as err:
            client.infer("onnx_mlp", inputs, outputs=outputs)
        assert err.value.status() == "400" and "shared-memory" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.infer("onnx_mlp", [_input(x)], outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=2)])
    assert err.value.status() == "400" and "classification" in err.value.message()


def test_requested_outputs_none_or_twice(kserve):
    """As Triton: an empty ``outputs`` list asks for every output; one output asked twice is an error."""
    body = {"inputs": [_v2("INPUT0", "FP32", [1, 4], [0.5] * 4)]}
    url = f"{kserve.base}/v2/models/onnx_mlp/infer"
    every = httpx.post(url, json=body).json()["outputs"]
    assert httpx.post(url, json={**body, "outputs": []}).json()["outputs"] == every and len(every) == 1
    r = httpx.post(url, json={**body, "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]})
    assert r.status_code == 400 and "twice" in r.json()["error"]


def _input(x):
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def test_a_client_that_hangs_up_leaves_the_queue(kserve):
    """Six 300 ms requests to a one-instance model, their clients gone after ~0.45 s: the queued ones are dropped
    (as over gRPC), not run for nobody. SEQ counts the model's executions."""
    import socket
    import time

    url = f"{kserve.base}/v2/models/py_seq/infer"

    def seq() -> int:
        body = {"inputs": [_v2("SLEEP_MS", "FP32", [1, 1], [0.0])]}
        return int(httpx.post(url, json=body, timeout=30).json()["outputs"][0]["data"][0])

    body = json.dumps({"inputs": [_v2("SLEEP_MS", "FP32", [1, 1], [300.0])]}).encode()
    head = (f"POST /v2/models/py_seq/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    before = seq()
    host, port = kserve.http.split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(6)]
    for s in socks:
        s.sendall(head + body)
    time.sleep(0.45)
    for s in socks:
        s.close()
    time.sleep(1.5)
    ran = seq() - before - 1
    assert ran <= 3, ran  # the one running (and perhaps the next) finish; the rest leave with their clients


def test_bf16_tensors(client, kserve):
    """BF16 in and out through a BF16 TorchScript model, binary with tritonclient (ml_dtypes' bfloat16 is its type
    for it; it sends BF16 only binary) and as JSON numbers: the result is torch's own in bfloat16."""
    import ml_dtypes

    x = _rows(2, 3, 21).astype(ml_dtypes.bfloat16)
    want = (torch.relu(torch.tensor(x.astype(np.float32)).bfloat16()) * 2.0 + 1.0).float().numpy()
    got = _infer(client, "torch_affine_bf16", "INPUT__0", x, datatype="BF16").as_numpy("OUTPUT__0")
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == (2, 3)
    np.testing.assert_array_equal(got.astype(np.float32), want)
    r = httpx.post(f"{kserve.base}/v2/models/torch_affine_bf16/infer",
                   json={"inputs": [_v2("INPUT__0", "BF16", [2, 3], x.astype(np.float32).ravel().tolist())]})
    (out,) = r.json()["outputs"]
    assert out["datatype"] == "BF16" and out["data"] == want.ravel().tolist()
