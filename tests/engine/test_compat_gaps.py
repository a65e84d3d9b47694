"""vLLM behaviours a new user relies on: ``skip_tokenizer_init`` (no tokenizer files at all) and prompt ids of a
padded vocabulary (below config.json's vocab_size, beyond the tokenizer's ids). Both raised before; outputs are
checked against HF transformers."""
from __future__ import annotations

import pytest
import torch

from _tiny_models import hf_greedy, load_hf_model, make_tiny_checkpoint, make_tiny_tokenizer
from strataserve import LLM, SamplingParams

NEW = 6


def _hf_greedy(path, prompt):
    return hf_greedy(path, [prompt], NEW)[0]


def test_skip_tokenizer_init_runs_token_ids_without_tokenizer_files(tmp_path):
    path = make_tiny_checkpoint("qwen2", tmp_path, vocab_size=300, tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer files"):
        LLM(path, device="cpu", dtype="float32", num_blocks=32)
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=32, skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    prompt = [7, 99, 150, 299, 12]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _hf_greedy(path, prompt) and out.outputs[0].text == ""
    # eos still comes from config.json: a stop at eos ends the completion
    eos = llm.engine.inputs.eos_token_id
    assert eos == load_hf_model(path).config.eos_token_id
    with pytest.raises(ValueError, match="token ids instead of text"):
        llm.generate(["text"], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([prompt], SamplingParams(stop=["x"]), use_tqdm=False)


def test_padded_vocabulary_ids_are_valid_prompt_ids(tmp_path):
    path = make_tiny_checkpoint("qwen2", tmp_path, vocab_size=300, tokenizer=False)
    make_tiny_tokenizer(270).save_pretrained(path)  # 270 tokenizer ids for 300 embedding rows
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=32)
    assert len(llm.get_tokenizer()) < 280 and llm.llm_engine.vocab_size == 300
    prompt = [5, 280, 299, 6]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _hf_greedy(path, prompt)
    with pytest.raises(ValueError, match=r"out of range: ids must be in \[0, 300\)"):
        llm.generate([[5, 300]], use_tqdm=False)


def _hf_prompt_logprobs(path, prompt):
    model = load_hf_model(path)
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def test_prompt_logprobs_match_hf_across_chunks_and_cache(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, vocab_size=300, tokenizer=False)
    prompt = [1, 17, 250, 33, 33, 99, 5, 140, 7, 8, 9, 10, 201]
    ref = _hf_prompt_logprobs(path, prompt)
    # chunks of 5 tokens; a second identical request must not be cut short by the prefix cache
    llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=4, num_blocks=64,
              max_num_batched_tokens=5)
    outs = llm.generate([prompt, prompt], SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    for out in outs:
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for p in range(1, len(prompt)):
            entry = plp[p]
            want = ref[p - 1]
            assert abs(entry[prompt[p]].logprob - float(want[prompt[p]])) < 1e-4
            assert entry[prompt[p]].rank == int((want > want[prompt[p]]).sum()) + 1
            top2 = torch.topk(want, 2).indices.tolist()
            assert set(entry) == set(top2) | {prompt[p]}
    # without prompt_logprobs nothing is computed or returned
    assert llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
