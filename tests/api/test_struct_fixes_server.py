"""Through the shared tiny server: constrained requests' logprobs are numbers in every shape (a token the grammar
masked is listed at -9999.0, as vLLM sends it, not null), explicit nulls for optional fields are their defaults,
and a schema whose pattern xgrammar would drop is a 400 naming where it is."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("xgrammar")

MSG = [{"role": "user", "content": "yes or no?"}]
CHOICE = {"guided_choice": ["yes", "no"], "max_tokens": 5, "seed": 0}


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": "tiny", **body}, headers=server.headers,
                      timeout=120)


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _all_logprobs(obj) -> list:
    """Every value of a "logprob" key, and every value of a completions ``top_logprobs`` dict."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "logprob":
                found.append(v)
            elif k == "top_logprobs" and isinstance(v, list):
                for d in v:
                    found += list(d.values()) if isinstance(d, dict) and "token" not in d else _all_logprobs(d)
            else:
                found += _all_logprobs(v)
    elif isinstance(obj, list):
        for v in obj:
            found += _all_logprobs(v)
    return found


@pytest.mark.parametrize("stream", [False, True])
def test_constrained_logprobs_are_numbers(server, stream):
    chat = _post(server, "chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 8, "stream": stream,
                                              **CHOICE})
    comp = _post(server, "completions", {"prompt": "answer:", "logprobs": 8, "stream": stream, **CHOICE})
    for r in (chat, comp):
        assert r.status_code == 200, r.text
        body = _events(r) if stream else [r.json()]
        values = _all_logprobs(body)
        assert values and all(isinstance(v, float) for v in values), values
        assert -9999.0 in values  # 8 alternatives, at most a few of them allowed: the masked ones are listed
    text = "".join(c["choices"][0]["text"] for c in _events(comp)) if stream else comp.json()["choices"][0]["text"]
    assert text in ("yes", "no")


def test_null_optional_fields_are_their_defaults(server):
    r = _post(server, "chat/completions", {"messages": MSG, "max_tokens": 3, "parallel_tool_calls": None,
                                           "logprobs": None, "n": None, "stream": None, "top_logprobs": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = _post(server, "completions", {"prompt": "x", "max_tokens": 3, "n": None, "echo": None, "stream": None,
                                      "skip_special_tokens": None})
    assert r.status_code == 200, r.text


def test_pattern_xgrammar_would_drop_is_400(server):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(?=b)[a-z]{1,4}$"}},
              "required": ["s"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = _post(server, "chat/completions", {"messages": MSG, "max_tokens": 8, "response_format": rf})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "response_format"
    assert "#/properties/s/pattern" in err["message"] and "Lookahead" in err["message"]
