"""What one request cost, for the cost-per-1k-output-tokens metric operators compare engines by.

A backend's GPU time is shared by the requests in flight on it: over any interval with ``n`` requests running,
each is charged ``1/n`` of the interval. The meter keeps a virtual clock ``V(t) = ∫ dt / n(t)`` (as fair queueing
does), so a request's share is ``V(leave) - V(enter)``, O(1) per event. Cost = share × price per second.
"""
from __future__ import annotations

import time


class CostMeter:
    def __init__(self, gpu_cost_per_hour: float | None) -> None:
        self.price_per_s = None if gpu_cost_per_hour is None else gpu_cost_per_hour / 3600.0
        self._n = 0
        self._v = 0.0
        self._t = time.perf_counter()

    def _advance(self) -> float:
        now = time.perf_counter()
        if self._n:
            self._v += (now - self._t) / self._n
        self._t = now
        return self._v

    def enter(self) -> float:
        v = self._advance()
        self._n += 1
        return v

    def leave(self, entered: float) -> float:
        """GPU-seconds charged to the request that entered at virtual time ``entered``."""
        v = self._advance()
        self._n -= 1
        return v - entered

    def cost_per_1k(self, gpu_seconds: float, output_tokens: int) -> float | None:
        if self.price_per_s is None or output_tokens <= 0:
            return None
        return self.price_per_s * gpu_seconds * 1000.0 / output_tokens
