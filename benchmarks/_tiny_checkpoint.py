"""Write a random-weight HF checkpoint (config, safetensors, word-level tokenizer) for benchmarks.

Benchmarks measure speed, not quality, so random weights in the real shapes are enough; the tokenizer exists only
so the engine can detokenise outputs like it would for a real model.
"""
from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096, max_position_embeddings=1024)


def write_random_llama(path: str | Path, seed: int = 0, **overrides) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**{**TINY_LLAMA, **overrides}, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, cfg.vocab_size)
    (path / "bench_info.json").write_text(json.dumps({"seed": seed, **TINY_LLAMA, **overrides}))
    return path


def write_word_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer for ids 3.. as "w<id>" (0 <unk>, 1 <s>, 2 </s>), saved in HF format at ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
