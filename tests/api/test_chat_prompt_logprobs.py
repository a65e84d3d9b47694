"""vLLM's ``prompt_logprobs`` on /v1/chat/completions: a top-level list over the rendered template's tokens (None
for the first, then {token id: {logprob, rank, decoded_token}}), the numbers /v1/completions gives for the same
token ids; out of range or streamed, the same 400 as /v1/completions."""
from __future__ import annotations

import math

import openai
import pytest
from api_server import MODEL


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


CHAT = dict(model=MODEL, messages=[{"role": "user", "content": "score this prompt"}], max_tokens=1, temperature=0.0)


def test_chat_returns_the_prompt_logprobs_completions_gives(client):
    out = client.chat.completions.create(n=2, extra_body={"prompt_logprobs": 2, "return_token_ids": True}, **CHAT)
    plp = out.model_extra["prompt_logprobs"]
    ids = out.model_extra["prompt_token_ids"]
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in out.choices)  # top level, as vLLM's
    assert len(plp) == len(ids) == out.usage.prompt_tokens and plp[0] is None
    for tid, pos in zip(ids[1:], plp[1:]):
        assert str(tid) in pos and 2 <= len(pos) <= 3
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["rank"] >= 1 for v in pos.values())
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0.0,
                                     extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    assert [None if p is None else sorted(p) for p in plp] == [None if p is None else sorted(p) for p in same]
    for mine, theirs in zip(plp[1:], same[1:]):
        for t, v in mine.items():
            assert math.isclose(v["logprob"], theirs[t]["logprob"], abs_tol=1e-4)
            assert (v["rank"], v["decoded_token"]) == (theirs[t]["rank"], theirs[t]["decoded_token"])
    plain = client.chat.completions.create(**CHAT)
    assert "prompt_logprobs" not in (plain.model_extra or {})  # only when asked


def test_chat_prompt_logprobs_zero_is_the_prompt_tokens_alone(client):
    out = client.chat.completions.create(extra_body={"prompt_logprobs": 0, "return_token_ids": True}, **CHAT)
    ids, plp = out.model_extra["prompt_token_ids"], out.model_extra["prompt_logprobs"]
    assert [None] + [[str(t)] for t in ids[1:]] == [None if p is None else list(p) for p in plp]


@pytest.mark.parametrize("value, stream", [(999, False), (-2, False), (2, True)])
def test_chat_refuses_what_completions_refuses(client, value, stream):
    extra = {"prompt_logprobs": value}
    for call in (lambda: client.chat.completions.create(stream=stream, extra_body=extra, **CHAT),
                 lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, stream=stream,
                                                   extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.body["param"] == "prompt_logprobs"
