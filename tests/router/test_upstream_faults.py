"""OpenAIUpstreamBackend against small fake upstreams on loopback (aiohttp): status mapping, failover to a live
replica when one refuses connections, the request body forwarded as sent, and a stream broken mid-way."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from router_servers import free_port

from strataserve.api.errors import APIError
from strataserve.router.backends.openai_upstream import OpenAIUpstreamBackend
from strataserve.router.config import OpenAIUpstream
from strataserve.router.metrics import RouterMetrics, RouteTrace


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _backend(urls: list[str], **kw) -> tuple[OpenAIUpstreamBackend, RouterMetrics]:
    spec = OpenAIUpstream(name="m", upstream="openai", url=urls, upstream_model="remote-m", timeout_s=2, **kw)
    return OpenAIUpstreamBackend(spec), RouterMetrics(None)


def _trace(b: OpenAIUpstreamBackend, metrics: RouterMetrics) -> RouteTrace:
    return RouteTrace(metrics, b.name, "default", b.cost)


@pytest.mark.parametrize("status,expect", [(400, 400), (422, 422), (429, 429), (500, 502), (401, 502),
                                           (503, 503), (404, 502)])
def test_upstream_status_mapping(status, expect):
    async def handler(request):
        return web.json_response({"error": {"message": f"upstream said {status}"}}, status=status,
                                 headers={"Retry-After": "7"})

    async def run():
        runner, url = await _serve(handler)
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
        runner, url = await _serve(handler)
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
        runner, url = await _serve(handler)
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
