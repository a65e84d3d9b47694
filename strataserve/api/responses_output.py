"""The Responses API's output shapes: the ``response`` object (with the request's settings echoed as OpenAI echoes
them), its output items (``message`` with ``output_text``, ``function_call``), usage, and the streamed events in
OpenAI's order, each with its ``sequence_number``. Shapes follow ``openai.types.responses``."""
from __future__ import annotations

import time
import uuid
from typing import Any

from strataserve.api.errors import APIError
from strataserve.api.formatting import json_bytes, line_safe
from strataserve.api.responses_protocol import ResponsesRequest
from strataserve.types.sampling import SamplingParams


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # OpenAI's form: resp_..., msg_..., fc_...


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [text_part(text)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A finished chat ``message`` (``api/tools.assistant_message``) as output items: the text (when there is
    some, or when nothing else came), then one ``function_call`` per tool call. ``status`` is the last item's:
    output cut short cuts only the item being written, the ones before it were complete (as OpenAI, and as the
    stream closes them)."""
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    items = [message_item(new_id("msg"), text, "completed")] if text or not calls else []
    items += [call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
              for c in calls]
    items[-1]["status"] = status
    return items


def response_usage(input_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


class ResponseShell:
    """The parts of a ``response`` object fixed at its start: its id, time and the settings it ran with (the
    effective temperature / top_p, after the checkpoint's defaults, as OpenAI echoes the values it used).
    ``store`` is false whatever was asked: nothing is kept (as vLLM without a store answers)."""

    def __init__(self, body: ResponsesRequest, model: str, params: SamplingParams) -> None:
        self.id = new_id("resp")
        fmt = body.text.format if body.text is not None else None
        text: dict[str, Any] = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else
                                {"type": "text"}}
        if body.text is not None and body.text.verbosity is not None:
            text["verbosity"] = body.text.verbosity
        tc = body.tool_choice
        self.fields: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": params.temperature,
            "top_p": params.top_p, "text": text,
            "tool_choice": "auto" if tc is None else tc if isinstance(tc, str) else tc.model_dump(),
            "tools": [t.model_dump() for t in body.tools or ()], "truncation": body.truncation or "disabled",
            "user": body.user, "metadata": body.metadata or {}, "background": False,
            "service_tier": body.service_tier or "auto", "max_tool_calls": body.max_tool_calls,
            "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier,
            "top_logprobs": 0,
        }

    def snapshot(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        done = int(time.time()) if status == "completed" else None
        return {**self.fields, "status": status, "completed_at": done, "error": error,
                "incomplete_details": incomplete, "output": output, "usage": usage}


def final_status(finish_reason: str | None) -> str:
    # "length": the output budget ran out (max_output_tokens, or the context's end); OpenAI names one reason
    return "incomplete" if finish_reason == "length" else "completed"


class EventWriter:
    """Streamed events for one response: the lifecycle events, then each output item opened, filled by deltas
    and closed in order; the final ``response.completed`` (or ``response.incomplete``) carries the whole
    response, so a client's accumulated stream equals the non-streamed answer."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # closed items, in output order
        self.open: dict[str, Any] | None = None  # the item being streamed

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + line_safe(json_bytes(data)) + b"\n\n"

    def start(self) -> bytes:
        head = self.shell.snapshot("in_progress", [])
        return self.event("response.created", response=head) + self.event("response.in_progress", response=head)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.items)}  # type: ignore[index]

    def text(self, piece: str) -> bytes:
        out = b""
        if self.open is not None and self.open["type"] != "message":
            out += self.close("completed")
        if self.open is None:
            self.open = message_item(new_id("msg"), "", "in_progress")
            self.open["content"] = []
            out += self.event("response.output_item.added", output_index=len(self.items), item=self.open)
            self.open["content"] = [text_part("")]
            out += self.event("response.content_part.added", **self._where(), content_index=0, part=text_part(""))
        if not piece:
            return out
        self.open["content"][0]["text"] += piece
        return out + self.event("response.output_text.delta", **self._where(), content_index=0, delta=piece,
                                logprobs=[])

    def call(self, call_id: str, name: str, arguments: str) -> bytes:
        """A new function call (and the first piece of its arguments)."""
        out = self.close("completed") if self.open is not None else b""
        self.open = call_item(new_id("fc"), call_id, name, "", "in_progress")
        out += self.event("response.output_item.added", output_index=len(self.items), item=dict(self.open))
        return out + self.arguments(arguments)

    def arguments(self, piece: str) -> bytes:
        if not piece or self.open is None:
            return b""
        self.open["arguments"] += piece
        return self.event("response.function_call_arguments.delta", **self._where(), delta=piece)

    def close(self, status: str) -> bytes:
        item, out = self.open, b""
        if item is None:
            return out
        if item["type"] == "message":
            part = item["content"][0]
            out += self.event("response.output_text.done", **self._where(), content_index=0, text=part["text"],
                              logprobs=[])
            out += self.event("response.content_part.done", **self._where(), content_index=0, part=part)
        else:
            out += self.event("response.function_call_arguments.done", **self._where(), name=item["name"],
                              arguments=item["arguments"])
        item["status"] = status
        out += self.event("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        self.open = None
        return out

    def finish(self, status: str, usage: dict[str, Any]) -> bytes:
        out = b""
        if self.open is None and not self.items:  # nothing was said: an empty message, as non-streamed
            out += self.text("")
        out += self.close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self.event(kind, response=self.shell.snapshot(status, self.items, usage))

    def error(self, exc: APIError) -> bytes:
        """A failure after the stream began: OpenAI's ``error`` event, then ``response.failed``."""
        code = str(exc.code) if exc.code is not None else exc.type
        out = self.event("error", code=code, message=exc.message, param=exc.param)
        failed = self.shell.snapshot("failed", self.items, None, {"code": "server_error" if exc.status >= 500 else
                                                                  "invalid_prompt", "message": exc.message})
        return out + self.event("response.failed", response=failed)
