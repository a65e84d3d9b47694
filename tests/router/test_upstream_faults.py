"""OpenAIUpstreamBackend against small fake upstreams on loopback (aiohttp): status mapping, failover to a live
replica when one refuses connections, the request body forwarded as sent, and a stream broken mid-way."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from router_servers import free_port, serve_aiohttp

from strataserve.api.errors import APIError
from strataserve.router.backends.openai_upstream import OpenAIUpstreamBackend
from strataserve.router.config import OpenAIUpstream
from strataserve.router.metrics import RouterMetrics, RouteTrace


def _backend(urls: list[str], **kw) -> tuple[OpenAIUpstreamBackend, RouterMetrics]:
    spec = OpenAIUpstream(name="m", upstream="openai", url=urls, upstream_model="remote-m", timeout_s=2, **kw)
    return OpenAIUpstreamBackend(spec), RouterMetrics(None)


def _trace(b: OpenAIUpstreamBackend, metrics: RouterMetrics) -> RouteTrace:
    return RouteTrace(metrics, b.name, "default", b.cost)


@pytest.mark.parametrize("status,expect", [(400, 400), (422, 422), (429, 429), (500, 502), (401, 502),
                                           (503, 503), (404, 502)])
def test_upstream_status_mapping(status, expect):
    async def handler(request):
        return web.json_response({"error": {"message": f"upstream said {status}", "param": "max_tokens",
                                            "code": "context_length_exceeded" if status == 400 else None}},
                                 status=status, headers={"Retry-After": "7"})

    async def run():
        runner, url = await serve_aiohttp(handler)
        b, metrics = _backend([url])
        try:
            with pytest.raises(APIError) as exc:
                await b.forward("/v1/completions", {"model": "m", "prompt": "x"}, stream=False, prefix=None,
                                trace=_trace(b, metrics))
            return exc.value, metrics
        finally:
            await b.stop()
            await runner.cleanup()

    err, metrics = asyncio.run(run())
    assert err.status == expect and f"upstream said {status}" in err.message
    if expect == 400:  # the client's fault: the upstream's param and code come through
        assert err.param == "max_tokens" and err.code == "context_length_exceeded"
    if expect in (429, 503):
        assert err.headers["Retry-After"] == "7"  # the upstream's own advice is passed on
    outcome = "client_error" if expect < 500 else "upstream_error"
    assert metrics.of("m", "default").outcomes[outcome] == 1


def test_failover_to_a_live_replica_and_body_forwarded_as_sent():
    seen = []

    async def handler(request):
        seen.append(await request.json())
        return web.json_response({"id": "x", "model": "remote-m", "usage": {"completion_tokens": 3},
                                  "choices": [{"text": "ok"}]})

    async def run():
        runner, url = await serve_aiohttp(handler)
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        b, metrics = _backend([dead, url])
        b.replicas.replicas[1].outstanding = 5  # least-outstanding picks the dead one first
        try:
            resp = await b.forward("/v1/completions", {"model": "m", "prompt": "x", "vendor_field": [1, 2]},
                                   stream=False, prefix=None, trace=_trace(b, metrics))
            return resp, b, metrics
        finally:
            await b.stop()
            await runner.cleanup()

    resp, b, metrics = asyncio.run(run())
    body = json.loads(resp.body)
    assert body["model"] == "m" and body["choices"][0]["text"] == "ok"  # renamed back
    assert seen == [{"model": "remote-m", "prompt": "x", "vendor_field": [1, 2]}]
    assert not b.replicas.replicas[0].healthy and "Connect" in b.replicas.replicas[0].last_error
    assert metrics.of("m", "default").output_tokens == 3


def test_stream_broken_midway_ends_with_an_error_event():
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"model":"remote-m","choices":[{"text":"a"}]}\n\n')
        await asyncio.sleep(0.05)
        request.transport.close()  # the upstream dies mid-stream
        return resp

    async def run():
        runner, url = await serve_aiohttp(handler)
        b, metrics = _backend([url])
        try:
            resp = await b.forward("/v1/completions", {"model": "m", "prompt": "x", "stream": True}, stream=True,
                                   prefix=None, trace=_trace(b, metrics), first_events=0)
            chunks = [c async for c in resp.body_iterator]
            return chunks, metrics
        finally:
            await b.stop()
            await runner.cleanup()

    chunks, metrics = asyncio.run(run())
    text = b"".join(chunks).decode()
    assert '"model":"m"' in text and '"error"' in text and "upstream" in text
    assert text.endswith("data: [DONE]\n\n")  # as a local engine's failure ends: clients waiting for it stop
    assert metrics.of("m", "default").outcomes["upstream_error"] == 1


@pytest.mark.parametrize("fault,status", [("breaks", 502), ("stalls", 504)])
def test_a_whole_answer_that_breaks_or_stalls_is_the_upstreams_fault(fault, status):
    """After its headers, the body of a non-streamed answer breaks off or stalls past timeout_s: 502 / 504 naming
    the upstream (it was a 500 "internal error"); the trace records no first token for a whole answer."""
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "400"})
        await resp.prepare(request)
        await resp.write(b'{"choices": [')
        if fault == "breaks":
            request.transport.close()
        else:
            await asyncio.sleep(5)
        return resp

    async def forward(b, trace):
        with pytest.raises(APIError) as exc:
            await b.forward("/v1/completions", {"model": "m", "prompt": "x"}, stream=False, prefix=None, trace=trace)
        return exc.value, b.replicas.replicas

    (err, replicas), metrics, _ = asyncio.run(_once(handler, forward))
    assert err.status == status and "upstream" in err.message
    series = metrics.of("m", "default")
    assert series.outcomes["upstream_error"] == 1 and sum(series.ttft.counts) == 0
    assert [r.outstanding for r in replicas] == [0]


def test_streamed_usage_chunk_is_no_token():
    """The usage-only chunk (no choices) a stream ends with is not counted as a generated token."""
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b"):
            await resp.write(b'data: {"choices":[{"index":0,"text":"%s"}]}\n\n' % text.encode())
        await resp.write(b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n')
        return resp

    async def forward(b, trace):
        resp = await b.forward("/v1/completions", {"model": "m", "prompt": "x", "stream": True}, stream=True,
                               prefix=None, trace=trace, first_events=0)
        return [c async for c in resp.body_iterator]

    assert asyncio.run(_once(handler, forward))[2].tokens == 2


async def _once(handler, forward) -> tuple:
    """``forward(backend, trace)`` against one fake upstream ``handler``: (its result, the metrics, the trace)."""
    runner, url = await serve_aiohttp(handler)
    b, metrics = _backend([url])
    trace = _trace(b, metrics)
    try:
        return await forward(b, trace), metrics, trace
    finally:
        await b.stop()
        await runner.cleanup()


def test_upstream_requests_are_charged_tokens_as_local_ones():
    """The key's tokens per minute: the prompt (4 characters a token) and n times the most the request may write
    (1024 when it sets no limit); before, upstream models were charged nothing."""
    from strataserve.api.serving import UPSTREAM_DEFAULT_OUTPUT, _upstream_charge

    assert _upstream_charge({"prompt": "x" * 400, "max_tokens": 50, "n": 2}) == 100 + 100
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10}
    assert _upstream_charge(chat) > 10
    assert _upstream_charge({"prompt": "abcd"}) == 1 + UPSTREAM_DEFAULT_OUTPUT


def test_an_upstream_error_body_comes_through_as_written():
    async def handler(request):
        return web.json_response({"error": {"message": "bad tool_choice", "type": "BadRequestError",
                                            "param": "tool_choice", "code": None}}, status=400)

    async def forward(b, trace):
        with pytest.raises(APIError) as exc:
            await b.forward("/v1/chat/completions", {"model": "m"}, stream=False, prefix=None, trace=trace)
        return exc.value.body()["error"]

    assert asyncio.run(_once(handler, forward))[0] == {"message": "bad tool_choice", "type": "BadRequestError",
                                                       "param": "tool_choice", "code": None}


def test_a_client_hanging_up_before_the_headers_ends_its_trace_and_admission_ticket():
    """Cancelled while the upstream has not answered: counted as aborted, and its admission ticket released (a
    leaked ticket counted as work ahead for good, and a class with a TTFT target was refused from then on)."""
    from strataserve.router.admission import AdmissionController

    async def handler(request):
        await asyncio.sleep(3)  # longer than the wait; short, as cleanup waits for it

    async def run():
        runner, url = await serve_aiohttp(handler)
        b, metrics = _backend([url])
        ctl = AdmissionController("m")
        trace = RouteTrace(metrics, b.name, "default", b.cost, ctl, ctl.enter(0, 10))
        try:
            task = asyncio.ensure_future(b.forward("/v1/completions", {"model": "m"}, stream=False, prefix=None,
                                                   trace=trace))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return metrics.of("m", "default").outcomes, ctl.work_ahead(100), b.replicas.replicas[0].outstanding
        finally:
            await b.stop()
            await runner.cleanup()

    outcomes, ahead, outstanding = asyncio.run(run())
    assert outcomes["aborted"] == 1 and ahead == 0 and outstanding == 0


def test_a_replica_that_does_not_connect_in_time_is_failed_over():
    """connect_timeout_s passing is a connection failure (nothing was sent): the replica is marked down and the
    request goes to the next one, not a 504. The dead replica is a listener whose accept queue is full."""
    import socket

    async def handler(request):
        return web.json_response({"id": "x", "model": "remote-m", "usage": {"completion_tokens": 1},
                                  "choices": [{"text": "ok"}]})

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    fill = []
    for _ in range(4):  # fill the queue: further SYNs are dropped, so connects hang
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(hole.getsockname())
        fill.append(c)

    async def run():
        runner, url = await serve_aiohttp(handler)
        b, metrics = _backend([f"http://127.0.0.1:{hole.getsockname()[1]}", url], connect_timeout_s=0.3)
        b.replicas.replicas[1].outstanding = 5  # least-outstanding tries the black hole first
        try:
            resp = await b.forward("/v1/completions", {"model": "m"}, stream=False, prefix=None,
                                   trace=_trace(b, metrics))
            return resp.status_code, json.loads(resp.body), b.replicas.replicas[0].healthy
        finally:
            await b.stop()
            await runner.cleanup()

    try:
        status, body, first_healthy = asyncio.run(run())
    finally:
        for s in (hole, *fill):
            s.close()
    assert status == 200 and body["choices"][0]["text"] == "ok" and not first_healthy


def test_a_compressed_answer_is_relayed_decoded():
    """An upstream behind a gzip proxy that compresses whatever the client accepts: the answer arrives as JSON."""
    import gzip

    async def handler(request):
        body = gzip.compress(json.dumps({"id": "x", "model": "remote-m", "usage": {"completion_tokens": 2},
                                         "choices": [{"text": "hello"}]}).encode())
        return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    async def forward(b, trace):
        return json.loads((await b.forward("/v1/completions", {"model": "m"}, stream=False, prefix=None,
                                           trace=trace)).body)

    body, metrics, _ = asyncio.run(_once(handler, forward))
    tokens = metrics.of("m", "default").output_tokens
    assert body["model"] == "m" and body["choices"][0]["text"] == "hello" and tokens == 2


def test_no_headers_in_time_counts_as_the_upstreams_fault():
    """504 upstream_timeout is one outcome, upstream_error, whether the upstream stalled before or after its
    headers (before: it was counted as unavailable)."""
    async def handler(request):
        await asyncio.sleep(3)  # longer than the wait; short, as cleanup waits for it

    async def forward(b, trace):
        with pytest.raises(APIError) as exc:
            await b.forward("/v1/completions", {"model": "m"}, stream=False, prefix=None, trace=trace)
        return exc.value.status

    status, metrics, _ = asyncio.run(_once(handler, forward))
    outcomes = metrics.of("m", "default").outcomes
    assert status == 504 and outcomes["upstream_error"] == 1 and outcomes["unavailable"] == 0
