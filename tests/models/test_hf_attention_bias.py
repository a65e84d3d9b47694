"""``attention_bias`` as transformers reads it: Llama / Qwen3 bias q/k/v AND o_proj (not implemented: refused at
config time, naming the field), Qwen2 always biases q/k/v only (served), Mistral ignores the key (so do we)."""
from __future__ import annotations

import pytest

from _tiny_models import hf_greedy, load_hf_model, make_tiny_checkpoint
from strataserve import LLM, SamplingParams
from strataserve.models.hf_config import load_decoder_config


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_q_k_v_and_o_proj_biases_are_refused_naming_the_field(family, tmp_path):
    path = make_tiny_checkpoint(family, tmp_path / family, attention_bias=True)
    assert load_hf_model(path).model.layers[0].self_attn.o_proj.bias is not None  # what HF builds
    with pytest.raises(ValueError) as err:
        load_decoder_config(path)
    text = str(err.value)
    # the field and what is supported, not "is config.json consistent with the weights?"
    assert "attention_bias=true is not supported" in text and "o_proj" in text and "q/k/v biases only" in text
    with pytest.raises(ValueError, match="attention_bias=true is not supported"):
        LLM(model=str(path), device="cpu", dtype="float32", num_blocks=16)


@pytest.mark.parametrize("family, attention_bias, qkv_bias", [("qwen2", None, True), ("qwen2", True, True),
                                                              ("mistral", True, False), ("llama", False, False)])
def test_families_whose_bias_is_implemented_or_ignored_still_load_and_match_hf(family, attention_bias, qkv_bias,
                                                                             tmp_path):
    extra = {} if attention_bias is None else {"attention_bias": attention_bias}
    path = make_tiny_checkpoint(family, tmp_path / family, **extra)
    assert load_decoder_config(path).qkv_bias is qkv_bias
    prompt = [1, 5, 6, 7]
    want = hf_greedy(load_hf_model(path), [prompt], 4)[0]
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_blocks=16)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0.0))
    finally:
        llm.shutdown()
    assert list(out[0].outputs[0].token_ids) == want
