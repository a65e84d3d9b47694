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
