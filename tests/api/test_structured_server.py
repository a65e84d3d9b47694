"""Structured outputs through a real server and the official ``openai`` client: response_format json_schema /
json_object on both routes, vLLM's guided_* extras and ``structured_outputs``, streamed and not, in concurrent
batches that mix constrained and free requests; bad specs are 400s."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False},
    },
    "required": ["id", "color", "flags", "owner"],
    "additionalProperties": False,
}
RF = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
MSG = [{"role": "user", "content": "describe a thing"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def _chat(client, stream: bool, **kw) -> str:
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=120, **kw)
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content
    parts, reasons = [], []
    for ch in client.chat.completions.create(model="tiny", messages=MSG, max_tokens=120, stream=True, **kw):
        for c in ch.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    return "".join(parts)


def _completion(client, stream: bool, **kw) -> str:
    if not stream:
        r = client.completions.create(model="tiny", prompt="a thing:", max_tokens=120, **kw)
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="a thing:",
                                                                        max_tokens=120, stream=True, **kw))


def test_mixed_concurrent_batch_constraints_hold(client):
    jobs = []
    for i in range(3):
        for stream in (False, True):
            jobs.append(("schema", lambda s=stream, i=i: _chat(client, s, response_format=RF, temperature=1.0,
                                                                seed=i)))
            jobs.append(("schema", lambda s=stream, i=i: _completion(client, s, temperature=0.9, seed=i,
                                                                      extra_body={"response_format": RF})))
    jobs.append(("regex", lambda: _chat(client, False, temperature=1.0,
                                        extra_body={"guided_regex": r"[A-Z][a-z]{2,4}-[0-9]{2}"})))
    jobs.append(("regex", lambda: _completion(client, True, temperature=1.0, extra_body={
        "structured_outputs": {"regex": r"[A-Z][a-z]{2,4}-[0-9]{2}"}})))
    jobs.append(("choice", lambda: _chat(client, True, extra_body={"guided_choice": ["alpha", "beta", "gamma"]})))
    jobs.append(("choice", lambda: _completion(client, False, extra_body={
        "structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})))
    jobs.append(("schema", lambda: _chat(client, False, temperature=0, extra_body={"guided_json": SCHEMA})))
    jobs.append(("free", lambda: client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40,
                                                                 temperature=1.0).choices[0].message.content))
    jobs.append(("free", lambda: client.completions.create(model="tiny", prompt="x", max_tokens=40).choices[0].text))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda j: (j[0], j[1]()), jobs))
    for kind, text in results:
        if kind == "schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(r"[A-Z][a-z]{2,4}-[0-9]{2}", text), text
        elif kind == "choice":
            assert text in ("alpha", "beta", "gamma")
        else:
            assert isinstance(text, str)


def test_min_tokens_yields_where_the_grammar_ends(client):
    """min_tokens holds while the grammar allows more, and yields where it allows only the end: the output still
    matches (it used to run on unconstrained once the grammar was complete)."""
    for stream in (False, True):
        assert _completion(client, stream, temperature=0, extra_body={
            "guided_choice": ["yes", "no"], "min_tokens": 10}) in ("yes", "no")
        jsonschema.validate(json.loads(_chat(client, stream, temperature=0, extra_body={
            "guided_json": SCHEMA, "min_tokens": 100})), SCHEMA)
    r = client.completions.create(model="tiny", prompt="x", max_tokens=40, temperature=0, extra_body={
        "guided_regex": "[a-z]{1,30}", "min_tokens": 12})
    assert re.fullmatch("[a-z]{1,30}", r.choices[0].text) and r.usage.completion_tokens >= 12


def test_json_object_parses_or_is_cut_by_length(client):
    """json_object is an object (not any JSON value: xgrammar's built-in grammar let arrays and numbers through),
    written compactly (no newlines or runs of spaces to fill max_tokens with)."""
    for seed in range(6):
        r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert text.startswith("{") and "\n" not in text and "  " not in text, text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "array", "contains": {"const": 3}},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "[a-z]+", "maxLength": 3}}},
    {"allOf": [{"type": "object"}, {"required": ["a"]}]},
    {"type": "object", "properties": {"n": {"not": {"type": "string"}}}},
])
def test_keywords_the_grammar_cannot_enforce_are_400(client, schema):
    """xgrammar compiles these but its output can break them with finish "stop": refused, so an accepted schema's
    output is valid against it."""
    with pytest.raises(openai.BadRequestError, match="is not supported"):
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, extra_body={"guided_json": schema})


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_bad_constraints_are_400(client, body, param):
    for call in (lambda: client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, extra_body=body),
                 lambda: client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=body)):
        with pytest.raises(openai.BadRequestError) as ei:
            call()
        assert ei.value.body["param"] == param
