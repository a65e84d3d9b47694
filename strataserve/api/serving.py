"""What the OpenAI routes share: server state, admission control, prompt checks, and the engine stream wrapper
that keeps metrics and aborts a request whose consumer went away (client disconnect, error, cancellation)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from strataserve.api.errors import APIError, bad_request, engine_dead, from_value_error
from strataserve.api.formatting import DONE, sse
from strataserve.api.limits import RequestLimits
from strataserve.api.metrics import ServerMetrics
from strataserve.api.request_params import check_token_ids
from strataserve.api.responses_input import chat_messages
from strataserve.types.errors import EngineDeadError
from strataserve.types.outputs import RequestOutput
from strataserve.types.sampling import SamplingParams
from strataserve.router.metrics import RouteTrace
from strataserve.router.router import Router, outcome_of
from strataserve.router.sla import SLA, bearer_key
from strataserve.router.types import Backend, Payload

T = TypeVar("T")


@dataclass
class ServerState:
    """Everything a route needs, built once at start-up (``app.state.strata``)."""

    engine: Any  # the local model's AsyncLLM (or ReplicatedEngine), handed over by the router's launch
    tokenizer: Any
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    max_inflight_seqs: int  # running + waiting sequences beyond which we answer 503
    max_running_seqs: int | None = None  # sequences the engine(s) run at once (admission's slots)
    vocab_size: int | None = None
    tool_call_parser: str | None = None  # --tool-call-parser (api/tool_parsers)
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    #: what a request leaves unset takes these (the checkpoint's generation_config.json; --generation-config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    inflight_seqs: int = 0

    @property
    def max_pool_tokens(self) -> int | None:
        """The whole KV cache in tokens (the smallest replica's): a longer prompt can never run, even where
        ``max_model_len`` allows it. None when the engine does not say. Read from the engine each time, since a
        restart replaces it."""
        engine = self.engine
        sizes = [getattr(getattr(e, "inputs", None), "max_pool_tokens", None)
                 for e in getattr(engine, "engines", None) or [engine]]
        return min(sizes) if sizes and all(isinstance(s, int) for s in sizes) else None

    def check_alive(self) -> None:
        try:
            self.engine.check_health()
        except EngineDeadError as exc:
            raise engine_dead(exc) from None

    def check_capacity(self, num_seqs: int) -> None:
        """Refuse (503) when the engine's waiting queue would pass its limit; an idle server takes anything."""
        if self.inflight_seqs and self.inflight_seqs + num_seqs > self.max_inflight_seqs:
            raise APIError(503, "the server is overloaded (waiting queue full); retry shortly",
                           code="overloaded", type="service_unavailable", headers={"Retry-After": "1"})

    @contextlib.contextmanager
    def hold(self, num_seqs: int):
        """Count these sequences as in flight for the duration of the block."""
        self.inflight_seqs += num_seqs
        try:
            yield
        finally:
            self.inflight_seqs -= num_seqs

    @contextlib.contextmanager
    def admit(self, num_seqs: int):
        self.check_capacity(num_seqs)
        with self.hold(num_seqs):
            yield


@dataclass
class Routed:
    """A request's route, as the router decided it: the backend serving its model and its SLA class."""

    router: Router
    backend: Backend
    sla: SLA
    key: str | None = None  # the request's API key (rate limits are per key)
    limits: RequestLimits = field(default_factory=RequestLimits)
    _shape: tuple[int, float | None] = (1, None)  # (sequences, max_tokens each) as ``check`` was told
    counted: bool = False  # its outcome is (or will be) in the router's metrics: traced, or refused as counted

    @property
    def upstream(self) -> bool:
        return self.backend.upstream

    @property
    def state(self) -> ServerState:
        return self.backend.state  # type: ignore[attr-defined]  # local LLM backends only

    def priority(self, requested: int) -> int:
        """The engine priority: the class's, plus the request's own (vLLM's ``priority`` field) within it."""
        return self.sla.priority + requested

    def check(self, work: float, tokens: float | None = None, seqs: int = 1, budget: float | None = None) -> None:
        """Admission of ``work`` prompt tokens: the prompt limit, the key's tokens per minute (``tokens``: the
        most this request may use) and the class's TTFT target (``seqs`` sequences of at most ``budget`` output
        tokens each: the engine slots they need, and how long they will hold them)."""
        self.limits.check_prompt(int(work))
        try:
            self.router.check_admission(self.backend, self.sla, work, seqs)
        except APIError:
            self.counted = True  # check_admission counted the refusal
            raise
        if tokens is not None:  # charged last: a request refused above spends nothing
            self.router.quota.take_tokens(self.key, tokens)
        self._shape = (seqs, budget)

    def trace(self, work: float) -> RouteTrace:
        self.counted = True
        return self.router.trace(self.backend, self.sla, work, *self._shape)


@contextlib.contextmanager
def traced(trace: RouteTrace):
    """Finish ``trace`` with the outcome of the block (ok, or what its exception means)."""
    try:
        yield trace
    except BaseException as exc:
        trace.finish(outcome_of(exc))
        raise
    trace.finish("ok")


async def sse_body(state: ServerState, num_seqs: int, routed: Routed, work: float,
                   events: Callable[[RouteTrace], AsyncIterator[bytes]],
                   error: Callable[[APIError], bytes] | None = None, done: bytes | None = DONE
                   ) -> AsyncIterator[bytes]:
    """The body of a streamed OpenAI response: the route's ``events`` (which raise APIError on failure) framed
    by the in-flight count and the router's trace, an error event on failure (``error``: the route's own form),
    then ``done`` (``[DONE]``; the Responses API ends without one)."""
    outcome = "aborted"  # unless it ends below: the client hung up
    with state.hold(num_seqs):
        trace = routed.trace(work)
        inner = events(trace)
        try:
            try:
                async for data in inner:
                    yield data
                outcome = "ok"
            except APIError as exc:
                outcome = outcome_of(exc)
                yield error(exc) if error is not None else sse(exc.body())
            if done is not None:
                yield done
        finally:
            await inner.aclose()  # aborts its engine requests now if the client hung up mid-stream
            trace.finish(outcome)


def router_of(request: Request) -> Router:
    return request.app.state.router


def route(request: Request, model: str | None, payload: Payload = Payload.TEXT) -> Routed:
    router = router_of(request)
    backend = router.resolve(model, payload)
    return Routed(router, backend, router.sla(request), bearer_key(request.headers.get("authorization")),
                  request.app.state.limits)


def local_state(routed: Routed) -> ServerState:
    """The local engine's state after the liveness check (503 when its engine process is gone)."""
    state = routed.state
    state.check_alive()
    return state


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_stream_options(body: Any) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")


def counts_outcome(handler: Callable[[Any, Request], Awaitable[Response]]
                   ) -> Callable[[Any, Request], Awaitable[Response]]:
    """A generation route whose request fails before its trace starts (a bad parameter's 400, a dead engine's
    503, the key's quota 429) still counts in ``strata:router_requests_total``, under the outcome a traced
    request would get, once ``admit`` has resolved its model and class."""

    @functools.wraps(handler)
    async def counted_handler(body: Any, request: Request) -> Response:
        try:
            return await handler(body, request)
        except BaseException as exc:
            routed = getattr(request.state, "routed", None)
            if routed is not None and not routed.counted:
                routed.counted = True
                routed.router.metrics.reject(routed.backend.name, routed.sla.name, outcome_of(exc))
            raise

    return counted_handler


def admit(request: Request, body: Any) -> Routed:
    """Checks shared by the OpenAI generation routes, before any route-specific validation: the route (404 for
    an unknown model, 400 for a non-text one), the SLA class, and the checks every backend needs."""
    routed = request.state.routed = route(request, body.model)
    routed.limits.check(body)
    check_stream_options(body)
    if not routed.upstream:
        state = local_state(routed)
        if body.logit_bias:
            check_token_ids(state, [_bias_id(k) for k in body.logit_bias], "logit_bias")
    return routed


def _bias_id(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise bad_request(f"logit_bias key {key!r} is not a token id: keys are token ids as strings, e.g. "
                          '{"50256": -100}', param="logit_bias") from None


async def forward_plain(routed: Routed, request: Request, path: str) -> Response:
    """A small non-generating request (tokenize, detokenize) answered by the upstream serving the model."""
    body = msgspec.json.decode(await request.body())
    return await routed.backend.forward(path, body, stream=False, prefix=None, trace=None)  # type: ignore


async def forward(routed: Routed, request: Request, path: str, *, stream: bool, prefix: str | None,
                  first_events: int = 0) -> Response:
    """Send the request's own JSON (unknown fields included) to the upstream serving its model. The key's tokens
    per minute are charged as a local model's: the prompt (estimated at 4 characters a token: the router holds
    no tokenizer of the upstream's) and the most it may write."""
    body = msgspec.json.decode(await request.body())
    _hold_to_limit(body, path, routed.limits)
    routed.check(1.0, _upstream_charge(body, path))
    trace = routed.trace(1.0)
    work = routed.backend.forward(path, body, stream=stream, prefix=prefix, trace=trace,  # type: ignore
                                  first_events=first_events)
    # A client that hangs up before the upstream answers stops the upstream's work too, streamed or not (a
    # stream's relay, once it runs, drops the upstream connection itself when the client leaves).
    return await until_disconnect(request, work)


UPSTREAM_DEFAULT_OUTPUT = 1024  # charged when a request to an upstream model sets no output limit
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) budget of a completions request that sets none


def _hold_to_limit(body: Any, path: str, limits: RequestLimits) -> None:
    """``--limit-max-tokens`` on a forwarded request that sets no output budget, as on a local model: the
    upstream would otherwise write up to the rest of its context (chat, responses). A completions request keeps
    the protocol's default of 16 unless the limit is lower. An explicit budget above the limit was refused at
    admission."""
    if limits.max_tokens is None or not isinstance(body, dict):
        return
    fields = ("max_output_tokens",) if path == "/v1/responses" else ("max_completion_tokens", "max_tokens")
    if any(body.get(f) is not None for f in fields):
        return
    if path == "/v1/completions" and limits.max_tokens >= COMPLETIONS_DEFAULT_MAX_TOKENS:
        return
    body[fields[-1]] = limits.max_tokens


def _upstream_charge(body: Any, path: str = "") -> float:
    """The tokens per minute an upstream request is charged; a Responses body as the chat request it means (its
    instructions and input as messages, ``max_output_tokens`` as the output limit), so neither route is cheaper."""
    if not isinstance(body, dict):
        return 0.0
    if path == "/v1/responses":
        body = {"messages": chat_messages(body.get("instructions"), body.get("input")),
                "max_completion_tokens": body.get("max_output_tokens")}
    prompt = body.get("messages", body.get("prompt")) or ""
    chars = len(prompt) if isinstance(prompt, str) else len(msgspec.json.encode(prompt))
    most = body.get("max_completion_tokens") or body.get("max_tokens") or UPSTREAM_DEFAULT_OUTPUT
    n = body.get("n") or 1
    try:
        return chars / 4 + int(n) * int(most)
    except (TypeError, ValueError):
        return chars / 4 + UPSTREAM_DEFAULT_OUTPUT  # the upstream answers the bad field with its own 400


def engine_abort_error(stop_reason: Any) -> APIError:
    """The error for a completion the engine itself aborted (it rejected the request, or is shutting down)."""
    if isinstance(stop_reason, str) and stop_reason:
        return bad_request(stop_reason)
    return APIError(503, "the engine aborted the request", type="service_unavailable")


async def engine_stream(state: ServerState, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        priority: int = 0, trace: RouteTrace | None = None) -> AsyncIterator[RequestOutput]:
    """Delta outputs of one engine request. Records metrics (the engine's, and the router's per-class ``trace``
    when given); aborts the request if not iterated to the end."""
    timer = state.metrics.track(len(prompt_ids), params.n)
    metrics = state.metrics
    finished = False
    ended = 0  # choices counted in request_success (one per choice, an abort's too)
    last: RequestOutput | None = None
    agen = state.engine.generate(prompt_ids, params, request_id, priority=priority)
    try:
        async for out in agen:
            n = 0
            for c in out.outputs:
                n += len(c.token_ids)
                if c.finish_reason is not None:
                    metrics.success(c.finish_reason)
                    ended += 1
            timer.on_output(out)
            if trace is not None:
                trace.on_tokens(n)
            last = out
            if out.finished:
                finished = True
            yield out
    except EngineDeadError as exc:
        raise engine_dead(exc) from None
    except ValueError as exc:  # the engine's own input checks (e.g. the prompt exceeds the KV pool)
        raise from_value_error(exc) from None
    finally:
        if not finished:
            for _ in range(max(params.n - ended, 1)):
                metrics.success("abort")
        # Closing the engine's generator aborts the request in the core (frees its blocks next step). It is
        # suspended at a yield (or already done), so this completes without waiting, even under cancellation.
        with contextlib.suppress(RuntimeError):
            await agen.aclose()
        timer.finish(last.metrics if last is not None else None)
        em = last.metrics if last is not None else None
        if trace is not None and em is not None and em.first_scheduled_time is not None:
            trace.queue_time(em.first_scheduled_time - em.arrival_time)


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (index, item); closing the merge closes (aborts) all of them."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                queue.put_nowait((i, item, None))
        except Exception as exc:  # noqa: BLE001 — handed to the consumer
            queue.put_nowait((i, None, exc))
        finally:
            queue.put_nowait((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` but cancel it (which aborts its engine requests) as soon as the client hangs up."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its finally blocks abort the engine work
    if task.cancelled():
        # Client is gone: nobody reads this answer; 499 is nginx's "client closed request".
        raise APIError(499, "client disconnected", code="client_disconnected")
    return task.result()
