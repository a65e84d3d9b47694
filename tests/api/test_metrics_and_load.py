"""/metrics (parsed with prometheus-client) moves with traffic; disconnects free KV blocks; overload gets 503;
``strata bench serve`` runs against the server and agrees with its counters."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from api_server import MODEL, ROOT
from prometheus_client.parser import text_string_to_metric_families

LABEL = {"model_name": MODEL}


def scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({**LABEL, **labels}.items()))), 0.0)


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def test_metric_names_and_labels(server):
    names = {name for name, _ in scrape(server)}
    for want in ("strata:num_requests_running", "strata:num_requests_waiting", "strata:kv_cache_usage_perc",
                 "strata:prefix_cache_queries_total", "strata:prefix_cache_hits_total",
                 "strata:prompt_tokens_total", "strata:generation_tokens_total", "strata:num_preemptions_total",
                 "strata:time_to_first_token_seconds_bucket", "strata:inter_token_latency_seconds_bucket",
                 "strata:time_per_output_token_seconds_bucket", "strata:e2e_request_latency_seconds_bucket",
                 "strata:request_queue_time_seconds_bucket", "strata:request_prefill_time_seconds_bucket",
                 "strata:request_decode_time_seconds_bucket", "strata:request_prompt_tokens_bucket",
                 "strata:request_generation_tokens_bucket"):
        assert want in names, want


def test_counters_move_with_traffic(server, http):
    before = scrape(server)
    prompt = "metrics are counted here " * 3  # > 1 block, so the repeat hits the prefix cache
    usages = []
    for _ in range(2):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0,
                                               "ignore_eos": True})
        usages.append(r.json()["usage"])
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("strata:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("strata:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 10
    assert delta("strata:request_success_total", finished_reason="length") == 2
    for hist in ("strata:e2e_request_latency_seconds", "strata:time_to_first_token_seconds",
                 "strata:request_prompt_tokens", "strata:request_queue_time_seconds",
                 "strata:request_prefill_time_seconds", "strata:request_decode_time_seconds"):
        assert delta(f"{hist}_count") == 2, hist
    assert delta("strata:request_generation_tokens_sum") == 10
    assert delta("strata:inter_token_latency_seconds_count") == 2 * 4
    assert delta("strata:prefix_cache_queries_total") > 0
    assert delta("strata:prefix_cache_hits_total") >= 16  # the second request reuses at least one full block


def test_requests_refused_before_they_run_are_counted(server, http):
    """A bad parameter's 400 (found by the route, after the model is known) counts as client_error in the
    router's outcomes, as a request that fails later does; 400s of an unknown model name have no model to count."""
    before = scrape(server)
    bad = [("/v1/completions", {"prompt": "x", "max_tokens": 0}),
           ("/v1/completions", {"prompt": "x", "temperature": -1}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 5000}], "max_tokens": 4})]
    for path, body in bad:
        assert http.post(path, json={"model": MODEL, **body}).status_code == 400
    assert http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200
    after = scrape(server)
    key = dict(sla_class="default")
    for outcome, n in (("client_error", 3), ("ok", 1)):
        assert value(after, "strata:router_requests_total", outcome=outcome, **key) - \
            value(before, "strata:router_requests_total", outcome=outcome, **key) == n, outcome


def _used_blocks(server) -> float:
    return value(scrape(server), "strata:kv_cache_used_blocks")


def test_stream_disconnect_frees_blocks(server, http):
    idle = _used_blocks(server)
    aborts = value(scrape(server), "strata:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "disconnect me", "max_tokens": 480, "ignore_eos": True, "stream": True,
            "n": 4}  # 4 x 480 tokens: hundreds of steps, so the hang-up lands mid-generation
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data:"))
            assert _used_blocks(server) > idle
    # The connection is closed: the request is aborted in the engine and its blocks freed.
    assert wait_for(lambda: _used_blocks(server) == idle), (_used_blocks(server), idle)
    samples = scrape(server)
    # one per choice, as finished ones count: the 4 choices were all cut
    assert value(samples, "strata:request_success_total", finished_reason="abort") == aborts + 4
    assert value(samples, "strata:num_requests_running") == 0


def test_non_stream_disconnect_aborts(server):
    idle = _used_blocks(server)
    aborts = value(scrape(server), "strata:request_success_total", finished_reason="abort")
    body = json.dumps({"model": MODEL, "prompt": "going away", "max_tokens": 480, "ignore_eos": True,
                       "n": 4}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        # Hang up while the engine is generating (4 x 480 tokens take hundreds of steps).
        assert wait_for(lambda: _used_blocks(server) > idle)
    assert wait_for(lambda: value(scrape(server), "strata:request_success_total", finished_reason="abort")
                    == aborts + 4)
    assert wait_for(lambda: _used_blocks(server) == idle)


def test_overload_gets_503_with_retry_after(server, http):
    # The server runs with --max-num-seqs 4 --max-waiting-requests 4: 8 sequences in flight fill it.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "busy"}], "max_tokens": 480,
            "ignore_eos": True, "stream": True, "n": 2}
    readers = []  # keep the line iterators alive: dropping one closes its connection (= a disconnect)
    with contextlib.ExitStack() as stack:
        for _ in range(4):
            r = stack.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
            assert r.status_code == 200
            readers.append(r.iter_lines())
            next(line for line in readers[-1] if line.startswith("data:"))
        over = http.post("/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 2})
        assert over.status_code == 503, over.text
        assert over.headers["retry-after"] == "1"
        assert over.json()["error"]["code"] == "overloaded"
    assert wait_for(lambda: value(scrape(server), "strata:num_requests_running") == 0)
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 2})
    assert ok.status_code == 200


def test_bench_serve_cli_against_server(server, tiny_ckpt, tmp_path):
    before = scrape(server)
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "strataserve", "bench", "serve", "--base-url", server.url, "--api-key",
           server.api_key, "--tokenizer", str(tiny_ckpt), "--num-prompts", "6", "--max-concurrency", "3",
           "--random-input-len", "24", "--random-output-len", "6", "--ignore-eos", "--seed", "1",
           "--disable-tqdm", "--save-result", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms",
                "total_input_tokens", "total_output_tokens", "duration"):
        assert key in result, key
    after = scrape(server)
    # The bench's token counts agree with the server's own counters (the bench may send one probe request
    # with the first prompt before the run, which the server counts too).
    assert result["total_output_tokens"] == 36
    generated = value(after, "strata:generation_tokens_total") - value(before, "strata:generation_tokens_total")
    assert generated in (36, 36 + 6)
    prompt = value(after, "strata:prompt_tokens_total") - value(before, "strata:prompt_tokens_total")
    assert prompt >= result["total_input_tokens"] and (prompt == result["total_input_tokens"]) == (generated == 36)


def test_bench_without_the_key_says_to_pass_it(server):
    import aiohttp

    from strataserve.bench.serve import _first_model

    async def probe() -> str:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(ValueError) as exc:
                await _first_model(session, server.url, {})
            return str(exc.value)

    assert "HTTP 401" in (msg := asyncio.run(probe())) and "--api-key" in msg
