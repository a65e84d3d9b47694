"""Replicas of one model (upstream servers, or local engine cores: ``local_replicas.py``): least-outstanding
choice with prefix affinity, and health tracking.

Choice: among healthy replicas, the one with the fewest requests in flight; but when the request has a long
enough prompt prefix, the replica that prefix hashes to (rendezvous hashing, stable as replicas come and go) is
taken as long as it has at most ``slack`` more requests in flight than the least loaded one. Requests sharing a
system prompt or a document thus land where that prefix is already cached (SGLang's cache-aware routing, with a
hash instead of a per-replica radix tree), and load still wins when it is uneven.

Health: a replica is marked down by a failed probe or a connection error on a request, and up again by the next
good probe. The probe loop runs for as long as the set is started.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import xxhash

log = logging.getLogger("strataserve.router")


@dataclass
class Replica:
    url: str
    healthy: bool = True
    outstanding: int = 0
    last_error: str | None = None
    down_since: float | None = None
    served: int = 0
    failures: int = 0
    key: int = field(default=0)

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            log.warning("replica %s is down: %s", self.url, reason)
        self.healthy = False
        self.last_error = reason
        self.down_since = self.down_since or time.monotonic()
        self.failures += 1

    def mark_up(self) -> None:
        if not self.healthy:
            log.warning("replica %s is back", self.url)
        self.healthy = True
        self.down_since = None


Probe = Callable[[Replica], Awaitable[None]]  # raises when the replica is not ready


class ReplicaSet:
    def __init__(self, model: str, urls: list[str], *, affinity_chars: int = 256, slack: int = 2) -> None:
        self.model = model
        self.replicas = [Replica(u, key=xxhash.xxh64_intdigest(u.encode())) for u in urls]
        self.affinity_chars = affinity_chars
        self.slack = slack
        self._task: asyncio.Task | None = None

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def choose(self, prefix: str | bytes | None = None, exclude: tuple[Replica, ...] = ()) -> Replica | None:
        """The replica for a request, or None when every replica (not excluded) is down. ``prefix``: the prompt's
        text, or its leading token ids as bytes (already cut to the affinity length)."""
        live = [r for r in self.replicas if r.healthy and r not in exclude]
        if not live:
            return None
        least = min(live, key=lambda r: r.outstanding)
        if prefix and self.affinity_chars and len(live) > 1 and len(prefix) >= min(64, self.affinity_chars):
            data = prefix if isinstance(prefix, bytes) else prefix[: self.affinity_chars].encode()
            h = xxhash.xxh64_intdigest(data)
            affine = max(live, key=lambda r: xxhash.xxh64_intdigest(h.to_bytes(8, "little"), seed=r.key & 0xFFFFFFFF))
            if affine.outstanding <= least.outstanding + self.slack:
                return affine
        return least

    def unavailable_message(self) -> str:
        errs = "; ".join(f"{r.url}: {r.last_error or 'down'}" for r in self.replicas)
        n = len(self.replicas)
        return (f"model `{self.model}` is unavailable: {'its upstream is' if n == 1 else f'all {n} upstream replicas are'}"
                f" down ({errs}); retry shortly")

    # ------------------------------------------------------------------ health
    def start(self, probe: Probe, interval_s: float) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop(probe, interval_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def probe_all(self, probe: Probe) -> None:
        async def one(r: Replica) -> None:
            try:
                await probe(r)
            except Exception as exc:  # noqa: BLE001 -- any failure of a probe means "not ready"
                r.mark_down(f"health check failed: {type(exc).__name__}: {exc}".rstrip(": "))
            else:
                r.mark_up()

        await asyncio.gather(*(one(r) for r in self.replicas))

    async def _loop(self, probe: Probe, interval_s: float) -> None:
        while True:
            await self.probe_all(probe)
            await asyncio.sleep(interval_s)
