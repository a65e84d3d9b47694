"""``strata serve --stream-interval N`` through the official ``openai`` client: the first chunk carries the first
token alone, later ones at least N tokens (the last may carry fewer), and the streamed text and usage equal the
non-streamed answer."""
from __future__ import annotations

import openai

from _tiny_models import make_tiny_checkpoint
from api_server import MODEL, launch

N = 4


def test_stream_interval_groups_tokens_per_chunk(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "ckpt")
    server = launch(path, tmp_path / "server.log", "--stream-interval", str(N))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
        kw = dict(model=MODEL, prompt="the quick brown fox", max_tokens=14, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        pieces = [c for c in chunks if c.choices]
        sizes = [len(c.choices[0].logprobs.tokens) for c in pieces]
        assert sizes[0] == 1 and all(s >= N for s in sizes[1:-1]) and sum(sizes) == 14, sizes
        assert len(pieces) <= 2 + (14 - 1) // N
        assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text
        assert pieces[-1].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 14

        chat = dict(model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=11, temperature=0,
                    extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**chat)
        parts = [c.choices[0].delta.content for c in client.chat.completions.create(**chat, stream=True)
                 if c.choices and c.choices[0].delta.content]
        assert "".join(parts) == whole.choices[0].message.content
        assert len(parts) <= 2 + (11 - 1) // N
    finally:
        server.stop()
