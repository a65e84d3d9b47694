"""Starting the engines the router's local backends wrap, with their start-up lines: an LLM engine (its engine-core
child process and the tokenizer beside it), a replicated model, a speech model (Qwen3-TTS or OmniVoice, in
process), the model repository's server. The API layer names none of them: ``strata serve`` asks
``load_local_model`` / ``start_model_server`` and hands the results to the backends.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from rich.console import Console

from strataserve.config import EngineConfig
from strataserve.models.omnivoice.config import is_omnivoice_dir
from strataserve.models.qwen3_tts.config import is_qwen3_tts_dir
from strataserve.router.local_replicas import ReplicatedEngine, start_replicas
from strataserve.startup import format_phases, process_age
from strataserve.types.errors import EngineStartupError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


def _fmt_gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3f} GiB" if num_bytes else "unknown size"


def kv_cache_line(info: Any) -> str:
    """The start-up line about the KV pool (an engine's ``ReadyInfo``); fp8 / int8 say what they bought."""
    kv = ""
    if info.kv_cache_dtype:
        gain = _DTYPE_BYTES.get(info.dtype, 0) / _DTYPE_BYTES.get(info.kv_cache_dtype, 1)
        kv = f" in {info.kv_cache_dtype} (per-head scales; {gain:g}× the blocks of a {info.dtype} cache)"
    return (f"KV cache: {info.num_blocks} blocks × {info.block_size} tokens = {info.num_blocks * info.block_size} "
            f"tokens, {_fmt_gib(info.kv_cache_bytes)}{kv}")


def load_engine(config: EngineConfig, console: Console, startup_timeout_s: float | None = None,
                name: str | None = None, client: Any = None) -> Any:
    """The AsyncLLM front end over an engine-core child process; raises with the child's error if loading fails.
    ``client``: an ``MPCoreClient(config, wait=False)`` started earlier (``strata serve`` spawns it before its own
    heavy imports). The tokenizer loads here while the engine process loads the model."""
    from strataserve.engine.async_llm import AsyncLLM
    from strataserve.engine.input_processor import load_tokenizer
    from strataserve.engine.mp_client import MPCoreClient

    label = f"[bold]{name}[/] " if name else ""
    with console.status(f"[bold]Loading model[/] {label}{config.model.model} (engine process)…"):
        if client is None:
            client = MPCoreClient(config, startup_timeout_s=startup_timeout_s, wait=False)
        try:
            t0 = time.perf_counter()
            try:
                tokenizer = load_tokenizer(config.model.tokenizer or config.model.model,
                                           config.model.skip_tokenizer_init)
            except Exception:
                client.wait_ready(startup_timeout_s)  # the engine's error (e.g. no config.json) comes first
                raise
            t_tok = time.perf_counter() - t0
            client.wait_ready(startup_timeout_s)
            engine = AsyncLLM(config, core_client=client, tokenizer=tokenizer)
        except BaseException:
            client.shutdown()
            raise
    info = client.ready_info
    console.print(f"[green]✓[/] engine process: spawned at {client.spawned_at:.2f} s, ready at "
                  f"{process_age():.2f} s ({format_phases(info.startup)}); tokenizer {t_tok:.2f} s beside it",
                  soft_wrap=True)
    console.print(f"[green]✓[/] model {label}loaded on {info.device} ({info.dtype}); max_model_len "
                  f"{info.max_model_len}")
    console.print(f"[green]✓[/] {kv_cache_line(info)}")
    if info.step_target_ms:
        console.print(f"[green]✓[/] step pacing: while streams decode, a step takes the prompt tokens that fit in "
                      f"~{info.step_target_ms:g} ms (--target-step-ms; 0 turns it off)", soft_wrap=True)
    return engine


def load_speech(name: str, cfg: EngineConfig, console: Console) -> Any:
    """An in-process ``AsyncTTS`` (its engine core runs on a thread) for a Qwen3-TTS checkpoint folder, or an
    ``AsyncOmniVoice`` (its batching scheduler runs on a thread) for an OmniVoice folder."""
    from strataserve.engine.async_tts import AsyncTTS
    from strataserve.engine.omnivoice_tts import AsyncOmniVoice

    if is_omnivoice_dir(cfg.model.model):
        with console.status(f"[bold]Loading speech model[/] {cfg.model.model}…"):
            try:
                return AsyncOmniVoice.from_pretrained(cfg.model.model, device=cfg.model.device,
                                                      dtype=cfg.model.dtype, mode=cfg.runner.mode,
                                                      max_batch=cfg.scheduler.max_num_seqs, name=name)
            except ValueError as exc:
                raise EngineStartupError(str(exc)) from None

    with console.status(f"[bold]Loading speech model[/] {cfg.model.model}…"):
        try:
            return AsyncTTS.from_pretrained(cfg.model.model, device=cfg.model.device, dtype=cfg.model.dtype,
                                            mode=cfg.runner.mode, max_model_len=cfg.model.max_model_len or 4096,
                                            max_num_seqs=cfg.scheduler.max_num_seqs,
                                            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                                            block_size=cfg.cache.block_size, num_blocks=cfg.cache.num_blocks,
                                            kv_cache_memory_gib=cfg.cache.kv_cache_memory_gib, name=name)
        except ValueError as exc:  # named checkpoint errors: the CLI reports them as a failed start
            raise EngineStartupError(str(exc)) from None


def is_speech_dir(path: str) -> bool:
    """A speech checkpoint (served in process by ``load_speech``) rather than an LLM."""
    return is_qwen3_tts_dir(path) or is_omnivoice_dir(path)


def is_in_process_speech(engine: Any) -> bool:
    """Whether ``engine`` came from ``load_speech`` (no engine process to supervise)."""
    from strataserve.engine.async_tts import AsyncTTS
    from strataserve.engine.omnivoice_tts import AsyncOmniVoice

    return isinstance(engine, (AsyncTTS, AsyncOmniVoice))


def load_replicas(name: str, config: EngineConfig, console: Console, *, replicas: int, placement: str,
                  ray_address: str | None, num_gpus_per_replica: float | None, startup_timeout_s: float | None,
                  affinity_chars: int, affinity_slack: float) -> ReplicatedEngine:
    """The model's replicas (engine processes on this host, or Ray actors), started together."""
    where = "Ray actors" if placement == "ray" else "engine processes"
    with console.status(f"[bold]Loading model[/] [bold]{name}[/] {config.model.model} ({replicas} {where})…"):
        try:
            engine = start_replicas(name, config, count=replicas, placement=placement, ray_address=ray_address,
                                    num_gpus_per_replica=num_gpus_per_replica, startup_timeout_s=startup_timeout_s,
                                    affinity_chars=affinity_chars, slack=affinity_slack)
        except (ValueError, ConnectionError) as exc:  # GPUs short, or no Ray cluster at ray_address
            raise EngineStartupError(str(exc)) from None
    plan = engine.launcher.plan if engine.launcher is not None else None
    gpus = f", {plan.num_gpus:g} GPU(s) each" if plan is not None and plan.num_gpus else ""
    console.print(f"[green]✓[/] model [bold]{name}[/] loaded: {replicas} replicas as {where}{gpus}; "
                  f"max_model_len {engine.max_model_len}")
    return engine


def adopt_early_client(started: dict, config: EngineConfig) -> Any:
    """The engine process ``strata serve`` spawned before its imports for this config, if any (removed from
    ``started``)."""
    from strataserve.engine.mp_client import process_key

    return started.pop(process_key(config), None)


async def start_model_server(path: str, control_mode: str, registry: CollectorRegistry,
                             load_models: Sequence[str], console: Console, poll_interval_s: float = 1.0,
                             strict_readiness: bool = True) -> Any:
    """The model repository's server (the KServe tensor backend), started."""
    from strataserve.modelserver.server import ModelServer

    with console.status(f"[bold]Loading model repository[/] {path}…"):
        model_server = ModelServer(path, control_mode=control_mode, registry=registry, load_models=list(load_models),
                                   poll_interval_s=poll_interval_s, strict_readiness=strict_readiness)
        await model_server.start()
    every = f", scanned every {poll_interval_s:g} s" if control_mode == "poll" else ""
    console.print(f"[green]✓[/] model repository {path} (control mode {control_mode}{every})")
    return model_server
