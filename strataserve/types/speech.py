"""Speech request settings, input errors and per-request timings: what the API and the TTS engines exchange."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strataserve.models.qwen3_tts.audio_input import AudioSource
    from strataserve.models.qwen3_tts.voice_clone import VoiceClonePrompt


class TTSInputError(ValueError):
    """A request the model cannot serve as given (empty/over-long text, unknown voice or language, ...)."""


@dataclass(frozen=True)
class SpeechParams:
    """Sampling for one request; None = the checkpoint's generation_config.json, else the reference defaults."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_new_frames: int | None = None
    code_temperature: float | None = None  # the reference's subtalker_* settings
    code_top_k: int | None = None
    code_top_p: float | None = None
    # non-autoregressive models (OmniVoice) only: unmasking steps and classifier-free guidance scale
    num_step: int | None = None
    guidance_scale: float | None = None


@dataclass
class SpeechTiming:
    """One finished (or aborted) request, for metrics."""

    queue_time: float  # arrival -> first scheduled (s)
    time_to_first_audio: float | None  # arrival -> first chunk handed to the caller (s)
    frames: int
    audio_seconds: float
    wall_seconds: float  # arrival -> finish
    finish_reason: str

    @property
    def real_time_factor(self) -> float:
        """wall time per second of audio (< 1 is faster than real time)."""
        return self.wall_seconds / self.audio_seconds if self.audio_seconds else float("inf")


@dataclass(frozen=True)
class CloneInput:
    """Per-request voice cloning (Base checkpoints): reference audio, its transcript, x-vector-only mode."""

    ref_audio: AudioSource | None = None
    ref_text: str | None = None
    x_vector_only: bool | None = None
    allow_paths: bool = False  # offline callers may name a file; network input never reads the server's disk
    encoded: VoiceClonePrompt | None = None  # ref_audio already encoded (``encode_reference``)

    @property
    def given(self) -> bool:
        return self.ref_audio is not None or bool(self.ref_text) or self.x_vector_only is not None


@dataclass(frozen=True)
class BatchStats:
    """What one batch cost: its bucket and how much of the canvas was padding."""

    batch_size: int
    bucket: tuple[int, int, int]  # (B_pad, T_pad, L_pad)
    padding_waste: float  # fraction of canvas positions that were padding
    seconds: float
