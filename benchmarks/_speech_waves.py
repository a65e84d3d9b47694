"""Waves of concurrent streamed ``/v1/audio/speech`` requests against a running server, whatever model it serves:
the client half shared by ``tts_serve_concurrency.py`` (Qwen3-TTS) and ``omnivoice_serve_concurrency.py``.

A wave sends C request bodies at once and reads every PCM stream to its end; its row has the wave's wall time,
the audio frames received (from the PCM bytes: 16-bit mono, ``samples_per_frame`` samples a frame), frames per
second over the wave, frames per request min / max and the time to first audio P50 / max. ``run_waves`` warms each
concurrency up once, then runs ``rounds`` waves per concurrency, alternating the order round by round, and prints
one ``TTSCONC {...}`` line per measured wave.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Callable

import httpx

#: (concurrency, seed) -> the C request bodies of one wave
Bodies = Callable[[int, int], list[dict]]


async def one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, int]:
    """One streamed request: (seconds to its first audio bytes, audio bytes received)."""
    t0, first, n = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"speech request failed: {r.status_code} {(await r.aread())[:500]!r}")
        async for chunk in r.aiter_bytes():
            if chunk and first is None:
                first = time.perf_counter() - t0
            n += len(chunk)
    if first is None:
        raise SystemExit("a stream ended without audio")
    return first, n


async def wave(url: str, bodies: list[dict]) -> tuple[float, list[tuple[float, int]]]:
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(client, url, b) for b in bodies))
        return time.perf_counter() - t0, got


def wave_stats(dt: float, got: list[tuple[float, int]], samples_per_frame: int) -> dict:
    frames = [n // 2 / samples_per_frame for _, n in got]
    firsts = [f for f, _ in got]
    return dict(s=round(dt, 3), frames=round(sum(frames), 1), fps=round(sum(frames) / dt, 1),
                frames_min=round(min(frames), 1), frames_max=round(max(frames), 1),
                ttfa_p50_ms=round(statistics.median(firsts) * 1e3, 1), ttfa_max_ms=round(max(firsts) * 1e3, 1))


def run_waves(url: str, conc: list[int], rounds: int, bodies: Bodies, samples_per_frame: int,
              head: dict) -> list[dict]:
    """Warm-up (one wave per concurrency: its batch shapes, graphs, the codec's shapes; seeds 10,000 + C), then
    the measured waves (seeds round * 1,000 + C). ``head``: the fields each row starts with."""
    for c in dict.fromkeys([1, *conc]):
        asyncio.run(wave(url, bodies(c, 10_000 + c)))
    rows = []
    for rnd in range(rounds):
        for c in (conc if rnd % 2 == 0 else conc[::-1]):
            dt, got = asyncio.run(wave(url, bodies(c, rnd * 1000 + c)))
            row = dict(head, round=rnd, concurrency=c, **wave_stats(dt, got, samples_per_frame))
            rows.append(row)
            print("TTSCONC " + json.dumps(row), flush=True)
    return rows


def fps_by_concurrency(rows: list[dict], conc: list[int]) -> dict[str, list[float]]:
    return {str(c): [r["fps"] for r in rows if r["concurrency"] == c] for c in conc}
