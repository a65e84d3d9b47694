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
            # auto_decompress off: bodies are relayed as the upstream encoded them.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                                                  auto_decompress=False)
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

    def unavailable_reason(self) -> str:
        return "" if self.ready() else self.replicas.unavailable_message()
