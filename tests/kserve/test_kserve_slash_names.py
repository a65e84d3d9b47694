"""A model name with slashes (an LLM served under its folder path, as the repository index lists it) is reachable
on every KServe route: over HTTP with the slashes as they are (tritonclient's ``quote`` keeps them) or as
``%2F``, and over gRPC, where names are plain strings."""
from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from _model_repos import add_onnx_mlp
from _ports import start_serve
from _tiny_models import make_tiny_checkpoint
from strataserve.api.kserve_http import make_kserve_router
from strataserve.api.kserve_paths import ModelPath, split_model_path
from strataserve.types.tensors import ModelServerError


@pytest.mark.parametrize("rest, want", [
    ("models/llama", ModelPath("models/llama", "", "")),
    ("models%2Fllama", ModelPath("models/llama", "", "")),
    ("/models/llama/ready", ModelPath("/models/llama", "", "ready")),
    ("models/llama/versions/2/config", ModelPath("models/llama", "2", "config")),
    ("models/llama/versions/2", ModelPath("models/llama", "2", "")),
    ("a/b/c/generate_stream", ModelPath("a/b/c", "", "generate_stream")),
    ("plain/infer", ModelPath("plain", "", "infer")),
    ("ready", ModelPath("ready", "", "")),  # a model named like a route word, alone: its metadata
    ("x%2Fready/stats", ModelPath("x/ready", "", "stats")),  # encoded: a name ending in a route word
    ("x%2Fversions%2F3/versions/1/ready", ModelPath("x/versions/3", "1", "ready")),
    ("m/trace/setting", ModelPath("m", "", "trace/setting")),
    ("", None),
])
def test_the_path_is_read_from_its_end(rest, want):
    assert split_model_path(rest) == want


class _Recorder:
    """A model-server surface that records each per-model call (method, name, version)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def is_decoupled(self, name: str, version: str = "") -> bool:
        return False

    async def generate_stream(self, name: str, version: str, inputs: dict, parameters: dict):
        self.calls.append(("generate_stream", name, version))
        yield {}

    def __getattr__(self, method: str):
        async def call(*args, **kwargs):
            self.calls.append((method, *args[:2]))
            if method == "infer":  # recorded; no tensors to answer with
                raise ModelServerError("not_found", "recorded")
            return {"ok": True}  # truthy: model_ready's "yes"

        return call


def test_every_route_reaches_a_name_with_slashes():
    ms = _Recorder()
    app = FastAPI()
    app.include_router(make_kserve_router(ms))
    client = TestClient(app, raise_server_exceptions=False)
    for name in ("models%2Fllama", "models/llama"):
        for v, vpath in (("", ""), ("3", "/versions/3")):
            base = f"/v2/models/{name}{vpath}"
            for suffix, method in (("", "model_metadata"), ("/ready", "model_ready"),
                                   ("/config", "model_config"), ("/stats", "statistics")):
                ms.calls.clear()
                assert client.get(base + suffix).status_code == 200, base + suffix
                assert ms.calls == [(method, "models/llama", v)]
            for suffix, method in (("/generate", "generate"), ("/generate_stream", "generate_stream")):
                ms.calls.clear()
                assert client.post(base + suffix, json={"text_input": "x"}).status_code == 200
                assert ms.calls == [(method, "models/llama", v)]
    body = {"inputs": [{"name": "I", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    ms.calls.clear()
    assert client.post("/v2/models/models/llama/versions/3/infer", json=body).status_code == 404
    assert ms.calls[0][0] == "infer" and (ms.calls[0][1].model_name, ms.calls[0][1].model_version) == (
        "models/llama", "3")
    ms.calls.clear()
    assert client.post("/v2/repository/models/a%2Fb/load").status_code == 200
    assert client.post("/v2/repository/models/a/b/unload").status_code == 200
    assert ms.calls == [("load", "a/b", None), ("unload", "a/b")]
    # the other method of a route, and routes this server lacks
    assert client.get("/v2/models/models/llama/infer").status_code == 405
    assert client.post("/v2/models/models/llama/ready").status_code == 405
    r = client.get("/v2/models/models/llama/trace/setting")
    assert r.status_code == 404 and "trace" in r.json()["error"]


@pytest.fixture(scope="module")
def slash_server(tmp_path_factory):
    """`strata serve /abs/models/llama --model-repository ...` (the README's command): the LLM's name is its
    absolute folder path, leading slash included."""
    tmp = tmp_path_factory.mktemp("slash")
    llama = tmp / "models" / "llama"
    make_tiny_checkpoint("llama", llama)
    add_onnx_mlp(tmp / "repo")
    log = tmp / "server.log"
    served = start_serve([str(llama), "--model-repository", str(tmp / "repo"), "--device", "cpu",
                          "--dtype", "float32", "--kv-cache-memory-gib", "0.01", "--max-model-len", "256",
                          "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"], log,
                         ready_path="/v2/health/ready", grpc=True, timeout_s=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield f"127.0.0.1:{served.port}", f"127.0.0.1:{served.grpc_port}", str(llama)
    finally:
        served.stop(timeout_s=30)


def test_tritonclient_http_and_grpc_reach_every_name_the_index_lists(slash_server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http, grpc, llama = slash_server
    completion = httpx.post(f"http://{http}/v1/completions", json={
        "model": llama, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}).json()["choices"][0]["text"]
    for mod, url in ((httpclient, http), (grpcclient, grpc)):
        client = mod.InferenceServerClient(url)
        index = client.get_model_repository_index()
        names = [m["name"] for m in index] if mod is httpclient else [m.name for m in index.models]
        assert sorted(names) == sorted([llama, "onnx_mlp"])
        for name in names:
            assert client.is_model_ready(name) and client.is_model_ready(name, "1"), (mod.__name__, name)
        # the text model answers every tensor route as Triton's vLLM backend does (text_input in, text_output out)
        meta = client.get_model_metadata(llama)
        assert (meta["name"] if mod is httpclient else meta.name) == llama, mod.__name__
        assert client.get_model_config(llama) and client.get_inference_statistics(llama)
        text = mod.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"Once upon a time"], dtype=object))
        out = client.infer(llama, [text], parameters={"max_tokens": 6, "temperature": 0}).as_numpy("text_output")
        assert out[0].decode() == completion, mod.__name__
        assert client.get_model_metadata("onnx_mlp")  # and the repository's models as before
        client.close()
    r = httpx.post(f"http://{http}/v2/models/{llama}/generate",
                   json={"text_input": "Once upon a time", "parameters": {"max_tokens": 6, "temperature": 0}})
    assert r.status_code == 200 and r.json()["text_output"] == completion
    encoded = llama.replace("/", "%2F")
    assert httpx.get(f"http://{http}/v2/models/{encoded}/ready").json() == {"name": llama, "ready": True}
