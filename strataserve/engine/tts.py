"""Offline text-to-speech: ``TTS(model=DIR).generate(texts, voice=..., ...)`` -> frames + waveform per text.

    from strataserve import TTS
    tts = TTS(model="path/to/Qwen3-TTS-12Hz-1.7B-CustomVoice")
    out = tts.generate(["Hello there."], voice="ryan", language="english", seed=0)
    soundfile.write("hello.wav", out[0].waveform, out[0].sample_rate)

Voice cloning (a Base checkpoint): ``generate(texts, ref_audio="ref.wav", ref_text="what ref.wav says")``
(in-context), ``x_vector_only=True`` (speaker embedding alone, no transcript), or ``voice=NAME`` for a voice
registered with ``register_voice`` or from a ``voices/`` folder (see ``models/qwen3_tts/voice_clone.py``).

``submit`` / ``step`` expose the continuous batching underneath: requests may join while others run.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TypeVar

import numpy as np
import torch

from strataserve.engine.tts_engine import (
    CloneInput,
    ServesTTSModel,
    TTSModel,
    build_core,
    build_request,
    load_tts_model,
)
from strataserve.types.speech import SpeechParams
from strataserve.models.qwen3_tts.audio_input import AudioSource
from strataserve.models.qwen3_tts.voice_clone import cut_reference

T = TypeVar("T")


@dataclass
class SpeechOutput:
    request_id: str
    frames: np.ndarray  # int64 [num_frames, num_code_groups]
    waveform: np.ndarray  # float32 [num_frames * samples_per_frame]
    sample_rate: int
    finish_reason: str  # "stop" (eos) | "length" (max_new_frames)


def _per_text(value: T | Sequence[T] | None, n: int, name: str) -> list[T | None]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} texts: give one, or one per text")
        return list(value)
    return [value] * n  # type: ignore[list-item]


class TTS(ServesTTSModel):
    def __new__(cls, model: str | Path | TTSModel, **kwargs: object):
        """An OmniVoice folder gets the non-autoregressive runner's offline front (``OmniVoiceTTS``)."""
        from strataserve.models.omnivoice.config import is_omnivoice_dir

        if cls is TTS and isinstance(model, (str, Path)) and is_omnivoice_dir(model):
            from strataserve.engine.omnivoice_tts import OmniVoiceTTS

            load = {k: kwargs[k] for k in ("device", "dtype", "mode") if k in kwargs}
            return OmniVoiceTTS.from_pretrained(model, max_batch=int(kwargs.get("max_num_seqs", 32)), **load)
        return super().__new__(cls)

    def __init__(self, model: str | Path | TTSModel, *, device: str = "auto", dtype: str = "auto",
                 mode: str = "auto", max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 num_blocks: int | None = None, block_size: int = 16, kv_cache_memory_gib: float = 0.5,
                 max_model_len: int = 4096, voices_dir: str | Path | None = None) -> None:
        self.model = model if isinstance(model, TTSModel) else load_tts_model(
            model, device=device, dtype=dtype, mode=mode, max_model_len=max_model_len, voices_dir=voices_dir)
        self.core, self.runner = build_core(self.model, max_num_seqs=max_num_seqs,
                                            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                            num_blocks=num_blocks, kv_cache_memory_gib=kv_cache_memory_gib)
        self._ids = itertools.count()

    def register_voice(self, name: str, ref_audio: AudioSource, ref_text: str | None = None,
                       x_vector_only: bool | None = None) -> None:
        """Keep a cloned voice (Base checkpoints) for ``voice=name``; without ref_text it is x-vector only."""
        if self.model.cloner is None:
            raise ValueError(f"register_voice needs a Base (voice cloning) checkpoint; this model is "
                             f"{self.model.config.model_type!r}")
        self.model.cloner.register(name, ref_audio, ref_text, x_vector_only)

    def submit(self, text: str, *, voice: str | None = None, language: str | None = None,
               instructions: str | None = None, params: SpeechParams = SpeechParams(),
               clone: CloneInput = CloneInput()) -> str:
        """Queue one request (it joins the running batch at the next step); returns its id."""
        rid = f"tts-{next(self._ids)}"
        req, state = build_request(self.model, rid, text, voice=voice, language=language,
                                   instructions=instructions, params=params, clone=clone)
        self.core.check_request(req)
        self.runner.register(rid, state)
        self.core.add_request(req)
        return rid

    def step(self) -> list[SpeechOutput]:
        """Run one engine step; returns the requests that finished in it (audio decoded)."""
        done = []
        for out in self.core.step().outputs:
            if out.finish_reason is not None:
                done.append(self._finish(out.request_id, out.finish_reason))
        return done

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished_requests()

    def generate(self, texts: str | Sequence[str], *, voice: str | Sequence[str] | None = None,
                 language: str | Sequence[str] | None = None, instructions: str | Sequence[str] | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | Sequence[int] | None = None,
                 max_new_frames: int | None = None, code_temperature: float | None = None,
                 ref_audio: AudioSource | Sequence[AudioSource] | None = None,
                 ref_text: str | Sequence[str] | None = None,
                 x_vector_only: bool | Sequence[bool] | None = None) -> list[SpeechOutput]:
        """Synthesize every text (batched); results in input order. Per-text lists are accepted for voice,
        language, instructions, seed and the cloning inputs (ref_audio: a path, audio bytes, base64 or a
        ``(waveform, sample_rate)`` pair). ``temperature=0`` (and ``code_temperature=0``) is greedy."""
        items = [texts] if isinstance(texts, str) else list(texts)
        n = len(items)
        voices, langs = _per_text(voice, n, "voice"), _per_text(language, n, "language")
        instrs, seeds = _per_text(instructions, n, "instructions"), _per_text(seed, n, "seed")
        refs = _per_text(ref_audio, n, "ref_audio") if isinstance(ref_audio, list) else [ref_audio] * n
        ref_texts, xvecs = _per_text(ref_text, n, "ref_text"), _per_text(x_vector_only, n, "x_vector_only")
        ids: list[str] = []
        try:
            for i, text in enumerate(items):
                params = SpeechParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                      repetition_penalty=repetition_penalty, seed=seeds[i],
                                      max_new_frames=max_new_frames, code_temperature=code_temperature)
                clone = CloneInput(refs[i], ref_texts[i], xvecs[i], allow_paths=True)
                try:
                    ids.append(self.submit(text, voice=voices[i], language=langs[i], instructions=instrs[i],
                                           params=params, clone=clone))
                except ValueError as exc:
                    raise ValueError(f"text {i}: {exc}") from None
            results: dict[str, SpeechOutput] = {}
            while self.has_unfinished():
                for o in self.step():
                    results[o.request_id] = o
        except BaseException:
            self.core.abort_requests(ids)
            for rid in ids:
                self.runner.release(rid, deferred=False)
            raise
        return [results[r] for r in ids]

    def _finish(self, rid: str, reason: str) -> SpeechOutput:
        st = self.runner.states[rid]
        self.runner.release(rid, deferred=False)
        g = self.model.config.num_code_groups
        frames = torch.tensor(st.frames, dtype=torch.long).reshape(-1, g)
        wav = np.zeros(0, dtype=np.float32)
        if len(frames):
            ref = torch.tensor(st.ref_frames, dtype=torch.long).reshape(-1, g)  # in-context cloning: decode after it
            codes = torch.cat([ref, frames]).T[None].to(self.model.codec_device)
            wav = self.model.codec.decode(codes)[0].cpu().numpy().astype(np.float32)
            wav = cut_reference(wav, len(ref), len(ref) + len(frames)) if len(ref) else wav
        return SpeechOutput(rid, frames.numpy(), wav, self.model.sample_rate, reason)

    def shutdown(self) -> None:
        self.core.shutdown()
