"""Pure-ASGI guards in front of every route (no BaseHTTPMiddleware: it would buffer SSE streams).

- Body limit: a declared Content-Length over the limit is refused before reading; otherwise the body is read
  (counting the actual bytes, so a lying or chunked upload is caught too) and replayed to the app.
- API keys: with any key set (``--api-key``, or keys mapped to SLA classes), every route except the open ones needs ``Authorization: Bearer <key>``.
  Open: health and metrics probes (``/health``, ``/metrics``, ``/v2/health/*``), ``/openapi.json`` and the docs,
  because orchestrators and scrapers probe them without credentials; and the web console's page and static files
  (``/``, ``/console/static/``), which hold no data: the page asks for the key and sends it to the data routes.
"""
from __future__ import annotations

import hmac
from typing import Any, Callable

from strataserve.api.errors import APIError

Scope = dict[str, Any]
Message = dict[str, Any]

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
                        "/v2/health/live", "/v2/health/ready", "/"})
OPEN_PREFIXES = ("/console/static/",)


async def _send_error(send: Callable, err: APIError) -> None:
    body = err.response().body
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for k, v in (err.headers or {}).items():
        headers.append((k.lower().encode(), v.encode()))
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app: Callable, *, api_keys: tuple[str, ...] = (), max_body_bytes: int) -> None:
        self.app = app
        self.expected = [f"Bearer {k}".encode() for k in api_keys] or None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.expected is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            got = headers.get(b"authorization", b"")
            # Compare with every key (no early exit), each in constant time, so timing tells nothing.
            ok = False
            for key in self.expected:
                ok |= hmac.compare_digest(got, key)
            if not ok:
                await _send_error(send, APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                                 "<key>'", code="invalid_api_key"))
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_error(send, _too_large(limit))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, _too_large(limit))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the server's limit of {limit} bytes",
                    code="request_too_large")
