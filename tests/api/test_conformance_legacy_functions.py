"""OpenAI's deprecated ``functions`` / ``function_call`` on /v1/chat/completions: a 400 that points to tools /
tool_choice, where before they were dropped without a word (the model answered in plain text, no call, no error).
The null / no-op values some clients send by default still pass."""
from __future__ import annotations

import openai
import pytest
from api_server import MODEL

FN = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
MSGS = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_functions_are_refused_with_a_pointer_to_tools(client, stream):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, functions=[FN], stream=stream)
    assert err.value.body["param"] == "functions" and "tools" in err.value.body["message"]


def test_a_forced_function_call_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2,
                                       function_call={"name": "get_weather"})
    assert err.value.body["param"] == "function_call" and "tool_choice" in err.value.body["message"]


@pytest.mark.parametrize("extra", [{"functions": None, "function_call": None}, {"functions": []},
                                   {"function_call": "none"}, {"function_call": "auto"}])
def test_default_no_op_values_pass(client, extra):
    out = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, extra_body=extra)
    assert out.choices[0].finish_reason in ("length", "stop")
