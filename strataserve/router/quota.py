"""Per-key rate limits: requests per minute and tokens per minute, each a token bucket per API key.

A bucket holds up to one minute's allowance and refills continuously, so a key may burst its whole minute at
once and then runs at the steady rate. Tokens are charged at admission as prompt tokens plus the most the
request may generate (``n`` x ``max_tokens``), the estimate OpenAI-style gateways use, because the real count is
only known after the answer has been sent. Requests without a key share one anonymous bucket.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from strataserve.api.errors import APIError


@dataclass(frozen=True)
class RateLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}={v}: must be >= 1 (leave it unset for no limit)")


class _Bucket:
    __slots__ = ("level", "stamp")

    def __init__(self, level: float, stamp: float) -> None:
        self.level, self.stamp = level, stamp


class KeyQuota:
    def __init__(self, limits: RateLimits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or RateLimits()
        self._clock = clock
        self._buckets: dict[tuple[str, str | None], _Bucket] = {}

    @property
    def enabled(self) -> bool:
        return self.limits.requests_per_minute is not None or self.limits.tokens_per_minute is not None

    def take_request(self, key: str | None) -> None:
        """Charge one request to ``key``; 429 with Retry-After when its requests-per-minute are spent."""
        if self.limits.requests_per_minute is not None:
            self._take("requests", key, 1.0, self.limits.requests_per_minute)

    def take_tokens(self, key: str | None, tokens: float) -> None:
        """Charge ``tokens`` to ``key``; 429 with Retry-After when its tokens-per-minute are spent, 400 when one
        request alone needs more than a minute's allowance (it could never be served)."""
        per_min = self.limits.tokens_per_minute
        if per_min is None:
            return
        if tokens > per_min:
            raise APIError(400, f"this request may use {tokens:.0f} tokens (prompt + n x max_tokens), more than "
                           f"this API key's limit of {per_min} tokens per minute: lower max_tokens or n",
                           param="max_tokens", code="tokens_per_minute_exceeded")
        self._take("tokens", key, tokens, per_min)

    def _take(self, kind: str, key: str | None, cost: float, per_min: int) -> None:
        now = self._clock()
        rate = per_min / 60.0
        b = self._buckets.get((kind, key))
        if b is None:
            b = self._buckets[(kind, key)] = _Bucket(float(per_min), now)
        b.level = min(float(per_min), b.level + (now - b.stamp) * rate)
        b.stamp = now
        if b.level < cost:
            wait = max(1, math.ceil((cost - b.level) / rate))
            raise APIError(429, f"rate limit reached for this API key: {per_min} {kind} per minute; retry in "
                           f"{wait} s", code=f"{kind}_per_minute_exceeded", type="rate_limit_error",
                           headers={"Retry-After": str(wait)})
        b.level -= cost
