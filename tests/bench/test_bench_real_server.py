"""``strata bench serve`` against a real ``strata serve`` subprocess on a tiny random checkpoint (CPU)."""
from __future__ import annotations

import argparse
import os

import pytest
from _ports import start_serve
from _tiny_models import make_tiny_checkpoint

from strataserve.bench.datasets import random_requests
from strataserve.bench.serve import add_cli_args, run
from strataserve.bench.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("bench_ckpt"))
    log = tmp_path_factory.mktemp("bench_server") / "server.log"
    served = start_serve([str(ckpt), "--device", "cpu", "--dtype", "float32", "--served-model-name", "tiny",
                          "--kv-cache-memory-gib", "0.01", "--max-model-len", "512", "--uvicorn-log-level", "warning"],
                         log, timeout_s=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield f"http://127.0.0.1:{served.port}", ckpt
    finally:
        served.stop()


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
