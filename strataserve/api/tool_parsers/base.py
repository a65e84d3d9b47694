"""What every tool-call parser provides: ``parse`` of a whole output, and the markers that let a stream hold back
text that may begin a tool call (so no half of a call ever reaches the client as content)."""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def call_from_obj(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """{"name": str, <args_key>: object or JSON text} -> ToolCall (None if it is not shaped like one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_values(text: str) -> tuple[list[Any], str]:
    """Consecutive JSON values at the start of ``text`` (separated by whitespace, ``;`` or ``,``); returns them
    and the rest of the text from the first place that is not JSON."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out, ""
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return out, text[i:]
        out.append(value)


class ToolParser(ABC):
    #: strings that open a tool-call section
    markers: tuple[str, ...] = ()
    #: True when a section may only open at the start of the output (after whitespace)
    at_start_only: bool = False

    @staticmethod
    def call_id() -> str:
        """A new tool call's ``id`` (vLLM's form); a family whose chat template checks the ids it is handed back
        overrides it."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and the tool calls of a complete output. Text with no valid call is all content."""

    def call_start(self, text: str) -> int:
        """Index where a tool-call section opens in ``text``, or -1."""
        if self.at_start_only:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.markers) else -1
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else -1

    def holdback(self, text: str) -> int:
        """How many trailing characters of ``text`` (with no section opened yet) might begin a marker."""
        if self.at_start_only:
            stripped = text.lstrip()
            return len(text) if any(m.startswith(stripped) for m in self.markers) else 0
        best = 0
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    best = max(best, k)
                    break
        return best
