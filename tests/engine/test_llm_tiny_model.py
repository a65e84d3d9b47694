"""Smoke test of the whole offline stack on a tiny random checkpoint: LLM -> EngineCore -> ModelRunner."""
from __future__ import annotations

import pytest
import torch
from _tiny_models import EOS_ID, load_hf_model, make_tiny_checkpoint

from strataserve import LLM, SamplingParams

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog and keeps running", "abc",
           "a longer prompt that spans a few blocks of the cache " * 2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=str(ckpt), dtype="float32", device="cpu", block_size=4, num_blocks=256)


def greedy(max_tokens=12):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_greedy_matches_hf_and_survives_preemption_chunking_and_cache_hits(ckpt, llm):
    outs = llm.generate(PROMPTS, greedy())
    tok = llm.get_tokenizer()
    hf = load_hf_model(ckpt)
    for p, o in zip(PROMPTS[:2], outs):
        ids = torch.tensor([tok.encode(p)])
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
        assert o.outputs[0].token_ids == ref.tolist()
    # Tiny pool + tiny token budget: preemption and chunked prefill; run twice for prefix-cache hits.
    small = LLM(model=str(ckpt), dtype="float32", device="cpu", block_size=4, num_blocks=24,
                max_num_batched_tokens=8, max_num_seqs=4)
    for _ in range(2):
        again = small.generate(PROMPTS, greedy())
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
        assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in outs]
    stats = small.engine.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert small.engine.core.scheduler.kv.num_free_blocks == 24


def test_chat_sampling_n_and_eos(llm):
    conv = [{"role": "user", "content": "hi there"}]
    (o,) = llm.chat(conv, SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6))
    assert "<|im_start|>assistant\n" in o.prompt and len(o.outputs) == 3
    assert all(1 <= len(c.token_ids) <= 6 for c in o.outputs)
    two = llm.chat([conv, conv], SamplingParams(temperature=0.8, seed=3, max_tokens=6))
    assert two[0].outputs[0].token_ids == two[1].outputs[0].token_ids == o.outputs[0].token_ids
    assert o.outputs[1].token_ids != o.outputs[0].token_ids or o.outputs[2].token_ids != o.outputs[0].token_ids
    # A scripted eos id as stop token ends generation with finish_reason "stop".
    first = llm.generate(["abc"], greedy(3))[0].outputs[0].token_ids
    (s,) = llm.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[first[1]]))
    assert s.outputs[0].token_ids == first[:first.index(first[1]) + 1] and s.outputs[0].finish_reason == "stop"
    assert s.outputs[0].stop_reason == first[1] and EOS_ID == llm.engine.inputs.eos_token_id


def test_async_streaming_text_equals_offline_text(ckpt, llm):
    import asyncio

    from strataserve.config import CacheConfig, EngineConfig, ModelConfig
    from strataserve.engine.async_llm import AsyncLLM

    prompts = PROMPTS[:3]
    want = [o.outputs[0] for o in llm.generate(prompts, greedy(10))]
    config = EngineConfig(model=ModelConfig(model=str(ckpt), dtype="float32", device="cpu"),
                          cache=CacheConfig(block_size=4, num_blocks=128))

    async def stream(llm, i):  # the server's kind: deltas, summed here
        from dataclasses import replace

        from strataserve.types.sampling import RequestOutputKind

        text, toks = "", []
        async for out in llm.generate(prompts[i], replace(greedy(10), output_kind=RequestOutputKind.DELTA), f"s{i}"):
            text += out.outputs[0].text
            toks += out.outputs[0].token_ids
        return text, toks

    async def main():
        llm = AsyncLLM.from_config(config)
        try:
            return await asyncio.gather(*[stream(llm, i) for i in range(len(prompts))])
        finally:
            llm.shutdown()

    got = asyncio.run(main())
    assert [g[1] for g in got] == [w.token_ids for w in want]
    assert [g[0] for g in got] == [w.text for w in want]
