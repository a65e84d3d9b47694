"""tests/_ports.py, the launchers' defence against port races: a child that lost its port to another process is
told apart from one that failed otherwise, retried a bounded number of times, and a server that answers on the
port is not taken for the child unless the child's own log says it serves there."""
from __future__ import annotations

import sys

import _ports
import pytest
from _ports import PortTaken, occupied, ready_or_respawn, spawn, wait_up


def test_a_taken_port_is_retried_three_launches_in_all_then_reported():
    respawns = []

    def wait() -> None:
        raise PortTaken("cannot serve HTTP on 127.0.0.1:1")

    with pytest.raises(PortTaken):
        ready_or_respawn(wait, lambda: respawns.append(1))
    assert len(respawns) == _ports.TRIES - 1 == 2


def test_another_failure_is_not_retried():
    respawns = []

    def wait() -> None:
        raise RuntimeError("server exited with 1: the engine failed to start")

    with pytest.raises(RuntimeError, match="engine failed"):
        ready_or_respawn(wait, lambda: respawns.append(1))
    assert respawns == []


def test_the_real_server_losing_its_port_reads_as_port_taken(tmp_path):
    """`strata serve` on a port another socket holds exits with its own message, which wait_up recognises; a
    different start-up error (a repository that is not a folder) stays a plain RuntimeError."""
    taken = occupied()
    port = taken.getsockname()[1]
    log = tmp_path / "server.log"
    serve = [sys.executable, "-m", "strataserve", "serve", "--host", "127.0.0.1", "--grpc-port", "0"]
    try:
        proc, offset = spawn([*serve, "--port", str(port), "--model-repository", str(tmp_path)], log)
        with pytest.raises(PortTaken, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
            wait_up(proc, log, offset, port, lambda: True, 240)
    finally:
        taken.close()
    other = _ports.free_port()
    proc, offset = spawn([*serve, "--port", str(other), "--model-repository", str(tmp_path / "nowhere")], log)
    with pytest.raises(RuntimeError, match="not a folder") as failed:
        wait_up(proc, log, offset, other, lambda: True, 240)
    assert not isinstance(failed.value, PortTaken)
    assert f"127.0.0.1:{port}" not in str(failed.value)  # each try reads only its own output


def test_an_answer_on_the_port_counts_only_once_the_child_says_it_serves_there(tmp_path):
    """Another server holding the port answers the probe; the child, not yet bound, has printed no banner: not
    up. Once the child's own banner names the port, it is."""
    log = tmp_path / "child.log"
    silent = [sys.executable, "-c", "import time; time.sleep(120)"]
    proc, offset = spawn(silent, log)
    try:
        with pytest.raises(TimeoutError):
            wait_up(proc, log, offset, 4321, lambda: True, 1)
    finally:
        proc.kill()
        proc.wait()
    banner = "print('console at http://127.0.0.1:4321/ · metrics at http://127.0.0.1:4321/metrics', flush=True)"
    proc, offset = spawn([sys.executable, "-c", f"{banner}; import time; time.sleep(120)"], log)
    try:
        wait_up(proc, log, offset, 4321, lambda: True, 60)
        with pytest.raises(TimeoutError):  # the banner names another port than the one asked for
            wait_up(proc, log, offset, 4322, lambda: True, 1)
    finally:
        proc.kill()
        proc.wait()
