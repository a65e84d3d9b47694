"""``POST /v1/chat/completions``: the model's chat template renders the messages; n, stop, logprobs +
top_logprobs, streaming with a role chunk first and ``stream_options.include_usage``."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from strataserve.api.errors import bad_request
from strataserve.api.formatting import (ChunkTemplate, TokenNamer, chat_logprobs, json_bytes, sse, usage,
                                      vllm_prompt_logprobs)
from strataserve.api.guided import guided_params, validate
from strataserve.api.protocol import ChatCompletionRequest, ChatMessage
from strataserve.api.request_params import (check_prompt_logprobs, make_params, resolve_max_tokens, truncated,
                                           vllm_extras)
from strataserve.api.serving import (ServerState, admit, counts_outcome, engine_abort_error, engine_stream, forward,
                                     new_id, sse_body, traced, until_disconnect)
from strataserve.api.tools import ToolPlan, ToolStreamer, assistant_message, message_dicts, plan_tools, tool_events
from strataserve.types.sampling import MAX_LOGPROBS, GuidedDecodingParams, SamplingParams
from strataserve.router.metrics import RouteTrace

router = APIRouter()


_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                       "continue_final_message", "tokenize", "return_dict", "chat_template"})


def render_chat(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                tools: list[Any] | None = None, *, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the conversation through the model's chat template (tool calls, tool results and the tool
    definitions included, for templates that render them). ``continue_final_message`` leaves the last message
    open, so the model continues it (an assistant prefill); ``template_kwargs`` are the template's own variables
    (``enable_thinking`` for Qwen3's)."""
    if state.tokenizer is None:
        raise bad_request("this server runs without a tokenizer (--skip-tokenizer-init): chat needs one; use "
                          "/v1/completions with token-id prompts", param="messages")
    if continue_final_message and add_generation_prompt:
        # vLLM's rule: a new assistant turn and a continued last message contradict each other
        raise bad_request("continue_final_message=true needs add_generation_prompt=false (a new assistant turn "
                          "cannot follow a message left open)", param="continue_final_message")
    extra = dict(template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}: use the request's own fields",
                          param="chat_template_kwargs")
    if tools:
        extra["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    if continue_final_message:
        extra["continue_final_message"] = True
    plain = message_dicts(messages)
    try:
        ids = state.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **extra)
    except ValueError as exc:
        raise bad_request(f"cannot render the chat: {exc}", param="messages") from None
    if isinstance(ids, str):
        ids = state.tokenizer.encode(ids, add_special_tokens=False)
    return list(ids)


def _refuse_legacy_functions(body: ChatCompletionRequest) -> None:
    """``functions`` / ``function_call`` (OpenAI's deprecated function calling) are a 400: dropped, the model would
    answer in plain text and the caller would never learn why no call came. ``None``, an empty list and the
    no-op choices ("none", "auto" with no functions) are what some clients send by default, and pass."""
    if body.functions:
        raise bad_request("functions is deprecated and not supported: give the functions in tools, as "
                          '[{"type": "function", "function": {...}}]', param="functions")
    if body.function_call not in (None, "none", "auto"):
        raise bad_request('function_call is deprecated and not supported: use tool_choice, e.g. {"type": '
                          '"function", "function": {"name": ...}}, with the functions in tools', param="function_call")


def _top_n(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if not body.logprobs:
        return None
    top = body.top_logprobs or 0
    if not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs={top} is out of range: must be in [0, {MAX_LOGPROBS}]",
                          param="top_logprobs")
    return top


def _prefix(messages: list[ChatMessage]) -> str:
    """What replica affinity hashes: the conversation's opening (system prompt, first turns)."""
    out, size = [], 0
    for m in messages:
        text = m.text()
        out.append(text)
        size += len(text)
        if size >= 1024:
            break
    return "\n".join(out)


@router.post("/v1/chat/completions")
@counts_outcome
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    routed = admit(request, body)
    if routed.upstream:
        return await forward(routed, request, "/v1/chat/completions", stream=body.stream,
                             prefix=_prefix(body.messages), first_events=body.n)
    state = routed.state
    _refuse_legacy_functions(body)
    plan, guided = tools_and_guided(state, body)
    top_n = _top_n(body)
    check_prompt_logprobs(body)
    prompt_ids = render_chat(state, body.messages, body.add_generation_prompt, body.tools,
                             continue_final_message=body.continue_final_message,
                             template_kwargs=body.chat_template_kwargs)
    prompt_ids = truncated(state, prompt_ids, body.truncate_prompt_tokens)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = resolve_max_tokens(state, len(prompt_ids), requested, param, "messages")
    params = make_params(state.sampling_defaults, n=body.n, max_tokens=max_tokens, temperature=body.temperature,
                         top_p=body.top_p,
                         top_k=body.top_k, min_p=body.min_p, presence_penalty=body.presence_penalty,
                         frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                         seed=body.seed, stop=body.stop or None, stop_token_ids=body.stop_token_ids,
                         ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logprobs=top_n,
                         skip_special_tokens=body.skip_special_tokens and not (plan and plan.keep_special_tokens),
                         include_stop_str_in_output=body.include_stop_str_in_output, guided_decoding=guided,
                         logit_bias=body.logit_bias, prompt_logprobs=body.prompt_logprobs,
                         **vllm_extras(state, body))
    rid = new_id("chatcmpl")
    work = float(len(prompt_ids))
    # 429 when the key's tokens per minute are spent or the queue ahead would make it miss its class's TTFT
    routed.check(work, work + body.n * max_tokens, body.n, max_tokens)
    priority = routed.priority(body.priority)
    if body.stream:
        state.check_capacity(body.n)
        events = _events(state, body, rid, prompt_ids, params, top_n, plan, priority)
        return StreamingResponse(sse_body(state, body.n, routed, work, events), media_type="text/event-stream")
    with state.admit(body.n), traced(routed.trace(work)) as trace:
        result = await until_disconnect(request, _collect(state, body, rid, prompt_ids, params, top_n, plan,
                                                          (priority, trace)))
    return Response(json_bytes(result), media_type="application/json")


def tools_and_guided(state: ServerState, body: ChatCompletionRequest
                      ) -> tuple[ToolPlan | None, GuidedDecodingParams | None]:
    """The tool plan (api/tools.py) and the output constraint: the request's own, else the one tool_choice
    required / named implies."""
    plan = plan_tools(body, state.tool_call_parser, state.enable_auto_tool_choice)
    guided = guided_params(body)
    if plan is not None and plan.guided is not None:
        if guided is not None:
            raise bad_request("tool_choice 'required' or a named function already constrains the output: drop "
                              "response_format / guided_*", param="tool_choice")
        validate(plan.guided, "tools")
        guided = plan.guided
    return plan, guided


async def _collect(state: ServerState, body: ChatCompletionRequest, rid: str, prompt_ids: list[int],
                   params: SamplingParams, top_n: int | None, plan: ToolPlan | None, job: tuple) -> dict[str, Any]:
    n = body.n
    namer = TokenNamer(state.tokenizer)
    parts: list[list[str]] = [[] for _ in range(n)]
    token_ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[dict]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    stop_reason: list[Any] = [None] * n
    completion_tokens = 0
    prompt_lps = None
    async for out in engine_stream(state, rid, prompt_ids, params, *job):
        if out.prompt_logprobs is not None:  # the first output carries them
            prompt_lps = out.prompt_logprobs
        for c in out.outputs:
            parts[c.index].append(c.text)
            token_ids[c.index] += c.token_ids
            completion_tokens += len(c.token_ids)
            if top_n is not None:
                lps[c.index].extend(chat_logprobs(namer, c.token_ids, c.logprobs, top_n))
            if c.finish_reason is not None:
                finish[c.index], stop_reason[c.index] = c.finish_reason, c.stop_reason
    for i in range(n):
        if finish[i] == "abort":
            raise engine_abort_error(stop_reason[i])
    messages = [assistant_message(plan, "".join(parts[i]), finish[i]) for i in range(n)]
    ids = body.return_token_ids  # vLLM's extra: the prompt's ids (the rendered template) and each choice's
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
        "choices": [{"index": i, "message": messages[i][0],
                     "logprobs": {"content": lps[i]} if top_n is not None else None,
                     "finish_reason": messages[i][1], "stop_reason": stop_reason[i],
                     **({"token_ids": token_ids[i]} if ids else {})} for i in range(n)],
        "usage": usage(len(prompt_ids), completion_tokens),
        **({"prompt_token_ids": prompt_ids} if ids else {}),
        # vLLM's extra: top level, as its ChatCompletionResponse.prompt_logprobs (the rendered template's tokens)
        **({"prompt_logprobs": vllm_prompt_logprobs(namer, prompt_ids, prompt_lps, body.prompt_logprobs)}
           if body.prompt_logprobs is not None else {}),
    }


def _events(state: ServerState, body: ChatCompletionRequest, rid: str, prompt_ids: list[int], params: SamplingParams,
            top_n: int | None, plan: ToolPlan | None, priority: int) -> Callable[[RouteTrace], AsyncIterator[bytes]]:
    async def events(trace: RouteTrace) -> AsyncIterator[bytes]:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        head: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                                "model": state.model_name}
        if with_usage:
            head["usage"] = None
        namer = TokenNamer(state.tokenizer)
        completion_tokens = 0
        first = {"prompt_token_ids": prompt_ids} if body.return_token_ids else {}  # vLLM: on the first chunk
        continuous = with_usage and body.stream_options.continuous_usage_stats  # usage on every chunk (vLLM)
        if continuous:
            first["usage"] = usage(len(prompt_ids), 0)
        yield b"".join(sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], **first})
                       for i in range(body.n))
        chunk = ChunkTemplate(head, (lambda: usage(len(prompt_ids), completion_tokens)) if continuous else None).delta
        streamers = [ToolStreamer(plan) for _ in range(body.n)] if plan and plan.mode != "none" else None
        async for out in engine_stream(state, rid, prompt_ids, params, priority, trace):
            batch = []  # one write per engine output, however many choices it advanced
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                if c.finish_reason == "abort":
                    raise engine_abort_error(c.stop_reason)
                ids = {"token_ids": c.token_ids} if body.return_token_ids else None
                if not c.text and c.finish_reason is None and top_n is None and ids is None:
                    continue  # an incomplete multi-byte character: nothing to show yet
                lp = ({"content": chat_logprobs(namer, c.token_ids, c.logprobs, top_n)}
                      if top_n is not None else None)
                if streamers is not None:
                    if ids is not None:  # a tool call's chunks do not follow tokens: the ids ride on their own
                        batch.append(chunk(c.index, {}, None, None, ids))
                    batch.extend(tool_events(streamers[c.index], chunk, c.index, c.text, lp, c.finish_reason,
                                             c.stop_reason))
                    continue
                delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                if c.finish_reason is not None:  # the last chunk says which stop ended it, as vLLM's does
                    ids = {**(ids or {}), "stop_reason": c.stop_reason}
                batch.append(chunk(c.index, delta, lp, c.finish_reason, ids))
            if batch:
                yield b"".join(batch)
        if with_usage:
            yield sse({**head, "choices": [], "usage": usage(len(prompt_ids), completion_tokens)})

    return events
