"""Qwen3-TTS on the engine core: loading, request validation, and the shared pieces of the offline ``TTS`` and
the serving ``AsyncTTS``.

A request = text + voice (preset speaker, or for a Base checkpoint a registered clone / reference audio + its
transcript) + language + optional instructions + sampling settings. It becomes
P placeholder token ids (the scheduler's view: P = prompt rows) plus a ``TTSRequestState`` registered with the
runner (prompt embeddings, sampling). The generic ``EngineCore`` (scheduler + paged KV) then drives
``TTSRunner``; codebook-0 ids flow back as tokens and complete frames accumulate in the state.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from strataserve.types.speech import CloneInput, SpeechParams, TTSInputError
from strataserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from strataserve.engine.engine_core import EngineCore
from strataserve.types.protocol import EngineCoreRequest
from strataserve.types.sampling import SamplingParams
from strataserve import envs
from strataserve.models.loader import resolve_device
from strataserve.models.qwen3_tts.codec import CodecDecoder
from strataserve.models.qwen3_tts.config import Qwen3TTSConfig, UnsupportedTTSVariantError, load_tts_config, \
    read_generation_defaults
from strataserve.models.qwen3_tts.loader import load_codec, load_talker, load_voice_cloner
from strataserve.models.qwen3_tts.prompt import build_prompt
from strataserve.models.qwen3_tts.talker import Qwen3TTSTalker
from strataserve.models.qwen3_tts.voice_clone import VoiceClonePrompt, VoiceCloner
from strataserve.runner.attention import kv_cache_bytes_per_block
from strataserve.runner.execution_plan import select_ops
from strataserve.runner.tts_runner import CodeSampling, TTSRequestState, TTSRunner

#: OpenAI's limit for /v1/audio/speech input
MAX_INPUT_CHARS = 4096
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


_REF_DEFAULTS = dict(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, max_new_frames=2048,
                     code_temperature=0.9, code_top_k=50, code_top_p=1.0)
_GEN_KEYS = dict(temperature="temperature", top_k="top_k", top_p="top_p", repetition_penalty="repetition_penalty",
                 max_new_frames="max_new_tokens", code_temperature="subtalker_temperature",
                 code_top_k="subtalker_top_k", code_top_p="subtalker_top_p")


@dataclass
class TTSModel:
    """Everything loaded from one checkpoint folder."""

    config: Qwen3TTSConfig
    talker: Qwen3TTSTalker
    codec: CodecDecoder
    tokenizer: Any  # transformers tokenizer
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    cuda_graphs: bool = False  # the runner mode asks for CUDA graphs (the code predictor's loop is captured)
    cloner: VoiceCloner | None = None  # Base checkpoints: reference audio -> clone prompt; registered voices

    @property
    def voices(self) -> list[str]:
        if self.cloner is not None:
            return sorted(self.cloner.voices)
        return sorted(self.config.speakers) if self.config.model_type == "custom_voice" else ["default"]

    @property
    def languages(self) -> list[str]:
        return self.config.languages

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def codec_device(self) -> torch.device:
        return next(self.codec.parameters()).device


class ServesTTSModel:
    """What a TTS front (offline or async) tells its callers about the model it serves."""

    model: TTSModel

    @property
    def voices(self) -> list[str]:
        return self.model.voices

    @property
    def languages(self) -> list[str]:
        return self.model.languages

    @property
    def sample_rate(self) -> int:
        return self.model.sample_rate


def load_tts_model(model_dir: str | Path, *, device: str = "auto", dtype: str = "auto", mode: str = "auto",
                   max_model_len: int = 4096, voices_dir: str | Path | None = None) -> TTSModel:
    """``voices_dir`` (Base checkpoints): clone voices to register (``voice_clone.py``); default: the checkpoint's
    own ``voices/`` folder when it has one."""
    folder = Path(model_dir)
    cfg = load_tts_config(folder)
    if voices_dir is not None and cfg.model_type != "base":
        raise UnsupportedTTSVariantError(f"{folder}: voices_dir registers cloned voices, which only a Base "
                                         f"checkpoint can use (this one is {cfg.model_type!r})")
    dev = resolve_device(device)
    if dtype == "auto":
        dt = _DTYPES.get(cfg.talker.torch_dtype, torch.bfloat16) if dev.type == "cuda" else torch.float32
    elif dtype in _DTYPES:
        dt = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype={dtype!r}: use one of auto, {', '.join(_DTYPES)}")
    talker, graphs = build_talker(cfg, dev, dt, mode, max_model_len)
    load_talker(folder, talker)
    tune_talker(talker, graphs)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{folder}: cannot load the text tokenizer ({exc})") from None
    cloner = None
    if cfg.model_type == "base":
        cloner = load_voice_cloner(folder, cfg, dev, dt)
        voices = Path(voices_dir) if voices_dir is not None else folder / "voices"
        if voices_dir is not None or voices.is_dir():
            cloner.register_folder(voices)
    return TTSModel(cfg, talker, load_codec(folder, cfg, dev), tok, read_generation_defaults(folder), folder.name,
                    graphs, cloner)


def build_talker(cfg: Qwen3TTSConfig, dev: torch.device, dt: torch.dtype, mode: str,
                 max_model_len: int) -> tuple[Qwen3TTSTalker, bool]:
    """The (uninitialised) talker with the runner mode's ops; True when the mode wants CUDA graphs."""
    plan = select_ops(mode, cfg.talker, dev)
    talker = Qwen3TTSTalker(cfg, plan.ops, select_ops(mode, cfg.code_predictor, dev).ops, dt, dev,
                            min(max_model_len, cfg.talker.max_position_embeddings))
    return talker, plan.cuda_graphs


def tune_talker(talker: Qwen3TTSTalker, cuda_graphs: bool) -> None:
    """Hybrid mode: the talker's and the code predictor's batch-1 matmuls (and the norms / SiLU-mul before them)
    as the LLM runner tunes its own (``runner/gemv_tuning.py``); one stream decodes both at batch 1. Call it after
    the weights are in and before any graph is captured."""
    if not (cuda_graphs and envs.STRATA_GEMV_TUNE):
        return
    from strataserve.runner.gemv_tuning import apply_tuning

    for model in (talker.talker, talker.predictor):
        apply_tuning(model, model.ops)


def resolve_params(p: SpeechParams, defaults: dict[str, Any]) -> tuple[SamplingParams, CodeSampling]:
    """Fill unset fields (checkpoint defaults, then the reference's); raise TTSInputError on bad values."""
    if p.num_step is not None or p.guidance_scale is not None:  # the message starts with the field that was set
        key, value = ("num_step", p.num_step) if p.num_step is not None else ("guidance_scale", p.guidance_scale)
        raise TTSInputError(f"{key}={value}: num_step and guidance_scale apply to non-autoregressive models "
                            "(OmniVoice); this model generates frame by frame: omit them")
    v = {}
    for name, ref in _REF_DEFAULTS.items():
        given = getattr(p, name)
        v[name] = given if given is not None else defaults.get(_GEN_KEYS[name], ref)
    if defaults.get("do_sample") is False and p.temperature is None:
        v["temperature"] = 0.0
    if defaults.get("subtalker_dosample") is False and p.code_temperature is None:
        v["code_temperature"] = 0.0
    frames = int(v["max_new_frames"])
    if frames < 1:  # checked here so the error names the speech field, not SamplingParams' max_tokens
        raise TTSInputError(f"max_new_frames={frames} is out of range: must be >= 1")
    try:
        sp = SamplingParams(temperature=float(v["temperature"]), top_k=int(v["top_k"]), top_p=float(v["top_p"]),
                            repetition_penalty=float(v["repetition_penalty"]), seed=p.seed,
                            max_tokens=frames, min_tokens=min(2, frames))
    except ValueError as exc:
        raise TTSInputError(str(exc)) from None
    try:  # validated like the talker's; the message names the code_* field the caller set
        cs_params = SamplingParams(temperature=float(v["code_temperature"]), top_k=int(v["code_top_k"]),
                                   top_p=float(v["code_top_p"]))
    except ValueError as exc:
        raise TTSInputError(f"code_{exc}") from None
    return sp, CodeSampling(cs_params.temperature, cs_params.top_k, cs_params.top_p)


def encode_reference(model: TTSModel, clone: CloneInput) -> CloneInput:
    """Run the encoders on ``clone.ref_audio`` now (a server does it on a worker thread, off its event loop);
    raises TTSInputError for unusable audio or a missing transcript. Other checks stay with ``build_request``."""
    if clone.ref_audio is None or clone.encoded is not None or model.cloner is None:
        return clone
    try:
        prompt = model.cloner.prompt(clone.ref_audio, clone.ref_text, bool(clone.x_vector_only),
                                     allow_paths=clone.allow_paths)
    except ValueError as exc:
        raise TTSInputError(str(exc)) from None
    return replace(clone, encoded=prompt)


def _clone_prompt(model: TTSModel, voice: str | None, clone: CloneInput) -> VoiceClonePrompt:
    cloner = model.cloner
    assert cloner is not None
    if clone.ref_audio is not None:
        if voice not in (None, "", "default"):
            raise TTSInputError(f"voice {voice!r} and ref_audio were both given: send a registered voice, or "
                                "ref_audio (+ ref_text) for a voice of its own")
        prompt = encode_reference(model, clone).encoded
        assert prompt is not None
        return prompt
    if clone.ref_text:
        raise TTSInputError("ref_text was given without ref_audio: send the reference audio too")
    if clone.x_vector_only and not voice:
        raise TTSInputError("x_vector_only was given without ref_audio: send the clip whose speaker it takes")
    if not voice or voice.lower() not in cloner.voices:
        names = ", ".join(model.voices) or "none registered"
        raise TTSInputError(f"voice {voice!r} is not available: this Base model clones a voice from ref_audio "
                            f"(+ ref_text), or speaks as a registered voice ({names})")
    found = cloner.voices[voice.lower()]
    if clone.x_vector_only and found.in_context:
        return VoiceClonePrompt(found.speaker_embedding, None, None)
    return found


def build_request(model: TTSModel, request_id: str, text: str, *, voice: str | None, language: str | None,
                  instructions: str | None, params: SpeechParams, clone: CloneInput = CloneInput(),
                  ) -> tuple[EngineCoreRequest, TTSRequestState]:
    """Validate one request and build what the engine core and the runner need (raises TTSInputError)."""
    cfg = model.config
    if not text or not text.strip():
        raise TTSInputError("input is empty: give the text to speak")
    if len(text) > MAX_INPUT_CHARS:
        raise TTSInputError(f"input has {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
    lang = (language or "auto").lower()
    if lang not in cfg.languages:
        raise TTSInputError(f"language {language!r} is not supported; supported: {', '.join(cfg.languages)}")
    speaker: str | None = None
    cloned: VoiceClonePrompt | None = None
    if cfg.model_type != "base" and clone.given:
        raise TTSInputError(f"ref_audio, ref_text and x_vector_only are for voice cloning, which needs a Base "
                            f"checkpoint; this model is {cfg.model_type!r}: drop those fields")
    if cfg.model_type == "base":
        if instructions:
            raise TTSInputError("instructions are not supported by a Base (voice cloning) model: drop them")
        cloned = _clone_prompt(model, voice, clone)
    elif cfg.model_type == "custom_voice":
        if not voice:
            raise TTSInputError(f"voice is required for this model: one of {', '.join(model.voices)}")
        if voice.lower() not in cfg.speakers:
            raise TTSInputError(f"voice {voice!r} is not available; voices: {', '.join(model.voices)}")
        speaker = voice.lower()
    elif voice not in (None, "", "default"):
        raise TTSInputError(f"voice {voice!r} is not available: this VoiceDesign model takes its voice from "
                            "`instructions`; use voice 'default'")
    if instructions and cfg.model_type == "custom_voice" and cfg.model_size == "0b6":
        instructions = None  # the reference ignores instructions on the 0.6B CustomVoice model
    if instructions and len(instructions) > MAX_INPUT_CHARS:
        raise TTSInputError(f"instructions have {len(instructions)} characters; the limit is {MAX_INPUT_CHARS}")
    sp, cs = resolve_params(params, model.generation_defaults)
    tok = model.tokenizer
    ids = tok(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    ins = tok(f"<|im_start|>user\n{instructions}<|im_end|>\n")["input_ids"] if instructions else None
    if cloned is None:
        prompt = build_prompt(model.talker, ids, lang, speaker, ins)
    else:
        ref_ids = tok(f"<|im_start|>assistant\n{cloned.ref_text}<|im_end|>\n")["input_ids"] if cloned.in_context \
            else None
        try:
            prompt = build_prompt(model.talker, ids, lang, None, None, speaker_embed=cloned.speaker_embedding,
                                  ref_ids=ref_ids, ref_codes=cloned.ref_codes)
        except ValueError as exc:
            raise TTSInputError(str(exc)) from None
    state = TTSRequestState(prompt, sp, cs)
    if cloned is not None and cloned.ref_codes is not None:
        state.ref_frames = cloned.ref_codes.tolist()
    # placeholders: never looked at (the runner feeds the prompt's rows); prefix caching is off for TTS
    req = EngineCoreRequest(request_id=request_id, prompt_token_ids=[0] * prompt.length, sampling_params=sp,
                            eos_token_id=cfg.codec_eos_id)
    return req, state


def build_core(model: TTSModel, *, max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
               block_size: int = 16, num_blocks: int | None = None, kv_cache_memory_gib: float = 0.5,
               ) -> tuple[EngineCore, TTSRunner]:
    t = model.config.talker
    max_model_len = int(model.talker.talker.cos_sin_cache.shape[0])  # the rotary table load_tts_model sized
    if num_blocks is None:
        per_block = kv_cache_bytes_per_block(t.num_layers, block_size, t.num_kv_heads, t.head_dim, model.talker.dtype)
        num_blocks = max(2, int(kv_cache_memory_gib * (1 << 30)) // per_block - 1)
    runner = TTSRunner(model.talker, num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, cuda_graphs=model.cuda_graphs)
    cfg = EngineConfig(model=ModelConfig(model=model.name or "qwen3-tts"),
                       cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=max_num_batched_tokens))
    return EngineCore(cfg, runner), runner
