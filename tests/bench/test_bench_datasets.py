"""Bench request sets: lengths, determinism in the seed, ShareGPT parsing and filtering."""
from __future__ import annotations

import json
import math

import pytest

from strataserve.bench.datasets import prefix_repetition_requests, random_requests, sharegpt_requests


def test_random_lengths_ranges_and_ids() -> None:
    reqs = random_requests(400, input_len=100, output_len=20, range_ratio=0.5, vocab_size=50, seed=3, special_ids={0, 1})
    assert len(reqs) == 400
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 50 <= r.prompt_len <= 150 and 10 <= r.expected_output_len <= 30
        assert all(2 <= t < 50 for t in r.prompt)
    ins = [r.prompt_len for r in reqs]
    assert min(ins) <= 55 and max(ins) >= 145  # the whole range is used
    assert abs(sum(ins) / len(ins) - 100) < 5


def test_random_fixed_lengths_and_seeds() -> None:
    a = random_requests(5, 7, 3, vocab_size=1000, seed=1)
    assert [(r.prompt_len, r.expected_output_len) for r in a] == [(7, 3)] * 5
    assert a == random_requests(5, 7, 3, vocab_size=1000, seed=1)
    assert a != random_requests(5, 7, 3, vocab_size=1000, seed=2)


@pytest.mark.parametrize("kwargs", [{"range_ratio": 1.0}, {"range_ratio": -0.1}, {"input_len": 0}])
def test_random_bad_values(kwargs: dict) -> None:
    args = {"num_prompts": 2, "input_len": 8, "output_len": 4, **kwargs}
    with pytest.raises(ValueError):
        random_requests(**args)


def test_prefix_repetition_shares_prefixes() -> None:
    reqs = prefix_repetition_requests(12, prefix_len=6, suffix_len=4, num_prefixes=3, output_len=5, vocab_size=10_000, seed=0)
    assert len(reqs) == 12
    assert all(r.prompt_len == len(r.prompt) == 10 and r.expected_output_len == 5 for r in reqs)
    prefixes = [tuple(r.prompt[:6]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({tuple(r.prompt[6:]) for r in reqs}) == 12  # suffixes differ
    assert prefixes != [p for p in dict.fromkeys(prefixes) for _ in range(4)]  # shuffled, not grouped
    assert reqs == prefix_repetition_requests(12, 6, 4, 3, 5, vocab_size=10_000, seed=0)


class WordTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split())))

    def decode(self, ids: list[int]) -> str:
        return " ".join("w" for _ in ids)


def _conv(human: str, gpt: str) -> dict:
    return {"id": "x", "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


def test_sharegpt_parsing_and_filters(tmp_path) -> None:
    words = lambda n: " ".join(["word"] * n)  # noqa: E731
    data = [
        _conv(words(10), words(20)),
        _conv(words(2), words(20)),  # prompt too short
        _conv(words(10), words(3)),  # reply too short
        _conv(words(2000), words(10)),  # prompt too long
        {"id": "y", "conversations": [{"from": "human", "value": words(8)}]},  # one turn
        _conv(words(5), words(6)),
        "garbage",
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(path, 2, seed=0, tokenizer=WordTokenizer())
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(5, 6), (10, 20)]
    assert all(isinstance(r.prompt, str) for r in reqs)
    fixed = sharegpt_requests(path, 3, seed=0, tokenizer=WordTokenizer(), output_len=7)
    assert all(r.expected_output_len == 7 for r in fixed)
    # an output-length override lifts only the reply's minimum (vLLM): the 2-word prompt stays out
    assert sorted(r.prompt_len for r in fixed) == [5, 10, 10]
    with pytest.raises(ValueError, match="only 3 usable"):
        sharegpt_requests(path, 4, seed=0, tokenizer=WordTokenizer(), output_len=7)
    est = sharegpt_requests(path, 2, seed=0)  # no tokenizer: ~4 characters per token
    assert {r.prompt_len for r in est} == {math.floor(len(words(10)) / 4 + 0.5), round(len(words(5)) / 4)}
    with pytest.raises(ValueError, match="only 2 usable"):
        sharegpt_requests(path, 3, tokenizer=WordTokenizer())


def test_sharegpt_extra_follows_the_measured(tmp_path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([_conv(f"prompt number {i} here", "a b c d e") for i in range(6)]))
    base = sharegpt_requests(path, 3, seed=1, tokenizer=WordTokenizer())
    more = sharegpt_requests(path, 3, seed=1, tokenizer=WordTokenizer(), extra=2)
    assert more[:3] == base and len(more) == 5 and not {r.prompt for r in more[3:]} & {r.prompt for r in base}
    assert len(sharegpt_requests(path, 5, seed=1, tokenizer=WordTokenizer(), extra=4)) == 6  # extra: up to


def test_sharegpt_string_turns_name_the_record(tmp_path) -> None:
    """Turns given as plain strings crashed with a raw AttributeError."""
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([_conv("a b c d e", "f g h i j"), {"id": "r7", "conversations": ["hello there", "hi"]}]))
    with pytest.raises(ValueError, match=r"record 1 \(id 'r7'\).*must be an object.*got str"):
        sharegpt_requests(path, 1, tokenizer=WordTokenizer())


def test_random_prefix_len_and_vllm_range_rounding() -> None:
    reqs = random_requests(50, input_len=6, output_len=3, range_ratio=0.5, vocab_size=500, seed=2, prefix_len=16)
    assert len({tuple(r.prompt[:16]) for r in reqs}) == 1  # one shared prefix
    assert len({tuple(r.prompt[16:19]) for r in reqs}) == 50
    assert all(r.prompt_len == len(r.prompt) and 16 + 3 <= r.prompt_len <= 16 + 9 for r in reqs)
    # vLLM's bounds: [floor(3 * 0.5), ceil(3 * 1.5)] = [1, 5]
    outs = [r.expected_output_len for r in random_requests(400, 6, 3, 0.5, 500, seed=0)]
    assert min(outs) == 1 and max(outs) == 5
    # prefix 0 draws exactly what it drew before the option existed
    assert random_requests(5, 7, 3, vocab_size=1000, seed=1, prefix_len=0) == random_requests(5, 7, 3, vocab_size=1000, seed=1)
    with pytest.raises(ValueError, match="random-prefix-len"):
        random_requests(1, 4, 2, prefix_len=-1)


def test_sharegpt_bad_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        sharegpt_requests(tmp_path / "missing.json", 1)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        sharegpt_requests(bad, 1)
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_requests(bad, 1)


def test_bench_tokenizer_from_model_folder(tmp_path) -> None:
    from strataserve.assets import DEMO_MODEL_DIR
    from strataserve.bench.tokenizer import load_tokenizer

    tok = load_tokenizer(DEMO_MODEL_DIR)
    specials = set(tok.all_special_ids)
    assert specials and len(tok) > max(specials)
    ids = tok.encode("hello world", add_special_tokens=False)
    assert ids and tok.decode(ids).strip() == "hello world"
    reqs = random_requests(20, 30, 2, vocab_size=len(tok), seed=0, special_ids=specials)
    assert not specials & {t for r in reqs for t in r.prompt}
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)
