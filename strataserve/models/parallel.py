"""Megatron-style tensor parallelism for the decoder: which slice of every weight a rank holds, and the two
collectives the layers need.

Layout over ``size`` ranks (rank r):
- qkv and gate/up are column-parallel: rank r holds its query heads ``[r*Hq/N, (r+1)*Hq/N)``, its KV heads and its
  ``I/N`` slice of gate and of up, so attention and the SwiGLU run on local data only.
- o and down are row-parallel: rank r holds the matching input columns; their outputs are partial sums, added by
  one all-reduce per attention block and one per MLP block.
- KV heads: split ``Hkv/N`` per rank when ``Hkv >= N``; when there are fewer KV heads than ranks each rank keeps
  the one KV head its query heads read (rank r: head ``r * Hkv // N``), so the KV heads are replicated.
- embedding and lm_head are vocab-parallel: rank r holds rows ``[r*Vp, (r+1)*Vp)`` with ``Vp = ceil(V/N)`` (the
  last rank's rows past V are zero). The embedding zeroes the ids it does not own and all-reduces; the lm_head's
  logit slices are all-gathered, so every rank holds the full logits (only rank 0 samples).

With ``size == 1`` every method is the plain single-GPU operation (no collective, no masking), so the same decoder
code runs unsharded at the same speed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from strataserve.models.hf_config import DecoderConfig


def check_tensor_parallel(cfg: DecoderConfig, size: int) -> None:
    """Raise a ValueError saying what to change when ``cfg`` cannot be split over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size}: must be >= 1")
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads={cfg.num_heads} is not divisible by it")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads} neither divides it nor is divisible by it")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={size} does not fit this model: {'; '.join(problems)}; "
                         "choose a size that divides the head counts (e.g. 1, 2, 4, 8)")


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group (``group`` is the torch.distributed group; None when size 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    #: an optional faster all-reduce for small tensors (``runner/tp_worker.OneShotAllReduce``); None: NCCL/gloo
    small_all_reduce: Any = None

    # ------------------------------------------------------------------ shapes
    def local_config(self, cfg: DecoderConfig) -> DecoderConfig:
        """The per-rank view of ``cfg``: this rank's heads, KV heads and MLP width (vocab and hidden stay full)."""
        if self.size == 1:
            return cfg
        check_tensor_parallel(cfg, self.size)
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // self.size,
                                   num_kv_heads=max(1, cfg.num_kv_heads // self.size),
                                   intermediate_size=cfg.intermediate_size // self.size)

    def kv_head_start(self, cfg: DecoderConfig) -> int:
        """The first (global) KV head this rank holds."""
        if cfg.num_kv_heads >= self.size:
            return self.rank * (cfg.num_kv_heads // self.size)
        return self.rank * cfg.num_kv_heads // self.size  # replicated: the head this rank's query heads read

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the embedding / lm_head shard (every rank the same, the last one padded)."""
        return -(-vocab_size // self.size)

    def shard_slice(self, name: str, cfg: DecoderConfig) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of checkpoint tensor ``name`` (HF naming, full config ``cfg``) this rank reads,
        or None when it reads the whole tensor (norms; everything when size is 1)."""
        if self.size == 1:
            return None
        part = name.rsplit(".", 2)
        module, kind = (part[-2], part[-1]) if len(part) >= 2 else ("", "")
        d = cfg.head_dim
        if module == "q_proj":
            n = cfg.num_heads // self.size * d
            return 0, self.rank * n, (self.rank + 1) * n
        if module in ("k_proj", "v_proj"):
            n = max(1, cfg.num_kv_heads // self.size) * d
            start = self.kv_head_start(cfg) * d
            return 0, start, start + n
        if module in ("gate_proj", "up_proj"):
            n = cfg.intermediate_size // self.size
            return 0, self.rank * n, (self.rank + 1) * n
        if module == "o_proj" and kind == "weight":
            n = cfg.num_heads // self.size * d
            return 1, self.rank * n, (self.rank + 1) * n
        if module == "down_proj":
            n = cfg.intermediate_size // self.size
            return 1, self.rank * n, (self.rank + 1) * n
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            n = self.vocab_rows(cfg.vocab_size)
            return 0, min(self.rank * n, cfg.vocab_size), min((self.rank + 1) * n, cfg.vocab_size)
        return None

    # ------------------------------------------------------------------ collectives (inside the forward)
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the row-parallel partial outputs of every rank, in place (capturable in a CUDA graph on NCCL)."""
        if self.small_all_reduce is not None and self.small_all_reduce.fits(x):
            return self.small_all_reduce(x)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def send_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0: broadcast a step's sampled token ids (on the device, no host sync); returns them as sent."""
        import torch.distributed as dist

        tokens = tokens.to(torch.long).contiguous()
        dist.broadcast(tokens, src=0, group=self.group)
        return tokens

    def receive_tokens(self, n: int, device: torch.device) -> torch.Tensor:
        """Other ranks: the ``n`` token ids rank 0 sends with ``send_tokens``."""
        import torch.distributed as dist

        tokens = torch.empty(n, dtype=torch.long, device=device)
        dist.broadcast(tokens, src=0, group=self.group)
        return tokens

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding lookup: ids outside this rank's rows give zeros, the all-reduce fills them."""
        if self.size == 1:
            return F.embedding(input_ids, weight)
        local = input_ids - self.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight)
        out.masked_fill_(outside[:, None], 0)
        return self.all_reduce(out)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[S, Vp]`` logit slices of every rank -> ``[S, V]`` on every rank (the padding columns dropped)."""
        if self.size == 1:
            return logits
        import torch.distributed as dist

        s, vp = logits.shape
        out = torch.empty(self.size * s, vp, dtype=logits.dtype, device=logits.device)
        # all_gather_single is all_gather_into_tensor's name from torch 2.13 on (the old one warns there)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, logits.contiguous(), group=self.group)
        return out.view(self.size, s, vp).permute(1, 0, 2).reshape(s, self.size * vp)[:, :vocab_size]


SINGLE = TensorParallel()
