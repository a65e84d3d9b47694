"""Voice cloning with a Base checkpoint, as the reference's ``generate_voice_clone`` does it: reference audio ->
(x-vector from the speaker encoder, codec frames from the speech tokenizer's encoder) + the reference's
transcript -> a ``VoiceClonePrompt`` that ``build_prompt`` turns into talker rows.

Two modes: in-context (the default; needs ``ref_text``): the x-vector takes the speaker's row and the reference
text and frames enter the prompt, and the reference frames are decoded in front of the generated ones (their
audio is cut off again), so the codec continues the reference's sound; x-vector only: just the speaker row.

Registered voices: a folder of ``NAME.wav`` (or .flac / .ogg / .mp3) files, each with an optional ``NAME.txt``
holding its transcript (in-context) -- without one the voice is x-vector only. They are encoded once at load.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from strataserve.models.qwen3_tts.audio_input import AudioSource, decode_audio, resample
from strataserve.models.qwen3_tts.codec_encoder import CodecEncoder
from strataserve.models.qwen3_tts.speaker_encoder import SpeakerEncoder

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


@dataclass(frozen=True)
class VoiceClonePrompt:
    speaker_embedding: torch.Tensor  # [H] x-vector
    ref_codes: torch.Tensor | None  # long [T, K]; None = x-vector only
    ref_text: str | None

    @property
    def in_context(self) -> bool:
        return self.ref_codes is not None


class VoiceCloner:
    """The Base checkpoint's two encoders; builds clone prompts from reference audio."""

    def __init__(self, speaker_encoder: SpeakerEncoder, codec_encoder: CodecEncoder) -> None:
        self.speaker_encoder, self.codec_encoder = speaker_encoder, codec_encoder
        self.voices: dict[str, VoiceClonePrompt] = {}

    def prompt(self, ref_audio: AudioSource, ref_text: str | None = None, x_vector_only: bool = False, *,
               allow_paths: bool = False) -> VoiceClonePrompt:
        """Raises ValueError (``AudioInputError`` for the audio) naming what to change."""
        if not x_vector_only and not (ref_text and ref_text.strip()):
            raise ValueError("ref_text is required for in-context voice cloning: give the words spoken in "
                             "ref_audio, or set x_vector_only to clone from the speaker embedding alone")
        wav, sr = decode_audio(ref_audio, allow_paths=allow_paths)
        spk_wav = resample(wav, sr, self.speaker_encoder.cfg.sample_rate)
        embedding = self.speaker_encoder.embed(torch.from_numpy(spk_wav))
        codes = None
        if not x_vector_only:
            rate = self.codec_encoder.cfg.input_sample_rate
            codes = self.codec_encoder.encode(torch.from_numpy(resample(wav, sr, rate)))
        return VoiceClonePrompt(embedding, codes, None if x_vector_only else ref_text)

    def register(self, name: str, ref_audio: AudioSource, ref_text: str | None = None,
                 x_vector_only: bool | None = None) -> VoiceClonePrompt:
        """Keep a clone prompt under ``name`` (lower-cased); ``x_vector_only`` defaults to "no ref_text given"."""
        key = name.strip().lower()
        if not key or key == "default":
            raise ValueError(f"voice name {name!r} is not usable; pick a non-empty name other than 'default'")
        xvec = not (ref_text and ref_text.strip()) if x_vector_only is None else x_vector_only
        self.voices[key] = self.prompt(ref_audio, ref_text, xvec, allow_paths=True)
        return self.voices[key]

    def register_folder(self, folder: str | Path) -> list[str]:
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"voices folder {str(folder)!r} is not a directory")
        names = []
        for path in sorted(p for p in folder.iterdir() if p.suffix.lower() in AUDIO_SUFFIXES):
            txt = path.with_suffix(".txt")
            ref_text = txt.read_text().strip() if txt.is_file() else None
            try:
                self.register(path.stem, path, ref_text)
            except ValueError as exc:
                raise ValueError(f"voice {path.name}: {exc}") from None
            names.append(path.stem.lower())
        return names


def cut_reference(wav: np.ndarray, ref_frames: int, total_frames: int) -> np.ndarray:
    """Drop the reference's share of a clip decoded from reference + generated frames (the reference's rule)."""
    return wav[int(ref_frames / max(total_frames, 1) * wav.shape[0]):]
