"""``POST /v1/audio/speech`` (OpenAI's request shape) for TTS engines.

``make_speech_router(resolve)``: ``resolve(model_name | None)`` returns the ``AsyncTTS``-like object serving that
model or raises ``APIError`` (404). Body: ``model``, ``input``, ``voice``, ``instructions``, ``response_format``
(wav | pcm | flac | mp3; pcm = raw 16-bit little-endian mono at the model's rate), ``speed`` (only 1.0),
``stream_format`` ("audio": the body streams as frames are decoded; "sse": ``speech.audio.delta`` events with
base64 audio, then ``speech.audio.done``, whose usage counts the talker's prompt positions as input tokens and
codec frames as output tokens; a failure once the stream has started is a last ``error`` event), plus extras: ``language``, ``temperature``, ``top_k``, ``top_p``,
``repetition_penalty``, ``seed``, ``max_new_frames``, Qwen3-TTS's ``code_temperature`` / ``code_top_k`` /
``code_top_p`` (or the reference's ``subtalker_*`` names; ``temperature: 0`` makes the codes greedy too unless
``code_temperature`` is given); voice cloning: ``voice`` names a registered clone,
or ``ref_audio`` (base64 audio file; for Qwen3-TTS Base also ``data:audio/...;base64,`` incl.
``audio/pcm;rate=N``) + ``ref_text`` (its transcript; in-context cloning) or, Qwen3-TTS Base only,
+ ``x_vector_only: true``; for non-autoregressive models (OmniVoice) ``num_step``, ``guidance_scale``
and ``speed``.

Streaming "audio": pcm and wav go out chunk by chunk (the WAV header, sent first, carries the "unknown length"
sizes 0xFFFFFFFF that streaming readers accept); flac and mp3 are encoded once the clip is complete, and mp3 as
SSE is one delta, so that joining the deltas gives one playable file. A client
that disconnects closes the stream, which aborts the request (its slot is freed at the engine's next step).
"""
from __future__ import annotations

import base64
import io
import json
import logging
import struct
from typing import Annotated, Any, AsyncIterator, Callable

import numpy as np
from fastapi import APIRouter
from pydantic import AliasChoices, BaseModel, Field
from starlette.responses import StreamingResponse

from strataserve.api.errors import APIError, bad_request
from strataserve.api.protocol import Int64
from strataserve.types.speech import CloneInput
from strataserve.types.speech import SpeechParams, TTSInputError

log = logging.getLogger("strataserve.api")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg"}
_STREAM_FORMATS = ("audio", "sse")


Finite = Annotated[float, Field(allow_inf_nan=False)]  # NaN / inf: a 400, not a clip of noise


class SpeechRequest(BaseModel):
    model: str | None = None
    input: str
    voice: str | None = None
    instructions: str | None = None
    response_format: str = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0, allow_inf_nan=False)
    stream_format: str = "audio"
    language: str | None = None
    temperature: Finite | None = Field(None, ge=0.0)
    top_k: Int64 | None = None
    top_p: Finite | None = None
    repetition_penalty: Finite | None = None
    seed: Int64 | None = None
    max_new_frames: Int64 | None = None
    # Qwen3-TTS's code predictor (codebooks 1..): the reference's subtalker_* settings, under either name; unset
    # with temperature 0 it is greedy too, so temperature 0 gives one clip (the checkpoint default samples at 0.9)
    code_temperature: Finite | None = Field(None, ge=0.0, validation_alias=AliasChoices(
        "code_temperature", "subtalker_temperature"))
    code_top_k: Int64 | None = Field(None, validation_alias=AliasChoices("code_top_k", "subtalker_top_k"))
    code_top_p: Finite | None = Field(None, validation_alias=AliasChoices("code_top_p", "subtalker_top_p"))
    # non-autoregressive models (OmniVoice): unmasking steps and guidance
    num_step: Int64 | None = None
    guidance_scale: Finite | None = None
    # voice cloning: a reference clip (base64 / data URL) and its transcript; x-vector-only is Qwen3-TTS Base's
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only: bool | None = None


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, num_bytes: int | None = None) -> bytes:
    """44-byte PCM16 mono WAV header; ``num_bytes=None`` writes the streaming "unknown length" sizes."""
    data = 0xFFFFFFFF if num_bytes is None else num_bytes
    riff = 0xFFFFFFFF if num_bytes is None else 36 + num_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
            sample_rate * 2, 2, 16) + b"data" + struct.pack("<I", data))


def encode_clip(x: np.ndarray, fmt: str, sample_rate: int) -> bytes:
    """A whole clip in ``fmt`` (flac / mp3 through soundfile; wav / pcm directly)."""
    if fmt == "pcm":
        return pcm16(x)
    if fmt == "wav":
        body = pcm16(x)
        return wav_header(sample_rate, len(body)) + body
    import soundfile as sf

    buf = io.BytesIO()
    if fmt == "flac":
        sf.write(buf, x, sample_rate, format="FLAC", subtype="PCM_16")
    else:
        sf.write(buf, x, sample_rate, format="MP3", subtype="MPEG_LAYER_III")
    return buf.getvalue()


def _check(body: SpeechRequest) -> str:
    fmt = body.response_format.lower()
    if fmt not in MEDIA_TYPES:
        raise bad_request(f"response_format {body.response_format!r} is not supported; use one of "
                          f"{', '.join(MEDIA_TYPES)}", param="response_format")
    if fmt in ("flac", "mp3"):
        try:
            import soundfile  # noqa: F401
        except ImportError:
            raise bad_request(f"response_format {fmt!r} needs the soundfile package on the server (pip install "
                              "'strataserve[tts]'); wav and pcm always work", param="response_format") from None
    if body.stream_format not in _STREAM_FORMATS:
        raise bad_request(f"stream_format {body.stream_format!r} is not supported; use 'audio' or 'sse'",
                          param="stream_format")
    if body.stream_format == "sse" and fmt == "flac":
        raise bad_request("flac cannot be sent as SSE deltas; use pcm, wav or mp3 with stream_format 'sse'",
                          param="response_format")
    return fmt


def _model_kwargs(body: SpeechRequest, tts: Any) -> dict[str, Any]:
    """What only some speech models take: speed and a reference clip (checked against what ``tts`` supports)."""
    out: dict[str, Any] = {}
    if body.speed != 1.0:
        if not getattr(tts, "supports_speed", False):
            raise bad_request("speed other than 1.0 is not supported by this model (it would need time-stretching "
                              "that changes the voice); omit it or send 1.0", param="speed")
        out["speed"] = body.speed
    if body.ref_text is not None and body.ref_audio is None:
        raise bad_request("ref_text was given without ref_audio: send the reference audio it transcribes",
                          param="ref_text")
    if hasattr(tts, "encode_reference"):  # Qwen3-TTS: the engine checks and encodes the clone (create_speech)
        return out
    if body.x_vector_only is not None:
        raise bad_request("x_vector_only is only for Qwen3-TTS Base models; omit it", param="x_vector_only")
    if body.ref_audio is not None or body.ref_text is not None:
        if not getattr(tts, "supports_reference_audio", False):
            raise bad_request("ref_audio / ref_text (voice cloning from a clip) are not supported by this model",
                              param="ref_audio")
        try:
            # line breaks allowed: `base64 clip.wav` wraps at 76 columns (MIME)
            out["ref_audio"] = None if body.ref_audio is None else base64.b64decode("".join(body.ref_audio.split()),
                                                                                  validate=True)
        except ValueError:
            raise bad_request("ref_audio is not valid base64", param="ref_audio") from None
        out["ref_text"] = body.ref_text
    return out


def _param_of(message: str) -> str | None:
    for key, param in (("input", "input"), ("voice", "voice"), ("language", "language"),
                       ("instructions", "instructions"), ("ref_audio", "ref_audio"), ("ref_text", "ref_text"),
                       ("x_vector_only", "x_vector_only"), ("speed", "speed"), ("num_step", "num_step"),
                       ("guidance_scale", "guidance_scale")):
        if message.startswith(key):
            return param
    head = message.split("=", 1)[0].strip()
    return head if head.isidentifier() and "=" in message else None


async def _audio_body(stream: Any, fmt: str, sr: int) -> AsyncIterator[bytes]:
    async with _closing(stream):
        if fmt in ("pcm", "wav"):
            if fmt == "wav":
                yield wav_header(sr)
            async for pcm in stream:
                yield pcm16(pcm)
            return
        parts = [pcm async for pcm in stream]
        yield encode_clip(np.concatenate(parts) if parts else np.zeros(0, np.float32), fmt, sr)


def _delta(data: bytes) -> bytes:
    return f"data: {json.dumps({'type': 'speech.audio.delta', 'audio': base64.b64encode(data).decode()})}\n\n".encode()


async def _sse_body(stream: Any, fmt: str, sr: int) -> AsyncIterator[bytes]:
    try:
        async for event in _sse_events(stream, fmt, sr):
            yield event
    except Exception as exc:  # noqa: BLE001 - the status line is out: the error is the stream's last event
        log.exception("speech generation failed mid-stream")
        error = {"type": "error", "error": {"message": str(exc) or type(exc).__name__, "type": "server_error"}}
        yield f"data: {json.dumps(error)}\n\n".encode()


async def _sse_events(stream: Any, fmt: str, sr: int) -> AsyncIterator[bytes]:
    async with _closing(stream):
        if fmt == "mp3":
            # one delta with the whole clip: an mp3 per chunk is a file per chunk (its own header and padding),
            # whose join decoders stop reading after the first; the encoder's own header is only right at the end
            parts = [pcm async for pcm in stream]
            yield _delta(encode_clip(np.concatenate(parts) if parts else np.zeros(0, np.float32), fmt, sr))
        else:
            first = True
            async for pcm in stream:
                yield _delta((wav_header(sr) if fmt == "wav" and first else b"") + pcm16(pcm))
                first = False
        frames, prompt = len(stream.frames), stream.input_tokens
        done = {"type": "speech.audio.done",
                "usage": {"input_tokens": prompt, "output_tokens": frames, "total_tokens": prompt + frames}}
        yield f"data: {json.dumps(done)}\n\n".encode()


class _closing:
    """Close the speech stream however the body ends (a disconnect cancels the body: the request aborts)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def __aenter__(self) -> Any:
        return self.stream

    async def __aexit__(self, *exc: Any) -> None:
        await self.stream.aclose()


def make_speech_router(resolve: Callable[[str | None], Any]) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/audio/speech")
    async def create_speech(body: SpeechRequest) -> StreamingResponse:
        fmt = _check(body)
        tts = resolve(body.model)
        code_temperature = body.code_temperature
        if code_temperature is None and body.temperature == 0 and hasattr(tts, "encode_reference"):
            code_temperature = 0.0  # Qwen3-TTS (the model with a code predictor): temperature 0 is one clip
        params = SpeechParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                              repetition_penalty=body.repetition_penalty, seed=body.seed,
                              max_new_frames=body.max_new_frames, num_step=body.num_step,
                              guidance_scale=body.guidance_scale, code_temperature=code_temperature,
                              code_top_k=body.code_top_k, code_top_p=body.code_top_p)
        extra = _model_kwargs(body, tts)
        try:
            if hasattr(tts, "encode_reference"):  # voice cloning: encoders off the event loop
                clone = CloneInput(body.ref_audio, body.ref_text, body.x_vector_only)
                extra["clone"] = await tts.encode_reference(clone)
            stream = tts.synthesize(body.input, voice=body.voice, language=body.language,
                                    instructions=body.instructions, params=params, **extra)
        except TTSInputError as exc:
            raise APIError(400, str(exc), param=_param_of(str(exc))) from None
        sr = tts.sample_rate
        if body.stream_format == "sse":
            return StreamingResponse(_sse_body(stream, fmt, sr), media_type="text/event-stream")
        return StreamingResponse(_audio_body(stream, fmt, sr), media_type=MEDIA_TYPES[fmt])

    return router
