"""One `strata serve --model-repository` subprocess (KServe HTTP + gRPC) shared by every test in tests/kserve
(package scope: it stops when the last test of this folder is done)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from _kserve_launch import Launched, kserve_server
from _model_repos import add_onnx_mlp, build_standard_repo


@dataclass
class KServeServer(Launched):
    repo: Path = Path()
    refs: dict | None = None


@pytest.fixture(scope="package")  # torn down when tests/kserve is done
def kserve(tmp_path_factory) -> KServeServer:
    tmp = tmp_path_factory.mktemp("kserve")
    repo = tmp / "repo"
    refs = build_standard_repo(repo)
    refs["spare_weights"] = add_onnx_mlp(repo, name="onnx_spare", seed=10)  # for load/unload tests
    # a generous batching window so the batching test sees merged batches on a busy 2-core machine
    refs["batch_weights"] = add_onnx_mlp(repo, name="onnx_batch", max_batch_size=32, max_queue_delay_us=50_000, seed=20)
    # a model that cannot load (its version folder has no model.onnx): listed UNAVAILABLE with the reason,
    # answered 503 / UNAVAILABLE; with it, strict readiness (the default, as Triton's) keeps the server not ready,
    # so the launcher waits for liveness
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: 2\n')
    with kserve_server(repo, tmp / "server.log", "--model-control-mode", "explicit", "--load-model", "*") as up:
        yield KServeServer(up.http, up.grpc, up.log, repo, refs)
