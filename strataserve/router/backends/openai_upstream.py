"""An upstream OpenAI-compatible server (vLLM, SGLang, another strata) behind the router, with replicas.

Requests are forwarded as the client sent them (unknown fields included) with ``model`` renamed to the upstream's
name; answers come back byte for byte, streams event by event as they arrive (never buffered whole; events ended
by LF, CRLF or CR blank lines alike, ``sse_events.py``), with the model renamed back.

Failures, as a user of Envoy or nginx in front of several replicas expects (details: ``upstream_retry.py``):

- a replica that cannot be connected to (nothing was sent) is marked down and the request goes to the next one;
- a replica that closes the connection without answering, or answers 500 / 502 / 503 / 504, before any byte was
  relayed: the request is tried once more, on another replica, and the replica stays in rotation (one request's
  failure may be that request's doing: a "query of death" must not take every replica out for everyone); five
  failed requests in a row with no success between do mark it down, until its next good health probe;
- when every try fails, the last upstream error is the answer; no replica left is 503 naming the model; no answer
  within ``timeout_s`` is 504 (not retried: the upstream may still be working on it);
- an upstream 4xx that is the client's doing (400, 413, 422, 429) passes through; any other answer becomes 502
  with the upstream's message, and so does a 200 whose body is not JSON (an HTML error page from a proxy);
- a stream that breaks, or sends an event past ``MAX_EVENT_BYTES`` without ending it, ends with an error event
  after the events already relayed.

Metrics: a stream's tokens are counted from its events' JSON, the upstream's ``usage.completion_tokens`` winning
when it reports one; a whole answer's from its usage. Admission: a non-streamed request stops counting as queued
work at its expected first-token time (``plain_admission.py``).
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
from strataserve.router.backends.plain_admission import PlainStart
from strataserve.router.backends.responses_stream import ResponsesStream
from strataserve.router.backends.sse_events import MAX_EVENT_BYTES, EventTooLarge, SSESplitter
from strataserve.router.backends.stream_tokens import StreamTokens
from strataserve.router.backends.upstream import UpstreamBackend
from strataserve.router.backends.upstream_retry import (RETRY_STATUSES, Outliers, after_connection_error,
                                                       is_fault_status)
from strataserve.router.replicas import Replica
from strataserve.router.router import outcome_of
from strataserve.router.types import ModelCard, Payload

_PASS_THROUGH = (400, 413, 422, 429)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
        self.outliers = Outliers()
        self.max_event_bytes = MAX_EVENT_BYTES
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
        """The first usable answer's headers, trying replicas as ``upstream_retry.py`` says; an answer of a
        retried status that cannot be retried (no try or replica left) is returned for ``forward`` to map."""
        tried: list[Replica] = []
        retried = False  # the one retry of a request an upstream may have seen
        last: APIError | None = None  # the latest failure, the answer when no replica is left
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.spec.connect_timeout_s,
                                        sock_read=self.spec.timeout_s)
        while True:
            replica = self.replicas.choose(prefix, exclude=tuple(tried))
            if replica is None:
                if last is not None:
                    raise last
                raise APIError(503, self.replicas.unavailable_message(), code="model_unavailable",
                               type="service_unavailable", headers={"Retry-After": "2"})
            tried.append(replica)
            replica.outstanding += 1
            try:
                resp = await self.session.post(replica.url + path, data=payload, headers=self._headers,
                                               timeout=timeout)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                replica.outstanding -= 1
                what = after_connection_error(exc, replica, self.outliers)
                if what == "next":  # the upstream saw nothing: the next replica may take it
                    continue
                if what == "timeout":  # no answer in timeout_s: its slowness
                    raise self._timeout() from None
                # sent, then dropped: one request's failure, retried once elsewhere; the replica stays in
                last = APIError(502, f"model `{self.name}`: the upstream server closed the connection without "
                                f"answering ({type(exc).__name__})", code="upstream_error", type="upstream_error")
                if retried:
                    raise last from None
                retried = True
                continue
            except asyncio.TimeoutError:
                replica.outstanding -= 1
                raise self._timeout() from None
            except BaseException:
                replica.outstanding -= 1
                raise
            if resp.status in RETRY_STATUSES:
                if is_fault_status(resp.status):
                    self.outliers.failed(replica, f"answered {resp.status}")
                if not retried and self.replicas.choose(prefix, exclude=tuple(tried)) is not None:
                    retried = True
                    try:
                        last = await self._error(resp)
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        pass  # its body broke too: the retry goes on all the same
                    finally:
                        replica.outstanding -= 1
                        resp.release()
                    continue
            elif resp.status < 500:
                self.outliers.succeeded(replica)
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
        plain = None if stream else PlainStart(trace)  # a whole answer shows no first token: admission's stand-in
        try:
            replica, resp = await self._send(path, payload, prefix)
        except BaseException as exc:  # no replica, a timeout, or the client hung up before the headers came
            if plain is not None:
                plain.cancel()
            trace.finish(outcome_of(exc))  # (an unfinished trace would hold its admission ticket for good)
            raise
        relayed = done = False  # a stream's relay gives the replica back when it ends; anything else, here
        try:
            if plain is not None:
                plain.answered()
            if resp.status != 200:
                err = await self._error(resp)
                trace.finish("client_error" if err.status in _PASS_THROUGH else "upstream_error")
                done = True
                raise err
            if not stream:
                data = await self._read(resp)
                done = True
                doc = self._json_answer(data, resp)
                # no first-token time: the whole answer came at once (it would pass for TTFT and skew admission)
                trace.finish("ok", _completion_tokens(doc))
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
            if plain is not None:
                plain.cancel()
            if not relayed:
                replica.outstanding -= 1
                # read to the end: the connection goes back to the pool; cut short (the client hung up, the
                # body broke): dropped, so the upstream aborts the work too
                resp.release() if done else resp.close()

    def _json_answer(self, data: bytes, resp: aiohttp.ClientResponse) -> Any:
        """A 200's body as JSON; one that is not (a proxy's HTML page, a cut-off body) is the upstream's fault."""
        try:
            return msgspec.json.decode(data)
        except msgspec.DecodeError:
            kind = resp.headers.get("Content-Type", "no content type")
            snippet = " ".join(data[:200].decode(errors="replace").split())
            raise APIError(502, f"model `{self.name}`: the upstream server answered 200 with a body that is not "
                           f"JSON ({kind}): {snippet}", code="upstream_error", type="upstream_error") from None

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
        a stream that breaks ends, after the events already relayed, with the route's own error form."""
        splitter = SSESplitter(self.max_event_bytes)
        counter = StreamTokens(first_events)
        outcome = "aborted"
        try:
            try:
                async for data in resp.content.iter_any():
                    events = splitter.feed(data)
                    if not events:
                        continue
                    out = b"".join(events)
                    trace.on_tokens(responses.feed(out) if responses is not None else counter.feed(events))
                    yield self._rename(out) if self._renames else out
                rest = splitter.close()
                if rest:
                    trace.on_tokens(responses.feed(rest) if responses is not None else counter.feed([rest]))
                    yield self._rename(rest)
                outcome = "ok"
                self.outliers.succeeded(replica)
            except (aiohttp.ClientError, asyncio.TimeoutError, EventTooLarge) as exc:
                outcome = "upstream_error"
                if isinstance(exc, EventTooLarge):
                    err = APIError(502, f"model `{self.name}`: the upstream stream broke: {exc}",
                                   code="upstream_error", type="upstream_error")
                elif isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
                    err = self._timeout()
                else:  # one request's failure: the replica stays in rotation unless it keeps failing
                    self.outliers.failed(replica, f"{type(exc).__name__} mid-stream")
                    err = APIError(502, f"model `{self.name}`: the upstream stream broke: {type(exc).__name__}",
                                   code="upstream_error", type="upstream_error")
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
            # the upstream's own usage is the count when it gave one (a delta may carry several tokens)
            trace.finish(outcome, responses.output_tokens if responses is not None else counter.usage)


def _completion_tokens(doc: Any) -> int | None:
    """The output tokens of a whole answer: chat / completions' ``completion_tokens``, Responses' ``output_tokens``."""
    try:
        usage = doc.get("usage") or {}
        return int(usage.get("completion_tokens", usage.get("output_tokens")))
    except (AttributeError, TypeError, ValueError):
        return None
