"""Launching a real ``strata serve`` subprocess (tiny random Llama checkpoint, CPU) for the tests in tests/api.

``launch()`` backs the shared session server (conftest.py) and the tests that need a server of their own (to kill
its engine or SIGTERM it). A uniquely named module, so imports never pick up another folder's conftest.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import _ports
import httpx

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL = "tiny"

# A Hermes-style template that renders the tools, assistant tool calls and tool results.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'tool' %}<tool_response>"
    "{{ m['tool_call_id'] }}:{{ m['content'] }}</tool_response>{% else %}{{ m['content'] or '' }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}


def free_port() -> int:
    """For the tests' own ports (tests/_ports.py, looked up there at each call so a test can replace it)."""
    return _ports.free_port()


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    api_key: str | None = API_KEY
    grpc_port: int | None = None  # launch(..., grpc=True)
    verify: Any = None  # launch(..., verify=ctx): the server speaks TLS, checked against ctx
    respawn: Callable[[], None] | None = field(default=None, repr=False)  # a fresh try on fresh ports
    offset: int = 0  # where this try's output begins in the log

    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}" if self.verify is not None else f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def launch(ckpt: Path, log: Path, *extra: str, api_key: str | None = API_KEY, wait: bool = True,
           new_session: bool = False, grpc: bool = False, verify: Any = None) -> Server:
    """``new_session``: the server leads a process group of its own (so a test can signal the whole group, as
    systemd does, without signalling itself). ``grpc``: serve KServe gRPC on a port of its own (``grpc_port``).
    ``verify``: an SSLContext for a server given TLS flags in ``extra``. The ports are provisional until the
    server is ready: a collision starts it again on fresh ones (tests/_ports.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    log.write_text("")
    server = Server(None, 0, log, api_key, verify=verify)  # type: ignore[arg-type]  # spawn() sets proc

    def spawn() -> None:
        server.port = _ports.free_port()
        server.grpc_port = _ports.free_port() if grpc else None
        cmd = [sys.executable, "-m", "strataserve", "serve", str(ckpt), "--host", "127.0.0.1", "--port",
               str(server.port), "--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL,
               "--kv-cache-memory-gib", "0.01", "--max-model-len", "512", "--uvicorn-log-level", "warning"]
        if grpc:
            cmd += ["--grpc-port", str(server.grpc_port)]
        cmd += [*extra, *(["--api-key", api_key] if api_key else [])]
        server.proc, server.offset = _ports.spawn(cmd, log, cwd=ROOT, env=env, new_session=new_session)

    server.respawn = spawn
    spawn()
    if wait:
        wait_ready(server)
    return server


def wait_ready(server: Server) -> Server:
    """Block until ``server`` answers /health (a launch(..., wait=False) server), starting it again on fresh ports
    if one was taken under it; stops it on failure."""
    def probe() -> bool:
        try:
            verify = True if server.verify is None else server.verify
            return httpx.get(f"{server.url}/health", timeout=2, verify=verify).status_code == 200
        except httpx.HTTPError:
            return False

    def wait() -> None:
        _ports.wait_up(server.proc, server.log, server.offset, server.port, probe,
                       300)  # generous: a shared, busy CI box can be slow to import torch

    try:
        _ports.ready_or_respawn(wait, server.respawn or (lambda: None))
    except BaseException:
        server.stop()
        raise
    return server
