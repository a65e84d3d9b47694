"""Ports for the `strata serve` subprocesses the tests launch, and their start-up, safe against port races.

A launcher picks a free port (bind port 0, close, pass the number on), and the child binds it a moment later. In
between, anything else on the machine can take the port: a parallel test's client connection (its ephemeral source
port comes from the same range), another server. The child then exits with the product's own "cannot serve HTTP
on ..." / "cannot bind the KServe gRPC server to ..." error, and the launcher starts it again on fresh ports
(``ready_or_respawn``, a few tries). Worse, another server holding the port would answer the readiness probe for
it; so a child counts as up only once its own log names the port as the one it serves on (the start-up banner
prints the bound port), which proves the answers come from it.

Why not `--port 0` and read the port back: it works for HTTP (the banner prints the bound port), but
`--grpc-port 0` means "no gRPC", and a retry covers both doors with no product change.

Launchers call ``_ports.free_port()`` through the module, so a test can replace the picker to provoke a collision.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]

TRIES = 3  # launches in all; a collision is rare, three in a row means something holds ports on purpose

# The product's messages for a port it could not bind (strataserve/api/server.py, strataserve/api/kserve_grpc.py).
_TAKEN = re.compile(r"cannot serve HTTP on \S+|cannot bind the KServe gRPC server to \S+")
# The banner's last line, "console at URL/ · metrics at URL/metrics", with the port actually bound.
_SERVING = re.compile(r"metrics at https?://\S+?:(\d+)/metrics")


class PortTaken(RuntimeError):
    """The child exited because a port it was given was taken before it could bind it."""


def free_port() -> int:
    """A port free at the time of the call (and only then: see the module's docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def occupied() -> socket.socket:
    """A listening socket on a free loopback port, held until closed: a port "taken" under a launcher."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def picker_first(monkeypatch, *ports: int) -> list[int]:
    """Make the launchers' next picks ``ports`` (in order), then free ones as usual; returns every port handed out,
    so a test can tell which try got which. (pytest's ``monkeypatch`` undoes it after the test.)"""
    real, queue, handed = free_port, list(ports), []

    def pick() -> int:
        handed.append(queue.pop(0) if queue else real())
        return handed[-1]

    monkeypatch.setattr(sys.modules[__name__], "free_port", pick)
    return handed


def spawn(cmd: list[str], log: Path, *, cwd: Path = ROOT, env: dict[str, str] | None = None,
          new_session: bool = False) -> tuple[subprocess.Popen, int]:
    """Start ``cmd`` with its output appended to ``log``: (the process, the log's size before it, where this
    child's own output begins; an earlier, failed try's output stays above it for the reader)."""
    offset = log.stat().st_size if log.exists() else 0
    with open(log, "a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=env or dict(os.environ),
                                start_new_session=new_session)
    return proc, offset


def serving_port(text: str) -> int | None:
    """The HTTP port a server's log says it serves on, if it got that far."""
    found = _SERVING.search(text)
    return int(found.group(1)) if found else None


def wait_up(proc: subprocess.Popen, log: Path, offset: int, port: int, probe: Callable[[], bool],
            timeout_s: float) -> None:
    """Block until ``proc`` serves on ``port`` and ``probe()`` (its readiness request) is true. Raises PortTaken
    when it exited over a taken port, RuntimeError when it exited otherwise, TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_bytes()[offset:].decode(errors="replace")  # offset counts bytes
        if proc.poll() is not None:
            error = PortTaken if _TAKEN.search(text) else RuntimeError
            raise error(f"server exited with {proc.returncode}:\n{text[-4000:]}")
        if serving_port(text) == port and probe():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not ready after {timeout_s} s:\n{text[-4000:]}")
        time.sleep(0.2)


def ready_or_respawn(wait: Callable[[], None], respawn: Callable[[], None], tries: int = TRIES) -> None:
    """``wait()`` for the child started last; when it died over a taken port, ``respawn()`` it on fresh ports and
    wait again, ``tries`` launches in all (the last PortTaken propagates)."""
    for launch in range(1, tries + 1):
        try:
            return wait()
        except PortTaken:
            if launch == tries:
                raise
            respawn()


@dataclass
class Served:
    """A started `strata serve` child and the ports it serves on (``grpc_port`` None: no gRPC)."""
    proc: subprocess.Popen
    port: int
    grpc_port: int | None

    def stop(self, timeout_s: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_serve(args: list[str], log: Path, *, ready_path: str = "/health", grpc: bool = False,
                timeout_s: float = 300, env: dict[str, str] | None = None) -> Served:
    """`strata serve ARGS` on 127.0.0.1 and fresh ports (gRPC too with ``grpc``), returned once ``ready_path``
    answers 200; started again on fresh ports after a collision; stopped on failure. Output appended to ``log``."""
    env = env or {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    current: Served | None = None
    offset = 0

    def start_try() -> None:
        nonlocal current, offset
        port, grpc_port = free_port(), (free_port() if grpc else None)
        cmd = [sys.executable, "-m", "strataserve", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--grpc-port", str(grpc_port or 0), *args]  # ARGS last: they may override
        proc, offset = spawn(cmd, log, cwd=ROOT, env=env)
        current = Served(proc, port, grpc_port)

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{current.port}{ready_path}", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    start_try()
    try:
        ready_or_respawn(lambda: wait_up(current.proc, log, offset, current.port, ready, timeout_s), start_try)
    except BaseException:
        current.stop()
        raise
    return current
