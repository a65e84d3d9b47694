"""The router in front of an upstream `strata serve`: the official clients get the same answers through the
router as directly (OpenAI streamed and not; KServe over HTTP and gRPC), upstream errors keep their meaning, a
hanging upstream never hangs a client, and a dead upstream is a 503 for its model only, until it comes back."""
from __future__ import annotations

import json
import time

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _model_repos import mlp_reference
from tritonclient.utils import InferenceServerException

PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "1 2 3 4"]


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _stream_text(stream) -> str:
    out = []
    for chunk in stream:
        for ch in chunk.choices:
            delta = getattr(ch, "delta", None)
            out.append((delta.content if delta is not None else ch.text) or "")
    return "".join(out)


def test_models_are_listed_with_their_payload(router):
    data = {m["id"]: m for m in httpx.get(router.url + "/v1/models").json()["data"]}
    assert {"local", "big", "mlp", "words", "hang"} <= set(data)
    assert data["local"]["payload"] == "text" and data["local"]["max_model_len"] == 256
    assert data["big"]["backend"] == "upstream-openai" and data["mlp"]["payload"] == "tensors"
    for name, remote in (("big", "tiny"), ("mlp", "onnx_mlp")):  # either kind of upstream: its name, its replicas
        assert data[name]["upstream_model"] == remote and data[name]["replicas"][0]["healthy"] is True
    index = {m["name"]: m for m in httpclient.InferenceServerClient(router.http).get_model_repository_index()}
    assert index["mlp"]["state"] == "READY" and index["words"]["state"] == "READY"
    assert index["local"]["state"] == "READY" and "text" in index["local"]["reason"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_and_chat_match_the_upstream(router, upstream, stream):
    direct, routed = _client(upstream), _client(router)
    for prompt in PROMPTS:
        args = dict(prompt=prompt, max_tokens=12, temperature=0, stream=stream)
        a = direct.completions.create(model="tiny", **args)
        b = routed.completions.create(model="big", **args)
        if stream:
            assert _stream_text(b) == _stream_text(a)
        else:
            assert b.choices[0].text == a.choices[0].text and b.model == "big"
            assert b.usage.completion_tokens == a.usage.completion_tokens
        msgs = [{"role": "user", "content": prompt}]
        a = direct.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=stream)
        b = routed.chat.completions.create(model="big", messages=msgs, max_tokens=10, temperature=0, stream=stream)
        if stream:
            assert _stream_text(b) == _stream_text(a)
        else:
            assert b.choices[0].message.content == a.choices[0].message.content and b.model == "big"
    # every request is done: the replicas hold none (non-streamed ones were counted up and never down)
    big = next(m for m in httpx.get(router.url + "/v1/models").json()["data"] if m["id"] == "big")
    assert [r["outstanding"] for r in big["replicas"]] == [0] * len(big["replicas"]), big


def _events(url: str, model: str) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": "hello", "max_tokens": 16, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line.startswith("data:")]


def test_stream_events_pass_through_one_for_one(router, upstream):
    """Every upstream SSE event reaches the client as its own event, with the model renamed."""
    direct, routed = _events(upstream.url, "tiny"), _events(router.url, "big")
    assert routed[-1] == "data: [DONE]" and len(routed) == len(direct) > 2
    for a, b in zip(direct[:-1], routed[:-1]):
        da, db = json.loads(a[5:]), json.loads(b[5:])
        assert db["model"] == "big" and da["model"] == "tiny"
        assert db["choices"] == da["choices"]


def test_local_model_and_sla_header(router):
    c = _client(router)
    r = c.completions.create(model="local", prompt="abc", max_tokens=5, temperature=0,
                             extra_headers={"x-sla-class": "batch"})
    assert r.model == "local" and r.usage.completion_tokens == 5
    bad = httpx.post(router.url + "/v1/completions", headers={"x-sla-class": "gold"},
                     json={"model": "local", "prompt": "abc", "max_tokens": 2})
    assert bad.status_code == 400 and "gold" in bad.json()["error"]["message"]
    text = httpx.get(router.url + "/metrics").text
    assert 'strata:router_requests_total{model_name="local",outcome="ok",sla_class="batch"}' in text
    assert 'strata:router_time_to_first_token_seconds_count{model_name="big",sla_class="interactive"}' in text


def test_routing_errors_name_the_model(router):
    r = httpx.post(router.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"] and "big" in r.json()["error"]["message"]
    r = httpx.post(router.url + "/v1/completions", json={"model": "mlp", "prompt": "x"})
    assert r.status_code == 400 and "tensors" in r.json()["error"]["message"]
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_required"


def test_upstream_client_errors_keep_their_status(router, upstream):
    body = {"prompt": "x", "max_tokens": 100_000}
    direct = httpx.post(upstream.url + "/v1/completions", json={**body, "model": "tiny"})
    routed = httpx.post(router.url + "/v1/completions", json={**body, "model": "big"})
    assert direct.status_code == routed.status_code == 400
    assert routed.json()["error"]["message"] == direct.json()["error"]["message"]


def test_hanging_upstream_never_hangs_the_client(router):
    # The client would wait 60 s; an answer at all (rather than httpx's ReadTimeout) is what timeout_s guarantees.
    r = httpx.post(router.url + "/v1/completions", json={"model": "hang", "prompt": "x"}, timeout=60)
    assert r.status_code in (503, 504), r.text  # 504 before the health check marks it down, 503 after
    assert "hang" in r.json()["error"]["message"]


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_through_router(router, upstream, binary):
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    outs = {}
    for srv, model in ((upstream, "onnx_mlp"), (router, "mlp")):
        c = httpclient.InferenceServerClient(srv.http)
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        res = c.infer(model, [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)])
        outs[model] = res.as_numpy("OUTPUT0")
        assert res.get_response()["model_name"] == model
        c.close()
    np.testing.assert_array_equal(outs["mlp"], outs["onnx_mlp"])
    np.testing.assert_allclose(outs["mlp"], mlp_reference(x, upstream.weights[1]), rtol=1e-5, atol=1e-5)
    meta = httpclient.InferenceServerClient(router.http).get_model_metadata("mlp")
    assert meta["name"] == "mlp" and meta["inputs"][0]["name"] == "INPUT0"


def test_tritonclient_grpc_through_router(router, upstream):
    c = grpcclient.InferenceServerClient(router.grpc)
    x = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    y = c.infer("mlp", [inp]).as_numpy("OUTPUT0")
    np.testing.assert_allclose(y, mlp_reference(x, upstream.weights[1]), rtol=1e-5, atol=1e-5)
    words = np.array([b"hello", "w\u00f6rld".encode()], dtype=object).reshape(2)[:1]
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(words)
    direct = grpcclient.InferenceServerClient(upstream.grpc).infer("py_text", [t]).as_numpy("text_output")
    routed = c.infer("words", [t]).as_numpy("text_output")
    assert list(routed) == list(direct)
    assert c.is_model_ready("mlp") and c.get_model_metadata("mlp").name == "mlp"
    with pytest.raises(InferenceServerException, match="INPUT0|input"):
        bad = grpcclient.InferInput("INPUT0", [2, 5], "FP32")
        bad.set_data_from_numpy(np.zeros((2, 5), np.float32))
        c.infer("mlp", [bad])
    c.close()


def _poll_big(router, status: int, wait_s: float = 30) -> httpx.Response:
    """Ask model `big` until the router answers ``status`` (health checks take a moment to notice)."""
    deadline = time.monotonic() + wait_s
    while True:
        r = httpx.post(router.url + "/v1/completions", json={"model": "big", "prompt": "x", "max_tokens": 2})
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_dead_upstream_is_503_for_its_models_only_then_recovers(router, upstream):
    """Last in this module: it stops the upstream and starts it again on the same ports."""
    upstream.stop()
    try:
        r = _poll_big(router, 503)
        assert r.status_code == 503 and "big" in r.json()["error"]["message"], r.text
        assert r.headers.get("retry-after")
        with pytest.raises(InferenceServerException, match="mlp"):
            inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
            httpclient.InferenceServerClient(router.http).infer("mlp", [inp])
        # the local model keeps serving, and the router stays healthy
        ok = httpx.post(router.url + "/v1/completions", json={"model": "local", "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200 and httpx.get(router.url + "/health").status_code == 200
        ready = {m["id"]: m["ready"] for m in httpx.get(router.url + "/v1/models").json()["data"]}
        assert ready["big"] is False and ready["local"] is True
    finally:
        upstream.start()
    r = _poll_big(router, 200)
    assert r.status_code == 200, r.text
    text = httpx.get(router.url + "/metrics").text
    assert 'outcome="unavailable"' in text
