"""``/v1/responses`` pieces without a server: the input items as the chat request they mean, every streamed event
and the response object validated against the ``openai`` package's own pydantic types, and a failure mid-stream
as OpenAI's ``error`` event (then ``response.failed``) with the engine request closed."""
from __future__ import annotations

import asyncio
import json
from typing import get_args
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from strataserve.api.errors import APIError
from strataserve.api.metrics import ServerMetrics
from strataserve.api.responses import _Job, _stream
from strataserve.api.responses_input import to_chat
from strataserve.api.responses_output import EventWriter, ResponseShell, response_usage
from strataserve.api.responses_protocol import ResponsesRequest
from strataserve.api.serving import ServerState
from strataserve.types.errors import EngineDeadError
from strataserve.types.outputs import CompletionOutput, RequestOutput
from strataserve.types.sampling import SamplingParams

#: each event type's class in the client (its union's members, by their ``type`` literal)
EVENT = {get_args(c.model_fields["type"].annotation)[0]: c for c in get_args(get_args(ResponseStreamEvent)[0])}


def _events(data: bytes) -> list[dict]:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            kind, payload = block.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            EVENT[event["type"]].model_validate(event)  # the client's schema, validated (not merely constructed)
            out.append(event)
    return out


def test_input_items_become_the_chat_conversation():
    body = ResponsesRequest.model_validate({"instructions": "be brief", "input": [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}],
        "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}],
        "tool_choice": {"type": "function", "name": "g"}, "max_output_tokens": 7,
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}})
    chat = to_chat(body)
    got = [(m.role, m.text(), [c.id for c in m.tool_calls or ()], m.tool_call_id, m.name) for m in chat.messages]
    assert got == [("system", "be brief", [], None, None), ("system", "dev", [], None, None),
                   ("user", "a\nb", [], None, None), ("assistant", "let me look", ["c1", "c2"], None, None),
                   ("tool", "one", [], "c1", "f"), ("tool", "two", [], "c2", "g")]
    assert chat.tool_choice == {"type": "function", "function": {"name": "g"}}
    assert [t.function.name for t in chat.tools] == ["f", "g"] and chat.max_completion_tokens == 7
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {
        "type": "object"}


def _shell(**body) -> ResponseShell:
    return ResponseShell(ResponsesRequest.model_validate({"input": "x", **body}), "m",
                         SamplingParams(temperature=0.5, top_p=0.9))


def test_events_and_response_match_the_openai_schema():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    w = EventWriter(_shell(tools=tools, metadata={"k": "v"}))
    data = (w.start() + w.text("Hel") + w.text("lo") + w.call("call_1", "f", "{\"a\"") + w.arguments(": 1}")
            + w.finish("completed", response_usage(5, 4, 2)))
    events = _events(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello" and final.output[1].arguments == '{"a": 1}'
    assert final.usage.input_tokens_details.cached_tokens == 2 and final.metadata == {"k": "v"}
    assert final.temperature == 0.5 and final.tool_choice == "auto"
    assert [e["output_index"] for e in events if "output_index" in e] == [0] * 7 + [1] * 5


class _Trace:
    def __init__(self) -> None:
        self.outcome = None

    def on_tokens(self, n: int) -> None:
        pass

    def queue_time(self, s: float) -> None:
        pass

    def finish(self, outcome: str, *args) -> None:
        self.outcome = outcome


def test_failure_mid_stream_is_an_error_event_and_closes_the_engine_request():
    closed = []

    async def generate(prompt_ids, params, request_id, priority=0):
        try:
            yield RequestOutput(request_id, None, prompt_ids, [CompletionOutput(0, "Hi", [7])], False)
            raise EngineDeadError("the core process exited")
        finally:
            closed.append(request_id)

    state = ServerState(engine=SimpleNamespace(generate=generate), tokenizer=None, model_name="m",
                        max_model_len=64, metrics=ServerMetrics("m", 64, lambda: None, register=False),
                        max_inflight_seqs=8)
    trace = _Trace()
    routed = SimpleNamespace(trace=lambda work: trace)
    job = _Job(state, ResponsesRequest(input="x"), [1, 2], SamplingParams(max_tokens=5), None, 0)

    async def run() -> bytes:
        return b"".join([chunk async for chunk in _stream(job, routed, 2.0)])

    events = _events(asyncio.run(run()))
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    err = events[-2]
    assert err["code"] == "engine_dead" and "not running" in err["message"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"
    assert closed == [job.shell.id] and trace.outcome not in (None, "ok") and state.inflight_seqs == 0


@pytest.mark.parametrize("status", ["completed", "incomplete"])
def test_an_empty_output_is_one_empty_message(status):
    w = EventWriter(_shell())
    events = _events(w.start() + w.finish(status, response_usage(1, 0, 0)))
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "" and final.status == status and len(final.output) == 1
    assert (final.incomplete_details is not None) == (status == "incomplete")


def test_errors_before_the_stream_name_responses_fields():
    body = ResponsesRequest.model_validate({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]})
    with pytest.raises(APIError) as info:
        to_chat(body)
    assert info.value.param == "input[0].arguments"
