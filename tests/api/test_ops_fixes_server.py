"""Operations fixes on a real `strata serve` started with --port 0: the printed URLs carry the bound port;
--served-model-name NAME ALIAS serves both names; /tokenize's return_token_strs; --limit-max-tokens below the
completions default of 16; the Responses route's default budget; requests-per-minute refusals in /metrics."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from api_server import MODEL, launch, wait_ready

GEN_MAX = 7  # the checkpoint's max_new_tokens
LIMIT = 10  # --limit-max-tokens, below the completions default of 16
RPM = 40


@pytest.fixture(scope="module")
def srv(tiny_ckpt, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ops")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": GEN_MAX}))
    # the last --port and --served-model-name win over launch()'s own
    server = launch(tiny_ckpt, folder / "server.log", "--port", "0", "--served-model-name", MODEL, "alias",
                    "--generation-config", str(folder), "--limit-max-tokens", str(LIMIT),
                    "--requests-per-minute", str(RPM), "--grpc-port", "0", wait=False)
    deadline = time.monotonic() + 300
    while (found := re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", server.log.read_text())) is None:
        assert server.proc.poll() is None and time.monotonic() < deadline, server.log_tail()
        time.sleep(0.2)
    server.port = int(found.group(1))
    try:
        yield wait_ready(server)
    finally:
        server.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=60)


def test_port_0_prints_the_bound_port(srv):
    log = srv.log.read_text()
    assert srv.port != 0 and ":0/" not in log
    assert f"Ready: {MODEL} (local-llm) at http://127.0.0.1:{srv.port}/v1" in log
    assert httpx.get(f"{srv.url}/health").status_code == 200  # the printed port is the one that answers


def test_every_served_name_is_listed_and_routed(srv):
    models = httpx.get(f"{srv.url}/v1/models", headers=srv.headers).json()["data"]
    assert [m["id"] for m in models] == [MODEL, "alias"] and models[1]["root"] == MODEL
    r = _post(srv, "/v1/completions", {"model": "alias", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL  # responses carry the first name, as vLLM's
    r = _post(srv, "/v1/chat/completions", {"model": "alias", "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    assert httpx.get(f"{srv.url}/v1/models/alias", headers=srv.headers).json()["id"] == "alias"


def test_tokenize_returns_token_strings_when_asked(srv):
    plain = _post(srv, "/tokenize", {"model": MODEL, "prompt": "hello world"}).json()
    assert plain["token_strs"] is None  # vLLM's shape: present, null unless asked for
    for body in ({"prompt": "hello world"}, {"messages": [{"role": "user", "content": "hello world"}]}):
        r = _post(srv, "/tokenize", {"model": "alias", "return_token_strs": True, **body}).json()
        assert len(r["token_strs"]) == r["count"] == len(r["tokens"]) and all(isinstance(s, str) for s in
                                                                               r["token_strs"])
    assert r["token_strs"] != plain["token_strs"]


def test_a_limit_below_16_holds_an_unset_completions_budget(srv):
    body = {"model": MODEL, "prompt": "the cat sat", "ignore_eos": True}
    r = _post(srv, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LIMIT, r.text
    r = _post(srv, "/v1/completions", {**body, "max_tokens": LIMIT + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_responses_default_budget_is_the_checkpoint_default(srv):
    r = _post(srv, "/v1/responses", {"model": MODEL, "input": "the cat sat", "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == GEN_MAX, r.text


def _metric(text: str, name: str) -> float:
    found = re.search(rf'^{re.escape(name)}\{{[^}}]*\}} (\S+)$', text, re.M)
    assert found is not None, name
    return float(found.group(1))


def test_parallel_sampling_counts_each_sequence_as_vllm_does(srv):
    names = ("strata:e2e_request_latency_seconds_count", "strata:time_to_first_token_seconds_count",
             "strata:request_generation_tokens_count", "strata:request_generation_tokens_sum",
             "strata:generation_tokens_total", "strata:prompt_tokens_total")
    before = httpx.get(f"{srv.url}/metrics").text
    r = _post(srv, "/v1/completions", {"model": MODEL, "prompt": "the cat sat", "n": 2, "max_tokens": 3,
                                       "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = httpx.get(f"{srv.url}/metrics").text
    d = {n: _metric(after, n) - _metric(before, n) for n in names}
    usage = r.json()["usage"]
    # two sequences: two requests in every histogram, each with its own prompt count and 3 tokens
    assert d[names[0]] == d[names[1]] == d[names[2]] == 2, d
    assert d[names[3]] == d[names[4]] == usage["completion_tokens"] == 6, d
    assert d[names[5]] == 2 * usage["prompt_tokens"], d


def test_requests_per_minute_refusals_show_in_metrics(srv):  # last: it spends the key's minute
    def refused() -> float:
        text = httpx.get(f"{srv.url}/metrics").text
        found = re.search(r'^strata:rate_limited_requests_total\{kind="requests_per_minute",'
                          r'sla_class="default"\} (\S+)$', text, re.M)
        assert found is not None, text[-2000:]
        return float(found.group(1))

    before = refused()
    codes = [_post(srv, "/tokenize", {"model": MODEL, "prompt": "x"}).status_code for _ in range(RPM + 3)]
    assert codes.count(429) >= 3
    assert refused() - before == codes.count(429)
