"""Start-up and shutdown of ``strata serve``: engine process, optional model repository + gRPC, uvicorn.

Order: load the engine (child process, handshake) → start the model server → bind HTTP (and gRPC) → print the
ready URL. On SIGINT/SIGTERM uvicorn drains, then gRPC, the model server and the engine process are stopped, in
that order, so no port, socket file or child process outlives the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
from dataclasses import dataclass
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry
from rich.console import Console

from strataserve.api.app import DEFAULT_MAX_BODY_BYTES, build_app
from strataserve.api.metrics import ServerMetrics
from strataserve.api.serving import ServerState
from strataserve.config import EngineConfig

log = logging.getLogger("strataserve.server")


@dataclass(frozen=True)
class ServeOptions:
    engine: EngineConfig | None  # None: serve only the model repository
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    uvicorn_log_level: str = "info"
    access_log: bool = True
    model_repository: str | None = None
    model_control_mode: str = "none"
    load_models: tuple[str, ...] = ()  # explicit mode: load these at start ("*" = all)
    grpc_port: int | None = 8001
    startup_timeout_s: float | None = None
    graceful_shutdown_s: int = 10
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False


class _Server(uvicorn.Server):
    """uvicorn would re-raise SIGTERM after shutdown (killing us before our cleanup); we own the signals."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


def _fmt_gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3f} GiB" if num_bytes else "unknown size"


def load_engine(config: EngineConfig, console: Console, startup_timeout_s: float | None = None) -> Any:
    """The AsyncLLM front end over an engine-core child process; raises with the child's error if loading fails."""
    from strataserve.engine.async_llm import AsyncLLM
    from strataserve.engine.mp_client import MPCoreClient

    with console.status(f"[bold]Loading model[/] {config.model.model} (engine process)…"):
        client = MPCoreClient(config, startup_timeout_s=startup_timeout_s)
        try:
            engine = AsyncLLM(config, core_client=client)
        except BaseException:
            client.shutdown()
            raise
    info = client.ready_info
    console.print(f"[green]✓[/] model loaded on {info.device} ({info.dtype}); max_model_len {info.max_model_len}")
    console.print(f"[green]✓[/] KV cache: {info.num_blocks} blocks × {info.block_size} tokens = "
                  f"{info.num_blocks * info.block_size} tokens, {_fmt_gib(info.kv_cache_bytes)}")
    return engine


def _served_name(options: ServeOptions) -> str:
    if options.served_model_name:
        return options.served_model_name
    assert options.engine is not None
    return options.engine.model.served_model_name or options.engine.model.model


def _vocab_size(tokenizer: Any) -> int | None:
    for attr in ("vocab_size",):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            try:
                return max(v, len(tokenizer))
            except TypeError:
                return v
    try:
        return len(tokenizer)
    except TypeError:
        return None


def build_state(engine: Any, options: ServeOptions, registry: CollectorRegistry) -> ServerState:
    assert options.engine is not None
    name = _served_name(options)
    max_len = int(engine.max_model_len)
    metrics = ServerMetrics(name, max_len, lambda: getattr(engine, "stats", None), registry)
    sched = options.engine.scheduler
    return ServerState(engine=engine, tokenizer=engine.tokenizer, model_name=name, max_model_len=max_len,
                       metrics=metrics, max_inflight_seqs=sched.max_num_seqs + sched.max_waiting_requests,
                       vocab_size=getattr(engine, "vocab_size", None) or _vocab_size(engine.tokenizer),
                       tool_call_parser=options.tool_call_parser,
                       enable_auto_tool_choice=options.enable_auto_tool_choice)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _serve_async(options: ServeOptions, engine: Any, console: Console) -> None:
    registry = CollectorRegistry()
    state = build_state(engine, options, registry) if engine is not None else None
    model_server = grpc_handle = None
    if options.model_repository:
        from strataserve.modelserver.server import ModelServer

        with console.status(f"[bold]Loading model repository[/] {options.model_repository}…"):
            model_server = ModelServer(options.model_repository, control_mode=options.model_control_mode,
                                       registry=registry, load_models=list(options.load_models))
            await model_server.start()
        console.print(f"[green]✓[/] model repository {options.model_repository} "
                      f"(control mode {options.model_control_mode})")
    app = build_app(state, registry=registry, api_key=options.api_key, max_body_bytes=options.max_body_bytes,
                    model_server=model_server)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.uvicorn_log_level,
                            access_log=options.access_log, timeout_keep_alive=30, lifespan="off",
                            # On SIGTERM, let in-flight generations finish for a while, then cancel them (the
                            # cancellation aborts them in the engine) so shutdown never hangs on a long stream.
                            timeout_graceful_shutdown=options.graceful_shutdown_s)
    server = _Server(config)
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    try:
        if model_server is not None and options.grpc_port:
            from strataserve.api.kserve_grpc import start_grpc_server

            grpc_handle = await _maybe_await(start_grpc_server(model_server, options.host, options.grpc_port))
        serving = asyncio.ensure_future(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            _banner(console, options, state, getattr(grpc_handle, "port", None))
        await serving
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if grpc_handle is not None:
            await _maybe_await(grpc_handle.stop())
        if model_server is not None:
            await model_server.stop()


def _banner(console: Console, options: ServeOptions, state: ServerState | None, grpc_port: int | None) -> None:
    host = "127.0.0.1" if options.host in ("0.0.0.0", "::", "") else options.host
    url = f"http://{host}:{options.port}"
    if state is not None:
        console.print(f"[bold green]Ready[/]: serving [bold]{state.model_name}[/] at {url}/v1 "
                      f"(metrics {url}/metrics)", soft_wrap=True)
    if options.model_repository:
        grpc = f", gRPC {host}:{grpc_port}" if grpc_port else ""
        console.print(f"[bold green]Ready[/]: KServe v2 at {url}/v2{grpc}", soft_wrap=True)


def _run_loop(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def serve(options: ServeOptions, console: Console | None = None) -> None:
    """Blocking: run the server until SIGINT/SIGTERM, then release everything."""
    console = console or Console(stderr=True)
    engine = None
    if options.engine is not None:
        engine = load_engine(options.engine, console, options.startup_timeout_s)
    try:
        _run_loop(_serve_async(options, engine, console))
    finally:
        if engine is not None:
            engine.shutdown()
        console.print("strataserve stopped")
