"""Proc's ports are provisional until its first start: a port taken before that moves the server to fresh ones;
after it, others may have been given the ports (a router's config names its upstream's), so a restart keeps them
and a taken one fails loudly instead of moving."""
from __future__ import annotations

import socket

import _ports
import httpx
import pytest
from _model_repos import add_onnx_mlp
from router_servers import Proc


def test_a_taken_port_moves_a_first_start_but_fails_a_restart(tmp_path):
    add_onnx_mlp(tmp_path / "repo")
    taken = _ports.occupied()
    port = taken.getsockname()[1]
    srv = Proc(["--model-repository", str(tmp_path / "repo")], port, tmp_path / "server.log",
               grpc_port=_ports.free_port())
    try:
        srv.start()
        assert srv.port != port and f"cannot serve HTTP on 127.0.0.1:{port}" in srv.log.read_text()
        assert httpx.get(f"{srv.url}/v2/models/onnx_mlp/ready", timeout=30).status_code == 200
    finally:
        taken.close()
        srv.stop()
    kept = srv.port, srv.grpc_port
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the stopped server's TIME_WAITs
    squatter.bind(("127.0.0.1", srv.port))
    squatter.listen()
    try:
        with pytest.raises(RuntimeError, match="was taken while it was stopped"):
            srv.start()
    finally:
        squatter.close()
        srv.stop()
    assert (srv.port, srv.grpc_port) == kept
