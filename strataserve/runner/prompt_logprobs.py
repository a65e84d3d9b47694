"""Prompt logprobs (``SamplingParams.prompt_logprobs``, the completions API's ``echo`` with ``logprobs``): for
each prompt position p > 0, the logprob (rank, top N) of prompt token p given tokens [0, p).

They come from the same forward pass as the step's KV writes: a prefill chunk covering positions [s, s + L)
yields the predictions for targets s + 1 .. min(s + L, n_prompt - 1), read from the chunk's own hidden rows, so
chunked prefill delivers them chunk by chunk. The scheduler never serves such a request from the prefix cache
(cached positions would have no hidden states), and it resumes a preempted one where its list stops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from strataserve.types.outputs import ScheduledChunk, TokenLogprobs
from strataserve.runner.input_batch import InputBatch
from strataserve.runner.sampler import SamplingRequest, token_logprobs


@dataclass(slots=True)
class PromptRows:
    """Which flat rows' logits the prompt logprobs need, and what they describe."""

    flat_rows: torch.Tensor  # long [R] on the batch's device
    targets: torch.Tensor  # long [R]: the prompt token each row predicts
    top_ns: list[int]  # [R]
    spans: list[tuple[str, int, int]]  # (request id, first target position - 1, number of rows), in row order


def prompt_rows(chunks: Sequence[ScheduledChunk], batch: InputBatch,
                requests: dict[str, SamplingRequest]) -> PromptRows | None:
    """The rows of this step that produce prompt logprobs, or None (the usual case: nothing asked)."""
    if not any(requests[c.req_id].params.prompt_logprobs is not None for c in chunks):
        return None
    flat_start: dict[int, int] = {ci: r for r, ci in enumerate(batch.decode_chunk_ids)}
    prefill_ids = [i for i, c in enumerate(chunks) if len(c.token_ids) != 1]  # as build_input_batch orders them
    for ci, seg in zip(prefill_ids, batch.attn_meta.prefills):
        flat_start[ci] = seg.start
    rows: list[int] = []
    targets: list[int] = []
    top_ns: list[int] = []
    spans: list[tuple[str, int, int]] = []
    for ci, c in enumerate(chunks):
        req = requests[c.req_id]
        n = req.params.prompt_logprobs
        last = len(req.prompt_token_ids) - 1  # positions [0, last) predict prompt tokens 1 .. last
        end = min(c.start_pos + len(c.token_ids), last)
        if n is None or c.start_pos >= end:
            continue
        count = end - c.start_pos
        base = flat_start[ci]
        rows.extend(range(base, base + count))
        targets.extend(req.prompt_token_ids[c.start_pos + 1:end + 1])
        top_ns.extend([n] * count)
        spans.append((c.req_id, c.start_pos, count))
    if not rows:
        return None
    dev = batch.input_ids.device
    return PromptRows(torch.tensor(rows, dtype=torch.long, device=dev),
                      torch.tensor(targets, dtype=torch.long, device=dev), top_ns, spans)


def prompt_logprobs(logits: torch.Tensor, rows: PromptRows) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """{request id: (position of its first entry's context end, logprobs)} from float logits [R, V] of ``rows``:
    entry k of a request whose span starts at s is the logprob of prompt token s + 1 + k."""
    lps = token_logprobs(logits, rows.targets, rows.top_ns)
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    k = 0
    for rid, start, count in rows.spans:
        out[rid] = (start, lps[k:k + count])  # type: ignore[assignment]
        k += count
    return out
