"""A Responses request -> the chat request the local serving path already runs (``api/chat.py``'s rendering, tool
plan, guided decoding and sampling), plus the refusals of what this stateless server cannot do. Every refusal is a
400 naming the Responses field (``input[2].call_id``, ``text.format.schema``), never a chat field."""
from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator

from pydantic import ValidationError

from strataserve.api.errors import APIError, bad_request
from strataserve.api.protocol import ChatCompletionRequest
from strataserve.api.responses_protocol import (MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE,
                                                ResponsesRequest)

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
_ROLES = ("user", "system", "developer", "assistant")
#: what the chat path names in its errors -> the Responses field that carried it
_PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
           "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "structured_outputs": "structured_outputs"}


def check_request(body: ResponsesRequest) -> None:
    """Refuse, up front, what needs state this server does not keep or features it does not have."""
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id needs a stored response, and this server keeps none (stateless, as "
                          "store=false): send the whole conversation in input instead",
                          param="previous_response_id")
    if body.conversation is not None:
        raise bad_request("conversation needs stored conversations, and this server keeps none: send the whole "
                          "conversation in input", param="conversation")
    if body.background:
        raise bad_request("background responses need a store, and this server keeps none: use stream=true for "
                          "long responses", param="background")
    if body.prompt is not None:
        raise bad_request("prompt (a stored prompt template) is not supported: send instructions and input",
                          param="prompt")
    r = body.reasoning
    if r is not None and (r.effort is not None or r.summary is not None or r.generate_summary is not None):
        raise bad_request("reasoning controls are not supported by this server (it has no reasoning parser; a "
                          "thinking model's template flags go in chat_template_kwargs): leave reasoning out",
                          param="reasoning")
    if body.truncation == "auto":
        raise bad_request("truncation='auto' is not supported: an input longer than the context is refused "
                          "(truncation='disabled')", param="truncation")
    for name in body.include or ():
        if name != "reasoning.encrypted_content":  # asked for by agents by default; we make no reasoning items
            raise bad_request(f"include={name!r} is not supported by this server", param="include")
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses: use /v1/chat/completions for logprobs",
                          param="top_logprobs")
    meta = body.metadata or {}
    if len(meta) > MAX_METADATA:
        raise bad_request(f"metadata has {len(meta)} pairs; at most {MAX_METADATA} are allowed", param="metadata")
    for k, v in meta.items():
        if len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                              f"{MAX_METADATA_VALUE}", param=f"metadata.{k[:MAX_METADATA_KEY]}")
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
        raise bad_request("text.format of type 'json_schema' needs a schema", param="text.format.schema")


@contextlib.contextmanager
def responses_params() -> Iterator[None]:
    """Errors raised by the chat path inside the block name the Responses field instead of the chat one."""
    try:
        yield
    except APIError as exc:
        if exc.param in _PARAMS:
            exc.param = _PARAMS[exc.param]
        raise


def prefix(body: ResponsesRequest) -> str:
    """What replica affinity hashes for an upstream: the instructions and the input's opening."""
    text = body.input if isinstance(body.input, str) else json.dumps(body.input[:4])
    return ((body.instructions or "") + "\n" + text)[:1024]


def chat_messages(instructions: Any, input: Any) -> list[Any]:
    """The chat ``messages`` a raw Responses body means (what ``to_chat`` builds), for the router's charge of a
    request it forwards upstream unchecked: items it cannot read are counted as sent (the upstream refuses them)."""
    messages: list[Any] = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and \
        instructions else []
    if isinstance(input, str):
        return messages + [{"role": "user", "content": input}]
    if not isinstance(input, list):
        return messages
    converted: list[dict[str, Any]] = []
    try:
        _items(input, converted)
    except APIError:
        return messages + input
    return messages + converted


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves ``body`` on a local model."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        _items(body.input, messages)
    if not messages:
        raise bad_request("input is empty: give a string or at least one message", param="input")
    fmt = body.text.format if body.text is not None else None
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "user": body.user, "parallel_tool_calls": body.parallel_tool_calls, "seed": body.seed, "stop": body.stop,
        "top_k": body.top_k, "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "priority": body.priority, "chat_template_kwargs": body.chat_template_kwargs,
        "structured_outputs": body.structured_outputs, "ignore_eos": body.ignore_eos,
    }
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else
                                   {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                                           "strict": fmt.strict}})
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    tc = body.tool_choice
    if tc is not None:
        chat["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # our own items are checked above; this is a field the chat model refines
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        raise bad_request(f"{loc}: {err.get('msg')}", param=_PARAMS.get(loc.split(".")[0], loc)) from None


def _items(items: list[Any], messages: list[dict[str, Any]]) -> None:
    """Input items -> chat messages: a ``function_call`` joins the assistant turn before it (a turn's calls are
    one message, as chat templates render them), a ``function_call_output`` is a ``tool`` message."""
    calls: dict[str, str] = {}  # call_id -> function name, of the calls seen so far
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object: a message ({{\"role\": \"user\", \"content\": ...}}) "
                              "or a function_call / function_call_output item", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)} (got {role!r})",
                                  param=f"{where}.role")
            # "developer" is OpenAI's newer name for system-level instructions; chat templates know "system"
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            args = _string(item, "arguments", where)
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):  # "[1]" or "3" parse, but templates render arguments as a mapping
                raise bad_request(f"{where}.arguments must be a JSON object as text", param=f"{where}.arguments")
            calls[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise bad_request(f"{where}: no function_call with call_id {call_id!r} comes before this output in "
                                  "input (this server keeps no earlier responses: send the call too)",
                                  param=f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, f"{where}.output")
            messages.append({"role": "tool", "content": text, "tool_call_id": call_id, "name": calls[call_id]})
        elif kind == "item_reference":
            raise bad_request(f"{where}: item_reference needs stored items, and this server keeps none: send the "
                              "item itself", param=f"{where}.type")
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, function_call "
                              "and function_call_output are)", param=f"{where}.type")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} is required and must be a string", param=f"{where}.{key}")
    return value


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined by newlines (as the chat route joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of input_text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise bad_request(f"{where}[{j}]: {kind} parts are not supported: this server serves text models",
                              param=f"{where}[{j}].type")
        if kind not in _TEXT_PARTS:
            raise bad_request(f"{where}[{j}] must be an input_text part ({{\"type\": \"input_text\", \"text\": ...}})",
                              param=f"{where}[{j}]")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        texts.append(text)
    return "\n".join(texts)
