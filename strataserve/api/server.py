"""Start-up and shutdown of ``strata serve``: engine processes, the router and its backends, optional model
repository + gRPC, uvicorn.

Order: load each local engine (its own child process, handshake; `router/launch.py`) → build the router (upstream
backends start their health checks; the model server loads; each local engine gets a supervisor that restarts it
after a crash) → bind HTTP (and gRPC), with TLS when given → print the ready URLs. On SIGTERM (or SIGINT) the
server drains: new requests get 503 + Retry-After and /health 503 while admitted ones finish, for up to
``--shutdown-timeout`` seconds (a second signal cuts it short); then uvicorn, gRPC, the router's backends, the
model server and the engine processes are stopped, in that order, so no port, socket file or child process outlives
the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

import uvicorn
from prometheus_client import CollectorRegistry
from rich.console import Console

from strataserve.api.app import build_app
from strataserve.api.door import CORS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUED_BYTES, Door, DoorConfig
from strataserve.api.limits import RequestLimits
from strataserve.api.metrics import MetricsGroup, ServerMetrics
from strataserve.api.rate_metrics import CountingQuota
from strataserve.api.serving import ServerState
from strataserve.config import EngineConfig
from strataserve.models.generation_defaults import describe, sampling_defaults
from strataserve.router.backends.kserve_upstream import KServeUpstreamBackend
from strataserve.router.backends.local_llm import LocalLLMBackend
from strataserve.router.backends.openai_upstream import OpenAIUpstreamBackend
from strataserve.router.backends.tts import TTSBackend
from strataserve.router.config import KServeUpstream, LocalModel, OpenAIUpstream, RouterConfig, merge_repository_keys
from strataserve.router.launch import (adopt_early_client, is_in_process_speech, is_speech_dir, load_engine,
                                       load_replicas, load_speech, start_model_server)
from strataserve.router.aliases import AliasRouter
from strataserve.router.local_replicas import ReplicatedEngine
from strataserve.router.metrics import RouterMetrics
from strataserve.router.quota import RateLimits
from strataserve.router.router import Router
from strataserve.router.sla import SLA, SLAPolicy
from strataserve.router.supervisor import EngineSupervisor, RestartMetrics
from strataserve.router.tensors import TensorRouter
from strataserve.startup import freeze_startup_heap, process_age

log = logging.getLogger("strataserve.server")


@dataclass(frozen=True)
class LocalLLMSpec:
    """One local LLM: the name clients use, its engine config, and its GPU price (cost metrics)."""

    name: str
    engine: EngineConfig
    gpu_cost_per_hour: float | None = None
    tool_call_parser: str | None = None  # hermes / llama3_json / mistral: parse tool calls out of the output
    enable_auto_tool_choice: bool = False
    # Replicas (router/local_replicas.py): None = one engine-core process, as without a config file
    placement: str | None = None  # "local" (processes on this host) or "ray" (actors on a Ray cluster)
    replicas: int = 1
    ray_address: str | None = None
    num_gpus_per_replica: float | None = None
    generation_config: str = "auto"  # sampling defaults: the checkpoint's generation_config.json ("vllm": none)
    aliases: tuple[str, ...] = ()  # more names it answers to (--served-model-name NAME ALIAS ...)


@dataclass(frozen=True)
class ServeOptions:
    llms: tuple[LocalLLMSpec, ...] = ()
    upstreams: tuple[OpenAIUpstream | KServeUpstream, ...] = ()
    sla: SLAPolicy = field(default_factory=SLAPolicy.single)
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    extra_api_keys: tuple[str, ...] = ()  # keys mapped to SLA classes in the config
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES
    grpc_max_message_bytes: int | None = None  # None: max_body_bytes
    metrics_require_key: bool = False
    rate: RateLimits = field(default_factory=RateLimits)
    limits: RequestLimits = field(default_factory=RequestLimits)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    cors: CORS | None = None  # --allowed-origins: browser pages of other origins may call the API
    restart_engines: bool = True
    uvicorn_log_level: str = "info"
    access_log: bool = True
    model_repository: str | None = None
    model_control_mode: str = "none"
    load_models: tuple[str, ...] = ()  # explicit mode: load these at start ("*" = all)
    repository_poll_s: float = 1.0  # poll mode: --repository-poll-secs
    strict_readiness: bool = True  # --[no-]strict-readiness: readiness waits for every repository model
    grpc_port: int | None = 8001
    startup_timeout_s: float | None = None
    graceful_shutdown_s: float = 10.0  # --shutdown-timeout: the drain's limit
    health_check_interval_s: float = 2.0
    affinity_chars: int = 256
    affinity_slack: int = 2

    @classmethod
    def from_config(cls, config: RouterConfig, base_engine: Callable[[LocalModel], EngineConfig],
                    tools: tuple[str | None, bool] = (None, False), generation_config: str = "auto",
                    **server: Any) -> "ServeOptions":
        """Options for a config file; ``base_engine`` builds an entry's EngineConfig (CLI defaults + its keys),
        ``tools`` is the command line's (tool_call_parser, enable_auto_tool_choice) and ``generation_config`` its
        --generation-config, which an entry may override."""
        llms = tuple(LocalLLMSpec(m.name, base_engine(m), m.gpu_cost_per_hour,
                                  m.tool_call_parser if m.tool_call_parser is not None else tools[0],
                                  m.enable_auto_tool_choice if m.enable_auto_tool_choice is not None else tools[1],
                                  (m.placement or "local") if m.replicated else None, m.replicas, m.ray_address,
                                  m.num_gpus_per_replica, m.generation_config or generation_config)
                     for m in config.models if isinstance(m, LocalModel))
        ups = tuple(m for m in config.models if not isinstance(m, LocalModel))
        classes = {k: SLA(k, v.priority, v.ttft_ms, v.tpot_ms) for k, v in config.sla_classes.items()}
        keys = config.key_classes()
        merge_repository_keys(config, server)
        return cls(llms=llms, upstreams=ups, sla=SLAPolicy(classes, config.default_sla or "", keys),
                   extra_api_keys=tuple(keys), health_check_interval_s=config.health_check_interval_s,
                   affinity_chars=config.prefix_affinity_chars, affinity_slack=config.affinity_slack, **server)


class _Server(uvicorn.Server):
    """uvicorn would re-raise SIGTERM after shutdown (killing us before our cleanup); we own the signals."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


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


def build_state(engine: Any, spec: LocalLLMSpec, metrics_group: MetricsGroup) -> ServerState:
    max_len = int(engine.max_model_len)
    state: ServerState | None = None  # the engine is read through the state: a restart replaces it
    metrics = ServerMetrics(spec.name, max_len, lambda: getattr(state.engine, "stats", None) if state else None,
                            register=False)
    metrics_group.add(metrics)
    sched = spec.engine.scheduler
    cores = len(engine.engines) if isinstance(engine, ReplicatedEngine) else 1  # each replica queues its own
    state = ServerState(engine=engine, tokenizer=engine.tokenizer, model_name=spec.name, max_model_len=max_len,
                       metrics=metrics, max_inflight_seqs=cores * (sched.max_num_seqs + sched.max_waiting_requests),
                       max_running_seqs=cores * sched.max_num_seqs,
                       vocab_size=getattr(engine, "vocab_size", None) or _vocab_size(engine.tokenizer),
                       tool_call_parser=spec.tool_call_parser, enable_auto_tool_choice=spec.enable_auto_tool_choice,
                       sampling_defaults=sampling_defaults(spec.engine.model.model, spec.generation_config))
    return state


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def build_router(options: ServeOptions, engines: dict[str, Any], registry: CollectorRegistry,
                       console: Console) -> Router:
    """Every backend the options declare, registered with one router (the model repository is started here).
    ``engines`` maps each local model's name to its ``AsyncLLM`` or, for a speech checkpoint, its ``AsyncTTS``."""
    router = AliasRouter(options.sla, RouterMetrics(registry), CountingQuota(options.rate, registry, options.sla))
    group, speech_group = MetricsGroup(registry), MetricsGroup(registry)
    restarts = RestartMetrics(registry)
    for spec in options.llms:
        engine = engines[spec.name]
        if is_in_process_speech(engine):  # no engine process to supervise
            router.add(TTSBackend(engine, speech_group, spec.gpu_cost_per_hour))
            continue
        backend = LocalLLMBackend(build_state(engine, spec, group), spec.gpu_cost_per_hour)
        if backend.state.sampling_defaults:
            console.print(f"{spec.name}: sampling defaults from generation_config.json for what a request leaves "
                          f"unset: {describe(backend.state.sampling_defaults)} (--generation-config vllm: none)",
                          soft_wrap=True)
        if options.restart_engines:
            backend.supervisors = _supervisors(backend, spec, options, engines, restarts, console)
        router.add(backend)
        for alias in spec.aliases:
            router.add_alias(alias, spec.name)
    kserve: dict[str, KServeUpstreamBackend] = {}
    for up in options.upstreams:
        if isinstance(up, OpenAIUpstream):
            router.add(OpenAIUpstreamBackend(up, affinity_chars=options.affinity_chars, slack=options.affinity_slack,
                                             health_interval_s=options.health_check_interval_s))
        else:
            backend = KServeUpstreamBackend(up, health_interval_s=options.health_check_interval_s)
            router.add(backend)
            kserve[up.name] = backend
    model_server = None
    if options.model_repository:
        model_server = await start_model_server(options.model_repository, options.model_control_mode, registry,
                                                options.load_models, console, options.repository_poll_s,
                                                strict_readiness=options.strict_readiness)
    if model_server is not None or kserve:
        # the KServe fronts: the repository, KServe upstreams, and (as Triton's vLLM backend) every local text model
        router.tensors = TensorRouter(model_server, kserve, router.non_tensor_cards, router=router,
                                      limits=options.limits)
    await router.start()
    return router


def _supervisors(backend: LocalLLMBackend, spec: LocalLLMSpec, options: ServeOptions, engines: dict[str, Any],
                 restarts: RestartMetrics, console: Console) -> list[EngineSupervisor]:
    """One supervisor per engine core: the model's one process, or each of its replicas."""
    state = backend.state
    if isinstance(state.engine, ReplicatedEngine):
        rep, launch = state.engine, state.engine.launcher
        return [EngineSupervisor(spec.name, lambda i=i: rep.engines[i], lambda e, i=i: rep.replace(i, e),
                                 lambda i=i: launch(i), restarts) for i in range(len(rep.engines))]

    def replace(engine: Any) -> None:
        state.engine = engines[spec.name] = engine  # the final shutdown stops the live one

    return [EngineSupervisor(spec.name, lambda: state.engine, replace,
                             lambda: load_engine(spec.engine, console, options.startup_timeout_s, spec.name),
                             restarts)]


def build_door(options: ServeOptions, router: Router) -> Door:
    keys = tuple(k for k in (options.api_key, *options.extra_api_keys) if k)
    return Door(DoorConfig(keys, options.metrics_require_key, options.max_body_bytes, options.max_queued_bytes,
                           options.rate), router.quota)


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the models load: a taken port fails at once with a sentence (uvicorn,
    binding it late, logged an error and exited with SystemExit 3 out of its task)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc} (is another server on the port? "
                      "choose another with --port)") from None
    return sock


async def _serve_async(options: ServeOptions, engines: dict[str, Any], console: Console,
                       sock: socket.socket) -> None:
    registry = CollectorRegistry()
    router = await build_router(options, engines, registry, console)
    grpc_handle = None
    door = build_door(options, router)
    app = build_app(router, registry=registry, door=door, limits=options.limits, cors=options.cors)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.uvicorn_log_level,
                            access_log=options.access_log, timeout_keep_alive=30, lifespan="off",
                            ssl_certfile=options.ssl_certfile, ssl_keyfile=options.ssl_keyfile,
                            # The drain already waited for in-flight requests; what is left (past the timeout)
                            # is cancelled, which aborts it in the engine, so shutdown never hangs on a stream.
                            timeout_graceful_shutdown=1)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    drain_task: asyncio.Future | None = None

    async def drain() -> None:
        door.begin_drain()
        console.print(f"draining: refusing new requests, waiting up to {options.graceful_shutdown_s}s for "
                      f"{door.inflight} in flight")
        if not await door.wait_idle(options.graceful_shutdown_s):
            console.print(f"shutdown timeout: cancelling {door.inflight} request(s) still in flight")
        server.should_exit = True

    def stop(sig: signal.Signals) -> None:
        nonlocal drain_task
        if drain_task is None and server.started:
            drain_task = asyncio.ensure_future(drain())
            return
        if server.should_exit or drain_task is not None:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    try:
        if router.tensors is not None and options.grpc_port:
            from strataserve.api.kserve_grpc import start_grpc_server

            tls = (options.ssl_certfile, options.ssl_keyfile) if options.ssl_certfile and options.ssl_keyfile else None
            grpc_handle = await _maybe_await(start_grpc_server(
                router.tensors, options.host, options.grpc_port, door=door, tls=tls,
                max_message_bytes=options.grpc_max_message_bytes or options.max_body_bytes))
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            app.state.console.start()  # the dashboard's history begins with the server
            freeze_startup_heap()
            # the bound port, not the asked one: --port 0 lets the OS choose
            _banner(console, options, router, sock.getsockname()[1], getattr(grpc_handle, "port", None))
            console.print(f"start-up: HTTP ready {process_age():.2f} s after the process started", soft_wrap=True)
        await serving
    finally:
        await app.state.console.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if drain_task is not None:
            drain_task.cancel()
        if grpc_handle is not None:
            await _maybe_await(grpc_handle.stop())
        await router.stop()
        if router.tensors is not None and router.tensors.local is not None:
            await router.tensors.local.stop()


def _banner(console: Console, options: ServeOptions, router: Router, port: int, grpc_port: int | None) -> None:
    host = "127.0.0.1" if options.host in ("0.0.0.0", "::", "") else options.host
    url = f"{'https' if options.ssl_certfile else 'http'}://{host}:{port}"
    for card in router.cards():
        where = {"text": f"{url}/v1", "speech": f"{url}/v1/audio/speech", "tensors": f"{url}/v2"}[card.payload.value]
        note = "" if card.ready else " [yellow](not ready: see /v1/models)[/]"
        console.print(f"[bold green]Ready[/]: [bold]{card.name}[/] ({card.backend}) at {where}{note}", soft_wrap=True)
    if router.tensors is not None:
        grpc = f", gRPC {host}:{grpc_port}" if grpc_port else ""
        console.print(f"[bold green]Ready[/]: KServe v2 at {url}/v2{grpc}", soft_wrap=True)
    console.print(f"console at {url}/ · metrics at {url}/metrics", soft_wrap=True)


def _run_loop(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def serve(options: ServeOptions, console: Console | None = None, started: dict[EngineConfig, Any] | None = None,
          imports_s: float | None = None) -> None:
    """Blocking: run the server until SIGINT/SIGTERM, then release everything. ``started``: engine processes
    spawned earlier (``MPCoreClient(..., wait=False)`` by engine config), adopted by the LLMs whose config matches;
    ``imports_s``: how long the caller's heavy imports took (the start-up breakdown)."""
    console = console or Console(stderr=True)
    started = dict(started or {})
    engines: dict[str, Any] = {}
    if imports_s is not None:
        console.print(f"start-up: API process imports {imports_s:.2f} s"
                      f"{' (beside the engine process)' if started else ''}", soft_wrap=True)
    sock = None
    try:
        sock = bind_http(options.host, options.port)
        for spec in options.llms:
            if is_speech_dir(spec.engine.model.model):
                engines[spec.name] = load_speech(spec.name, spec.engine, console)
            elif spec.placement is not None:  # replicas: several engine cores behind the router
                engines[spec.name] = load_replicas(
                    spec.name, spec.engine, console, replicas=spec.replicas, placement=spec.placement,
                    ray_address=spec.ray_address, num_gpus_per_replica=spec.num_gpus_per_replica,
                    startup_timeout_s=options.startup_timeout_s, affinity_chars=options.affinity_chars,
                    affinity_slack=options.affinity_slack)
            else:  # an LLM, in its own engine-core process
                engines[spec.name] = load_engine(spec.engine, console, options.startup_timeout_s, spec.name,
                                                 client=adopt_early_client(started, spec.engine))
        _run_loop(_serve_async(options, engines, console, sock))
    finally:
        if sock is not None:
            sock.close()
        for client in started.values():  # spawned early but not adopted (e.g. the options changed)
            client.shutdown()
        for engine in engines.values():
            engine.shutdown()
        console.print("strataserve stopped")
