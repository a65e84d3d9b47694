"""``echo`` with ``logprobs`` on /v1/completions (official client): the logprobs start with the prompt tokens
(null for the first), each equal to HF transformers' log_softmax over the prompt, then the generated ones;
streamed and not give the same tokens."""
from __future__ import annotations

import openai
import torch

from _tiny_models import load_hf_model

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def test_echo_logprobs_cover_the_prompt(server, tiny_ckpt):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(load_hf_model(tiny_ckpt)(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    for p in range(1, len(PROMPT)):
        assert abs(lp.token_logprobs[p] - float(ref[p - 1, PROMPT[p]])) < 1e-4
        assert len(lp.top_logprobs[p]) >= 1
    assert all(v is not None for v in lp.token_logprobs[len(PROMPT):])
    assert lp.text_offset == sorted(lp.text_offset)
    stream = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                       temperature=0, stream=True)
    tokens, values = [], []
    for ch in stream:
        if ch.choices and ch.choices[0].logprobs is not None:
            tokens += ch.choices[0].logprobs.tokens
            values += ch.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens and values == lp.token_logprobs


def test_text_offsets_index_the_echoed_text(server):
    """Each token's text_offset points at it in the choice's text (OpenAI's legacy completions): the bos the
    tokenizer adds to a string prompt is not in the echoed text, so it takes no room; a special token written in the
    prompt is, so it does. Streamed offsets are the same."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    for prompt in ("hello world, hi", "hello<|im_end|> world"):
        kw = dict(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=4, temperature=0)
        choice = client.completions.create(**kw).choices[0]
        lp = choice.logprobs
        assert lp.tokens[0] == "<s>" and lp.text_offset[0] == 0 and choice.text.startswith(prompt)
        for token, offset in list(zip(lp.tokens, lp.text_offset))[1:]:
            if not token.startswith("bytes:"):  # a random model's partial characters read as U+FFFD in the text
                assert choice.text.startswith(token, offset), (token, offset, choice.text)
        streamed = []
        for ch in client.completions.create(**kw, stream=True):
            if ch.choices and ch.choices[0].logprobs is not None:
                streamed += ch.choices[0].logprobs.text_offset
        assert streamed == lp.text_offset
