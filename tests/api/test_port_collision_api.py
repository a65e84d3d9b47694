"""launch() survives its port being taken between the pick and the server's bind, even by another HTTP server
that answers /health: the child's own log decides whether it is up, and a lost port means a fresh try."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import _ports
import httpx
from api_server import MODEL, launch


class _Impostor(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        body = json.dumps({"data": [{"id": "impostor"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_launch_moves_off_a_port_another_server_took(tiny_ckpt, tmp_path, monkeypatch):
    impostor = ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    taken = impostor.server_address[1]
    handed = _ports.picker_first(monkeypatch, taken)  # the launcher's first pick: the impostor's port
    try:
        srv = launch(tiny_ckpt, tmp_path / "server.log", api_key=None)
    finally:
        impostor.shutdown()
        impostor.server_close()
    try:
        assert handed[0] == taken and srv.port == handed[1] != taken
        log = srv.log.read_text()
        assert f"cannot serve HTTP on 127.0.0.1:{taken}" in log  # the first try lost the port, and said so
        assert f"metrics at http://127.0.0.1:{srv.port}/metrics" in log
        models = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [MODEL]
    finally:
        srv.stop()
