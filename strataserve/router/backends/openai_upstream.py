"""An upstream OpenAI-compatible server (vLLM, SGLang, another strata) behind the router, with replicas.

Requests are forwarded as the client sent them (unknown fields included) with ``model`` renamed to the upstream's
name; answers come back byte for byte, streams event by event as they arrive (never buffered whole), with the
model renamed back. Errors: a connection failure marks the replica down and retries the request on another
replica (nothing was generated yet, so it is safe); no replica left is 503 naming the model; no first byte
within ``timeout_s`` is 504; an upstream 4xx that is the client's doing (400, 413, 422, 429) passes through, and
anything else the upstream answers becomes 502 with the upstream's message.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import aiohttp
import msgspec
from starlette.responses import Response, StreamingResponse

from strataserve.api.errors import APIError
from strataserve.api.formatting import sse
from strataserve.router.config import OpenAIUpstream
from strataserve.router.metrics import NullTrace, RouteTrace
from strataserve.router.backends.responses_stream import ResponsesStream
from strataserve.router.backends.upstream import UpstreamBackend
from strataserve.router.replicas import Replica
from strataserve.router.router import outcome_of
from strataserve.router.types import ModelCard, Payload

_PASS_THROUGH = (400, 413, 422, 429)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _upstream_message(body: bytes) -> str:
    return _upstream_error(body)[0]


def _upstream_error(body: bytes) -> tuple[str, str | None, str | int | None, str | None]:
    """The upstream's error (message, param, code, type): OpenAI's body, or the text of any other."""
    try:
        doc = msgspec.json.decode(body)
        err = doc.get("error", doc) if isinstance(doc, dict) else doc
        if not isinstance(err, dict):
            return str(err)[:500], None, None, None
        param, code, kind = err.get("param"), err.get("code"), err.get("type")
        return (str(err.get("message"))[:500], param if isinstance(param, str) else None,
                code if isinstance(code, (str, int)) and not isinstance(code, bool) else None,
                kind if isinstance(kind, str) else None)
    except (msgspec.DecodeError, AttributeError):
        return body[:500].decode(errors="replace"), None, None, None


class OpenAIUpstreamBackend(UpstreamBackend):
    payload = Payload.TEXT

    def __init__(self, spec: OpenAIUpstream, *, affinity_chars: int = 256, slack: int = 2,
                 health_interval_s: float = 2.0) -> None:
        super().__init__(spec.name, spec.url, gpu_cost_per_hour=spec.gpu_cost_per_hour,
                         connect_timeout_s=spec.connect_timeout_s, health_interval_s=health_interval_s,
                         affinity_chars=affinity_chars, slack=slack)
        self.spec = spec
        key = spec.api_key()
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        remote = spec.remote_name
        self._renames = ([(f'"model":"{remote}"'.encode(), f'"model":"{spec.name}"'.encode()),
                          (f'"model": "{remote}"'.encode(), f'"model": "{spec.name}"'.encode())]
                         if remote != spec.name else [])

    def card(self) -> ModelCard:
        return ModelCard(self.name, Payload.TEXT, "upstream-openai", self.ready(), self.unavailable_reason(),
                         extra=self.listing(self.spec.remote_name))

    # ------------------------------------------------------------------ requests
    def _rename(self, data: bytes) -> bytes:
        for old, new in self._renames:
            data = data.replace(old, new)
        return data

    async def _send(self, path: str, payload: bytes, prefix: str | None) -> tuple[Replica, aiohttp.ClientResponse]:
        tried: list[Replica] = []
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.spec.connect_timeout_s,
                                        sock_read=self.spec.timeout_s)
        while True:
            replica = self.replicas.choose(prefix, exclude=tuple(tried))
            if replica is None:
                raise APIError(503, self.replicas.unavailable_message(), code="model_unavailable",
                               type="service_unavailable", headers={"Retry-After": "2"})
            replica.outstanding += 1
            try:
                resp = await self.session.post(replica.url + path, data=payload, headers=self._headers,
                                               timeout=timeout)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                replica.outstanding -= 1
                # no answer in timeout_s is the upstream's slowness (504); not connecting in connect_timeout_s
                # is a connection failure: nothing was sent, so the next replica may take it
                if isinstance(exc, aiohttp.ServerTimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
                    raise self._timeout() from None
                replica.mark_down(f"{type(exc).__name__}: {exc}")
                tried.append(replica)
                continue
            except asyncio.TimeoutError:
                replica.outstanding -= 1
                raise self._timeout() from None
            except BaseException:
                replica.outstanding -= 1
                raise
            replica.served += 1
            return replica, resp

    def _timeout(self) -> APIError:
        return APIError(504, f"model `{self.name}`: the upstream server did not answer within "
                        f"{self.spec.timeout_s:g} s", code="upstream_timeout", type="upstream_error")

    async def _error(self, resp: aiohttp.ClientResponse) -> APIError:
        body = await resp.read()
        msg, param, code, kind = _upstream_error(body)
        if resp.status in _PASS_THROUGH:  # the client's own fault: its error as the upstream wrote it
            headers = {"Retry-After": resp.headers["Retry-After"]} if "Retry-After" in resp.headers else None
            return APIError(resp.status, msg, param=param, code=code, type=kind, headers=headers)
        if resp.status == 503:
            return APIError(503, f"model `{self.name}`: the upstream server is unavailable: {msg}",
                            code="upstream_unavailable", type="service_unavailable",
                            headers={"Retry-After": resp.headers.get("Retry-After", "1")})
        return APIError(502, f"model `{self.name}`: the upstream server answered {resp.status}: {msg}",
                        code="upstream_error", type="upstream_error")

    async def forward(self, path: str, body: dict[str, Any], *, stream: bool, prefix: str | None,
                      trace: RouteTrace | None, first_events: int = 1) -> Response:
        """Send one OpenAI request upstream; ``first_events`` is how many SSE events precede the first token
        (chat streams open with a role-only event)."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        trace = trace if trace is not None else NullTrace()  # type: ignore[assignment]
        payload = msgspec.json.encode({**body, "model": self.spec.remote_name})
        try:
            replica, resp = await self._send(path, payload, prefix)
        except BaseException as exc:  # no replica, a timeout, or the client hung up before the headers came
            trace.finish(outcome_of(exc))  # (an unfinished trace would hold its admission ticket for good)
            raise
        relayed = done = False  # a stream's relay gives the replica back when it ends; anything else, here
        try:
            if resp.status != 200:
                err = await self._error(resp)
                trace.finish("client_error" if err.status in _PASS_THROUGH else "upstream_error")
                done = True
                raise err
            if not stream:
                data = await self._read(resp)
                done = True
                # no first-token time: the whole answer came at once (it would pass for TTFT and skew admission)
                trace.finish("ok", _completion_tokens(data))
                return Response(self._rename(data), media_type=resp.headers.get("Content-Type", "application/json"))
            relayed = True
            responses = ResponsesStream(self.name) if path == "/v1/responses" else None
            return StreamingResponse(self._relay(replica, resp, trace, first_events, responses),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        except BaseException:
            if not trace.finished:
                trace.finish("upstream_error")
            raise
        finally:
            if not relayed:
                replica.outstanding -= 1
                # read to the end: the connection goes back to the pool; cut short (the client hung up, the
                # body broke): dropped, so the upstream aborts the work too
                resp.release() if done else resp.close()

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes:
        """A whole answer; a body that breaks or stalls after its headers is the upstream's fault (502 / 504)."""
        try:
            return await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
                raise self._timeout() from None
            raise APIError(502, f"model `{self.name}`: the upstream answer broke off: {type(exc).__name__}",
                           code="upstream_error", type="upstream_error") from None

    async def _relay(self, replica: Replica, resp: aiohttp.ClientResponse, trace: RouteTrace,
                     first_events: int, responses: ResponsesStream | None = None) -> AsyncIterator[bytes]:
        """Relay a stream event by event, counting its tokens (a Responses stream: ``responses`` reads its events);
        a stream that breaks ends with the route's own error form."""
        buf = b""
        events = 0
        outcome = "aborted"
        try:
            try:
                async for data in resp.content.iter_any():
                    buf += data
                    cut = buf.rfind(b"\n\n")
                    if cut < 0:
                        continue
                    out, buf = buf[: cut + 2], buf[cut + 2:]
                    if responses is not None:
                        trace.on_tokens(responses.feed(out))
                    else:
                        # events that carry tokens: not [DONE], nor the usage-only chunk (no choices) at the end
                        n = out.count(b"data:") - out.count(b'"choices":[]')
                        if b"[DONE]" in out:
                            n -= 1
                        new = max(0, events + n - first_events) - max(0, events - first_events)
                        events += n
                        trace.on_tokens(new)
                    yield self._rename(out) if self._renames else out
                if buf:
                    if responses is not None:
                        trace.on_tokens(responses.feed(buf))
                    yield self._rename(buf)
                outcome = "ok"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                outcome = "upstream_error"
                if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionError)):
                    replica.mark_down(f"{type(exc).__name__} mid-stream")
                err = (self._timeout() if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError))
                       else APIError(502, f"model `{self.name}`: the upstream stream broke: {type(exc).__name__}",
                                     code="upstream_error", type="upstream_error"))
                if responses is not None:  # an error event, then response.failed (no [DONE]), as the local path
                    yield self._rename(responses.failure(err))
                else:
                    yield sse(err.body()) + b"data: [DONE]\n\n"  # as a local engine's failure ends a stream
        finally:
            replica.outstanding -= 1
            if outcome == "ok":
                resp.release()  # read to the end: the connection goes back to the pool
            else:
                resp.close()  # client gone or stream broken: drop the connection so the upstream aborts too
            # a Responses stream's final usage is the count (its deltas may carry several tokens each)
            trace.finish(outcome, responses.output_tokens if responses is not None else None)


def _completion_tokens(data: bytes) -> int | None:
    """The output tokens of a whole answer: chat / completions' ``completion_tokens``, Responses' ``output_tokens``."""
    try:
        usage = msgspec.json.decode(data).get("usage") or {}
        return int(usage.get("completion_tokens", usage.get("output_tokens")))
    except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
        return None
