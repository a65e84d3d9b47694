"""An explicit load outlives a caller that stops waiting. A gRPC client whose deadline passes while the model's
initialize() runs cancels its RPC on the server; the load must still run to its end, so the model ends READY
(and strict readiness is released) or UNAVAILABLE with the load's own error, never half loaded with no reason
and the server not ready until someone unloads it. Real `strata serve`, tritonclient gRPC; the Python model's
initialize() waits for a gate file the test creates (tests/_gated_model.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from _gated_model import NOT_READY, READY, Gate
from _gated_model import model_ready as _model_ready
from _gated_model import server_ready as _ready
from _gated_model import states as _states
from _gated_model import wait_until as _wait
from _kserve_launch import Launched, kserve_server
from _model_repos import add_python_text
from tritonclient.utils import InferenceServerException


def _serve(tmp: Path):
    repo, gate = tmp / "repo", Gate(tmp / "gates", "slow")
    add_python_text(repo)
    gate.write_model(repo, "slow")
    return gate, kserve_server(repo, tmp / "server.log", "--model-control-mode", "explicit", "--load-model",
                               "py_text")


def _load_and_give_up(server: Launched, gate: Gate) -> None:
    """A gRPC load whose deadline passes while initialize() waits for the gate: the client gives up."""
    gate.close()
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        with pytest.raises(InferenceServerException, match="(?i)deadline"):
            client.load_model("slow", client_timeout=1.0)
    finally:
        client.close()
    assert gate.started.exists()  # the load was under way when the caller left


def _reason(server: Launched, name: str) -> str:
    index = httpx.post(f"{server.base}/v2/repository/index", json={}, timeout=10).json()
    return " ".join(m["reason"] for m in index if m["name"] == name)


def test_a_load_whose_caller_gave_up_still_ends_ready(tmp_path):
    gate, launch = _serve(tmp_path)
    with launch as server:
        _wait(lambda: _ready(server) == READY, "the server is ready at start", server)
        _load_and_give_up(server, gate)
        assert _ready(server) == NOT_READY  # still loading: strict readiness holds
        gate.open()
        _wait(lambda: _model_ready(server, "slow"), "'slow' is READY although its caller left", server)
        assert _ready(server) == READY
        assert _states(server)["slow"] == "READY"
        client = grpcclient.InferenceServerClient(server.grpc)
        try:
            x = grpcclient.InferInput("X", [1], "INT64")
            x.set_data_from_numpy(np.array([41], dtype=np.int64))
            assert client.infer("slow", [x]).as_numpy("Y").tolist() == [42]
        finally:
            client.close()


def test_a_failed_load_whose_caller_gave_up_keeps_its_reason(tmp_path):
    gate, launch = _serve(tmp_path)
    with launch as server:
        _wait(lambda: _ready(server) == READY, "the server is ready at start", server)
        gate.fail(True)
        _load_and_give_up(server, gate)
        gate.open()
        _wait(lambda: _states(server).get("slow") == "UNAVAILABLE" and "initialize refused to load"
              in _reason(server, "slow"), "'slow' is UNAVAILABLE with initialize()'s error", server)
        assert _ready(server) == NOT_READY  # a failed explicit load, as Triton: until an unload or a good load
        gate.fail(False)
        client = grpcclient.InferenceServerClient(server.grpc)
        try:
            client.load_model("slow")  # the gate is open: this load runs through
        finally:
            client.close()
        assert _ready(server) == READY and _model_ready(server, "slow")
