"""Dynamic batching A/B: strataserve (KServe v2 HTTP) vs LitServe, same ONNX MLP, same machine, same run.

The model is a 3-layer MLP 512-2048-2048-10 (float32, ReLU) built with onnx.helper from a fixed seed and run by
onnxruntime in both servers with the same session options (intra-op threads = cores), both batching up to 64
rows with a 2 ms collection window, both without access logs. 64 closed-loop HTTP clients (one asyncio loop,
aiohttp, pre-encoded JSON bodies: each client sends one row of 512 floats). Both servers stay up for the whole
run and are loaded in alternating windows (warm-up, then a timed part) so a noisy machine hits both alike.
Every client's answer is checked against onnxruntime run directly before timing starts.

    .venv/bin/python benchmarks/batching.py [--duration 24] [--rounds 3] [--warmup 3] [--clients 64]

Prints one parseable line per server and one with the ratio, e.g.
    batching server=strataserve clients=64 requests=... rps=... p50_ms=... p99_ms=... errors=0 avg_batch=...
    batching ratio rps_x=... p99_strataserve_ms=... p99_litserve_ms=...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DIMS = (512, 2048, 2048, 10)
SEED = 0


def build_mlp(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(SEED)
    nodes, inits, prev = [], [], "x"
    n = len(DIMS) - 1
    for i, (a, b) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        bias = (rng.standard_normal(b) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(bias, f"b{i}")]
        gemm_out = "y" if i == n - 1 else f"g{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [gemm_out]))
        if i < n - 1:
            nodes.append(helper.make_node("Relu", [gemm_out], [f"h{i}"]))
            prev = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", DIMS[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", DIMS[-1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def session_options():
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count() or 1
    opts.inter_op_num_threads = 1
    return opts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- servers
def write_repository(root: Path, onnx_path: Path, max_batch: int, delay_us: int) -> Path:
    model_dir = root / "repo" / "mlp"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.onnx").write_bytes(onnx_path.read_bytes())
    (model_dir / "config.pbtxt").write_text(
        f'name: "mlp"\nbackend: "onnxruntime"\nmax_batch_size: {max_batch}\n'
        f'input [{{ name: "x" data_type: TYPE_FP32 dims: [{DIMS[0]}] }}]\n'
        f'output [{{ name: "y" data_type: TYPE_FP32 dims: [{DIMS[-1]}] }}]\n'
        f"instance_group [{{ count: 1 kind: KIND_CPU }}]\n"
        f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
    )
    return root / "repo"


def strataserve_cmd(repo: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "strataserve.cli", "serve", "--model-repository", str(repo),
        "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(free_port()),
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
    ]


try:  # LitServe pickles the API object into a spawned worker, so the class must live at module level
    import litserve as ls

    _LitBase = ls.LitAPI
except ImportError:  # strataserve-only runs (--only strataserve) do not need it
    ls, _LitBase = None, object


class MlpLitAPI(_LitBase):
    def __init__(self, model: str, **kw):
        super().__init__(**kw)
        self.model = model

    def setup(self, device):
        import onnxruntime as ort

        self.session = ort.InferenceSession(self.model, sess_options=session_options(), providers=["CPUExecutionProvider"])

    def decode_request(self, request):
        return np.asarray(request["input"], dtype=np.float32)

    def batch(self, inputs):
        return np.stack(inputs)

    def predict(self, x):
        return self.session.run(["y"], {"x": x})[0]

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {"output": output.tolist()}


def serve_litserve(model: str, port: int, max_batch: int, timeout_s: float) -> None:
    api = MlpLitAPI(model, max_batch_size=max_batch, batch_timeout=timeout_s)
    ls.LitServer(api, accelerator="cpu", workers_per_device=1).run(
        host="127.0.0.1", port=port, generate_client_file=False, log_level="warning"
    )


def litserve_cmd(model: Path, port: int, max_batch: int, timeout_s: float) -> list[str]:
    return [sys.executable, __file__, "--serve-litserve", str(model), str(port), str(max_batch), str(timeout_s)]


# ------------------------------------------------------------------------------------------- load
async def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


async def check_outputs(name, url, bodies, expected, parse) -> None:
    """Correctness before speed: every client's row against onnxruntime run directly."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        for i, body in enumerate(bodies):
            async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                got = parse(await r.json())
                np.testing.assert_allclose(got, expected[i], rtol=1e-4, atol=1e-4, err_msg=name)


async def run_window(url, bodies, clients, warmup_s, duration_s) -> tuple[list[float], float, int]:
    """Closed loop: each client sends its next request when the previous answer arrived."""
    import aiohttp

    lat: list[float] = []
    errors = 0
    phase = {"measure": False, "stop": False}
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as s:

        async def client(i: int) -> None:
            nonlocal errors
            while not phase["stop"]:
                t0 = time.perf_counter()
                async with s.post(url, data=bodies[i], headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
                if phase["measure"] and not phase["stop"]:
                    lat.append(time.perf_counter() - t0)
                    errors += not ok

        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        await asyncio.sleep(warmup_s)
        phase["measure"] = True
        t0 = time.perf_counter()
        await asyncio.sleep(duration_s)
        phase["stop"] = True
        elapsed = time.perf_counter() - t0
        await asyncio.gather(*tasks)
    return lat, elapsed, errors


def summarize(lat: list[float], elapsed: float, errors: int) -> dict:
    arr = np.array(lat) * 1000
    return {"requests": len(lat), "rps": len(lat) / elapsed, "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)), "errors": errors}


def line(name: str, clients: int, r: dict) -> str:
    extra = f" avg_batch={r['avg_batch']:.1f}" if "avg_batch" in r else ""
    return (
        f"batching server={name} clients={clients} requests={r['requests']} rps={r['rps']:.1f} "
        f"p50_ms={r['p50_ms']:.2f} p99_ms={r['p99_ms']:.2f} errors={r['errors']}{extra}"
    )


def stop(proc: subprocess.Popen) -> None:
    """Stop a server and everything it started: LitServe forks its HTTP servers and spawns its workers, and
    they outlive a plain SIGTERM to the parent, so each server runs in its own process group."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    time.sleep(1.0)  # children may still be exiting after the parent went
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each timed window")
    p.add_argument("--duration", type=float, default=24.0, help="timed seconds per server, split over the rounds")
    p.add_argument("--rounds", type=int, default=3, help="alternating windows (evens out a noisy machine)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--queue-delay-us", type=int, default=2000, help="both servers' batch collection window")
    p.add_argument("--only", choices=["strataserve", "litserve"])
    args = p.parse_args()

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = root / "mlp.onnx"
        build_mlp(model)
        rows = np.random.default_rng(SEED + 1).standard_normal((args.clients, DIMS[0])).astype(np.float32)
        ref = ort.InferenceSession(str(model), sess_options=session_options(), providers=["CPUExecutionProvider"])
        expected = ref.run(["y"], {"x": rows})[0]
        del ref

        servers: dict[str, dict] = {}
        if args.only in (None, "strataserve"):
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            repo = write_repository(root, model, args.max_batch, args.queue_delay_us)
            servers["strataserve"] = dict(
                cmd=strataserve_cmd(repo, port), ready=f"{base}/v2/models/mlp/ready", url=f"{base}/v2/models/mlp/infer",
                stats=f"{base}/v2/models/mlp/stats", parse=lambda d: np.asarray(d["outputs"][0]["data"], np.float32),
                bodies=[json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, DIMS[0]],
                                                "data": r.tolist()}]}).encode() for r in rows],
            )
        if args.only in (None, "litserve"):
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            servers["litserve"] = dict(
                cmd=litserve_cmd(model, port, args.max_batch, args.queue_delay_us / 1e6), ready=f"{base}/health",
                url=f"{base}/predict", stats=None, parse=lambda d: np.asarray(d["output"], np.float32),
                bodies=[json.dumps({"input": r.tolist()}).encode() for r in rows],
            )
        procs = {}
        try:
            for name, srv in servers.items():  # both up (idle) for the whole run; only one is loaded at a time
                procs[name] = subprocess.Popen(srv["cmd"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                               start_new_session=True)
            for name, srv in servers.items():
                asyncio.run(wait_ready(srv["ready"], procs[name]))
                asyncio.run(check_outputs(name, srv["url"], srv["bodies"], expected, srv["parse"]))
            acc = {name: ([], 0.0, 0) for name in servers}
            names = list(servers)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    srv = servers[name]
                    lat, el, err = asyncio.run(run_window(srv["url"], srv["bodies"], args.clients, args.warmup,
                                                          args.duration / args.rounds))
                    print(f"# round={r} {line(name, args.clients, summarize(lat, el, err))}", flush=True)
                    l0, e0, r0 = acc[name]
                    acc[name] = (l0 + lat, e0 + el, r0 + err)
            results = {}
            for name, srv in servers.items():
                results[name] = summarize(*acc[name])
                if srv["stats"]:
                    import urllib.request

                    st = json.load(urllib.request.urlopen(srv["stats"]))["model_stats"][0]
                    results[name]["avg_batch"] = st["inference_count"] / max(1, st["execution_count"])
                print(line(name, args.clients, results[name]), flush=True)
        finally:
            for proc in procs.values():
                stop(proc)
        if len(results) == 2:
            s, l = results["strataserve"], results["litserve"]
            print(
                f"batching ratio rps_x={s['rps'] / l['rps']:.2f} p99_strataserve_ms={s['p99_ms']:.2f} "
                f"p99_litserve_ms={l['p99_ms']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-litserve":
        serve_litserve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    else:
        main()
