"""The engine-core process: an ``EngineCore`` step loop behind two zmq sockets.

The API process binds a PUSH socket (requests, aborts, shutdown) and a PULL socket (one ``EngineCoreOutputs``
message per step) and spawns this process, which connects to both. Why a separate process: tokenising, JSON and
SSE work in the HTTP front must never stall the model loop, and the model loop must never wait on the front.

Loop invariants:
- idle (no unfinished requests): block on the input socket (with a timeout only to notice a dead parent); while
  the core reports deferred work (``idle_work()``: mixed-step graph capture) it does one piece between
  non-blocking polls instead, so a request that arrives waits for at most one piece;
- busy: drain every queued message without blocking, then step, then send that step's outputs in one message;
- after any message the core steps once even if idle, so the stats (KV usage after an abort) reach the front.

The start-up handshake goes over a ``multiprocessing`` pipe: ``ReadyInfo`` on success, ``StartupError`` with the
message of whatever failed (bad model path, out of memory) otherwise, so a bad start never hangs the front.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Any, Callable

import msgspec
import zmq

from strataserve.config import EngineConfig
from strataserve.types.protocol import EngineCoreOutputs, EngineCoreRequest
from strataserve.startup import Phases, freeze_startup_heap, leave_stopping_to_the_parent, process_age

# Input message kinds: the first frame of a multipart message.
ADD = b"A"
ABORT = b"X"
SHUTDOWN = b"Q"

# How often an idle core checks that its parent still lives (ms).
_IDLE_POLL_MS = 1000


class ReadyInfo(msgspec.Struct, kw_only=True, tag=True):
    """What the front needs to know once the model is loaded (start-up banner, length checks)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_bytes: int  # bytes of the whole KV pool (0 when unknown)
    device: str
    dtype: str
    kv_cache_dtype: str = ""  # KV storage dtype when it differs from ``dtype`` (fp8 / int8)
    step_target_ms: float = 0.0  # the step budget's target in effect (``engine/step_budget.py``); 0: unpaced
    #: this process's start-up phases (name, seconds), from its start to ready
    startup: list[tuple[str, float]] = []


class StartupError(msgspec.Struct, kw_only=True, tag=True):
    error_type: str
    message: str


def _kv_bytes_per_block(core: Any, block_size: int) -> int:
    """Size of one KV block from the runner's model config (0 when the runner does not say, e.g. a fake)."""
    runner = getattr(core, "runner", None)
    cfg = getattr(runner, "model_config", None)
    if cfg is None:
        return 0
    from strataserve.runner.attention import kv_cache_bytes_per_block

    return kv_cache_bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    getattr(runner, "kv_cache_dtype", runner.dtype))


def core_ready_info(core: Any, config: EngineConfig) -> ReadyInfo:
    runner = getattr(core, "runner", None)
    block_size = int(getattr(runner, "block_size", config.cache.block_size))
    num_blocks = int(getattr(core, "num_blocks", getattr(runner, "num_blocks", 0)))
    max_model_len = int(getattr(core, "max_model_len", getattr(runner, "max_model_len", 0)))
    device = str(getattr(runner, "device", config.model.device))
    dtype = str(getattr(runner, "dtype", config.model.dtype)).replace("torch.", "")
    kv_dtype = str(getattr(runner, "kv_cache_dtype", "")).replace("torch.", "")
    budget = getattr(getattr(core, "scheduler", None), "step_budget", None)
    return ReadyInfo(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                     kv_cache_bytes=_kv_bytes_per_block(core, block_size) * num_blocks, device=device, dtype=dtype,
                     kv_cache_dtype="" if kv_dtype == dtype else kv_dtype,
                     step_target_ms=round(budget.target_s * 1e3, 3) if budget is not None else 0.0)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the parent dies, so a SIGKILLed front leaves no orphan engine."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _tell_front(handshake: Any, message: ReadyInfo | StartupError) -> bool:
    """Send the start-up result over the handshake pipe; False when the front has already gone away."""
    try:
        handshake.send_bytes(msgspec.msgpack.encode(message))
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return False
    finally:
        handshake.close()


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, handshake: Any,
                    core_factory: Callable[[EngineConfig], Any] | None = None,
                    env: dict[str, str] | None = None) -> None:
    """Process entry point (spawn target). Returns when told to shut down or when the parent goes away.

    ``core_factory`` (a picklable, importable callable) replaces ``EngineCore(config)``; tests pass one that
    builds the core over a fake runner. ``env`` is applied before the model loads (a replica's
    ``CUDA_VISIBLE_DEVICES``: CUDA reads it at its first use, not at import)."""
    os.environ.update(env or {})
    leave_stopping_to_the_parent()  # the front drains, then sends SHUTDOWN
    _die_with_parent()
    parent = os.getppid()
    phases = Phases()
    phases.add("process spawn", process_age())
    try:
        core = build_core(config, core_factory, phases)
        info = core_ready_info(core, config)
        info.startup = phases.items
    except BaseException as exc:  # noqa: BLE001 — every start-up failure must reach the front as a message
        tb = traceback.format_exc(limit=4)
        message = str(exc) or exc.__class__.__name__
        if not _tell_front(handshake, StartupError(error_type=type(exc).__name__, message=message)):
            return  # the front is gone (Ctrl-C while loading): nobody to tell
        if not isinstance(exc, ValueError):  # a ValueError already says what to change; anything else: show where
            print(tb, file=sys.stderr)
        return

    def ready() -> None:  # sent once both sockets are connected, so the front's first send never waits
        freeze_startup_heap()  # this process is the engine's own (serve_core may also run in a host's thread)
        if not _tell_front(handshake, info):
            raise SystemExit(0)  # the front went away while we loaded: nothing to serve, no traceback

    serve_core(core, input_addr, output_addr, lambda: os.getppid() != parent, ready)


def build_core(config: EngineConfig, core_factory: Callable[[EngineConfig], Any] | None = None,
               phases: Phases | None = None) -> Any:
    """The engine core, its start-up phases (imports, then the runner's own) added to ``phases``."""
    phases = phases if phases is not None else Phases()
    with phases.time("imports"):
        if core_factory is None:
            from strataserve.engine.engine_core import EngineCore
            from strataserve.runner import model_runner  # noqa: F401  (torch, triton: timed apart)

            core_factory = EngineCore
    t0, first = time.perf_counter(), len(phases.items)
    core = core_factory(config)
    runner_phases = getattr(getattr(core, "runner", None), "startup", None)
    for name, sec in getattr(runner_phases, "items", []):
        phases.add(name, sec)
    phases.add("engine core", time.perf_counter() - t0 - sum(sec for _, sec in phases.items[first:]))
    return core


def serve_core(core: Any, input_addr: str, output_addr: str, orphaned: Callable[[], bool],
               on_connected: Callable[[], Any] | None = None) -> None:
    """Connect to the front's two sockets and run the step loop until SHUTDOWN (or ``orphaned()`` turns True);
    the core is shut down on the way out. Hosts the core in a spawned process and in a Ray actor alike."""
    ctx = zmq.Context(io_threads=1)
    inp = ctx.socket(zmq.PULL)
    out = ctx.socket(zmq.PUSH)
    inp.setsockopt(zmq.LINGER, 0)
    inp.setsockopt(zmq.RCVHWM, 0)
    out.setsockopt(zmq.LINGER, 1000)
    out.setsockopt(zmq.SNDHWM, 0)  # unbounded: the core never waits on the front
    inp.connect(input_addr)
    out.connect(output_addr)
    try:
        if on_connected is not None:
            on_connected()
        _loop(core, inp, out, orphaned)
    finally:
        try:
            core.shutdown()
        finally:
            inp.close()
            out.close()
            ctx.term()


def _loop(core: Any, inp: zmq.Socket, out: zmq.Socket, orphaned: Callable[[], bool]) -> None:
    req_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    ids_decoder = msgspec.msgpack.Decoder(list[str])
    encoder = msgspec.msgpack.Encoder()
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    idle_work = getattr(core, "idle_work", None)
    while True:
        busy = core.has_unfinished_requests()
        got_message = False
        if not busy:
            # Idle: deferred work piece by piece, then sleep in the kernel until a message arrives.
            if not poller.poll(0 if idle_work is not None else _IDLE_POLL_MS):
                if orphaned():
                    return
                if idle_work is not None and not idle_work():
                    idle_work = None
                continue
        # Drain everything queued so this step sees every new request and abort.
        while True:
            try:
                frames = inp.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            got_message = True
            kind = frames[0]
            if kind == ADD:
                for payload in frames[1:]:
                    _add(core, req_decoder.decode(payload), out, encoder)
            elif kind == ABORT:
                core.abort_requests(ids_decoder.decode(frames[1]))
            elif kind == SHUTDOWN:
                return
        if busy or got_message:
            outputs: EngineCoreOutputs = core.step()
            if outputs.outputs or outputs.stats is not None:
                out.send(encoder.encode(outputs), copy=False)
        if busy and orphaned():
            return


def _add(core: Any, request: EngineCoreRequest, out: zmq.Socket, encoder: msgspec.msgpack.Encoder) -> None:
    """Admit one request; a request the core refuses finishes at once with an abort carrying the reason."""
    try:
        core.add_request(request)
    except ValueError as exc:
        from strataserve.types.protocol import EngineCoreOutput

        err = EngineCoreOutput(request_id=request.request_id, new_token_ids=[], finish_reason="abort",
                               stop_reason=str(exc))
        out.send(encoder.encode(EngineCoreOutputs(outputs=[err])))
