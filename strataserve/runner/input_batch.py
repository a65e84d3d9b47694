"""Scheduled chunks -> flat model inputs + ``AttentionMetadata`` for one step.

Flat order: decode tokens first, sorted by context length (so ``DecodeGroup``s pad little), then the prefill
chunks in scheduler order. A chunk of one token is a decode whatever its position (a 1-token prompt, or the
last token after a cached prefix): its query attends over the cache after its own K/V was written.

Per-step Python work is a loop over chunks (not tokens); token-level arrays are built with numpy, decode block
tables are gathered from the runner's persistent ``BlockTableRows``, and on an accelerator all int64 arrays travel
in one pinned transfer and all int32 arrays in another.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from strataserve.kernels.prefill_tiles import PREFILL_BLOCK_M, build_prefill_tiles
from strataserve.types.outputs import ScheduledChunk
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
    decode_chunk_ids: list[int]  # the chunk of each decode row (rows [0, num_decode_tokens))


def _padded(rows: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        r = r[:width]  # a table may own blocks beyond this step's need (allocated ahead)
        out[i, :len(r)] = r
    return out


class BlockTableRows:
    """Persistent block-table rows, one per request, updated with only the blocks added since the last step.

    A decode step's table then costs one fancy-index gather instead of re-padding every request's whole list
    (the scheduler's block lists only grow while a request runs; a preempted request is forgotten and gets a
    fresh row when it resumes). Rows and columns grow on demand.
    """

    def __init__(self, max_rows: int, max_cols: int) -> None:
        self.table = np.zeros((max(1, max_rows), max(1, max_cols)), dtype=np.int32)
        self.filled = [0] * self.table.shape[0]
        self._row: dict[str, int] = {}
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    def forget(self, req_id: str) -> None:
        row = self._row.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    def rows(self, chunks: Sequence[ScheduledChunk], ids: Sequence[int]) -> np.ndarray:
        """The row of each ``chunks[i]`` for i in ``ids``, after copying in the blocks each gained."""
        row_of, filled = self._row, self.filled
        out = np.empty(len(ids), dtype=np.int64)
        for j, i in enumerate(ids):
            c = chunks[i]
            r = row_of.get(c.req_id)
            if r is None:
                r = row_of[c.req_id] = self._take()
            bt = c.block_table
            n, f = len(bt), filled[r]
            if n != f:
                if n > self.table.shape[1]:
                    self.table = np.pad(self.table, ((0, 0), (0, n - self.table.shape[1])))
                if n > f:
                    self.table[r, f:n] = bt[f:n]
                else:  # never expected (tables only grow); rewrite rather than trust the row
                    self.table[r, :n] = bt
                    self.table[r, n:f] = 0
                filled[r] = n
            out[j] = r
        return out

    def _take(self) -> int:
        if not self._free:
            old = self.table.shape[0]
            self.table = np.pad(self.table, ((0, old), (0, 0)))
            self.filled.extend([0] * old)
            self._free = list(range(2 * old - 1, old - 1, -1))
        r = self._free.pop()
        if self.filled[r]:  # padding past a row's table reads 0, as in the padded path, never a stale block id
            self.table[r, :self.filled[r]] = 0
            self.filled[r] = 0
        return r


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask -> 0 / -inf in the model dtype, once per step (SDPA would convert a bool mask in every layer)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _decode_groups(nblocks: np.ndarray, ctx: torch.Tensor, tables: torch.Tensor, block_size: int,
                   mask_dtype: torch.dtype, window: int | None = None) -> list[DecodeGroup]:
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
        keys = torch.arange(nb * block_size)
        allowed = keys < ctx[s:e, None]
        if window is not None:  # the query at ctx - 1 sees keys (ctx - 1 - window, ctx - 1]
            allowed &= keys >= ctx[s:e, None] - window
        mask = _additive(allowed, mask_dtype)
        groups.append(DecodeGroup(s, e, tables[s:e, :nb].contiguous(), mask[:, None, None, :]))
    return groups


def build_input_batch(chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device,
                      mask_dtype: torch.dtype = torch.float32, torch_views: bool = True,
                      rows: BlockTableRows | None = None, sliding_window: int | None = None,
                      tile_map: bool = False) -> InputBatch:
    """``mask_dtype``: the model dtype (the torch backend's additive masks must match the queries').
    ``torch_views=False`` skips ``decode_groups`` and the prefill segments' block ids/masks, which only the torch
    attention backend reads (kernel backends use the generic tensors). ``rows``: the runner's persistent block
    tables (decode tables are gathered from it); without it they are padded from the chunks' lists.

    Token ids < 0 (a token still being sampled by the step in flight) are passed through as they are; the
    runner replaces them on the device. ``sliding_window``: each query sees only the last ``sliding_window``
    positions, itself included (Mistral); the torch backend's masks carry it. ``tile_map``: also the Triton
    prefill kernel's tile map (``kernels/prefill_tiles.py``), in the same transfer as the other int32 arrays."""
    dec: list[int] = []
    pre: list[int] = []
    for i, c in enumerate(chunks):
        (dec if len(c.token_ids) == 1 else pre).append(i)
    dec.sort(key=lambda i: chunks[i].start_pos)
    bs = block_size
    n_dec = len(dec)

    # ---- decodes: one token each, vectorised over rows
    d_pos = np.fromiter((chunks[i].start_pos for i in dec), dtype=np.int64, count=n_dec)
    d_ctx = d_pos + 1
    d_nb = (d_ctx + bs - 1) // bs
    width = int(d_nb.max()) if n_dec else 0
    if not n_dec:
        d_tables = np.zeros((0, 0), np.int32)
    elif rows is not None:
        idx = rows.rows(chunks, dec)  # first: it may grow (replace) rows.table
        d_tables = rows.table[idx, :width]
    else:
        d_tables = _padded([chunks[i].block_table for i in dec], width).astype(np.int32)
    d_slots = d_tables[np.arange(n_dec), d_pos // bs].astype(np.int64) * bs + d_pos % bs
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
        windowed = sliding_window is not None and total > sliding_window
        if (start > 0 or windowed) and torch_views:
            seg.block_ids = torch.from_numpy(bt) if start > 0 else None
            keys, queries = torch.arange(total)[None, :], torch.arange(start, total)[:, None]
            allowed = keys <= queries
            if windowed:
                allowed &= keys > queries - sliding_window
            seg.mask = _additive(allowed if start > 0 else allowed[:, start:], mask_dtype)
        segments.append(seg)
        p_tables.append(table)
        p_ctx.append(start)
        offset += n
        p_start_loc.append(offset)

    sample_chunk_ids = [i for i, c in enumerate(chunks) if c.sample]
    if pre:
        dec_row = {ci: r for r, ci in enumerate(dec)}
        seg_of = dict(zip(pre, segments))
        logits_rows = [dec_row[ci] if ci in dec_row else seg_of[ci].start + seg_of[ci].query_len - 1
                       for ci in sample_chunk_ids]
    else:  # decode-only: row of chunk ci is its rank in ``dec``
        rank = np.empty(len(chunks), dtype=np.int64)
        rank[np.asarray(dec, dtype=np.int64)] = np.arange(n_dec)
        logits_rows = rank[np.asarray(sample_chunk_ids, dtype=np.int64)]

    p_width = max((len(t) for t in p_tables), default=0)
    i64 = [np.asarray(ids, dtype=np.int64), np.concatenate(pos_parts), np.concatenate(slot_parts),
           np.asarray(logits_rows, dtype=np.int64)]
    p_ctx_a = np.asarray(p_ctx, dtype=np.int32)
    i32 = [d_tables, d_ctx.astype(np.int32), np.asarray(p_start_loc, dtype=np.int32), p_ctx_a,
           _padded(p_tables, p_width).astype(np.int32), p_ctx_a + np.diff(np.asarray(p_start_loc, dtype=np.int32))]
    if tile_map and pre:
        i32.append(build_prefill_tiles([s.query_len for s in segments], PREFILL_BLOCK_M))
    (input_ids, positions, slots, logits_idx), (d_tab, d_ctx_t, p_qsl, p_ctx_t, p_tab, p_len, *tiles) = \
        _tensors(i64, i32, device)
    groups: list[DecodeGroup] = []
    if torch_views:
        d_long = torch.from_numpy(d_tables.astype(np.int64))
        groups = _decode_groups(d_nb, torch.from_numpy(d_ctx), d_long, bs, mask_dtype, sliding_window)
        if device.type != "cpu":
            groups = [DecodeGroup(g.start, g.end, _mv(g.block_tables, device), _mv(g.mask, device)) for g in groups]
            segments = [PrefillSegment(s.start, s.query_len, s.context_len,
                                       None if s.block_ids is None else _mv(s.block_ids, device),
                                       None if s.mask is None else _mv(s.mask, device)) for s in segments]
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=n_dec, decode_block_tables=d_tab, decode_context_lens=d_ctx_t,
        prefill_query_start_loc=p_qsl, prefill_context_lens=p_ctx_t, prefill_block_tables=p_tab,
        decode_groups=groups, prefills=segments, prefill_seq_lens=p_len, prefill_tiles=tiles[0] if tiles else None)
    return InputBatch(input_ids=input_ids, positions=positions, attn_meta=meta, logits_indices=logits_idx,
                      sample_chunk_ids=sample_chunk_ids, decode_chunk_ids=dec)


def _mv(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


def _tensors(i64: list[np.ndarray], i32: list[np.ndarray], device: torch.device):
    """numpy arrays -> tensors on ``device`` (keeping each array's shape). On an accelerator each dtype group is
    packed into one pinned host buffer and copied in one asynchronous transfer (pinned, so the copy never waits
    for the GPU work in flight), then split into views."""
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in i64], [torch.from_numpy(a) for a in i32]
    return _packed(i64, torch.int64, device), _packed(i32, torch.int32, device)


#: every packed view starts on a 16-byte boundary. Triton specialises each kernel on its pointers' 16-byte
#: alignment, so views at offsets that follow the step's sizes made new kernel variants appear mid-run, each a
#: compile of up to ~1.4 s on a cold cache (H200, docs/gpu_notes.md, run 12)
PACK_ALIGN_BYTES = 16


def packed_offsets(sizes: list[int], itemsize: int) -> tuple[list[int], int]:
    """Element offset of each array in the packed buffer (each aligned to ``PACK_ALIGN_BYTES``) and its length."""
    step = max(1, PACK_ALIGN_BYTES // itemsize)
    offsets, o = [], 0
    for n in sizes:
        offsets.append(o)
        o += -(-n // step) * step
    return offsets, o


def _packed(arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device,
            pin: bool = True) -> list[torch.Tensor]:
    sizes = [a.size for a in arrays]
    offsets, total = packed_offsets(sizes, dtype.itemsize)
    host = torch.empty(max(1, total), dtype=dtype, pin_memory=pin)
    flat = host.numpy()
    for a, o, n in zip(arrays, offsets, sizes):
        flat[o:o + n] = a.reshape(-1)
    dev = host.to(device, non_blocking=True)
    return [dev[o:o + n].view(a.shape) for a, o, n in zip(arrays, offsets, sizes)]
