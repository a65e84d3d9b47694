"""Per-request token counts on the device, for the penalties of an async runner.

Why: repetition / frequency / presence penalties read every prompt and output token of a request. Rebuilding that
from the host's lists each step costs host time proportional to all those tokens (~10 ms per step at 256 requests
of ~500 tokens, on the path that should overlap the device), and under async scheduling the host list lacks the
token still in flight. So a penalised request gets one row here when it first samples: its prompt's token set
and its output counts, built once from the host; from then on each sampled token is added on the device right
after sampling, in stream order, so the next step sees it whether or not it has reached the host.

Rows live in one [capacity, vocab] buffer (grown by doubling) and are freed with their ``SamplingRequest``; a
request the scheduler re-sends (preemption) comes back as a new ``SamplingRequest`` and is rebuilt from its lists.
"""
from __future__ import annotations

from itertools import chain
from typing import Sequence

import torch

from strataserve.runner.sampler import SamplingRequest
from strataserve.runner.sampling_filters import to_device


class TokenHistory:
    def __init__(self, vocab: int, device: torch.device, capacity: int = 8) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(capacity, vocab, dtype=torch.float32, device=device)  # output tokens
        self.seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=device)  # prompt or output tokens
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def rows_in_use(self) -> int:
        return self.counts.shape[0] - len(self._free)

    def rows(self, reqs: Sequence[SamplingRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts [R, vocab] float, prompt-or-output seen [R, vocab] bool) of ``reqs``, in order; a
        request seen for the first time gets its row filled from its host lists."""
        slots = [self._slot_of(r) for r in reqs]
        idx = to_device(slots, torch.int64, self.device)
        return self.counts.index_select(0, idx), self.seen.index_select(0, idx)

    def record(self, reqs: Sequence[SamplingRequest], tokens: torch.Tensor) -> None:
        """Add each row's sampled token (``tokens`` [len(reqs)] on the device) to the rows that have one."""
        pick = [j for j, r in enumerate(reqs) if r.history_slot >= 0]
        if not pick:
            return
        rows = to_device([reqs[j].history_slot for j in pick], torch.int64, self.device)
        tok = tokens if len(pick) == len(reqs) else tokens.index_select(0, to_device(pick, torch.int64, self.device))
        tok = tok.clamp(0, self.vocab - 1)  # a NaN row's clamped id is in range already; this only guards indexing
        self.counts.index_put_((rows, tok), torch.ones(len(pick), dtype=torch.float32, device=self.device),
                               accumulate=True)
        self.seen[rows, tok] = torch.ones(len(pick), dtype=torch.bool, device=self.device)

    def release(self, req: SamplingRequest) -> None:
        """Free the request's row (the runner calls it when it drops or replaces the request)."""
        if req.history_slot >= 0:
            self._free.append(req.history_slot)
            req.history_slot = -1

    def _slot_of(self, req: SamplingRequest) -> int:
        if req.history_slot >= 0:
            return req.history_slot
        if not self._free:
            self._grow()
        slot = req.history_slot = self._free.pop()
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        outs = [t for t in req.output_token_ids[:req.position] if 0 <= t < self.vocab]
        ids = [t for t in chain(req.prompt_token_ids, outs) if 0 <= t < self.vocab]
        if ids:
            self.seen[slot, to_device(ids, torch.int64, self.device)] = torch.ones(
                len(ids), dtype=torch.bool, device=self.device)
        if outs:
            self.counts[slot].index_add_(0, to_device(outs, torch.int64, self.device),
                                         torch.ones(len(outs), dtype=torch.float32, device=self.device))
        return slot

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.seen = torch.cat([self.seen, torch.zeros_like(self.seen)])
        self._free.extend(range(2 * old - 1, old - 1, -1))
