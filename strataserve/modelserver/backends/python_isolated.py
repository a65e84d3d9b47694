"""Opt-in process isolation for Python models (`parameters { key: "EXECUTION_ISOLATION" value: { string_value:
"process" } }`): the model runs in a spawned child process, talking over a multiprocessing pipe.

`IsolatedModel` stands in for the TritonPythonModel object in the parent: `execute(requests)` pickles the
requests (tensors are numpy arrays) to the child and waits for its responses; responses a decoupled model sends
through its response sender flow back on the same pipe, read by one thread in the parent. Costs one copy of
every tensor each way, which is why in-process is the default. BLS calls and custom metrics are not
available in the child. A request the client cancels is passed on (`cancel`), so `is_cancelled()` turns True
in the child too.
"""

from __future__ import annotations

import importlib.util
import itertools
import multiprocessing as mp
import queue
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from strataserve.modelserver import pb_runtime, pb_utils
from strataserve.startup import leave_stopping_to_the_parent
from strataserve.types.tensors import ModelServerError


def _child_main(conn, path: str, args: dict) -> None:
    leave_stopping_to_the_parent()  # the server finalizes us after its drain
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    sys.path.insert(0, str(Path(path).parent))  # the child is the model's own process: keep it there
    ctx = pb_runtime.ModelContext(None, args["model_name"])
    try:
        with pb_runtime.bound(pb_runtime.ModelContext(None, args["model_name"], initializing=True)):
            spec = importlib.util.spec_from_file_location("_strata_isolated_model", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            model = module.TritonPythonModel()
            if hasattr(model, "initialize"):
                model.initialize(args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent as a load error
        send(("init_error", f"{type(e).__name__}: {e}"))
        return
    loop = pb_runtime.InstanceLoop(ctx, args["model_instance_name"])
    send(("ready",))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    cancelled: set[int] = set()  # tokens of requests the parent says were cancelled

    def reader() -> None:  # cancels must arrive while execute() runs, so the pipe is read on its own thread
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                inbox.put(None)
                return
            if msg[0] == "cancel":
                cancelled.add(msg[1])
                continue
            inbox.put(msg)
            if msg[0] == "finalize":
                return

    threading.Thread(target=reader, daemon=True, name="strata-pymodel-pipe").start()
    while (msg := inbox.get()) is not None:
        if msg[0] == "finalize":
            loop.drain()
            if hasattr(model, "finalize"):
                with pb_runtime.bound(ctx):
                    model.finalize()
            loop.close()
            send(("finalized",))
            break
        _, call_id, items = msg
        requests, plain = [], []
        for token, decoupled, req in items:
            req._cancel_check = lambda token=token: token in cancelled
            if decoupled:
                def send_response(resp, final, token=token) -> None:
                    send(("send", token, resp, final))
                    if final:
                        cancelled.discard(token)
                req._sender = pb_utils.InferenceResponseSender(send_response, req._cancel_check)
            else:
                plain.append(token)
            requests.append(req)
        try:
            with pb_runtime.bound(ctx):
                result = pb_runtime.run_execute(model, requests, loop, decoupled=len(plain) < len(requests))
            send(("result", call_id, result, None))
        except BaseException as e:  # noqa: BLE001 - one failed execute fails its requests only
            send(("result", call_id, None, f"{type(e).__name__}: {e}"))
        cancelled.difference_update(plain)


class IsolatedModel:
    """Parent-side proxy of a TritonPythonModel living in a child process.

    Self-healing: when the child dies (SIGKILL, segfault, OOM, or killed by ``kill`` after an execution
    timeout), the calls in flight fail with an error naming the model, and the reader thread starts a new child
    (``initialize`` runs again) -- at once after a crash, with a doubling back-off (up to 30 s) when children keep
    dying within ``STABLE_S`` of their start. Meanwhile ``execute`` waits up to ``RESTART_WAIT_S`` for the new
    child, then answers UNAVAILABLE."""

    STABLE_S = 30.0
    MAX_BACKOFF_S = 30.0
    RESTART_WAIT_S = 10.0

    def __init__(self, path: Path, args: dict, name: str, on_restart: Callable[[], None] | None = None):
        self.name, self._path, self._args = name, path, args
        self._on_restart = on_restart
        self._calls: dict[int, Future] = {}
        self._senders: dict[int, pb_utils.InferenceResponseSender] = {}
        self._live: set[int] = set()  # tokens of requests the child is working on (cancel only those)
        self._call_tokens: dict[int, list[int]] = {}  # call -> its non-decoupled requests' tokens
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._closing = False
        self._finalized = threading.Event()
        self._up = threading.Event()  # a child is running
        self.restarts = 0
        self._conn, self._proc = self._spawn()
        self._started = time.monotonic()
        self._up.set()
        self._reader = threading.Thread(target=self._supervise, daemon=True, name=f"strata-pymodel-reader-{name}")
        self._reader.start()

    def _spawn(self):
        ctx = mp.get_context("spawn")  # never fork a process that runs threads and an event loop
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_child_main, args=(child_conn, str(self._path), self._args), daemon=True,
                           name=f"strata-pymodel-{self.name}")
        proc.start()
        child_conn.close()
        try:
            first = conn.recv()
        except EOFError:
            first = ("init_error", f"the model process exited with code {proc.exitcode}")
        if first[0] != "ready":
            proc.join(5)
            conn.close()
            raise ModelServerError("invalid_argument", f"{self._path}: {first[1]}")
        return conn, proc

    def _supervise(self) -> None:
        backoff = 0.0
        while True:
            self._read()
            if self._closing or self._finalized.is_set():
                return
            quick = time.monotonic() - self._started < self.STABLE_S
            backoff = min(max(backoff * 2, 0.25), self.MAX_BACKOFF_S) if quick else 0.0
            while not self._closing:
                time.sleep(backoff)
                try:
                    conn, proc = self._spawn()
                    break
                except Exception as e:  # noqa: BLE001 - keep trying, slower each time
                    self._dead = f"model '{self.name}': its process died and restarting it failed: {e}"
                    backoff = min(max(backoff * 2, 0.25), self.MAX_BACKOFF_S)
            else:
                return
            if self._closing:  # unloaded while the new child started
                proc.kill()
                conn.close()
                return
            with self._lock:
                self._conn, self._proc = conn, proc
                self._dead = None
            self._up.set()
            self._started = time.monotonic()
            self.restarts += 1
            if self._on_restart is not None:
                self._on_restart()

    def _read(self) -> None:
        conn = self._conn
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "result":
                _, call_id, result, error = msg
                with self._lock:
                    self._live.difference_update(self._call_tokens.pop(call_id, ()))
                fut = self._calls.pop(call_id, None)
                if fut is None:
                    continue  # its caller gave up (execution timeout)
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(ModelServerError("internal", f"model '{self.name}': {error}"))
            elif msg[0] == "send":
                _, token, resp, final = msg
                if final:
                    with self._lock:
                        self._live.discard(token)
                sender = self._senders.pop(token) if final else self._senders[token]
                sender.send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            elif msg[0] == "finalized":
                self._finalized.set()
                break
        self._up.clear()
        self._proc.join(1)
        self._dead = (f"model '{self.name}': its process exited (code {self._proc.exitcode}) during the request; "
                      "it is being restarted")
        err = ModelServerError("unavailable", self._dead)
        with self._lock:
            calls, senders = list(self._calls.values()), list(self._senders.values())
            self._calls.clear()
            self._senders.clear()
            self._live.clear()
            self._call_tokens.clear()
        for fut in calls:
            if not fut.done():
                fut.set_exception(err)
        for sender in senders:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(self._dead)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._close(conn)

    def _close(self, conn) -> None:
        """Close the pipe once: the reader thread and ``finalize`` both close it, and two threads inside one
        ``Connection.close`` close the fd twice (EBADF, or worse, an fd number reused meanwhile)."""
        with self._lock:
            conn.close()

    @property
    def up(self) -> bool:
        """A child process is running (False while it is being restarted)."""
        return self._up.is_set()

    def wait_ready(self) -> None:
        self._up.wait(self.RESTART_WAIT_S)

    def execute(self, requests: list[pb_utils.InferenceRequest]):
        if not self._up.wait(self.RESTART_WAIT_S) or self._closing:
            raise ModelServerError("unavailable", self._dead or f"model '{self.name}': its process is not running")
        items, plain = [], []
        for req in requests:
            sender, req._sender = req._sender, None  # the child attaches its own sender
            req._token = token = next(self._ids)
            if sender is not None:
                self._senders[token] = sender
            else:
                plain.append(token)
            items.append((token, sender is not None, req))
        fut: Future = Future()
        with self._lock:
            call_id = next(self._ids)
            self._calls[call_id] = fut
            self._call_tokens[call_id] = plain
            self._live.update(token for token, _, _ in items)
            try:
                self._conn.send(("execute", call_id, items))
            except (OSError, BrokenPipeError):
                self._calls.pop(call_id, None)
                raise ModelServerError("unavailable", f"model '{self.name}': its process is not running") from None
        for req in requests:  # cancelled between prepare and now: the child learns it by message like the rest
            if req.is_cancelled():
                self.cancel(req)
        return fut.result()

    def cancel(self, req: pb_utils.InferenceRequest) -> None:
        """The client cancelled ``req`` (event-loop thread): tell the child, if it still works on it."""
        token = getattr(req, "_token", None)
        with self._lock:
            if token is None or token not in self._live or self._dead:
                return
            try:
                self._conn.send(("cancel", token))
            except (OSError, BrokenPipeError):
                pass

    def kill(self) -> None:
        """End the child now (a hung execution); the reader fails its calls and starts a new child."""
        self._proc.kill()

    def finalize(self) -> None:
        self._closing = True
        try:
            if not self._dead:
                self._conn.send(("finalize",))
                self._finalized.wait(10)
        except (OSError, BrokenPipeError):
            pass
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._close(self._conn)
