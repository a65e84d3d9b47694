"""strataserve: one inference-serving stack. ``from strataserve import LLM, SamplingParams`` as with vLLM.

Exports are imported lazily so ``import strataserve`` stays light (no torch until an engine is built).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strataserve.envs import apply_process_defaults

apply_process_defaults()

__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "AsyncLLM", "EngineArgs", "AsyncEngineArgs", "TTS", "AsyncTTS"]
__version__ = "0.1.0"

_WHERE = {
    "LLM": "strataserve.engine.llm",
    "SamplingParams": "strataserve.types.sampling",
    "GuidedDecodingParams": "strataserve.types.sampling",
    "StructuredOutputsParams": "strataserve.types.sampling",
    "RequestOutput": "strataserve.types.outputs",
    "CompletionOutput": "strataserve.types.outputs",
    "AsyncLLM": "strataserve.engine.async_llm",
    "EngineArgs": "strataserve.engine.engine_args",
    "AsyncEngineArgs": "strataserve.engine.engine_args",
    "TTS": "strataserve.engine.tts",
    "AsyncTTS": "strataserve.engine.async_tts",
}

if TYPE_CHECKING:
    from strataserve.engine.async_llm import AsyncLLM
    from strataserve.engine.engine_args import AsyncEngineArgs, EngineArgs
    from strataserve.engine.llm import LLM
    from strataserve.types.outputs import CompletionOutput, RequestOutput
    from strataserve.engine.async_tts import AsyncTTS
    from strataserve.types.sampling import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
    from strataserve.engine.tts import TTS


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'strataserve' has no attribute {name!r}")
