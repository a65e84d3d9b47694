"""When a request to an upstream replica is tried again elsewhere, and when a replica leaves the rotation: the
policy of ``OpenAIUpstreamBackend`` (see its module docstring), in the terms of Envoy's ``retry_on`` and outlier
detection.

- Nothing sent (connection refused, connect timeout, DNS / TLS failure; Envoy ``connect-failure``): the replica is
  marked down and the request goes to the next replica, as many times as there are replicas.
- Sent, then no answer (the upstream closed or reset the connection before its response headers; Envoy ``reset``)
  or an answer of 500 / 502 / 503 / 504 before any byte of the body was relayed (Envoy ``5xx`` less 501 / 505,
  which another replica of the same server answers alike): tried once more, on another replica. One retry at most:
  a request that kills its upstream (a "query of death") reaches two replicas, never the whole set. No retry
  after a stream has begun, nor after ``timeout_s`` without an answer (the upstream may still be working on it).
- A single failed request does not take a replica out of rotation for everyone (it may be the request's fault);
  ``CONSECUTIVE_FAILURES`` in a row with no success between do (Envoy's ``consecutive_gateway_failure``, default
  5), until the next good health probe. 503 is deliberate back-pressure (busy, draining), not a fault: retried,
  never counted.
"""
from __future__ import annotations

import aiohttp

from strataserve.router.replicas import Replica

RETRY_STATUSES = frozenset({500, 502, 503, 504})
_FAULT_STATUSES = frozenset({500, 502, 504})  # counted towards ejection
CONSECUTIVE_FAILURES = 5


def nothing_sent(exc: BaseException) -> bool:
    """The connection was never made, so the upstream saw nothing of the request."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def after_connection_error(exc: BaseException, replica: Replica, outliers: "Outliers") -> str:
    """Book a connection error of a request to ``replica``: "next" when nothing was sent (the replica is marked
    down; the next may take the request), "timeout" when no answer came in the read timeout (not retried), else
    "dropped" (sent, then the connection closed: counted towards ejection; the caller retries once)."""
    reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if nothing_sent(exc):
        replica.mark_down(reason)
        return "next"
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return "timeout"
    outliers.failed(replica, reason)
    return "dropped"


def is_fault_status(status: int) -> bool:
    return status in _FAULT_STATUSES


class Outliers:
    """Consecutive request failures per replica (by URL); enough in a row mark it down."""

    def __init__(self, limit: int = CONSECUTIVE_FAILURES) -> None:
        self.limit = limit
        self._run: dict[str, int] = {}

    def failed(self, replica: Replica, reason: str) -> None:
        n = self._run.get(replica.url, 0) + 1
        if n >= self.limit:
            replica.mark_down(f"{n} requests in a row failed, the last: {reason}")
            n = 0  # counted afresh once a probe brings it back
        self._run[replica.url] = n

    def succeeded(self, replica: Replica) -> None:
        self._run.pop(replica.url, None)

    def run(self, replica: Replica) -> int:
        return self._run.get(replica.url, 0)
