"""Sampling defaults a checkpoint's creator recommends in ``generation_config.json`` (Qwen3's temperature 0.6,
top_p 0.95, top_k 20, ...), applied as vLLM's ``--generation-config auto`` does: to the fields a request leaves
unset, offline and served. ``vllm`` (vLLM's name) ignores them; a folder reads that folder's file instead."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field (vLLM's list)
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: str | Path, generation_config: str = "auto") -> dict[str, Any]:
    """{SamplingParams field: value} from the file; {} without one, or for ``generation_config="vllm"``. A value
    SamplingParams would refuse is left out (with a warning), so no request fails for the checkpoint's sake."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_dir if generation_config == "auto" else generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(f"--generation-config {generation_config}: no generation_config.json in that folder")
        return {}
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        log.warning("%s is not valid JSON (%s): its sampling defaults are ignored", path, exc)
        return {}
    from strataserve.types.sampling import SamplingParams

    out: dict[str, Any] = {}
    for key, name in _FIELDS.items():
        value = doc.get(key) if isinstance(doc, dict) else None
        if value is None or isinstance(value, bool):
            continue
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError) as exc:
            log.warning("%s: %s=%r is left out of the sampling defaults: %s", path, key, value, exc)
            continue
        out[name] = value
    return out


def describe(defaults: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in defaults.items())
