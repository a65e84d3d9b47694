"""The door both fronts (HTTP middleware, gRPC interceptor) pass through: API keys, per-key request rate,
total queued bytes, and the drain state of a graceful shutdown.

Drain (SIGTERM): ``begin_drain`` makes every new request a 503 with Retry-After (and ``/health`` a 503), so a
load balancer moves traffic to another replica, while requests already inside finish; ``wait_idle`` returns when
none is left or the shutdown timeout has passed.
"""
from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass, field

from strataserve.api.errors import APIError
from strataserve.router.quota import KeyQuota, RateLimits
from strataserve.router.sla import bearer_key

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_QUEUED_BYTES = 1024 * 1024 * 1024
DRAIN_RETRY_AFTER_S = 5
PROBE_PATHS = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})
DOC_PATHS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
# The web console's page and static files hold no data: the page asks for the key and sends it to the feeds.
CONSOLE_PATHS = frozenset({"/"})
CONSOLE_PREFIX = "/console/static/"


@dataclass(frozen=True)
class CORS:
    """Which other origins a browser page may call the API from (vLLM's ``--allowed-*`` flags). Preflights are
    answered before the key check (a browser sends none with them); every other request still needs the key."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


@dataclass(frozen=True)
class DoorConfig:
    api_keys: tuple[str, ...] = ()  # --api-key plus the keys mapped to SLA classes
    metrics_require_key: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES
    rate: RateLimits = field(default_factory=RateLimits)

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_queued_bytes < 1:
            raise ValueError("max_body_bytes and max_queued_bytes must be >= 1")


class Door:
    def __init__(self, config: DoorConfig | None = None, quota: KeyQuota | None = None) -> None:
        self.config = config or DoorConfig()
        self.quota = quota or KeyQuota(self.config.rate)
        self._expected = [f"Bearer {k}".encode() for k in self.config.api_keys if k] or None
        open_paths = PROBE_PATHS | DOC_PATHS | CONSOLE_PATHS
        self.open_paths = open_paths if self.config.metrics_require_key else open_paths | {"/metrics"}
        self.draining = False
        self.inflight = 0
        self.queued_bytes = 0
        self._idle: asyncio.Event | None = None

    def is_open(self, path: str) -> bool:
        return path in self.open_paths or path.startswith(CONSOLE_PREFIX)

    # ------------------------------------------------------------------ checks
    def authorize(self, authorization: bytes | str | None) -> None:
        """401 unless ``authorization`` is ``Bearer <one of the keys>`` (no-op when no key is set)."""
        if self._expected is None:
            return
        got = authorization.encode() if isinstance(authorization, str) else (authorization or b"")
        if got[:7].lower() == b"bearer ":  # the scheme's case is free (RFC 7235); the key's is not
            got = b"Bearer " + got[7:]
        # Compare with every key (no early exit), each in constant time, so timing tells nothing.
        ok = False
        for key in self._expected:
            ok |= hmac.compare_digest(got, key)
        if not ok:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def admit(self, authorization: bytes | str | None, nbytes: int, charge: bool = True) -> None:
        """503 while draining or when ``nbytes`` more would pass the queued-bytes budget; 429 past the key's
        request rate, which ``charge`` says the request counts against (work does; reads of models, stats and the
        console's feed do not, or an open dashboard would spend a key's budget). Call ``enter`` right after, and
        ``leave`` when the request is done."""
        if self.draining:
            raise draining_error()
        self._check_bytes(nbytes)
        if charge and self.quota.enabled:
            auth = authorization.decode("latin-1") if isinstance(authorization, bytes) else authorization
            self.quota.take_request(bearer_key(auth))

    def _check_bytes(self, nbytes: int) -> None:
        limit = self.config.max_queued_bytes
        if nbytes and self.queued_bytes + nbytes > limit:
            raise APIError(503, f"the server already holds {self.queued_bytes} bytes of requests in flight (limit "
                           f"{limit}); retry shortly", code="queue_bytes_exceeded", type="service_unavailable",
                           headers={"Retry-After": "1"})

    def reserve_bytes(self, nbytes: int) -> None:
        """Count ``nbytes`` more of an admitted request (its body turned out larger than declared)."""
        self._check_bytes(nbytes)
        self.queued_bytes += nbytes

    def enter(self, nbytes: int) -> None:
        self.inflight += 1
        self.queued_bytes += nbytes

    def leave(self, nbytes: int) -> None:
        self.inflight -= 1
        self.queued_bytes -= nbytes
        if self.inflight == 0 and self._idle is not None:
            self._idle.set()

    # ------------------------------------------------------------------ drain
    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every admitted request finished within ``timeout_s``."""
        if self.inflight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


def draining_error() -> APIError:
    return APIError(503, "the server is shutting down and admits no new requests; retry on another replica",
                    code="draining", type="service_unavailable",
                    headers={"Retry-After": str(DRAIN_RETRY_AFTER_S), "Connection": "close"})
