"""``AsyncTTS``: Qwen3-TTS for serving. The engine core (scheduler + ``TTSRunner``) runs on its own thread
(``InprocCoreClient``); every request streams float32 PCM chunks as its frames are decoded.

    tts = AsyncTTS.from_pretrained("path/to/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    stream = tts.synthesize("Hello!", voice="ryan")      # validates now: TTSInputError on bad input
    async for pcm in stream: ...                          # float32 chunks at tts.sample_rate
    await stream.aclose()                                 # early close aborts the request (slot freed next step)

Audio chunks: frames [0, F), then [F, F + C), [F + C, F + 2C), ... (F = ``first_chunk_frames``, C =
``chunk_frames``), the last one cut where the clip ends. The boundaries depend on frame counts alone: a chunk
waits for the frame at its boundary (or the end of the clip), and frames that arrived together are still cut at
the boundaries, so the same seeded request gets the same windows however fast the engine ran ahead of the codec,
and the whole (non-streamed) response is the streamed chunks joined. Each is decoded with up to 25 frames of left
context by the causal codec (on a worker thread, so the event loop never waits for it). Windows of streams that
wait together share a forward (``engine/codec_batcher.py``): a window's samples are its own, equal to its solo
decode up to float rounding (matmuls of another row count), which can move an int16 sample by a step or two. A
streamed clip can differ from a whole-clip decode in the last bits where the codec's attention window reaches past
that context.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import numpy as np

from strataserve.types.speech import SpeechTiming
from strataserve.engine.codec_batcher import CodecBatcher
from strataserve.engine.core_client import InprocCoreClient
from strataserve.types.errors import EngineDeadError
from strataserve.types.protocol import EngineCoreOutput, SchedulerStats
from strataserve.engine.tts_engine import (
    CloneInput,
    ServesTTSModel,
    TTSModel,
    build_core,
    build_request,
    encode_reference,
    load_tts_model,
)
from strataserve.models.qwen3_tts.codec import LEFT_CONTEXT_FRAMES
from strataserve.types.speech import SpeechParams, TTSInputError


class SpeechStream:
    """Async iterator of float32 PCM chunks for one request; ``aclose`` aborts it if unfinished."""

    def __init__(self, owner: AsyncTTS, rid: str, first_chunk: int, chunk: int) -> None:
        self.owner, self.request_id = owner, rid
        self.first_chunk, self.chunk = first_chunk, chunk
        self.queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.first_audio: float | None = None
        self.scheduled: float | None = None
        self.finish_reason: str | None = None
        self.frames: list[list[int]] = []
        self.ref_frames: list[list[int]] = []  # in-context cloning: decoded in front of ``frames``, not sent
        self.input_tokens = 0  # talker prompt positions (text, speaker, language and control rows)
        self._sent = 0  # frames already turned into audio
        self._counted = 0  # frames already added to the owner's ``frames_generated``
        self._closed = False

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self._chunks()

    def _windows(self, n: int, final: bool) -> list[tuple[int, int]]:
        """The chunks [start, end) that ``n`` frames complete (and, ``final``, the cut last one)."""
        out, sent = [], self._sent
        while True:
            end = self.first_chunk if sent == 0 else sent + self.chunk
            if end > n:
                if final and n > sent:
                    out.append((sent, n))
                return out
            out.append((sent, end))
            sent = end

    async def _chunks(self) -> AsyncIterator[np.ndarray]:
        try:
            while True:
                out = await self.queue.get()
                if out.scheduled_time is not None and self.scheduled is None:
                    self.scheduled = time.perf_counter()
                if out.finish_reason is not None:
                    self.finish_reason = out.finish_reason
                st = self.owner.runner.states.get(self.request_id)
                n = len(st.frames) if st is not None else self._sent
                if st is not None and n > len(self.frames):
                    self.frames = [list(f) for f in st.frames[:n]]
                ref = len(self.ref_frames)
                for start, end in self._windows(n, self.finish_reason is not None):
                    pcm = await self.owner._decode(self.ref_frames + self.frames, ref + start, ref + end)
                    self._sent = end
                    if self.first_audio is None:
                        self.first_audio = time.perf_counter()
                    yield pcm
                if self.finish_reason is not None:
                    if self.finish_reason == "abort" and out.stop_reason:
                        raise RuntimeError(f"request aborted by the engine: {out.stop_reason}")
                    return
        finally:
            self._finish()

    async def aclose(self) -> None:
        self._finish()

    def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.owner._done(self)


class AsyncTTS(ServesTTSModel):
    def __init__(self, model: TTSModel, *, max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 num_blocks: int | None = None, block_size: int = 16, kv_cache_memory_gib: float = 0.5,
                 first_chunk_frames: int = 2, chunk_frames: int = 8, name: str | None = None) -> None:
        self.model = model
        self.name = name or model.name or "qwen3-tts"
        self.core, self.runner = build_core(model, max_num_seqs=max_num_seqs,
                                            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                            num_blocks=num_blocks, kv_cache_memory_gib=kv_cache_memory_gib)
        self.client = InprocCoreClient(core=self.core)
        self.first_chunk_frames, self.chunk_frames = max(1, first_chunk_frames), max(1, chunk_frames)
        self._streams: dict[str, SpeechStream] = {}
        self._ids = itertools.count()
        self._pump: asyncio.Task | None = None
        self._codec_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-codec")
        #: the streams' audio windows, decoded together when they wait together (``engine/codec_batcher.py``)
        self.codec_batcher = CodecBatcher(model.codec, model.codec_device, self._codec_pool, LEFT_CONTEXT_FRAMES)
        self.scheduler_stats = SchedulerStats()
        #: called with a ``SpeechTiming`` when a request ends (the API's metrics hook in here)
        self.observers: list[Callable[[SpeechTiming], None]] = []
        self.frames_generated = 0
        self._shut_down = False

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto",
                        mode: str = "auto", max_model_len: int = 4096, voices_dir: str | Path | None = None,
                        **kwargs: Any) -> AsyncTTS:
        return cls(load_tts_model(model_dir, device=device, dtype=dtype, mode=mode, max_model_len=max_model_len,
                                  voices_dir=voices_dir), **kwargs)

    # ------------------------------------------------------------------ what it serves

    @property
    def num_running(self) -> int:
        return self.scheduler_stats.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler_stats.num_waiting

    def check_health(self) -> None:
        """Raises ``EngineDeadError`` when the engine thread died or was shut down."""
        if self._shut_down:
            raise EngineDeadError("the speech engine was shut down")
        self.client.check_health()

    # ------------------------------------------------------------------ requests
    def synthesize(self, text: str, *, voice: str | None = None, language: str | None = None,
                   instructions: str | None = None, params: SpeechParams = SpeechParams(),
                   request_id: str | None = None, clone: CloneInput = CloneInput()) -> SpeechStream:
        """Validate and queue one request (``TTSInputError`` on bad input, before anything streams)."""
        self.check_health()
        rid = request_id or f"speech-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        req, state = build_request(self.model, rid, text, voice=voice, language=language,
                                   instructions=instructions, params=params, clone=clone)
        if req.sampling_params.max_tokens < 2:
            # the last codebook-0 id never becomes a frame (it is the stop decision, or the limit): one id is a
            # clip of no audio, which no flac / mp3 file can hold, so the request is refused instead
            raise TTSInputError(f"max_new_frames={req.sampling_params.max_tokens} gives a clip of no audio (the "
                                "last generated step is never a frame): use 2 or more")
        self.core.check_request(req)
        stream = SpeechStream(self, rid, self.first_chunk_frames, self.chunk_frames)
        stream.input_tokens = state.prompt.length
        stream.ref_frames = state.ref_frames
        self._streams[rid] = stream
        self.runner.register(rid, state)
        try:
            self.client.add_request(req)
        except BaseException:
            self._streams.pop(rid, None)
            self.runner.release(rid, deferred=False)  # the engine never saw it
            raise
        self._ensure_pump()
        return stream

    async def encode_reference(self, clone: CloneInput) -> CloneInput:
        """Encode a request's reference audio (voice cloning) on a worker thread: the speaker and codec encoders
        would otherwise stall the event loop (and every stream on it) for their whole run."""
        if clone.ref_audio is None or self.model.cloner is None:
            return clone
        return await asyncio.get_running_loop().run_in_executor(None, encode_reference, self.model, clone)

    async def _decode(self, frames: list[list[int]], start: int, end: int) -> np.ndarray:
        return await self.codec_batcher.decode(frames, start, end)

    def _done(self, stream: SpeechStream) -> None:
        rid = stream.request_id
        if self._streams.pop(rid, None) is None:
            return
        if stream.finish_reason is None:  # closed early (client went away): free its slot at the next step
            self.client.abort_requests([rid])
            stream.finish_reason = "abort"
        self._count_frames(stream)
        self.runner.release(rid)
        now = time.perf_counter()
        frames = stream._sent
        timing = SpeechTiming(
            queue_time=(stream.scheduled or now) - stream.arrival,
            time_to_first_audio=None if stream.first_audio is None else stream.first_audio - stream.arrival,
            frames=frames, audio_seconds=frames * self.model.config.codec.decode_upsample_rate / self.sample_rate
            if self.model.config.codec else 0.0, wall_seconds=now - stream.arrival,
            finish_reason=stream.finish_reason or "abort")
        for cb in self.observers:
            cb(timing)

    # ------------------------------------------------------------------ output pump
    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    async def _run_pump(self) -> None:
        # runs for the engine's life (not only while streams are open) so the running / waiting counts stay
        # current after the last request leaves; it ends when the engine dies or shuts down
        while True:
            try:
                outs = await self.client.get_outputs()
            except BaseException as exc:  # engine died: wake every stream with an abort
                for s in list(self._streams.values()):
                    s.queue.put_nowait(EngineCoreOutput(request_id=s.request_id, new_token_ids=[],
                                                        finish_reason="abort", stop_reason=str(exc)))
                return
            if outs.stats is not None:
                self.scheduler_stats = outs.stats
            for o in outs.outputs:
                s = self._streams.get(o.request_id)
                if s is not None:
                    self._count_frames(s)
                    s.queue.put_nowait(o)

    def _count_frames(self, stream: SpeechStream) -> None:
        """Add the request's new complete frames to ``frames_generated``: audio frames, as usage counts them, not
        codebook-0 ids (the last id of a clip, its stop token or the limit, never becomes a frame)."""
        st = self.runner.states.get(stream.request_id)
        if st is not None and len(st.frames) > stream._counted:
            self.frames_generated += len(st.frames) - stream._counted
            stream._counted = len(st.frames)

    def shutdown(self) -> None:
        self._shut_down = True
        self.client.shutdown()
        self._codec_pool.shutdown(wait=False)
