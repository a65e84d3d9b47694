"""Layer 4 models: one decoder for Llama/Mistral/Qwen2/Qwen3, HF config parsing, checkpoint loader, tokenizer.

The names below load on first use (PEP 562), so importing a light submodule (``hf_config``,
``qwen3_tts.config``) does not import torch: ``strata serve`` reads checkpoint configs before its heavy imports.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"DecoderModel": "decoder", "SUPPORTED_ARCHITECTURES": "hf_config", "DecoderConfig": "hf_config",
            "load_decoder_config": "hf_config", "build_random_model": "loader", "load_model": "loader",
            "Tokenizer": "tokenizer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
