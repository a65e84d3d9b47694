"""Logit penalties, token bans and biases applied before sampling, vectorised over the rows that use them.

Formulas (logits ``x`` of one row, vocabulary id ``t``):

- repetition (HF ``RepetitionPenaltyLogitsProcessor``): for every ``t`` present in prompt + generated tokens,
  ``x[t] = x[t] / r`` if ``x[t] > 0`` else ``x[t] * r``;
- frequency / presence (OpenAI): ``x[t] -= f * count_gen(t) + p * (count_gen(t) > 0)`` over generated tokens only.

Repetition is applied first, then frequency/presence, as vLLM does. ``apply_penalties`` works on the (row, token)
pairs that occur (cheap on CPU, but ``torch.unique`` waits for the device); ``apply_penalties_counts`` reads
per-row counts kept on the device (``runner/token_history.py``, async scheduling) and never syncs.
"""
from __future__ import annotations

from itertools import chain
from typing import Iterable, Sequence

import torch

from strataserve.runner.sampling_filters import to_device


def _flat_keys(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Flat indices ``row * vocab + token`` of every (row, token) occurrence; ids outside the vocabulary dropped."""
    ids = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(r) for r in rows], dtype=torch.int64))
    keep = (ids >= 0) & (ids < vocab)
    return (row[keep] * vocab + ids[keep]).to(device, non_blocking=True)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: Sequence[float],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> None:
    """Penalise contiguous ``logits`` [R, V] in place; row i uses prompt_ids[i], output_ids[i], the i-th penalties.

    Works on the (row, token) pairs that occur - O(tokens), not O(R * V) - which matters for 150k vocabularies.
    """
    vocab = logits.shape[1]
    dev = logits.device
    flat = logits.view(-1)
    out_keys = _flat_keys(output_ids, vocab, dev)
    if any(r != 1.0 for r in repetition):
        rep = to_device(repetition, torch.float32, dev)
        seen = torch.unique(torch.cat([_flat_keys(prompt_ids, vocab, dev), out_keys]))
        vals = flat[seen]
        r = rep[seen // vocab]
        flat[seen] = torch.where(vals > 0, vals / r, vals * r)
    if any(f != 0.0 for f in frequency) or any(p != 0.0 for p in presence):
        keys, counts = torch.unique(out_keys, return_counts=True)
        row = keys // vocab
        freq = to_device(frequency, torch.float32, dev)[row]
        pres = to_device(presence, torch.float32, dev)[row]
        flat[keys] -= counts.to(torch.float32) * freq + pres


def apply_penalties_counts(
    logits: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
    repetition: Sequence[float],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> None:
    """``apply_penalties`` from dense per-row state on the device (``runner/token_history.py``): ``counts`` [R, V]
    how often each id was output, ``seen`` [R, V] whether it occurs in the prompt or the output. No host sync."""
    dev = logits.device
    if any(r != 1.0 for r in repetition):
        rep = to_device(repetition, torch.float32, dev).unsqueeze(1)
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits))
    if any(f != 0.0 for f in frequency) or any(p != 0.0 for p in presence):
        freq = to_device(frequency, torch.float32, dev).unsqueeze(1)
        pres = to_device(presence, torch.float32, dev).unsqueeze(1)
        logits -= counts * freq + (counts > 0).to(torch.float32) * pres


def _put(logits: torch.Tensor, rows: Sequence[int], per_row: Iterable[Iterable[tuple[int, float]]],
         accumulate: bool) -> None:
    """``logits[rows[i], t] = v`` (or ``+= v``) for each (t, v) of ``per_row[i]``; ids outside the vocabulary are
    skipped. One indexed write for all rows."""
    vocab = logits.shape[1]
    r_idx: list[int] = []
    t_idx: list[int] = []
    vals: list[float] = []
    for r, pairs in zip(rows, per_row):
        for t, v in pairs:
            if 0 <= t < vocab:
                r_idx.append(r)
                t_idx.append(t)
                vals.append(v)
    if r_idx:
        dev = logits.device
        logits.index_put_((to_device(r_idx, torch.int64, dev), to_device(t_idx, torch.int64, dev)),
                          to_device(vals, logits.dtype, dev), accumulate=accumulate)


def ban_tokens(logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[Sequence[int]]) -> None:
    """Set ``logits[rows[i], t] = -inf`` for every t in token_ids[i] (ids outside the vocabulary are skipped)."""
    _put(logits, rows, (((t, float("-inf")) for t in ids) for ids in token_ids), accumulate=False)


def add_bias(logits: torch.Tensor, rows: Sequence[int], biases: Sequence[dict[int, float]]) -> None:
    """``logits[rows[i], t] += biases[i][t]`` (OpenAI's ``logit_bias``; ids outside the vocabulary are skipped)."""
    _put(logits, rows, (b.items() for b in biases), accumulate=True)
