"""One decoder for Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3 (pre-norm, RMSNorm, GQA/MHA, SwiGLU).

Per-family differences are ``DecoderConfig`` data: q/k/v bias (Qwen2), per-head q/k RMSNorm before rotary
(Qwen3), rope scaling (Llama 3.1), tied embeddings, any head_dim. q/k/v and gate/up projections are fused into
single matmuls (the loader concatenates the checkpoint's weights). Elementwise ops and attention come from the
``OpSet`` given at construction, so the runner mode decides which kernels run, not this file.

Tensor parallelism (``models/parallel.py``): built with a rank's ``TensorParallel`` and that rank's local config
(its share of heads and MLP width), the same layers become Megatron's column/row-parallel ones: one all-reduce
after the o projection, one after down, a vocab-parallel embedding and gathered logits. At size 1 none of that runs.

Tokens are flattened: ``forward(input_ids [T], positions [T], attn_meta)`` -> hidden ``[T, H]``, where T mixes the
decode tokens and prefill chunks of one step and ``attn_meta`` says which token belongs where in the KV cache.
"""
from __future__ import annotations

import torch
from torch import nn

from strataserve.models.hf_config import DecoderConfig
from strataserve.models.parallel import SINGLE, TensorParallel
from strataserve.models.rope import build_cos_sin_cache
from strataserve.runner.attention import AttentionMetadata
from strataserve.runner.ops import OpSet


class _Factory:
    """Creates uninitialised parameters (the loader or ``init_random_weights`` fills them)."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype, self.device = dtype, device

    def __call__(self, *shape: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(*shape, dtype=self.dtype, device=self.device), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, ops: OpSet, new: _Factory,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops
        self.tp = tp if tp.size > 1 else None  # row-parallel o: its output is a partial sum to all-reduce
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.qkv_weight = new(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
        self.qkv_bias = new(cfg.q_size + 2 * cfg.kv_size) if cfg.qkv_bias else None
        self.o_weight = new(cfg.hidden_size, cfg.q_size)
        self.q_norm = new(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = new(cfg.head_dim) if cfg.qk_norm else None

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        """From the qkv projection's output (the layer runs it with the norm before it: ``OpSet.norm_linear``)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # (q/k norm,) rotary, KV store and attention in one call: a kernel backend fuses the first three
        o = self.ops.attend(self.layer_idx, positions, q, k, v, self.head_dim, cos_sin, self.q_norm, self.k_norm,
                            self.eps, meta)
        out = self.ops.linear(o, self.o_weight)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: OpSet, new: _Factory, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp if tp.size > 1 else None  # row-parallel down: its output is a partial sum to all-reduce
        self.gate_up_weight = new(2 * cfg.intermediate_size, cfg.hidden_size)  # [gate; up]
        self.down_weight = new(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention output and the residual stream, with the norm before gate_up (``OpSet.norm_mlp``);
        returns (output, new residual)."""
        out, residual = self.ops.norm_mlp(x, residual, norm_weight, eps, self.gate_up_weight, self.down_weight)
        return (out if self.tp is None else self.tp.all_reduce(out)), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, ops: OpSet, new: _Factory,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.ops = ops
        self.eps = cfg.rms_norm_eps
        self.input_norm = new(cfg.hidden_size)
        self.self_attn = Attention(cfg, layer_idx, ops, new, tp)
        self.post_attn_norm = new(cfg.hidden_size)
        self.mlp = MLP(cfg, ops, new, tp)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor, meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp, ops = self.self_attn, self.mlp, self.ops
        # residual None (first layer): no add, the residual stream starts as the embeddings
        qkv, residual = ops.norm_linear(hidden, residual, self.input_norm, self.eps, attn.qkv_weight, attn.qkv_bias)
        x = attn(positions, qkv, cos_sin, meta)
        return mlp(x, residual, self.post_attn_norm, self.eps)


class DecoderModel(nn.Module):
    """The decoder. Parameters are created uninitialised; fill them with ``models.loader``.

    ``max_positions`` bounds the rotary table (defaults to the config's ``max_model_len``).
    ``tp``: this rank's tensor-parallel place; ``cfg`` is then the rank's ``tp.local_config`` of the checkpoint's.
    """

    def __init__(self, cfg: DecoderConfig, ops: OpSet, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.tp = tp
        new = _Factory(dtype, device)
        vocab_rows = tp.vocab_rows(cfg.vocab_size)
        self.embed_tokens = new(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops, new, tp) for i in range(cfg.num_layers))
        self.norm = new(cfg.hidden_size)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else new(vocab_rows, cfg.hidden_size)
        cos_sin = build_cos_sin_cache(cfg.head_dim, max_positions or cfg.max_model_len, cfg.rope_theta,
                                      cfg.rope_scaling, device)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                attn_meta: AttentionMetadata | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: long ``[T]`` -> final-normed hidden ``[T, H]``.

        ``attn_meta=None``: the T tokens are one causal sequence and the KV cache is not touched.
        ``inputs_embeds`` ``[T, H]`` replaces the embedding lookup (models whose inputs are sums of several
        embeddings, e.g. the Qwen3-TTS talker and code predictor); ``input_ids`` is then ignored.
        """
        hidden = self.tp.embed(input_ids, self.embed_tokens) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.cos_sin_cache, attn_meta)
        hidden, _ = self.ops.fused_add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[S, H]`` -> logits ``[S, V]`` in the model dtype (every rank's vocab slice, gathered)."""
        return self.tp.gather_vocab(self.ops.linear(hidden, self.lm_head), self.config.vocab_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[S, H]`` -> float32 logits ``[S, V]``."""
        return self.logits(hidden).float()
