"""The router's config file (``strata serve --config FILE.yaml``): what one server fronts, validated by pydantic.

A model entry is local (``path``: an HF folder served by its own engine-core process, engine flags allowed) or
upstream (``upstream: openai`` for any OpenAI-compatible server, ``upstream: kserve`` for any KServe v2 server;
``url`` may list several replicas). SLA classes give each request a priority and latency targets; API keys may
be mapped to a class. Errors name the key (``models[1].url``) and say what to change.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator,
                      model_validator)

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"


class _Strict(BaseModel):
    # A misspelled key is an error, not silently ignored: the config is typed by an operator, not a client.
    model_config = ConfigDict(extra="forbid", frozen=True)


class SLAClass(_Strict):
    """``priority``: lower runs first (the engine's order); ``ttft_ms``: admission refuses (429) a request that
    the queue ahead would make miss it; ``tpot_ms``: the per-token target, reported and used for goodput."""

    priority: int = Field(0, ge=0, le=1_000_000)
    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)


class _ModelBase(_Strict):
    name: str = Field(pattern=_NAME, description="the name clients send as `model`")
    gpu_cost_per_hour: float | None = Field(None, ge=0, description="price of the GPU(s) behind this model, "
                                            "for the cost-per-1k-output-tokens metric")


class LocalModel(_ModelBase):
    """A local LLM engine in its own engine-core process; the keys are `strata serve`'s engine flags."""

    path: str
    dtype: Literal["auto", "float32", "float16", "bfloat16", "half", "float"] = "auto"  # vLLM's aliases too
    device: str = "auto"
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_waiting_requests: int | None = Field(None, ge=1)
    target_step_ms: float | None = Field(None, ge=0)
    stream_interval: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    kv_cache_memory_gib: float | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    num_gpu_blocks_override: int | None = Field(None, ge=2)
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: Literal["auto", "fp8", "int8"] | None = None
    tensor_parallel_size: int | None = Field(None, ge=1, description="GPUs this model is split over (one host)")
    load_format: Literal["auto", "dummy"] | None = None
    runner_mode: Literal["auto", "eager", "triton", "graph", "hybrid"] | None = None
    seed: int | None = None
    skip_tokenizer_init: bool | None = None
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    enable_auto_tool_choice: bool | None = None
    generation_config: str | None = Field(None, min_length=1, description="auto (the checkpoint's "
                                          "generation_config.json), vllm (none), or a folder holding one")
    # Replicas: K engine cores of this model, balanced by the router (``router/local_replicas.py``).
    replicas: int = Field(1, ge=1, le=1024)
    placement: Literal["local", "ray"] | None = Field(None, description="local: K engine processes on this host; "
                                                      "ray: K Ray actors on the cluster ray.init finds")
    ray_address: str | None = Field(None, min_length=1, description="the Ray cluster: auto or HOST:PORT (default: "
                                    "RAY_ADDRESS, else a new local one)")
    num_gpus_per_replica: float | None = Field(None, ge=0, description="default: the tensor-parallel size on "
                                               "CUDA, 0 on CPU")

    @field_validator("placement")
    @classmethod
    def _ray_installed(cls, v: str | None) -> str | None:
        if v == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("Ray is not installed: pip install 'strataserve[ray]' (or use placement: local)")
        return v

    @field_validator("ray_address")
    @classmethod
    def _not_ray_client(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("ray://"):
            raise ValueError("Ray Client (ray://) is not supported: the replicas stream to this server over zmq, so "
                             "run strata serve on a node of the cluster and give the head as HOST:PORT (or auto)")
        return v

    @model_validator(mode="after")
    def _replica_keys(self) -> "LocalModel":
        if self.ray_address is not None and self.placement != "ray":
            raise ValueError("ray_address is only used with placement: ray; add placement: ray or remove it")
        if self.num_gpus_per_replica is not None and self.placement is None:
            raise ValueError("num_gpus_per_replica needs placement: local or ray")
        if (self.placement == "local" and self.num_gpus_per_replica is not None
                and self.num_gpus_per_replica != int(self.num_gpus_per_replica)):
            raise ValueError("num_gpus_per_replica: placement local takes whole GPUs; use placement ray to "
                             "share a GPU between replicas")
        return self

    @property
    def replicated(self) -> bool:
        """True when the entry runs through the replica path (several cores, or one Ray actor)."""
        return self.replicas > 1 or self.placement is not None

    @field_validator("path")
    @classmethod
    def _path_exists(cls, v: str) -> str:
        if not Path(v).is_dir():
            raise ValueError(f"folder {v!r} does not exist: give an HF checkpoint folder")
        return v

    def engine_overrides(self) -> dict[str, Any]:
        """The engine flags this entry sets (argparse dest names), for building its EngineConfig."""
        keys = ("dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests",
                "target_step_ms", "stream_interval", "block_size", "kv_cache_memory_gib", "gpu_memory_utilization",
                "num_gpu_blocks_override",
                "enable_prefix_caching", "kv_cache_dtype", "tensor_parallel_size", "load_format", "runner_mode",
                "seed", "skip_tokenizer_init")
        return {k: getattr(self, k) for k in keys if k in self.model_fields_set}


class _Upstream(_ModelBase):
    url: list[str] = Field(min_length=1, description="one url per replica")
    upstream_model: str | None = None
    timeout_s: float = Field(600.0, gt=0, description="longest wait for the upstream's next byte")
    connect_timeout_s: float = Field(5.0, gt=0)

    @field_validator("url", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("url")
    @classmethod
    def _http_urls(cls, v: list[str]) -> list[str]:
        for u in v:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"{u!r} is not an http(s) url: write it as http://HOST:PORT")
        if len(set(v)) != len(v):
            raise ValueError("the same url is listed twice")
        return [u.rstrip("/") for u in v]

    @property
    def remote_name(self) -> str:
        return self.upstream_model or self.name


class OpenAIUpstream(_Upstream):
    upstream: Literal["openai"]
    api_key_env: str | None = Field(None, description="environment variable holding the upstream's API key")

    @field_validator("api_key_env")
    @classmethod
    def _env_set(cls, v: str | None) -> str | None:
        if v is not None and v not in os.environ:
            raise ValueError(f"environment variable {v} is not set: export it or remove api_key_env")
        return v

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class KServeUpstream(_Upstream):
    upstream: Literal["kserve"]


def _entry_kind(v: Any) -> str:
    if isinstance(v, dict):
        if "upstream" in v:
            return str(v["upstream"])
        if "path" in v:
            return "local"
    return "local"  # pydantic then names the missing `path`


ModelEntry = Annotated[Union[Annotated[LocalModel, Tag("local")], Annotated[OpenAIUpstream, Tag("openai")],
                             Annotated[KServeUpstream, Tag("kserve")]], Discriminator(_entry_kind)]


class APIKey(_Strict):
    """A client key (given as ``key`` or read from ``key_env``) and the SLA class its requests get."""

    key: str | None = None
    key_env: str | None = None
    sla: str

    @model_validator(mode="after")
    def _one_source(self) -> "APIKey":
        if (self.key is None) == (self.key_env is None):
            raise ValueError("give exactly one of key or key_env")
        if self.key_env is not None and self.key_env not in os.environ:
            raise ValueError(f"environment variable {self.key_env} is not set")
        if not self.value().strip():  # an empty key would let every request in under this class
            raise ValueError(f"{'key' if self.key is not None else 'environment variable ' + str(self.key_env)} "
                             "is empty: give a key")
        return self

    def value(self) -> str:
        return self.key if self.key is not None else os.environ[self.key_env or ""]


class RouterConfig(_Strict):
    models: list[ModelEntry] = Field(default_factory=list)
    # The repository keys: a flag typed on the command line wins over each (``merge_repository_keys``)
    model_repository: str | None = None
    model_control_mode: Literal["none", "explicit", "poll"] = "none"
    repository_poll_secs: float = Field(1.0, gt=0)  # poll mode's scan interval
    # Triton's --strict-readiness: /v2/health/ready only while every repository model is READY
    strict_readiness: bool = True
    sla_classes: dict[str, SLAClass] = Field(default_factory=lambda: {"default": SLAClass()})
    default_sla: str | None = None
    api_keys: list[APIKey] = Field(default_factory=list)
    health_check_interval_s: float = Field(2.0, gt=0)
    prefix_affinity_chars: int = Field(256, ge=0, description="prompt characters hashed for replica affinity "
                                       "(0 turns affinity off)")
    affinity_slack: int = Field(2, ge=0, description="how many more outstanding requests the affine replica "
                                "may have than the least loaded one and still be chosen")

    @field_validator("strict_readiness", mode="before")
    @classmethod
    def _true_or_false(cls, v: Any) -> Any:
        # a real boolean only: pydantic would read "no", "off" or 0 as false, which an operator's typo should not be
        if not isinstance(v, bool):
            raise ValueError(f"must be true or false, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "RouterConfig":
        names = [m.name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"models: the name {dup[0]!r} is used twice; every model needs its own name")
        if not self.sla_classes:
            raise ValueError("sla_classes: declare at least one class")
        default = self.default_sla or next(iter(self.sla_classes))
        if default not in self.sla_classes:
            raise ValueError(f"default_sla: {default!r} is not one of sla_classes ({', '.join(self.sla_classes)})")
        object.__setattr__(self, "default_sla", default)
        for k in self.api_keys:
            if k.sla not in self.sla_classes:
                raise ValueError(f"api_keys: class {k.sla!r} is not one of sla_classes ({', '.join(self.sla_classes)})")
        if self.model_repository is not None and not Path(self.model_repository).is_dir():
            raise ValueError(f"model_repository: folder {self.model_repository!r} does not exist")
        addrs = {m.ray_address for m in self.models if isinstance(m, LocalModel) and m.placement == "ray"}
        if len(addrs) > 1:
            raise ValueError("ray_address: every placement: ray model must use the same Ray cluster (one "
                             "ray.init per server); give them one ray_address")
        if not self.models and self.model_repository is None:
            raise ValueError("models: the config serves nothing; list at least one model or a model_repository")
        return self

    def key_classes(self) -> dict[str, str]:
        return {k.value(): k.sla for k in self.api_keys}


# The config's repository keys and the ServeOptions fields they set (their --flags' names, but --repository-poll-secs).
_REPOSITORY_KEYS = (("model_repository", "model_repository"), ("model_control_mode", "model_control_mode"),
                    ("repository_poll_secs", "repository_poll_s"), ("strict_readiness", "strict_readiness"))


def merge_repository_keys(config: RouterConfig, server: dict[str, Any]) -> None:
    """Fill ``server`` (ServeOptions fields from the flags typed on the command line; None or absent: not typed)
    with the file's repository keys. One rule, as with vLLM's --config: a typed flag wins over the file's key, which
    wins over ServeOptions' default; the file's keys apply whether the repository comes from the file or from
    --model-repository. A key that needs a repository, set where there is none, is refused (as its flag is)."""
    for key, option in _REPOSITORY_KEYS:
        if server.get(option) is None and key in config.model_fields_set:
            server[option] = getattr(config, key)
    if server.get("model_repository"):
        return
    # model_control_mode: none asks for nothing a missing repository could fail to give
    orphans = [key for key, _ in _REPOSITORY_KEYS[1:] if key in config.model_fields_set
               and not (key == "model_control_mode" and config.model_control_mode == "none")]
    if orphans:
        listed = orphans[0] if len(orphans) == 1 else f"{', '.join(orphans[:-1])} and {orphans[-1]}"
        raise ValueError(f"{listed} {'applies' if len(orphans) == 1 else 'apply'} to repository models: add "
                         f"model_repository to the config (or --model-repository), or remove the "
                         f"{'key' if len(orphans) == 1 else 'keys'}")


class ConfigError(ValueError):
    """A config file that cannot be served as written; the message names the key and what to change."""


def _format(exc: ValidationError, doc: dict) -> str:
    lines = []
    for err in exc.errors():
        loc = ""
        path = list(err["loc"])
        for k, part in enumerate(path):
            if isinstance(part, int):
                loc += f"[{part}]"
                if k == 1 and path[0] == "models":  # name the entry, not only its index
                    entry = (doc.get("models") or [None] * (part + 1))[part]
                    if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                        loc += f" ({entry['name']})"
            elif part in ("local", "openai", "kserve") and k == 2:
                continue
            else:
                loc += f".{part}" if loc else str(part)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key: remove it or check its spelling"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] == "union_tag_invalid":
            msg = f"upstream {err['input'].get('upstream')!r} is not known: use openai or kserve"
        lines.append(f"{loc or '(top level)'}: {msg}")
    return "; ".join(lines)


def parse_config(doc: Any, source: str = "config") -> RouterConfig:
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: the top level must be a mapping with a `models` list")
    try:
        return RouterConfig.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_format(exc, doc)}") from None
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(path: str | os.PathLike) -> RouterConfig:
    """Read and validate a YAML config file; relative paths in it are taken from the file's folder."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    base = p.resolve().parent
    if isinstance(doc, dict):
        models = doc.get("models")
        for m in models if isinstance(models, list) else []:  # anything else: the validation below says so
            if isinstance(m, dict) and isinstance(m.get("path"), str):
                m["path"] = str(base / m["path"])
        if isinstance(doc.get("model_repository"), str):
            doc["model_repository"] = str(base / doc["model_repository"])
    return parse_config(doc, str(p))
