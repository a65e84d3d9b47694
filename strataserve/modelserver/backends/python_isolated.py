"""Opt-in process isolation for Python models (`parameters { key: "EXECUTION_ISOLATION" value: { string_value:
"process" } }`): the model runs in a spawned child process, talking over a multiprocessing pipe.

`IsolatedModel` stands in for the TritonPythonModel object in the parent: `execute(requests)` pickles the
requests (tensors are numpy arrays) to the child and waits for its responses; responses a decoupled model sends
through its response sender flow back on the same pipe, read by one thread in the parent. Costs one copy of
every tensor each way, which is why in-process is the default. BLS calls are not available in the child.
"""

from __future__ import annotations

import importlib.util
import itertools
import multiprocessing as mp
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

from strataserve.modelserver import pb_utils
from strataserve.modelserver.types import ModelServerError


def _child_main(conn, path: str, args: dict) -> None:
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    sys.path.insert(0, str(Path(path).parent))  # the child is the model's own process: keep it there
    try:
        spec = importlib.util.spec_from_file_location("_strata_isolated_model", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.TritonPythonModel()
        if hasattr(model, "initialize"):
            model.initialize(args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent as a load error
        send(("init_error", f"{type(e).__name__}: {e}"))
        return
    send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "finalize":
            if hasattr(model, "finalize"):
                model.finalize()
            send(("finalized",))
            break
        _, call_id, items = msg
        requests = []
        for token, req in items:
            if token is not None:
                req._sender = pb_utils.InferenceResponseSender(
                    lambda resp, final, token=token: send(("send", token, resp, final)))
            requests.append(req)
        try:
            send(("result", call_id, model.execute(requests), None))
        except BaseException as e:  # noqa: BLE001 - one failed execute fails its requests only
            send(("result", call_id, None, f"{type(e).__name__}: {e}"))


class IsolatedModel:
    """Parent-side proxy of a TritonPythonModel living in a child process."""

    def __init__(self, path: Path, args: dict, name: str):
        self.name = name
        ctx = mp.get_context("spawn")  # never fork a process that runs threads and an event loop
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child_conn, str(path), args), daemon=True,
                                 name=f"strata-pymodel-{name}")
        self._proc.start()
        child_conn.close()
        first = self._recv_or_dead()
        if first[0] != "ready":
            self._proc.join(5)
            raise ModelServerError("invalid_argument", f"{path}: {first[1]}")
        self._calls: dict[int, Future] = {}
        self._senders: dict[int, pb_utils.InferenceResponseSender] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._finalized = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"strata-pymodel-reader-{name}")
        self._reader.start()

    def _recv_or_dead(self):
        try:
            return self._conn.recv()
        except EOFError:
            return ("init_error", f"the model process exited with code {self._proc.exitcode}")

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "result":
                _, call_id, result, error = msg
                fut = self._calls.pop(call_id)
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(ModelServerError("internal", f"model '{self.name}': {error}"))
            elif msg[0] == "send":
                _, token, resp, final = msg
                sender = self._senders.pop(token) if final else self._senders[token]
                sender.send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            elif msg[0] == "finalized":
                self._finalized.set()
                break
        self._dead = f"model '{self.name}': its process exited (code {self._proc.exitcode})"
        err = ModelServerError("internal", self._dead)
        for fut in list(self._calls.values()):
            fut.set_exception(err)
        for sender in list(self._senders.values()):
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(self._dead)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._calls.clear()
        self._senders.clear()

    def execute(self, requests: list[pb_utils.InferenceRequest]):
        if self._dead:
            raise ModelServerError("unavailable", self._dead)
        items = []
        for req in requests:
            sender, req._sender = req._sender, None  # the child attaches its own sender
            token = None
            if sender is not None:
                token = next(self._ids)
                self._senders[token] = sender
            items.append((token, req))
        fut: Future = Future()
        with self._lock:
            call_id = next(self._ids)
            self._calls[call_id] = fut
            self._conn.send(("execute", call_id, items))
        return fut.result()

    def finalize(self) -> None:
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
        self._conn.close()
