"""Load an HF checkpoint folder (config.json + safetensors, single or sharded) straight into ``DecoderModel``.

Also builds random-weight models from a ``DecoderConfig`` for benchmarks (real shapes, no checkpoint;
``load_format="dummy"``): each tensor is drawn whole from a generator seeded by its name's position, so every
tensor-parallel split of one seed holds the same model.

Tensor parallelism: with a rank's ``TensorParallel`` each sharded tensor is read through safetensors'
``get_slice`` (only that rank's rows or columns; the file is memory-mapped, so the rest is never read) and the
model is built in the rank's local shapes (``models/parallel.py`` says which slice is whose). On one GPU, every
tensor stored whole in the model's dtype is streamed from the file through pinned buffers instead
(``models/weight_stream.py``; ``STRATA_WEIGHT_STREAM=0``: safetensors for all).

dtype "auto" means the checkpoint's ``torch_dtype``, except on CPU where half types become float32: CPU matmuls in
bf16/fp16 are slower and less accurate than float32 on the machines we target. Device "auto" is cuda when
available, else cpu.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from strataserve import envs
from strataserve.models.decoder import DecoderModel
from strataserve.models.hf_config import DecoderConfig, load_decoder_config
from strataserve.models.parallel import SINGLE, TensorParallel
from strataserve.models.weight_stream import WeightStreamer, read_header
from strataserve.runner.attention import TorchAttention
from strataserve.runner.ops import OpSet, TorchOps

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Checkpoint tensors that carry nothing we need (rotary tables are recomputed).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r}: use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available here; use device='cpu' or 'auto'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: use cpu, cuda, cuda:N or auto")
    return dev


def resolve_dtype(dtype: str, cfg: DecoderConfig, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        name = cfg.torch_dtype if device.type == "cuda" else "float32"
        return _DTYPES.get(name, torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def default_ops(cfg: DecoderConfig) -> OpSet:
    return TorchOps(TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, or a ValueError saying what is missing."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing or not names:
            raise ValueError(f"{model_dir}: model.safetensors.index.json names shard files that are missing: "
                             f"{', '.join(missing) or '(index lists no files)'}")
        return [model_dir / n for n in names]
    raise ValueError(f"{model_dir}: no weights found; need model.safetensors or model.safetensors.index.json "
                     "with its shards (only safetensors checkpoints are supported)")


def hf_tensor_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor ``cfg`` implies (HF names) with its full shape, in checkpoint order."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h)})
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,),
                           p + "self_attn.k_norm.weight": (cfg.head_dim,)})
        shapes.update({p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


class _Targets:
    """Maps HF tensor names to (our parameter, row offset); tracks which names were filled.

    ``model.config`` is the rank's local config; ``full`` the checkpoint's (the vocab-parallel shards of the
    last rank hold fewer real rows than their padded size; the padding rows are zeroed here)."""

    def __init__(self, model: DecoderModel, full: DecoderConfig | None = None) -> None:
        cfg = model.config
        self.full, self.tp = full or cfg, model.tp
        self.map: dict[str, tuple[torch.Tensor, int]] = {
            "model.embed_tokens.weight": (model.embed_tokens, 0),
            "model.norm.weight": (model.norm, 0),
        }
        if not cfg.tie_word_embeddings:
            self.map["lm_head.weight"] = (model.lm_head, 0)
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            self.map.update({
                p + "input_layernorm.weight": (layer.input_norm, 0),
                p + "post_attention_layernorm.weight": (layer.post_attn_norm, 0),
                p + "self_attn.q_proj.weight": (attn.qkv_weight, 0),
                p + "self_attn.k_proj.weight": (attn.qkv_weight, q),
                p + "self_attn.v_proj.weight": (attn.qkv_weight, q + kv),
                p + "self_attn.o_proj.weight": (attn.o_weight, 0),
                p + "mlp.gate_proj.weight": (layer.mlp.gate_up_weight, 0),
                p + "mlp.up_proj.weight": (layer.mlp.gate_up_weight, inter),
                p + "mlp.down_proj.weight": (layer.mlp.down_weight, 0),
            })
            if attn.qkv_bias is not None:
                self.map.update({p + "self_attn.q_proj.bias": (attn.qkv_bias, 0),
                                 p + "self_attn.k_proj.bias": (attn.qkv_bias, q),
                                 p + "self_attn.v_proj.bias": (attn.qkv_bias, q + kv)})
            if attn.q_norm is not None:
                self.map.update({p + "self_attn.q_norm.weight": (attn.q_norm, 0),
                                 p + "self_attn.k_norm.weight": (attn.k_norm, 0)})
        # rows each tensor fills: fused parameters are split by their parts' sizes
        part = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter}
        self.rows = {n: part.get(n.split(".")[-2], p.shape[0]) for n, (p, _) in self.map.items()}
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            spec = self.tp.shard_slice(name, self.full)
            if spec is not None and name in self.map:
                self.rows[name] = spec[2] - spec[1]
                self.map[name][0].data[self.rows[name]:].zero_()
        self.filled: set[str] = set()

    def read(self, f, name: str) -> torch.Tensor:
        """Tensor ``name`` of the open safetensors file ``f``: the whole of it, or only this rank's slice."""
        spec = self.tp.shard_slice(name, self.full)
        if spec is None:
            return f.get_tensor(name)
        dim, start, stop = spec
        piece = f.get_slice(name)
        return piece[start:stop] if dim == 0 else piece[:, start:stop]

    def wanted(self, name: str) -> bool:
        # some tied checkpoints still store lm_head; the embedding is used
        return not (name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and name not in self.map))

    def destination(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The parameter rows that checkpoint tensor ``name`` (of ``shape``, as read) fills."""
        if name not in self.map:
            raise ValueError(f"checkpoint tensor {name!r} is not part of the supported decoder; "
                             "is config.json consistent with the weights?")
        param, row = self.map[name]
        dst = param.data[row:row + self.rows[name]]
        if tuple(dst.shape) != tuple(shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(shape)}, "
                             f"config.json implies {tuple(dst.shape)}")
        return dst

    def whole(self, name: str) -> bool:
        """Whether this rank reads tensor ``name`` whole (no tensor-parallel slice)."""
        return self.tp.shard_slice(name, self.full) is None

    def fill(self, name: str, tensor: torch.Tensor) -> None:
        if not self.wanted(name):
            return
        self.destination(name, tuple(tensor.shape)).copy_(tensor)
        self.filled.add(name)

    def check_complete(self, model_dir: Path) -> None:
        missing = sorted(set(self.map) - self.filled)
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise ValueError(f"{model_dir}: checkpoint lacks tensors the config requires: {shown}")


def prefixed_tensors(files: list[Path], prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` whose name starts with ``prefix``, keyed by the rest of its name (a sub-model's
    state dict inside a bigger checkpoint)."""
    state = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    state[name[len(prefix):]] = f.get_tensor(name)
    return state


def _load_files(files: list[Path], targets: _Targets, streamer: WeightStreamer | None = None) -> None:
    """Every wanted tensor of ``files`` into its parameter: through ``streamer`` where it takes the tensor as
    stored (``models/weight_stream.py``), else read by safetensors (a cast, a tensor-parallel slice)."""
    def load_one(path: Path) -> None:
        rest = []
        if streamer is not None:
            for name, stored in read_header(path).items():
                if not targets.wanted(name):
                    continue
                dst = targets.destination(name, stored.shape) if targets.whole(name) else None
                if dst is not None and streamer.accepts(stored, dst):
                    streamer.add(path, stored, dst)
                    targets.filled.add(name)
                else:
                    rest.append(name)
            streamer.finish()
            if not rest:
                return
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in (rest if streamer is not None else f.keys()):
                if targets.wanted(name):
                    targets.fill(name, targets.read(f, name))

    if len(files) == 1:
        load_one(files[0])
        return
    from rich.progress import Progress  # only multi-shard loads show progress

    with Progress(transient=True) as progress:
        task = progress.add_task(f"loading {len(files)} shards", total=len(files))
        for path in files:
            load_one(path)
            progress.advance(task)


LOAD_FORMATS = ("auto", "dummy")


def _streamer_for(device: torch.device) -> WeightStreamer | None:
    """The pinned-buffer streamer on a GPU (``STRATA_WEIGHT_STREAM``); on a CPU safetensors' memory map already
    reads straight into the parameters' copy."""
    return WeightStreamer(device) if device.type == "cuda" and envs.STRATA_WEIGHT_STREAM else None


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
               ops: OpSet | None = None, max_positions: int | None = None, tp: TensorParallel = SINGLE,
               load_format: str = "auto") -> DecoderModel:
    """Load an HF checkpoint folder into a ``DecoderModel`` (eval, no grad); with ``tp``, this rank's shard of it.
    ``load_format="dummy"`` reads only config.json and fills random weights (``build_random_model``). Errors are
    ValueErrors naming what is missing or unsupported."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
    folder = Path(model_dir)
    cfg = load_decoder_config(folder)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, cfg, dev)
    if load_format == "dummy":
        return build_random_model(cfg, dt, dev, ops, max_positions=max_positions, tp=tp)
    files = safetensors_files(folder)
    local = tp.local_config(cfg)
    model = DecoderModel(local, ops or default_ops(local), dt, dev, max_positions, tp)
    targets = _Targets(model, cfg)
    # one GPU only: the tensor-parallel ranks' loads were not measured with it (their slices take safetensors anyway)
    streamer = _streamer_for(dev) if tp.size == 1 else None
    with torch.no_grad():
        _load_files(files, targets, streamer)
    targets.check_complete(folder)
    return model.eval()


class _RandomCheckpoint:
    """The tensors of ``hf_tensor_shapes(cfg)``, drawn on ``device`` when read (the safe_open calls we use).

    Each is drawn whole (then sliced) from a generator seeded by ``seed`` and its position, so a rank's slice is
    the same numbers whatever the split: TP=1 and TP=N dummy models agree. Norm weights are drawn near 1 (not
    exactly 1, to exercise them), the rest with standard deviation ``std``."""

    def __init__(self, cfg: DecoderConfig, device: torch.device, seed: int, std: float) -> None:
        self.shapes = hf_tensor_shapes(cfg)
        self.device, self.seed, self.std = device, seed, std
        self._index = {name: i for i, name in enumerate(self.shapes)}

    def keys(self) -> list[str]:
        return list(self.shapes)

    def get_tensor(self, name: str) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 100_003 + self._index[name])
        t = torch.empty(self.shapes[name], dtype=torch.float32, device=self.device)
        return t.normal_(1.0, 0.1, generator=gen) if name.endswith("norm.weight") else \
            t.normal_(0.0, self.std, generator=gen)

    def get_slice(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)  # sliced by the caller, as safetensors' slice object is


def build_random_model(cfg: DecoderConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       ops: OpSet | None = None, seed: int = 0, max_positions: int | None = None,
                       std: float = 0.02, tp: TensorParallel = SINGLE) -> DecoderModel:
    """A model with random weights in ``cfg``'s shapes (benchmarks; e.g. Llama-3.1-8B shape on a GPU); with
    ``tp``, this rank's shard of the same random model."""
    local = tp.local_config(cfg)
    model = DecoderModel(local, ops or default_ops(local), dtype, device, max_positions, tp)
    targets = _Targets(model, cfg)
    source = _RandomCheckpoint(cfg, model.device, seed, std)
    with torch.no_grad():
        for name in source.keys():
            targets.fill(name, targets.read(source, name))
    return model.eval()
