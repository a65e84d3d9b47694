"""The OpenAI routes of a real server subprocess, driven by the official ``openai`` client (sync and async)."""
from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest
from api_server import MODEL


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    return texts, reasons, usage


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_models_retrieve_one_and_404_for_unknown(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such/model")
    assert err.value.body["code"] == "model_not_found" and MODEL in err.value.body["message"]


def test_completion_greedy_stream_equals_non_stream(client, server):
    full = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The quick brown fox"},
                            headers=server.headers).json()["tokens"]
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    stream = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts, reasons, usage = _stream_text(stream)
    assert texts[0] == full.choices[0].text
    assert reasons[0] == "length"
    assert usage.completion_tokens == 24 and usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_greedy_stream_equals_non_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                          temperature=0.0)
    assert full.choices[0].message.role == "assistant"
    assert 1 <= full.usage.completion_tokens <= 20
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = _stream_text(stream)
    assert texts[0] == full.choices[0].message.content
    assert reasons[0] == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_n2_returns_two_choices_stream_and_not(client):
    out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, n=2, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 24
    assert out.choices[0].text != out.choices[1].text  # independent samples (seeded differently per choice)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=6, temperature=1.0, stream=True)
    texts, reasons, _ = _stream_text(chat)
    assert set(texts) == {0, 1} and set(reasons) == {0, 1}


def test_stop_string_cuts_text_before_it(client):
    base = client.completions.create(model=MODEL, prompt="abc def", max_tokens=40, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(base[i:i + 2] for i in range(4, len(base) - 2) if base[i:i + 2].strip())
    cut = base[:base.index(stop)]
    out = client.completions.create(model=MODEL, prompt="abc def", max_tokens=40, temperature=0.0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    single = client.completions.create(model=MODEL, prompt="abc def", max_tokens=40, temperature=0.0, stop=stop,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == cut


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="logprobs please", max_tokens=6, temperature=0.0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    # a token holding part of a UTF-8 character is named by its bytes, as OpenAI does ("bytes:\\xe2\\x80")
    raw = [bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in lp.tokens]
    assert b"".join(raw).decode(errors="replace") == out.choices[0].text
    # offsets index the text's characters: a whole token sits at its offset; partial ones never go backwards
    text = out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)


def test_chat_logprobs_top(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                         temperature=0.0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-5)
        if not item.token.startswith("bytes:"):
            assert item.bytes == list(item.token.encode())
    # the tokens' bytes, joined, are the text (partial UTF-8 tokens carry their own bytes)
    assert b"".join(bytes(item.bytes) for item in content).decode(errors="replace") == out.choices[0].message.content


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="seeded", max_tokens=16, temperature=1.0, top_p=0.9,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_token_id_prompts_and_echo(client, server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "echo me"}, headers=server.headers).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    by_text = client.completions.create(model=MODEL, prompt="echo me", max_tokens=5, temperature=0.0,
                                        extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=3, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text[:len(batch.choices[0].text)]
    echo = client.completions.create(model=MODEL, prompt="echo me", max_tokens=5, temperature=0.0, echo=True,
                                     extra_body={"ignore_eos": True})
    assert echo.choices[0].text == "echo me" + by_text.choices[0].text
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=server.headers).json()
    assert detok["prompt"].endswith("echo me")


def test_add_special_tokens_false_leaves_out_the_bos(client, server):
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "echo me", "add_special_tokens": False},
                     headers=server.headers).json()["tokens"]
    full = httpx.post(f"{server.url}/tokenize", json={"prompt": "echo me"}, headers=server.headers).json()["tokens"]
    assert len(full) == len(tok) + 1  # the tiny tokenizer adds a BOS
    for special, ids in ((False, tok), (True, full)):
        out = client.completions.create(model=MODEL, prompt="echo me", max_tokens=2, temperature=0.0,
                                        extra_body={"add_special_tokens": special, "return_token_ids": True})
        assert out.choices[0].prompt_token_ids == ids and out.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt(client, stream):
    """OpenAI's (and vLLM's) prompt scoring: the prompt and its logprobs come back, nothing is generated."""
    kw = dict(model=MODEL, prompt="score this prompt", echo=True, logprobs=1, temperature=0.0)
    ref = client.completions.create(max_tokens=1, **kw).choices[0]
    if stream:
        chunks = list(client.completions.create(max_tokens=0, stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        reason = chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(max_tokens=0, **kw)
        text, tokens, reason = out.choices[0].text, out.choices[0].logprobs.tokens, out.choices[0].finish_reason
        assert out.usage.completion_tokens == 0
    assert text == "score this prompt" and reason == "length"
    assert tokens == ref.logprobs.tokens[:-1]  # the prompt's tokens, not the one token max_tokens=1 made
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)  # without echo there is nothing to return


def test_vllm_extras_allowed_ids_bad_words_truncation(client, server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "one two three four five six"},
                     headers=server.headers).json()["tokens"]
    kw = dict(model=MODEL, max_tokens=6, temperature=0.0)
    base = client.completions.create(prompt="one two three", extra_body={"return_token_ids": True}, **kw)
    allowed = sorted(set(base.choices[0].token_ids[:3]))
    for stream in (False, True):
        out = client.completions.create(prompt="one two three", stream=stream, **kw,
                                        extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
        got = [t for c in (out if stream else [out]) for ch in c.choices for t in (ch.token_ids or [])]
        assert got and set(got) <= set(allowed)
    cut = client.chat.completions.create(messages=[{"role": "user", "content": "one two three four"}],
                                         extra_body={"truncate_prompt_tokens": 3}, **kw)
    assert cut.usage.prompt_tokens == 3
    cut = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 2, "return_token_ids": True},
                                    **kw)
    assert cut.choices[0].prompt_token_ids == ids[-2:] and cut.usage.prompt_tokens == 2
    word = base.choices[0].text.split()[0]
    seq = httpx.post(f"{server.url}/tokenize", json={"prompt": word, "add_special_tokens": False},
                     headers=server.headers).json()["tokens"]
    assert base.choices[0].token_ids[:len(seq)] == seq  # greedy writes the word first...
    banned = client.completions.create(prompt="one two three", **kw,
                                       extra_body={"bad_words": [word], "return_token_ids": True}).choices[0]
    got = banned.token_ids  # ...and never with it banned
    assert not any(got[i:i + len(seq)] == seq for i in range(len(got))), (word, banned.text)
    for extra, param in (({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                         ({"truncate_prompt_tokens": 10**7}, "truncate_prompt_tokens")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(prompt="x", stream=True, extra_body=extra, **kw)
        assert err.value.body["param"] == param


def test_prompt_logprobs_match_the_echoed_logprobs(client):
    """vLLM's prompt_logprobs: per prompt token (None for the first) its logprob, rank and text, plus the top N;
    the same numbers as an echo with logprobs gives. Not streamed (400), as in vLLM."""
    kw = dict(model=MODEL, prompt="score this prompt", temperature=0.0, max_tokens=1)
    out = client.completions.create(extra_body={"prompt_logprobs": 2}, **kw).choices[0]
    echo = client.completions.create(echo=True, logprobs=1, **kw).choices[0].logprobs
    plp = out.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(echo.tokens) - 1
    for k, pos in enumerate(plp[1:], start=1):
        assert 2 <= len(pos) <= 3 and all(v["rank"] >= 1 for v in pos.values())
        mine = [v for v in pos.values() if v["decoded_token"] == echo.tokens[k]]
        assert mine and math.isclose(mine[0]["logprob"], echo.token_logprobs[k], abs_tol=1e-4)
    mixed = client.completions.create(echo=True, logprobs=3, extra_body={"prompt_logprobs": 1}, **kw).choices[0]
    alone = client.completions.create(echo=True, logprobs=3, **kw).choices[0]
    assert mixed.logprobs.top_logprobs == alone.logprobs.top_logprobs  # each keeps its own N
    assert all(len(p) <= 2 for p in mixed.model_extra["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(stream=True, extra_body={"prompt_logprobs": 2}, **kw)


def test_async_client_concurrent_streams(server):
    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)

        async def one(i: int) -> str:
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=10, temperature=0.0,
                stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def plain(i: int) -> str:
            r = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                                                      max_tokens=10, temperature=0.0)
            return r.choices[0].message.content

        try:
            streamed = await asyncio.gather(*(one(i) for i in range(4)))
            plain_texts = await asyncio.gather(*(plain(i) for i in range(4)))
            assert streamed == plain_texts
            return streamed
        finally:
            await aclient.close()

    texts = asyncio.run(run())
    assert len(texts) == 4


def test_openapi_schema_lists_routes(server):
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    for p in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
              "/metrics"):
        assert p in paths


def test_logit_bias_with_the_openai_client(client, server):
    kw = dict(model=MODEL, prompt="bias me", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True,
                                                                                         "return_token_ids": True})
    plain = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    streamed = [i for ch in client.completions.create(stream=True, **kw) for c in ch.choices
                for i in c.model_extra["token_ids"]]
    assert streamed == plain  # return_token_ids streams each chunk's ids
    forced = client.completions.create(logit_bias={"7": 100}, **kw).choices[0].model_extra["token_ids"]
    assert forced == [7] * 6
    banned = client.completions.create(logit_bias={str(plain[0]): -100}, **kw).choices[0].model_extra["token_ids"]
    assert banned[0] != plain[0]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0.0, logit_bias={"7": 100}, extra_body={"ignore_eos": True})
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": [7] * 4}, headers=server.headers).json()
    assert chat.choices[0].message.content == detok["prompt"]
    for bias, needle in (({"x": 1}, "not a token id"), ({"7": 150}, "[-100, 100]"),
                         ({"99999999": 1}, "outside the vocabulary")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(logit_bias=bias, **kw)
        assert needle in err.value.body["message"] and err.value.body["param"] == "logit_bias", err.value.body


def test_logprobs_name_partial_utf8_tokens_by_their_bytes(client, tiny_ckpt):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_ckpt).encode("\u2028", add_special_tokens=False)
    assert len(ids) == 3  # e2 80 a8: one byte token each in the tiny vocabulary
    bias = {str(ids[0]): 100}  # forces the lone lead byte
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                          temperature=0.0, logprobs=True, top_logprobs=3, logit_bias=bias)
    item = chat.choices[0].logprobs.content[0]
    assert (item.token, item.bytes) == ("bytes:\\xe2", [0xE2])  # OpenAI's form, not U+FFFD's bytes
    for top in item.top_logprobs:  # (logprobs are the model's, before the bias)
        want = bytes.fromhex(top.token[6:].replace("\\x", "")) if top.token.startswith("bytes:") else top.token.encode()
        assert top.bytes == list(want)
    cmpl = client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0.0, logprobs=2,
                                     logit_bias=bias)
    lp = cmpl.choices[0].logprobs
    assert lp.tokens == ["bytes:\\xe2", "bytes:\\xe2"]
    assert lp.text_offset == [0, 1]  # the second lead byte ends the first (invalid) character: one U+FFFD


def test_chat_return_token_ids_streamed_and_not(client, server):
    messages = [{"role": "user", "content": "ids please"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.chat.completions.create(**kw)
    ids = whole.choices[0].model_extra["token_ids"]
    assert len(ids) == 6
    tok = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages},
                     headers=server.headers).json()
    assert whole.model_extra["prompt_token_ids"] == tok["tokens"]  # the rendered template's ids
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=server.headers).json()["prompt"]
    assert whole.choices[0].message.content == text
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].model_extra["prompt_token_ids"] == tok["tokens"]
    assert [i for ch in chunks for c in ch.choices for i in (c.model_extra or {}).get("token_ids", [])] == ids


def test_text_parts_are_joined_by_newlines(server):
    """A message's content as text parts reads as vLLM renders it: the parts joined by newlines."""
    def ids(content):
        return httpx.post(f"{server.url}/tokenize", headers=server.headers,
                          json={"model": MODEL, "messages": [{"role": "user", "content": content}]}).json()["tokens"]

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    assert ids(parts) == ids("Hello\nWorld") != ids("HelloWorld")


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats(client, route):
    kw = dict(model=MODEL, max_tokens=5, temperature=0.0, n=2, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    if route == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "count"}], **kw))
    else:
        chunks = list(client.completions.create(prompt="count", **kw))
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 10  # two choices of five
    seen = [ch.usage for ch in chunks[:-1]]
    assert all(u is not None and u.prompt_tokens == final.usage.prompt_tokens for u in seen)  # on every chunk
    done = [u.completion_tokens for u in seen]
    assert done == sorted(done) and done[0] <= 2 and done[-1] == 10  # the count so far, rising to the total
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in seen)
    plain = {**kw, "stream_options": {"include_usage": True}}
    make = client.chat.completions.create if route == "chat" else client.completions.create
    prompt = {"messages": [{"role": "user", "content": "count"}]} if route == "chat" else {"prompt": "count"}
    assert all(ch.usage is None for ch in list(make(**prompt, **plain))[:-1])  # without it: only the last
