"""Strict readiness in poll mode: a model that a repository poll finds after start-up holds /v2/health/ready and
gRPC ServerReady back while it first loads (it was reported ready meanwhile). Once it is READY the server is
ready; a load that fails keeps the server not ready, as a model that fails at start-up does, until the folder is
fixed or removed; removing a model's folder never leaves readiness stuck. With --no-strict-readiness a loading
model does not matter, as before. Real `strata serve` processes; each Python model's initialize() waits for a
gate file the test creates, and writes a marker when it starts, so the test sees the load in progress."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import tritonclient.grpc as grpcclient
from _kserve_launch import Launched, kserve_server
from _model_repos import add_python_text, write_python_model

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
            if {fail!r}:
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


class Gate:
    """Files outside the repository (a file inside a model folder would change its fingerprint: a reload)."""

    def __init__(self, folder: Path, name: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.started, self.open_file = folder / f"{name}.started", folder / f"{name}.open"

    def open(self) -> None:
        self.open_file.touch()


def _add_gated(tmp: Path, repo: Path, name: str, fail: bool = False) -> Gate:
    """Build the model beside the repository, then move it in at once, so no poll sees it half written."""
    gate = Gate(tmp / "gates", name)
    staging = tmp / "staging"
    staging.mkdir(exist_ok=True)
    write_python_model(staging, name, GATED.format(started=str(gate.started), gate=str(gate.open_file), fail=fail),
                       CONFIG)
    os.rename(staging / name, repo / name)
    return gate


def _ready(server: Launched) -> tuple[bool, bool]:
    """(HTTP, gRPC) readiness. Asked one after the other, so they may differ while readiness is changing."""
    r = httpx.get(f"{server.base}/v2/health/ready", timeout=10)
    assert (r.status_code == 200) == r.json()["ready"], (r.status_code, r.text)
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        return r.status_code == 200, client.is_server_ready()
    finally:
        client.close()


READY, NOT_READY = (True, True), (False, False)


def _states(server: Launched) -> dict[str, str]:
    index = httpx.post(f"{server.base}/v2/repository/index", json={}, timeout=10).json()
    return {m["name"]: m["state"] for m in index}


def _wait(predicate, what: str, server: Launched, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}:\n{server.log_tail()}")
        time.sleep(0.02)


def _model_ready(server: Launched, name: str) -> bool:
    return httpx.get(f"{server.base}/v2/models/{name}/ready", timeout=10).status_code == 200


def _serve_poll(tmp: Path, *flags: str):
    repo = tmp / "repo"
    add_python_text(repo)  # something loaded at start-up, so the server starts out ready
    return repo, kserve_server(repo, tmp / "server.log", "--model-control-mode", "poll",
                               "--repository-poll-secs", "0.05", *flags)


def test_a_newly_polled_model_holds_readiness_back_while_it_loads(tmp_path):
    repo, launch = _serve_poll(tmp_path)
    with launch as server:
        _wait(lambda: _ready(server) == READY, "the server is ready at start", server)

        slow = _add_gated(tmp_path, repo, "slow")
        _wait(slow.started.exists, "the poll finds 'slow' and its initialize() runs", server)
        assert _ready(server) == NOT_READY  # its initialize() is still waiting for the gate
        assert not _model_ready(server, "slow")
        assert _model_ready(server, "py_text")  # only server readiness follows the loading model
        slow.open()
        _wait(lambda: _ready(server) == READY, "the server is ready once 'slow' loaded", server)
        assert _model_ready(server, "slow") and _states(server)["slow"] == "READY"

        # removing a loaded model's folder leaves the server ready
        shutil.rmtree(repo / "slow")
        _wait(lambda: "slow" not in _states(server), "the poll drops 'slow'", server)
        assert _ready(server) == READY


def test_a_newly_polled_model_that_fails_to_load_keeps_the_server_not_ready_until_removed(tmp_path):
    repo, launch = _serve_poll(tmp_path)
    with launch as server:
        _wait(lambda: _ready(server) == READY, "the server is ready at start", server)

        bad = _add_gated(tmp_path, repo, "bad", fail=True)
        _wait(bad.started.exists, "the poll finds 'bad' and its initialize() runs", server)
        assert _ready(server) == NOT_READY  # loading
        bad.open()
        _wait(lambda: _states(server).get("bad") == "UNAVAILABLE", "the load of 'bad' fails", server)
        assert _ready(server) == NOT_READY  # as a model that failed at start-up
        index = httpx.post(f"{server.base}/v2/repository/index", json={}, timeout=10).json()
        reasons = [m["reason"] for m in index if m["name"] == "bad"]
        assert any("initialize refused to load" in r for r in reasons), index

        # the failure is not forever: removing the folder makes the server ready again
        shutil.rmtree(repo / "bad")
        _wait(lambda: _ready(server) == READY, "the server is ready once 'bad' is removed", server)
        assert "bad" not in _states(server)


def test_without_strict_readiness_a_loading_model_does_not_matter(tmp_path):
    repo, launch = _serve_poll(tmp_path, "--no-strict-readiness")
    with launch as server:
        _wait(lambda: _ready(server) == READY, "the server is ready at start", server)
        slow = _add_gated(tmp_path, repo, "slow")
        _wait(slow.started.exists, "the poll finds 'slow' and its initialize() runs", server)
        assert _ready(server) == READY and not _model_ready(server, "slow")
        slow.open()
        _wait(lambda: _model_ready(server, "slow"), "'slow' is loaded", server)
        assert _ready(server) == READY
