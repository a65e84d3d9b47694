"""Scheduled chunks -> flat model inputs + ``AttentionMetadata`` for one step.

Flat order: decode tokens first, sorted by context length (so ``DecodeGroup``s pad little), then the prefill
chunks in scheduler order. A chunk of one token is a decode whatever its position (a 1-token prompt, or the
last token after a cached prefix): its query attends over the cache after its own K/V was written.

Per-step Python work is a loop over chunks (not tokens); token-level arrays are built with numpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from strataserve.engine.outputs import ScheduledChunk
from strataserve.runner.attention import AttentionMetadata, DecodeGroup, PrefillSegment

# Decode rows per padding group. Small groups pad less and, more importantly on CPU, keep each group's gathered
# K/V (~2 MB for 8 rows of ~270 tokens) in cache for the attention that reads it right after the gather:
# measured 200 decodes x 1 layer: 1 group 90 ms, 4 groups 21 ms, 25 groups 14 ms, 200 groups 19 ms.
_MIN_GROUP_ROWS = 8
_MAX_GROUPS = 32


@dataclass(slots=True)
class InputBatch:
    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    attn_meta: AttentionMetadata
    logits_indices: torch.Tensor  # long [S]: flat row of each sampling chunk's last token, in chunk order
    sample_chunk_ids: list[int]  # indices into the chunk list, same order as logits_indices


def _padded(rows: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        r = r[:width]  # a table may own blocks beyond this step's need (allocated ahead)
        out[i, :len(r)] = r
    return out


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask -> 0 / -inf in the model dtype, once per step (SDPA would convert a bool mask in every layer)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _decode_groups(nblocks: np.ndarray, ctx: torch.Tensor, tables: torch.Tensor, block_size: int,
                   mask_dtype: torch.dtype) -> list[DecodeGroup]:
    """Split rows (sorted by length) into equal-count groups, each padded to its own longest row."""
    b = len(nblocks)
    if b == 0:
        return []
    n_groups = max(1, min(_MAX_GROUPS, b // _MIN_GROUP_ROWS))
    bounds = np.linspace(0, b, n_groups + 1).astype(np.int64)
    groups = []
    for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if e <= s:
            continue
        nb = int(nblocks[e - 1])
        mask = _additive(torch.arange(nb * block_size) < ctx[s:e, None], mask_dtype)
        groups.append(DecodeGroup(s, e, tables[s:e, :nb].contiguous(), mask[:, None, None, :]))
    return groups


def build_input_batch(chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device,
                      mask_dtype: torch.dtype = torch.float32, torch_views: bool = True) -> InputBatch:
    """``mask_dtype``: the model dtype (the torch backend's additive masks must match the queries').
    ``torch_views=False`` skips ``decode_groups`` and the prefill segments' block ids/masks, which only the torch
    attention backend reads (kernel backends use the generic tensors)."""
    dec = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    pre = [i for i, c in enumerate(chunks) if len(c.token_ids) != 1]
    dec.sort(key=lambda i: chunks[i].start_pos)
    bs = block_size
    n_dec = len(dec)

    # ---- decodes: one token each, vectorised over rows
    d_pos = np.fromiter((chunks[i].start_pos for i in dec), dtype=np.int64, count=n_dec)
    d_ctx = d_pos + 1
    d_nb = (d_ctx + bs - 1) // bs
    width = int(d_nb.max()) if n_dec else 0
    d_tables = _padded([chunks[i].block_table for i in dec], width) if n_dec else np.zeros((0, 0), np.int64)
    d_slots = d_tables[np.arange(n_dec), d_pos // bs] * bs + d_pos % bs
    ids = [chunks[i].token_ids[0] for i in dec]
    pos_parts = [d_pos]
    slot_parts = [d_slots]

    # ---- prefill chunks
    segments: list[PrefillSegment] = []
    p_tables: list[list[int]] = []
    p_start_loc = [n_dec]
    p_ctx: list[int] = []
    offset = n_dec
    for i in pre:
        c = chunks[i]
        n, start = len(c.token_ids), c.start_pos
        total = start + n
        table = c.block_table[:(total + bs - 1) // bs]
        bt = np.asarray(table, dtype=np.int64)
        pos = np.arange(start, total, dtype=np.int64)
        ids.extend(c.token_ids)
        pos_parts.append(pos)
        slot_parts.append(bt[pos // bs] * bs + pos % bs)
        seg = PrefillSegment(offset, n, start)
        if start > 0 and torch_views:
            seg.block_ids = torch.from_numpy(bt)
            seg.mask = _additive(torch.arange(total)[None, :] <= torch.arange(start, total)[:, None], mask_dtype)
        segments.append(seg)
        p_tables.append(table)
        p_ctx.append(start)
        offset += n
        p_start_loc.append(offset)

    sample_chunk_ids = [i for i, c in enumerate(chunks) if c.sample]
    dec_row = {ci: r for r, ci in enumerate(dec)}
    logits_rows = []
    seg_of = dict(zip(pre, segments))
    for ci in sample_chunk_ids:
        if ci in dec_row:
            logits_rows.append(dec_row[ci])
        else:
            seg = seg_of[ci]
            logits_rows.append(seg.start + seg.query_len - 1)

    d_tables_t = torch.from_numpy(d_tables)
    d_ctx_t = torch.from_numpy(d_ctx)
    p_width = max((len(t) for t in p_tables), default=0)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slot_parts)),
        num_decode_tokens=n_dec,
        decode_block_tables=d_tables_t.to(torch.int32),
        decode_context_lens=d_ctx_t.to(torch.int32),
        prefill_query_start_loc=torch.tensor(p_start_loc, dtype=torch.int32),
        prefill_context_lens=torch.tensor(p_ctx, dtype=torch.int32),
        prefill_block_tables=torch.from_numpy(_padded(p_tables, p_width)).to(torch.int32),
        decode_groups=_decode_groups(d_nb, d_ctx_t, d_tables_t, bs, mask_dtype) if torch_views else [],
        prefills=segments,
    )
    batch = InputBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.from_numpy(np.concatenate(pos_parts)),
        attn_meta=meta,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long),
        sample_chunk_ids=sample_chunk_ids,
    )
    return batch if device.type == "cpu" else _to_device(batch, device)


def _to_device(batch: InputBatch, device: torch.device) -> InputBatch:
    def mv(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    m = batch.attn_meta
    meta = AttentionMetadata(
        slot_mapping=mv(m.slot_mapping), num_decode_tokens=m.num_decode_tokens,
        decode_block_tables=mv(m.decode_block_tables), decode_context_lens=mv(m.decode_context_lens),
        prefill_query_start_loc=mv(m.prefill_query_start_loc), prefill_context_lens=mv(m.prefill_context_lens),
        prefill_block_tables=mv(m.prefill_block_tables),
        decode_groups=[DecodeGroup(g.start, g.end, mv(g.block_tables), mv(g.mask)) for g in m.decode_groups],
        prefills=[PrefillSegment(s.start, s.query_len, s.context_len,
                                 None if s.block_ids is None else mv(s.block_ids),
                                 None if s.mask is None else mv(s.mask)) for s in m.prefills],
    )
    return InputBatch(mv(batch.input_ids), mv(batch.positions), meta, mv(batch.logits_indices),
                      batch.sample_chunk_ids)
