"""``strata serve --skip-tokenizer-init`` on a checkpoint with no tokenizer files: token-id prompts work and
return token ids (``return_token_ids``, as vLLM) equal to HF transformers' greedy tokens; text needs a tokenizer
(400)."""
from __future__ import annotations

import json

import httpx

from _tiny_models import hf_greedy, make_tiny_checkpoint
from api_server import launch


def test_token_ids_in_and_out_without_a_tokenizer(tmp_path):
    path = make_tiny_checkpoint("qwen3", tmp_path / "ckpt", vocab_size=300, tokenizer=False)
    server = launch(path, tmp_path / "server.log", "--skip-tokenizer-init", api_key=None)
    try:
        prompt = [9, 18, 27, 36, 299]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["prompt_token_ids"] == prompt and choice["text"] == ""
        assert choice["token_ids"] == hf_greedy(path, [prompt], 5)[0]
        # streamed: every chunk carries its new token ids (a choice's first one the prompt's too), n choices apart
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True, "n": 2},
                          timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        ids: dict[int, list[int]] = {0: [], 1: []}
        for e in events:
            for c in e["choices"]:
                first = not ids[c["index"]]
                assert ("prompt_token_ids" in c) == first and c.get("prompt_token_ids", prompt) == prompt
                ids[c["index"]] += c["token_ids"]
        assert ids[0] == ids[1] == choice["token_ids"]  # greedy: both choices are the same tokens
        for bad in ({**body, "prompt": "text"}, {**body, "echo": True}):
            r = httpx.post(f"{server.url}/v1/completions", json=bad, timeout=60)
            assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": [
            {"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        for path, bad in (("/tokenize", {"prompt": "text"}), ("/detokenize", {"tokens": prompt})):
            r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **bad}, timeout=60)
            assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"], r.text
    finally:
        server.stop()
