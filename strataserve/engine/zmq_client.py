"""``ZmqCoreClient``: the front end's side of the zmq wire to an engine core that runs somewhere else.

Wire: two zmq sockets bound here -- PUSH for commands (multipart ``[b"A", req...]`` adds, ``[b"X", ids]`` aborts,
``[b"Q"]`` shutdown), PULL for one msgpack ``EngineCoreOutputs`` per core step. Both are unbounded so neither
side ever waits on the other. The core connects to them (``core_proc.serve_core``).

Where the core lives is the subclass's business: ``MPCoreClient`` spawns a process on this host (ipc:// paths),
``RayCoreClient`` hosts it in a Ray actor (ipc:// on the same node, tcp:// across nodes). A subclass tells
whether the core still runs (``_core_alive``), resolves a future when it exits (``_watch_exit``), and stops it
(``_stop_core``); everything on the wire is here, once.
"""
from __future__ import annotations

import asyncio
import shutil
import tempfile
from abc import abstractmethod
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from strataserve.engine.core_client import CoreClient
from strataserve.types.errors import EngineDeadError
from strataserve.engine.core_proc import ABORT, ADD, SHUTDOWN
from strataserve.types.protocol import EngineCoreOutputs, EngineCoreRequest


class ZmqCoreClient(CoreClient):
    def __init__(self) -> None:
        super().__init__()
        self._closed = False
        self._tmpdir: str | None = None
        self._ctx = zmq.Context(io_threads=1)
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._out = self._actx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._death: asyncio.Future | None = None
        self._watch_loop: asyncio.AbstractEventLoop | None = None

    def _bind(self, tcp_host: str | None = None) -> tuple[str, str]:
        """Bind both sockets and return their addresses for the core to connect to: ipc:// paths in a private
        temp dir, or tcp:// ports picked by the kernel on ``tcp_host`` (a core on another machine)."""
        if tcp_host is None:
            self._tmpdir = tempfile.mkdtemp(prefix="strata-core-")
            self._in.bind(f"ipc://{self._tmpdir}/in")
            self._out.bind(f"ipc://{self._tmpdir}/out")
        else:
            self._in.bind(f"tcp://{tcp_host}:*")
            self._out.bind(f"tcp://{tcp_host}:*")
        return (self._in.getsockopt_string(zmq.LAST_ENDPOINT), self._out.getsockopt_string(zmq.LAST_ENDPOINT))

    def _wait_connected(self, timeout_ms: int = 5000) -> None:
        self._in.poll(timeout_ms, zmq.POLLOUT)  # the core has connected: sends never block from here on

    # ------------------------------------------------------------------ what a subclass provides
    @abstractmethod
    def _core_alive(self) -> bool:
        """False once the core has exited (cheap: called before every send and by ``check_health``)."""

    @abstractmethod
    def _exit_reason(self) -> str:
        """Why the core is gone, for ``EngineDeadError`` (exit code, actor death cause)."""

    @abstractmethod
    def _watch_exit(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
        """Arrange for ``on_exit()`` to run on ``loop`` when the core exits."""

    def _unwatch_exit(self, loop: asyncio.AbstractEventLoop) -> None:  # noqa: B027 -- optional hook
        """Undo ``_watch_exit`` (shutdown)."""

    @abstractmethod
    def _stop_core(self, timeout_s: float) -> None:
        """Stop the core after SHUTDOWN was sent (wait up to ``timeout_s``, then force it)."""

    # ------------------------------------------------------------------ health
    def _poll_core(self) -> None:
        """Notice a dead core even while nobody awaits outputs (an idle server's /health)."""
        if self.dead_error is None and not self._closed and not self._core_alive():
            self._mark_dead(self._exit_reason())

    @property
    def errored(self) -> bool:
        self._poll_core()
        return self.dead_error is not None

    def check_health(self) -> None:
        self._poll_core()
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
        # start-up) or after it died: wait for the pipe while the core lives.
        while self._core_alive():
            if self._in.poll(100, zmq.POLLOUT):
                self._in.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
        self._mark_dead(self._exit_reason())
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
        """Future that resolves when the core exits."""
        loop = asyncio.get_running_loop()
        if self._death is None or self._watch_loop is not loop:
            self._death = loop.create_future()
            self._watch_loop = loop
            self._watch_exit(loop, lambda: self._mark_dead(self._exit_reason()))
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
        raise EngineDeadError("engine core is gone")

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._in.send_multipart([SHUTDOWN], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._stop_core(timeout_s)
        if self._watch_loop is not None and not self._watch_loop.is_closed():
            self._unwatch_exit(self._watch_loop)
        self._mark_dead("engine core was shut down")
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __del__(self) -> None:  # last resort; the server calls shutdown() explicitly
        try:
            if not self._closed:
                self.shutdown(timeout_s=1.0)
        except Exception:  # noqa: BLE001
            pass
