"""``/v1/responses`` details without a server: an upstream Responses request charged as the chat request it means,
cut-short output marking only the cut item incomplete (non-streamed as streamed), ``store`` echoed false, and
short 400s naming the field (``input[0]``, ``tool_choice``) instead of pydantic's union branches."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai.types.responses import Response

from strataserve.api.errors import install_error_handlers
from strataserve.api.responses_input import to_chat
from strataserve.api.responses_output import EventWriter, ResponseShell, output_items, response_usage
from strataserve.api.responses_protocol import ResponsesRequest
from strataserve.api.serving import UPSTREAM_DEFAULT_OUTPUT, _upstream_charge
from strataserve.types.sampling import SamplingParams

BIG = "hello " * 4000
ITEMS = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
         {"type": "function_call_output", "call_id": "c1", "output": "one"}]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "one", "tool_call_id": "c1", "name": "f"}]


@pytest.mark.parametrize("responses,chat", [
    ({"input": BIG, "max_output_tokens": 1}, {"messages": [{"role": "user", "content": BIG}], "max_tokens": 1}),
    ({"input": "hi", "instructions": "be brief"},
     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
    ({"input": ITEMS, "instructions": "be brief", "max_output_tokens": 9},
     {"messages": CHAT, "max_completion_tokens": 9}),
], ids=["string", "instructions", "items"])
def test_upstream_responses_charge_equals_the_chat_request(responses, chat):
    charge = _upstream_charge(responses, "/v1/responses")
    assert charge == _upstream_charge(chat, "/v1/chat/completions")
    assert charge > len(responses["input"] if isinstance(responses["input"], str) else "") / 4
    most = responses.get("max_output_tokens") or UPSTREAM_DEFAULT_OUTPUT
    assert charge - most > 0  # the input counts (it counted as 0 before)


def _shell(**body) -> ResponseShell:
    return ResponseShell(ResponsesRequest.model_validate({"input": "x", **body}), "m", SamplingParams())


def test_cut_short_marks_only_the_cut_item_incomplete_streamed_and_not():
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in (1, 2)]
    items = output_items({"content": "Sure.", "tool_calls": calls}, "incomplete")
    assert [i["status"] for i in items] == ["completed", "completed", "incomplete"]
    w = EventWriter(_shell())
    data = w.start() + w.text("Sure.") + w.call("c1", "f", "{}") + w.call("c2", "f", "{}")
    data += w.finish("incomplete", response_usage(1, 9, 0))
    final = w.shell.snapshot("incomplete", w.items)
    assert [i["status"] for i in final["output"]] == [i["status"] for i in items]
    assert [i["status"] for i in output_items({"content": "x"}, "incomplete")] == ["incomplete"]


def test_store_is_echoed_false_since_nothing_is_kept():
    for store in (True, False):
        r = Response.model_validate(_shell(store=store).snapshot("completed", [], response_usage(1, 1, 0)))
        assert r.store is False


def _app() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/r")
    async def handler(body: ResponsesRequest) -> dict:
        to_chat(body)
        return {}

    return TestClient(app)


@pytest.mark.parametrize("body,param,says", [
    ({"input": ["hello"]}, "input[0]", "must be an object"),
    ({"input": 3}, "input", "must be a string or a list of input items"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]}},
     "tool_choice", "must be 'auto', 'none', 'required' or"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments", "must be a JSON object"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "3"}]},
     "input[0].arguments", "must be a JSON object"),
], ids=["item-not-object", "input-number", "allowed_tools", "args-array", "args-number"])
def test_bad_input_is_one_short_error_naming_the_field(body, param, says):
    r = _app().post("/r", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert "literal" not in err["message"] and ".str" not in err["message"]  # no union branch names
