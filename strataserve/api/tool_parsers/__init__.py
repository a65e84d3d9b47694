"""Tool-call parsers: turn a model's raw text into OpenAI ``tool_calls``, one module per model family's format.

Chosen with ``strata serve --tool-call-parser NAME`` (vLLM's names): ``hermes`` (Qwen2/Qwen3 ``<tool_call>``
JSON), ``llama3_json`` (Llama 3.1 ``{"name": ..., "parameters": ...}``), ``mistral`` (``[TOOL_CALLS]``).
"""
from __future__ import annotations

from strataserve.api.tool_parsers.base import ParsedOutput, ToolCall, ToolParser
from strataserve.api.tool_parsers.hermes import HermesToolParser
from strataserve.api.tool_parsers.llama3_json import Llama3JsonToolParser
from strataserve.api.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_parser(name: str) -> ToolParser:
    """The parser named ``name``; ValueError listing the known names otherwise."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}: use one of {', '.join(PARSERS)}")
    return cls()


__all__ = ["PARSERS", "ParsedOutput", "ToolCall", "ToolParser", "get_parser"]
