"""OmniVoice for users: the offline ``OmniVoiceTTS`` (what ``TTS(model=OMNIVOICE_DIR)`` returns) and the serving
``AsyncOmniVoice`` (``strata serve OMNIVOICE_DIR``), both over one ``NARScheduler`` thread that batches whole
requests from every caller.

    tts = TTS(model="path/to/OmniVoice")
    out = tts.generate(["Hello there."], instructions="female, low pitch", seed=0)

    stream = AsyncOmniVoice.from_pretrained(DIR).synthesize("Hello!", voice="auto")   # TTSInputError if bad
    async for pcm in stream: ...     # one float32 chunk per sentence piece, in order, as each is decoded

Long inputs: a served request's sentence pieces go to the scheduler ``pieces_ahead`` (default 2) at a time, the
next one as one finishes (from the scheduler's callback, so it joins the very next batch). The first piece's audio
streams as soon as it is decoded, other requests share every batch in between instead of waiting for the whole
clip, and a closed stream (client hang-up) submits nothing more and drops its waiting pieces; a running batch
stops at its next step once all its requests are cancelled. Each piece's seed is the request's seed + its index, and the
runner's noise is per request, so which pieces share a batch changes no token; the decode runs one clip per
forward so that it changes no sample either. The offline ``generate`` submits all pieces at once (throughput).

Audio: the decoded waveform's volume follows the reference (a quiet reference clip gives quiet output; without
one the peak is set to 0.5), as the reference package does; its silence trimming and edge fades are not applied.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

import numpy as np
import torch

from strataserve.types.speech import SpeechTiming
from strataserve.engine.nar_scheduler import NARScheduler
from strataserve.engine.omnivoice_requests import _LANGUAGE_NAMES, ChunkPolicy, OmniVoiceRequests
from strataserve.engine.tts import SpeechOutput, _per_text
from strataserve.types.speech import SpeechParams
from strataserve.models.omnivoice.codec import ReferenceEncoder
from strataserve.models.omnivoice.loader import LoadedOmniVoice, load_omnivoice
from strataserve.models.omnivoice.prompt import VoiceReference
from strataserve.runner.nar_runner import NARRequest, NARRunner
from strataserve.types.speech import BatchStats


def finish_audio(wav: torch.Tensor, ref: VoiceReference | None) -> np.ndarray:
    x = wav.detach().float().cpu().numpy().astype(np.float32)
    if ref is not None and ref.rms is not None:
        return x * (ref.rms / 0.1) if ref.rms < 0.1 else x
    peak = float(np.abs(x).max()) if x.size else 0.0
    return x / peak * 0.5 if peak > 1e-6 else x


class _OmniVoiceBase:
    def __init__(self, ov: LoadedOmniVoice, *, max_batch: int = 32, window_s: float = 0.005,
                 policy: ChunkPolicy = ChunkPolicy(), name: str | None = None) -> None:
        self.ov = ov
        self.name = name or ov.name or "omnivoice"
        self.runner = NARRunner(ov.model, num_codebooks=ov.config.num_codebooks, mask_id=ov.config.audio_mask_id,
                                cuda_graphs=ov.cuda_graphs)
        codec = ov.codec

        def decode(clips: list[torch.Tensor]) -> list[torch.Tensor]:  # one per forward: batch-independent samples
            return [codec.decode_batch([c])[0] for c in clips]

        self.scheduler = NARScheduler(self.runner, decode if codec is not None else None,
                                      window_s=window_s, max_batch=max_batch)
        enc = ReferenceEncoder(ov.folder / "audio_tokenizer", ov.model.device) \
            if ov.folder is not None and ReferenceEncoder.available() else None
        self.requests = OmniVoiceRequests(ov, policy, enc)
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto",
                        mode: str = "auto", **kwargs: Any):
        return cls(load_omnivoice(model_dir, device=device, dtype=dtype, mode=mode), **kwargs)

    @property
    def voices(self) -> list[str]:
        return self.requests.voices

    @property
    def languages(self) -> list[str]:
        return ["auto"] + sorted(set(_LANGUAGE_NAMES.values()))

    @property
    def sample_rate(self) -> int:
        return self.ov.config.sample_rate

    @property
    def batch_observers(self) -> list[Callable[[BatchStats], None]]:
        return self.runner.observers

    def shutdown(self) -> None:
        self.scheduler.shutdown()


class OmniVoiceTTS(_OmniVoiceBase):
    def generate(self, texts: str | Sequence[str], *, voice: str | Sequence[str] | None = None,
                 language: str | Sequence[str] | None = None, instructions: str | Sequence[str] | None = None,
                 num_step: int | None = None, guidance_scale: float | None = None, temperature: float | None = None,
                 seed: int | Sequence[int] | None = None, speed: float = 1.0) -> list[SpeechOutput]:
        """Synthesize every text (batched together); results in input order. ``frames`` is ``[T, 8]``."""
        items = [texts] if isinstance(texts, str) else list(texts)
        n = len(items)
        voices, langs = _per_text(voice, n, "voice"), _per_text(language, n, "language")
        instrs, seeds = _per_text(instructions, n, "instructions"), _per_text(seed, n, "seed")
        plans = []
        for i, text in enumerate(items):
            params = SpeechParams(seed=seeds[i], num_step=num_step, guidance_scale=guidance_scale,
                                  temperature=temperature)
            try:
                plans.append(self.requests.build(f"tts-{next(self._ids)}", text, voice=voices[i], language=langs[i],
                                                 instructions=instrs[i], params=params, speed=speed))
            except ValueError as exc:
                raise ValueError(f"text {i}: {exc}") from None
        results: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        errors: list[BaseException] = []
        total = sum(len(reqs) for reqs, _ in plans)
        done = threading.Event()
        lock = threading.Lock()

        def on_done(req: NARRequest, tokens, wav, err) -> None:
            with lock:
                if err is not None:
                    errors.append(err)
                else:
                    results[req.request_id] = (tokens.cpu(), wav)
                if len(results) + len(errors) == total:
                    done.set()

        for reqs, _ in plans:
            for r in reqs:
                self.scheduler.submit(r, on_done)
        done.wait()
        if errors:
            raise errors[0]
        out = []
        for reqs, ref in plans:
            frames = torch.cat([results[r.request_id][0] for r in reqs], dim=1).T.numpy()
            wavs = [results[r.request_id][1] for r in reqs]
            wav = finish_audio(torch.cat(wavs), ref) if all(w is not None for w in wavs) else np.zeros(0, np.float32)
            out.append(SpeechOutput(reqs[0].request_id.rsplit(".", 1)[0], frames, wav, self.sample_rate, "stop"))
        return out


class OmniVoiceStream:
    """Async iterator of float32 PCM chunks (one per text piece, in order); ``aclose`` cancels what is left.

    Pieces are submitted ``ahead`` at a time: ``_feed`` runs on the event loop for the first ones and on the
    scheduler's worker thread (its callback) for the rest; ``_lock`` orders it against ``_stop``."""

    def __init__(self, owner: AsyncOmniVoice, rid: str, reqs: list[NARRequest], ref: VoiceReference | None,
                 ahead: int = 2) -> None:
        self.owner, self.request_id, self.reqs, self.ref = owner, rid, reqs, ref
        self.queue: asyncio.Queue[tuple[int, Any, Any, BaseException | None]] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.first_audio: float | None = None
        self.finish_reason: str | None = None
        self.frames: list[list[int]] = []
        self.input_tokens = sum(r.prefix_len for r in reqs)
        self.ahead = max(1, ahead)
        self._index = {r.request_id: i for i, r in enumerate(reqs)}
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._submitted = 0  # pieces handed to the scheduler so far (in order)
        self._stopped = False  # closed: submit no more
        self._refused: BaseException | None = None  # why the scheduler took no more (it stopped)
        self._next = 0
        self._closed = False

    def _start(self) -> None:
        self._feed(self.ahead)
        if self._refused is not None and self._submitted == 0:  # nothing will ever arrive: the caller's error
            raise self._refused

    def _feed(self, n: int) -> None:
        with self._lock:
            for _ in range(n):
                if self._stopped or self._submitted >= len(self.reqs):
                    return
                i = self._submitted
                try:
                    self.owner.scheduler.submit(self.reqs[i], self._on_done)
                except Exception as exc:  # noqa: BLE001 -- the scheduler stopped: the stream ends with the error
                    self._stopped, self._refused = True, exc
                    if i:
                        self._loop.call_soon_threadsafe(self.queue.put_nowait, (i, None, None, exc))
                    return
                self._submitted += 1

    def _on_done(self, req: NARRequest, tokens, wav, err) -> None:  # scheduler's worker thread
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, (self._index[req.request_id], tokens, wav, err))
        except RuntimeError:  # the stream's event loop is gone: nobody reads this stream any more
            self._stop()
            return
        if err is None:
            self._feed(1)

    def _stop(self) -> list[str]:
        """Submit nothing more; the ids of the pieces already submitted (to cancel)."""
        with self._lock:
            self._stopped = True
            return [r.request_id for r in self.reqs[:self._submitted]]

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[np.ndarray]:
        ready: dict[int, tuple[Any, Any]] = {}
        try:
            while self._next < len(self.reqs):
                i, tokens, wav, err = await self.queue.get()
                if err is not None:
                    self.finish_reason = "abort"
                    raise RuntimeError(f"speech generation failed: {err}")
                ready[i] = (tokens, wav)
                while self._next in ready:
                    tokens, wav = ready.pop(self._next)
                    self._next += 1
                    self.frames += tokens.T.tolist()
                    if self.first_audio is None:
                        self.first_audio = time.perf_counter()
                    yield finish_audio(wav, self.ref) if wav is not None else np.zeros(0, np.float32)
            self.finish_reason = "stop"
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.owner._done(self)


class AsyncOmniVoice(_OmniVoiceBase):
    #: what the speech route may pass (the autoregressive AsyncTTS takes neither)
    supports_speed = True
    supports_reference_audio = True

    def __init__(self, ov: LoadedOmniVoice, *, pieces_ahead: int = 2, **kwargs: Any) -> None:
        """``pieces_ahead``: how many pieces of one long request are queued or running at a time."""
        super().__init__(ov, **kwargs)
        self.pieces_ahead = max(1, pieces_ahead)
        self.observers: list[Callable[[SpeechTiming], None]] = []
        self.frames_generated = 0
        self._streams: dict[str, OmniVoiceStream] = {}

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def check_health(self) -> None:
        self.scheduler.check_health()

    def synthesize(self, text: str, *, voice: str | None = None, language: str | None = None,
                   instructions: str | None = None, params: SpeechParams = SpeechParams(),
                   request_id: str | None = None, speed: float = 1.0, ref_audio: bytes | None = None,
                   ref_text: str | None = None) -> OmniVoiceStream:
        """Validate and queue one request (``TTSInputError`` on bad input, before anything streams)."""
        self.check_health()
        rid = request_id or f"speech-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        reqs, ref = self.requests.build(rid, text, voice=voice, language=language, instructions=instructions,
                                        params=params, speed=speed, ref_audio=ref_audio, ref_text=ref_text)
        stream = OmniVoiceStream(self, rid, reqs, ref, self.pieces_ahead)
        self._streams[rid] = stream
        try:
            stream._start()
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    def _done(self, stream: OmniVoiceStream) -> None:
        if self._streams.pop(stream.request_id, None) is None:
            return
        if stream.finish_reason != "stop":  # closed early (client went away) or failed: drop what still waits
            stream.finish_reason = "abort"
            for rid in stream._stop():
                self.scheduler.cancel(rid)
        now = time.perf_counter()
        frames = len(stream.frames)
        self.frames_generated += frames
        started = [r.started_at for r in stream.reqs if r.started_at is not None]
        timing = SpeechTiming(queue_time=(min(started) if started else now) - stream.arrival, time_to_first_audio=None if stream.first_audio is None
                              else stream.first_audio - stream.arrival, frames=frames,
                              audio_seconds=frames / self.ov.config.frame_rate, wall_seconds=now - stream.arrival,
                              finish_reason=stream.finish_reason)
        for cb in self.observers:
            cb(timing)
