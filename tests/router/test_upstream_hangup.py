"""A client that hangs up while an upstream OpenAI model has not yet answered its headers: the router cancels the
upstream request (drops its connection, gives back the replica's outstanding count and the admission ticket)
whether the request streams or not, instead of holding them until the upstream answers."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web
from router_servers import serve_aiohttp
from starlette.requests import Request

from strataserve.api.errors import APIError
from strataserve.api.serving import Routed, forward
from strataserve.router.backends.openai_upstream import OpenAIUpstreamBackend
from strataserve.router.config import OpenAIUpstream
from strataserve.router.router import Router
from strataserve.router.sla import SLA

UPSTREAM_SLEEP = 5.0  # the upstream's delay before its headers; the client leaves long before
HANG_UP_AFTER = 0.3


def _client_request(body: dict, gone: asyncio.Event) -> Request:
    """A request whose body is ``body`` and whose client disconnects once ``gone`` is set (as uvicorn says it)."""
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
    return Request(scope, receive)


@pytest.mark.parametrize("stream", [False, True])
def test_hang_up_before_headers_cancels_the_upstream_request(stream):
    seen: dict[str, float] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        seen["arrived"] = time.monotonic()
        deadline = time.monotonic() + UPSTREAM_SLEEP
        while time.monotonic() < deadline:  # "thinking"; notes when the router drops the connection
            if request.transport is None or request.transport.is_closing():
                seen["dropped"] = time.monotonic()
                break
            await asyncio.sleep(0.02)
        return web.json_response({"id": "c", "choices": []})

    async def run():
        runner, url = await serve_aiohttp(handler)
        spec = OpenAIUpstream(name="m", upstream="openai", url=[url], upstream_model="remote-m", timeout_s=30)
        backend = OpenAIUpstreamBackend(spec)
        router = Router()
        routed = Routed(router, backend, SLA("default"))
        gone = asyncio.Event()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        asyncio.get_running_loop().call_later(HANG_UP_AFTER, gone.set)
        t0 = time.monotonic()
        try:
            with pytest.raises(APIError) as exc:
                await asyncio.wait_for(forward(routed, _client_request(body, gone), "/v1/chat/completions",
                                               stream=stream, prefix=None, first_events=1), UPSTREAM_SLEEP - 2)
            elapsed = time.monotonic() - t0
            await asyncio.sleep(0.3)  # the upstream's poll notices the closed connection
            return exc.value, elapsed, backend, router
        finally:
            await backend.stop()
            await runner.cleanup()

    err, elapsed, backend, router = asyncio.run(run())
    assert err.status == 499 and elapsed < 1.5, (err.status, elapsed)
    assert "dropped" in seen and seen["dropped"] - seen["arrived"] < 1.5  # the upstream saw the router leave
    assert backend.replicas.replicas[0].outstanding == 0
    ctl = router._admission(backend)
    assert not ctl._live and not ctl._pending  # the admission ticket is given back
    assert router.metrics.of("m", "default").outcomes["aborted"] == 1
