"""Our decoder vs HF transformers on tiny random checkpoints (float32 logits, atol 1e-4), every family/variant."""
from __future__ import annotations

import pytest
import torch

from _tiny_models import load_hf_model, make_tiny_checkpoint
from strataserve.models.loader import load_model

VARIANTS = {
    # name: (family, HF config overrides)
    "llama3-rope-scaling-gqa-untied": ("llama3", {}),
    "llama2-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-linear-rope-headdim8": ("llama", dict(head_dim=8, rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral-mqa": ("mistral", {}),
    "qwen2-bias-mha-tied": ("qwen2", {}),
    "qwen2-bias-gqa-untied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3-qknorm-headdim32-tied": ("qwen3", {}),
    "qwen3-qknorm-untied-headdim8": ("qwen3", dict(head_dim=8, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(family, tmp_path, tokenizer=False, vocab_size=256, **overrides)
    hf = load_hf_model(path)
    ours = load_model(path, dtype="float32", device="cpu")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = hf(ids).logits[0]
        got = ours.compute_logits(ours(ids[0], torch.arange(80)))
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.1  # the comparison is not between two near-constant tensors
