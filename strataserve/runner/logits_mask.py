"""Apply a grammar's token bitmask to the logits before sampling (structured outputs).

The bitmask is int32 ``[R, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed
(xgrammar's layout). It is built on the host by the engine's grammar worker while the forward pass runs; here it
is moved to the logits' device in one (pinned, asynchronous) copy, unpacked with shifts and written as -inf over
the forbidden tokens of the constrained rows only, batched across rows with different grammars.
"""
from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return t


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size]: the unpacked bitmask (tokens past the mask's width are forbidden)."""
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1
    allowed = bits.bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: ``logits[rows[j], t] = -inf`` wherever bit t of ``bitmask[j]`` is clear."""
    if not rows:
        return
    if bitmask.shape[0] != len(rows):
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {len(rows)} constrained logits rows")
    dev = logits.device
    if dev.type == "cuda":
        bitmask = bitmask.pin_memory().to(dev, non_blocking=True)
    allowed = allowed_tokens(bitmask, logits.shape[1])
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    logits[idx] = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
