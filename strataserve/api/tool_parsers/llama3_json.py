"""Llama 3.1/3.2 JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``), several separated by ``;``."""
from __future__ import annotations

from strataserve.api.tool_parsers.base import ParsedOutput, ToolParser, call_from_obj, json_values

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    markers = (_TAG, "{")
    at_start_only = True

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG):]
        values, rest = json_values(body)
        calls = [call_from_obj(v, "parameters") for v in values]
        if not calls or rest.strip() or any(c is None for c in calls):
            return ParsedOutput(text)
        return ParsedOutput(None, calls)  # type: ignore[arg-type]
