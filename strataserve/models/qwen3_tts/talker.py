"""Qwen3-TTS talker + code predictor on the shared decoder.

The talker is a Qwen3 decoder over the first codebook: its ``embed_tokens`` is the checkpoint's
``codec_embedding`` and its ``lm_head`` the ``codec_head``; its inputs are sums of embeddings (codec frame +
projected text), passed through the decoder's ``inputs_embeds`` hook. Text tokens enter through
``text_embedding`` and a two-layer MLP (``text_projection``) into the talker's width.

The code predictor is a second, small Qwen3 decoder that fills codebooks 1..G-1 of a frame autoregressively from
the talker's last hidden state and codebook 0; it has one input embedding and one head per codebook (stacked
here as ``[G-1, vocab, dim]`` so a batch gathers them in one op) and a projection from the talker's width to its
own when they differ. Its decoder's own ``embed_tokens`` / ``lm_head`` are unused (left zero).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strataserve.models.decoder import DecoderModel, _Factory
from strataserve.models.qwen3_tts.config import Qwen3TTSConfig
from strataserve.runner.ops import OpSet


class Qwen3TTSTalker(nn.Module):
    def __init__(self, cfg: Qwen3TTSConfig, talker_ops: OpSet, predictor_ops: OpSet,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        new = _Factory(dtype, device)
        t, p = cfg.talker, cfg.code_predictor
        self.talker = DecoderModel(t, talker_ops, dtype, device, max_positions)
        # the code predictor never sees more than G positions (hidden state + G-1 codes)
        self.predictor = DecoderModel(p, predictor_ops, dtype, device, max(cfg.num_code_groups, 2))
        th = cfg.text_hidden_size
        self.text_embedding = new(cfg.text_vocab_size, th)
        self.text_fc1_weight, self.text_fc1_bias = new(th, th), new(th)
        self.text_fc2_weight, self.text_fc2_bias = new(t.hidden_size, th), new(t.hidden_size)
        g = cfg.num_code_groups - 1
        self.cp_embeddings = new(g, p.vocab_size, t.hidden_size)
        self.cp_heads = new(g, p.vocab_size, p.hidden_size)
        same = p.hidden_size == t.hidden_size
        self.cp_proj_weight = None if same else new(p.hidden_size, t.hidden_size)
        self.cp_proj_bias = None if same else new(p.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.text_embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.text_embedding.device

    # ------------------------------------------------------------------ embeddings
    def text_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """text ids ``[..., N]`` -> projected ``[..., N, H]`` (the reference's ``text_projection(text_embedding)``)."""
        x = F.embedding(ids, self.text_embedding)
        x = F.silu(F.linear(x, self.text_fc1_weight, self.text_fc1_bias))
        return F.linear(x, self.text_fc2_weight, self.text_fc2_bias)

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """first-codebook (and control) ids -> talker-width embeddings."""
        return F.embedding(ids, self.talker.embed_tokens)

    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """whole frames ``[B, G]`` -> the talker input ``[B, H]``: the sum of every codebook's embedding."""
        first = self.codec_embed(codes[:, :1])  # [B, 1, H]
        g = torch.arange(codes.shape[1] - 1, device=codes.device)
        rest = self.cp_embeddings[g, codes[:, 1:]]  # [B, G-1, H]
        return torch.cat([first, rest], dim=1).sum(1)  # summed as the reference does, in one reduction

    def cp_input(self, x: torch.Tensor) -> torch.Tensor:
        """talker-width ``[B, H]`` -> code-predictor width (identity when equal)."""
        return x if self.cp_proj_weight is None else F.linear(x, self.cp_proj_weight, self.cp_proj_bias)

    def cp_code_embed(self, group: int, ids: torch.Tensor) -> torch.Tensor:
        """codebook ``group`` (1..G-1) ids ``[B]`` -> talker-width embeddings ``[B, H]``."""
        return F.embedding(ids, self.cp_embeddings[group - 1])

    def cp_logits(self, group: int, hidden: torch.Tensor) -> torch.Tensor:
        """code predictor hidden ``[B, Hc]`` -> float32 logits of codebook ``group`` (1..G-1)."""
        return self.predictor.ops.linear(hidden, self.cp_heads[group - 1]).float()
