"""A Python repository model whose load the test controls, and readiness probes, for the strict-readiness tests
(poll and explicit mode): initialize() writes a marker, waits for a gate file, and fails while a "fail" file
exists. The files live outside the repository (a file inside a model folder would change its fingerprint)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import httpx
import tritonclient.grpc as grpcclient
from _kserve_launch import Launched
from _model_repos import write_python_model

GATED = """
    import time
    from pathlib import Path
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            Path({started!r}).touch()
            deadline = time.monotonic() + 60  # bounded: a test that never opens the gate still ends
            while not Path({gate!r}).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the gate never opened")
                time.sleep(0.01)
            if Path({fail!r}).exists():
                raise RuntimeError("initialize refused to load")

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(
                r, "X").as_numpy() + 1)]) for r in requests]
"""
CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "X" data_type: TYPE_INT64 dims: [1] } ]
    output [ { name: "Y" data_type: TYPE_INT64 dims: [1] } ]
"""
READY, NOT_READY = (True, True), (False, False)


class Gate:
    """The marker files of one model; close() arms the gate for its next load."""

    def __init__(self, folder: Path, name: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.started, self.open_file, self.fail_file = (folder / f"{name}.{s}" for s in ("started", "open", "fail"))

    def open(self) -> None:
        self.open_file.touch()

    def close(self) -> None:
        self.open_file.unlink(missing_ok=True)
        self.started.unlink(missing_ok=True)

    def fail(self, on: bool) -> None:
        self.fail_file.touch() if on else self.fail_file.unlink(missing_ok=True)

    def write_model(self, folder: Path, name: str) -> None:
        write_python_model(folder, name, GATED.format(started=str(self.started), gate=str(self.open_file),
                                                      fail=str(self.fail_file)), CONFIG)


def server_ready(server: Launched) -> tuple[bool, bool]:
    """(HTTP, gRPC) readiness. Asked one after the other, so they may differ while readiness is changing."""
    r = httpx.get(f"{server.base}/v2/health/ready", timeout=10)
    assert (r.status_code == 200) == r.json()["ready"], (r.status_code, r.text)
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        return r.status_code == 200, client.is_server_ready()
    finally:
        client.close()


def model_ready(server: Launched, name: str) -> bool:
    return httpx.get(f"{server.base}/v2/models/{name}/ready", timeout=10).status_code == 200


def states(server: Launched) -> dict[str, str]:
    index = httpx.post(f"{server.base}/v2/repository/index", json={}, timeout=10).json()
    return {m["name"]: m["state"] for m in index}


def wait_until(predicate: Callable[[], bool], what: str, server: Launched, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}:\n{server.log_tail()}")
        time.sleep(0.02)
