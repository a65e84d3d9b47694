"""Qwen3-TTS serving (``AsyncTTS``, tiny checkpoint, CPU, no server process): chunk boundaries that depend on frame
counts alone (the same seeded request gives the same bytes whether frames arrive one by one or all at once), the
frame counter against usage, and the speech route's answers (in process, ASGI) for a zero-frame limit and for a
field only non-autoregressive models take."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from strataserve.engine.async_tts import AsyncTTS, SpeechStream
from strataserve.engine.tts_engine import load_tts_model
from strataserve.types.protocol import EngineCoreOutput
from strataserve.types.speech import SpeechParams

PARAMS = SpeechParams(temperature=0.0, code_temperature=0.0, seed=0, max_new_frames=20)


class FakeOwner:
    """What a ``SpeechStream`` reads from its ``AsyncTTS``: the runner's frames and the decode (recorded)."""

    def __init__(self) -> None:
        self.runner = SimpleNamespace(states={})
        self.windows: list[tuple[int, int]] = []

    async def _decode(self, frames, start: int, end: int) -> np.ndarray:
        self.windows.append((start, end))
        return np.asarray([f[0] for f in frames[start:end]], np.float32)

    def _done(self, stream) -> None:
        pass


def _stream_with_groups(groups: list[int], reader_waits: bool) -> tuple[list[tuple[int, int]], list[np.ndarray]]:
    """17 frames reach a stream in ``groups`` (frames per engine output); the reader keeps up with every output,
    or (``reader_waits``) starts once all of them are queued."""
    owner = FakeOwner()
    state = SimpleNamespace(frames=[])
    owner.runner.states["r"] = state
    stream = SpeechStream(owner, "r", 2, 4)

    async def produce():
        total = 0
        for k, g in enumerate(groups):
            state.frames += [[total + j] for j in range(g)]
            total += g
            stream.queue.put_nowait(EngineCoreOutput(request_id="r", new_token_ids=[0] * g,
                                                     finish_reason="length" if k == len(groups) - 1 else None))
            for _ in range(5):  # let a reader that keeps up take this output first
                await asyncio.sleep(0)

    async def read():
        return [c async for c in stream]

    async def main():
        if reader_waits:
            await produce()
            return await read()
        reader = asyncio.ensure_future(read())
        await produce()
        return await reader

    return owner.windows, asyncio.run(main())


@pytest.mark.parametrize("reader_waits", [False, True])
@pytest.mark.parametrize("groups", [[17], [1] * 17, [3, 9, 5], [2, 4, 11], [16, 1]])
def test_chunk_windows_depend_on_frame_counts_only(groups, reader_waits):
    windows, chunks = _stream_with_groups(groups, reader_waits)
    assert windows == [(0, 2), (2, 6), (6, 10), (10, 14), (14, 17)]
    assert np.array_equal(np.concatenate(chunks), np.arange(17, dtype=np.float32))


@pytest.fixture(scope="module")
def model(weak_eos_ckpt):
    return load_tts_model(weak_eos_ckpt, device="cpu")


def test_same_bytes_when_frames_arrive_at_once(model):
    """A reader that keeps up gets the frames a few at a time; one that waits until the clip is done gets them
    all at once. The chunks (and so the joined whole response) are the same."""
    tts = AsyncTTS(model, first_chunk_frames=2, chunk_frames=3)

    async def keep_up():
        s = tts.synthesize("Hello world, this is a test.", voice="ryan", params=PARAMS)
        return [c async for c in s], s

    async def wait_first():
        s = tts.synthesize("Hello world, this is a test.", voice="ryan", params=PARAMS)
        for _ in range(3000):  # until the engine finished the clip (the weak eos: it runs to max_new_frames)
            st = tts.runner.states.get(s.request_id)
            if not tts.core.scheduler.requests and st is not None and len(st.frames) == 19:
                break
            await asyncio.sleep(0.01)
        return [c async for c in s], s

    async def main():
        return await keep_up(), await wait_first()

    try:
        (fast, s1), (slow, s2) = asyncio.run(main())
    finally:
        tts.shutdown()
    assert [len(c) for c in fast] == [len(c) for c in slow]
    per_frame = sum(map(len, fast)) // 19
    assert [len(c) // per_frame for c in fast] == [2, 3, 3, 3, 3, 3, 2]  # 2, then 3 frames, the end cut short
    assert all(np.array_equal(a, b) for a, b in zip(fast, slow))
    assert s1.frames == s2.frames


def test_frames_metric_counts_audio_frames_like_usage(model):
    """``strata:tts_frames_total`` (``frames_generated``) adds what usage.output_tokens says: frames, not ids."""
    tts = AsyncTTS(model)

    async def main():
        done = []
        for n in (3, 20):
            s = tts.synthesize("Hello world.", voice="ryan", params=SpeechParams(seed=0, max_new_frames=n))
            [c async for c in s]
            done.append(len(s.frames))
        return done

    try:
        frames = asyncio.run(main())
    finally:
        tts.shutdown()
    assert frames == [2, 19]  # n codebook-0 ids: the last is never a frame
    assert tts.frames_generated == sum(frames)


def _app(tts):
    from fastapi import FastAPI

    from strataserve.api.errors import install_error_handlers
    from strataserve.api.speech import make_speech_router

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(make_speech_router(lambda name: tts))
    return app


@pytest.mark.parametrize("body, param, match", [
    ({"max_new_frames": 1, "response_format": "flac"}, "max_new_frames", "max_new_frames=1 gives a clip of no audio"),
    ({"max_new_frames": 1, "response_format": "mp3"}, "max_new_frames", "max_new_frames=1"),
    ({"max_new_frames": 1, "response_format": "pcm", "stream_format": "sse"}, "max_new_frames", "max_new_frames"),
    ({"guidance_scale": 3.0}, "guidance_scale", "guidance_scale=3.0"),
    ({"num_step": 8}, "num_step", "num_step=8"),
])
def test_speech_route_names_the_field(model, body, param, match):
    tts = AsyncTTS(model)

    async def main():
        transport = httpx.ASGITransport(app=_app(tts))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/audio/speech", json={"input": "Hello.", "voice": "ryan", **body})

    try:
        r = asyncio.run(main())
    finally:
        tts.shutdown()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err
