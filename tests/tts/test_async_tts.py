"""``AsyncTTS`` in-process: concurrent streams match the offline engine, chunking, and an early close aborts the
request and frees its slot at the engine's next step."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from strataserve.engine.async_tts import AsyncTTS
from strataserve.types.errors import EngineDeadError
from strataserve.engine.tts import TTS
from strataserve.engine.tts_engine import load_tts_model
from strataserve.types.speech import SpeechParams, TTSInputError

TEXTS = ["Hello world, this is a test.", "Short one.", "Another sentence here"]


def test_concurrent_streams_match_offline_and_abort_frees_slot(weak_eos_ckpt):
    ckpt = weak_eos_ckpt
    offline = TTS(str(ckpt), device="cpu")
    params = SpeechParams(temperature=0.0, code_temperature=0.0, max_new_frames=10)
    expected = [o.waveform for o in offline.generate(TEXTS, voice="ryan", temperature=0.0, code_temperature=0.0,
                                                       max_new_frames=10)]
    tts = AsyncTTS(load_tts_model(ckpt, device="cpu"), first_chunk_frames=2, chunk_frames=3)
    timings = []
    tts.observers.append(timings.append)

    async def collect(text):
        chunks = [c async for c in tts.synthesize(text, voice="ryan", params=params)]
        return chunks

    async def main():
        results = await asyncio.gather(*(collect(t) for t in TEXTS))
        long = tts.synthesize(TEXTS[0], voice="ryan", params=SpeechParams(max_new_frames=4000))
        it = long.__aiter__()
        first = await it.__anext__()
        await it.aclose()
        for _ in range(1500):  # the abort reaches the engine thread and its next step frees the slot (<= 30 s)
            if not tts.core.scheduler.requests and tts.num_running == 0:
                break
            await asyncio.sleep(0.02)
        return results, first

    try:
        results, first = asyncio.run(main())
        for chunks, want in zip(results, expected):
            # 8 samples per frame; a chunk waits for >= 2 (first) / 3 frames, or takes all that are ready
            assert len(chunks) >= 2 and len(chunks[0]) >= 2 * 8 and all(len(c) % 8 == 0 for c in chunks)
            np.testing.assert_allclose(np.concatenate(chunks), want, atol=1e-4)  # windows vs whole clip
        assert len(first) >= 2 * 8
        assert not tts.core.scheduler.requests and tts.num_running == 0
        assert [t.finish_reason for t in timings] == ["length"] * 3 + ["abort"]
        assert all(t.time_to_first_audio is not None and t.frames for t in timings)
        with pytest.raises(TTSInputError, match="voice"):
            tts.synthesize("hi", voice="nobody")
        tts.check_health()
    finally:
        tts.shutdown()
    with pytest.raises(EngineDeadError):
        tts.check_health()


def test_windows_of_streams_waiting_together_share_a_codec_forward(weak_eos_ckpt):
    """Concurrent streams' audio windows go through the codec together (one forward per window shape), and each
    stream's audio is what it gets alone: rows of one shape stack without padding (the same frames; samples equal
    up to float32 rounding: the matmuls of another row count)."""
    tts = AsyncTTS(load_tts_model(weak_eos_ckpt, device="cpu"), first_chunk_frames=2, chunk_frames=3)
    params = SpeechParams(temperature=0.0, code_temperature=0.0, max_new_frames=12)

    async def collect(text):
        return np.concatenate([c async for c in tts.synthesize(text, voice="ryan", params=params)])

    b = tts.codec_batcher

    async def main():
        solo = [await collect(t) for t in TEXTS]
        alone = (b.forwards, b.windows)
        both = await asyncio.gather(*(collect(t) for t in TEXTS))
        return solo, alone, both

    try:
        solo, alone, both = asyncio.run(main())
        assert alone[0] == alone[1] > 0  # one stream at a time: every window alone
        forwards, windows = b.forwards - alone[0], b.windows - alone[1]
        assert windows >= 3 * len(TEXTS) and forwards <= windows - 2  # windows of different streams went together
        for got, want in zip(both, solo):  # float32 matmuls of another row count: last-bit differences only
            np.testing.assert_allclose(got, want, atol=1e-4)
    finally:
        tts.shutdown()
