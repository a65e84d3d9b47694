"""What a Python model's code runs inside: its context (server, name), its event loop, its logger.

- `ModelContext` is bound to the threads that run a model's code (the execution thread while `initialize` /
  `execute` run, and the instance's event-loop thread for good), so that `pb_utils` calls made there (BLS, model
  management, `Logger`, `MetricFamily`) know their server and model. Threads a model starts itself fall back
  to the server last bound (one per process in practice; the isolated child has no server).
- `InstanceLoop`: Triton (>= 24.04) runs `async def execute` on one event loop per model instance that lives as
  long as the instance: tasks a model starts keep running after `execute` returns, and a decoupled model's
  next request starts while the previous one awaits.
- Model logs go to a logger named after the model (`strataserve.model.<name>`), shown on stderr at INFO when
  the application has set up no logging of its own (Triton logs INFO by default; VERBOSE is DEBUG).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

MODEL_LOGGER = "strataserve.model"
_local = threading.local()
_last_server: Any = None
_log = logging.getLogger(__name__)


@dataclass
class ModelContext:
    server: Any  # the ModelServer; None in an isolated model's child process
    model_name: str
    initializing: bool = False
    model_version: str = ""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return getattr(self.server, "loop", None)


def current() -> ModelContext | None:
    return getattr(_local, "ctx", None)


def current_server() -> Any:
    ctx = current()
    return ctx.server if ctx is not None else _last_server


@contextlib.contextmanager
def bound(ctx: ModelContext) -> Iterator[ModelContext]:
    global _last_server
    prev = current()
    _local.ctx = ctx
    if ctx.server is not None:
        _last_server = ctx.server
    try:
        yield ctx
    finally:
        _local.ctx = prev


def model_logger() -> logging.Logger:
    ctx = current()
    parent = logging.getLogger(MODEL_LOGGER)
    if not parent.hasHandlers():  # nobody set up logging: show model logs as Triton does (INFO, stderr)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s"))
        parent.addHandler(handler)
        parent.setLevel(logging.INFO)
    return logging.getLogger(f"{MODEL_LOGGER}.{ctx.model_name}") if ctx is not None else parent


class InstanceLoop:
    """One model instance's event loop, on its own daemon thread."""


    def __init__(self, ctx: ModelContext, name: str):
        self.ctx = ctx
        self.loop = asyncio.new_event_loop()
        self._background: set[concurrent.futures.Future] = set()
        self._thread = threading.Thread(target=self._run, name=f"strata-pyloop-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _local.ctx = self.ctx
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the instance's loop and wait for its result (the calling thread blocks)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def spawn(self, coro: Any, on_error: Callable[[BaseException], None]) -> None:
        """Start ``coro`` on the loop and return at once; ``on_error`` gets what it raises."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._background.add(fut)

        def done(f: concurrent.futures.Future) -> None:
            self._background.discard(f)
            if f.cancelled():  # stopped by the server (shutdown): its requests end with an error, not in silence
                on_error(RuntimeError("the model's execution was cancelled: the server is stopping"))
            elif f.exception() is not None:
                on_error(f.exception())

        fut.add_done_callback(done)

    def drain(self) -> None:
        """Wait for background executions (an async decoupled model's in-flight requests) to finish: unloading
        waits for in-flight requests, as Triton's does and as the batcher waits for queued ones."""
        while self._background:
            concurrent.futures.wait(list(self._background))

    def close(self) -> None:
        """Cancel what still runs on the loop, then stop it."""

        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self.loop)
        self._thread.join(5)


def run_execute(model: Any, requests: list, loop: InstanceLoop, decoupled: bool) -> Any:
    """``model.execute(requests)``. An ``async def execute`` runs on the instance's loop: to its end (its
    result is the responses), or, for a decoupled model, in the background (Triton >= 24.04), so the next
    execution can start while it awaits; what it raises then fails the requests it has not finished."""
    result = model.execute(requests)
    if not inspect.iscoroutine(result):
        return result
    if not decoupled:
        return loop.run(result)
    loop.spawn(result, lambda exc: fail_unfinished(requests, exc))
    return None


def fail_unfinished(requests: list, exc: BaseException) -> None:
    from strataserve.modelserver import pb_utils

    name = current().model_name if current() is not None else "?"
    _log.error("model %s: async execute raised %s: %s", name, type(exc).__name__, exc)
    for r in requests:
        sender = r._sender
        if sender is not None and not sender._closed:
            with contextlib.suppress(Exception):
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"execute() raised {type(exc).__name__}: {exc}")), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
