"""Two replicas of the demo model as Ray actors behind the router (`placement: ray`), on a local Ray cluster
this test starts (2 CPUs, 4 declared GPUs so each replica's placement group of 2 GPUs is real Ray scheduling;
the models run on the CPU). The `strata serve --config` process joins it through `ray_address`. The same
server also runs the demo model as two engine processes on this host (`placement: local`).

Checked through the HTTP API with the `openai` client: greedy answers equal HF transformers' from both
replicas; killing the actor that streams a request fails that request with the 503 `engine_dead` error while
the other replica keeps answering, /health says degraded, and a replacement actor comes up (restart counted);
the same for a SIGKILLed local replica process.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest
import torch
from router_servers import Proc, free_port, write_config

# Ray reads this when it is first imported: single-machine mode, where every Ray address (this process's
# cluster, the server process that inherits the variable, their workers) is 127.0.0.1, not the host's address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray  # noqa: E402

from strataserve.assets import DEMO_MODEL_DIR  # noqa: E402
from strataserve.engine.ray_client import NAMESPACE  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, object_store_memory=100 * 2**20,
             namespace=NAMESPACE, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:"), f"Ray bound {address}: it was imported before this module"
        yield address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray_router")
    cfg = write_config(tmp / "router.yaml", {
        "models": [{"name": "demo", "path": str(DEMO_MODEL_DIR), "device": "cpu", "dtype": "float32",
                    "kv_cache_memory_gib": 0.01, "max_model_len": 512, "replicas": 2, "placement": "ray",
                    "ray_address": cluster, "num_gpus_per_replica": 2},
                   {"name": "local", "path": str(DEMO_MODEL_DIR), "device": "cpu", "dtype": "float32",
                    "kv_cache_memory_gib": 0.01, "max_model_len": 512, "replicas": 2, "placement": "local"}],
        "health_check_interval_s": 0.3,
    })
    srv = Proc(["--config", str(cfg)], free_port(), tmp / "router.log").start(timeout=240)
    yield srv
    srv.stop()


def _replicas(srv, model: str = "demo") -> list[dict]:
    data = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]
    return next(m for m in data if m["id"] == model)["replicas"]


def _recovered(srv, model: str, timeout: float = 120) -> list[dict]:
    """Poll until every replica of ``model`` is healthy and /health is a plain 200 again."""
    deadline = time.monotonic() + timeout
    while True:
        reps = _replicas(srv, model)
        health = httpx.get(srv.url + "/health", timeout=10)
        if all(r["healthy"] for r in reps) and health.status_code == 200 and not health.content:
            return reps
        assert time.monotonic() < deadline, reps
        time.sleep(0.5)


def _hf_greedy(ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_both_replicas_serve_hf_greedy_answers(server):
    reps = _replicas(server)
    assert [r["healthy"] for r in reps] == [True, True]
    gpus = [set(r["gpu_ids"]) for r in reps]
    assert [len(g) for g in gpus] == [2, 2] and not gpus[0] & gpus[1]  # each its own placement group
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    prompt = httpx.post(server.url + "/tokenize", json={"model": "demo", "prompt": "The old house at the end of the "
                        "street"}, timeout=10).json()["tokens"]
    want = _hf_greedy(prompt, 12)
    def ask(_):
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        return r.choices[0].model_extra["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, range(6)))
    assert got == [want] * 6
    served = [r["served"] for r in _replicas(server)]
    assert sum(served) == 6 and min(served) >= 1, served  # concurrent requests spread over both


def test_killing_an_actor_fails_its_stream_and_a_replacement_comes_up(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=480, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    reps = _replicas(server)
    busy = [r for r in reps if r["outstanding"] == 1]
    assert len(busy) == 1, reps
    victim, other = busy[0], next(r for r in reps if r is not busy[0])
    ray.kill(ray.get_actor(victim["actor"], namespace=NAMESPACE))
    with pytest.raises(openai.APIError, match="engine"):
        for _ in stream:
            pass
    # the other replica answers at once, and /health reports the model degraded while the replacement loads
    r = client.completions.create(model="demo", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "degraded",
                                                           "models": {"demo": "degraded", "local": "serving"}}
    reps = _recovered(server, "demo")
    names = {r["actor"] for r in reps}
    assert victim["actor"] not in names and other["actor"] in names
    metrics = httpx.get(server.url + "/metrics").text
    assert 'strata:engine_restarts_total{model_name="demo"} 1.0' in metrics
    r = client.completions.create(model="demo", prompt="Hello again", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


def test_local_replica_processes_share_the_load_and_one_killed_is_replaced(server):
    reps = _replicas(server, "local")
    assert len({r["pid"] for r in reps}) == 2 and all(r["healthy"] for r in reps)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    def ask(i):
        return client.completions.create(model="local", prompt=f"Story {i}:", max_tokens=24,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == [24] * 4
    assert min(r["served"] for r in _replicas(server, "local")) >= 1
    os.kill(reps[0]["pid"], signal.SIGKILL)
    assert [ask(i) for i in range(3)] == [24] * 3  # the other process answers meanwhile
    after = _recovered(server, "local")
    assert after[0]["pid"] != reps[0]["pid"] and after[1]["pid"] == reps[1]["pid"]
    assert 'strata:engine_restarts_total{model_name="local"} 1.0' in httpx.get(server.url + "/metrics").text


def test_an_actor_that_cannot_start_says_why(cluster, tmp_path):
    from strataserve.config import EngineConfig, ModelConfig
    from strataserve.types.errors import EngineStartupError
    from strataserve.engine.ray_client import RayCoreClient

    config = EngineConfig(model=ModelConfig(model=str(tmp_path), device="cpu"))
    # num_cpus=0: the server's replicas hold both of the cluster's CPUs
    with pytest.raises(EngineStartupError, match=r"engine actor bad-\w+ failed to load the model: .*config\.json"):
        RayCoreClient(config, name="bad", num_cpus=0, startup_timeout_s=120)
    with pytest.raises(EngineStartupError, match=r"did not finish loading within 2s \(is the cluster short"):
        RayCoreClient(config, name="huge", num_gpus=8, num_cpus=0, startup_timeout_s=2)  # the cluster has 4
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(("bad", "huge"))]
