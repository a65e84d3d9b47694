"""Refusals of the per-key rate limits (``--requests-per-minute``, ``--tokens-per-minute``) in ``/metrics``.

The requests-per-minute check runs at the door (HTTP middleware, gRPC interceptor), before the body is read: the
request names no model yet, so it cannot be counted in ``strata:router_requests_total``, which is labelled by
model. The quota itself counts what it refuses instead, by limit (``kind``) and by the SLA class of the API key
(a bounded label that says which tenant is throttled; the key itself is a secret and never a label). A refused
tokens-per-minute request is counted here and, since the router knows its model by then, also in
``strata:router_requests_total{outcome="rejected"}``.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from strataserve.api.errors import APIError
from strataserve.router.quota import KeyQuota, RateLimits
from strataserve.router.sla import SLAPolicy

REQUESTS, TOKENS = "requests_per_minute", "tokens_per_minute"


class CountingQuota(KeyQuota, Collector):
    """A ``KeyQuota`` that counts its 429s as ``strata:rate_limited_requests_total{kind, sla_class}``, the class
    being the one ``policy`` gives the API key (the header is not read yet at the door)."""

    def __init__(self, limits: RateLimits | None, registry: CollectorRegistry | None,
                 policy: SLAPolicy | None = None) -> None:
        super().__init__(limits)
        self._policy = policy or SLAPolicy.single()
        kinds = [k for k, v in ((REQUESTS, self.limits.requests_per_minute), (TOKENS, self.limits.tokens_per_minute))
                 if v is not None]
        # every series from the start at 0, so rate() and alerts work before the first refusal
        self.refused: dict[tuple[str, str], int] = {(k, c): 0 for k in kinds for c in self._policy.names()}
        if registry is not None:
            registry.register(self)

    def take_request(self, key: str | None) -> None:
        with self._counting(REQUESTS, key):
            super().take_request(key)

    def take_tokens(self, key: str | None, tokens: float) -> None:
        with self._counting(TOKENS, key):
            super().take_tokens(key, tokens)

    @contextlib.contextmanager
    def _counting(self, kind: str, key: str | None) -> Iterator[None]:
        try:
            yield
        except APIError as err:
            if err.status == 429:  # a 400 (one request over a whole minute's allowance) is no rate limit
                label = (kind, self._policy.resolve(None, key).name)
                self.refused[label] = self.refused.get(label, 0) + 1
            raise

    def collect(self) -> Iterable[Metric]:
        if not self.enabled:
            return []
        fam = CounterMetricFamily("strata:rate_limited_requests", "Requests refused with 429 by a per-key rate "
                                  "limit, by limit and by the API key's SLA class.", labels=["kind", "sla_class"])
        for (kind, sla_class), n in sorted(self.refused.items()):
            fam.add_metric([kind, sla_class], n)
        return [fam]
