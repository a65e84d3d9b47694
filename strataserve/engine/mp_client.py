"""``MPCoreClient``: the front end's handle on an engine core running in its own (spawned) process.

Wire: two zmq sockets bound here on ipc:// paths in a private temp dir — PUSH for commands (multipart
``[b"A", req...]`` adds, ``[b"X", ids]`` aborts, ``[b"Q"]`` shutdown), PULL for one msgpack ``EngineCoreOutputs``
per core step. Both are unbounded so neither side ever waits on the other. The start-up handshake (model
loaded / error) comes back on a ``multiprocessing`` pipe; see ``strataserve.engine.core_proc``.

Death detection costs nothing while healthy: the event loop watches the child's process sentinel, and
``get_outputs`` races it against the socket, so a killed core turns into ``EngineDeadError`` at once.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import shutil
import tempfile
import time
from dataclasses import replace
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from strataserve.config import EngineConfig
from strataserve.engine.core_client import CoreClient, CoreInfo, EngineDeadError
from strataserve.engine.core_proc import ABORT, ADD, SHUTDOWN, ReadyInfo, StartupError, run_engine_core
from strataserve.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from strataserve.startup import process_age


def process_key(config: EngineConfig) -> EngineConfig:
    """What an engine process is started with: the config less the API-side model name (``strata serve`` adopts
    an early-spawned process for the LLM whose key matches)."""
    return replace(config, model=replace(config.model, served_model_name=None))


class EngineStartupError(RuntimeError):
    """The engine process could not load the model; the message says why."""


class MPCoreClient(CoreClient):
    """Spawns ``run_engine_core`` and talks to it over zmq. Construct from synchronous code (it blocks until the
    model is loaded, unless ``wait=False``: then call ``wait_ready`` before anything else, which lets the caller
    do its own start-up work while the engine loads); use ``get_outputs`` from one event loop afterwards."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float | None = None,
                 core_factory: Callable[[EngineConfig], Any] | None = None, wait: bool = True) -> None:
        super().__init__()
        self._closed = False
        self._tmpdir = tempfile.mkdtemp(prefix="strata-core-")
        in_addr = f"ipc://{self._tmpdir}/in"
        out_addr = f"ipc://{self._tmpdir}/out"
        self._ctx = zmq.Context(io_threads=1)
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        self._out = self._actx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._death: asyncio.Future | None = None
        self._watch_loop: asyncio.AbstractEventLoop | None = None

        mp = multiprocessing.get_context("spawn")
        self._conn, child_conn = mp.Pipe(duplex=False)
        self._proc = mp.Process(target=run_engine_core, name="strata-engine-core", daemon=True,
                                args=(config, in_addr, out_addr, child_conn, core_factory))
        self.config = config
        self.ready_info: ReadyInfo | None = None
        #: this process's age (s) when the engine process was started (the start-up breakdown)
        self.spawned_at = process_age()
        try:
            self._proc.start()
        except BaseException:
            self._conn.close()
            self.shutdown()
            raise
        finally:
            child_conn.close()
        if wait:
            self.wait_ready(startup_timeout_s)

    def wait_ready(self, timeout_s: float | None = None) -> ReadyInfo:
        """Block until the engine has loaded the model (idempotent); raises ``EngineStartupError`` if it failed."""
        if self.ready_info is not None:
            return self.ready_info
        try:
            self.ready_info = self._handshake(self._conn, timeout_s)
            self._in.poll(5000, zmq.POLLOUT)  # the core has connected; wait for the pipe so sends never block
        except BaseException:
            self.shutdown()
            raise
        finally:
            self._conn.close()
        self.info = CoreInfo(max_model_len=self.ready_info.max_model_len, num_blocks=self.ready_info.num_blocks,
                             block_size=self.ready_info.block_size)
        return self.ready_info

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _handshake(self, conn: Any, timeout_s: float | None) -> ReadyInfo:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not conn.poll(0.2):
            if not self._proc.is_alive():
                raise EngineStartupError(f"engine process exited with code {self._proc.exitcode} while loading the "
                                         "model (its log is above)")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartupError(f"engine process did not finish loading within {timeout_s:.0f}s")
        try:
            raw = conn.recv_bytes()
        except EOFError:
            raise EngineStartupError("engine process closed the start-up pipe without an answer") from None
        msg = msgspec.msgpack.decode(raw, type=ReadyInfo | StartupError)
        if isinstance(msg, StartupError):
            raise EngineStartupError(f"{msg.error_type}: {msg.message}")
        return msg

    # ------------------------------------------------------------------ health
    def _poll_process(self) -> None:
        """Notice a dead core even while nobody awaits outputs (an idle server's /health)."""
        if self.dead_error is None and not self._closed and not self._proc.is_alive():
            self._mark_dead(f"engine process exited unexpectedly (exit code {self._proc.exitcode})")

    @property
    def errored(self) -> bool:
        self._poll_process()
        return self.dead_error is not None

    def check_health(self) -> None:
        self._poll_process()
        super().check_health()

    # ------------------------------------------------------------------ commands (never block)
    def _send(self, frames: list[bytes]) -> None:
        if self._closed:
            raise EngineDeadError("engine core was shut down")
        self.check_health()
        try:
            self._in.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        # The queue is unbounded, so this only happens while the core's connection is not up yet (right after
        # start-up) or after it died: wait for the pipe while the process lives.
        while self._proc.is_alive():
            if self._in.poll(100, zmq.POLLOUT):
                self._in.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
        self._mark_dead(f"engine process exited unexpectedly (exit code {self._proc.exitcode})")
        self.check_health()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send([ADD, self._encoder.encode(request)])

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self._closed and self.dead_error is None:
            try:
                self._send([ABORT, self._encoder.encode(list(request_ids))])
            except EngineDeadError:
                pass  # nothing to abort in a dead core

    # ------------------------------------------------------------------ outputs
    def _mark_dead(self, reason: str) -> None:
        if self.dead_error is None:
            self.dead_error = EngineDeadError(reason)
        if self._death is not None and not self._death.done():
            self._death.set_result(None)

    def _watch(self) -> asyncio.Future:
        """Future that resolves when the core process exits (the loop polls its sentinel fd, no thread)."""
        loop = asyncio.get_running_loop()
        if self._death is None or self._watch_loop is not loop:
            self._death = loop.create_future()
            self._watch_loop = loop
            sentinel = self._proc.sentinel

            def on_exit() -> None:
                loop.remove_reader(sentinel)
                self._mark_dead(f"engine process exited unexpectedly (exit code {self._proc.exitcode})")

            loop.add_reader(sentinel, on_exit)
        return self._death

    async def get_outputs(self) -> EngineCoreOutputs:
        death = self._watch()
        recv = self._out.recv(copy=False)
        if not recv.done():
            await asyncio.wait((recv, death), return_when=asyncio.FIRST_COMPLETED)
        if recv.done():
            return self._decoder.decode(recv.result().buffer)
        recv.cancel()
        if self._closed:
            raise EngineDeadError("engine core was shut down")
        self.check_health()
        raise EngineDeadError("engine process is gone")

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        proc = self._proc
        if proc.pid is not None and proc.is_alive():
            try:
                self._in.send_multipart([SHUTDOWN], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        if self._watch_loop is not None and not self._watch_loop.is_closed():
            try:
                self._watch_loop.remove_reader(proc.sentinel)
            except (ValueError, RuntimeError, OSError):
                pass
        self._mark_dead("engine core was shut down")
        self._conn.close()  # the start-up pipe, if never waited on
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __del__(self) -> None:  # last resort; the server calls shutdown() explicitly
        try:
            if not self._closed:
                self.shutdown(timeout_s=1.0)
        except Exception:  # noqa: BLE001
            pass
