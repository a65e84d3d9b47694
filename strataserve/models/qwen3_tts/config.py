"""Parse a Qwen3-TTS checkpoint folder's ``config.json`` (as the official ``qwen-tts`` package writes it) into
frozen configs: the talker and the code predictor as ``DecoderConfig`` (they are Qwen3 decoders), the special
codec ids that build the prompt, the preset speakers and languages, and the 12 Hz speech-tokenizer decoder.

Layout of the folder: ``config.json`` (``model_type`` "qwen3_tts", ``talker_config`` with a nested
``code_predictor_config``), ``model.safetensors`` (or an index + shards), ``generation_config.json`` (optional
sampling defaults), the Qwen2 text tokenizer files, and ``speech_tokenizer/`` (``config.json`` +
``model.safetensors``) holding the codec. Unknown variants and missing files raise the named errors below.

The talker's rotary is "multimodal" (``mrope_section``), but for speech the three position streams (temporal,
height, width) are always equal, so every section sees the same angle and the rotation equals plain 1-D rotary:
the decoder's ordinary rotary serves it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strataserve.models.hf_config import DecoderConfig, RopeScaling, _read_json

SUPPORTED_MODEL_TYPES = ("custom_voice", "voice_design", "base")
SUPPORTED_TOKENIZER_TYPES = ("qwen3_tts_tokenizer_12hz",)
#: the reference suppresses this many ids at the top of the codec vocabulary (control ids), except eos
NUM_SPECIAL_CODEC_IDS = 1024


class UnsupportedTTSVariantError(ValueError):
    """The folder is a Qwen3-TTS checkpoint of a kind this runner does not serve (say which, and what is)."""


class MissingCheckpointFileError(ValueError):
    """A file the Qwen3-TTS checkpoint folder must hold is absent."""


@dataclass(frozen=True)
class CodecDecoderConfig:
    """The 12 Hz speech tokenizer's decoder (codes -> 24 kHz waveform)."""

    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    hidden_size: int
    latent_dim: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    layer_scale_initial_scale: float
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    decoder_dim: int
    max_position_embeddings: int
    sample_rate: int
    decode_upsample_rate: int

    @property
    def total_upsample(self) -> int:
        n = 1
        for r in self.upsample_rates + self.upsampling_ratios:
            n *= r
        return n


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """The Base variant's ECAPA-TDNN speaker encoder (reference audio -> one talker-width x-vector)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000


@dataclass(frozen=True)
class CodecEncoderConfig:
    """The 12 Hz speech tokenizer's encoder (a Mimi encoder: 24 kHz audio -> codec frames), as config.json says."""

    mimi: dict[str, Any]  # ``encoder_config``: transformers' MimiConfig fields
    valid_num_quantizers: int
    input_sample_rate: int
    encode_downsample_rate: int


@dataclass(frozen=True)
class Qwen3TTSConfig:
    model_type: str  # custom_voice | voice_design | base
    model_size: str  # e.g. "0b6", "1b7" (as config.json says)
    talker: DecoderConfig
    code_predictor: DecoderConfig
    num_code_groups: int
    text_vocab_size: int
    text_hidden_size: int
    hidden_act: str
    # codec control ids (first codebook vocabulary)
    codec_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    # text ids
    tts_bos_id: int
    tts_eos_id: int
    tts_pad_id: int
    speakers: dict[str, int] = field(default_factory=dict)  # lower-case name -> codec id
    speaker_dialect: dict[str, str | None] = field(default_factory=dict)  # lower-case name -> dialect or None
    language_ids: dict[str, int] = field(default_factory=dict)  # lower-case language (incl. dialects) -> id
    codec: CodecDecoderConfig | None = None
    speaker_encoder: SpeakerEncoderConfig | None = None  # Base checkpoints only
    codec_encoder: CodecEncoderConfig | None = None

    @property
    def languages(self) -> list[str]:
        """Languages a request may name (dialects are chosen through speakers, as the reference does)."""
        return ["auto"] + [k for k in self.language_ids if "dialect" not in k]

    @property
    def suppressed_ids(self) -> list[int]:
        v = self.talker.vocab_size
        return [i for i in range(max(0, v - NUM_SPECIAL_CODEC_IDS), v) if i != self.codec_eos_id]

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate if self.codec else 24000


def is_qwen3_tts_dir(model_dir: str | Path) -> bool:
    """True when ``model_dir/config.json`` says ``model_type: qwen3_tts`` (architecture detection for serve)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("model_type") == "qwen3_tts"
    except (json.JSONDecodeError, OSError):
        return False


def _decoder(raw: dict[str, Any], arch: str, default_vocab: int) -> DecoderConfig:
    hidden = int(raw.get("hidden_size", 1024))
    heads = int(raw.get("num_attention_heads", 16))
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedTTSVariantError(f"{arch}: hidden_act={raw.get('hidden_act')!r} is not supported (silu only)")
    if raw.get("use_sliding_window"):
        raise UnsupportedTTSVariantError(f"{arch}: use_sliding_window=true is not supported")
    return DecoderConfig(
        architecture=arch, vocab_size=int(raw.get("vocab_size", default_vocab)), hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size", 3072)), num_layers=int(raw.get("num_hidden_layers", 5)),
        num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)), rope_scaling=RopeScaling(),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)), tie_word_embeddings=False,
        qkv_bias=bool(raw.get("attention_bias", False)), qk_norm=True, bos_token_id=None, eos_token_ids=(),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16").replace("torch.", ""))


def _codec_config(raw: dict[str, Any]) -> CodecDecoderConfig:
    d = raw.get("decoder_config") or {}
    hidden = int(d.get("hidden_size", 1024))
    heads = int(d.get("num_attention_heads", 16))
    return CodecDecoderConfig(
        codebook_size=int(d.get("codebook_size", 2048)), codebook_dim=int(d.get("codebook_dim", 512)),
        num_quantizers=int(d.get("num_quantizers", 16)), hidden_size=hidden, latent_dim=int(d.get("latent_dim", 1024)),
        intermediate_size=int(d.get("intermediate_size", 3072)), num_layers=int(d.get("num_hidden_layers", 8)),
        num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope_theta=float(d.get("rope_theta", 10000.0)), sliding_window=int(d.get("sliding_window", 72)),
        layer_scale_initial_scale=float(d.get("layer_scale_initial_scale", 0.01)),
        upsample_rates=tuple(int(x) for x in d.get("upsample_rates", (8, 5, 4, 3))),
        upsampling_ratios=tuple(int(x) for x in d.get("upsampling_ratios", (2, 2))),
        decoder_dim=int(d.get("decoder_dim", 1536)),
        max_position_embeddings=int(d.get("max_position_embeddings", 8000)),
        sample_rate=int(raw.get("output_sample_rate", 24000)),
        decode_upsample_rate=int(raw.get("decode_upsample_rate", 1920)))


def _speaker_encoder_config(raw: dict[str, Any]) -> SpeakerEncoderConfig:
    d = SpeakerEncoderConfig()
    kw = {k: (tuple(int(x) for x in raw[k]) if isinstance(getattr(d, k), tuple) else type(getattr(d, k))(raw[k]))
          for k in d.__dataclass_fields__ if k in raw}
    cfg = SpeakerEncoderConfig(**kw)
    if not len(cfg.enc_channels) == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations) >= 3:
        raise UnsupportedTTSVariantError("config.json: speaker_encoder_config needs enc_channels, enc_kernel_sizes "
                                         "and enc_dilations of one length (at least 3)")
    return cfg


def _codec_encoder_config(raw: dict[str, Any]) -> CodecEncoderConfig | None:
    if not raw.get("encoder_config"):
        return None
    return CodecEncoderConfig(mimi=dict(raw["encoder_config"]),
                              valid_num_quantizers=int(raw.get("encoder_valid_num_quantizers", 16)),
                              input_sample_rate=int(raw.get("input_sample_rate", 24000)),
                              encode_downsample_rate=int(raw.get("encode_downsample_rate", 1920)))


def tts_config_from_dict(raw: dict[str, Any], speech_tokenizer: dict[str, Any] | None = None) -> Qwen3TTSConfig:
    if raw.get("model_type") != "qwen3_tts":
        raise UnsupportedTTSVariantError(f"config.json: model_type={raw.get('model_type')!r} is not a Qwen3-TTS "
                                         "checkpoint (want 'qwen3_tts')")
    kind = raw.get("tts_model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedTTSVariantError(f"config.json: tts_model_type={kind!r} is not supported; supported: "
                                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    tok = raw.get("tokenizer_type")
    if tok not in SUPPORTED_TOKENIZER_TYPES:
        raise UnsupportedTTSVariantError(f"config.json: tokenizer_type={tok!r} is not supported (only the 12 Hz "
                                         f"speech tokenizer is: {', '.join(SUPPORTED_TOKENIZER_TYPES)})")
    t = raw.get("talker_config") or {}
    cp = t.get("code_predictor_config") or {}
    talker = _decoder(t, "Qwen3TTSTalker", 3072)
    predictor = _decoder(cp, "Qwen3TTSCodePredictor", 2048)
    groups = int(t.get("num_code_groups", 32))
    if int(cp.get("num_code_groups", groups)) != groups:
        raise UnsupportedTTSVariantError("config.json: talker and code predictor disagree on num_code_groups")
    spk_enc = _speaker_encoder_config(raw.get("speaker_encoder_config") or {}) if kind == "base" else None
    if spk_enc is not None and spk_enc.enc_dim != talker.hidden_size:
        raise UnsupportedTTSVariantError(f"config.json: speaker_encoder_config.enc_dim={spk_enc.enc_dim} must equal "
                                         f"the talker's hidden_size={talker.hidden_size} (the x-vector is a prompt "
                                         "row)")
    dialects = {k.lower(): (v or None) for k, v in (t.get("spk_is_dialect") or {}).items()}
    return Qwen3TTSConfig(
        model_type=kind, model_size=str(raw.get("tts_model_size") or ""), talker=talker, code_predictor=predictor,
        num_code_groups=groups, text_vocab_size=int(t.get("text_vocab_size", 151936)),
        text_hidden_size=int(t.get("text_hidden_size", 2048)), hidden_act=str(t.get("hidden_act", "silu")),
        codec_eos_id=int(t.get("codec_eos_token_id", 4198)), codec_pad_id=int(t.get("codec_pad_id", 4196)),
        codec_bos_id=int(t.get("codec_bos_id", 4197)), codec_think_id=int(t.get("codec_think_id", 4202)),
        codec_nothink_id=int(t.get("codec_nothink_id", 4203)),
        codec_think_bos_id=int(t.get("codec_think_bos_id", 4204)),
        codec_think_eos_id=int(t.get("codec_think_eos_id", 4205)),
        tts_bos_id=int(raw.get("tts_bos_token_id", 151672)), tts_eos_id=int(raw.get("tts_eos_token_id", 151673)),
        tts_pad_id=int(raw.get("tts_pad_token_id", 151671)),
        speakers={k.lower(): int(v) for k, v in (t.get("spk_id") or {}).items()},
        speaker_dialect=dialects,
        language_ids={k.lower(): int(v) for k, v in (t.get("codec_language_id") or {}).items()},
        codec=_codec_config(speech_tokenizer) if speech_tokenizer is not None else None,
        speaker_encoder=spk_enc,
        codec_encoder=_codec_encoder_config(speech_tokenizer) if speech_tokenizer is not None else None)


def load_tts_config(model_dir: str | Path, need_codec: bool = True) -> Qwen3TTSConfig:
    folder = Path(model_dir)
    if not folder.is_dir():
        raise MissingCheckpointFileError(f"model path {str(folder)!r} is not a directory; give a Qwen3-TTS "
                                         "checkpoint folder")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise MissingCheckpointFileError(f"{folder}: config.json is missing")
    st_cfg = folder / "speech_tokenizer" / "config.json"
    if need_codec and not st_cfg.is_file():
        raise MissingCheckpointFileError(f"{folder}: speech_tokenizer/config.json is missing (the codec that "
                                         "turns frames into audio lives in speech_tokenizer/)")
    st = _read_json(st_cfg) if st_cfg.is_file() else None
    if st is not None and st.get("model_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
        raise UnsupportedTTSVariantError(f"{st_cfg}: model_type={st.get('model_type')!r}; only the 12 Hz speech "
                                         "tokenizer is supported")
    return tts_config_from_dict(_read_json(cfg_path), st)


def read_generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """``generation_config.json`` (sampling defaults the reference merges under the caller's values), or {}."""
    path = Path(model_dir) / "generation_config.json"
    return _read_json(path) if path.is_file() else {}
