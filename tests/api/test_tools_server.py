"""Tool calling through real servers (one per ``--tool-call-parser``) and the official ``openai`` client.

A random model never writes a tool call by itself, so the auto-choice tests make it write one in its family's
format with a grammar constraint (``guided_regex``), then check what the parser and the client make of it; free
output must come back as plain content. ``required`` / named choices are grammar-constrained by the server."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from _tiny_models import make_tiny_checkpoint, make_tiny_tokenizer
from api_server import TOOL_TEMPLATE, WEATHER, launch, wait_ready

pytest.importorskip("xgrammar")

TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MSG = [{"role": "user", "content": "weather in paris?"}]
ARGS = r'\{"city": "[a-z]{1,6}", "days": [1-7]\}'
# the same call in each family's format, forced by a regex so the random model writes it
FORCED = {
    "hermes": r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": ' + ARGS + r'\}\n</tool_call>',
    "llama3_json": r'\{"name": "get_weather", "parameters": ' + ARGS + r'\}',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": ' + ARGS + r'\}\]',
}
CONTENT = {"hermes": "Sure.", "llama3_json": None, "mistral": None}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tools_ckpt"))
    tok = make_tiny_tokenizer(512)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(path)
    logs = tmp_path_factory.mktemp("tool_servers")
    started = {name: launch(path, logs / f"{name}.log", "--enable-auto-tool-choice", "--tool-call-parser", name, "--max-model-len", "1024",
                            wait=False) for name in FORCED}  # start together: the imports overlap
    try:
        for s in started.values():
            wait_ready(s)
        yield {name: openai.OpenAI(base_url=f"{s.url}/v1", api_key=s.api_key, max_retries=0, timeout=120)
               for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def _stream(client, **kw):
    """The completion the openai library itself assembles from the chunks (its stream helper)."""
    with client.chat.completions.stream(model="tiny", messages=kw.pop("messages", MSG), **kw) as s:
        for _ in s:
            pass
        return s.get_final_completion()


def _check_weather_call(choice, content, parser=None):
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or None) == content  # a stream starts with content "" (role chunk)
    (call,) = choice.message.tool_calls
    if parser == "mistral":  # Mistral's chat template takes back only 9-character alphanumeric ids
        assert call.type == "function" and re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    else:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.parametrize("parser", list(FORCED))
def test_auto_parses_each_family_format_streamed_and_not(servers, parser):
    client = servers[parser]
    kw = dict(tools=TOOLS, tool_choice="auto", max_tokens=200, temperature=1.0, seed=3,
              extra_body={"guided_regex": FORCED[parser]})
    r = client.chat.completions.create(model="tiny", messages=MSG, **kw)
    _check_weather_call(r.choices[0], CONTENT[parser], parser)
    s = _stream(client, **kw)
    _check_weather_call(s.choices[0], CONTENT[parser], parser)
    assert s.choices[0].message.tool_calls[0].function.arguments == r.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.parametrize("parser", list(FORCED))
def test_output_that_is_not_a_call_is_plain_content(servers, parser):
    client = servers[parser]
    kw = dict(tools=TOOLS, max_tokens=12, temperature=0, extra_body={"guided_regex": "[a-z ]{12}"})
    r = client.chat.completions.create(model="tiny", messages=MSG, **kw)
    s = _stream(client, **kw)
    for c in (r.choices[0], s.choices[0]):
        assert not c.message.tool_calls and c.finish_reason in ("stop", "length")
    assert s.choices[0].message.content == r.choices[0].message.content and len(r.choices[0].message.content) == 12


def test_required_and_named_choices_always_parse(servers):
    client = servers["hermes"]
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for stream in (False, True):
        for seed in range(2):
            kw = dict(tools=TOOLS, tool_choice="required", max_tokens=200, temperature=1.0, seed=seed,
                      parallel_tool_calls=False)  # one call: a random model may otherwise add calls until length
            r = _stream(client, **kw) if stream else client.chat.completions.create(model="tiny", messages=MSG, **kw)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.tool_calls
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=40)
        r = _stream(client, **kw) if stream else client.chat.completions.create(model="tiny", messages=MSG, **kw)
        c = r.choices[0]
        assert c.finish_reason == "stop" and not c.message.content
        (call,) = c.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_none_gives_content_and_tool_turns_go_through_the_template(servers):
    client = servers["hermes"]
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=20,
                                       extra_body={"guided_regex": FORCED["hermes"]})
    assert r.choices[0].message.content.startswith("Sure. <tool_call>") and not r.choices[0].message.tool_calls
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    # the reference: the same conversation rendered by transformers with the arguments as an object
    tok = make_tiny_tokenizer(512)
    ref_msgs = MSG + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tok.apply_chat_template(ref_msgs, tools=TOOLS, chat_template=TOOL_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True)
    assert '<tool_response>call_1:sunny</tool_response>' in text and '"days": 2' in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_bad_tool_requests_are_400(servers, server):
    client = servers["hermes"]
    bad = [dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
           dict(tool_choice="required"),
           dict(tools=TOOLS, tool_choice="sometimes"),
           dict(tools=TOOLS + TOOLS[:1]),
           dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})]
    for kw in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, **kw)
    plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        plain.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=4)


def test_chat_template_fields_render_as_transformers_does(servers):
    """``tools`` on /tokenize, ``chat_template_kwargs`` and ``continue_final_message`` (vLLM's fields): the chat
    route and /tokenize give the ids transformers renders, and contradictory fields are 400s."""
    client = servers["hermes"]
    tok = make_tiny_tokenizer(512)
    prefill = MSG + [{"role": "assistant", "content": "Sure, the weath"}]
    cases = [(MSG, dict(tools=TOOLS)), (MSG, dict(chat_template_kwargs={"enable_thinking": False})),
             (prefill, dict(continue_final_message=True, add_generation_prompt=False))]
    for messages, fields in cases:
        kw = {k: v for k, v in fields.items() if k != "chat_template_kwargs"}
        text = tok.apply_chat_template(messages, chat_template=TOOL_TEMPLATE, tokenize=False,
                                       **{"add_generation_prompt": True, **kw, **fields.get("chat_template_kwargs", {})})
        want = tok.encode(text, add_special_tokens=False)
        counted = httpx.post(str(client.base_url).removesuffix("v1/") + "tokenize", timeout=60,
                             headers={"Authorization": f"Bearer {client.api_key}"},
                             json={"model": "tiny", "messages": messages, **fields})
        assert counted.json()["tokens"] == want, fields
        extra = {k: v for k, v in fields.items() if k != "tools"}
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, tools=fields.get("tools"),
                                           extra_body={**extra, "return_token_ids": True})
        assert r.model_extra["prompt_token_ids"] == want, fields
    assert tok.decode(want).endswith("<|im_start|>assistant\nSure, the weath")  # left open: no <|im_end|>
    for bad in ({"continue_final_message": True}, {"chat_template_kwargs": {"add_generation_prompt": False}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=prefill, max_tokens=1, extra_body=bad)


def test_required_with_defs_and_a_tool_without_parameters(servers):
    """A pydantic tool with a nested model has ``$defs``: under ``required`` they move to the combined schema's
    root, where its refs point (it was a 400). A tool without ``parameters`` takes none: its arguments are ``{}``."""
    client = servers["hermes"]
    nested = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
              "additionalProperties": False,
              "$defs": {"Loc": {"type": "object", "properties": {"city": {"enum": ["oslo", "rome"]}},
                                "required": ["city"], "additionalProperties": False}}}
    tools = [{"type": "function", "function": {"name": "where", "parameters": nested}},
             {"type": "function", "function": {"name": "ping"}}]
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=MSG, tools=tools, tool_choice="required",
                                           max_tokens=80, temperature=1.0, seed=seed)
        for call in r.choices[0].message.tool_calls or []:
            args = json.loads(call.function.arguments)
            if call.function.name == "ping":
                assert args == {}
            else:
                jsonschema.validate(args, nested)
    named = client.chat.completions.create(model="tiny", messages=MSG, tools=tools, max_tokens=40, temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "ping"}})
    assert [c.function.arguments for c in named.choices[0].message.tool_calls] == ["{}"]
