"""The streaming client over httpx.MockTransport: SSE parsing, usage vs chunk counting, errors, payloads."""
from __future__ import annotations

import asyncio
import re
import json

import httpx
import pytest

from strataserve.bench.client import build_payload, send_request
from strataserve.bench.datasets import SampleRequest


def _sse(*events: object) -> bytes:
    lines = []
    for e in events:
        lines.append(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n")
    return ("".join(lines)).encode()


def _send(handler, body: dict, prompt_len: int = 3):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, "http://x/v1/completions", body, prompt_len, {"Authorization": "Bearer k"})

    return asyncio.run(go())


def test_usage_counts_and_chunk_timing() -> None:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers["authorization"]
        seen["body"] = json.loads(request.content)
        body = _sse(
            {"choices": [{"index": 0, "text": "Hel"}]},
            {"choices": [{"index": 0, "text": ""}]},  # empty pieces are not tokens
            {"choices": [{"index": 0, "text": "lo"}]},
            {"choices": [{"index": 0, "text": "!"}]},
            {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5}},
            "[DONE]",
        )
        return httpx.Response(200, content=b": keep-alive\n\n" + body, headers={"content-type": "text/event-stream"})

    r = _send(handler, {"prompt": [1, 2, 3], "max_tokens": 5})
    assert r.success and r.error == ""
    assert seen["auth"] == "Bearer k" and seen["body"]["prompt"] == [1, 2, 3]
    assert r.output_tokens == 5 and r.prompt_len == 11  # the server's usage wins
    assert r.generated_text == "Hello!"
    assert len(r.itl) == 2 and r.ttft > 0 and r.latency >= r.ttft + sum(r.itl)
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 4)


def test_chat_deltas_and_chunk_count_fallback() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
            {"choices": [{"index": 0, "delta": {"content": "a"}}]},
            {"choices": [{"index": 0, "delta": {"content": "b"}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            "[DONE]",
        ))

    r = _send(handler, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert r.success and r.output_tokens == 2 and r.prompt_len == 3 and r.generated_text == "ab"


@pytest.mark.parametrize(
    "response, error",
    [
        (httpx.Response(400, json={"error": {"message": "max_tokens too big"}}), "HTTP 400: .*max_tokens too big"),
        (httpx.Response(200, content=_sse({"choices": [{"text": "a"}]})), "without data: \\[DONE\\]"),
        (httpx.Response(200, content=_sse({"error": {"message": "engine died"}}, "[DONE]")), "stream error: .*engine died"),
        (httpx.Response(200, content=b"data: {broken\n\n"), "JSONDecodeError"),
    ],
)
def test_failures_are_reported_not_raised(response: httpx.Response, error: str) -> None:
    r = _send(lambda request: response, {"prompt": "x", "max_tokens": 1})
    assert not r.success
    assert re.search(error, r.error), r.error


def test_connection_error_is_reported() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    r = _send(handler, {"prompt": "x", "max_tokens": 1})
    assert not r.success and r.error.startswith("ConnectError")


def test_build_payload() -> None:
    req = SampleRequest([5, 6], 2, 7)
    body = build_payload("/v1/completions", "m", req, True, {"temperature": 0.0, "top_k": 3})
    assert body == {"model": "m", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.0, "top_k": 3, "ignore_eos": True, "prompt": [5, 6]}
    chat = build_payload("/v1/chat/completions", "m", SampleRequest("hi", 1, 4), False, {})
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat and "ignore_eos" not in chat
    with pytest.raises(ValueError, match="--tokenizer"):
        build_payload("/v1/chat/completions", "m", req, False, {})
