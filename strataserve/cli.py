"""The ``strata`` command: ``serve`` (OpenAI + KServe server), ``bench serve`` (load generator), ``generate``.

Flags are named like vLLM's where they mean the same thing, so existing launch scripts port by a rename.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Sequence

from strataserve import envs
from strataserve.cli_checks import flag_error, options_error, repository_override
from strataserve.cli_door import add_door_args, door_options
from strataserve.cli_types import api_key, port, positive_float, positive_int, positive_mib, step_ms
from strataserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig
from strataserve.engine.step_budget import AUTO_TARGET_STEP_MS

if TYPE_CHECKING:
    from rich.console import Console

    from strataserve.api.server import ServeOptions


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except where the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "half", "float"])
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=positive_int, default=SchedulerConfig.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=SchedulerConfig.max_num_batched_tokens)
    g.add_argument("--max-waiting-requests", type=positive_int, default=SchedulerConfig.max_waiting_requests,
                   help="waiting-queue limit; beyond it requests get 503 + Retry-After")
    g.add_argument("--target-step-ms", type=step_ms, default="auto",
                   help="while decodes run, cap each step's prefill tokens so the step takes about this long (the "
                        f"streams' inter-token latency); 0 = off; auto = {AUTO_TARGET_STEP_MS:g} where steps with "
                        "prompt tokens replay CUDA graphs (GPU, hybrid mode, one GPU), off elsewhere")
    g.add_argument("--stream-interval", type=positive_int, default=SchedulerConfig.stream_interval,
                   help="streamed chunks carry at least this many tokens (the first token is sent at once): fewer "
                        "socket writes per token when the API process or the clients are short of CPU")
    g.add_argument("--block-size", type=positive_int, default=CacheConfig.block_size)
    g.add_argument("--kv-cache-memory-gib", type=float, default=CacheConfig.kv_cache_memory_gib,
                   help="KV-cache budget on CPU, in GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization,
                   help="fraction of GPU memory the engine may use (weights + KV cache)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="fix the KV pool size in blocks")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"],
                   help="KV cache storage: auto = the model dtype; fp8 (e4m3) or int8 with per-head scales "
                        "(twice the blocks of bf16 for the same memory)")
    g.add_argument("--runner-mode", default="auto", choices=["auto", "eager", "triton", "graph", "hybrid"])
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="split the model over this many GPUs of this host (one process each, NCCL)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights in config.json's shapes, no weight files (benchmarks)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: token-id prompts only, outputs as token ids (return_token_ids)")


def _first_name(names: str | list[str] | None) -> str | None:
    """The name responses carry: the first of --served-model-name's (a config entry gives one string)."""
    return names[0] if isinstance(names, list) else names


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    """Build (and so validate) the engine config; a bad value raises ValueError naming the flag's field."""
    return EngineConfig(
        model=ModelConfig(model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                          seed=args.seed, served_model_name=_first_name(getattr(args, "served_model_name", None)),
                          skip_tokenizer_init=getattr(args, "skip_tokenizer_init", False),
                          load_format=getattr(args, "load_format", "auto")),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gib=args.kv_cache_memory_gib,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          num_blocks=args.num_gpu_blocks_override, enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto")),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_waiting_requests=args.max_waiting_requests,
                                  target_step_ms=getattr(args, "target_step_ms", None),
                                  stream_interval=getattr(args, "stream_interval", 1)),
        runner=RunnerConfig(mode=args.runner_mode, defer_cuda_graphs=envs.STRATA_SERVE_DEFER_GRAPHS),
        parallel=ParallelConfig(tensor_parallel_size=getattr(args, "tensor_parallel_size", 1)),
    )


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an LLM over the OpenAI API (and a model repository over KServe v2)",
                       formatter_class=_Help)
    p.add_argument("model", nargs="?", default=None,
                   help="HF checkpoint folder (default: the embedded demo model, unless --model-repository)")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default="0.0.0.0",
                   help="address the HTTP and gRPC servers listen on (0.0.0.0: every IPv4 interface; :: for IPv6)")
    p.add_argument("--port", type=port, default=8000, help="HTTP port (OpenAI API, KServe v2 HTTP, console)")
    p.add_argument("--api-key", type=api_key, default=envs.STRATA_API_KEY,
                   help="require 'Authorization: Bearer KEY' on HTTP and gRPC (the probes and docs stay open, "
                        "and /metrics unless --metrics-require-key)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use (default: the folder path); as vLLM's, every name is served and "
                        "listed, and responses carry the first")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for what a request leaves unset (vLLM's flag): auto = the checkpoint's "
                        "generation_config.json, vllm = none, or a folder holding one")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--max-request-body-mib", type=positive_mib, default=16.0, help="larger bodies get 413")
    p.add_argument("--model-repository", default=None, help="serve this Triton-style model repository (KServe v2)")
    # default None (it means none), so that a typed value wins over a config file's key and an untyped one not
    p.add_argument("--model-control-mode", default=None, choices=["none", "explicit", "poll"],
                   help="repository models: none = load all at start; explicit = load / unload over the API; "
                        "poll = follow the repository's changes (Triton's flag; default: none)")
    # default None, so that a value given without --model-repository can be refused; it means 1 s
    p.add_argument("--repository-poll-secs", type=positive_float, default=None, metavar="S",
                   help="poll mode: how often the repository is scanned for changes (Triton's flag; default: 1)")
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="explicit mode: load this repository model at start (repeat; '*' = all)")
    # default None, so that a value given without --model-repository can be refused; it means on
    p.add_argument("--strict-readiness", action=argparse.BooleanOptionalAction, default=None,
                   help="/v2/health/ready and gRPC ServerReady: ready only while every repository model that "
                        "should be loaded is READY; off: ready once started; Triton's flag (default: on)")
    p.add_argument("--grpc-port", type=port, default=8001, help="KServe v2 gRPC port (0 = no gRPC)")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="serve what this router config declares (local models, upstream OpenAI / KServe servers, "
                        "a model repository, SLA classes); engine flags given here are every local model's defaults")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let tool_choice='auto' parse tool calls out of the output (needs --tool-call-parser)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="tool-call format of the model family: hermes (Qwen2/3), llama3_json, mistral")
    add_door_args(p)
    add_engine_args(p)
    p.set_defaults(func=_cmd_serve)


def _entry_engine(args: argparse.Namespace, entry) -> EngineConfig:
    """A config entry's EngineConfig: the command line's engine flags, overridden by the entry's own keys."""
    merged = argparse.Namespace(**{**vars(args), **entry.engine_overrides(), "served_model_name": entry.name})
    try:
        return engine_config(merged, entry.path)
    except ValueError as exc:
        raise ValueError(f"model {entry.name!r}: {exc}") from None


def _serve_options(args: argparse.Namespace, console: Console) -> ServeOptions | None:
    from strataserve.api.server import LocalLLMSpec, ServeOptions

    error = flag_error(args)
    if error is not None:
        console.print(f"[red]error:[/] {error}", soft_wrap=True)
        return None
    server = dict(host=args.host, port=args.port, api_key=args.api_key,
                  max_body_bytes=int(args.max_request_body_mib * 2**20), uvicorn_log_level=args.uvicorn_log_level,
                  access_log=not args.disable_uvicorn_access_log, load_models=tuple(args.load_model),
                  grpc_port=args.grpc_port or None)
    # the repository flags only where typed: each wins over a config file's key; untyped, the file's key applies,
    # else ServeOptions' default
    for option, value in (("model_repository", args.model_repository), ("model_control_mode", args.model_control_mode),
                          ("repository_poll_s", args.repository_poll_secs),
                          ("strict_readiness", args.strict_readiness)):
        if value is not None:
            server[option] = value
    try:
        server.update(door_options(args))
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return None
    if args.config is not None:
        from strataserve.router.config import ConfigError, load_config

        if args.model or args.model_flag:
            console.print("[red]error:[/] give either a model folder or --config, not both (list the model in the "
                          "config's `models`)")
            return None
        try:
            config = load_config(args.config)
            warning = repository_override(args, config.model_repository)
            if warning is not None:
                console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
            options = ServeOptions.from_config(config, lambda e: _entry_engine(args, e),
                                               (args.tool_call_parser, args.enable_auto_tool_choice),
                                               args.generation_config, **server)
        except (ConfigError, ValueError) as exc:
            console.print(f"[red]error:[/] {exc}", soft_wrap=True)
            return None
        error = options_error(args, options)
        if error is not None:
            console.print(f"[red]error:[/] {error}", soft_wrap=True)
            return None
        return options
    model = args.model or args.model_flag
    if model is None and args.model_repository is None:
        from strataserve.assets import DEMO_MODEL_DIR

        model = str(DEMO_MODEL_DIR)
        if args.served_model_name is None:
            args.served_model_name = [DEMO_MODEL_DIR.name]
        console.print(f"No model given: serving the embedded demo model ({model})", soft_wrap=True)
    llms = ()
    if model is not None:
        try:
            config = engine_config(args, model)
        except ValueError as exc:
            console.print(f"[red]error:[/] {exc}")
            return None
        if not os.path.isdir(model):
            console.print(f"[red]error:[/] model folder {model!r} does not exist (give an HF checkpoint folder)")
            return None
        names = args.served_model_name or [model]
        llms = (LocalLLMSpec(names[0], config, tool_call_parser=args.tool_call_parser,
                             enable_auto_tool_choice=args.enable_auto_tool_choice,
                             generation_config=args.generation_config, aliases=tuple(names[1:])),)
    return ServeOptions(llms=llms, **server)


def _spawn_early(args: argparse.Namespace) -> dict:
    """The engine process of the LLM folder named on the command line, started before this process's heavy imports
    (fastapi, torch, transformers), so the two load side by side; {} where anything is off (``_serve_options``
    then reports it) or for a config file / speech checkpoint (loaded the ordinary way)."""
    if args.config is not None or not envs.STRATA_SERVE_EARLY_SPAWN or flag_error(args) is not None:
        return {}
    from strataserve.models.qwen3_tts.config import is_qwen3_tts_dir  # no torch: models/ loads lazily

    model = args.model or args.model_flag
    if model is None and args.model_repository is None:
        from strataserve.assets import DEMO_MODEL_DIR

        model = str(DEMO_MODEL_DIR)
    if model is None or not os.path.isdir(model) or is_qwen3_tts_dir(model):
        return {}
    try:
        config = engine_config(args, model)
    except ValueError:
        return {}
    from strataserve.engine.mp_client import MPCoreClient, process_key

    return {process_key(config): MPCoreClient(config, wait=False)}


def _cmd_serve(args: argparse.Namespace) -> int:
    import time

    t0 = time.perf_counter()
    early = _spawn_early(args)
    from rich.console import Console

    from strataserve.api.server import serve
    from strataserve.types.errors import EngineStartupError

    console = Console(stderr=True)
    options = _serve_options(args, console)
    if options is None:
        for client in early.values():
            client.shutdown()
        return 2
    try:
        serve(options, console, started=early, imports_s=time.perf_counter() - t0)
    except EngineStartupError as exc:
        console.print(f"[red]error:[/] the engine failed to start: {exc}")
        return 1
    except (OSError, ValueError) as exc:  # the port is taken; a start-up ValueError says what to change
        console.print(f"[red]error:[/] {exc}", soft_wrap=True)
        return 1
    return 0


def _add_bench(sub: argparse._SubParsersAction, full: bool = True) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_cmd", required=True)
    serve_p = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server (ours, vLLM, ...)",
                                   formatter_class=_Help)
    if not full:  # another command: its options are never parsed
        return
    try:
        from strataserve.bench.serve import add_cli_args
    except ImportError:
        serve_p.set_defaults(func=lambda _: _missing("strataserve.bench.serve"))
        return
    add_cli_args(serve_p)
    serve_p.set_defaults(func=_cmd_bench_serve)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from strataserve.bench.serve import run

    run(args)
    return 0


def _missing(module: str) -> int:
    print(f"error: {module} is not available in this installation", file=sys.stderr)
    return 1


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation with the LLM class (no server)",
                       formatter_class=_Help)
    p.add_argument("model", nargs="?", default=None, help="HF checkpoint folder (default: the demo model)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--chat", action="store_true", help="treat each prompt as a user chat message")
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)


def _generate_llm(llm_cls: Any, model: str, c: EngineConfig) -> Any:
    """The offline engine of ``strata generate``; a ValueError says what in the flags to change."""
    return llm_cls(model=model, dtype=c.model.dtype, device=c.model.device, max_model_len=c.model.max_model_len,
                   seed=c.model.seed, block_size=c.cache.block_size, kv_cache_memory_gib=c.cache.kv_cache_memory_gib,
                   gpu_memory_utilization=c.cache.gpu_memory_utilization, num_blocks=c.cache.num_blocks,
                   enable_prefix_caching=c.cache.enable_prefix_caching, max_num_seqs=c.scheduler.max_num_seqs,
                   max_num_batched_tokens=c.scheduler.max_num_batched_tokens, mode=c.runner.mode,
                   target_step_ms=c.scheduler.target_step_ms,
                   tensor_parallel_size=c.parallel.tensor_parallel_size, load_format=c.model.load_format,
                   kv_cache_dtype=c.cache.kv_cache_dtype)


def _cmd_generate(args: argparse.Namespace) -> int:
    from strataserve import LLM, SamplingParams

    model = args.model
    if model is None:
        from strataserve.assets import DEMO_MODEL_DIR

        model = str(DEMO_MODEL_DIR)
    try:
        config = engine_config(args, model)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        if config.model.skip_tokenizer_init:
            raise ValueError("--skip-tokenizer-init: strata generate takes text prompts and prints text; it needs "
                             "the tokenizer (serve with it and send token ids instead)")
        llm = _generate_llm(LLM, model, config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outs):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM before the server took over its signals: unwinds as Ctrl-C does, exits 128 + 15 as killed."""


def _interrupt(signum: int, frame: object) -> None:
    raise _Terminated


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``strata`` parser. Given the command line ``argv``, the bench options (their module imports aiohttp
    and numpy: ~0.3 s) are only built when it names ``bench`` (or asks for help), so ``strata serve`` spawns its
    engine process that much sooner."""
    from strataserve import __version__

    parser = argparse.ArgumentParser(prog="strata", description="strataserve: LLM + multi-model inference server")
    parser.add_argument("-V", "--version", action="version", version=f"strataserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_bench(sub, full=argv is None or not argv or argv[0] not in ("serve", "generate"))
    _add_generate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    # SIGTERM while loading: unwind like Ctrl-C so the engine child and its socket files are cleaned up.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return int(args.func(args) or 0)
    except _Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
