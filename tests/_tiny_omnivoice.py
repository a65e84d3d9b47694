"""Tiny random OmniVoice checkpoints built with the reference package's own classes (``omnivoice``), saved the
way it saves them, plus a tiny Higgs audio tokenizer folder holding the decode half.

The reference imports torchaudio at module level (it resamples reference audio with it; nothing here does), and
torchaudio has no wheel for the CPU torch used in tests: ``import_reference`` puts an empty stand-in module in
place for that import (test-only shim; nothing of torchaudio runs). The audio tokenizer folder is written from a
``HiggsAudioV2TokenizerConfig`` and our decode-half module with random weights (transformers refuses to build
the whole tokenizer without torchaudio); its decode is checked against the H200 recording elsewhere.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

from _tiny_models import make_tiny_tokenizer

SPECIALS = [f"<|{n}|>" for n in ("text_start", "text_end", "lang_start", "lang_end", "instruct_start",
                                  "instruct_end", "denoise")]
CODEBOOKS = 8
TINY_LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0,
                tie_word_embeddings=True)
#: 25 frames/s like the released tokenizer (hop 960 at 24 kHz), 8 codebooks at 2 kbps, tiny widths
TINY_CODEC = dict(target_bandwidths=[0.5, 1, 1.5, 2], codebook_size=1024, codebook_dim=8,
                  acoustic_model_config=dict(downsampling_ratios=[8, 5, 4, 2, 3], upsampling_ratios=[8, 5, 4, 2, 3],
                                             hidden_size=16, encoder_hidden_size=4, decoder_hidden_size=32),
                  semantic_model_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, conv_dim=[8, 8], conv_stride=[5, 2],
                                             conv_kernel=[10, 3], num_conv_pos_embeddings=4,
                                             num_conv_pos_embedding_groups=2))


def import_reference() -> types.ModuleType:
    import transformers.modeling_utils  # noqa: F401 -- its lazy imports probe for torchaudio: load them first

    if "torchaudio" not in sys.modules:
        try:
            import torchaudio  # noqa: F401
        except ImportError:  # absent: stand in for the import only
            stub = types.ModuleType("torchaudio")
            stub.functional = types.ModuleType("torchaudio.functional")
            sys.modules.update({"torchaudio": stub, "torchaudio.functional": stub.functional})
    import omnivoice.models.omnivoice as ref

    for k in [k for k in sys.modules if k.startswith("torchaudio") and sys.modules[k].__spec__ is None]:
        del sys.modules[k]
    return ref


def make_tiny_tokenizer_with_specials():
    tok = make_tiny_tokenizer(300)
    tok.add_tokens(SPECIALS, special_tokens=True)
    return tok


def make_tiny_omnivoice(path: str | Path, seed: int = 0, codec: bool = True):
    """Write a tiny checkpoint folder; returns (path, reference model with its text tokenizer set)."""
    from transformers import Qwen3Config

    ref = import_reference()
    path = Path(path)
    tok = make_tiny_tokenizer_with_specials()
    llm = Qwen3Config(vocab_size=1100, **TINY_LLM)  # > the audio mask id: padding embeds it as text
    torch.manual_seed(seed)
    model = ref.OmniVoice(ref.OmniVoiceConfig(llm_config=llm.to_dict())).eval()
    with torch.no_grad():  # post_init's small std makes every logit near-equal: widen the heads for clear argmaxes
        model.audio_heads.weight.normal_(0, 0.5)
        model.audio_embeddings.weight.normal_(0, 0.5)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    model.text_tokenizer = tok
    if codec:
        write_tiny_codec(path / "audio_tokenizer", seed)
    return path, model


def write_tiny_codec(folder: Path, seed: int = 0) -> None:
    write_codec(folder, TINY_CODEC, seed)


def write_codec(folder: Path, shape: dict, seed: int = 0) -> None:
    """An audio tokenizer folder (config + the decode half's weights, random) in ``shape``."""
    from safetensors.torch import save_file
    from transformers import HiggsAudioV2TokenizerConfig

    from strataserve.models.omnivoice.codec import HiggsDecoder

    cfg = HiggsAudioV2TokenizerConfig(**{k: v for k, v in shape.items() if v is not None})
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(folder))
    torch.manual_seed(seed)
    dec = HiggsDecoder(cfg)
    with torch.no_grad():
        for p in dec.parameters():  # fan-in scaled: the waveform stays in a sane range through the stack
            p.normal_(0, 0.1 if p.dim() < 2 else p[0].numel() ** -0.5)
        for q in dec.quantizer.quantizers:
            q.codebook.embed.normal_(0, 1.0)
    save_file({k: v.contiguous() for k, v in dec.state_dict().items()}, str(folder / "model.safetensors"))
