"""Two `strata serve` processes handed the same gRPC port: the second fails with a clear message instead of sharing
the port (grpcio turns SO_REUSEPORT on unless told not to, and the kernel would then split clients between the
two), and the launcher starts it again on fresh ports, so both end up serving, each on its own port."""
from __future__ import annotations

import _ports
import tritonclient.grpc as grpcclient
from _kserve_launch import kserve_server
from _model_repos import add_onnx_mlp


def test_a_second_server_on_a_taken_grpc_port_fails_clearly_and_the_launcher_moves_it(tmp_path, monkeypatch):
    add_onnx_mlp(tmp_path / "repo")
    with kserve_server(tmp_path / "repo", tmp_path / "first.log") as first:
        taken = int(first.grpc.rsplit(":", 1)[1])
        # the second server's first try: a free HTTP port and the first server's gRPC port
        handed = _ports.picker_first(monkeypatch, _ports.free_port(), taken)
        with kserve_server(tmp_path / "repo", tmp_path / "second.log") as second:
            log = second.log_tail()
            assert f"cannot bind the KServe gRPC server to 127.0.0.1:{taken}" in log, log
            assert second.grpc != first.grpc and second.grpc == f"127.0.0.1:{handed[3]}"
            for served in (first, second):
                client = grpcclient.InferenceServerClient(served.grpc)
                assert client.is_server_live() and client.is_model_ready("onnx_mlp")
                client.close()
        assert grpcclient.InferenceServerClient(first.grpc).is_server_live()  # the first one never noticed
