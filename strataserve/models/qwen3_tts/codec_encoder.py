"""The 12 Hz speech tokenizer's encoder: 24 kHz audio -> codec frames ``[T, K]`` (the reference clip's codes, which
in-context voice cloning puts in the talker's prompt and in front of the generated frames for decoding).

It is a Mimi encoder (SEANet convs, a causal transformer, downsampling, split residual VQ), so transformers'
``MimiModel`` runs it; only its encoder half is kept. Two settings follow the reference: attention is full causal
(the sliding window is widened to the whole context, as the reference does for the attention it was trained
with under transformers 4.57), and only the first ``encoder_valid_num_quantizers`` codebooks are used, trimmed to
ceil(samples / encode_downsample_rate) frames. It always runs in float32: once per reference clip, off the
decode path.
"""
from __future__ import annotations

from pathlib import Path

import torch

from strataserve.models.loader import prefixed_tensors
from strataserve.models.qwen3_tts.config import CodecEncoderConfig, MissingCheckpointFileError

_DECODER_PARTS = ("upsample", "decoder_transformer", "decoder")


class CodecEncoder:
    def __init__(self, cfg: CodecEncoderConfig, device: torch.device | str = "cpu") -> None:
        from transformers import MimiConfig, MimiModel

        self.cfg = cfg
        mimi = MimiConfig(**cfg.mimi)
        mimi.sliding_window = mimi.max_position_embeddings  # full causal attention, as the reference runs it
        self.model = MimiModel(mimi)
        for name in _DECODER_PARTS:  # encoder only: the talker's codec decoder is ours
            setattr(self.model, name, None)
        self.model.to(device=device, dtype=torch.float32).eval()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load(self, path: Path) -> CodecEncoder:
        """``encoder.*`` tensors of the speech tokenizer's ``model.safetensors``."""
        state = prefixed_tensors([path], "encoder.")
        if not state:
            raise MissingCheckpointFileError(f"{path}: no encoder.* tensors (voice cloning needs the speech "
                                             "tokenizer's encoder)")
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # buffers newer transformers add (conv padding sizes) need not be in an older checkpoint
        kept = {n for n, _ in self.model.named_parameters()}
        missing = [k for k in missing if not k.startswith(_DECODER_PARTS)
                   and (k in kept or k.endswith(("embed_sum", "cluster_usage")))]
        unexpected = [k for k in unexpected if not k.startswith(_DECODER_PARTS)]
        if missing or unexpected:
            raise ValueError(f"{path} does not match the 12 Hz encoder config: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}")
        return self

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """float32 mono ``[N]`` at ``input_sample_rate`` -> long codes ``[ceil(N / downsample), K]`` on the CPU."""
        x = wav.to(self.device, torch.float32)[None, None]
        codes = self.model.encode(x, return_dict=True).audio_codes[0, : self.cfg.valid_num_quantizers]
        frames = -(-wav.shape[-1] // self.cfg.encode_downsample_rate)
        return codes[:, :frames].T.contiguous().cpu()
