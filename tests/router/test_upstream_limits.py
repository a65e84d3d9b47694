"""--limit-max-tokens holds a request forwarded to an upstream OpenAI model that sets no output budget, as it
holds one to a local model: chat and responses (whose unset budget is the rest of the upstream's context) get the
limit; completions keep the protocol's default of 16 unless the limit is lower; a budget the client set is sent
as it is (one above the limit is refused at admission, before forwarding)."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from router_servers import serve_aiohttp
from starlette.requests import Request

from strataserve.api.limits import RequestLimits
from strataserve.api.serving import Routed, forward
from strataserve.router.backends.openai_upstream import OpenAIUpstreamBackend
from strataserve.router.config import OpenAIUpstream
from strataserve.router.router import Router
from strataserve.router.sla import SLA

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
RESPONSE = {"model": "m", "input": "hi"}


def _request(path: str, body: dict) -> Request:
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays until the answer
        return {}

    return Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}, receive)


def _forwarded(path: str, body: dict, limit: int | None) -> dict:
    """The JSON body the upstream received for ``body`` sent to ``path`` under ``--limit-max-tokens limit``."""
    seen: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [], "usage": {}})

    async def run():
        runner, url = await serve_aiohttp(handler)
        backend = OpenAIUpstreamBackend(OpenAIUpstream(name="m", upstream="openai", url=[url], timeout_s=10))
        routed = Routed(Router(), backend, SLA("default"), limits=RequestLimits(max_tokens=limit))
        try:
            await forward(routed, _request(path, body), path, stream=False, prefix=None)
        finally:
            await backend.stop()
            await runner.cleanup()

    asyncio.run(run())
    return seen[0]


@pytest.mark.parametrize("path, body, field", [("/v1/chat/completions", CHAT, "max_tokens"),
                                               ("/v1/responses", RESPONSE, "max_output_tokens")])
def test_an_unset_budget_is_held_to_the_limit(path, body, field):
    assert _forwarded(path, body, 50)[field] == 50
    assert _forwarded(path, {**body, field: None}, 50)[field] == 50  # null is unset
    assert field not in _forwarded(path, body, None)  # no limit: forwarded as sent


def test_a_set_budget_is_sent_as_it_is():
    got = _forwarded("/v1/chat/completions", {**CHAT, "max_completion_tokens": 7}, 50)
    assert got["max_completion_tokens"] == 7 and "max_tokens" not in got


def test_completions_keep_their_default_of_16_unless_the_limit_is_lower():
    assert "max_tokens" not in _forwarded("/v1/completions", COMPLETION, 50)
    assert _forwarded("/v1/completions", COMPLETION, 8)["max_tokens"] == 8
