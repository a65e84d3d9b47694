"""What every upstream backend shares: its replicas, a pooled HTTP session, and the health-check loop."""
from __future__ import annotations

import aiohttp

from strataserve.router.replicas import Replica, ReplicaSet
from strataserve.router.types import Backend


class UpstreamBackend(Backend):
    upstream = True
    health_path = "/health"  # GET; 200 means ready

    def __init__(self, name: str, urls: list[str], *, gpu_cost_per_hour: float | None, connect_timeout_s: float,
                 health_interval_s: float, affinity_chars: int = 0, slack: int = 2) -> None:
        super().__init__(name, gpu_cost_per_hour)
        self.replicas = ReplicaSet(name, urls, affinity_chars=affinity_chars, slack=slack)
        self.connect_timeout_s = connect_timeout_s
        self.health_interval_s = health_interval_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No per-host cap: concurrency is the clients', and the upstream does its own admission.
            # Bodies are asked for uncompressed (they are relayed, renamed and counted as text), and decoded
            # should an upstream (a proxy's gzip) compress them anyway.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                                                  headers={"Accept-Encoding": "identity"})
        return self._session

    async def start(self) -> None:
        self.replicas.start(self._probe, self.health_interval_s)

    async def stop(self) -> None:
        await self.replicas.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _probe(self, r: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.connect_timeout_s))
        async with self.session.get(r.url + self.health_path, timeout=timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.health_path} answered {resp.status}")

    def ready(self) -> bool:
        return bool(self.replicas.healthy())

    def listing(self, remote_name: str) -> dict:
        """The card's extra fields: the upstream's own name for the model, and each replica's health and load."""
        return {"upstream_model": remote_name,
                "replicas": [{"url": r.url, "healthy": r.healthy, "outstanding": r.outstanding}
                             for r in self.replicas.replicas]}

    def unavailable_reason(self) -> str:
        return "" if self.ready() else self.replicas.unavailable_message()
