"""Two local LLMs in one `strata serve --config` (the demo model twice, different settings, each in its own
engine process), SLA classes with priorities and a TTFT target, API keys mapped to classes, and config errors."""
from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time

import httpx
import openai
import pytest
from router_servers import ROOT, Proc, free_port, local_entry, write_config

from strataserve.assets import DEMO_MODEL_DIR

ADMIN, BATCH_KEY = "admin-key", "batch-key"


@pytest.fixture(scope="module")
def duo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("duo")
    cfg = write_config(tmp / "duo.yaml", {
        "models": [
            local_entry("chat-a", DEMO_MODEL_DIR, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256,
                        gpu_cost_per_hour=2.5),
            local_entry("chat-b", DEMO_MODEL_DIR, max_model_len=64, max_num_seqs=2),
        ],
        "sla_classes": {"interactive": {"priority": 0, "ttft_ms": 30000}, "batch": {"priority": 10},
                        "strict": {"priority": 5, "ttft_ms": 1}},
        "default_sla": "interactive",
        "api_keys": [{"key": BATCH_KEY, "sla": "batch"}],
    })
    srv = Proc(["--config", str(cfg), "--api-key", ADMIN], free_port(), tmp / "duo.log",
               headers={"Authorization": f"Bearer {ADMIN}"})
    srv.start()
    yield srv
    srv.stop()


def _h(key: str = ADMIN, sla: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **({"x-sla-class": sla} if sla else {})}


def test_two_local_models_each_with_its_own_settings(duo):
    models = {m["id"]: m for m in httpx.get(duo.url + "/v1/models", headers=_h()).json()["data"]}
    assert models["chat-a"]["max_model_len"] == 512 and models["chat-b"]["max_model_len"] == 64
    c = openai.OpenAI(base_url=duo.url + "/v1", api_key=ADMIN, max_retries=0)
    long_prompt = "the old house stood on the hill " * 12  # ~100 tokens: over chat-b's 64
    a = c.completions.create(model="chat-a", prompt=long_prompt, max_tokens=4, temperature=0)
    assert a.model == "chat-a" and a.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="64"):
        c.completions.create(model="chat-b", prompt=long_prompt, max_tokens=4)
    b = c.chat.completions.create(model="chat-b", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                  temperature=0)
    assert b.model == "chat-b" and b.choices[0].message.content
    metrics = httpx.get(duo.url + "/metrics").text
    for name in ("chat-a", "chat-b"):  # one engine each, one series each
        assert f'strata:kv_cache_total_blocks{{model_name="{name}"}}' in metrics


def test_api_key_class_is_a_ceiling(duo):
    body = {"model": "chat-a", "prompt": "x", "max_tokens": 1}
    assert httpx.post(duo.url + "/v1/completions", json=body, headers=_h(BATCH_KEY)).status_code == 200
    r = httpx.post(duo.url + "/v1/completions", json=body, headers=_h(BATCH_KEY, "interactive"))
    assert r.status_code == 403 and "batch" in r.json()["error"]["message"]
    assert httpx.post(duo.url + "/v1/completions", json=body, headers=_h("wrong")).status_code == 401
    metrics = httpx.get(duo.url + "/metrics").text
    assert 'strata:router_requests_total{model_name="chat-a",outcome="ok",sla_class="batch"}' in metrics


async def _ttft(client: httpx.AsyncClient, url: str, sla: str, max_tokens: int = 2, key: str = ADMIN) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", headers=_h(key, sla),
                             json={"model": "chat-a", "prompt": "The garden", "max_tokens": max_tokens,
                                   "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"text"' in line:
                return time.perf_counter() - t0
    raise AssertionError("no token")


async def _drain(client: httpx.AsyncClient, url: str) -> None:
    async with client.stream("POST", url + "/v1/completions", headers=_h(sla="batch"),
                             json={"model": "chat-a", "prompt": "The garden", "max_tokens": 480, "stream": True,
                                   "ignore_eos": True}) as r:
        async for _ in r.aiter_bytes():
            pass


async def _gauge(client: httpx.AsyncClient, url: str, name: str, model: str = "chat-a") -> float:
    for line in (await client.get(url + "/metrics")).text.splitlines():
        if line.startswith(f'{name}{{model_name="{model}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exposed")


def test_interactive_ttft_holds_under_a_batch_flood(duo):
    """With every slot of chat-a held by batch requests and more queued, an interactive request preempts a
    batch one and gets its first token about as fast as on an idle engine, while a batch request waits."""

    async def run() -> tuple[float, list[float], float]:
        async with httpx.AsyncClient(timeout=120) as client:
            idle = statistics.median([await _ttft(client, duo.url, "interactive") for _ in range(3)])
            flood = [asyncio.ensure_future(_drain(client, duo.url)) for _ in range(8)]
            while await _gauge(client, duo.url, "strata:num_requests_waiting") < 3:  # 4 running, the rest queued
                await asyncio.sleep(0.05)
            loaded = [await _ttft(client, duo.url, "interactive") for _ in range(3)]
            assert not any(f.done() for f in flood), "the flood ended before the measurements"
            queued_batch = await _ttft(client, duo.url, "batch")  # behind the flood's own queue
            for f in flood:  # hang up: the engine aborts them
                f.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
            return idle, loaded, queued_batch

    idle, loaded, queued_batch = asyncio.run(run())
    assert statistics.median(loaded) <= max(3 * idle, idle + 0.5), (idle, loaded)
    assert queued_batch > 2 * statistics.median(loaded), (queued_batch, loaded)
    metrics = httpx.get(duo.url + "/metrics").text
    pre = [line for line in metrics.splitlines() if line.startswith('strata:num_preemptions_total{model_name="chat-a"')]
    assert pre and float(pre[0].split()[-1]) >= 3  # each interactive request preempted a batch one


def test_unreachable_ttft_is_refused_at_the_door(duo):
    """Class `strict` wants 1 ms: once the router has learnt the engine's pace, a strict request with strict
    work queued ahead of it is answered 429 + Retry-After at once, and the others are served."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            for _ in range(5):  # samples for the estimator (any class: the pace is the engine's)
                await _ttft(client, duo.url, "interactive")
            body = {"model": "chat-a", "prompt": "a long story " * 10, "max_tokens": 8, "ignore_eos": True}
            return await asyncio.gather(*(client.post(duo.url + "/v1/completions", json=body,
                                                      headers=_h(sla="strict")) for _ in range(6)))

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert 200 in codes and 429 in codes, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "sla_ttft_unreachable"
    metrics = httpx.get(duo.url + "/metrics").text
    assert 'strata:router_requests_total{model_name="chat-a",outcome="rejected",sla_class="strict"}' in metrics


def test_cost_per_1k_tokens_is_reported(duo):
    c = openai.OpenAI(base_url=duo.url + "/v1", api_key=ADMIN, max_retries=0)
    c.completions.create(model="chat-a", prompt="x", max_tokens=8, extra_body={"ignore_eos": True})
    lines = [line for line in httpx.get(duo.url + "/metrics").text.splitlines()
             if line.startswith("strata:router_cost_per_1k_output_tokens_quantile{")
             and 'model_name="chat-a"' in line]
    q = {line.split('quantile="')[1].split('"')[0]: float(line.split()[-1]) for line in lines
         if 'sla_class="interactive"' in line}
    assert set(q) == {"0.5", "0.95"} and 0 < q["0.5"] <= q["0.95"]
    # chat-b has no gpu_cost_per_hour: no cost series for it
    assert not any('model_name="chat-b"' in line for line in lines)


@pytest.mark.parametrize("doc,expect", [
    ("models:\n  - name: a\n    path: /nonexistent\n", "models[0] (a).path"),
    ("models:\n  - name: u\n    upstream: openai\n", "models[0] (u).url: required key is missing"),
    ("models:\n  - name: u\n    upstream: grpc\n    url: http://x:1\n", "upstream 'grpc' is not known"),
    ("models: []\nsla_classes: {a: {priority: 1}}\ndefault_sla: b\n", "default_sla"),
    ("models:\n  - name: u\n    upstream: openai\n    url: http://x:1\n    urll: 3\n", "urll: unknown key"),
])
def test_config_errors_are_clear(tmp_path, doc, expect):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(doc)
    r = subprocess.run([sys.executable, "-m", "strataserve", "serve", "--config", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={"COLUMNS": "300", "PATH": "/usr/bin"})
    assert r.returncode == 2, r.stderr
    assert expect in " ".join(r.stderr.split()), r.stderr
