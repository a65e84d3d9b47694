"""Tokens per minute on upstream KServe calls: an LLM's text_input call is charged its prompt (4 characters a token)
plus the max_tokens it asks for, and answered 429 + Retry-After (RESOURCE_EXHAUSTED over gRPC) naming the limit
once the key's minute is spent; a tensor model's call holds no tokens and is still served; one call asking for
more than a minute's tokens is a 400. The router's face of a repository LLM keeps no unloaded version alive."""
from __future__ import annotations

import gc
import re
import weakref
from types import SimpleNamespace

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from router_servers import Proc, free_port, write_config
from tritonclient.utils import InferenceServerException

from strataserve.router.kserve_calls import tensor_call_tokens
from strataserve.types.tensors import InferRequest, InferTensor

ADMIN, KEY = "admin-key", "tpm-key"
TPM = 400
PROMPT = "hello there"  # 11 characters: 2.75 tokens


@pytest.fixture(scope="module")
def server(upstream, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kserve_tensor_tokens")
    cfg = write_config(tmp / "router.yaml", {
        "models": [
            {"name": "mlp", "upstream": "kserve", "url": upstream.url, "upstream_model": "onnx_mlp"},
            {"name": "ks", "upstream": "kserve", "url": upstream.url, "upstream_model": "tiny"},  # an LLM
        ],
        "sla_classes": {"interactive": {"priority": 0}, "batch": {"priority": 10}},
        "default_sla": "interactive",
        "api_keys": [{"key": KEY, "sla": "batch"}],
    })
    srv = Proc(["--config", str(cfg), "--api-key", ADMIN, "--tokens-per-minute", str(TPM)], free_port(),
               tmp / "router.log", grpc_port=free_port(), headers={"Authorization": f"Bearer {ADMIN}"})
    srv.start()
    yield srv
    srv.stop()


def _h(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _text(mod) -> list:
    t = mod.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    return [t]


def _mlp(mod) -> list:
    x = mod.InferInput("INPUT0", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    return [x]


def test_upstream_llm_calls_spend_the_keys_tokens_and_tensor_calls_do_not(server):
    http = httpclient.InferenceServerClient(server.http)
    grpc_client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as exc:  # more than a whole minute's tokens in one call
        http.infer("ks", _text(httpclient), headers=_h(), parameters={"max_tokens": TPM + 1})
    assert exc.value.status() == "400" and "tokens per minute" in exc.value.message()
    # 2.75 + 240 of the key's 400: the upstream (a 256-token context) writes them; 300 more would need ~20 s
    res = http.infer("ks", _text(httpclient), headers=_h(), parameters={"max_tokens": 240, "ignore_eos": True})
    assert res.as_numpy("text_output") is not None
    r = httpx.post(server.url + "/v2/models/ks/infer", headers=_h(), timeout=60, json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]},
                   {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1],
                    "data": ['{"max_tokens": 300}']}]})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    assert f"{TPM} tokens per minute" in r.json()["error"]
    with pytest.raises(InferenceServerException) as exc:
        grpc_client.infer("ks", _text(grpcclient), headers=_h(), parameters={"max_tokens": 300})
    assert exc.value.status() == str(grpc.StatusCode.RESOURCE_EXHAUSTED) and "tokens per minute" in exc.value.message()
    # a tensor model's call holds no tokens: the spent key is still served, over both fronts
    assert http.infer("mlp", _mlp(httpclient), headers=_h()).as_numpy("OUTPUT0").shape[0] == 1
    assert grpc_client.infer("mlp", _mlp(grpcclient), headers=_h()).as_numpy("OUTPUT0").shape[0] == 1
    http.close()
    grpc_client.close()
    metrics = httpx.get(server.url + "/metrics", headers=_h(ADMIN)).text
    counts = {(m, o): float(v) for m, o, v in re.findall(
        r'^strata:router_requests_total\{model_name="(\w+)",outcome="(\w+)",sla_class="batch"\} (\S+)$', metrics, re.M)}
    assert counts[("ks", "ok")] == 1 and counts[("ks", "rejected")] == 2 and counts[("ks", "client_error")] == 1
    assert counts[("mlp", "ok")] == 2 and counts.get(("mlp", "rejected"), 0) == 0


def _request(*tensors: InferTensor, **parameters) -> InferRequest:
    return InferRequest(model_name="m", inputs=list(tensors), parameters=parameters)


def _bytes(name: str, value: str) -> InferTensor:
    return InferTensor(name, "BYTES", [1], np.array([value.encode()], dtype=object))


def test_what_a_tensor_call_is_charged():
    prompt = _bytes("text_input", "x" * 40)  # 10 tokens
    assert tensor_call_tokens(_request(InferTensor("INPUT0", "FP32", [1, 4], np.ones((1, 4), np.float32)))) is None
    assert tensor_call_tokens(_request(prompt)) == 10  # no output budget named: the prompt alone
    assert tensor_call_tokens(_request(prompt, max_tokens=8)) == 18
    assert tensor_call_tokens(_request(prompt, max_tokens="8", n=2)) == 26  # Triton's clients send strings
    sampling = _bytes("sampling_parameters", '{"max_tokens": 30}')
    assert tensor_call_tokens(_request(prompt, sampling, max_tokens=8)) == 40  # sampling_parameters wins
    budget = InferTensor("max_tokens", "INT32", [1], np.array([12], np.int32))  # TensorRT-LLM's input
    assert tensor_call_tokens(_request(prompt, budget)) == 22
    assert tensor_call_tokens(_request(prompt, _bytes("sampling_parameters", "{bad"), max_tokens="x")) == 10
    ints = InferTensor("text_input", "INT32", [1], np.array([1], np.int32))  # not text: no tokens
    assert tensor_call_tokens(_request(ints, max_tokens=8)) is None


class _Engine:
    """What the router's face reads of an LLM engine."""

    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=4, max_waiting_requests=8))
    max_model_len = 64
    tokenizer = None
    stats = None

    def check_health(self) -> None:
        pass


def test_a_repository_llm_face_lives_as_long_as_its_version():
    from strataserve.modelserver.llm import LLMVersion
    from strataserve.modelserver.llm_io import text_model_spec
    from strataserve.modelserver.stats import ModelStats
    from strataserve.router.repo_llm import RepositoryLLMs
    from strataserve.router.router import Router

    served: dict[str, LLMVersion] = {}
    local = SimpleNamespace(llm_version=lambda name, version="": served.get(name))
    engine = _Engine()
    served["m"] = LLMVersion(text_model_spec("m"), 1, ModelStats("m", "1"), engine)
    faces = RepositoryLLMs(Router(), local)
    face = faces.get("m")
    assert face is not None and faces.get("m", "1") is face  # one face per version: admission state is shared
    assert face.backend.admission.slots == 4 and face.backend.state.max_inflight_seqs == 12
    gone = weakref.ref(engine)
    del face, engine
    served.clear()  # the model server unloads the version
    gc.collect()
    assert gone() is None  # its engine is not kept alive by the router
