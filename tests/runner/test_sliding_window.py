"""Mistral's sliding window masked in attention (eager torch backend): greedy outputs of prompts several windows
long equal HF transformers', through chunked prefill, prefix-cache hits and decode past the window. Before the
window was masked the context was capped at the window, so these prompts were rejected."""
from __future__ import annotations

import random

import pytest

from _tiny_models import hf_greedy, load_hf_model, make_tiny_checkpoint
from strataserve import LLM, SamplingParams

WINDOW = 8
NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("mistral", tmp_path_factory.mktemp("mistral_sw"), sliding_window=WINDOW,
                                vocab_size=300, tokenizer=False)


def test_windowed_attention_matches_hf(ckpt):
    rng = random.Random(0)
    shared = [rng.randrange(5, 300) for _ in range(12)]
    prompts = [shared + [rng.randrange(5, 300) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    prompts.append([rng.randrange(5, 300) for _ in range(5)])  # shorter than the window
    assert load_hf_model(ckpt).config.sliding_window == WINDOW
    ref = hf_greedy(ckpt, prompts, NEW)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    # a small token budget: prefill in chunks (with and without earlier context), mixed with decodes
    llm = LLM(ckpt, device="cpu", dtype="float32", mode="eager", skip_tokenizer_init=True, block_size=4,
              num_blocks=128, max_num_batched_tokens=7, max_model_len=64)
    assert llm.max_model_len == 64  # beyond the window: the window is masked, not used as a cap
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    # whole prompts in one chunk; the repeated ones hit the prefix cache
    llm = LLM(ckpt, device="cpu", dtype="float32", mode="eager", skip_tokenizer_init=True, block_size=4,
              num_blocks=128, max_num_batched_tokens=256)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts + prompts[:2], sp, use_tqdm=False)]
    assert got == ref + ref[:2]
