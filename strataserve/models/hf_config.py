"""Parse an HF ``config.json`` (+ ``generation_config.json``) into one frozen ``DecoderConfig``.

One decoder covers Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3; the differences between them are data here
(qkv bias, q/k RMSNorm, rope scaling, tied embeddings), never branches on the architecture name elsewhere.

Rope settings come in two layouts: transformers 4.x writes ``rope_theta`` + ``rope_scaling``; transformers 5.x
writes one ``rope_parameters`` dict (``rope_type``, ``rope_theta`` and the scaling fields). Both are accepted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Architectures whose checkpoints carry per-head RMSNorm on q and k before rotary (Qwen3).
_QK_NORM_ARCHS = {"Qwen3ForCausalLM"}
# Qwen2 always has q/k/v bias (no o_proj bias), whatever its config says.
_QKV_BIAS_ARCHS = {"Qwen2ForCausalLM"}
# Where transformers reads ``attention_bias``: it biases q/k/v AND o_proj, which the decoder does not implement.
# (Mistral's and Qwen2's attention ignore the key, as transformers does.)
_ATTENTION_BIAS_ARCHS = {"LlamaForCausalLM", "Qwen3ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling. ``rope_type`` "default" means none; "llama3" and "linear" use the fields below."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json then generation_config.json, de-duplicated, order kept
    torch_dtype: str  # "float32" | "float16" | "bfloat16" as written by the checkpoint
    sliding_window: int | None = None  # only when the checkpoint really uses it (see ``max_model_len``)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name}={getattr(self, name)} must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def window_every_layer(self) -> bool:
        """Mistral windows every layer (the runner masks it); Qwen2/3 window only some layers, not masked here."""
        return self.sliding_window is not None and self.architecture == "MistralForCausalLM"

    @property
    def max_model_len(self) -> int:
        """Longest usable context with the window masked in attention (``runner/input_batch.py``, torch backend).

        Where the window is not masked (Qwen2/3's per-layer windows; the Triton kernels), the runner caps the
        context at the window instead (``full_attention_len``): there full and windowed attention agree.
        """
        return self.max_position_embeddings

    @property
    def full_attention_len(self) -> int:
        """Longest context where full attention equals the checkpoint's windowed attention."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def eos_primary(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers 5.x layout
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling: dict[str, Any] | None = params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if not scaling:
        return float(theta), RopeScaling()
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json: rope scaling type {rope_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), RopeScaling()
    defaults = RopeScaling()
    return float(theta), RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(scaling.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            scaling.get("original_max_position_embeddings", defaults.original_max_position_embeddings)),
    )


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    window = raw.get("sliding_window")
    if not window:
        return None
    # Qwen2/Qwen3 configs carry a window but only apply it with use_sliding_window=true; Mistral always does.
    if arch != "MistralForCausalLM" and not raw.get("use_sliding_window", False):
        return None
    return int(window)


def decoder_config_from_dict(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> DecoderConfig:
    """Build a ``DecoderConfig`` from parsed config.json (and generation_config.json) contents."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"config.json: architecture {archs or '(none given)'} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        vocab = int(raw["vocab_size"])
        inter = int(raw["intermediate_size"])
    except KeyError as exc:
        raise ValueError(f"config.json: missing field {exc.args[0]!r}") from None
    if raw.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported (no supported family uses MLP biases)")
    if raw.get("attention_bias") and arch in _ATTENTION_BIAS_ARCHS:
        raise ValueError(f"config.json: attention_bias=true is not supported for {arch}: it adds biases to "
                         "q_proj, k_proj, v_proj and o_proj, and the decoder implements q/k/v biases only (as "
                         "Qwen2ForCausalLM has them); supported: attention_bias false or absent")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r} is not supported; the decoder implements SwiGLU (silu)")
    head_dim = raw.get("head_dim") or hidden // heads
    theta, scaling = _parse_rope(raw)
    eos = _as_id_tuple(raw.get("eos_token_id"))
    if generation:
        eos = tuple(dict.fromkeys(eos + _as_id_tuple(generation.get("eos_token_id"))))
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", "")
    return DecoderConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch in _QKV_BIAS_ARCHS,
        qk_norm=arch in _QK_NORM_ARCHS,
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        eos_token_ids=eos,
        torch_dtype=dtype if dtype in ("float32", "float16", "bfloat16") else "float32",
        sliding_window=_sliding_window(raw, arch),
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def load_decoder_config(model_dir: str | Path) -> DecoderConfig:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional) from an HF checkpoint folder."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ValueError(f"model path {str(folder)!r} is not a directory; give an HF checkpoint folder")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder}: config.json is missing; an HF checkpoint folder needs config.json "
                         "and model.safetensors (or model.safetensors.index.json with its shards)")
    gen_path = folder / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else None
    return decoder_config_from_dict(_read_json(cfg_path), generation)


def read_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """eos ids from config.json then generation_config.json (either may be absent); de-duplicated, order kept."""
    folder = Path(model_dir)
    ids: tuple[int, ...] = ()
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            ids += _as_id_tuple(_read_json(path).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))
