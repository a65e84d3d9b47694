"""The streaming client against a canned aiohttp server: SSE parsing, usage vs chunk counting, errors, payloads."""
from __future__ import annotations

import asyncio
import re
import json
import socket

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from strataserve.bench.client import build_payload, send_request
from strataserve.bench.datasets import SampleRequest


def _sse(*events: object) -> bytes:
    lines = []
    for e in events:
        lines.append(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n")
    return ("".join(lines)).encode()


def _response(status: int = 200, content: bytes = b"", split: int = 0) -> tuple[int, bytes, int]:
    """A canned response; ``split`` > 0 streams it in pieces of that many bytes, so lines straddle reads."""
    return status, content, split


def _send(handler, body: dict, prompt_len: int = 3):
    async def endpoint(request: web.Request) -> web.StreamResponse:
        seen = {"auth": request.headers.get("authorization"), "body": await request.json()}
        status, content, split = handler(seen)
        if not split:
            return web.Response(status=status, body=content, content_type="text/event-stream")
        resp = web.StreamResponse(status=status, headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(content), split):
            await resp.write(content[i:i + split])
            await asyncio.sleep(0.001)
        await resp.write_eof()
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", endpoint)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            url = str(server.make_url("/v1/completions"))
            return await send_request(session, url, body, prompt_len, {"Authorization": "Bearer k"})

    return asyncio.run(go())


@pytest.mark.parametrize("split", [0, 7])
def test_usage_counts_and_chunk_timing(split: int) -> None:
    seen = {}

    def handler(request: dict) -> tuple[int, bytes, int]:
        seen.update(request)
        body = _sse(
            {"choices": [{"index": 0, "text": "Hel"}]},
            {"choices": [{"index": 0, "text": ""}]},  # a token whose text is not out yet: still an output chunk
            {"choices": [{"index": 0, "text": "lo"}]},
            {"choices": [{"index": 0, "text": "!"}]},
            {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},  # the finish chunk is no output
            {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5}},
            "[DONE]",
        )
        return _response(200, b": keep-alive\n\n" + body, split)

    r = _send(handler, {"prompt": [1, 2, 3], "max_tokens": 5})
    assert r.success and r.error == ""
    assert seen["auth"] == "Bearer k" and seen["body"]["prompt"] == [1, 2, 3]
    assert r.output_tokens == 5 and r.prompt_len == 11  # the server's usage wins
    assert r.generated_text == "Hello!"
    assert len(r.itl) == 3 and r.ttft > 0 and r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 4)


def test_chat_deltas_and_chunk_count_fallback() -> None:
    def handler(request: dict) -> tuple[int, bytes, int]:
        return _response(200, _sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
            {"choices": [{"index": 0, "delta": {"content": "a"}}]},
            {"choices": [{"index": 0, "delta": {"content": "b"}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            "[DONE]",
        ))

    r = _send(handler, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert r.success and r.output_tokens == 2 and r.prompt_len == 3 and r.generated_text == "ab"
    assert r.output_tokens_source == "chunks" and len(r.itl) == 1  # role and finish chunks carry no output


@pytest.mark.parametrize(
    "events, tokens, text",
    [
        # reasoning models: tokens in reasoning_content / reasoning, content null
        ([{"delta": {"reasoning_content": "th"}}, {"delta": {"reasoning": "ink", "content": None}},
          {"delta": {"content": "ok"}}], 3, "think" + "ok"),
        # tool calls only
        ([{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}},
          {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}}], 2, ""),
        # token ids with empty text (vLLM return_token_ids), and an empty content delta that is not the role chunk
        ([{"delta": {"content": ""}, "token_ids": [5]}, {"delta": {"content": ""}}, {"delta": {"content": "x"}}], 3, "x"),
    ],
)
def test_output_without_content_is_timed(events: list[dict], tokens: int, text: str) -> None:
    """TTFT was 0 (and every SLO met) when no chunk had delta.content."""
    def handler(request: dict) -> tuple[int, bytes, int]:
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        chunks += [{"choices": [{"index": 0, **e}]} for e in events]
        chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, "[DONE]"]
        return _response(200, _sse(*chunks), split=40)  # several reads, so the chunks arrive at distinct times

    r = _send(handler, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5})
    assert r.success and r.output_tokens == tokens and r.generated_text == text
    assert r.ttft > 0 and len(r.itl) == tokens - 1 and r.latency == pytest.approx(r.ttft + sum(r.itl))


def test_error_null_is_no_error() -> None:
    def handler(request: dict) -> tuple[int, bytes, int]:
        return _response(200, _sse({"choices": [{"index": 0, "text": "a"}], "error": None},
                                   {"choices": [], "usage": {"completion_tokens": 1}, "error": None}, "[DONE]"))

    r = _send(handler, {"prompt": "x", "max_tokens": 1})
    assert r.success and r.output_tokens == 1 and r.output_tokens_source == "usage", r.error


def test_usage_without_any_output_chunk_is_an_error() -> None:
    def handler(request: dict) -> tuple[int, bytes, int]:
        return _response(200, _sse({"choices": [], "usage": {"completion_tokens": 4}}, "[DONE]"))

    r = _send(handler, {"prompt": "x", "max_tokens": 4})
    assert not r.success and "4 output tokens" in r.error


@pytest.mark.parametrize(
    "response, error",
    [
        ((400, json.dumps({"error": {"message": "max_tokens too big"}}).encode()), "HTTP 400: .*max_tokens too big"),
        ((200, _sse({"error": {"message": "engine died"}}, "[DONE]")), 'stream error: {"message": "engine died"}'),
        ((200, b"data: {broken\n\n"), "DecodeError: JSON is malformed"),
        ((200, _sse({"choices": [{"text": 5}]}, "[DONE]")), "ValidationError: Expected `str"),
        ((200, b"data: [DONE]"), None),  # a last line without its newline still ends the stream
        ((200, _sse({"choices": [{"text": "a"}]})), 1),  # a body that ends cleanly without [DONE] is complete
    ],
)
def test_failures_are_reported_not_raised(response: tuple[int, bytes], error: str | int | None) -> None:
    r = _send(lambda request: _response(*response), {"prompt": "x", "max_tokens": 1})
    if not isinstance(error, str):
        assert r.success and r.output_tokens == (error or 0), r.error
        return
    assert not r.success
    assert re.search(error, r.error), r.error


def test_connection_error_is_reported() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens on this port now

    async def go():
        async with aiohttp.ClientSession() as session:
            return await send_request(session, f"http://127.0.0.1:{port}/v1/completions", {"prompt": "x", "max_tokens": 1}, 1)

    r = asyncio.run(go())
    assert not r.success and r.error.startswith("ClientConnectorError"), r.error


def test_build_payload() -> None:
    req = SampleRequest([5, 6], 2, 7)
    body = build_payload("/v1/completions", "m", req, True, {"temperature": 0.0, "top_k": 3})
    assert body == {"model": "m", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.0, "top_k": 3, "ignore_eos": True, "prompt": [5, 6]}
    chat = build_payload("/v1/chat/completions", "m", SampleRequest("hi", 1, 4), False, {})
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat and "ignore_eos" not in chat
    # max_tokens is deprecated for chat; vLLM's bench sends max_completion_tokens
    assert chat["max_completion_tokens"] == 4 and "max_tokens" not in chat
    with pytest.raises(ValueError, match="--tokenizer"):
        build_payload("/v1/chat/completions", "m", req, False, {})


def test_cut_stream_fails_and_timeout_says_what() -> None:
    """A stream without [DONE] is complete only when its body ended cleanly: a cut connection is a failure. A
    request that hits the session's total timeout says so (it read "TimeoutError: " before)."""
    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse({"choices": [{"index": 0, "text": "a"}]}))
        request.transport.close()
        return resp

    async def stall(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse({"choices": [{"index": 0, "text": "a"}]}))
        await asyncio.sleep(30)
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/cut", cut)
        app.router.add_post("/stall", stall)
        async with TestServer(app) as server:
            async with aiohttp.ClientSession() as session:
                a = await send_request(session, str(server.make_url("/cut")), {"prompt": "x", "max_tokens": 2}, 1)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
                b = await send_request(session, str(server.make_url("/stall")), {"prompt": "x", "max_tokens": 2}, 1)
            return a, b

    cut_res, stall_res = asyncio.run(go())
    assert not cut_res.success and cut_res.error.startswith("ClientPayloadError"), cut_res.error
    assert not stall_res.success
    assert stall_res.error == "TimeoutError: no complete response within --request-timeout 0.3 s"
