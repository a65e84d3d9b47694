"""Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or, from v11 on,
``[TOOL_CALLS]name[ARGS]{...}`` repeated. ``[TOOL_CALLS]`` is a special token: the chat route keeps special
tokens in the text when this parser is active. Call ids are 9 letters / digits: Mistral's chat template (and
mistral_common) refuse any other id when the call comes back in the next turn."""
from __future__ import annotations

import re
import secrets
import string

from strataserve.api.tool_parsers.base import ParsedOutput, ToolCall, ToolParser, call_from_obj, json_values

_MARK = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")
_ALNUM = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    markers = (_MARK,)

    @staticmethod
    def call_id() -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))  # vLLM's MistralToolCall id

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(_MARK)
        if start < 0:
            return ParsedOutput(text)
        content = text[:start].rstrip() or None
        calls: list[ToolCall] = []
        for part in text[start:].split(_MARK)[1:]:
            got = self._part(part)
            if got is None:
                return ParsedOutput(text)
            calls.extend(got)
        return ParsedOutput(content, calls) if calls else ParsedOutput(text)

    @staticmethod
    def _part(part: str) -> list[ToolCall] | None:
        m = _NAMED.match(part)
        if m:  # name[ARGS]{...}
            values, rest = json_values(part[m.end():])
            call = call_from_obj({"name": m.group(1), "arguments": values[0]}) if len(values) == 1 else None
            return [call] if call is not None and not rest.strip() else None
        values, rest = json_values(part)
        if rest.strip() or not values:
            return None
        items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
        calls = [call_from_obj(v) for v in items]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
