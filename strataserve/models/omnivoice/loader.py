"""Load an OmniVoice checkpoint folder: config, network, text tokenizer, audio decoder, registered voices.

Registered voices are ``voices/NAME.pt`` files in the folder, as the reference's ``VoiceClonePrompt.save``
writes them (a dict with ``ref_audio_tokens`` ``[C, T]``, ``ref_text``, ``ref_rms``): cloning a voice by name needs
no audio encoder.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strataserve.models.loader import resolve_device
from strataserve.models.omnivoice.codec import HiggsDecoder, load_higgs_decoder
from strataserve.models.omnivoice.config import MissingCheckpointFileError, OmniVoiceConfig, load_omnivoice_config
from strataserve.models.omnivoice.model import OmniVoiceModel, init_random_omnivoice, load_omnivoice_weights
from strataserve.models.omnivoice.prompt import VoiceReference
from strataserve.runner.execution_plan import select_ops

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedOmniVoice:
    config: OmniVoiceConfig
    model: OmniVoiceModel
    codec: HiggsDecoder | None
    tokenizer: Any
    voices: dict[str, VoiceReference] = field(default_factory=dict)
    name: str = ""
    cuda_graphs: bool = False
    folder: Path | None = None


def _resolve_dtype(dtype: str, cfg: OmniVoiceConfig, dev: torch.device) -> torch.dtype:
    if dtype == "auto":
        # the backbone's own config often says float32 (the package saves its sub-config as built, whatever the
        # weights): on a GPU that would run the canvas in fp32, ~10x slower than bf16 for no audible gain
        half = cfg.llm.torch_dtype if cfg.llm.torch_dtype in ("bfloat16", "float16") else "bfloat16"
        return _DTYPES[half] if dev.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def build_omnivoice(cfg: OmniVoiceConfig, device: torch.device, dtype: torch.dtype, mode: str,
                    max_positions: int) -> tuple[OmniVoiceModel, bool]:
    """The uninitialised network with the runner mode's ops; True when the mode wants CUDA graphs."""
    plan = select_ops(mode, cfg.llm, device)
    return OmniVoiceModel(cfg, plan.ops, dtype, device, max_positions), plan.cuda_graphs


def load_voices(folder: Path) -> dict[str, VoiceReference]:
    voices = {}
    for path in sorted((folder / "voices").glob("*.pt")):
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            voices[path.stem.lower()] = VoiceReference(data["ref_audio_tokens"].long(), str(data["ref_text"]),
                                                       float(data["ref_rms"]) if data.get("ref_rms") else None)
        except (KeyError, RuntimeError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not a saved voice prompt (needs ref_audio_tokens, ref_text): {exc}") from None
    return voices


def load_omnivoice(model_dir: str | Path, *, device: str = "auto", dtype: str = "auto", mode: str = "auto",
                   max_positions: int = 4096, random_weights: bool = False) -> LoadedOmniVoice:
    """``random_weights``: keep the folder's shapes but draw the weights (benchmarks without the real model)."""
    folder = Path(model_dir)
    cfg = load_omnivoice_config(folder)
    dev = resolve_device(device)
    model, graphs = build_omnivoice(cfg, dev, _resolve_dtype(dtype, cfg, dev), mode,
                                    min(max_positions, cfg.llm.max_position_embeddings))
    if random_weights:
        init_random_omnivoice(model)
    else:
        load_omnivoice_weights(folder, model)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise MissingCheckpointFileError(f"{folder}: cannot load the text tokenizer ({exc})") from None
    missing = [t for t in ("<|text_start|>", "<|lang_start|>", "<|instruct_start|>")
               if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
    if missing:
        raise ValueError(f"{folder}: the text tokenizer lacks OmniVoice's special tokens {missing}")
    codec = None if random_weights and not (folder / "audio_tokenizer" / "model.safetensors").is_file() \
        else load_higgs_decoder(folder / "audio_tokenizer", dev)
    return LoadedOmniVoice(cfg, model, codec, tok, load_voices(folder), folder.name, graphs, folder)
