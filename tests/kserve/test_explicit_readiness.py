"""Strict readiness in explicit mode: a model loaded through the repository API (HTTP load, gRPC
RepositoryModelLoad) holds /v2/health/ready and gRPC ServerReady back while it loads and serves nothing; that
includes a load after an unload (its versions are listed "unloaded" meanwhile, which alone never counts). Once it
is READY the server is ready. A load that fails leaves the server not ready, as Triton does (the model is
UNAVAILABLE with the error), but not for good: unloading the model, or a later load that succeeds, makes it ready.
Loading again a model that serves does not hold readiness (the old version serves until the new one replaces
it). With --no-strict-readiness a loading model does not matter. Real `strata serve` processes; the Python
model's initialize() writes a marker, then waits for a gate file the test creates, so the test sees the load in
progress; it fails while a "fail" file exists."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
import tritonclient.grpc as grpcclient
from _gated_model import NOT_READY, READY, Gate
from _gated_model import model_ready as _model_ready
from _gated_model import server_ready as _ready
from _gated_model import states as _states
from _gated_model import wait_until as _wait
from _kserve_launch import Launched, kserve_server
from _model_repos import add_python_text


def _http_control(server: Launched, name: str, action: str) -> httpx.Response:
    return httpx.post(f"{server.base}/v2/repository/models/{name}/{action}", json={}, timeout=90)


def _grpc_load(server: Launched, name: str) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        client.load_model(name)  # raises InferenceServerException when the load fails
    finally:
        client.close()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as executor:  # a load call blocks until the gate opens
        yield executor


def _serve_explicit(tmp: Path, *flags: str):
    """py_text is loaded at start-up (so the server starts out ready); 'slow' only when the test asks."""
    repo, gate = tmp / "repo", Gate(tmp / "gates", "slow")
    add_python_text(repo)
    gate.write_model(repo, "slow")
    return gate, kserve_server(repo, tmp / "server.log", "--model-control-mode", "explicit", "--load-model",
                               "py_text", *flags)


def _load_in_background(pool: ThreadPoolExecutor, server: Launched, gate: Gate, load: Callable) -> Future:
    gate.close()
    call = pool.submit(load, server, "slow")
    _wait(gate.started.exists, "the load of 'slow' runs its initialize()", server)
    return call


def test_an_explicit_load_and_a_load_after_unload_hold_readiness_back(tmp_path, pool):
    gate, launch = _serve_explicit(tmp_path)
    with launch as server:
        _wait(lambda: _ready(server) == READY, "the server is ready at start", server)
        assert "slow" in _states(server) and not _model_ready(server, "slow")  # listed, not asked for: no hold

        call = _load_in_background(pool, server, gate, lambda s, n: _http_control(s, n, "load"))
        assert _ready(server) == NOT_READY  # its initialize() is waiting for the gate
        assert _model_ready(server, "py_text") and not _model_ready(server, "slow")
        gate.open()
        assert call.result(timeout=90).status_code == 200
        assert _ready(server) == READY and _model_ready(server, "slow")

        # an unload never holds readiness
        assert _http_control(server, "slow", "unload").status_code == 200
        _wait(lambda: _states(server)["slow"] == "UNAVAILABLE", "'slow' is unloaded", server)
        assert _ready(server) == READY

        # loaded again after the unload (gRPC this time): held back again while it loads
        call = _load_in_background(pool, server, gate, _grpc_load)
        assert _ready(server) == NOT_READY
        assert _states(server)["slow"] == "UNAVAILABLE"  # still listed as unloaded while it loads
        gate.open()
        call.result(timeout=90)
        assert _ready(server) == READY and _model_ready(server, "slow")

        # loading a model that serves again: its old version serves until the new one replaces it, so no hold
        call = _load_in_background(pool, server, gate, lambda s, n: _http_control(s, n, "load"))
        assert _ready(server) == READY and _model_ready(server, "slow")
        gate.open()
        assert call.result(timeout=90).status_code == 200
        assert _ready(server) == READY and _model_ready(server, "slow")


def test_a_failed_explicit_load_leaves_the_server_not_ready_until_unloaded_or_loaded(tmp_path, pool):
    gate, launch = _serve_explicit(tmp_path)
    with launch as server:
        _wait(lambda: _ready(server) == READY, "the server is ready at start", server)

        gate.fail(True)
        call = _load_in_background(pool, server, gate, lambda s, n: _http_control(s, n, "load"))
        assert _ready(server) == NOT_READY  # loading
        gate.open()
        failed = call.result(timeout=90)
        assert failed.status_code >= 400 and "initialize refused to load" in failed.text, failed.text
        assert _states(server)["slow"] == "UNAVAILABLE"
        assert _ready(server) == NOT_READY  # Triton's rule: a model asked for that is not READY counts

        # an unload releases it
        assert _http_control(server, "slow", "unload").status_code == 200
        assert _ready(server) == READY

        # a load after the unload that fails again: held while it loads, not ready after
        call = _load_in_background(pool, server, gate, lambda s, n: _http_control(s, n, "load"))
        assert _ready(server) == NOT_READY
        gate.open()
        assert call.result(timeout=90).status_code >= 400
        assert _ready(server) == NOT_READY

        # a later load that succeeds (no unload in between) releases it too
        gate.fail(False)
        call = _load_in_background(pool, server, gate, _grpc_load)
        assert _ready(server) == NOT_READY
        gate.open()
        call.result(timeout=90)
        assert _ready(server) == READY and _states(server)["slow"] == "READY"


def test_without_strict_readiness_an_explicit_load_does_not_matter(tmp_path, pool):
    gate, launch = _serve_explicit(tmp_path, "--no-strict-readiness")
    with launch as server:
        _wait(lambda: _ready(server) == READY, "the server is ready at start", server)
        for load in (lambda s, n: _http_control(s, n, "load"), _grpc_load):  # a first load, then one after unload
            call = _load_in_background(pool, server, gate, load)
            assert _ready(server) == READY and not _model_ready(server, "slow")
            gate.open()
            call.result(timeout=90)
            assert _ready(server) == READY and _model_ready(server, "slow")
            assert _http_control(server, "slow", "unload").status_code == 200
            assert _ready(server) == READY
