"""Pure-ASGI guard in front of every route (no BaseHTTPMiddleware: it would buffer SSE streams), enforcing the
``Door`` (``api/door.py``): API keys, the drain state, the per-key request rate and the queued-bytes budget.

- Body limit: a declared Content-Length over the limit is refused before reading; otherwise the body is read
  (counting the actual bytes, so a lying or chunked upload is caught too) and replayed to the app.
- Rates: only POSTs (work: inference, tokenizing, repository control) count against a key's requests per minute.
- API keys: with any key set (``--api-key``, or keys mapped to SLA classes), every route except the open ones
  needs ``Authorization: Bearer <key>``. Open: the probes (``/health``, ``/v2/health/*``), ``/openapi.json`` and
  the docs, and ``/metrics`` unless ``--metrics-require-key``, because orchestrators and scrapers probe them
  without credentials; and the web console's page and static files (``/``, ``/console/static/``), which hold no
  data: the page asks for the key and sends it to the data routes.
- Drain: while the server drains, the probes ``/health`` and ``/v2/health/ready`` answer 503 and every other
  route 503 + Retry-After; requests already admitted run to the end (they count in ``Door.inflight``).
- JSON text must be Unicode: a lone UTF-16 surrogate escape (``"\\ud83d"``) is valid JSON syntax that Python's
  parser lets through, but no tokenizer, codec or encoder downstream can take it, so it is refused here with a 400.
- An exception no route handled gets its 500 here, before the response starts. Starlette's outermost handler
  would send the same body and then re-raise, and the server would drop the client's kept-alive connection.
- When the drain's time is up, the server cancels what is still in flight: an SSE stream then ends with a last
  error event (and ``[DONE]``), a request not yet answered (its body still arriving, or its answer not started)
  gets a 503, instead of a cut connection and a traceback per request in the log.
"""
from __future__ import annotations

from typing import Any, Callable

import asyncio
import json
import logging

import msgspec

from strataserve.api.door import Door, draining_error
from strataserve.api.errors import APIError

log = logging.getLogger("strataserve.api")

Scope = dict[str, Any]
Message = dict[str, Any]
_DRAIN_PROBES = frozenset({"/health", "/v2/health/ready"})


async def _send_error(send: Callable, err: APIError, path: str = "") -> None:
    # KServe clients (tritonclient) read {"error": "<message>"}; OpenAI clients the nested object.
    body = msgspec.json.encode({"error": err.message}) if path.startswith("/v2") else err.response().body
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for k, v in (err.headers or {}).items():
        headers.append((k.lower().encode(), v.encode()))
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app: Callable, *, door: Door) -> None:
        self.app = app
        self.door = door
        self.max_body_bytes = door.config.max_body_bytes

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        door, path = self.door, scope["path"]
        if door.is_open(path):
            if door.draining and path in _DRAIN_PROBES:
                await _send_error(send, draining_error(), path)
                return
            await _answering_500(self.app, scope, receive, send, door)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization")
        try:
            door.authorize(auth)
            declared = headers.get(b"content-length")
            size = int(declared) if declared is not None and declared.isdigit() else 0
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            door.admit(auth, size, charge=scope["method"] == "POST")
        except APIError as err:
            await _send_error(send, err, path)
            return
        door.enter(size)
        try:
            await self._guarded(scope, receive, send, size)
        finally:
            door.leave(size)

    async def _guarded(self, scope: Scope, receive: Callable, send: Callable, declared: int) -> None:
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await _answering_500(self.app, scope, receive, send, self.door)
            return
        limit = self.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await receive()
            except asyncio.CancelledError:
                if not self.door.draining:
                    raise
                # The drain's time is up while the client was still sending its body: a 503 that says so, not a
                # traceback and a 500 in the log (as a stream cut short gets its last event).
                await _send_error(send, _stopped_error(), scope["path"])
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, _too_large(limit), scope["path"])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        extra = max(0, size - declared)  # a chunked or understated upload: count what actually arrived
        if extra:
            try:
                self.door.reserve_bytes(extra)
            except APIError as err:
                await _send_error(send, err, scope["path"])
                return
        body = b"".join(chunks)
        surrogate = _lone_surrogate(body, scope)
        if surrogate is not None:
            self.door.queued_bytes -= extra
            await _send_error(send, surrogate, scope["path"])
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        try:
            await _answering_500(self.app, scope, replay, send, self.door)
        finally:
            self.door.queued_bytes -= extra


async def _answering_500(app: Callable, scope: Scope, receive: Callable, send: Callable, door: Door) -> None:
    started = False
    sse = False

    async def tracking_send(message: Message) -> None:
        nonlocal started, sse
        if message["type"] == "http.response.start":
            started = True
            sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"])
        await send(message)

    try:
        await app(scope, receive, tracking_send)
    except asyncio.CancelledError:
        if not door.draining or (started and not sse):
            raise
        # The drain's time is up and the server is stopping: a stream ends with a last error event (and the
        # OpenAI routes' [DONE]), a request not yet answered gets a 503, rather than a cut connection and a logged
        # traceback per request.
        if started:
            await send({"type": "http.response.body", "body": _stopped_event(scope["path"]), "more_body": False})
        else:
            await _send_error(send, _stopped_error(), scope["path"])
    except Exception as exc:
        if started:  # the status line is out: only dropping the connection tells the client it is cut short
            raise
        log.exception("unhandled error while serving %s", scope["path"])
        await _send_error(send, APIError(500, f"internal error: {type(exc).__name__}: {exc}"), scope["path"])


def _stopped_error() -> APIError:
    return APIError(503, "the server stopped before this request finished (its shutdown timeout passed); retry "
                    "elsewhere", code="server_shutdown", type="service_unavailable", headers={"Connection": "close"})


def _stopped_event(path: str) -> bytes:
    err = _stopped_error()
    if path.startswith("/v2"):
        return b"data: " + msgspec.json.encode({"error": err.message}) + b"\n\n"
    return b"data: " + msgspec.json.encode(err.body()) + b"\n\ndata: [DONE]\n\n"


def _lone_surrogate(body: bytes, scope: Scope) -> APIError | None:
    """A 400 for a JSON body that escapes half of a UTF-16 surrogate pair, else None. The byte scan finds every
    ``\\ud8xx``-``\\udfxx`` escape (emoji from clients that escape non-ASCII text too); msgspec then refuses only the
    unpaired ones. KServe's binary-data bodies are skipped: their tail is raw tensor bytes."""
    if b"\\ud" not in body and b"\\uD" not in body:
        return None
    for name, _ in scope["headers"]:
        if name == b"inference-header-content-length":
            return None
    try:
        msgspec.json.decode(body)
        return None
    except msgspec.DecodeError:
        pass
    try:
        json.loads(body)
    except ValueError:
        return None  # malformed JSON anyway: the route's own parser says where
    return APIError(400, "the request's JSON holds a lone UTF-16 surrogate escape (half of a pair, such as "
                    "\"\\ud83d\" alone); text must be valid Unicode", code="invalid_unicode")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the server's limit of {limit} bytes",
                    code="request_too_large")
