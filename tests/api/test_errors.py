"""Every bad input gets its status and an OpenAI error body; the server keeps serving afterwards."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from api_server import MODEL

GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES = [
    # (name, path, body, status, param)
    ("unknown model", "/v1/completions", {**GOOD, "model": "nope"}, 404, "model"),
    ("unknown model chat", "/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
    ("max_tokens 0", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative chat", "/v1/chat/completions", {**CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("max_completion_tokens 0", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("max_tokens wrong type", "/v1/completions", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("prompt wrong type", "/v1/completions", {**GOOD, "prompt": {"text": "hi"}}, 400, None),
    ("prompt missing", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("empty string prompt ids", "/v1/completions", {**GOOD, "prompt": [[]]}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {**GOOD, "prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {**GOOD, "prompt": [1, -5]}, 400, "prompt"),
    ("messages empty", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("temperature too high", "/v1/completions", {**GOOD, "temperature": 1000}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("presence penalty", "/v1/chat/completions", {**CHAT, "presence_penalty": 5}, 400, "presence_penalty"),
    ("frequency penalty", "/v1/completions", {**GOOD, "frequency_penalty": -9}, 400, "frequency_penalty"),
    ("min_p", "/v1/completions", {**GOOD, "min_p": 1.5}, 400, "min_p"),
    ("top_k", "/v1/completions", {**GOOD, "top_k": -7}, 400, "top_k"),
    ("repetition penalty", "/v1/completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logprobs too many", "/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs too many", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 99}, 400,
     "top_logprobs"),
    ("n too large", "/v1/completions", {**GOOD, "n": 1000}, 400, "n"),
    ("n zero", "/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("empty stop string", "/v1/completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("min_tokens above max_tokens", "/v1/completions", {**GOOD, "min_tokens": 5}, 400, "min_tokens"),
    ("prompt over context", "/v1/completions", {**GOOD, "prompt": "word " * 700}, 400, "prompt"),
    ("prompt ids over context", "/v1/completions", {**GOOD, "prompt": [5] * 600}, 400, "prompt"),
    ("messages over context", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "word " * 700}]}, 400, "messages"),
    ("prompt + max_tokens over context", "/v1/completions", {**GOOD, "prompt": [5] * 300, "max_tokens": 300},
     400, "max_tokens"),
    ("seed beyond int64", "/v1/completions", {**GOOD, "seed": 2**70}, 400, "seed"),
    ("top_k beyond int64", "/v1/chat/completions", {**CHAT, "top_k": 2**70}, 400, "top_k"),
    ("stop token id beyond int64", "/v1/completions", {**GOOD, "stop_token_ids": [2**64]}, 400, None),
    ("stream_options without stream", "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("stream wrong type", "/v1/completions", {**GOOD, "stream": "yes please"}, 400, "stream"),
    ("tokenize neither", "/tokenize", {"model": MODEL}, 400, None),
    ("detokenize bad id", "/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
]


def _check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
        yield c


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input(http, name, path, body, status, param):
    _check_error(http.post(path, json=body), status, param)


def test_invalid_json_is_400(http):
    for raw in (b"{not json", b"", b"[1, 2", b"\xff\xfe"):
        _check_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)


def test_oversized_body_is_413(http):
    big = json.dumps({**GOOD, "prompt": "x" * (17 * 2**20)}).encode()
    _check_error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit must hold on the bytes actually read
        for _ in range(17):
            yield b"x" * 2**20

    _check_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_api_key_required_except_probes(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdA=="}):
        err = _check_error(httpx.post(f"{server.url}/v1/completions", json=GOOD, headers=headers), 401)
        assert err["type"] == "authentication_error"
        _check_error(httpx.get(f"{server.url}/v1/models", headers=headers), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=9000)
    assert "temperature" in str(info.value)


def test_server_still_serves_after_bad_inputs(http):
    r = http.post("/v1/completions", json={**GOOD, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    r = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_lone_surrogates_are_400_and_the_connection_stays(http):
    """Half of a UTF-16 surrogate pair is valid JSON syntax but no text: a 400 naming it on every route, and the
    client's kept-alive connection still serves (a 500 used to drop it). A whole pair (an emoji, as clients that
    escape non-ASCII send it) is text and is served."""
    lone = {"/v1/completions": '{"model": "%s", "max_tokens": 2, "prompt": "hi \\ud83d"}',
            "/v1/chat/completions": '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", '
                                    '"content": "\\ude00 hi"}]}',
            "/tokenize": '{"model": "%s", "prompt": "a\\ud83d\\ud83d"}'}
    headers = {"content-type": "application/json"}
    for path, raw in lone.items():
        err = _check_error(http.post(path, content=(raw % MODEL).encode(), headers=headers), 400)
        assert err["code"] == "invalid_unicode" and "surrogate" in err["message"]
        assert http.get("/v1/models").status_code == 200  # the same connection
    pair = json.dumps({**GOOD, "prompt": "hi \U0001F600"}, ensure_ascii=True)
    assert "\\ud83d\\ude00" in pair
    assert http.post("/v1/completions", content=pair.encode(), headers=headers).status_code == 200


def test_stop_reason_rides_on_the_last_streamed_chunk(http):
    """As vLLM's stream choices do: the stop string (or token id) that ended the choice, null for a length stop."""
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        plain = http.post(path, json={**body, "max_tokens": 12, "temperature": 0}).json()["choices"][0]
        text = plain["text"] if "text" in plain else plain["message"]["content"]
        assert plain["stop_reason"] is None
        stop = text[3:5]  # written after the third character: the stop ends the choice there
        want = http.post(path, json={**body, "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
        assert want["choices"][0]["finish_reason"] == "stop" and want["choices"][0]["stop_reason"] == stop
        for stop_list, reason in (([stop], stop), (None, None)):
            req = {**body, "max_tokens": 12, "temperature": 0, "stop": stop_list, "stream": True}
            with http.stream("POST", path, json=req) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            last = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
            assert len(last) == 1 and last[0]["stop_reason"] == reason, last
