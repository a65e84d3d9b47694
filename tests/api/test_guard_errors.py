"""The guard in front of every route answers an exception no route handled with a 500 itself (an OpenAI body, or
KServe's on /v2), so the server keeps the client's connection; once a response has started, the exception goes on
up, since only dropping the connection can tell the client its body is cut short."""
from __future__ import annotations

import asyncio
import json

import pytest

from strataserve.api.door import Door
from strataserve.api.middleware import GuardMiddleware


def _run(app, path: str, method: str = "GET") -> list[dict]:
    sent: list[dict] = []
    scope = {"type": "http", "path": path, "method": method, "headers": [(b"content-length", b"2")]}
    bodies = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive():
        return bodies.pop() if bodies else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(GuardMiddleware(app, door=Door())(scope, receive, send))
    return sent


async def _raises(scope, receive, send):
    raise TypeError("a bug")


async def _raises_midway(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    raise TypeError("a bug")


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_unhandled_error_is_a_500_body(method):
    start, body = _run(_raises, "/v1/completions", method)
    assert start["status"] == 500
    err = json.loads(body["body"])["error"]
    assert err["type"] == "internal_server_error" and "TypeError: a bug" in err["message"]
    start, body = _run(_raises, "/v2/models/m/infer", method)
    assert start["status"] == 500 and json.loads(body["body"]) == {"error": "internal error: TypeError: a bug"}


def test_error_after_the_response_started_propagates():
    with pytest.raises(TypeError):
        _run(_raises_midway, "/v1/completions", "POST")
