"""Tool-call parsers and the streamer on literal model outputs: calls, content around them, malformed calls,
and a character-by-character stream that must give the same content and calls as the whole-output parse."""
from __future__ import annotations

import json

import pytest

from strataserve.api.tool_parsers import get_parser
from strataserve.api.tools import ToolPlan, ToolStreamer, assistant_message

CASES = {
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
         '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Let me check.", [("f", {"a": 1}), ("g", {})]),
        ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", {"a": [1, 2]})]),  # unclosed
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ("just text < tool", "just text < tool", []),
    ],
    "llama3_json": [
        ('{"name": "f", "parameters": {"x": "y"}}', None, [("f", {"x": "y"})]),
        ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"k": 2}}', None,
         [("f", {}), ("g", {"k": 2})]),
        ('{"name": "f"} and more', '{"name": "f"} and more', []),
        ("The answer is {1}", "The answer is {1}", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "f", "arguments": {"q": 1}}, {"name": "g", "arguments": {}}]', None,
         [("f", {"q": 1}), ("g", {})]),
        ('ok [TOOL_CALLS]f[ARGS]{"q": "z"}[TOOL_CALLS]g[ARGS]{}', "ok", [("f", {"q": "z"}), ("g", {})]),
        ("[TOOL_CALLS] nonsense", "[TOOL_CALLS] nonsense", []),
        ("no calls [TOOL", "no calls [TOOL", []),
    ],
}


def _as_pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", list(CASES))
def test_parse(name):
    parser = get_parser(name)
    for text, content, calls in CASES[name]:
        out = parser.parse(text)
        assert out.content == content and _as_pairs(out.tool_calls) == calls, text


@pytest.mark.parametrize("name", list(CASES))
def test_char_stream_equals_whole_parse(name):
    plan = ToolPlan("auto", parser=get_parser(name))
    for text, _, _ in CASES[name]:
        msg, reason = assistant_message(plan, text, "stop")
        st = ToolStreamer(plan)
        deltas = [d for ch in text for d in st.feed(ch)]
        tail, s_reason = st.finish("stop")
        deltas += tail
        content = "".join(d.get("content", "") for d in deltas)
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert (content or None) == msg["content"] and s_reason == reason
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
        assert [c["index"] for c in calls] == list(range(len(calls)))


def test_unknown_parser_is_value_error():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


def _streamed(plan, text, reason):
    st = ToolStreamer(plan)
    deltas = [d for ch in text for d in st.feed(ch)]
    tail, s_reason = st.finish(reason)
    deltas += tail
    return "".join(d.get("content", "") for d in deltas) or None, \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for d in deltas
         for c in d.get("tool_calls", [])], s_reason


def test_parallel_tool_calls_false_keeps_the_first_auto_call():
    text = CASES["hermes"][0][0]  # two calls
    plan = ToolPlan("auto", parser=get_parser("hermes"), parallel=False)
    msg, reason = assistant_message(plan, text, "stop")
    assert _as_pairs_dicts(msg["tool_calls"]) == [("f", {"a": 1})] and reason == "tool_calls"
    assert _streamed(plan, text, "stop") == ("Let me check.", [("f", {"a": 1})], "tool_calls")


def test_required_cut_by_max_tokens_keeps_whole_calls_and_shows_no_grammar_text():
    plan = ToolPlan("required")
    for text, calls in [('[{"name": "ping", "parameters": {}}, {"name":', [("ping", {})]),
                        ('[{"name": "ping", "parameters": {"x": [1, ', []), ("", [])]:
        msg, reason = assistant_message(plan, text, "length")
        assert msg["content"] is None and _as_pairs_dicts(msg.get("tool_calls", [])) == calls
        assert reason == "length"
        assert _streamed(plan, text, "length") == (None, calls, "length")


def _as_pairs_dicts(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
