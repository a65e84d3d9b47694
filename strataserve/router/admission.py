"""Admission control at the door: refuse (429 + Retry-After) a request that the queue ahead would make miss its
class's time-to-first-token target, instead of letting it wait and time out.

Model: a request's TTFT is the wait for an engine slot plus the prefill queue ahead of it, counting only requests
of equal or higher priority (lower value), since the engine serves those first and preempts lower classes for them.

- Prefill queue: proportional to the work ahead plus its own (prompt tokens still to prefill for local engines;
  outstanding requests for upstream servers). The seconds per unit of work are learnt online: each first token of
  a request that found a free slot gives a sample ``ttft / work_at_admission``, smoothed (EWMA).
- Slots (local engines, ``slots`` = the engines' ``max_num_seqs``): when the sequences already admitted fill them,
  the request waits until enough running ones finish. A running request's rest is its output budget
  (``max_tokens``) less what it has made, at a decode pace learnt the same way (seconds per token per sequence).

Until a few samples exist, or when nothing is ahead and a slot is free, everything is admitted: an idle server
never refuses.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from strataserve.api.errors import APIError

MIN_SAMPLES = 4
ALPHA = 0.2  # EWMA weight of a new sample


@dataclass(eq=False)
class Ticket:
    """One admitted request, until it ends (``release``); queued for prefill until its first token."""

    priority: int
    work: float
    work_ahead: float
    seqs: int = 1  # sequences it runs (n x prompts): the engine slots it holds
    budget: float | None = None  # most output tokens per sequence (max_tokens); None: unknown
    slot_wait: bool = False  # admitted while the slots were full: its TTFT says nothing of the prefill pace
    generated: int = 0
    admitted_at: float = field(default_factory=time.perf_counter)
    started: bool = False
    done: bool = False

    def rest_tokens(self) -> float:
        """Output tokens each of its sequences may still make."""
        if self.budget is None:
            return math.inf
        return max(1.0, self.budget - self.generated / self.seqs)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - ALPHA) * old + ALPHA * sample


class AdmissionController:
    def __init__(self, model: str, slots: int | None = None) -> None:
        self.model = model
        self.slots = slots  # sequences the engine(s) run at once; None: not modelled (upstream servers)
        self._pending: list[Ticket] = []  # admitted, first token not yet seen
        self._live: list[Ticket] = []  # admitted, not yet ended (slot holders)
        self.seconds_per_work: float | None = None
        self.samples = 0
        self.seconds_per_token: float | None = None  # decode pace of one sequence
        self.token_samples = 0
        self.rejected = 0

    def work_ahead(self, priority: int) -> float:
        return sum(t.work for t in self._pending if t.priority <= priority)

    def slot_wait_s(self, priority: int, seqs: int = 1) -> float | None:
        """Seconds until ``seqs`` slots free up for this priority (0: free now); None when unknown."""
        if self.slots is None:
            return 0.0
        holders = [t for t in self._live if t.priority <= priority]
        free = self.slots - sum(t.seqs for t in holders)
        need = min(seqs, self.slots) - free
        if need <= 0:
            return 0.0
        if self.seconds_per_token is None or self.token_samples < MIN_SAMPLES:
            return None
        freed = 0
        for t in sorted(holders, key=Ticket.rest_tokens):  # one not yet started holds its whole budget
            freed += t.seqs
            if freed >= need:
                return t.rest_tokens() * self.seconds_per_token
        return None  # unreachable: the holders fill the slots

    def estimate_ttft_s(self, priority: int, work: float, seqs: int = 1) -> float | None:
        wait = self.slot_wait_s(priority, seqs)
        ahead = self.work_ahead(priority)
        prefill = None
        if self.seconds_per_work is not None and self.samples >= MIN_SAMPLES:
            prefill = self.seconds_per_work * (ahead + work)
        if not wait and (ahead == 0 or prefill is None):
            return None  # a free slot and nothing ahead (or no pace learnt yet): admit
        return (wait or 0.0) + (prefill or 0.0)

    def admit(self, priority: int, work: float, ttft_ms: float | None, seqs: int = 1,
              budget: float | None = None) -> Ticket:
        """Admit or raise 429. Call ``first_token`` / ``release`` on the returned ticket."""
        self.check(priority, work, ttft_ms, seqs)
        return self.enter(priority, work, seqs, budget)

    def check(self, priority: int, work: float, ttft_ms: float | None, seqs: int = 1) -> None:
        """Raise 429 (with Retry-After) when the slots held and the queue ahead would make this request miss
        ``ttft_ms``."""
        if ttft_ms is None:
            return
        est = self.estimate_ttft_s(priority, work, seqs)
        target = ttft_ms / 1000.0
        if est is not None and est > target:
            self.rejected += 1
            wait = max(1, math.ceil(est - target))
            raise APIError(429, f"model `{self.model}` cannot meet this SLA class's time to first token "
                           f"({ttft_ms:.0f} ms): the requests ahead need about {est * 1000:.0f} ms; retry in "
                           f"{wait} s or use a class with a looser target", code="sla_ttft_unreachable",
                           type="rate_limit_error", headers={"Retry-After": str(wait)})

    def enter(self, priority: int, work: float, seqs: int = 1, budget: float | None = None) -> Ticket:
        """Count an admitted request: queued until its first token, holding its slots until released."""
        ticket = Ticket(priority, max(work, 1.0), self.work_ahead(priority), max(1, seqs), budget,
                        slot_wait=bool(self.slot_wait_s(priority, seqs)))
        self._pending.append(ticket)
        self._live.append(ticket)
        return ticket

    def first_token(self, ticket: Ticket) -> None:
        if ticket.started or ticket.done:
            return
        ticket.started = True
        if not ticket.slot_wait:
            ttft = time.perf_counter() - ticket.admitted_at
            self.seconds_per_work = _ewma(self.seconds_per_work, ttft / (ticket.work_ahead + ticket.work))
            self.samples += 1
        self._pending.remove(ticket)

    def on_tokens(self, ticket: Ticket, n: int, seconds: float | None = None) -> None:
        """``n`` more output tokens of ``ticket``; ``seconds`` since its previous ones (a decode-pace sample)."""
        ticket.generated += n
        if seconds is not None and seconds > 0 and n > 0:
            self.seconds_per_token = _ewma(self.seconds_per_token, seconds * ticket.seqs / n)
            self.token_samples += 1

    def release(self, ticket: Ticket) -> None:
        """The request ended (finished, error or abort); safe to call twice."""
        if ticket.done:
            return
        ticket.done = True
        if not ticket.started:
            self._pending.remove(ticket)
        self._live.remove(ticket)
