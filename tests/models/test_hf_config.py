"""config.json parsing: both rope layouts, per-family flags, errors that name what is supported."""
from __future__ import annotations

import json

import pytest
import torch

from _tiny_models import tiny_hf_config
from strataserve.models.hf_config import (SUPPORTED_ARCHITECTURES, decoder_config_from_dict, load_decoder_config,
                                          read_eos_token_ids)
from strataserve.models.rope import inverse_frequencies


def hf_dict(hf_cfg) -> dict:
    """A config dict as save_pretrained writes it (architectures are added from the model class)."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[hf_cfg.model_type]
    return {**hf_cfg.to_dict(), "architectures": [arch]}


def base(**kw):
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               eos_token_id=2, bos_token_id=1)
    raw.update(kw)
    return raw


def test_old_and_new_rope_layouts_agree():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    old = decoder_config_from_dict(base(rope_theta=5e5, rope_scaling={"type": "llama3", **scaling}))
    new = decoder_config_from_dict(base(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling}))
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling
    assert new.rope_scaling.rope_type == "llama3" and new.rope_scaling.original_max_position_embeddings == 64
    plain = decoder_config_from_dict(base(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.rope_scaling.rope_type == "default" and plain.rope_theta == 1e4


@pytest.mark.parametrize("rope", [
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=64),
    dict(rope_type="linear", factor=4.0),
])
def test_scaled_inverse_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = tiny_hf_config("llama", rope_theta=5e5, rope_scaling=rope, head_dim=32)
    ours = decoder_config_from_dict(hf_dict(hf_cfg))
    ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, torch.device("cpu"))
    got = inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(got, inverse_frequencies(32, 5e5, type(ours.rope_scaling)()))  # scaling did apply


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_scaling_names_supported(rope_type):
    with pytest.raises(ValueError, match="llama3.*linear"):
        decoder_config_from_dict(base(rope_scaling={"rope_type": rope_type, "factor": 2.0}))


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError) as err:
        decoder_config_from_dict(base(architectures=["GPT2LMHeadModel"]))
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    with pytest.raises(ValueError, match="not supported"):
        decoder_config_from_dict(base(architectures=None))


@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_family_flags_from_real_hf_configs(family):
    hf_cfg = tiny_hf_config(family)
    c = decoder_config_from_dict(hf_dict(hf_cfg))
    assert c.qkv_bias == (family == "qwen2")
    assert c.qk_norm == (family == "qwen3")
    assert c.head_dim == (32 if family == "qwen3" else 16)
    assert c.num_kv_heads == hf_cfg.num_key_value_heads
    assert c.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert c.rms_norm_eps == hf_cfg.rms_norm_eps
    assert c.torch_dtype == "float32"


def test_head_dim_default_and_explicit():
    assert decoder_config_from_dict(base()).head_dim == 16
    assert decoder_config_from_dict(base(head_dim=40)).head_dim == 40


def test_attention_bias_flag_and_bad_fields():
    with pytest.raises(ValueError, match="attention_bias"):  # q/k/v + o_proj biases: see test_hf_attention_bias.py
        decoder_config_from_dict(base(attention_bias=True))
    with pytest.raises(ValueError, match="mlp_bias"):
        decoder_config_from_dict(base(mlp_bias=True))
    with pytest.raises(ValueError, match="hidden_act"):
        decoder_config_from_dict(base(hidden_act="gelu"))
    with pytest.raises(ValueError, match="multiple"):
        decoder_config_from_dict(base(num_key_value_heads=3))
    raw = base()
    del raw["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        decoder_config_from_dict(raw)


def test_sliding_window_fields():
    mistral = decoder_config_from_dict(base(architectures=["MistralForCausalLM"], sliding_window=128,
                                            max_position_embeddings=1024))
    assert mistral.max_model_len == 1024 and mistral.full_attention_len == 128 and mistral.window_every_layer
    assert decoder_config_from_dict(base(architectures=["MistralForCausalLM"], sliding_window=None)).max_model_len == 256
    # Qwen2 carries a window but ignores it unless use_sliding_window is set
    qwen = base(architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False)
    assert decoder_config_from_dict(qwen).max_model_len == 256
    assert decoder_config_from_dict({**qwen, "use_sliding_window": True}).full_attention_len == 64


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(base(eos_token_id=[2, 7])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_decoder_config(tmp_path).eos_token_ids == (2, 7, 9)
    assert read_eos_token_ids(tmp_path) == (2, 7, 9)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_decoder_config(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json is missing"):
        load_decoder_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_decoder_config(tmp_path)
