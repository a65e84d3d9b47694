"""The OmniVoice network on our decoder: audio/text input embeddings -> bidirectional Qwen3 backbone -> per-codebook
heads. ``forward`` runs a whole padded canvas batch (one or more groups of rows, each group padded to its own
length); ``target_logits`` reads the heads only at the canvas positions a step predicts (the reference computes
them everywhere and slices).

Input ids are ``[N, C, L]`` (C codebooks; text positions repeat the text id in every codebook row). A position
flagged in ``audio_mask`` embeds as the sum of its C codebook embeddings (codebook c's id offset by
``c * audio_vocab_size`` into one table), any other as the backbone's text embedding of row 0.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from strataserve.models.decoder import DecoderModel
from strataserve.models.loader import _load_files, _Targets, safetensors_files
from strataserve.models.omnivoice.config import OmniVoiceConfig
from strataserve.models.qwen3_tts.loader import init_random_talker
from strataserve.runner.nar_attention import CanvasAttention, CanvasMeta, CanvasOps
from strataserve.runner.ops import OpSet


class OmniVoiceModel(nn.Module):
    def __init__(self, cfg: OmniVoiceConfig, base_ops: OpSet, dtype: torch.dtype, device: torch.device | str,
                 max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        llm = cfg.llm
        ops = CanvasOps(base_ops, CanvasAttention(llm.num_heads, llm.num_kv_heads, llm.head_dim))
        self.backbone = DecoderModel(llm, ops, dtype, device, max_positions)  # type: ignore[arg-type]
        rows = cfg.num_codebooks * cfg.audio_vocab_size
        self.audio_embeddings = nn.Parameter(torch.empty(rows, llm.hidden_size, dtype=dtype, device=device),
                                             requires_grad=False)
        self.audio_heads = nn.Parameter(torch.empty(rows, llm.hidden_size, dtype=dtype, device=device),
                                        requires_grad=False)
        self.register_buffer("codebook_offsets", torch.arange(cfg.num_codebooks, device=device)
                             * cfg.audio_vocab_size, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.audio_heads.device

    @property
    def dtype(self) -> torch.dtype:
        return self.audio_heads.dtype

    def embed(self, ids: torch.Tensor, audio_mask: torch.Tensor) -> torch.Tensor:
        """ids long ``[N, C, L]``, audio_mask bool ``[N, L]`` -> ``[N * L, H]``."""
        text = F.embedding(ids[:, 0, :], self.backbone.embed_tokens)
        shifted = ids * audio_mask.unsqueeze(1) + self.codebook_offsets.view(1, -1, 1)
        audio = F.embedding(shifted, self.audio_embeddings).sum(dim=1)
        return torch.where(audio_mask.unsqueeze(-1), audio, text).flatten(0, 1)

    def forward(self, groups: Sequence[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
                meta: CanvasMeta) -> torch.Tensor:
        """The canvas batch, one ``(ids [N_g, C, L_g], audio_mask [N_g, L_g])`` per group (``meta``'s groups) ->
        final-normed hidden ``[sum N_g * L_g, H]``, the groups back to back."""
        embeds = [self.embed(ids, audio_mask) for ids, audio_mask in groups]
        x = embeds[0] if len(embeds) == 1 else torch.cat(embeds)
        return self.backbone(None, positions, meta, inputs_embeds=x)  # type: ignore

    def target_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """hidden ``[N * L, H]``, rows long ``[M, T]`` (flat canvas rows) -> float32 logits ``[M, C, T, V]``."""
        m, t = rows.shape
        out = self.backbone.ops.linear(hidden.index_select(0, rows.flatten()), self.audio_heads).float()
        return out.view(m, t, self.config.num_codebooks, self.config.audio_vocab_size).transpose(1, 2)


class _Weights(_Targets):
    """Checkpoint name -> destination: ``llm.*`` through the decoder's name map, plus the audio tensors."""

    def __init__(self, model: OmniVoiceModel) -> None:
        super().__init__(model.backbone)
        for name, param in (("audio_embeddings.weight", model.audio_embeddings),
                            ("audio_heads.weight", model.audio_heads)):
            self.map[name], self.rows[name] = (param, 0), param.shape[0]

    def fill(self, name: str, tensor: torch.Tensor) -> None:
        if name == "codebook_layer_offsets":  # a buffer the reference saves; we rebuild it from the config
            return
        super().fill("model." + name[len("llm."):] if name.startswith("llm.") else name, tensor)


def load_omnivoice_weights(folder: Path, model: OmniVoiceModel) -> OmniVoiceModel:
    targets = _Weights(model)
    with torch.no_grad():
        _load_files(safetensors_files(folder), targets)  # type: ignore[arg-type]
    targets.check_complete(folder)
    return model.eval()


def init_random_omnivoice(model: OmniVoiceModel, seed: int = 0, std: float = 0.02) -> OmniVoiceModel:
    """Random weights in the model's shapes (benchmarks): norms near 1, everything else N(0, std)."""
    return init_random_talker(model, seed, std)  # type: ignore[arg-type]  # any module: it walks the parameters
