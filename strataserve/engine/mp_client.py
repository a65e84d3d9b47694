"""``MPCoreClient``: the front end's handle on an engine core running in its own (spawned) process on this host.

The wire (two zmq sockets on ipc:// paths in a private temp dir) is ``ZmqCoreClient``'s; this class spawns
``run_engine_core`` and watches the process. The start-up handshake (model loaded / error) comes back on a
``multiprocessing`` pipe; see ``strataserve.engine.core_proc``.

Death detection costs nothing while healthy: the event loop watches the child's process sentinel, and
``get_outputs`` races it against the socket, so a killed core turns into ``EngineDeadError`` at once.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import signal
import time
from dataclasses import replace
from typing import Any, Callable

import msgspec

from strataserve.config import EngineConfig
from strataserve.engine.core_client import CoreInfo
from strataserve.engine.core_proc import ReadyInfo, StartupError, run_engine_core
from strataserve.engine.zmq_client import ZmqCoreClient
from strataserve.types.errors import EngineStartupError
from strataserve.startup import process_age


def process_key(config: EngineConfig) -> EngineConfig:
    """What an engine process is started with: the config less the API-side model name (``strata serve`` adopts
    an early-spawned process for the LLM whose key matches)."""
    return replace(config, model=replace(config.model, served_model_name=None))


class MPCoreClient(ZmqCoreClient):
    """Spawns ``run_engine_core`` and talks to it over zmq. Construct from synchronous code (it blocks until the
    model is loaded; with ``wait=False`` it returns at once and ``wait_ready`` blocks, so several cores load
    side by side); use ``get_outputs`` from one event loop afterwards. ``env`` is set in the child before the
    model loads (e.g. ``CUDA_VISIBLE_DEVICES`` for one replica's GPUs)."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float | None = None,
                 core_factory: Callable[[EngineConfig], Any] | None = None,
                 env: dict[str, str] | None = None, *, wait: bool = True) -> None:
        super().__init__()
        in_addr, out_addr = self._bind()
        mp = multiprocessing.get_context("spawn")
        self._conn, child_conn = mp.Pipe(duplex=False)
        self._proc = mp.Process(target=run_engine_core, name="strata-engine-core", daemon=True,
                                args=(config, in_addr, out_addr, child_conn, core_factory, env))
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
        self._startup_timeout_s = startup_timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float | None = None) -> ReadyInfo:
        """Block until the model is loaded (idempotent; ``EngineStartupError`` if it fails, and the core is shut
        down then). ``timeout_s`` defaults to the constructor's ``startup_timeout_s``."""
        if self.ready_info is not None:
            return self.ready_info
        try:
            self.ready_info = self._handshake(self._conn, self._startup_timeout_s if timeout_s is None else timeout_s)
            self._wait_connected()
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

    # ------------------------------------------------------------------ the process
    def _core_alive(self) -> bool:
        return self._proc.is_alive()

    def _exit_reason(self) -> str:
        self._proc.join(timeout=1.0)  # a dying child: reap it, its exit code is None until then
        code = self._proc.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"engine process was killed by {name} (exit code {code})"
        return f"engine process exited unexpectedly (exit code {code})"

    def _watch_exit(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
        sentinel = self._proc.sentinel  # the loop polls its fd: no thread

        def fired() -> None:
            loop.remove_reader(sentinel)
            on_exit()

        loop.add_reader(sentinel, fired)

    def _unwatch_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.remove_reader(self._proc.sentinel)
        except (ValueError, RuntimeError, OSError):
            pass

    def _stop_core(self, timeout_s: float) -> None:
        self._conn.close()  # the start-up pipe, if never waited on
        proc = self._proc
        if proc.pid is None or not proc.is_alive():
            return
        proc.join(timeout_s)
        if proc.is_alive():  # deaf to SHUTDOWN; SIGTERM it ignores while we live (leave_stopping_to_the_parent)
            proc.kill()
            proc.join(2.0)
