"""The web console at ``/``: the static single-page app (``strataserve/console/``) and the two JSON feeds it reads.

- ``GET /console/api/stats[?since=T]``: the dashboard's feed. A background task samples the router once a second
  (engine stats of each local LLM, the router's per-model / per-class histograms, token counters and cost) into
  a ring buffer of the last 10 minutes, so a freshly opened page shows history. Each sample is encoded to JSON
  once when it is taken; a request only joins the cached strings after ``since``, so polling costs the API
  next to nothing however many pages are open.
- ``GET /console/api/models``: every model the router fronts (cards, upstream replicas and health) and the
  model repository's index with its control mode, for the Models page.

The page itself holds no data and is open; both feeds need the API key like every other data route (the
middleware's open paths). Playgrounds use the public routes (OpenAI, KServe v2, /v1/audio/speech) directly.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from strataserve.api.errors import APIError
from strataserve.api.metrics import LoopHistogram
from strataserve.router.router import Router

STATIC_DIR = Path(__file__).resolve().parents[1] / "console"
INTERVAL_S = 1.0
HISTORY = 600  # samples kept: 10 minutes at 1 s
WINDOW = 10  # samples behind each latency quantile and the prefix-cache hit rate
# Outcomes that are not errors: "ok", and "aborted" (the client went away or pressed Stop), shown on its own. Every
# other outcome the router records (rejected, client_error, upstream_error, unavailable, ...) counts as an error.
_NOT_ERRORS = ("ok", "aborted")


def bucket_quantile(bounds: list[float], counts: list[int], q: float) -> float | None:
    """The ``q`` quantile of a histogram (per-bucket counts, upper bounds ending in +Inf), interpolated
    linearly inside its bucket as Prometheus' ``histogram_quantile`` does; None for an empty histogram. Values in
    the +Inf bucket are reported as the last finite bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    cum = 0
    for i, c in enumerate(counts):
        if c and cum + c >= rank:
            lo = bounds[i - 1] if i else 0.0
            hi = bounds[i]
            if math.isinf(hi):
                return lo
            return lo + (hi - lo) * (rank - cum) / c
        cum += c
    return None  # unreachable: the loop always reaches the rank


def _window_quantiles(h: LoopHistogram, old: list[int] | None) -> tuple[float | None, float | None]:
    delta = h.counts if old is None else [a - b for a, b in zip(h.counts, old)]
    return bucket_quantile(h.bounds, delta, 0.5), bucket_quantile(h.bounds, delta, 0.95)


def _engine_of(backend: Any) -> tuple[Any, Any]:
    """A local LLM backend's ``ServerState`` and its engine's latest ``SchedulerStats`` (None before a step)."""
    state = getattr(backend, "state", None)
    return state, getattr(getattr(state, "engine", None), "stats", None)


def _generated(state: Any, stats: Any) -> int:
    """Output tokens of a local model: the count ``/metrics`` exposes as ``strata:generation_tokens_total`` (tokens
    the API process received and sent on; ``ServerMetrics``), so the console and /metrics agree. The engine's own
    ``SchedulerStats.generation_tokens`` also counts a token sampled for a request aborted before it was sent; it is
    the fallback only for a backend without ``ServerMetrics``."""
    metrics = getattr(state, "metrics", None)
    if metrics is not None and hasattr(metrics, "generation_tokens"):
        return int(metrics.generation_tokens)
    return stats.generation_tokens if stats is not None else 0


def _rate(now: float, then: float | None, dt: float) -> float:
    return 0.0 if then is None or dt <= 0 else max(0.0, (now - then) / dt)


class ConsoleFeed:
    """Samples ``router`` every ``interval`` seconds; ``encoded_since`` answers the dashboard's polls."""

    def __init__(self, router: Router, interval: float = INTERVAL_S, history: int = HISTORY) -> None:
        self.router = router
        self.interval = interval
        self.samples: deque[tuple[float, str]] = deque(maxlen=history)  # (t, JSON of the sample)
        self._snaps: deque[dict[str, Any]] = deque(maxlen=WINDOW)  # cumulative counters, newest last
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin sampling (idempotent); needs a running event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="console-feed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            self.take()
            await asyncio.sleep(self.interval)

    # ------------------------------------------------------------------ sampling
    def _cumulative(self) -> dict[str, Any]:
        """The counters the rates and windowed quantiles are differences of."""
        engines = {}
        for b in self.router.local_text_backends():
            state, stats = _engine_of(b)
            if stats is not None:
                engines[b.name] = (_generated(state, stats), stats.num_preemptions, stats.prefix_cache_hits,
                                   stats.prefix_cache_queries)
        series = {}
        for key, s in self.router.metrics.series.items():
            series[key] = {"tokens": s.output_tokens, "ok": s.outcomes.get("ok", 0),
                           "aborted": s.outcomes.get("aborted", 0),
                           "errors": sum(n for o, n in s.outcomes.items() if o not in _NOT_ERRORS),
                           **{name: list(h.counts) for name, h in (("ttft", s.ttft), ("itl", s.itl), ("e2e", s.e2e),
                                                                   ("queue", s.queue))}}
        return {"t": time.time(), "engines": engines, "series": series}

    def take(self) -> dict[str, Any]:
        """Take one sample now, append it to the history and return it."""
        snap = self._cumulative()
        prev = self._snaps[-1] if self._snaps else None
        old = self._snaps[0] if self._snaps else None
        self._snaps.append(snap)
        dt = snap["t"] - prev["t"] if prev else 0.0
        local = set()
        engines: dict[str, dict[str, Any]] = {}
        for b in self.router.local_text_backends():
            local.add(b.name)
            state, stats = _engine_of(b)
            cur = snap["engines"].get(b.name)
            before = prev["engines"].get(b.name) if prev else None
            first = old["engines"].get(b.name) if old else None
            e = {"ready": b.ready(), "inflight": getattr(state, "inflight_seqs", 0), "running": 0, "waiting": 0,
                 "kv_usage": None, "prefix_hit_rate": None, "tokens_total": 0, "tps": 0.0, "preemptions": 0.0}
            if stats is not None and cur is not None:
                e.update(running=stats.num_running, waiting=stats.num_waiting, kv_usage=stats.kv_cache_usage,
                         tokens_total=cur[0], tps=_rate(cur[0], before and before[0], dt),
                         preemptions=_rate(cur[1], before and before[1], dt))
                hits, queries = cur[2] - (first[2] if first else 0), cur[3] - (first[3] if first else 0)
                e["prefix_hit_rate"] = hits / queries if queries > 0 else None
            engines[b.name] = e
        series: dict[str, dict[str, Any]] = {}
        upstream_tokens = 0
        upstream_tps = 0.0
        for (model, sla), s in self.router.metrics.series.items():
            cur = snap["series"][(model, sla)]
            before = prev["series"].get((model, sla)) if prev else None
            first = old["series"].get((model, sla)) if old else None
            # `model` and `sla` are the key's parts: a model name can hold "/", so the key is not to be split
            row: dict[str, Any] = {"model": model, "sla": sla, "tokens_total": cur["tokens"], "ok": cur["ok"],
                                   "errors": cur["errors"], "aborted": cur["aborted"],
                                   # a series born since the last sample counts from zero
                                   "tps": _rate(cur["tokens"], (before or {"tokens": 0})["tokens"] if prev else None, dt)}
            for name, h in (("ttft", s.ttft), ("itl", s.itl), ("e2e", s.e2e), ("queue", s.queue)):
                row[f"{name}_p50"], row[f"{name}_p95"] = _window_quantiles(h, first and first[name])
            cost = self.router.metrics.cost_quantiles(model, sla)
            row["cost_p50"], row["cost_p95"] = cost if cost is not None else (None, None)
            series[f"{model}/{sla}"] = row
            if model not in local:  # a local engine counts its tokens as they stream; the router at the end
                upstream_tokens += cur["tokens"]
                upstream_tps += row["tps"]
        sample = {"t": round(snap["t"], 3), "engines": engines, "series": series,
                  "tokens_total": upstream_tokens + sum(e["tokens_total"] for e in engines.values()),
                  "tps": upstream_tps + sum(e["tps"] for e in engines.values()),
                  "running": sum(e["running"] for e in engines.values()),
                  "waiting": sum(e["waiting"] for e in engines.values()),
                  "inflight": sum(e["inflight"] for e in engines.values())}
        self.samples.append((sample["t"], json.dumps(sample, separators=(",", ":"), allow_nan=False)))
        return sample

    def encoded_since(self, since: float) -> str:
        """The feed's JSON: the samples taken after ``since`` (all of them for 0), oldest first."""
        parts = [s for t, s in self.samples if t > since]
        return (f'{{"interval":{self.interval},"history":{self.samples.maxlen},"now":{time.time():.3f},'
                f'"samples":[{",".join(parts)}]}}')


async def models_doc(router: Router) -> dict[str, Any]:
    models = [{"name": c.name, "payload": c.payload.value, "backend": c.backend, "ready": c.ready,
               "reason": c.reason, "max_model_len": c.max_model_len, "extra": c.extra} for c in router.cards()]
    repository = None
    local = router.tensors.local if router.tensors is not None else None
    if local is not None:
        repository = {"control_mode": local.control_mode, "models": local.repository_index()}
    return {"models": models, "repository": repository}


def mount_console(app: FastAPI, router: Router) -> ConsoleFeed:
    """Serve the console at ``/`` and its feeds under ``/console/api``; returns the feed (started by the server
    once its loop runs, or by the first poll)."""
    feed = ConsoleFeed(router)
    app.mount("/console/static", StaticFiles(directory=STATIC_DIR), name="console-static")

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/console/api/stats", include_in_schema=False)
    async def stats(request: Request) -> Response:
        feed.start()
        if not feed.samples:
            feed.take()
        try:
            since = float(request.query_params.get("since", "0"))
        except ValueError:
            raise APIError(400, "query parameter `since` must be a number (seconds since the epoch)",
                           param="since") from None
        return Response(feed.encoded_since(since), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    @app.get("/console/api/models", include_in_schema=False)
    async def models() -> dict:
        return await models_doc(router)

    return feed
