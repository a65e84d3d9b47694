"""Hermes / Qwen2 / Qwen3: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``, possibly several,
possibly after some content; an unclosed last call (max_tokens hit right after it) still counts when it parses."""
from __future__ import annotations

import re

from strataserve.api.tool_parsers.base import ParsedOutput, ToolParser, call_from_obj, json_values

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    markers = ("<tool_call>",)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(text)
        calls = []
        for body in _CALL.findall(text[start:]):
            values, rest = json_values(body.strip())
            call = call_from_obj(values[0]) if len(values) == 1 and not rest.strip() else None
            if call is None:
                return ParsedOutput(text)  # malformed: hand the text back untouched
            calls.append(call)
        content = text[:start].rstrip()
        return ParsedOutput(content or None, calls)
