"""Relaying an upstream's SSE stream through OpenAIUpstreamBackend (fake upstreams on loopback): events relayed
one by one whatever their line endings (LF, CRLF, CR), the events before a break kept, an event that never ends
bounded, and output tokens read from the events' JSON and the upstream's usage."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from router_servers import serve_aiohttp

from strataserve.router.backends.openai_upstream import OpenAIUpstreamBackend
from strataserve.router.backends.responses_stream import ResponsesStream
from strataserve.router.backends.sse_events import EventTooLarge, SSESplitter
from strataserve.router.config import OpenAIUpstream
from strataserve.router.metrics import RouterMetrics, RouteTrace

SEPARATORS = {"lf": (b"\n", b"\n\n"), "crlf": (b"\r\n", b"\r\n\r\n"), "cr": (b"\r", b"\r\r")}


def _chunk(text: str, nl: bytes, sep: bytes) -> bytes:
    data = json.dumps({"model": "remote-m", "choices": [{"index": 0, "text": text}]}).encode()
    return b"event: message" + nl + b"data: " + data + sep


async def _relay(handler, body: dict, path: str = "/v1/completions", on_chunk=None, **attrs):
    """Forward one streamed request to ``handler``; (the chunks the client got, the metrics, the trace)."""
    runner, url = await serve_aiohttp(handler)
    spec = OpenAIUpstream(name="m", upstream="openai", url=[url], upstream_model="remote-m", timeout_s=5)
    b, metrics = OpenAIUpstreamBackend(spec), RouterMetrics(None)
    for k, v in attrs.items():
        setattr(b, k, v)
    trace = RouteTrace(metrics, b.name, "default", b.cost)
    try:
        resp = await b.forward(path, {"model": "m", "stream": True, **body}, stream=True, prefix=None,
                               trace=trace, first_events=0)
        chunks = []
        async for c in resp.body_iterator:
            chunks.append(c)
            if on_chunk is not None:
                on_chunk(c)
        return chunks, metrics, trace
    finally:
        await b.stop()
        await runner.cleanup()


@pytest.mark.parametrize("kind", list(SEPARATORS))
def test_events_are_relayed_one_by_one_whatever_their_line_endings(kind):
    """CRLF-ended events (sse-starlette's default) were held until the stream ended, and sent in one piece. The
    upstream here sends its next event only once the client has the previous one: buffering would deadlock."""
    nl, sep = SEPARATORS[kind]
    got = asyncio.Event()

    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b", "c"):
            got.clear()
            await resp.write(_chunk(text, nl, sep))
            await asyncio.wait_for(got.wait(), 2)  # the client has it before the next is written
        await resp.write(b"data: [DONE]" + sep)
        return resp

    chunks, metrics, trace = asyncio.run(_relay(handler, {}, on_chunk=lambda c: got.set()))
    assert len(chunks) == 4 and all(c.endswith(b"\n\n") and b"\r" not in c for c in chunks)
    assert [json.loads(c.split(b"data: ")[1])["choices"][0]["text"] for c in chunks[:3]] == ["a", "b", "c"]
    assert b'"model": "m"' in chunks[0] and chunks[3] == b"data: [DONE]\n\n"
    assert trace.tokens == 3 and metrics.of("m", "default").outcomes["ok"] == 1


@pytest.mark.parametrize("kind", ["crlf", "cr"])
def test_the_events_before_a_break_reach_the_client(kind):
    nl, sep = SEPARATORS[kind]

    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b"):
            await resp.write(_chunk(text, nl, sep))
        await asyncio.sleep(0.1)
        request.transport.close()  # the upstream dies mid-stream
        return resp

    chunks, metrics, _ = asyncio.run(_relay(handler, {}))
    text = b"".join(chunks).decode()
    assert text.count('"text": "a"') == 1 and text.count('"text": "b"') == 1
    assert '"error"' in text.split('"text": "b"')[1] and text.endswith("data: [DONE]\n\n")
    assert metrics.of("m", "default").outcomes["upstream_error"] == 1


def test_an_event_that_never_ends_is_bounded():
    """An upstream that never sends a blank line was buffered without limit; past the bound the stream ends with
    an error event naming the fault, after the events already relayed."""
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk("a", b"\n", b"\n\n"))
        for _ in range(100):
            await resp.write(b"data: " + b"x" * 1000 + b"\n")  # one event, never ended
            await asyncio.sleep(0)
        await asyncio.sleep(2)
        return resp

    chunks, metrics, _ = asyncio.run(_relay(handler, {}, max_event_bytes=16_000))
    text = b"".join(chunks).decode()
    assert '"text": "a"' in text and "xxxx" not in text
    assert "without ending" in text and text.endswith("data: [DONE]\n\n")
    assert metrics.of("m", "default").outcomes["upstream_error"] == 1


def test_responses_events_with_crlf_are_read():
    """A Responses stream in CRLF: its deltas and final usage are read (the split was on LF LF only)."""
    def ev(seq, kind, **f):
        return (f"event: {kind}\r\ndata: " + json.dumps({"type": kind, "sequence_number": seq, **f}) +
                "\r\n\r\n").encode()

    done = {"id": "r", "object": "response", "status": "completed", "usage": {"output_tokens": 5}}
    stream = ResponsesStream("m")
    tokens = stream.feed(ev(0, "response.output_text.delta", delta="ab") + ev(1, "response.output_text.delta",
                                                                               delta="c"))
    stream.feed(ev(2, "response.completed", response=done))
    assert tokens == 2 and stream.seq == 2 and stream.output_tokens == 5


def test_splitter_joins_a_crlf_cut_between_reads():
    s = SSESplitter(100)
    assert s.feed(b"data: 1\r") == [] and s.feed(b"\n\r") == [b"data: 1\n\n"]
    assert s.feed(b"\ndata: 2\r\r") == [b"data: 2\n\n"]  # CR CR: an event ended by lone CRs
    assert s.feed(b": ping\n\n\n\ndata: 3") == [b": ping\n\n"] and s.close() == b"data: 3\n\n"
    with pytest.raises(EventTooLarge):
        s.feed(b"x" * 101)


@pytest.mark.parametrize("usage", [None, 9])
def test_tokens_come_from_the_events_json_and_the_upstreams_usage(usage):
    """JSON with spaces after the colons (Python's json.dumps): the usage-only chunk (``"choices": []``) was
    counted as a token; and the upstream's usage.completion_tokens, when it gives one, is the count."""
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b"):
            await resp.write(_chunk(text, b"\n", b"\n\n"))
        last = {"model": "remote-m", "choices": [], "usage": {"prompt_tokens": 1} if usage is None else
                {"prompt_tokens": 1, "completion_tokens": usage}}
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    _, metrics, trace = asyncio.run(_relay(handler, {}))
    assert trace.tokens == 2
    assert metrics.of("m", "default").output_tokens == (2 if usage is None else usage)
