"""Real `strata serve` subprocesses for the router tests: an upstream (OpenAI + KServe) and routers configured by
YAML files. A uniquely named module, so imports never pick up another folder's helpers."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import _ports
import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """For the tests' own ports (tests/_ports.py, looked up there at each call so a test can replace it)."""
    return _ports.free_port()


@dataclass
class Proc:
    """``port`` and ``grpc_port`` are provisional until the first ``start()`` returns: a collision starts the
    server again on fresh ports (tests/_ports.py). After that they are kept (a restart serves the same ports)."""
    args: list[str]
    port: int
    log: Path
    grpc_port: int | None = None
    proc: subprocess.Popen | None = None
    offset: int = 0  # where this try's output begins in the log
    headers: dict[str, str] = field(default_factory=dict)
    pinned: bool = False  # started once: others may know the ports now

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def start(self, ready_path: str = "/health", timeout: float = 300) -> "Proc":
        def spawn() -> None:
            cmd = [sys.executable, "-m", "strataserve", "serve", *self.args, "--host", "127.0.0.1", "--port",
                   str(self.port), "--grpc-port", str(self.grpc_port or 0), "--uvicorn-log-level", "warning",
                   "--disable-uvicorn-access-log"]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
            self.proc, self.offset = _ports.spawn(cmd, self.log, cwd=ROOT, env=env)

        def respawn() -> None:
            if self.pinned:  # the ports are promised to others: fail rather than move
                raise RuntimeError(f"a port of {self.url} (gRPC {self.grpc}) was taken while it was stopped:\n"
                                   f"{self.log_tail()}")
            self.port = _ports.free_port()
            self.grpc_port = _ports.free_port() if self.grpc_port else self.grpc_port
            spawn()

        def probe() -> bool:
            try:
                return httpx.get(self.url + ready_path, timeout=2, headers=self.headers).status_code == 200
            except httpx.HTTPError:
                return False

        spawn()
        try:
            _ports.ready_or_respawn(lambda: _ports.wait_up(self.proc, self.log, self.offset, self.port, probe,
                                                           timeout), respawn)
        except BaseException:
            self.stop()
            raise
        self.pinned = True
        return self

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


async def serve_aiohttp(handler) -> tuple:
    """An aiohttp app answering every path with ``handler`` on a free loopback port: (its AppRunner, its URL)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()  # port 0, read back: no window for another to take it
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def write_config(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def local_entry(name: str, model: Path, **extra) -> dict:
    return {"name": name, "path": str(model), "device": "cpu", "dtype": "float32", "kv_cache_memory_gib": 0.01,
            **extra}


class Blackhole:
    """A TCP server that accepts connections and never answers: an upstream that hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self.conns:
            c.close()
