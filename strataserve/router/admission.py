"""Admission control at the door: refuse (429 + Retry-After) a request that the queue ahead would make miss its
class's time-to-first-token target, instead of letting it wait and time out.

Model: a request's TTFT is proportional to the work ahead of it plus its own (prompt tokens still to prefill for
local engines; outstanding requests for upstream servers), counting only requests of equal or higher priority
(lower value), since the engine serves those first and preempts lower classes for them. The seconds per unit of
work are learnt online: each first token gives a sample ``ttft / work_at_admission``, smoothed (EWMA). Until a few
samples exist, or when nothing is ahead, everything is admitted: an idle server never refuses.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from strataserve.api.errors import APIError

MIN_SAMPLES = 4
ALPHA = 0.2  # EWMA weight of a new sample


@dataclass
class Ticket:
    """One admitted request, until its first token."""

    priority: int
    work: float
    work_ahead: float
    admitted_at: float = field(default_factory=time.perf_counter)
    done: bool = False


class AdmissionController:
    def __init__(self, model: str) -> None:
        self.model = model
        self._pending: list[Ticket] = []  # admitted, first token not yet seen
        self.seconds_per_work: float | None = None
        self.samples = 0
        self.rejected = 0

    def work_ahead(self, priority: int) -> float:
        return sum(t.work for t in self._pending if t.priority <= priority)

    def estimate_ttft_s(self, priority: int, work: float) -> float | None:
        if self.seconds_per_work is None or self.samples < MIN_SAMPLES:
            return None
        return self.seconds_per_work * (self.work_ahead(priority) + work)

    def admit(self, priority: int, work: float, ttft_ms: float | None) -> Ticket:
        """Admit or raise 429. Call ``first_token`` / ``release`` on the returned ticket."""
        self.check(priority, work, ttft_ms)
        return self.enter(priority, work)

    def check(self, priority: int, work: float, ttft_ms: float | None) -> None:
        """Raise 429 (with Retry-After) when the queue ahead would make this request miss ``ttft_ms``."""
        ahead = self.work_ahead(priority)
        if ttft_ms is not None and ahead > 0:
            est = self.estimate_ttft_s(priority, work)
            target = ttft_ms / 1000.0
            if est is not None and est > target:
                self.rejected += 1
                wait = max(1, math.ceil(est - target))
                raise APIError(429, f"model `{self.model}` cannot meet this SLA class's time to first token "
                               f"({ttft_ms:.0f} ms): the queue ahead needs about {est * 1000:.0f} ms; retry in "
                               f"{wait} s or use a class with a looser target", code="sla_ttft_unreachable",
                               type="rate_limit_error", headers={"Retry-After": str(wait)})

    def enter(self, priority: int, work: float) -> Ticket:
        """Count an admitted request as queued until its first token."""
        ticket = Ticket(priority, max(work, 1.0), self.work_ahead(priority))
        self._pending.append(ticket)
        return ticket

    def first_token(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        ttft = time.perf_counter() - ticket.admitted_at
        sample = ttft / (ticket.work_ahead + ticket.work)
        s = self.seconds_per_work
        self.seconds_per_work = sample if s is None else (1 - ALPHA) * s + ALPHA * sample
        self.samples += 1
        self.release(ticket)

    def release(self, ticket: Ticket) -> None:
        """The request left the queue (first token, error or abort); safe to call twice."""
        if not ticket.done:
            ticket.done = True
            self._pending.remove(ticket)
