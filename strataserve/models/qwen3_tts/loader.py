"""Load a Qwen3-TTS checkpoint folder (or random weights in its shapes) into ``Qwen3TTSTalker`` + ``CodecDecoder``.

The talker's and code predictor's decoder layers reuse the LLM loader's name map (fused q/k/v and gate/up); the
TTS-only tensors (text embedding + projection, per-codebook embeddings and heads, projection) are mapped here.
``speaker_encoder.*`` (voice cloning, Base checkpoints) goes to the ``SpeakerEncoder`` (``load_voice_cloner``),
with the speech tokenizer's ``encoder.*`` for the reference's codes.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from strataserve.models.loader import _Targets, prefixed_tensors, safetensors_files
from strataserve.models.qwen3_tts.codec import CodecDecoder
from strataserve.models.qwen3_tts.codec_encoder import CodecEncoder
from strataserve.models.qwen3_tts.config import MissingCheckpointFileError, Qwen3TTSConfig
from strataserve.models.qwen3_tts.speaker_encoder import SpeakerEncoder
from strataserve.models.qwen3_tts.talker import Qwen3TTSTalker
from strataserve.models.qwen3_tts.voice_clone import VoiceCloner

_SKIPPED_PREFIXES = ("speaker_encoder.",)


class _TalkerTargets:
    """Checkpoint name -> destination, for the whole talker (both decoders + TTS-only tensors)."""

    def __init__(self, model: Qwen3TTSTalker) -> None:
        self.talker = _Targets(model.talker)
        self.predictor = _Targets(model.predictor)
        # the code predictor's own vocabulary embedding / head are unused: nothing in the checkpoint fills them
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            self.predictor.map[name][0].data.zero_()
            self.predictor.filled.add(name)
        self.extra: dict[str, torch.Tensor] = {
            "talker.model.text_embedding.weight": model.text_embedding,
            "talker.text_projection.linear_fc1.weight": model.text_fc1_weight,
            "talker.text_projection.linear_fc1.bias": model.text_fc1_bias,
            "talker.text_projection.linear_fc2.weight": model.text_fc2_weight,
            "talker.text_projection.linear_fc2.bias": model.text_fc2_bias,
        }
        for j in range(model.config.num_code_groups - 1):
            self.extra[f"talker.code_predictor.model.codec_embedding.{j}.weight"] = model.cp_embeddings[j]
            self.extra[f"talker.code_predictor.lm_head.{j}.weight"] = model.cp_heads[j]
        if model.cp_proj_weight is not None:
            self.extra["talker.code_predictor.small_to_mtp_projection.weight"] = model.cp_proj_weight
            self.extra["talker.code_predictor.small_to_mtp_projection.bias"] = model.cp_proj_bias
        self.filled: set[str] = set()

    def fill(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith(_SKIPPED_PREFIXES):
            return
        if name in self.extra:
            dst = self.extra[name]
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                                 f"{tuple(dst.shape)}")
            dst.data.copy_(tensor)
            self.filled.add(name)
        elif name.startswith("talker.code_predictor."):
            self.predictor.fill(name[len("talker.code_predictor."):], tensor)
        elif name.startswith("talker."):
            sub = name[len("talker."):]
            sub = {"model.codec_embedding.weight": "model.embed_tokens.weight",
                   "codec_head.weight": "lm_head.weight"}.get(sub, sub)
            self.talker.fill(sub, tensor)
        else:
            raise ValueError(f"checkpoint tensor {name!r} is not part of a Qwen3-TTS talker; is config.json "
                             "consistent with the weights?")

    def check_complete(self, folder: Path) -> None:
        self.talker.check_complete(folder)
        self.predictor.check_complete(folder)
        missing = sorted(set(self.extra) - self.filled)
        if missing:
            raise ValueError(f"{folder}: checkpoint lacks tensors the config requires: {', '.join(missing[:5])}")


def load_talker(folder: Path, model: Qwen3TTSTalker) -> Qwen3TTSTalker:
    targets = _TalkerTargets(model)
    with torch.no_grad():
        for path in safetensors_files(folder):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    targets.fill(name, f.get_tensor(name))
    targets.check_complete(folder)
    return model.eval()


def _speech_tokenizer_weights(folder: Path) -> Path:
    path = folder / "speech_tokenizer" / "model.safetensors"
    if not path.is_file():
        raise MissingCheckpointFileError(f"{path.parent}: model.safetensors is missing (the speech tokenizer's "
                                         "weights)")
    return path


def load_codec(folder: Path, cfg: Qwen3TTSConfig, device: torch.device) -> CodecDecoder:
    assert cfg.codec is not None
    path = _speech_tokenizer_weights(folder)
    codec = CodecDecoder(cfg.codec)
    missing, unexpected = codec.load_state_dict(prefixed_tensors([path], "decoder."), strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} does not match the 12 Hz decoder: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    # float32 always: it runs once per few frames, and half precision would cost audio precision for little gain
    return codec.to(device=device, dtype=torch.float32).eval()


def load_voice_cloner(folder: Path, cfg: Qwen3TTSConfig, device: torch.device, dtype: torch.dtype) -> VoiceCloner:
    """A Base checkpoint's speaker encoder (``speaker_encoder.*``, in the talker's dtype as the reference runs it)
    and the speech tokenizer's encoder."""
    if cfg.speaker_encoder is None or cfg.codec_encoder is None:
        raise MissingCheckpointFileError(f"{folder}: a Base checkpoint needs speaker_encoder_config in config.json "
                                         "and encoder_config in speech_tokenizer/config.json")
    spk = SpeakerEncoder(cfg.speaker_encoder)
    state = prefixed_tensors(safetensors_files(folder), "speaker_encoder.")
    if not state:
        raise MissingCheckpointFileError(f"{folder}: a Base checkpoint's weights must hold speaker_encoder.* "
                                         "tensors (the speaker encoder for voice cloning); none were found")
    missing, unexpected = spk.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: speaker_encoder.* tensors do not match speaker_encoder_config: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    enc = CodecEncoder(cfg.codec_encoder, device).load(_speech_tokenizer_weights(folder))
    return VoiceCloner(spk.to(device=device, dtype=dtype).eval(), enc)


def init_random_talker(model: Qwen3TTSTalker, seed: int = 0, std: float = 0.02) -> Qwen3TTSTalker:
    """Random weights in the model's shapes (benchmarks): norms near 1, everything else N(0, std)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm"):
                param.normal_(1.0, 0.1, generator=gen)
            else:
                param.normal_(0.0, std, generator=gen)
    return model.eval()
