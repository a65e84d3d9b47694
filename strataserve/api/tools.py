"""Tool calling on ``/v1/chat/completions``: ``tools`` + ``tool_choice`` -> a ``ToolPlan`` (what to constrain,
how to parse), the assistant message of a finished choice, and streamed ``tool_calls`` deltas.

``tool_choice`` as in vLLM: ``"none"`` (plain content), ``"auto"`` (the server's ``--tool-call-parser`` reads the
text; needs ``--enable-auto-tool-choice``), ``"required"`` (output constrained by the grammar engine to a JSON
list of ``{"name", "parameters"}``), or ``{"type": "function", "function": {"name": ...}}`` (output constrained to
that function's parameters schema). With ``required`` and a named function the call always parses.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from strataserve.api.errors import bad_request
from strataserve.api.tool_parsers import PARSERS, ToolCall, ToolParser, get_parser
from strataserve.types.sampling import GuidedDecodingParams

#: a function without ``parameters`` takes none (OpenAI: "an empty parameter list"): its arguments are ``{}``
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(slots=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    parser: ToolParser | None = None
    function: str | None = None  # mode "named"
    guided: GuidedDecodingParams | None = None
    parallel: bool = True  # parallel_tool_calls: False keeps the first call only (OpenAI; vLLM drops the rest)
    #: makes call ids in the form of the server's --tool-call-parser, whatever the mode (Mistral's template checks
    #: the ids of a required or named call as much as an auto one); None: the parser's own, else vLLM's usual
    call_id: Callable[[], str] | None = None

    def new_call_id(self) -> str:
        make = self.call_id or (self.parser.call_id if self.parser is not None else ToolParser.call_id)
        return make()

    @property
    def keep_special_tokens(self) -> bool:
        """Markers such as Mistral's [TOOL_CALLS] or Llama's <|python_tag|> are special tokens: keep them."""
        return self.mode == "auto"


def _required_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """One array of calls; each tool's ``$defs`` move to the root, where its ``#/$defs/...`` refs point (nested
    under the array they would resolve nowhere: pydantic models with a nested model always have some)."""
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    items = []
    for t in tools:
        params = dict(t.function.parameters or _NO_PARAMETERS)
        for key, merged in defs.items():
            for name, sub in (params.pop(key, None) or {}).items():
                if merged.get(name, sub) != sub:
                    raise bad_request(f"two tools define {key} {name!r} differently: rename one", param="tools")
                merged[name] = sub
        items.append({"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update((key, merged) for key, merged in defs.items() if merged)
    return schema


def plan_tools(body: Any, parser_name: str | None, auto_enabled: bool) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice``; None when the request uses no tools. Raises 400 APIErrors."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: give the functions in 'tools'", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", param="tools")
    if choice is None:
        choice = "auto"
    call_id = PARSERS.get(parser_name or "", ToolParser).call_id
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              param="tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                              param="tool_choice")
        params = tools[names.index(name)].function.parameters or _NO_PARAMETERS
        return ToolPlan("named", function=name, guided=GuidedDecodingParams(json=params), call_id=call_id)
    if choice == "none":
        return ToolPlan("none")
    if choice == "required":
        schema = _required_schema(tools, body.parallel_tool_calls)
        return ToolPlan("required", guided=GuidedDecodingParams(json=schema), call_id=call_id)
    if choice == "auto":
        if not auto_enabled or parser_name is None:
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                              "--tool-call-parser", param="tool_choice")
        return ToolPlan("auto", parser=get_parser(parser_name), parallel=body.parallel_tool_calls)
    raise bad_request(f"tool_choice={choice!r}: use 'none', 'auto', 'required' or a named function",
                      param="tool_choice")


def _call_dict(plan: ToolPlan, call: ToolCall, index: int | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"id": plan.new_call_id(), "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}
    return d if index is None else {"index": index, **d}


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a ``required`` output: the grammar's JSON array, or, when ``max_tokens`` cut it, the
    elements that were complete (never the grammar's own ``{"name", "parameters"}`` text as content)."""
    try:
        items = json.loads(text)
    except ValueError:
        items = _complete_elements(text)
    if not isinstance(items, list):
        return []
    return [ToolCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items
            if isinstance(i, dict) and isinstance(i.get("name"), str)]


def _complete_elements(text: str) -> list[Any]:
    decoder, out = json.JSONDecoder(), []
    pos = text.find("[") + 1
    while 0 < pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        out.append(item)
    return out


def _calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a complete output."""
    if plan.mode == "named":
        return None, [ToolCall(plan.function or "", text)]
    if plan.mode == "required":
        return None, _required_calls(text)
    if plan.mode == "auto" and plan.parser is not None:
        parsed = plan.parser.parse(text)
        return parsed.content, parsed.tool_calls if plan.parallel else parsed.tool_calls[:1]
    return text, []


def _finish(plan: ToolPlan, calls: list[ToolCall], reason: str | None) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call; a forced (named) call finishes with "stop"
    return "tool_calls" if calls and reason == "stop" and plan.mode != "named" else reason


def assistant_message(plan: ToolPlan | None, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The ``message`` of a finished choice and its finish_reason."""
    if plan is None or plan.mode == "none":
        return {"role": "assistant", "content": text}, reason
    content, calls = _calls(plan, text)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [_call_dict(plan, c) for c in calls]
    return msg, _finish(plan, calls, reason)


class ToolStreamer:
    """Turns one choice's text deltas into chat ``delta`` dicts: content passes through until a tool-call section
    may have begun; a section is held and sent as ``tool_calls`` deltas (id + name, then arguments) when it ends.
    A named call streams its arguments as they are generated."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content
        self.in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.text += text
        plan = self.plan
        if plan.mode == "named":
            if not self.in_call:
                self.in_call = True
                self.calls = [ToolCall(plan.function or "", "")]
                head = _call_dict(plan, self.calls[0], 0)
                head["function"]["arguments"] = text
                return [{"tool_calls": [head]}]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if plan.mode == "required" or self.in_call:
            self.in_call = True
            return []
        if plan.mode == "auto" and plan.parser is not None:
            start = plan.parser.call_start(self.text)
            end = start if start >= 0 else len(self.text) - plan.parser.holdback(self.text)
            self.in_call = start >= 0
            while end > self.sent and self.text[end - 1].isspace():
                end -= 1  # whitespace before a call is dropped (as in the whole-output parse): hold it
        else:
            end = len(self.text)
        return self._content(end)

    def _content(self, end: int) -> list[dict[str, Any]]:
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:end], end
        return [{"content": piece}]

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas still held back and the choice's finish_reason."""
        if self.plan.mode == "named":
            return [], reason
        if not self.in_call:
            return self._content(len(self.text)), reason
        _, calls = _calls(self.plan, self.text)
        if not calls and self.plan.mode == "required":  # cut before one call was whole: nothing to show
            return [], reason
        if not calls:  # not a valid call after all: the held text is content
            return self._content(len(self.text)), reason
        self.calls = calls
        deltas = [{"tool_calls": [_call_dict(self.plan, c, k)]} for k, c in enumerate(calls)]
        return deltas, _finish(self.plan, calls, reason)


def message_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages -> the dicts chat templates read: assistant ``tool_calls`` with their arguments as objects
    (templates such as Qwen's render them with ``tojson``), ``tool`` results with ``tool_call_id`` and ``name``."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _args(c.function.arguments)}}
                               for c in m.tool_calls]
        out.append(d)
    return out


def _args(arguments: str | dict) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        raise bad_request("an assistant tool call's arguments must be a JSON object (text)",
                          param="messages") from None


def tool_events(streamer: ToolStreamer, chunk: Any, index: int, text: str, logprobs: Any,
                finish_reason: str | None, stop_reason: Any = None) -> list[bytes]:
    """SSE chunks for one engine delta of a choice with tools; the finish_reason (and the stop_reason) ride on the
    last one."""
    deltas = streamer.feed(text)
    reason = finish_reason
    if finish_reason is not None:
        tail, reason = streamer.finish(finish_reason)
        deltas += tail
    if not deltas:
        if reason is None and logprobs is None:
            return []
        deltas = [{}]
    last = len(deltas) - 1
    return [chunk(index, d, logprobs if k == 0 else None, reason if k == last else None,
                  {"stop_reason": stop_reason} if k == last and reason is not None else None)
            for k, d in enumerate(deltas)]
