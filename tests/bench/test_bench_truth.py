"""``strata bench serve`` figures against a server whose timings are known exactly (``timed_server``).

Each test states the true TTFT / TPOT / E2EL / token counts the server produces and checks the bench reports them;
the tolerances cover scheduling noise on a shared CPU, far below the errors these tests guard against.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from timed_server import Timing, timed_server

from strataserve.bench.serve import add_cli_args, run
from strataserve.bench.workload import arrival_offsets

TOL_MS = 40.0


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(["--disable-tqdm", *argv])


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> str:
    """A word-level tokenizer where the server's "w<i> " pieces are one token each, so re-tokenising is exact."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(200)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path_factory.mktemp("word_tok")
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_warmups_and_probe_never_send_measured_prompts() -> None:
    """A prefix cache warmed by the measured prompts made TTFT look 15-20x better."""
    t = Timing(ttft=0.0, itl=0.0)
    with timed_server(t) as url:
        run(_args("--base-url", url, "--num-prompts", "4", "--num-warmups", "3", "--random-input-len", "6",
                  "--random-output-len", "2", "--random-prefix-len", "4"))
    assert len(t.bodies) == 8  # probe + 3 warm-ups + 4 measured
    unmeasured, measured = [b["prompt"] for b in t.bodies[:4]], [b["prompt"] for b in t.bodies[4:]]
    assert len({tuple(p[:4]) for p in measured}) == 1  # --random-prefix-len: one shared 4-token prefix
    for w in unmeasured:
        assert all(w[:2] != m[:2] for m in measured), (w, measured)  # not even the shared prefix is warmed
        assert len(w) == len(measured[0])  # the same shape
    assert len({tuple(w) for w in unmeasured[1:]}) == 3  # distinct warm-ups


def test_sharegpt_warmups_use_conversations_beyond_the_measured(tmp_path) -> None:
    conv = lambda h: {"conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": "a b c d e f"}]}  # noqa: E731
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([conv(f"question number {i} please answer") for i in range(6)]))
    t = Timing(ttft=0.0, itl=0.0)
    with timed_server(t) as url:
        run(_args("--base-url", url, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3",
                  "--num-warmups", "2", "--sharegpt-output-len", "2"))
    unmeasured, measured = [b["prompt"] for b in t.bodies[:3]], {b["prompt"] for b in t.bodies[3:]}
    assert len(measured) == 3 and not measured & set(unmeasured)


def test_reasoning_only_stream_is_timed(tmp_path) -> None:
    """Tokens in delta.reasoning_content only: TTFT 0, ITL 0 and a passed TTFT SLO were reported."""
    conv = {"conversations": [{"from": "human", "value": "tell me a long story now"}, {"from": "gpt", "value": "ok"}]}
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([conv] * 4))
    t = Timing(ttft=0.3, itl=0.05, reasoning=True)
    with timed_server(t) as url:
        r = run(_args("--base-url", url, "--backend", "openai-chat", "--dataset-name", "sharegpt", "--dataset-path",
                      str(path), "--num-prompts", "2", "--sharegpt-output-len", "5", "--goodput", "ttft:100"))
    assert r["completed"] == 2 and r["total_output_tokens"] == 10
    assert r["mean_ttft_ms"] == pytest.approx(300, abs=TOL_MS)
    assert r["mean_itl_ms"] == pytest.approx(50, abs=TOL_MS / 2) and r["mean_tpot_ms"] == pytest.approx(50, abs=TOL_MS / 2)
    assert r["request_goodput"] == 0.0


def test_latency_ends_at_the_last_token_not_at_done() -> None:
    """0.4 s between the last token and usage/[DONE] was counted in E2EL and TPOT."""
    t = Timing(ttft=0.2, itl=0.05, done_delay=0.4)
    with timed_server(t) as url:
        r = run(_args("--base-url", url, "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "6"))
    assert r["mean_e2el_ms"] == pytest.approx(200 + 5 * 50, abs=TOL_MS)
    assert r["mean_tpot_ms"] == pytest.approx(50, abs=TOL_MS / 4)
    assert r["latencies"] and all(x == pytest.approx(0.45, abs=TOL_MS / 1e3) for x in r["latencies"])


def test_no_usage_counts_tokens_with_the_tokenizer(word_tokenizer, capsys) -> None:
    """Chunks 2 and 5 carry 3 tokens: 10 tokens in 6 chunks, the last at 0.2 + 5 * 0.1 s."""
    t = Timing(ttft=0.2, itl=0.1, multi={2: 3, 5: 3}, usage=False)
    with timed_server(t) as url:
        r = run(_args("--base-url", url, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "10",
                      "--tokenizer", word_tokenizer))
    assert r["total_output_tokens"] == 20 and r["output_tokens_source"] == "tokenizer"
    assert r["mean_tpot_ms"] == pytest.approx(500 / 9, abs=TOL_MS / 4)
    assert "output_tokens_from=tokenizer" in capsys.readouterr().out
    t = Timing(ttft=0.0, itl=0.0, multi={2: 3, 5: 3}, usage=False)
    with timed_server(t) as url:
        r = run(_args("--base-url", url, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "10"))
    captured = capsys.readouterr()
    assert r["total_output_tokens"] == 12 and r["output_tokens_source"] == "chunks"  # no tokenizer: chunks, warned
    assert captured.err.count("reported no usage") == 1 and "--tokenizer" in captured.err


def test_error_null_chunks_succeed() -> None:
    t = Timing(ttft=0.0, itl=0.0, error_null=True)
    with timed_server(t) as url:
        r = run(_args("--base-url", url, "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "3"))
    assert r["completed"] == 3 and r["failed"] == 0 and r["total_output_tokens"] == 9


def test_stream_without_done_is_complete_and_timeouts_say_what() -> None:
    t = Timing(ttft=0.0, itl=0.0, done=False)
    with timed_server(t) as url:
        r = run(_args("--base-url", url, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "3"))
    assert r["completed"] == 2 and r["failed"] == 0
    t = Timing(ttft=0.0, itl=0.0, stall_from=1)  # the probe (index 0) answers; every measured request stalls
    with timed_server(t) as url:
        r = run(_args("--base-url", url, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "3",
                      "--request-timeout", "0.5"))
    assert r["failed"] == 2
    assert r["error_summary"] == ["TimeoutError: no complete response within --request-timeout 0.5 s"]


def test_poisson_schedule_is_rescaled_to_n_over_rate() -> None:
    for seed in range(5):
        for burstiness in (1.0, 0.5, 4.0):
            t = arrival_offsets(300, 50.0, burstiness, np.random.default_rng(seed))
            assert t[-1] == pytest.approx(300 / 50.0) and np.all(np.diff(t) >= 0) and t[0] > 0
    even = arrival_offsets(4, 2.0, float("inf"), np.random.default_rng(0))
    assert even.tolist() == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_offsets(3, float("inf"), 1.0, np.random.default_rng(0)).tolist() == [0.0, 0.0, 0.0]
    t = Timing(ttft=0.0, itl=0.0)
    with timed_server(t) as url:
        run(_args("--base-url", url, "--num-prompts", "20", "--request-rate", "40", "--random-input-len", "4",
                  "--random-output-len", "1", "--seed", "3"))
    want = arrival_offsets(20, 40.0, 1.0, np.random.default_rng(3))
    got = np.array(t.arrivals[1:]) - t.arrivals[1]
    assert got[-1] == pytest.approx(want[-1] - want[0], abs=0.05)  # the span the rescaled schedule gives


def test_saved_result_has_vllm_keys(tmp_path) -> None:
    t = Timing(ttft=0.01, itl=0.01)
    with timed_server(t) as url:
        r = run(_args("--base-url", url, "--num-prompts", "4", "--random-input-len", "4", "--random-output-len", "3",
                      "--save-result", str(tmp_path / "r.json"), "--save-detailed", "--label", "nightly",
                      "--max-concurrency", "2"))
    saved = json.loads((tmp_path / "r.json").read_text())
    vllm = ["date", "backend", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
            "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
            "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
            "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
            "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests", "mean_ttft_ms",
            "median_ttft_ms", "p99_ttft_ms"]
    assert [k for k in vllm if k not in saved] == []
    assert saved["model_id"] == "timed" and saved["backend"] == saved["endpoint_type"] == "openai"
    assert saved["label"] == "nightly" and saved["tokenizer_id"] is None
    assert saved["errors"] == [""] * 4 and saved["error_summary"] == []
    assert saved["generated_texts"] == ["w0 w1 w2 "] * 4 and saved["output_lens"] == [3] * 4
    assert saved["max_concurrent_requests"] == 2 and saved["max_output_tokens_per_s"] == 12.0
    assert len(saved["start_times"]) == 4 and all(0 <= s < r["duration"] for s in saved["start_times"])
    assert saved["e2els"] == saved["latencies"]  # the earlier name stays for existing readers


def test_vllm_flag_spellings_and_percentile_selection() -> None:
    t = Timing(ttft=0.0, itl=0.0)
    with timed_server(t) as url:
        r = run(_args("--base-url", url, "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "4",
                      "--prefix-repetition-suffix-len", "2", "--prefix-repetition-num-prefixes", "1",
                      "--prefix-repetition-output-len", "2", "--num-prompts", "3",
                      "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99.9"))
    assert r["dataset_name"] == "prefix-repetition" and r["completed"] == 3
    stats = {k for k in r if k.endswith("_ms") and k != "goodput_slos_ms"}
    assert stats == {f"{s}_{m}_ms" for m in ("ttft", "e2el") for s in ("mean", "median", "std", "p50", "p90", "p99.9")}
    assert all(b.get("ignore_eos") is None for b in t.bodies)  # ignore_eos is on by default only for random


def test_chat_sends_max_completion_tokens_and_random_ignores_eos(word_tokenizer) -> None:
    t = Timing(ttft=0.0, itl=0.0)
    with timed_server(t) as url:
        run(_args("--base-url", url, "--backend", "openai-chat", "--tokenizer", word_tokenizer, "--num-prompts", "2",
                  "--random-input-len", "4", "--random-output-len", "3"))
        run(_args("--base-url", url, "--num-prompts", "1", "--random-input-len", "4", "--random-output-len", "3",
                  "--no-ignore-eos"))
    chat = t.bodies[:3]
    assert all(b["max_completion_tokens"] == 3 and "max_tokens" not in b and b["ignore_eos"] is True for b in chat)
    assert all("ignore_eos" not in b and b["max_tokens"] == 3 for b in t.bodies[3:])
