"""OpenAI chat messages as chat templates read them (the offline ``LLM.chat``; the server's routes do the same from
their typed requests in ``api/tools.py``): text parts joined by newlines, as vLLM renders them, and a tool call's
``arguments`` as an object (templates such as Qwen's write them with ``tojson``)."""
from __future__ import annotations

import json
from typing import Any, Mapping


def plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"a chat message is a dict with a 'role' (and 'content'), got {message!r:.80}")
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"message content parts must be {{'type': 'text', 'text': ...}} (this model reads "
                                 f"text only), got {part!r:.80}")
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    if out.get("tool_calls"):
        out["tool_calls"] = [_call(c) for c in out["tool_calls"]]
    return out


def _call(call: Mapping[str, Any]) -> dict[str, Any]:
    call = dict(call)
    fn = call.get("function")
    if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
        try:
            call["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
        except ValueError:
            pass  # not JSON: the template gets the text as given
    return call
