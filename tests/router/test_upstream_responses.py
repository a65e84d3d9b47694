"""An upstream's ``/v1/responses`` through OpenAIUpstreamBackend against a fake upstream on loopback (aiohttp): its
output tokens counted from Responses' usage and events (not chat's ``completion_tokens`` / one per ``data:``), and
a stream broken mid-way ended as the local path ends one (``error`` then ``response.failed``, numbered on)."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web
from router_servers import serve_aiohttp

from strataserve.router.backends.openai_upstream import OpenAIUpstreamBackend
from strataserve.router.config import OpenAIUpstream
from strataserve.router.metrics import RouterMetrics, RouteTrace


def _event(seq: int, kind: str, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n".encode()


RESP = {"id": "resp_up1", "object": "response", "created_at": 1, "model": "remote-m", "status": "in_progress",
        "output": [], "usage": None}
ITEM = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
WHERE = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
HEAD = [_event(0, "response.created", response=RESP), _event(1, "response.in_progress", response=RESP),
        _event(2, "response.output_item.added", output_index=0, item=ITEM),
        _event(3, "response.content_part.added", **WHERE, part={"type": "output_text", "text": ""})]
#: three deltas carrying five tokens (a delta may hold several), then the closing events and the usage
DELTAS = [_event(4 + i, "response.output_text.delta", **WHERE, delta=d) for i, d in enumerate(["ab", "c", "de"])]
DONE_ITEM = {**ITEM, "status": "completed", "content": [{"type": "output_text", "text": "abcde", "annotations": []}]}
TAIL = [_event(7, "response.output_text.done", **WHERE, text="abcde"),
        _event(8, "response.content_part.done", **WHERE, part=DONE_ITEM["content"][0]),
        _event(9, "response.output_item.done", output_index=0, item=DONE_ITEM),
        _event(10, "response.completed", response={**RESP, "status": "completed", "output": [DONE_ITEM],
                                                   "usage": {"input_tokens": 3, "output_tokens": 5}})]


def _streaming(events: list[bytes], *, break_after: bool = False):
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(e)
            await asyncio.sleep(0.01)
        if break_after:
            request.transport.close()  # the upstream dies mid-stream
        return resp
    return handler


def _run(handler, body: dict, stream: bool) -> tuple[bytes, RouterMetrics]:
    async def run():
        runner, url = await serve_aiohttp(handler)
        spec = OpenAIUpstream(name="m", upstream="openai", url=[url], upstream_model="remote-m", timeout_s=5)
        b, metrics = OpenAIUpstreamBackend(spec), RouterMetrics(None)
        try:
            resp = await b.forward("/v1/responses", {"model": "m", **body}, stream=stream, prefix=None,
                                   trace=RouteTrace(metrics, b.name, "default", b.cost))
            data = b"".join([c async for c in resp.body_iterator]) if stream else resp.body
            return data, metrics
        finally:
            await b.stop()
            await runner.cleanup()
    return asyncio.run(run())


def _parse(data: bytes) -> list[tuple[str | None, dict]]:
    out = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def test_non_streamed_output_tokens_come_from_responses_usage():
    async def handler(request):
        return web.json_response({**RESP, "status": "completed", "usage": {"input_tokens": 3, "output_tokens": 7}})

    data, metrics = _run(handler, {"input": "hi"}, stream=False)
    assert json.loads(data)["model"] == "m"
    assert metrics.of("m", "default").output_tokens == 7


def test_streamed_output_tokens_are_the_final_usage_not_the_events():
    _, metrics = _run(_streaming(HEAD + DELTAS + TAIL), {"input": "hi", "stream": True}, stream=True)
    assert metrics.of("m", "default").output_tokens == 5  # not 11 events, nor 11 - 4 opening ones


def test_streamed_output_tokens_without_usage_count_the_deltas():
    last = _event(10, "response.completed", response={**RESP, "status": "completed", "output": [DONE_ITEM]})
    _, metrics = _run(_streaming(HEAD + DELTAS + TAIL[:3] + [last]), {"input": "hi", "stream": True}, stream=True)
    assert metrics.of("m", "default").output_tokens == 3  # one per delta event, the closing events not counted


def test_broken_stream_ends_with_error_then_response_failed():
    data, metrics = _run(_streaming(HEAD + DELTAS + TAIL[:3], break_after=True), {"input": "hi", "stream": True},
                         stream=True)
    events = _parse(data)
    assert all(kind == d["type"] for kind, d in events)  # every event has its event: line, as the local path's
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [d["type"] for _, d in events][-2:] == ["error", "response.failed"]
    err, failed = events[-2][1], events[-1][1]["response"]
    assert err["code"] == "upstream_error" and "broke" in err["message"]
    assert failed["id"] == "resp_up1" and failed["status"] == "failed" and failed["model"] == "m"
    assert failed["error"]["code"] == "server_error" and failed["output"] == [DONE_ITEM]
    assert b"[DONE]" not in data
    s = metrics.of("m", "default")
    assert s.outcomes["upstream_error"] == 1 and s.output_tokens == 3
