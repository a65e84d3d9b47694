"""Loading what ``strata serve`` hosts, with its start-up lines: an LLM engine (its engine-core child process and
the tokenizer beside it), a replicated model, a speech model (Qwen3-TTS or OmniVoice, in process).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Console

from strataserve.config import EngineConfig
from strataserve.models.omnivoice.config import is_omnivoice_dir
from strataserve.startup import format_phases, process_age

if TYPE_CHECKING:
    from strataserve.api.server import LocalLLMSpec


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
    return engine


def load_speech(spec: LocalLLMSpec, console: Console) -> Any:
    """An in-process ``AsyncTTS`` (its engine core runs on a thread) for a Qwen3-TTS checkpoint folder, or an
    ``AsyncOmniVoice`` (its batching scheduler runs on a thread) for an OmniVoice folder."""
    from strataserve.engine.async_tts import AsyncTTS
    from strataserve.engine.mp_client import EngineStartupError
    from strataserve.engine.omnivoice_tts import AsyncOmniVoice

    cfg, name = spec.engine, spec.name
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
