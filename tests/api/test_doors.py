"""Every door locked, on a real `strata serve` over TLS (a self-signed certificate made here): the API key on the
OpenAI, KServe HTTP, repository control and /metrics routes and on gRPC (tritonclient, `authorization` metadata),
the probes open; each request limit's error; the queued-bytes budget; repository path escapes; per-key rate
limits (tokens and requests per minute) answering 429 with Retry-After."""
from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _model_repos import write_python_model
from api_server import MODEL, launch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.utils import InferenceServerException

KEY = "door-key"
# X[0] >= 100: sleeps X[0] ms first; Y = X + 1.
ECHO = """
    import time
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                if x[0] >= 100:
                    time.sleep(x[0] / 1000)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]))
            return out
"""
CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT64 dims: [-1] } ]
output [ { name: "Y" data_type: TYPE_INT64 dims: [-1] } ]
"""


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def door(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doors")
    cert, key = _self_signed(tmp)
    repo = tmp / "repo"
    write_python_model(repo, "echo", ECHO, CONFIG)
    (tmp / "outside").mkdir()
    (repo / "link_out").symlink_to(tmp / "outside")
    ctx = ssl.create_default_context(cafile=str(cert))
    srv = launch(tiny_ckpt, tmp / "server.log", "--model-repository", str(repo),
                 "--model-control-mode", "explicit", "--load-model", "echo",
                 "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--metrics-require-key",
                 "--requests-per-minute", "60", "--tokens-per-minute", "600", "--limit-n", "2",
                 "--limit-max-tokens", "64", "--limit-prompt-tokens", "100", "--limit-stop", "2",
                 "--limit-logit-bias", "2", "--max-request-body-mib", "0.015", "--max-queued-mib", "0.012",
                 "--grpc-max-message-mib", "0.01", "--allowed-origins", '["https://ui.example"]', api_key=KEY,
                 grpc=True, verify=ctx)
    client = httpx.Client(base_url=srv.url, verify=ctx, timeout=60)
    try:
        yield srv, client, cert, srv.grpc_port
    finally:
        client.close()
        srv.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}
WRONG = {"Authorization": "Bearer not-the-key"}


def _echo_body(x: list[int]) -> dict:
    return {"inputs": [{"name": "X", "datatype": "INT64", "shape": [len(x)], "data": x}]}


def test_every_http_route_needs_the_key_over_tls(door):
    srv, client, cert, _ = door
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is refused
        httpx.get(f"http://127.0.0.1:{srv.port}/v1/models", headers=AUTH, timeout=5).raise_for_status()
    routes = [("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/v2", None),
              ("GET", "/v2/models/echo", None), ("POST", "/v2/models/echo/infer", _echo_body([1, 2])),
              ("POST", "/v2/repository/index", {}), ("POST", "/v2/repository/models/echo/load", {}),
              ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
              ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})]
    for method, path, body in routes:
        for headers in ({}, WRONG):
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.text)
            err = r.json()["error"]  # KServe routes: a string, as tritonclient expects; OpenAI: an object
            assert "API key" in (err if path.startswith("/v2") else err["message"])
        r = client.request(method, path, json=body, headers=AUTH)
        assert r.status_code == 200, (path, r.text)
    assert client.post("/v2/models/echo/infer", json=_echo_body([1, 2]), headers=AUTH).json()["outputs"][0][
        "data"] == [2, 3]
    for probe in ("/health", "/v2/health/live", "/v2/health/ready"):
        assert client.get(probe).status_code == 200
    # tritonclient over HTTPS
    triton = httpclient.InferenceServerClient(f"localhost:{srv.port}", ssl=True, ssl_options={"ca_certs": str(cert)})
    inp = httpclient.InferInput("X", [3], "INT64")
    inp.set_data_from_numpy(np.array([4, 5, 6], np.int64))
    with pytest.raises(InferenceServerException) as err:
        triton.infer("echo", [inp])
    assert "API key" in str(err.value)
    got = triton.infer("echo", [inp], headers=dict(AUTH)).as_numpy("Y")  # it adds its own headers to the dict
    np.testing.assert_array_equal(got, [5, 6, 7])


def test_grpc_needs_the_key_over_tls_and_bounds_message_size(door):
    _, _, cert, grpc_port = door
    client = grpcclient.InferenceServerClient(f"localhost:{grpc_port}", ssl=True,
                                              root_certificates=str(cert))
    assert client.is_server_live()  # the probes stay open
    inp = grpcclient.InferInput("X", [3], "INT64")
    inp.set_data_from_numpy(np.array([1, 2, 3], np.int64))
    for headers in (None, {"authorization": "Bearer not-the-key"}):
        with pytest.raises(InferenceServerException) as err:
            client.infer("echo", [inp], headers=headers)
        assert err.value.status() == "StatusCode.UNAUTHENTICATED" and "API key" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            client.get_model_repository_index(headers=headers)
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    got = client.infer("echo", [inp], headers={"authorization": f"Bearer {KEY}"}).as_numpy("Y")
    np.testing.assert_array_equal(got, [2, 3, 4])
    big = grpcclient.InferInput("X", [4096], "INT64")  # 32 KiB > --grpc-max-message-mib 0.01
    big.set_data_from_numpy(np.zeros(4096, np.int64))
    with pytest.raises(InferenceServerException) as err:
        client.infer("echo", [big], headers={"authorization": f"Bearer {KEY}"})
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    plain = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")  # no TLS: no answer
    with pytest.raises(InferenceServerException):
        plain.is_server_live(client_timeout=3)


def test_each_limit_has_a_clear_error(door):
    _, client, _, _ = door
    base = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    cases = [({"n": 3}, "n", "limit of 2"), ({"max_tokens": 65}, "max_tokens", "limit of 64"),
             ({"stop": ["a", "b", "c"]}, "stop", "at most 2"), ({"stop": ["x" * 300]}, "stop", "300 characters"),
             ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "at most 2"),
             ({"prompt": "word " * 150}, "prompt", "limit of 100")]
    for extra, param, text in cases:
        r = client.post("/v1/completions", json={**base, **extra}, headers=AUTH)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and text in err["message"], err
    r = client.post("/v1/chat/completions", headers=AUTH,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    big = client.post("/v2/models/echo/infer", json=_echo_body([0] * 10000), headers=AUTH)  # ~20 KiB > 15 KiB
    assert big.status_code == 413 and "limit" in big.json()["error"]


def test_queued_bytes_budget(door):
    _, client, _, _ = door
    payload = [1500] + [0] * 4000  # ~8 KiB of JSON; the first request sleeps 1.5 s in the model
    slow: dict = {}
    t = threading.Thread(target=lambda: slow.setdefault("r", client.post("/v2/models/echo/infer",
                                                                          json=_echo_body(payload), headers=AUTH)))
    t.start()
    import time

    time.sleep(0.5)
    second = client.post("/v2/models/echo/infer", json=_echo_body([1] + [0] * 4000), headers=AUTH)
    t.join(30)
    assert second.status_code == 503 and "bytes of requests in flight" in second.json()["error"]
    assert second.headers["retry-after"]
    assert slow["r"].status_code == 200  # the admitted one was served
    assert client.post("/v2/models/echo/infer", json=_echo_body([1] + [0] * 4000), headers=AUTH).status_code == 200


def test_repository_api_refuses_paths_outside_the_repository(door):
    _, client, _, _ = door
    for name in ("..%2F..%2Fetc", "%2E%2E", "link_out", "..%5Cetc", "%2Fetc"):
        r = client.post(f"/v2/repository/models/{name}/load", json={}, headers=AUTH)
        assert r.status_code in (400, 404), (name, r.text)  # 404: the decoded path matches no route
        err = r.json()["error"]
        assert (err if isinstance(err, str) else err["message"]), r.text
    r = client.post("/v2/repository/models/link_out/load", json={}, headers=AUTH)
    assert r.status_code == 400 and "outside the model repository" in r.json()["error"]


def test_cors_for_allowed_origins_only_and_the_key_still_needed(door, server):
    """--allowed-origins: a browser page of that origin gets its preflight answered (it carries no key) and can
    read the answers, a 401 included; other origins get no CORS grant. Without the flag (``server``) none."""
    _, client, _, _ = door
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = client.options("/v1/chat/completions", headers={"Origin": "https://ui.example", **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
    bad = client.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **pre})
    assert "access-control-allow-origin" not in bad.headers
    r = client.get("/v1/models", headers={"Origin": "https://ui.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = client.get("/v1/models", headers={"Origin": "https://ui.example", **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    plain = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://ui.example", **server.headers})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_rate_limits_per_key(door):
    """Runs last in this module: it spends the key's allowance."""
    _, client, _, _ = door
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 64, "n": 2, "ignore_eos": True}
    statuses = []
    for _ in range(8):  # each may use 5 + 2 x 64 tokens: 600 per minute admit at most 4 in a row
        r = client.post("/v1/completions", json=body, headers=AUTH)
        statuses.append(r.status_code)
        if r.status_code == 429:
            break
    assert statuses[-1] == 429 and statuses.count(200) <= 4, statuses
    assert r.json()["error"]["code"] == "tokens_per_minute_exceeded" and int(r.headers["retry-after"]) >= 1
    # reads (the model list, the console's once-a-second feed) do not spend the key's requests per minute
    for _ in range(70):
        assert client.get("/v1/models", headers=AUTH).status_code == 200
        assert client.get("/console/api/stats", headers=AUTH).status_code == 200
    for i in range(80):
        r = client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=AUTH)
        if r.status_code == 429:
            break
    assert r.status_code == 429 and r.json()["error"]["code"] == "requests_per_minute_exceeded"
    assert int(r.headers["retry-after"]) >= 1
    assert client.get("/health").status_code == 200  # probes are never rate limited


def test_bad_tls_pair_and_a_taken_grpc_port_say_so(tmp_path, capsys):
    """A certificate that is not one, or a key that is not its own, is named at start-up (gRPC used to report a
    port it could not bind); a second server on a taken gRPC port fails (SO_REUSEPORT let both listen)."""
    from rich.console import Console

    from strataserve.cli import _serve_options, build_parser

    cert, key = _self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    _, other_key = _self_signed(tmp_path / "other")
    (tmp_path / "junk.pem").write_text("junk\n")
    for c, k in ((tmp_path / "junk.pem", key), (cert, other_key), (cert, tmp_path / "missing.pem")):
        args = build_parser().parse_args(["serve", "--ssl-certfile", str(c), "--ssl-keyfile", str(k)])
        assert _serve_options(args, Console(file=sys.stderr, width=300)) is None
        assert "not a usable certificate and key" in capsys.readouterr().err

    # in a process of its own: tritonclient's copy of the protocol, imported here, clashes with the server's
    r = subprocess.run([sys.executable, "-c", GRPC_TWICE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "another server on the port" in r.stdout, r.stdout + r.stderr


GRPC_TWICE = """
import asyncio
from strataserve.api.kserve_grpc import start_grpc_server

async def twice():
    first = await start_grpc_server(None, "127.0.0.1", 0)
    try:
        await start_grpc_server(None, "127.0.0.1", first.port)
        print("both bound")
    except OSError as exc:
        print(exc)
    finally:
        await first.stop()

asyncio.run(twice())
"""
