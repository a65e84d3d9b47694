"""``strata bench serve`` against a real ``strata serve`` subprocess on a tiny random checkpoint (CPU)."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _tiny_models import make_tiny_checkpoint

from strataserve.bench.datasets import random_requests
from strataserve.bench.serve import add_cli_args, run
from strataserve.bench.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("bench_ckpt"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("bench_server") / "server.log"
    cmd = [sys.executable, "-m", "strataserve", "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--served-model-name", "tiny", "--kv-cache-memory-gib", "0.01",
           "--max-model-len", "512", "--uvicorn-log-level", "warning"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not ready:\n" + log.read_text()[-3000:]
            time.sleep(0.2)
        yield url, ckpt
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(["--disable-tqdm", *argv])


def test_bench_completions_token_prompts_exact_counts(server_url, tmp_path) -> None:
    url, ckpt = server_url
    result = run(_args("--base-url", url, "--tokenizer", str(ckpt), "--num-prompts", "8", "--max-concurrency", "4",
                       "--random-input-len", "16", "--random-output-len", "6", "--random-range-ratio", "0.5",
                       "--ignore-eos", "--seed", "3", "--goodput", "ttft:600000", "--save-result", str(tmp_path / "r.json")))
    want = random_requests(8, 16, 6, 0.5, len(load_tokenizer(ckpt)), 3, set(load_tokenizer(ckpt).all_special_ids))
    assert result["failed"] == 0 and result["completed"] == 8, result["error_summary"]
    assert result["model"] == "tiny"  # taken from /v1/models
    # The server's usage agrees with the dataset: prompts are sent as token ids, ignore_eos forces max_tokens.
    assert result["total_input_tokens"] == sum(r.prompt_len for r in want)
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in want)
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"] and result["mean_itl_ms"] > 0
    assert (tmp_path / "r.json").is_file()


def test_bench_chat_decoded_prompts(server_url) -> None:
    url, ckpt = server_url
    result = run(_args("--base-url", url, "--endpoint", "/v1/chat/completions", "--tokenizer", str(ckpt),
                       "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos"))
    assert result["failed"] == 0 and result["completed"] == 4, result["error_summary"]
    assert result["total_output_tokens"] == 16
    assert result["total_input_tokens"] > 0
