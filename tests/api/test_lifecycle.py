"""Process lifecycle on servers of their own: `strata serve MODEL --model-repository DIR` serves both fronts; the
engine process dying fails LLM requests cleanly and turns /health to 503 while the repository keeps serving;
SIGTERM stops every child and frees the HTTP and gRPC ports and the socket files; a bad model path fails
start-up with a clear message instead of hanging."""
from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _model_repos import add_onnx_mlp, mlp_reference
from api_server import MODEL, ROOT, free_port, launch


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
        cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return kid
    raise AssertionError("no engine-core child process found")


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


def test_engine_death_then_sigterm(tiny_ckpt, tmp_path):
    sockets_before = set(glob.glob("/tmp/strata-core-*"))
    repo = tmp_path / "repo"
    weights = add_onnx_mlp(repo, name="mlp")[1]
    grpc_port = free_port()
    # Without the supervisor: the dead engine stays dead (test_self_healing.py covers the restart).
    srv = launch(tiny_ckpt, tmp_path / "server.log", "--model-repository", str(repo), "--grpc-port",
                 str(grpc_port), "--no-engine-restart", api_key=None)
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
        metrics = httpx.get(f"{url}/metrics").text  # one registry: LLM and repository metrics together
        assert "strata:num_requests_running" in metrics and 'model="mlp"' in metrics
        engine = _engine_pid(srv.proc.pid)
        children = _children(srv.proc.pid)
        assert httpx.get(f"{url}/health").status_code == 200

        body = {"model": MODEL, "prompt": "long story", "max_tokens": 480, "ignore_eos": True, "n": 4}
        result: dict = {}

        def non_stream() -> None:
            result["r"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                waiter = threading.Thread(target=non_stream)
                waiter.start()
                time.sleep(0.1)
                os.kill(engine, signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data:")]
            waiter.join(30)
        # The stream ends with an OpenAI error event, then [DONE].
        assert rest[-1] == "data: [DONE]"
        assert '"error"' in rest[-2] and "engine" in rest[-2]
        r = result["r"]
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        again = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2})
        assert again.status_code == 503 and again.json()["error"]["type"] == "service_unavailable"
        kserve_infer()  # the repository keeps serving without the LLM engine

        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0, srv.log_tail()
    finally:
        srv.stop()
    assert _port_free(srv.port) and _port_free(grpc_port)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if _alive(p)], "child processes outlived the server"
    assert set(glob.glob("/tmp/strata-core-*")) <= sockets_before, "engine socket files left behind"


def test_sigterm_with_a_stream_in_flight_stops_everything(tmp_path):
    # No drain time: the 4 x 1000-token stream is still running, so shutdown cancels it (aborted in the engine).
    from strataserve.assets import DEMO_MODEL_DIR  # slower than the tiny model: the stream outlasts the grace

    srv = launch(DEMO_MODEL_DIR, tmp_path / "server.log", "--shutdown-timeout", "0", "--max-model-len", "1024",
                 api_key=None)
    try:
        engine = _engine_pid(srv.proc.pid)
        body = {"model": MODEL, "prompt": "keep going", "max_tokens": 1000, "n": 4, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            srv.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        # cut at the drain's end: a last error event and [DONE], not a cut connection and a logged traceback
        assert rest[-1] == "data: [DONE]" and '"code":"server_shutdown"' in rest[-2], rest[-3:]
        assert srv.proc.wait(timeout=60) == 0, srv.log_tail()
        assert "Traceback" not in srv.log.read_text()
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
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
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            events = [next(line for line in lines if line.startswith("data:"))]
            os.killpg(srv.proc.pid, signal.SIGTERM)
            events += [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], events[-3:]
        assert srv.proc.wait(timeout=60) == 0, srv.log_tail()
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
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
