"""Reference audio for voice cloning: decode what a caller sends into mono float32 at the model's rate.

Accepted: an audio file's bytes (wav, flac, ogg, mp3: whatever libsndfile reads), the same as base64 or as a
``data:audio/...;base64,`` URL, raw PCM as ``data:audio/pcm;rate=24000;base64,...`` (16-bit little-endian mono,
OpenAI's ``pcm``; the rate defaults to 24 kHz), a ``(waveform, sample_rate)`` pair, and (offline only) a file
path. Several channels are averaged. Resampling uses soxr at the "HQ" setting and fixes the length to
ceil(n * ratio), exactly what the reference gets from ``librosa.resample``'s default.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
from pathlib import Path
from typing import Union

import numpy as np

AudioSource = Union[str, bytes, Path, "tuple[np.ndarray, int]"]
#: longer references only lengthen the prompt (12.5 rows a second) without helping the clone
MAX_REF_SECONDS = 60.0
MIN_REF_SECONDS = 0.1


class AudioInputError(ValueError):
    """Reference audio that cannot be used (say why and what to send instead)."""


def _pcm_data_url(header: str, payload: bytes) -> tuple[np.ndarray, int]:
    rate = 24000
    for part in header.split(";")[1:]:
        if part.startswith("rate="):
            try:
                rate = int(part[5:])
            except ValueError:
                raise AudioInputError(f"ref_audio: bad rate in {header!r}; write e.g. rate=24000") from None
    if len(payload) % 2:
        raise AudioInputError("ref_audio: raw PCM must be 16-bit samples (an even number of bytes)")
    return np.frombuffer(payload, dtype="<i2").astype(np.float32) / 32768.0, rate


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)  # `base64 clip.wav` wraps at 76 columns
    except (binascii.Error, ValueError):
        raise AudioInputError("ref_audio is not valid base64 (send an audio file's bytes base64-encoded, or a "
                              "data:audio/...;base64, URL)") from None


def _read_file_bytes(data: bytes) -> tuple[np.ndarray, int]:
    import soundfile as sf

    try:
        wav, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=False)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        reason = getattr(exc, "error_string", None) or exc  # libsndfile's text without the buffer's repr
        raise AudioInputError(f"ref_audio could not be decoded as an audio file ({reason}); send wav, flac, ogg or "
                              "mp3 bytes, or raw 16-bit PCM as data:audio/pcm;rate=24000;base64,...") from None
    return wav, int(sr)


def decode_audio(source: AudioSource, *, allow_paths: bool = False) -> tuple[np.ndarray, int]:
    """-> (mono float32 waveform, its sample rate). ``allow_paths``: a str naming an existing file is read
    (never for network input)."""
    if isinstance(source, tuple):
        if len(source) != 2 or not isinstance(source[0], np.ndarray):
            raise AudioInputError("ref_audio as a tuple must be (waveform ndarray, sample_rate)")
        wav, sr = np.asarray(source[0], dtype=np.float32), int(source[1])
    elif isinstance(source, (bytes, bytearray)):
        wav, sr = _read_file_bytes(bytes(source))
    elif isinstance(source, Path) or (allow_paths and isinstance(source, str) and len(source) < 4096
                                      and Path(source).is_file()):
        if not allow_paths or not Path(source).is_file():
            raise AudioInputError(f"ref_audio file {str(source)!r} does not exist")
        wav, sr = _read_file_bytes(Path(source).read_bytes())
    elif isinstance(source, str):
        text = source.strip()
        if text.startswith("data:"):
            header, sep, payload = text.partition(",")
            if not sep or not header.endswith(";base64"):
                raise AudioInputError("ref_audio data URL must be data:<mime>;base64,<data>")
            raw = _b64(payload)
            is_pcm = header[5:].split(";")[0].lower() in ("audio/pcm", "audio/l16le", "audio/s16le")
            wav, sr = _pcm_data_url(header[:-7], raw) if is_pcm else _read_file_bytes(raw)
        else:
            wav, sr = _read_file_bytes(_b64(text))
    else:
        raise AudioInputError(f"ref_audio of type {type(source).__name__} is not supported; send base64 audio, "
                              "bytes or a (waveform, sample_rate) pair")
    if wav.ndim == 2:
        wav = wav.mean(axis=-1)
    if wav.ndim != 1:
        raise AudioInputError(f"ref_audio must be mono or [samples, channels]; got shape {wav.shape}")
    if not 1000 <= sr <= 384000:
        raise AudioInputError(f"ref_audio sample rate {sr} Hz is out of range (1 kHz .. 384 kHz)")
    seconds = len(wav) / sr
    if not MIN_REF_SECONDS <= seconds <= MAX_REF_SECONDS:
        raise AudioInputError(f"ref_audio lasts {seconds:.2f} s; give between {MIN_REF_SECONDS} and "
                              f"{MAX_REF_SECONDS:.0f} seconds of speech")
    if not np.isfinite(wav).all():
        raise AudioInputError("ref_audio holds NaN or infinite samples")
    return wav.astype(np.float32), sr


def resample(wav: np.ndarray, sr: int, target: int) -> np.ndarray:
    """``wav`` at ``sr`` -> float32 at ``target`` (soxr HQ, length ceil(n * target / sr))."""
    if sr == target:
        return wav.astype(np.float32)
    import soxr

    out = soxr.resample(wav.astype(np.float32), sr, target, quality="soxr_hq")
    n = int(math.ceil(len(wav) * float(target) / sr))
    out = out[:n] if len(out) >= n else np.pad(out, (0, n - len(out)))
    return out.astype(np.float32)
