"""Strict readiness in poll mode: a model that a repository poll finds after start-up holds /v2/health/ready and
gRPC ServerReady back while it first loads (it was reported ready meanwhile). Once it is READY the server is
ready; a load that fails keeps the server not ready, as a model that fails at start-up does, until the folder is
fixed or removed; removing a model's folder never leaves readiness stuck. With --no-strict-readiness a loading
model does not matter, as before. Real `strata serve` processes; each Python model's initialize() waits for a
gate file the test creates, and writes a marker when it starts, so the test sees the load in progress."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
from _gated_model import NOT_READY, READY, Gate
from _gated_model import model_ready as _model_ready
from _gated_model import server_ready as _ready
from _gated_model import states as _states
from _gated_model import wait_until as _wait
from _kserve_launch import kserve_server
from _model_repos import add_python_text

def _add_gated(tmp: Path, repo: Path, name: str, fail: bool = False) -> Gate:
    """Build the model beside the repository, then move it in at once, so no poll sees it half written."""
    gate = Gate(tmp / "gates", name)
    gate.fail(fail)
    staging = tmp / "staging"
    staging.mkdir(exist_ok=True)
    gate.write_model(staging, name)
    os.rename(staging / name, repo / name)
    return gate


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
