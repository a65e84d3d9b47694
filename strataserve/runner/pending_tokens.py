"""Async scheduling's placeholders: step N+1 is queued before step N's tokens reach the host, so its decode chunks
carry token ids < 0 and the tokens are taken on the device from the previous launch's token tensor (``last``:
that tensor and each request's row in it).
"""
from __future__ import annotations

import torch

from strataserve.runner.input_batch import InputBatch

LastLaunch = tuple[torch.Tensor, dict[str, int]]


def fill_placeholders(batch: InputBatch, chunks, last: LastLaunch | None, device: torch.device) -> None:
    """Replace the placeholder ids (< 0) of decode rows with the previous launch's sampled tokens."""
    dst, src = [], []
    row_of = last[1] if last is not None else {}
    for r, ci in enumerate(batch.decode_chunk_ids):
        c = chunks[ci]
        if c.token_ids[0] < 0:
            if c.req_id not in row_of:
                raise RuntimeError(f"{c.req_id}: its token is pending but the previous step did not sample it")
            dst.append(r)
            src.append(row_of[c.req_id])
    if dst:
        assert last is not None
        idx = torch.tensor(dst + src, dtype=torch.long)
        if device.type == "cuda":
            idx = idx.pin_memory().to(device, non_blocking=True)
        n = len(dst)
        batch.input_ids.index_copy_(0, idx[:n], last[0].index_select(0, idx[n:]))
