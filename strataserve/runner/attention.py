"""Paged KV cache layout, per-step attention metadata, and the plain-PyTorch attention backend.

KV cache layout (kernels rely on it): for every layer one K and one V tensor, each contiguous
``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype, or fp8/int8 with per-layer, per-KV-head
scales ``kv_scales`` [num_layers, 2 (K, V), num_kv_heads] (``kernels/kv_quant.py``, ``runner/kv_quant.py``).
Token position ``p`` of a request whose block table is ``bt`` lives in block ``bt[p // block_size]`` at row
``p % block_size``; its flat *slot* is
``bt[p // block_size] * block_size + p % block_size``, i.e. the row of ``cache.view(-1, num_kv_heads, head_dim)``.

Flat batch order (built by ``runner/input_batch.py``): decode tokens first (one per sequence, sorted by context
length so that similar lengths sit together), then the prefill chunks. Every step first writes the new K/V of
all T tokens into their slots, then attends:
- decode row i: query at position ``context_lens[i] - 1`` over the first ``context_lens[i]`` cached tokens;
- prefill chunk: queries at positions ``context_len .. context_len + query_len - 1``, causal, over the earlier
  tokens (cached prefix / previous chunks, read from the blocks) and the chunk itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from strataserve.kernels.kv_quant_ref import dequantize_ref, quantize_ref


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer in the storage ``dtype`` (the model dtype, fp8 or int8)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [start, end) padded together to ``block_tables.shape[1]`` blocks (torch backend detail)."""

    start: int
    end: int
    block_tables: torch.Tensor  # long [n, nb]
    mask: torch.Tensor  # [n, 1, 1, nb * block_size]: bool (True = attend) or additive (0 / -inf, model dtype)


@dataclass(slots=True)
class PrefillSegment:
    """One prefill chunk occupying flat tokens [start, start + query_len)."""

    start: int
    query_len: int
    context_len: int  # tokens already in the cache before this chunk (cached prefix and/or earlier chunks)
    block_ids: torch.Tensor | None = None  # long, blocks covering [0, context_len + query_len); None if no context
    mask: torch.Tensor | None = None  # [query_len, context_len + query_len] causal-with-offset, bool or additive


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once per step by the runner, read by every layer.

    Generic fields (for any backend, e.g. Triton kernels): ``slot_mapping``, ``decode_block_tables``,
    ``decode_context_lens``, ``prefill_*`` tensors. ``decode_groups`` and ``prefills`` are the torch backend's
    pre-sliced views of the same data.
    """

    slot_mapping: torch.Tensor  # long [T]
    num_decode_tokens: int  # decodes occupy flat tokens [0, num_decode_tokens)
    decode_block_tables: torch.Tensor  # int32 [B, max_blocks] (padded with 0)
    decode_context_lens: torch.Tensor  # int32 [B], includes the token being decoded
    prefill_query_start_loc: torch.Tensor  # int32 [P + 1], flat offsets (first = num_decode_tokens)
    prefill_context_lens: torch.Tensor  # int32 [P], tokens cached before each chunk
    prefill_block_tables: torch.Tensor  # int32 [P, max_blocks] (padded with 0)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    prefill_seq_lens: torch.Tensor | None = None  # int32 [P]: context + query tokens (kernels; once per step)
    #: int32 [n, 2] (segment, query block) map of the prefill kernel's fixed-grid launch (``runner/mixed_graph.py``
    #: sets it; ``prefills`` is then empty and the map alone says which query rows are computed)
    prefill_tiles: torch.Tensor | None = None
    #: the decode rows are a fixed grid, most of them padding (context 0): the kernel should size each real row's
    #: split count from the lengths (a mixed-step graph; the launch cannot know how many rows are real)
    decode_rows_padded: bool = False


class TorchAttention:
    """Paged attention in plain PyTorch: gather K/V through block tables, then ``scaled_dot_product_attention``.

    Decode runs batched per ``DecodeGroup`` (one gather + one SDPA per group and layer); prefill chunks without
    earlier context attend over their own fresh K/V (unquantised even with an fp8/int8 cache), the others over K/V
    gathered from their blocks (dequantised).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_scales: torch.Tensor | None = None
        #: sees every layer's (layer, k, v) [T, Hkv, D] on the no-cache path (the fp8/int8 scale calibration)
        self.kv_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      kv_scales: torch.Tensor | None = None) -> None:
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        t = q.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q3 = q.view(t, hq, d)
        k3 = k.view(t, hkv, d)
        v3 = v.view(t, hkv, d)
        if meta is None:
            if self.kv_observer is not None:
                self.kv_observer(layer_idx, k3, v3)
            return self.causal(q3, k3, v3).reshape(t, hq * d)
        k_cache, v_cache = self.kv_caches[layer_idx]
        scales = None if self.kv_scales is None else self.kv_scales[layer_idx]
        k_new, v_new = k3, v3
        if scales is not None:  # quantised, stored through byte views (index ops lack float8 kernels on CPU)
            k_new = quantize_ref(k3, scales[0], k_cache.dtype).view(torch.uint8)
            v_new = quantize_ref(v3, scales[1], v_cache.dtype).view(torch.uint8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k_new)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v_new)
        if meta.num_decode_tokens and not meta.decode_groups:
            raise ValueError("torch attention needs decode_groups: build the batch with torch_views=True")
        out = q.new_empty(t, hq, d)
        # Gathers go through 2-D views: index_select then copies whole blocks (memcpy) instead of elements.
        k_rows = k_cache.view(k_cache.shape[0], -1)
        v_rows = v_cache.view(v_cache.shape[0], -1)

        def gather(rows: torch.Tensor, ids: torch.Tensor, which: int) -> torch.Tensor:
            x = rows.index_select(0, ids).view(-1, hkv, d)
            if scales is None:
                return x
            return dequantize_ref(x.view(self.kv_caches[layer_idx][which].dtype), scales[which], q.dtype)

        for g in meta.decode_groups:
            n = g.block_tables.shape[0]
            flat = g.block_tables.reshape(-1)
            kg = gather(k_rows, flat, 0).view(n, -1, hkv, d).transpose(1, 2)
            vg = gather(v_rows, flat, 1).view(n, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q3[g.start:g.end].unsqueeze(2), kg, vg, attn_mask=g.mask,
                                               enable_gqa=hq != hkv)
            out[g.start:g.end] = o.squeeze(2)
        for seg in meta.prefills:
            s, e = seg.start, seg.start + seg.query_len
            if seg.context_len == 0:
                if seg.mask is None:
                    out[s:e] = self.causal(q3[s:e], k3[s:e], v3[s:e])
                else:  # a sliding window cuts into the chunk: causal-and-windowed mask over its own K/V
                    o = F.scaled_dot_product_attention(q3[s:e].transpose(0, 1), k3[s:e].transpose(0, 1),
                                                       v3[s:e].transpose(0, 1), attn_mask=seg.mask,
                                                       enable_gqa=hq != hkv)
                    out[s:e] = o.transpose(0, 1)
                continue
            if seg.block_ids is None or seg.mask is None:
                raise ValueError("torch attention needs block ids + mask for a chunk after cached tokens: "
                                 "build the batch with torch_views=True")
            total = seg.context_len + seg.query_len
            kc = gather(k_rows, seg.block_ids, 0)[:total]
            vc = gather(v_rows, seg.block_ids, 1)[:total]
            o = F.scaled_dot_product_attention(q3[s:e].transpose(0, 1), kc.transpose(0, 1), vc.transpose(0, 1),
                                               attn_mask=seg.mask, enable_gqa=hq != hkv)
            out[s:e] = o.transpose(0, 1)
        return out.view(t, hq * d)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One causal sequence from its own fresh K/V: [n, H, D] in, [n, Hq, D] out."""
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(0, 1)
