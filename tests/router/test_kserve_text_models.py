"""A local text model of a router config (the command line's form is a one-entry config) on the KServe fronts, as
Triton's vLLM backend serves one: generate / generate_stream over HTTP, infer over HTTP and gRPC with
tritonclient (Triton's text_input / stream / sampling_parameters / exclude_input_in_output / return_* tensors),
ModelStreamInfer; the answers equal /v1/completions'; bad parameters are KServe 400s naming the parameter; a
client that leaves mid-stream frees its engine request."""
from __future__ import annotations

import json
import queue
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _model_repos import add_python_text
from router_servers import Proc, free_port, local_entry, write_config
from tritonclient.utils import InferenceServerException

PROMPT, MAX_TOKENS = "hello there", 12
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kserve_text")
    add_python_text(tmp / "repo")
    cfg = write_config(tmp / "router.yaml", {
        "models": [local_entry("chat", tiny, max_model_len=1024, max_num_seqs=4, kv_cache_memory_gib=0.05)],
        "model_repository": str(tmp / "repo"),
        "sla_classes": {"interactive": {"priority": 0}, "batch": {"priority": 10}}, "default_sla": "interactive",
    })
    srv = Proc(["--config", str(cfg)], free_port(), tmp / "server.log", grpc_port=free_port())
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(server) -> str:
    r = httpx.post(server.url + "/v1/completions", json={"model": "chat", "prompt": PROMPT, **GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text
    return text


def _inputs(mod, prompt: str = PROMPT, **flags) -> list:
    """Triton's vLLM-backend tensors: text_input plus BOOL flags and BYTES (JSON) strings."""
    t = mod.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    out = [t]
    for name, value in flags.items():
        x = mod.InferInput(name, [1], "BOOL" if isinstance(value, bool) else "BYTES")
        x.set_data_from_numpy(np.array([value]) if isinstance(value, bool) else np.array([value.encode()], object))
        out.append(x)
    return out


def test_generate_and_generate_stream_equal_completions(server, reference):
    r = httpx.post(server.url + "/v2/models/chat/generate",
                   json={"text_input": PROMPT, "parameters": {"stream": False, **GREEDY}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"model_name": "chat", "model_version": "1", "text_output": reference}
    events = []
    with httpx.stream("POST", server.url + "/v2/models/chat/generate_stream",
                      json={"text_input": PROMPT, "parameters": GREEDY}, timeout=60) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events  # Triton's generate_stream: every event is a JSON object
    pieces = [json.loads(e) for e in events]
    assert len(pieces) > 1 and "".join(p["text_output"] for p in pieces) == reference
    assert all(p["model_name"] == "chat" for p in pieces)
    # Triton's tensors as generate fields: the prompt leads, counts and finish reason come back
    r = httpx.post(server.url + "/v2/models/chat/generate", timeout=60, json={
        "text_input": PROMPT, "exclude_input_in_output": False, "return_finish_reason": True,
        "return_num_input_tokens": True, "return_num_output_tokens": True,
        "sampling_parameters": json.dumps({"temperature": "0", "max_tokens": str(MAX_TOKENS)})})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["text_output"] == PROMPT + reference and doc["finish_reason"] == "length"
    assert doc["num_output_tokens"] == MAX_TOKENS and doc["num_input_tokens"] > 0


def test_tritonclient_http_and_grpc_infer(server, reference):
    http = httpclient.InferenceServerClient(server.http)
    res = http.infer("chat", _inputs(httpclient), parameters=GREEDY)
    assert res.as_numpy("text_output").tolist() == [reference.encode()]
    res = http.infer("chat", _inputs(httpclient, sampling_parameters=json.dumps(GREEDY)))
    assert res.as_numpy("text_output").tolist() == [reference.encode()]
    meta = http.get_model_metadata("chat")
    assert meta["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": [1]}
    assert meta["outputs"][0] == {"name": "text_output", "datatype": "BYTES", "shape": [1]}
    assert http.is_model_ready("chat") and http.get_model_config("chat")["backend"] == "llm"
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["chat"]["state"] == "READY" and index["py_text"]["state"] == "READY"
    http.close()

    grpc = grpcclient.InferenceServerClient(server.grpc)
    res = grpc.infer("chat", _inputs(grpcclient), parameters=GREEDY)
    assert res.as_numpy("text_output").tolist() == [reference.encode()]
    got: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: got.put((result, error)))
    grpc.async_stream_infer("chat", _inputs(grpcclient, stream=True, sampling_parameters=json.dumps(GREEDY)),
                            request_id="s1", enable_empty_final_response=True)
    text, pieces = "", 0
    while True:
        result, error = got.get(timeout=30)
        assert error is None, error
        out = result.as_numpy("text_output")
        text += out[0].decode() if out is not None else ""
        pieces += out is not None
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    grpc.stop_stream()
    assert text == reference and pieces > 1  # streamed piece by piece, as Triton's vLLM backend does
    assert grpc.get_model_metadata("chat").inputs[0].datatype == "BYTES"
    assert not grpc.get_model_config("chat").config.model_transaction_policy.decoupled
    grpc.close()


@pytest.mark.parametrize("params, named", [
    ({"temperature": -1}, "temperature"), ({"bogus": 1}, "bogus"), ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"), ({"n": 2}, "'n'"),
])
def test_bad_parameters_are_kserve_400s_naming_them(server, params, named):
    r = httpx.post(server.url + "/v2/models/chat/generate", json={"text_input": PROMPT, "parameters": params},
                   timeout=30)
    assert r.status_code == 400 and named in r.json()["error"], r.text
    r = httpx.post(server.url + "/v2/models/chat/generate_stream",
                   json={"text_input": PROMPT, "parameters": params}, timeout=30)
    assert r.status_code == 400 and named in r.json()["error"], r.text


def test_bad_requests_over_tritonclient(server):
    grpc = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException, match="top_p") as e:
        grpc.infer("chat", _inputs(grpcclient), parameters={"top_p": 0})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="sampling_parameters"):
        grpc.infer("chat", _inputs(grpcclient, sampling_parameters="{not json"))
    with pytest.raises(InferenceServerException, match="missing inputs"):
        x = grpcclient.InferInput("stream", [1], "BOOL")
        x.set_data_from_numpy(np.array([True]))
        grpc.infer("chat", [x])
    grpc.close()
    r = httpx.post(server.url + "/v2/models/chat/versions/2/generate", json={"text_input": PROMPT})
    assert r.status_code == 404 and "version 2" in r.json()["error"]


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def test_client_leaving_mid_stream_frees_its_request(server):
    tokens = 'strata:generation_tokens_total{model_name="chat"}'
    aborted = 'strata:router_requests_total{model_name="chat",outcome="aborted",sla_class="interactive"}'
    before, aborted_before = _metric(server, tokens), _metric(server, aborted)
    with httpx.stream("POST", server.url + "/v2/models/chat/generate_stream", timeout=60,
                      json={"text_input": "x", "parameters": {"max_tokens": 1000, "ignore_eos": True}}) as s:
        first = next(line for line in s.iter_lines() if line.startswith("data: "))
        assert "text_output" in first
    deadline = time.monotonic() + 10
    while _metric(server, 'strata:num_requests_running{model_name="chat"}') and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, 'strata:num_requests_running{model_name="chat"}') == 0
    assert _metric(server, aborted) == aborted_before + 1
    assert _metric(server, tokens) - before < 1000  # stopped early, not run to its max_tokens


def test_the_callers_sla_class_reaches_a_text_model_over_http_and_grpc(server, reference):
    """x-sla-class (header / gRPC metadata) is the request's class, as on /v1: a known one serves, an unknown one
    is refused naming it."""
    body = {"text_input": PROMPT, "parameters": GREEDY}
    ok = httpx.post(server.url + "/v2/models/chat/generate", json=body, headers={"x-sla-class": "batch"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["text_output"] == reference
    bad = httpx.post(server.url + "/v2/models/chat/generate", json=body, headers={"x-sla-class": "nope"}, timeout=60)
    assert bad.status_code == 400 and "nope" in bad.json()["error"]
    grpc = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException, match="nope"):
        grpc.infer("chat", _inputs(grpcclient), parameters=GREEDY, headers={"x-sla-class": "nope"})
    assert grpc.infer("chat", _inputs(grpcclient), parameters=GREEDY,
                      headers={"x-sla-class": "batch"}).as_numpy("text_output").tolist() == [reference.encode()]
    grpc.close()
