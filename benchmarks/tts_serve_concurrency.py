"""Served Qwen3-TTS throughput at concurrency: does the streamed path (per-chunk codec decode on one worker
thread, PCM encoding, HTTP) keep up with the engine as the batch grows?

A random-weight checkpoint in the released shape (``tts_serve_ttfa.write_checkpoint``) is served on loopback with
``--max-num-seqs 32``; for each concurrency C, ROUNDS waves of C streamed ``/v1/audio/speech`` requests (pcm,
greedy, ``max_new_frames`` FRAMES, a different random text each) run together. Per wave: audio frames per second
over the wave (frames from the PCM bytes: one frame is ``decode_upsample_rate`` samples of int16), time to first
audio P50 / max. Compare with ``tts_bench.py``'s engine-only batch-C frames/s (no codec, no HTTP) in the same call.

Prints one ``TTSCONC {...}`` line per wave and a final ``RESULT {...}``.

    python benchmarks/tts_serve_concurrency.py                       # H200: SHAPE=1.7B CONC=1,8,16,32 ROUNDS=3
    SHAPE=tiny CONC=1,2 ROUNDS=1 FRAMES=8 python benchmarks/tts_serve_concurrency.py   # CPU smoke run
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from _server import Server  # noqa: E402


def stand_in_audio_io() -> None:
    """The reference model code imports librosa, soundfile and onnxruntime at module level (audio I/O, its 25 Hz
    tokenizer), which writing a random checkpoint never calls; where they (or numba / scipy under librosa) are
    absent, empty modules stand in for the import only, so the device run does not need ~100 MB of wheels."""
    import importlib.machinery
    import types

    for name, attrs in (("librosa", {}), ("librosa.filters", {"mel": None}), ("soundfile", {}), ("onnxruntime", {})):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - absent, or its own dependencies are
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers asks find_spec about them
            mod.__dict__.update(attrs)
            sys.modules[name] = mod
    sys.modules["librosa"].filters = sys.modules["librosa.filters"]


stand_in_audio_io()
from tts_serve_ttfa import SHAPE, write_checkpoint  # noqa: E402

CONC = [int(c) for c in os.environ.get("CONC", "1,8,16,32").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", 3))
FRAMES = int(os.environ.get("FRAMES", 100))
WORDS = ("river stone light morning quiet garden window letter summer paper music harbor silver forest yellow "
         "station winter market engine violin candle mirror thunder orchard").split()


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(14)) + "." for _ in range(n)]


async def one(client: httpx.AsyncClient, url: str, model: str, text: str) -> tuple[float, int]:
    body = dict(model=model, input=text, voice="ryan", language="english", response_format="pcm",
                stream_format="audio", temperature=0.0, max_new_frames=FRAMES)
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


async def wave(url: str, model: str, batch: list[str]) -> tuple[float, list[tuple[float, int]]]:
    limits = httpx.Limits(max_connections=len(batch) + 4, max_keepalive_connections=len(batch) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(client, url, model, t) for t in batch))
        return time.perf_counter() - t0, got


def main() -> None:
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(Path(tmp) / f"qwen3-tts-{SHAPE}")
        cfg = json.loads((folder / "speech_tokenizer" / "config.json").read_text())
        samples_per_frame = int(cfg.get("decode_upsample_rate", 1920))
        srv = Server([str(folder), "--max-num-seqs", str(max(CONC))], out / "tts_serve_concurrency.log")
        try:
            model = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
            for c in dict.fromkeys([1, *CONC]):  # warm-up: each batch size's graphs, the codec's shapes
                asyncio.run(wave(srv.url, model, texts(c, 10_000 + c)))
            for rnd in range(ROUNDS):
                for c in (CONC if rnd % 2 == 0 else CONC[::-1]):
                    dt, got = asyncio.run(wave(srv.url, model, texts(c, rnd * 1000 + c)))
                    frames = [n // 2 / samples_per_frame for _, n in got]
                    firsts = [f for f, _ in got]
                    row = dict(shape=SHAPE, round=rnd, concurrency=c, s=round(dt, 3), frames=round(sum(frames), 1),
                               fps=round(sum(frames) / dt, 1), frames_min=round(min(frames), 1),
                               frames_max=round(max(frames), 1),
                               ttfa_p50_ms=round(statistics.median(firsts) * 1e3, 1),
                               ttfa_max_ms=round(max(firsts) * 1e3, 1))
                    rows.append(row)
                    print("TTSCONC " + json.dumps(row), flush=True)
        finally:
            srv.stop()
    summary = {str(c): [r["fps"] for r in rows if r["concurrency"] == c] for c in CONC}
    print("RESULT " + json.dumps(dict(shape=SHAPE, frames=FRAMES, fps_by_concurrency=summary)), flush=True)


if __name__ == "__main__":
    main()
