"""Unit checks (no server) of the response and request shapes around structured outputs and tools: masked
tokens' -inf logprobs are sent as vLLM's -9999.0 (JSON has no infinity: msgspec wrote null), Mistral call ids are
9 letters / digits in every tool_choice mode, and an explicit null for an optional request field means its
default."""
from __future__ import annotations

import json
import re

import pytest

from strataserve.api.formatting import vllm_prompt_logprobs as _prompt_logprobs
from strataserve.api.formatting import CompletionLogprobs, TokenNamer, chat_logprobs, json_bytes
from strataserve.api.protocol import ChatCompletionRequest, CompletionRequest
from strataserve.api.tools import ToolStreamer, assistant_message, plan_tools
from strataserve.types.outputs import Logprob

INF = float("-inf")


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


# one generated token (id 0, chosen) and its top alternatives: ids 1 and 2 were masked by the grammar
STEP = {0: Logprob(-0.1, 1, "a"), 1: Logprob(INF, 2, "b"), 2: Logprob(INF, 3, "c")}


def test_chat_top_logprobs_of_masked_tokens_are_numbers():
    items = json.loads(json_bytes(chat_logprobs(TokenNamer(_Tok()), [0], [STEP], 3)))
    assert items[0]["logprob"] == -0.1
    assert [t["logprob"] for t in items[0]["top_logprobs"]] == [-0.1, -9999.0, -9999.0]
    # a chosen token the grammar forced past a -inf (e.g. eos) is a number too
    forced = chat_logprobs(TokenNamer(_Tok()), [1], [STEP], 0)
    assert forced[0]["logprob"] == -9999.0


def test_completion_logprobs_of_masked_tokens_are_numbers():
    lp = CompletionLogprobs(TokenNamer(_Tok()), 3)
    lp.add([0, 1], [STEP, STEP])
    out = json.loads(json_bytes(lp.result()))
    assert out["token_logprobs"] == [-0.1, -9999.0]
    assert out["top_logprobs"][0] == {"a": -0.1, "b": -9999.0, "c": -9999.0}
    # echo: the prompt's logprobs go through the same path, the first (no logprob) stays null as OpenAI's
    echo = CompletionLogprobs(TokenNamer(_Tok()), 2)
    part = json.loads(json_bytes(echo.add([3, 1], [None, STEP], text="db")))
    assert part["token_logprobs"] == [None, -9999.0] and None not in part["top_logprobs"][1].values()


def test_prompt_logprobs_of_masked_tokens_are_numbers():
    out = json.loads(json_bytes(_prompt_logprobs(TokenNamer(_Tok()), [5, 1], [None, STEP], 3)))
    assert out[0] is None
    assert {k: v["logprob"] for k, v in out[1].items()} == {"0": -0.1, "1": -9999.0, "2": -9999.0}
    assert b"null" not in json_bytes(out[1:])


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}]
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
OUTPUT = {"auto": '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]',
          "required": '[{"name": "get_time", "parameters": {"tz": "UTC"}}]', "named": '{"tz": "UTC"}'}
CHOICE = {"auto": "auto", "required": "required", "named": {"type": "function", "function": {"name": "get_time"}}}


def _ids(plan, text) -> list[str]:
    msg, _ = assistant_message(plan, text, "stop")
    ids = [c["id"] for c in msg["tool_calls"]]
    streamer = ToolStreamer(plan)
    deltas = [d for ch in text for d in streamer.feed(ch)] + streamer.finish("stop")[0]
    ids += [c["id"] for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert len(ids) == 2
    return ids


@pytest.mark.parametrize("mode", list(OUTPUT))
def test_mistral_call_ids_are_nine_alphanumerics(mode):
    """Mistral's chat template refuses any other id when the call comes back (vLLM's MistralToolCall ids)."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "time?"}], tools=TOOLS,
                                 tool_choice=CHOICE[mode])
    ids = _ids(plan_tools(body, "mistral", True), OUTPUT[mode])
    assert all(MISTRAL_ID.fullmatch(i) for i in ids), ids
    assert len(set(_ids(plan_tools(body, "mistral", True), OUTPUT[mode]) + ids)) == 4  # fresh each time
    if mode != "auto":  # other parsers (and none) keep vLLM's usual ids
        for parser in ("hermes", None):
            assert all(i.startswith("chatcmpl-tool-") for i in _ids(plan_tools(body, parser, True), OUTPUT[mode]))


CHAT_BASE = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("model,base", [(ChatCompletionRequest, CHAT_BASE), (CompletionRequest, {"prompt": "x"})])
def test_null_optional_fields_mean_their_default(model, base):
    for name, field in model.model_fields.items():
        if field.is_required():
            continue
        got = getattr(model.model_validate({**base, name: None}), name)
        # a null means the default, except where None is itself a value (completions max_tokens: null = as many
        # as fit, as in vLLM)
        assert got == field.default or (got is None and name == "max_tokens"), (name, got)
    body = model.model_validate({**base, "n": None, "stream": None, "stream_options": {"include_usage": None},
                                 "response_format": {"type": None}})
    assert body.n == 1 and body.stream is False and body.stream_options.include_usage is False
    assert body.response_format.type == "text"


def test_null_chat_fields_reach_their_defaults():
    body = ChatCompletionRequest.model_validate({**CHAT_BASE, "parallel_tool_calls": None, "logprobs": None,
                                                 "n": None, "tools": TOOLS, "tool_choice": "required"})
    assert body.parallel_tool_calls is True and body.logprobs is False and body.n == 1
    schema = plan_tools(body, None, False).guided.json
    assert "maxItems" not in schema  # parallel calls allowed, as with the field left out
    with pytest.raises(Exception):
        ChatCompletionRequest.model_validate({"model": "m", "messages": None})  # a required field stays required
