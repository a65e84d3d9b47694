"""``POST /v1/responses``: OpenAI's Responses API, stateless (as vLLM without a store). The request becomes the
chat request it means (``api/responses_input.py``) and runs through the chat route's own pieces: admission (API
key, rate limits, SLA class, capacity), the chat template, the tool plan and parsers, guided decoding for
``text.format``, sampling defaults, metrics and the engine stream that aborts when the client hangs up. Only the
output shape is the Responses API's (``api/responses_output.py``)."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from strataserve.api.chat import render_chat, tools_and_guided
from strataserve.api.errors import APIError, bad_request
from strataserve.api.formatting import json_bytes
from strataserve.api.protocol import ChatCompletionRequest
from strataserve.api.request_params import make_params, resolve_max_tokens, vllm_extras
from strataserve.api.responses_input import check_request, prefix, responses_params, to_chat
from strataserve.api.responses_output import (EventWriter, ResponseShell, final_status, output_items,
                                              response_usage)
from strataserve.api.responses_protocol import ResponsesRequest
from strataserve.api.serving import (Routed, ServerState, admit, counts_outcome, engine_abort_error, engine_stream,
                                     forward, sse_body, traced, until_disconnect)
from strataserve.api.tools import ToolPlan, ToolStreamer, assistant_message
from strataserve.router.metrics import RouteTrace
from strataserve.types.sampling import SamplingParams

router = APIRouter()

class _Job:
    """One local response: what the engine runs and how its output is shaped."""

    def __init__(self, state: ServerState, body: ResponsesRequest, prompt_ids: list[int], params: SamplingParams,
                 plan: ToolPlan | None, priority: int) -> None:
        self.state, self.prompt_ids, self.params, self.plan, self.priority = state, prompt_ids, params, plan, priority
        self.shell = ResponseShell(body, state.model_name, params)
        self.output_tokens = 0
        self.cached = 0

    def engine(self, trace: RouteTrace) -> AsyncIterator[Any]:
        return engine_stream(self.state, self.shell.id, self.prompt_ids, self.params, self.priority, trace)

    def usage(self) -> dict[str, Any]:
        return response_usage(len(self.prompt_ids), self.output_tokens, self.cached)

    def count(self, out: Any) -> tuple[str, str | None]:
        """(text, finish_reason) of one engine delta; counts its tokens; raises when the engine aborted it."""
        c = out.outputs[0]
        self.output_tokens += len(c.token_ids)
        self.cached = max(self.cached, out.num_cached_tokens)
        if c.finish_reason == "abort":
            raise engine_abort_error(c.stop_reason)
        return c.text, c.finish_reason


@router.post("/v1/responses")
@counts_outcome
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    routed = admit(request, body)
    most = routed.limits.max_tokens
    if most is not None and body.max_output_tokens is not None and body.max_output_tokens > most:
        raise bad_request(f"max_output_tokens={body.max_output_tokens} is above this server's limit of {most}",
                          param="max_output_tokens", code="limit_exceeded")
    if routed.upstream:  # it may keep responses, read images...: its own checks apply
        # (its stream's tokens are counted from its events: router/backends/responses_stream.py)
        return await forward(routed, request, "/v1/responses", stream=body.stream, prefix=prefix(body))
    check_request(body)
    with responses_params():
        job = _prepare(routed, body, to_chat(body))
    work = float(len(job.prompt_ids))
    if body.stream:
        job.state.check_capacity(1)
        return StreamingResponse(_stream(job, routed, work), media_type="text/event-stream")
    with job.state.admit(1), traced(routed.trace(work)) as trace:
        result = await until_disconnect(request, _collect(job, trace))
    return Response(json_bytes(result), media_type="application/json")


# What needs a stored response: a clear 404 (the client's NotFoundError says why) rather than the bare route 404.
@router.get("/v1/responses/{response_id}")
@router.delete("/v1/responses/{response_id}")
@router.get("/v1/responses/{response_id}/input_items")
@router.post("/v1/responses/{response_id}/cancel")
async def stored_response(response_id: str) -> Response:
    raise APIError(404, f"Response with id '{response_id}' not found: this server keeps no responses (it is "
                   "stateless, as store=false), so they cannot be retrieved, listed, deleted or cancelled")


def _prepare(routed: Routed, body: ResponsesRequest, chat: ChatCompletionRequest) -> _Job:
    """The chat route's steps up to the engine: tools and guided decoding, the template, the output budget, the
    sampling parameters, then the key's token quota and the SLA class's admission."""
    state = routed.state
    plan, guided = tools_and_guided(state, chat)
    prompt_ids = render_chat(state, chat.messages, True, chat.tools, template_kwargs=chat.chat_template_kwargs)
    max_tokens = resolve_max_tokens(state, len(prompt_ids), body.max_output_tokens, "max_output_tokens", "input")
    if body.max_output_tokens is None and routed.limits.max_tokens is not None:  # unset: held to the limit
        max_tokens = min(max_tokens, routed.limits.max_tokens)
    params = make_params(state.sampling_defaults, max_tokens=max_tokens, temperature=chat.temperature,
                         top_p=chat.top_p, top_k=chat.top_k, min_p=chat.min_p, seed=chat.seed,
                         presence_penalty=chat.presence_penalty, frequency_penalty=chat.frequency_penalty,
                         repetition_penalty=chat.repetition_penalty, stop=chat.stop or None,
                         ignore_eos=chat.ignore_eos, skip_special_tokens=not (plan and plan.keep_special_tokens), guided_decoding=guided,
                         **vllm_extras(state, chat))
    work = float(len(prompt_ids))
    routed.check(work, work + max_tokens, 1, max_tokens)
    return _Job(state, body, prompt_ids, params, plan, routed.priority(body.priority))


async def _collect(job: _Job, trace: RouteTrace) -> dict[str, Any]:
    parts: list[str] = []
    finish: str | None = None
    async for out in job.engine(trace):
        text, reason = job.count(out)
        parts.append(text)
        finish = reason or finish
    message, _ = assistant_message(job.plan, "".join(parts), finish)
    status = final_status(finish)
    return job.shell.snapshot(status, output_items(message, status), job.usage())


def _stream(job: _Job, routed: Routed, work: float) -> AsyncIterator[bytes]:
    """The SSE body, framed as the chat route's streams are (in-flight count, trace, abort when the client hangs
    up); a failure after the start is an ``error`` event (then ``response.failed``); no ``[DONE]`` at the end, as
    OpenAI's Responses stream has none."""
    writer = EventWriter(job.shell)
    return sse_body(job.state, 1, routed, work, lambda trace: _events(job, writer, trace), error=writer.error,
                    done=None)


async def _events(job: _Job, writer: EventWriter, trace: RouteTrace) -> AsyncIterator[bytes]:
    yield writer.start()
    plan = job.plan
    streamer = ToolStreamer(plan) if plan is not None and plan.mode != "none" else None
    async for out in job.engine(trace):
        text, reason = job.count(out)
        if streamer is None:
            data = writer.text(text) if text else b""
            if reason is not None:
                data += writer.finish(final_status(reason), job.usage())
        else:
            deltas = streamer.feed(text)
            if reason is not None:
                deltas += streamer.finish(reason)[0]
            data = b"".join(_delta(writer, d) for d in deltas)
            if reason is not None:
                data += writer.finish(final_status(reason), job.usage())
        if data:
            yield data


def _delta(writer: EventWriter, delta: dict[str, Any]) -> bytes:
    """One of ``ToolStreamer``'s chat deltas as Responses events."""
    if "content" in delta:
        return writer.text(delta["content"])
    out = b""
    for call in delta.get("tool_calls", ()):
        fn = call.get("function", {})
        if "id" in call:  # a new call: its id and name come with it (and the first arguments)
            out += writer.call(call["id"], fn.get("name", ""), fn.get("arguments", ""))
        else:
            out += writer.arguments(fn.get("arguments", ""))
    return out
