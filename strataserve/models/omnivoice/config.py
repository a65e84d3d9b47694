"""Parse an OmniVoice checkpoint folder as the ``omnivoice`` package writes it (``save_pretrained``).

Layout: ``config.json`` (``model_type`` "omnivoice", ``llm_config`` = the Qwen3 backbone, ``audio_vocab_size``,
``audio_mask_id``, ``num_audio_codebook``), ``model.safetensors`` (``llm.*``, ``audio_embeddings.weight``,
``audio_heads.weight``), the text tokenizer files, and ``audio_tokenizer/`` (the Higgs audio v2 tokenizer:
``config.json`` + ``model.safetensors``). Missing pieces raise ``MissingCheckpointFileError`` naming the file;
a backbone other than Qwen3 raises ``UnsupportedTTSVariantError``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from strataserve.models.hf_config import DecoderConfig, _read_json, decoder_config_from_dict
from strataserve.models.qwen3_tts.config import MissingCheckpointFileError, UnsupportedTTSVariantError

__all__ = ["OmniVoiceConfig", "load_omnivoice_config", "is_omnivoice_dir", "MissingCheckpointFileError",
           "UnsupportedTTSVariantError"]

_BACKBONES = {"qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class OmniVoiceConfig:
    llm: DecoderConfig  # the bidirectional backbone (its lm_head is unused: tied, so nothing extra is allocated)
    audio_vocab_size: int  # per codebook, including the mask id
    audio_mask_id: int
    num_codebooks: int
    sample_rate: int  # of the audio tokenizer's waveform
    frame_rate: int  # audio frames (canvas positions) per second

    def __post_init__(self) -> None:
        if not 0 <= self.audio_mask_id < self.audio_vocab_size:
            raise ValueError(f"audio_mask_id={self.audio_mask_id} must lie in [0, audio_vocab_size="
                             f"{self.audio_vocab_size})")


def is_omnivoice_dir(model_dir: str | Path) -> bool:
    """True when ``model_dir/config.json`` says ``model_type: omnivoice`` (architecture detection for serve)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("model_type") == "omnivoice"
    except (json.JSONDecodeError, OSError):
        return False


def _codec_rates(folder: Path) -> tuple[int, int]:
    from transformers import HiggsAudioV2TokenizerConfig

    try:
        cfg = HiggsAudioV2TokenizerConfig.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"{folder}/config.json: not a Higgs audio v2 tokenizer config ({exc})") from None
    return int(cfg.sample_rate), int(cfg.frame_rate)


def load_omnivoice_config(model_dir: str | Path) -> OmniVoiceConfig:
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise MissingCheckpointFileError(f"{folder}: config.json is missing (not an OmniVoice checkpoint folder)")
    raw: dict[str, Any] = _read_json(folder / "config.json")
    if raw.get("model_type") != "omnivoice":
        raise UnsupportedTTSVariantError(f"{folder}/config.json: model_type {raw.get('model_type')!r} is not "
                                         "'omnivoice'")
    llm = raw.get("llm_config")
    if not isinstance(llm, dict):
        raise MissingCheckpointFileError(f"{folder}/config.json: llm_config (the backbone's config) is missing")
    arch = _BACKBONES.get(str(llm.get("model_type")))
    if arch is None:
        raise UnsupportedTTSVariantError(f"{folder}: backbone model_type {llm.get('model_type')!r} is not "
                                         f"supported; supported: {', '.join(_BACKBONES)}")
    # the weights' dtype is written at the top level; the backbone's sub-config usually carries none
    dtype = llm.get("dtype") or llm.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype")
    dec = replace(decoder_config_from_dict({**llm, "architectures": [arch], "dtype": dtype}),
                  tie_word_embeddings=True)
    tok_dir = folder / "audio_tokenizer"
    if not (tok_dir / "config.json").is_file():
        raise MissingCheckpointFileError(f"{tok_dir}: config.json is missing (the Higgs audio tokenizer that "
                                         "turns audio tokens into a waveform)")
    sr, fr = _codec_rates(tok_dir)
    return OmniVoiceConfig(llm=dec, audio_vocab_size=int(raw.get("audio_vocab_size", 1025)),
                           audio_mask_id=int(raw.get("audio_mask_id", 1024)),
                           num_codebooks=int(raw.get("num_audio_codebook", 8)), sample_rate=sr, frame_rate=fr)
