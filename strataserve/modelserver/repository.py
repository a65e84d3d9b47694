"""The model repository on disk: safe name → folder resolution, version folders, config loading.

Layout (Triton's): `<repo>/<model>/config.pbtxt` and numeric version folders `<repo>/<model>/<N>/`. A folder
holding an HF checkpoint (config.json + *.safetensors) is an LLM model with the single version 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from strataserve.types import model_config_pb2 as pb
from strataserve.modelserver.autocomplete import autocomplete_onnx, autocomplete_python, complete_llm_config
from strataserve.modelserver.config import (
    PLATFORM_TO_BACKEND,
    ConfigError,
    ModelSpec,
    build_spec,
)
from strataserve.modelserver.pbtxt import parse_json_override, parse_pbtxt
from strataserve.types.tensors import ModelServerError

CONFIG_FILE = "config.pbtxt"
DEFAULT_FILENAMES = {"onnxruntime": ("model.onnx",), "pytorch": ("model.pt", "model.pt2"), "python": ("model.py",)}


@dataclass(frozen=True)
class ModelSource:
    """A model's validated spec and the version folders its version policy selects."""

    spec: ModelSpec
    model_dir: Path
    versions: dict[int, Path]  # version -> folder holding the model file


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


class Repository:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"model repository {root!s} is not a folder; pass an existing directory")

    def model_names(self) -> list[str]:
        names = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            try:
                self.resolve(entry.name)
            except ModelServerError:
                continue  # a symlink out of the repository is never listed
            names.append(entry.name)
        return names

    def resolve(self, name: str) -> Path:
        """The model's folder. Names that could reach outside the repository are refused."""
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
                or "\0" in name or os.path.isabs(name) or name.startswith("~"):
            raise ModelServerError("invalid_argument", f"model name {name!r} is not a plain folder name in the "
                                   "model repository")
        path = self.root / name
        try:
            real = path.resolve()
        except (OSError, RuntimeError) as e:
            raise ModelServerError("invalid_argument", f"model {name!r}: cannot resolve its folder: {e}") from None
        if real.parent != self.root and self.root not in real.parents:
            raise ModelServerError("invalid_argument", f"model {name!r} resolves outside the model repository")
        if not real.is_dir():
            raise ModelServerError("not_found", f"model '{name}' is not in the model repository {self.root}")
        return path

    def fingerprint(self, name: str) -> tuple:
        """Changes whenever a file of the model changes (poll mode compares these)."""
        model_dir = self.resolve(name)
        items = []
        for dirpath, _dirs, files in os.walk(model_dir):
            if "__pycache__" in dirpath:
                continue
            for f in files:
                p = Path(dirpath, f)
                try:
                    st = p.stat()
                except OSError:
                    continue
                items.append((str(p.relative_to(model_dir)), st.st_mtime_ns, st.st_size))
        return tuple(sorted(items))

    def load_source(self, name: str, config_override: str | None = None) -> ModelSource:
        model_dir = self.resolve(name)
        cfg_path = model_dir / CONFIG_FILE
        if config_override is not None:
            source: str | Path = f"config override for model '{name}'"
            cfg = parse_json_override(config_override, str(source))
        elif cfg_path.is_file():
            source = cfg_path
            cfg = parse_pbtxt(cfg_path.read_text(), cfg_path)
        else:
            source, cfg = model_dir, pb.ModelConfig()
        version_dirs = _version_dirs(model_dir)
        hint = _backend_hint(model_dir, version_dirs, cfg)
        backend = cfg.backend or PLATFORM_TO_BACKEND.get(cfg.platform, "") or hint
        if source == model_dir and backend not in ("onnxruntime", "llm", "python"):
            raise ConfigError(model_dir / CONFIG_FILE, CONFIG_FILE, "is missing; only ONNX models, HF LLM folders "
                              "and Python models with auto_complete_config can do without one")
        if backend == "llm":
            complete_llm_config(cfg, hf_folder_only=source == model_dir)
            if not version_dirs:
                version_dirs = {1: model_dir}
        if backend == "ensemble" and not version_dirs:
            version_dirs = {1: model_dir}
        versions = _apply_policy(cfg.version_policy, version_dirs, source)
        if backend == "onnxruntime" and versions:
            latest = versions[max(versions)]
            autocomplete_onnx(cfg, _model_file(latest, cfg, "onnxruntime", source), source)
        isolated = cfg.parameters["EXECUTION_ISOLATION"].string_value == "process" \
            if "EXECUTION_ISOLATION" in cfg.parameters else False
        if backend == "python" and versions and not isolated:  # isolated user code never runs in this process
            path = _model_file(versions[max(versions)], cfg, "python", source)
            autocomplete_python(cfg, path, source)
            if source == model_dir and not cfg.input:
                raise ConfigError(model_dir / CONFIG_FILE, CONFIG_FILE, f"is missing and {path} has no "
                                  "auto_complete_config to declare the inputs and outputs")
        spec = build_spec(cfg, name, source, hint)
        return ModelSource(spec, model_dir, versions)


def model_file(spec: ModelSpec, version_dir: Path) -> Path:
    return _model_file(version_dir, spec.proto, spec.backend, spec.source)


def _model_file(version_dir: Path, cfg: pb.ModelConfig, backend: str, source) -> Path:
    names = (cfg.default_model_filename,) if cfg.default_model_filename else DEFAULT_FILENAMES.get(backend, ())
    for n in names:
        if (version_dir / n).exists():
            return version_dir / n
    raise ConfigError(source, "default_model_filename", f"no model file {' or '.join(names)} in {version_dir}")


def _version_dirs(model_dir: Path) -> dict[int, Path]:
    out = {}
    for entry in model_dir.iterdir():
        if entry.is_dir() and entry.name.isdigit() and int(entry.name) > 0:
            out[int(entry.name)] = entry
    return out


def _backend_hint(model_dir: Path, version_dirs: dict[int, Path], cfg: pb.ModelConfig) -> str:
    if cfg.ensemble_scheduling.step:
        return "ensemble"
    if is_hf_folder(model_dir):
        return "llm"
    for vdir in sorted(version_dirs.values(), reverse=True):
        if (vdir / "model.onnx").exists():
            return "onnxruntime"
        if (vdir / "model.py").exists():
            return "python"
        if (vdir / "model.pt").exists() or (vdir / "model.pt2").exists():
            return "pytorch"
    return ""


def _apply_policy(policy: pb.ModelVersionPolicy, dirs: dict[int, Path], source) -> dict[int, Path]:
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return dict(sorted(dirs.items()))
    if choice == "specific":
        missing = [v for v in policy.specific.versions if v not in dirs]
        if missing:
            raise ConfigError(source, "version_policy.specific.versions",
                              f"versions {missing} have no version folder (present: {sorted(dirs)})")
        return {v: dirs[v] for v in sorted(set(policy.specific.versions))}
    n = policy.latest.num_versions if choice == "latest" else 1
    if choice == "latest" and n < 1:
        raise ConfigError(source, "version_policy.latest.num_versions", f"{n} must be at least 1")
    return {v: dirs[v] for v in sorted(dirs)[-n:]}
