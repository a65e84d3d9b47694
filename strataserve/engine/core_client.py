"""How the front end (``AsyncLLM``) talks to an engine core: ``CoreClient`` and the in-process implementation.

The front end never steps the engine itself: it hands requests to a core client and awaits batches of
``EngineCoreOutputs``. ``InprocCoreClient`` steps an ``EngineCore`` on one background thread of this process;
``strataserve.engine.mp_client.MPCoreClient`` (server helper) runs it in another process. Both follow these rules:

- ``add_request`` / ``abort_requests`` never block on the engine step; they are safe to call from the event loop.
- ``get_outputs`` is awaited by exactly one consumer task. Every batch carries the core's latest ``SchedulerStats``.
  After a batch of aborts the core publishes a batch (possibly with no outputs) so stats such as the used-block
  count reflect the abort even when the engine then goes idle.
- Aborting an unknown or already finished request id is a no-op. The core does not send outputs for requests
  the client aborted; the client finishes them itself.
- When the core dies, ``errored`` turns True, ``dead_error`` holds the cause and ``get_outputs`` /
  ``check_health`` raise ``EngineDeadError``; nothing hangs.
- ``shutdown`` is idempotent and leaves no thread or process behind.
"""
from __future__ import annotations

import asyncio
import collections
import queue
import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import msgspec

from strataserve.types.errors import EngineDeadError
from strataserve.types.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from strataserve.config import EngineConfig
    from strataserve.engine.engine_core import EngineCore


class CoreInfo(msgspec.Struct, kw_only=True):
    """Facts about the running core that the front end needs for validation (sent once at start-up)."""

    max_model_len: int
    num_blocks: int
    block_size: int

    @property
    def max_pool_tokens(self) -> int:
        return self.num_blocks * self.block_size


class CoreClient(ABC):
    """Front end's handle on one engine core. See the module docstring for the contract."""

    #: set by the implementation once the core is up
    info: CoreInfo

    def __init__(self) -> None:
        self.dead_error: BaseException | None = None

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the core has died."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine core died: {self.dead_error!r}") from self.dead_error

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue one request for the core. The front end validates first; a request the core still rejects
        comes back as an output with finish_reason "abort" and the error text as stop_reason."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests and free their KV blocks at the core's next step boundary."""

    @abstractmethod
    async def get_outputs(self) -> EngineCoreOutputs:
        """Wait for the next batch of outputs (one engine step's worth, or more, in order)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core and release everything it holds. Safe to call twice."""


_STOP = object()


class InprocCoreClient(CoreClient):
    """Runs ``EngineCore.step`` in a loop on one daemon thread; commands and outputs cross via thread-safe queues."""

    def __init__(self, config: "EngineConfig | None" = None, core: "EngineCore | None" = None) -> None:
        super().__init__()
        if core is None:
            from strataserve.engine.engine_core import EngineCore

            if config is None:
                raise ValueError("InprocCoreClient needs an EngineConfig or an EngineCore")
            core = EngineCore(config)
        self.core = core
        self.info = CoreInfo(max_model_len=core.max_model_len, num_blocks=core.num_blocks,
                             block_size=core.block_size)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: collections.deque[EngineCoreOutputs] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._lock = threading.Lock()  # guards _loop/_ready hand-over between the loop and the core thread
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="strata-engine-core", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ front-end side
    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_health()
        self.core.check_request(request)  # pure and thread-safe: bad input fails here, in the caller
        self._inbox.put(("add", request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self._closed:
            self._inbox.put(("abort", list(request_ids)))

    async def get_outputs(self) -> EngineCoreOutputs:
        if self._ready is None:
            with self._lock:
                self._loop = asyncio.get_running_loop()
                self._ready = asyncio.Event()
        while True:
            if self._outbox:
                return self._outbox.popleft()
            self.check_health()
            if self._closed:
                raise EngineDeadError("engine core was shut down")
            self._ready.clear()
            if self._outbox or self.dead_error is not None:
                continue
            await self._ready.wait()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(_STOP)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self.core.shutdown()
        self._wake()

    # ------------------------------------------------------------------ core thread
    def _wake(self) -> None:
        with self._lock:
            loop, ready = self._loop, self._ready
        if loop is not None and ready is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def _handle(self, item: object) -> bool:
        """Apply one inbox command; False means stop."""
        if item is _STOP:
            return False
        kind, payload = item  # type: ignore[misc]
        if kind == "add":
            try:
                self.core.add_request(payload)
            except ValueError as exc:  # pre-validation missed it: finish it as aborted, keep serving others
                self._outbox.append(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    request_id=payload.request_id, new_token_ids=[], finish_reason="abort", stop_reason=str(exc))]))
        else:
            self.core.abort_requests(payload)
        return True

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                # Block for work only when the engine is idle; otherwise drain what arrived and step.
                got_any = False
                if not core.has_unfinished_requests():
                    if not self._handle(self._inbox.get()):
                        return
                    got_any = True
                while True:
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(item):
                        return
                    got_any = True
                if core.has_unfinished_requests() or got_any:
                    out = core.step()
                    if out.outputs or got_any:
                        self._outbox.append(out)
                        self._wake()
        except BaseException as exc:  # noqa: BLE001 - any crash must reach the front end
            self.dead_error = exc
            self._wake()
