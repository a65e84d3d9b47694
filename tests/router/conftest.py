"""One upstream `strata serve` (tiny LLM over OpenAI + a model repository over KServe HTTP/gRPC) and one router
in front of it (a local LLM, the upstream's LLM, two upstream KServe models, a hanging upstream)."""
from __future__ import annotations

from pathlib import Path

import pytest
from _model_repos import add_onnx_mlp, add_python_text
from _tiny_models import make_tiny_checkpoint
from router_servers import Blackhole, Proc, free_port, local_entry, write_config


@pytest.fixture(scope="package")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("router_tiny"))


@pytest.fixture(scope="package")
def upstream(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("upstream")
    repo = tmp / "repo"
    weights = add_onnx_mlp(repo)
    add_python_text(repo)
    srv = Proc([str(tiny), "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
                "--kv-cache-memory-gib", "0.01", "--max-model-len", "256", "--max-num-seqs", "8",
                "--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "*"],
               free_port(), tmp / "upstream.log", grpc_port=free_port())
    srv.weights = weights  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def blackhole():
    bh = Blackhole()
    yield bh
    bh.close()


@pytest.fixture(scope="package")
def router(tiny, upstream, blackhole, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    up = upstream.url
    cfg = write_config(tmp / "router.yaml", {
        "models": [
            local_entry("local", tiny, max_model_len=256, max_num_seqs=4, gpu_cost_per_hour=3.0),
            {"name": "big", "upstream": "openai", "url": [up], "upstream_model": "tiny", "timeout_s": 30,
             "gpu_cost_per_hour": 2.0},
            {"name": "mlp", "upstream": "kserve", "url": up, "upstream_model": "onnx_mlp"},
            {"name": "words", "upstream": "kserve", "url": up, "upstream_model": "py_text"},
            {"name": "hang", "upstream": "openai", "url": f"http://127.0.0.1:{blackhole.port}", "timeout_s": 1,
             "connect_timeout_s": 1},
        ],
        "sla_classes": {"interactive": {"priority": 0, "ttft_ms": 5000}, "batch": {"priority": 10}},
        "default_sla": "interactive",
        "health_check_interval_s": 0.3,
    })
    srv = Proc(["--config", str(cfg)], free_port(), tmp / "router.log", grpc_port=free_port())
    srv.start()
    yield srv
    srv.stop()
