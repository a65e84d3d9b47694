"""Turn one speech request for OmniVoice into runner requests: validate every input (``TTSInputError`` naming
what to change), resolve the voice (auto, a registered voice, or a reference clip's tokens), normalise language and
voice-design instructions, estimate the clip length, and split long text into sentence chunks.

Chunks: text whose estimated audio is longer than ``chunk_threshold_s`` is cut at sentence ends (then commas,
then spaces) into pieces of at most ``chunk_s``; the served front submits them a few at a time
(``omnivoice_tts.OmniVoiceStream``) and streams each as soon as it is decoded. Every piece keeps the request's
voice (reference or instructions).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from strataserve.engine.tts_engine import MAX_INPUT_CHARS
from strataserve.types.speech import SpeechParams, TTSInputError
from strataserve.models.omnivoice.loader import LoadedOmniVoice
from strataserve.models.omnivoice.prompt import VoiceReference, build_input_ids, estimate_frames
from strataserve.runner.nar_runner import NARRequest, UnmaskSettings

#: voice names meaning "no reference: the model picks a voice" (or the instructions design it)
AUTO_VOICES = ("auto", "default")
#: common language names -> the ids the model was trained with; ISO 639 codes pass through as given
_LANGUAGE_NAMES = {"english": "en", "chinese": "zh", "mandarin": "zh", "japanese": "ja", "korean": "ko",
                   "german": "de", "french": "fr", "spanish": "es", "italian": "it", "portuguese": "pt",
                   "russian": "ru", "arabic": "ar", "hindi": "hi", "dutch": "nl", "turkish": "tr"}
_CODE_RE = re.compile(r"^[a-z]{2,3}$")
_SEPARATORS = (re.compile(r"(?<=[.!?;。！？；])\s*"), re.compile(r"(?<=[,，、])\s*"), re.compile(r"\s+"))
_MAX_INSTRUCTIONS = 512
_MAX_CHUNK_S = 60.0  # the canvas of one piece; longer pieces get split at commas / spaces


@dataclass(frozen=True)
class ChunkPolicy:
    chunk_threshold_s: float = 30.0  # the reference's defaults
    chunk_s: float = 15.0


def resolve_language(language: str | None) -> str | None:
    if language is None or language.strip().lower() in ("", "auto", "none"):
        return None
    key = language.strip().lower()
    if key in _LANGUAGE_NAMES:
        return _LANGUAGE_NAMES[key]
    if _CODE_RE.match(key):
        return key
    raise TTSInputError(f"language {language!r} is not recognised: give an ISO 639 code such as 'en' or 'zh', "
                        f"one of {', '.join(sorted(_LANGUAGE_NAMES))}, or 'auto'")


def normalize_instructions(text: str | None) -> str | None:
    """Comma-separated voice-design items (e.g. "female, low pitch, british accent"), lower-cased, one separator."""
    if text is None or not text.strip():
        return None
    if len(text) > _MAX_INSTRUCTIONS:
        raise TTSInputError(f"instructions has {len(text)} characters; the limit is {_MAX_INSTRUCTIONS}")
    items = [x.strip().lower() for x in re.split(r"\s*[,，]\s*", text.strip()) if x.strip()]
    zh = any("\u4e00" <= ch <= "\u9fff" for item in items for ch in item)
    return ("，" if zh else ", ").join(items)


def settings_from(p: SpeechParams) -> UnmaskSettings:
    unused = [n for n in ("top_k", "top_p", "repetition_penalty", "max_new_frames", "code_temperature",
                          "code_top_k", "code_top_p") if getattr(p, n) is not None]
    if unused:
        raise TTSInputError(f"{unused[0]}={getattr(p, unused[0])}: not used by this model (it unmasks a whole clip; "
                            "use num_step, guidance_scale, temperature and seed)")
    d = UnmaskSettings()
    try:
        return UnmaskSettings(num_step=d.num_step if p.num_step is None else int(p.num_step),
                              guidance_scale=d.guidance_scale if p.guidance_scale is None else float(p.guidance_scale),
                              class_temperature=d.class_temperature if p.temperature is None else float(p.temperature))
    except ValueError as exc:
        raise TTSInputError(str(exc)) from None


def split_text(text: str, frames_of: Callable[[str], int], max_frames: int, level: int = 0) -> list[str]:
    """Pieces of ``text`` each estimated at most ``max_frames``: sentence ends first, then commas, then spaces."""
    if frames_of(text) <= max_frames or level == len(_SEPARATORS):
        return [text]
    out, cur = [], ""
    for part in (x.strip() for x in _SEPARATORS[level].split(text) if x.strip()):
        cand = f"{cur} {part}" if cur else part
        if cur and frames_of(cand) > max_frames:
            out.append(cur)
            cand = part
        cur = cand
    out.append(cur)
    return [q for p in out for q in split_text(p, frames_of, max_frames, level + 1)]


class OmniVoiceRequests:
    """Builds runner requests for one loaded model (voices, tokenizer, codec rates)."""

    def __init__(self, ov: LoadedOmniVoice, policy: ChunkPolicy = ChunkPolicy(),
                 encode_reference=None) -> None:
        self.ov, self.policy = ov, policy
        #: ``audio file bytes -> (tokens [C, T], rms)``; None: cloning from raw audio is not available
        self.encode_reference = encode_reference

    @property
    def voices(self) -> list[str]:
        return list(AUTO_VOICES[:1]) + sorted(self.ov.voices)

    def voice(self, voice: str | None, ref_audio: bytes | None, ref_text: str | None) -> VoiceReference | None:
        if ref_audio is not None:
            if not ref_text or not ref_text.strip():
                raise TTSInputError("ref_text is required with ref_audio: the transcript of the reference clip")
            if self.encode_reference is None:
                raise TTSInputError("ref_audio: voice cloning from raw audio needs the audio tokenizer's encoder "
                                    "(torchaudio) on the server; register the voice instead (voices/NAME.pt)")
            try:
                tokens, rms = self.encode_reference(ref_audio)
            except ValueError as exc:
                raise TTSInputError(str(exc)) from None
            return VoiceReference(tokens, ref_text.strip(), rms)
        if voice is None or voice.lower() in AUTO_VOICES:
            return None
        ref = self.ov.voices.get(voice.lower())
        if ref is None:
            raise TTSInputError(f"voice {voice!r} is not registered; available: {', '.join(self.voices)}")
        return ref

    def build(self, request_id: str, text: str, *, voice: str | None = None, language: str | None = None,
              instructions: str | None = None, params: SpeechParams = SpeechParams(), speed: float = 1.0,
              ref_audio: bytes | None = None, ref_text: str | None = None,
              seed: int | None = None) -> tuple[list[NARRequest], VoiceReference | None]:
        if not text or not text.strip():
            raise TTSInputError("input is empty: give the text to speak")
        if len(text) > MAX_INPUT_CHARS:
            raise TTSInputError(f"input has {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
        if not 0.25 <= speed <= 4.0:
            raise TTSInputError(f"speed={speed}: must be in [0.25, 4]")
        settings = settings_from(params)
        lang, instr = resolve_language(language), normalize_instructions(instructions)
        ref = self.voice(voice, ref_audio, ref_text)
        cfg = self.ov.config
        fr = cfg.frame_rate / 25  # the estimate counts 25 Hz frames

        def frames_of(t: str) -> int:
            return max(1, int(estimate_frames(t, ref, speed) * fr))

        pieces = [text.strip()]
        if frames_of(text) > self.policy.chunk_threshold_s * cfg.frame_rate:
            pieces = split_text(text.strip(), frames_of, int(self.policy.chunk_s * cfg.frame_rate))
        limit = int(_MAX_CHUNK_S * cfg.frame_rate)
        base = params.seed if params.seed is not None else (seed if seed is not None else
                                                             int(torch.randint(0, 2**31 - 1, ()).item()))
        reqs = []
        for i, piece in enumerate(pieces):
            n = min(frames_of(piece), limit)
            ids, a0 = build_input_ids(self.ov.tokenizer, piece, n, cfg.num_codebooks, cfg.audio_mask_id,
                                      language=lang, instruct=instr, ref=ref)
            max_pos = int(self.ov.model.backbone.cos_sin_cache.shape[0])
            if ids.shape[1] > max_pos:
                raise TTSInputError(f"input: prompt, reference clip and audio need {ids.shape[1]} positions; the "
                                    f"model takes {max_pos}: shorten the text or the reference clip")
            reqs.append(NARRequest(f"{request_id}.{i}", ids, a0, n, settings, base + i))
        return reqs, ref
