"""``strata bench serve`` end to end against a fake OpenAI streaming server: every field of the JSON result."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
from bench_fakes import MODEL, FakeState, fake_server

from strataserve.assets import DEMO_MODEL_DIR
from strataserve.bench.datasets import random_requests
from strataserve.bench.metrics import METRICS, STATS
from strataserve.bench.serve import add_cli_args, run

RESULT_KEYS = {
    "date", "backend", "endpoint_type", "label", "model_id", "tokenizer_id", "base_url", "endpoint", "model",
    "dataset_name", "num_prompts", "request_rate", "burstiness", "max_concurrency", "seed", "num_warmups",
    "ignore_eos", "goodput_slos_ms", "gpu_cost_per_hour", "percentile_metrics", "metric_percentiles", "duration",
    "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests", "request_goodput",
    "cost_per_1m_output_tokens", "output_tokens_source", "latencies", "error_summary",
} | {f"{s}_{m}_ms" for m in METRICS for s in STATS}
DETAILED_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors", "e2els",
                 "request_errors"}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(["--disable-tqdm", *argv])


def _summary(out: str) -> dict[str, str]:
    lines = [line for line in out.splitlines() if line.startswith("bench: ")]
    assert len(lines) == 1, out
    return dict(kv.split("=", 1) for kv in lines[0][len("bench: "):].split())


def test_random_run_every_field(tmp_path, capsys) -> None:
    state = FakeState(token_delay_s=0.004, fail_indices={3, 6}, api_key="sekret")
    with fake_server(state) as url:
        result = run(_args(
            "--base-url", url, "--num-prompts", "12", "--max-concurrency", "4", "--random-input-len", "16",
            "--random-output-len", "6", "--random-range-ratio", "0.5", "--random-vocab-size", "100", "--seed", "5",
            "--num-warmups", "2", "--ignore-eos", "--goodput", "ttft:60000", "tpot:60000", "--gpu-cost-per-hour", "2.5",
            "--save-result", "--result-filename", "out.json", "--result-dir", str(tmp_path), "--api-key", "sekret",
            "--save-detailed",
        ))
    assert json.loads((tmp_path / "out.json").read_text()) == result
    assert set(result) == RESULT_KEYS | DETAILED_KEYS
    # 1 probe + 2 warm-ups + 12 measured; indices 3 and 6 (measured) were failed by the server.
    assert len(state.bodies) == 15
    measured = state.bodies[3:]
    ok = [b for i, b in enumerate(state.bodies) if i >= 3 and i not in state.fail_indices]
    want = random_requests(12, 16, 6, 0.5, 100, 5)
    assert sorted(b["prompt"] for b in measured) == sorted(r.prompt for r in want)
    assert sorted(b["max_tokens"] for b in measured) == sorted(r.expected_output_len for r in want)
    for b in measured:
        assert b["model"] == MODEL and b["stream"] is True and b["ignore_eos"] is True
        assert b["stream_options"] == {"include_usage": True} and b["temperature"] == 0.0
    assert 2 <= state.max_in_flight <= 4

    dur = result["duration"]
    out_tokens = sum(b["max_tokens"] for b in ok)
    in_tokens = sum(len(b["prompt"]) for b in ok)
    assert result["completed"] == 10 and result["failed"] == 2
    assert result["total_output_tokens"] == out_tokens and result["total_input_tokens"] == in_tokens
    assert result["request_throughput"] == pytest.approx(10 / dur)
    assert result["output_throughput"] == pytest.approx(out_tokens / dur)
    assert result["total_token_throughput"] == pytest.approx((in_tokens + out_tokens) / dur)
    assert result["request_goodput"] == pytest.approx(10 / dur)
    assert result["cost_per_1m_output_tokens"] == pytest.approx(2.5 * dur / 3600 / out_tokens * 1e6)
    assert result["goodput_slos_ms"] == {"ttft": 60000.0, "tpot": 60000.0}
    assert result["model"] == MODEL and result["base_url"] == url and result["endpoint"] == "/v1/completions"
    assert result["dataset_name"] == "random" and result["num_prompts"] == 12 and result["request_rate"] == "inf"
    assert result["burstiness"] == 1.0 and result["max_concurrency"] == 4 and result["seed"] == 5
    assert result["num_warmups"] == 2 and result["ignore_eos"] is True and result["gpu_cost_per_hour"] == 2.5
    summary = result["error_summary"]
    assert len(summary) == 1 and summary[0].startswith("HTTP 500") and "injected failure" in summary[0]
    # "errors": one entry per measured request, in request order, as vLLM
    failed = {tuple(want[i].prompt) for i, e in enumerate(result["errors"]) if e}
    assert len(result["errors"]) == 12 and failed == {tuple(b["prompt"]) for b in state.failed_bodies}
    # Per-request figures (--save-detailed) reproduce the aggregates; the server's 4 ms sleep before every token
    # bounds TTFT and E2EL from below (ITL has no such bound: chunks can arrive together).
    good = [i for i, e in enumerate(result["request_errors"]) if not e]
    assert len(good) == 10 and len(result["input_lens"]) == 12
    ttft = [result["ttfts"][i] * 1e3 for i in good]
    e2el = [result["e2els"][i] * 1e3 for i in good]
    outs = [result["output_lens"][i] for i in good]
    itl = [x * 1e3 for i in good for x in result["itls"][i]]
    tpot = [(e - t) / (n - 1) for e, t, n in zip(e2el, ttft, outs)]
    assert all(t >= 3.5 for t in ttft) and all(e >= 3.5 * n for e, n in zip(e2el, outs))
    assert sorted(outs) == sorted(b["max_tokens"] for b in ok) and len(itl) == sum(n - 1 for n in outs)
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        assert result[f"mean_{name}_ms"] == pytest.approx(np.mean(values))
        assert result[f"median_{name}_ms"] == pytest.approx(np.median(values))
        assert result[f"std_{name}_ms"] == pytest.approx(np.std(values))
        assert result[f"p95_{name}_ms"] == pytest.approx(np.percentile(values, 95))
        assert result[f"p99_{name}_ms"] == pytest.approx(np.percentile(values, 99))

    summary = _summary(capsys.readouterr().out)
    assert summary["completed"] == "10" and summary["failed"] == "2"
    assert float(summary["req_per_s"]) == pytest.approx(result["request_throughput"], rel=1e-3)
    assert float(summary["output_tok_per_s"]) == pytest.approx(result["output_throughput"], rel=1e-3)
    assert float(summary["cost_per_1m_output_tokens"]) == pytest.approx(result["cost_per_1m_output_tokens"], rel=1e-3)


def test_poisson_arrivals_and_strict_goodput(tmp_path) -> None:
    state = FakeState(token_delay_s=0.001)
    with fake_server(state) as url:
        result = run(_args(
            "--base-url", url, "--model", "given-name", "--num-prompts", "10", "--request-rate", "100",
            "--burstiness", "0.5", "--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", "8",
            "--prefix-repetition-suffix-len", "2", "--prefix-repetition-num-prefixes", "2",
            "--prefix-repetition-output-len", "3", "--goodput", "ttft:0.0001", "--save-result", str(tmp_path / "r.json"),
        ))
    assert result["duration"] >= 10 / 100  # the rescaled arrival times end at num_prompts / rate
    assert set(result) == RESULT_KEYS  # no per-request lists without --save-detailed
    assert result["completed"] == 10 and result["request_goodput"] == 0.0 and result["request_rate"] == 100.0
    assert result["total_output_tokens"] == 30 and result["total_input_tokens"] == 100
    assert all(b["model"] == "given-name" and "ignore_eos" not in b for b in state.bodies)
    assert len({tuple(b["prompt"][:8]) for b in state.bodies[1:]}) == 2
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 10


def test_chat_sharegpt_without_usage_counts_chunks(tmp_path) -> None:
    conv = lambda h, g: {"conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}  # noqa: E731
    data = [conv("tell me " * 10, "sure " * 20), conv("why " * 30, "because " * 12), conv("a " * 40, "b " * 50)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    state = FakeState(token_delay_s=0.001, send_usage=False)
    with fake_server(state) as url:
        result = run(_args("--base-url", url, "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt",
                           "--dataset-path", str(path), "--num-prompts", "3", "--sharegpt-output-len", "5"))
    assert result["completed"] == 3 and result["total_output_tokens"] == 15  # 5 content chunks each, no usage
    assert all(b["messages"][0]["role"] == "user" and b["max_completion_tokens"] == 5 for b in state.bodies)
    prompts = {d["conversations"][0]["value"] for d in data}
    assert {b["messages"][0]["content"] for b in state.bodies} == prompts
    assert result["total_input_tokens"] == sum(round(len(p) / 4) for p in prompts)  # no tokenizer: estimate


def test_chat_random_with_tokenizer_decodes_prompts() -> None:
    state = FakeState(token_delay_s=0.0)
    with fake_server(state) as url:
        result = run(_args("--base-url", url, "--backend", "openai-chat", "--tokenizer", str(DEMO_MODEL_DIR),
                           "--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "2"))
    assert result["completed"] == 4 and result["endpoint"] == "/v1/chat/completions"
    assert all(isinstance(b["messages"][0]["content"], str) and b["messages"][0]["content"] for b in state.bodies)
    state = FakeState(token_delay_s=0.0)
    with fake_server(state) as url:
        run(_args("--base-url", url, "--prompt-format", "text", "--tokenizer", str(DEMO_MODEL_DIR), "--num-prompts", "2",
                  "--random-input-len", "12", "--random-output-len", "2"))
    assert all(isinstance(b["prompt"], str) and b["prompt"] for b in state.bodies)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--endpoint", "/v1/chat/completions", "--num-prompts", "2"], "pass --tokenizer"),
        (["--prompt-format", "text", "--num-prompts", "2"], "pass --tokenizer"),
        (["--endpoint", "/v1/chat/completions", "--prompt-format", "ids"], "takes text messages"),
        (["--goodput", "ttft=5"], "NAME:MS"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--request-rate", "0"], "--request-rate"),
        (["--dataset-name", "sharegpt"], "--dataset-path"),
        (["--random-range-ratio", "1.5", "--num-prompts", "2"], "range-ratio"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        run(_args("--base-url", "http://127.0.0.1:9", *argv))


def test_unreachable_server_and_failing_probe() -> None:
    with pytest.raises(SystemExit, match="cannot list models"):
        run(_args("--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--random-input-len", "4"))
    state = FakeState(fail_indices={0})
    with fake_server(state) as url, pytest.raises(SystemExit, match="probe request .* failed: HTTP 500"):
        run(_args("--base-url", url, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2"))
    state = FakeState(api_key="right")
    with fake_server(state) as url, pytest.raises(SystemExit, match="HTTP 401"):
        run(_args("--base-url", url, "--api-key", "wrong", "--num-prompts", "2", "--random-input-len", "4"))


def test_strata_cli_runs_bench_serve() -> None:
    state = FakeState(token_delay_s=0.0)
    with fake_server(state) as url:
        proc = subprocess.run(
            [sys.executable, "-m", "strataserve", "bench", "serve", "--base-url", url, "--num-prompts", "3",
             "--random-input-len", "5", "--random-output-len", "2", "--disable-tqdm"],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 0, proc.stderr
    summary = _summary(proc.stdout)
    assert summary["completed"] == "3" and summary["failed"] == "0"
    assert len(state.bodies) == 4  # probe + 3


def test_where_the_result_goes_is_checked_before_the_run(tmp_path):
    """A result path that is a folder (or a --result-dir that is a file) used to fail after the whole run."""
    from strataserve.bench.serve import _validate

    (tmp_path / "a_file").write_text("x")
    for argv, needle in ((["--save-result", str(tmp_path)], "is a folder"),
                         (["--save-result", "--result-dir", str(tmp_path / "a_file")], "is a file"),
                         (["--request-timeout", "0"], "--request-timeout")):
        with pytest.raises(ValueError, match=needle):
            _validate(_args(*argv))
    _validate(_args("--save-result", str(tmp_path / "out.json")))
