"""Process lifecycle on servers of their own: `strata serve MODEL --model-repository DIR` serves both fronts; the
engine process dying fails LLM requests cleanly and turns /health to 503 while the repository keeps serving;
SIGTERM stops every child and frees the HTTP and gRPC ports and the socket files; a bad model path fails
start-up with a clear message instead of hanging."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _model_repos import add_onnx_mlp, mlp_reference
from api_server import MODEL, ROOT, free_port, launch

# Waits end as soon as what they wait for happens; the limits are for a loaded CI machine, where start-up, a step
# or a reply can take many times what it takes on an idle one (httpx's own default is 5 s).
_LIMIT_S = 120.0


def _children(pid: int) -> list[int]:
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.split("/")[2]))
    return kids


def _engine_pid(pid: int) -> int:
    for kid in _children(pid):
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:  # a short-lived child that has gone
            continue
        if b"spawn_main" in cmdline:
            return kid
    raise AssertionError("no engine-core child process found")


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + _LIMIT_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _engine_requests(url: str) -> float:
    """Sequences in the engine (running + waiting), from /metrics: the scheduler's stats of its latest step."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=_LIMIT_S).text.splitlines():
        if line.startswith(("strata:num_requests_running{", "strata:num_requests_waiting{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_engine_death_then_sigterm(tiny_ckpt, tmp_path, monkeypatch):
    # The server's engine socket dir goes in a TMPDIR of its own: other servers (other tests, other workers) add
    # and remove theirs in /tmp meanwhile, so only this folder tells whether ours was removed.
    sockets = tempfile.mkdtemp(prefix="strata-lc-")
    monkeypatch.setenv("TMPDIR", sockets)
    try:
        _engine_death_then_sigterm(tiny_ckpt, tmp_path, sockets)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def _engine_death_then_sigterm(tiny_ckpt: Path, tmp_path: Path, sockets: str) -> None:
    repo = tmp_path / "repo"
    weights = add_onnx_mlp(repo, name="mlp")[1]
    # Without the supervisor: the dead engine stays dead (test_self_healing.py covers the restart).
    srv = launch(tiny_ckpt, tmp_path / "server.log", "--model-repository", str(repo), "--no-engine-restart",
                 api_key=None, grpc=True)
    grpc_port = srv.grpc_port
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8

    def kserve_infer() -> None:  # the repository's model, over the same HTTP port and over gRPC
        for mod, addr in ((httpclient, f"127.0.0.1:{srv.port}"), (grpcclient, f"127.0.0.1:{grpc_port}")):
            client = mod.InferenceServerClient(addr)
            inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer("mlp", [inp]).as_numpy("OUTPUT0")
            np.testing.assert_allclose(got, mlp_reference(x, weights), rtol=1e-5, atol=1e-6)

    try:
        url = srv.url
        kserve_infer()
        metrics = httpx.get(f"{url}/metrics", timeout=_LIMIT_S).text  # one registry: LLM and repository metrics
        assert "strata:num_requests_running" in metrics and 'model="mlp"' in metrics
        assert glob.glob(f"{sockets}/strata-core-*"), "the engine's socket dir is not where TMPDIR points"
        engine = _engine_pid(srv.proc.pid)
        children = _children(srv.proc.pid)
        assert httpx.get(f"{url}/health", timeout=_LIMIT_S).status_code == 200

        body = {"model": MODEL, "prompt": "long story", "max_tokens": 480, "ignore_eos": True, "n": 4}
        result: dict = {}

        def non_stream() -> None:
            result["r"] = httpx.post(f"{url}/v1/completions", json=body, timeout=_LIMIT_S)

        with httpx.Client(timeout=_LIMIT_S) as client:
            with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                streaming = _engine_requests(url)
                waiter = threading.Thread(target=non_stream)
                waiter.start()
                # the kill comes once the non-streamed request is in the engine too (not after a guessed delay)
                deadline = time.monotonic() + _LIMIT_S
                while _engine_requests(url) <= streaming and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert _engine_requests(url) > streaming, "the non-streamed request never reached the engine"
                os.kill(engine, signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data:")]
            waiter.join(_LIMIT_S)
        assert not waiter.is_alive(), "the non-streamed request never ended"
        # The stream ends with an OpenAI error event, then [DONE].
        assert rest[-1] == "data: [DONE]"
        assert '"error"' in rest[-2] and "engine" in rest[-2]
        r = result["r"]
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=_LIMIT_S)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        again = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}, timeout=_LIMIT_S)
        assert again.status_code == 503 and again.json()["error"]["type"] == "service_unavailable"
        kserve_infer()  # the repository keeps serving without the LLM engine

        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=_LIMIT_S) == 0, srv.log_tail()
    finally:
        srv.stop()
    assert _port_free(srv.port) and _port_free(grpc_port)
    _wait_gone(children)
    assert not [p for p in children if _alive(p)], "child processes outlived the server"
    assert not glob.glob(f"{sockets}/strata-core-*"), "engine socket files left behind"


def test_sigterm_with_a_stream_in_flight_stops_everything(tmp_path):
    # No drain time: the 4 x 1000-token stream is still running, so shutdown cancels it (aborted in the engine).
    from strataserve.assets import DEMO_MODEL_DIR  # slower than the tiny model: the stream outlasts the grace

    srv = launch(DEMO_MODEL_DIR, tmp_path / "server.log", "--shutdown-timeout", "0", "--max-model-len", "1024",
                 api_key=None)
    try:
        engine = _engine_pid(srv.proc.pid)
        body = {"model": MODEL, "prompt": "keep going", "max_tokens": 1000, "n": 4, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=_LIMIT_S) as client, \
                client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            srv.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        # cut at the drain's end: a last error event and [DONE], not a cut connection and a logged traceback
        assert rest[-1] == "data: [DONE]" and '"code":"server_shutdown"' in rest[-2], rest[-3:]
        assert srv.proc.wait(timeout=_LIMIT_S) == 0, srv.log_tail()
        assert "Traceback" not in srv.log.read_text()
    finally:
        srv.stop()
    _wait_gone([engine])
    assert not _alive(engine)
    assert _port_free(srv.port)
    assert "stopped" in srv.log_tail()


def test_sigterm_to_the_process_group_still_drains(tiny_ckpt, tmp_path):
    """systemd, ``timeout`` and supervisord's stopasgroup signal the whole group: the engine core must leave its
    stopping to the server, which lets the stream in flight finish (it used to die at once: engine_dead)."""
    srv = launch(tiny_ckpt, tmp_path / "server.log", "--shutdown-timeout", "60", api_key=None, new_session=True)
    try:
        engine = _engine_pid(srv.proc.pid)
        body = {"model": MODEL, "prompt": "keep going", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=_LIMIT_S) as client, \
                client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            events = [next(line for line in lines if line.startswith("data:"))]
            os.killpg(srv.proc.pid, signal.SIGTERM)
            events += [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], events[-3:]
        assert srv.proc.wait(timeout=_LIMIT_S) == 0, srv.log_tail()
    finally:
        srv.stop()
    _wait_gone([engine])
    assert not _alive(engine) and "died" not in srv.log_tail()


def _serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "strataserve", "serve", *args, "--device", "cpu", "--port", str(free_port())]
    env = {**os.environ, "COLUMNS": "200"}  # rich wraps at 80 columns otherwise, splitting long tmp paths' messages
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


def test_bad_model_path_fails_fast_with_a_message(tmp_path):
    missing = _serve(str(tmp_path / "does-not-exist"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = _serve(str(empty))
    assert broken.returncode == 1
    assert "engine failed to start" in broken.stderr and "config.json" in broken.stderr


def test_operator_mistakes_are_one_line_errors(tiny_ckpt, tmp_path):
    """A taken HTTP port (checked before the model loads), a repository that is not a folder, a config whose
    models are not a list: each a sentence and exit code 1, no traceback."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = str(taken.getsockname()[1])
        cmd = [sys.executable, "-m", "strataserve", "serve", str(tiny_ckpt), "--device", "cpu", "--host", "127.0.0.1",
               "--port", port]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                           env={**os.environ, "COLUMNS": "200"})
    finally:
        taken.close()
    assert r.returncode == 1 and f"cannot serve HTTP on 127.0.0.1:{port}" in r.stderr, r.stderr
    (tmp_path / "models5.yaml").write_text("models: 5\n")
    for args, needle in (([str(tiny_ckpt), "--model-repository", str(tmp_path / "nowhere")], "not a folder"),
                         (["--config", str(tmp_path / "models5.yaml")], "models: Input should be a valid list")):
        r = _serve(*args, "--grpc-port", "0")
        assert r.returncode in (1, 2) and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
