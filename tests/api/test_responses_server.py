"""``POST /v1/responses`` through real servers and the official ``openai`` client: the embedded demo model (text)
and a tiny Qwen3 checkpoint served with ``--tool-call-parser hermes`` (tools, structured output). Streams are read
with the client's own accumulator, whose final response must equal the non-streamed one under greedy decoding."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response
from prometheus_client.parser import text_string_to_metric_families
from _tiny_models import make_tiny_checkpoint, make_tiny_tokenizer
from api_server import TOOL_TEMPLATE, WEATHER, launch, wait_ready

from strataserve.assets import DEMO_MODEL_DIR

pytest.importorskip("xgrammar")

TOOLS = [{"type": "function", "name": "get_weather", "description": "forecast", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
ARGS = r'\{"city": "[a-z]{1,6}", "days": [1-7]\}'
HERMES_CALL = r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": ' + ARGS + r'\}\n</tool_call>'


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("resp_qwen3"))
    tok = make_tiny_tokenizer(512)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(path)
    logs = tmp_path_factory.mktemp("resp_logs")
    started = {"demo": launch(DEMO_MODEL_DIR, logs / "demo.log", "--max-model-len", "1024", wait=False),
               "qwen3": launch(path, logs / "qwen3.log", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                               "--max-model-len", "1024", wait=False)}  # together: the imports overlap
    try:
        for s in started.values():
            wait_ready(s)
        yield {name: (openai.OpenAI(base_url=f"{s.url}/v1", api_key=s.api_key, max_retries=0, timeout=60), s)
               for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def _shape(response) -> dict:
    """What must agree between a streamed and a non-streamed response: everything but ids and times."""
    d = response.model_dump(exclude={"id", "created_at", "completed_at"})
    d["usage"]["input_tokens_details"].pop("cached_tokens")  # a repeat finds its prompt in the prefix cache
    for item in d["output"]:
        item.pop("id", None)
        item.pop("call_id", None)
        for part in item.get("content") or ():
            part.pop("parsed", None)
        item.pop("parsed_arguments", None)
    return d


def _streamed(client, **kw):
    """The final response the client's stream helper assembles, and the raw event types in order."""
    with client.responses.stream(**kw) as stream:
        events = [e for e in stream]
        final = stream.get_final_response()
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(len(seqs)))
    return final, [e.type for e in events]


def test_text_streamed_equals_non_streamed(clients):
    client, _ = clients["demo"]
    kw = dict(model="tiny", instructions="Tell a short story.", temperature=0, max_output_tokens=200,
              input=[{"role": "developer", "content": "Be kind."},
                     {"role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]}],
              metadata={"run": "a"}, user="u1", extra_body={"stop": ["."]})
    r = client.responses.create(**kw)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.incomplete_details is None and r.metadata == {"run": "a"} and r.user == "u1"
    assert r.instructions == "Tell a short story." and r.max_output_tokens == 200 and r.temperature == 0
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text and r.output_text
    u = r.usage
    assert u.output_tokens > 0 and u.input_tokens > 10 and u.total_tokens == u.input_tokens + u.output_tokens
    final, types = _streamed(client, **kw)
    assert _shape(final) == _shape(r) and final.usage.input_tokens_details.cached_tokens > 0
    deltas = types.count("response.output_text.delta")
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    raw = client.responses.create(**kw, stream=True)  # stream=True: the same events, without the helper
    assert [e.type for e in raw] == types


def test_max_output_tokens_is_incomplete(clients):
    client, _ = clients["demo"]
    r = client.responses.create(model="tiny", input="Once upon a time", max_output_tokens=3,
                                extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = list(client.responses.create(model="tiny", input="Once upon a time", max_output_tokens=3,
                                          stream=True, extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 3


def test_tool_round_trip(clients):
    client, _ = clients["qwen3"]
    kw = dict(model="tiny", input="weather in paris?", tools=TOOLS, max_output_tokens=60, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    r = client.responses.create(**kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.tool_choice.name == "get_weather" and [t.name for t in r.tools] == ["get_weather", "get_time"]
    final, types = _streamed(client, **kw)
    assert _shape(final) == _shape(r)
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    # the round trip: the call and its output go back in; the answer is text (tool_choice none)
    history = [{"role": "user", "content": "weather in paris?"}, *[o.model_dump() for o in r.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    again = client.responses.create(model="tiny", input=history, tools=TOOLS, tool_choice="none",
                                    max_output_tokens=5)
    assert again.output[0].type == "message" and again.usage.input_tokens > r.usage.input_tokens
    # required, one call: always a parsed call
    req = client.responses.create(model="tiny", input="time?", tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    assert [o.type for o in req.output] == ["function_call"] and req.parallel_tool_calls is False


def test_auto_tool_call_parsed_by_hermes(clients):
    client, _ = clients["qwen3"]
    # a random model never calls by itself: a regex makes it write a Hermes call, which the parser must find
    kw = dict(model="tiny", input="weather in paris?", tools=TOOLS, max_output_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Sure."
    assert r.output[1].name == "get_weather" and r.status == "completed"
    final, types = _streamed(client, **kw)
    assert _shape(final) == _shape(r)
    assert types.index("response.output_text.done") < types.index("response.function_call_arguments.done")


def test_json_schema_output(clients):
    client, _ = clients["qwen3"]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "w": {"enum": ["a", "b"]}},
              "required": ["n", "w"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="json please", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "thing", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "thing"
    obj = client.responses.create(model="tiny", input="json please", max_output_tokens=60,
                                  text={"format": {"type": "json_object"}})
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


BAD = [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]}, "input[0].arguments"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "hi " * 2000}, "input"),
    ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": ["hello"]}, "input[0]"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_400_naming_the_param(clients, extra, param):
    _, server = clients["qwen3"]
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **extra}, headers=server.headers,
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_raw_body_validates_and_needs_the_api_key(clients):
    _, server = clients["demo"]
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4}
    r = httpx.post(f"{server.url}/v1/responses", json=body, headers=server.headers, timeout=30)
    Response.model_validate(r.json())  # the client's schema, validated (the client itself only constructs)
    assert httpx.post(f"{server.url}/v1/responses", json=body, timeout=30).status_code == 401


def _metric(server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return 0.0


def test_disconnect_mid_stream_aborts(clients):
    _, server = clients["qwen3"]
    aborts = _metric(server, "strata:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "input": "go on", "max_output_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as own:
        with own.stream("POST", f"{server.url}/v1/responses", json=body, headers=server.headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(6):
                next(line for line in lines if line.startswith("data:"))
            assert _metric(server, "strata:num_requests_running") == 1
    # the hang-up aborted the engine request (its KV blocks go with it) rather than letting it run 900 tokens
    deadline = time.monotonic() + 15
    while _metric(server, "strata:request_success_total", finished_reason="abort") == aborts:
        assert time.monotonic() < deadline, "the engine request was not aborted"
        time.sleep(0.05)
    while _metric(server, "strata:num_requests_running"):
        assert time.monotonic() < deadline, "the aborted request still runs"
        time.sleep(0.05)


TWO_CALLS = HERMES_CALL + r'\n<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>'


def test_cut_short_marks_only_the_cut_item_incomplete(clients):
    client, _ = clients["qwen3"]
    kw = dict(model="tiny", input="weather in paris?", tools=TOOLS, temperature=0,
              extra_body={"structured_outputs": {"regex": TWO_CALLS}})
    full = client.responses.create(**kw, max_output_tokens=200)
    assert full.status == "completed" and [o.type for o in full.output][-2:] == ["function_call"] * 2
    # cut inside the second call's arguments: the text and the first call were complete, the second was not
    kw["max_output_tokens"] = full.usage.output_tokens - 12
    cut = client.responses.create(**kw)
    assert cut.status == "incomplete" and len(cut.output) >= 2
    assert [o.status for o in cut.output] == ["completed"] * (len(cut.output) - 1) + ["incomplete"]
    with client.responses.stream(**kw) as stream:
        final = [e for e in stream][-1].response  # response.incomplete: get_final_response() wants "completed"
    assert _shape(final) == _shape(cut)


def test_nothing_is_stored_and_stored_routes_say_so(clients):
    client, _ = clients["demo"]
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=True)
    assert r.store is False  # as vLLM without a store: nothing was kept, whatever was asked
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.input_items.list(r.id),
                 lambda: client.responses.delete(r.id), lambda: client.responses.cancel(r.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert r.id in str(info.value) and "keeps no responses" in str(info.value)
