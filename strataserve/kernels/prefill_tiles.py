"""The prefill-attention kernel's tile map, built on the host (no triton import: the input batch builder uses it).

A tile is one (segment, query block) program of ``prefill_attention`` (``kernels/prefill_attention.py``): with a
map the launch grid is the map's length, not a function of the step's longest segment, so one CUDA graph serves
any mix of prefill chunks that fits its map.
"""
from __future__ import annotations

import numpy as np

#: the query rows per program of the runner's launches (a tile map must be built with the same value)
PREFILL_BLOCK_M = 64


def build_prefill_tiles(q_lens: list[int], block_m: int, out: np.ndarray | None = None) -> np.ndarray:
    """The tile map of segments with ``q_lens`` query tokens: one (segment, query block) row per BLOCK_M queries,
    the last query blocks (most keys, under the causal mask) first so the longest programs start early. ``out``
    (int32 [n, 2]): written in place, the unused rows set to (-1, 0); it must have room for every tile."""
    rows = [(s, mb) for s, n in enumerate(q_lens) for mb in range(-(-n // block_m))]
    rows.sort(key=lambda r: -r[1])
    if out is None:
        out = np.empty((len(rows), 2), dtype=np.int32)
    if len(rows) > out.shape[0]:
        raise ValueError(f"{len(rows)} prefill tiles do not fit a map of {out.shape[0]}")
    if rows:
        out[:len(rows)] = rows
    out[len(rows):] = (-1, 0)
    return out
