"""Tiny random HF checkpoints (+ an offline byte-level BPE tokenizer with a chat template) for tests.

``make_tiny_checkpoint(family, path, **overrides)`` writes config.json, model.safetensors, generation_config.json
and tokenizer files into ``path`` with transformers' own ``save_pretrained`` and returns ``path``. ``overrides``
are HF config fields (e.g. ``num_key_value_heads=4``, ``tie_word_embeddings=True``, ``head_dim=32``).

Families: "llama" (Llama 2 style), "llama3" (Llama 3.1 ``rope_scaling`` llama3), "mistral", "qwen2" (q/k/v bias),
"qwen3" (q/k RMSNorm, head_dim != hidden/heads).

Tokenizer: ids 0-4 are <pad> <s> </s> <|im_start|> <|im_end|>, then the 256 byte-level symbols, then merges up
to ``vocab_size`` so that every model id decodes. Encoding prepends <s> like Llama's tokenizers.
"""
from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_BASE: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                             tie_word_embeddings=False)
_FAMILY: dict[str, dict[str, Any]] = {
    "llama": dict(rope_theta=10000.0),
    "llama3": dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=64)),
    "mistral": dict(rope_theta=1000000.0, sliding_window=None, num_key_value_heads=1),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True, num_key_value_heads=4),
    "qwen3": dict(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=True),
}
FAMILIES = tuple(_FAMILY)


def _hf_classes(family: str) -> tuple[type, type]:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "llama3": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]


def tiny_hf_config(family: str, **overrides: Any):
    if family not in _FAMILY:
        raise ValueError(f"family {family!r}: use one of {', '.join(FAMILIES)}")
    cfg_cls, _ = _hf_classes(family)
    return cfg_cls(**{**_BASE, **_FAMILY[family], **overrides})


def make_tiny_tokenizer(vocab_size: int):
    """A fast byte-level BPE tokenizer with exactly ``vocab_size`` ids (transformers wrapper)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    n_merges = vocab_size - len(vocab)
    if n_merges < 0:
        raise ValueError(f"vocab_size={vocab_size}: the tiny tokenizer needs at least {len(vocab)} ids")
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    pairs = [("Ġ", c) for c in letters] + [(a, b) for a in letters for b in letters]
    pairs += [(a, b) for a in string.digits for b in string.digits]
    merges = pairs[:n_merges]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is larger than the tiny tokenizer can fill")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=SPECIAL_TOKENS[3:], chat_template=CHAT_TEMPLATE)


def make_tiny_checkpoint(family: str, path: str | Path, *, seed: int = 0, tokenizer: bool = True,
                         max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a tiny random ``family`` checkpoint (float32) into ``path``; returns ``path``.

    ``max_shard_size`` (e.g. "100KB") makes a sharded checkpoint with model.safetensors.index.json.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_hf_config(family, **overrides)
    _, model_cls = _hf_classes(family)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; perturb them so the tests exercise them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        make_tiny_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path


def load_hf_model(path: str | Path):
    """The HF transformers model for a tiny checkpoint (float32, eval) — the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, exactly ``max_new_tokens`` long (eos ignored).
    ``model``: a checkpoint folder or an already loaded HF model."""
    if isinstance(model, (str, Path)):
        model = load_hf_model(model)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs
