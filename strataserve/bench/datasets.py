"""Request sets for ``strata bench serve``: random token prompts, shared-prefix prompts, ShareGPT conversations.

Every generator is deterministic in its ``seed``. Random prompts are token-id lists (``/v1/completions`` accepts a
list of ints as ``prompt``, as in vLLM), so their lengths are exact; with a tokenizer they can be decoded to text
for endpoints that need text (chat).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    """The subset of a HF tokenizer the datasets use."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int  # exact for token-id prompts and tokenised text; an estimate otherwise
    expected_output_len: int


def _lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Integers uniform in [floor(mean * (1 - ratio)), ceil(mean * (1 + ratio))], at least 1: vLLM's rounding, so
    ``mean=3, ratio=0.5`` draws from [1, 5]."""
    if mean < 1:
        raise ValueError(f"length {mean} must be >= 1")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio={ratio} must be in [0, 1)")
    low = max(1, math.floor(mean * (1 - ratio)))
    high = max(low, math.ceil(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _token_pool(vocab_size: int, special_ids: set[int]) -> np.ndarray:
    pool = np.array([t for t in range(vocab_size) if t not in special_ids], dtype=np.int64)
    if pool.size == 0:
        raise ValueError(f"no usable token ids below vocab size {vocab_size}")
    return pool


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 1000,
    seed: int = 0,
    special_ids: set[int] = frozenset(),  # type: ignore[assignment]
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """Prompts of uniformly random token ids (special ids excluded); lengths drawn around the given means.

    ``prefix_len`` > 0 puts one random prefix of that many tokens before every prompt (vLLM's
    ``--random-prefix-len``): the prompt is ``prefix_len`` + the drawn input length tokens."""
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len={prefix_len} must be >= 0")
    rng = np.random.default_rng(seed)
    pool = _token_pool(vocab_size, set(special_ids))
    in_lens = _lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = _lengths(output_len, range_ratio, num_prompts, rng)
    prefix = rng.choice(pool, size=prefix_len).tolist() if prefix_len else []  # drawn after: prefix 0 changes nothing
    return [
        SampleRequest(prefix + rng.choice(pool, size=int(n)).tolist(), prefix_len + int(n), int(m))
        for n, m in zip(in_lens, out_lens)
    ]


def prefix_repetition_requests(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab_size: int = 1000,
    seed: int = 0,
    special_ids: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[SampleRequest]:
    """``num_prefixes`` random prefixes shared round-robin by the prompts, each followed by its own random suffix;
    the order is shuffled so requests sharing a prefix interleave. Exercises a server's prefix cache."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError("prefix-repetition needs num_prefixes >= 1, prefix_len + suffix_len >= 1, output_len >= 1")
    rng = np.random.default_rng(seed)
    pool = _token_pool(vocab_size, set(special_ids))
    prefixes = [rng.choice(pool, size=prefix_len).tolist() for _ in range(num_prefixes)]
    reqs = [
        SampleRequest(prefixes[i % num_prefixes] + rng.choice(pool, size=suffix_len).tolist(), prefix_len + suffix_len, output_len)
        for i in range(num_prompts)
    ]
    order = rng.permutation(num_prompts)
    return [reqs[i] for i in order]


def _estimate_tokens(text: str) -> int:
    """Without a tokenizer: ~4 characters per token, the usual rule of thumb for English BPE vocabularies."""
    return max(1, round(len(text) / 4))


def sharegpt_requests(
    path: str | Path,
    num_prompts: int,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    extra: int = 0,
) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's length as the expected output length (``output_len`` overrides).

    Like vLLM's sampler it skips conversations with fewer than two turns, prompts under 4 tokens, replies under 4
    tokens (unless ``output_len`` is given), prompts over ``max_prompt_len`` and pairs over ``max_total_len``.
    Lengths come from ``tokenizer`` when given. Up to ``extra`` more usable conversations follow the first
    ``num_prompts`` (the bench's warm-ups); the first ``num_prompts`` do not depend on ``extra``.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--dataset-path {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not JSON ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of {{'conversations': [...]}} entries")
    pairs = []
    for index, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not isinstance(turns[0], dict) or not isinstance(turns[1], dict):
            name = f" (id {entry['id']!r})" if "id" in entry else ""
            raise ValueError(f"--dataset-path {path}: record {index}{name}: each turn of 'conversations' must be an "
                             f"object like {{'from': 'human', 'value': '...'}}, got {type(turns[0]).__name__}")
        prompt, reply = turns[0].get("value"), turns[1].get("value")
        if isinstance(prompt, str) and isinstance(reply, str):
            pairs.append((prompt, reply))
    count = (lambda s: len(tokenizer.encode(s, add_special_tokens=False))) if tokenizer else _estimate_tokens
    rng = np.random.default_rng(seed)
    out: list[SampleRequest] = []
    for i in rng.permutation(len(pairs)):
        prompt, reply = pairs[i]
        p_len = count(prompt)
        r_len = output_len if output_len is not None else count(reply)
        # as vLLM's is_valid_sequence: an output-length override skips only the reply's minimum
        if p_len < 4 or (output_len is None and r_len < 4):
            continue
        if p_len > max_prompt_len or p_len + r_len > max_total_len:
            continue
        out.append(SampleRequest(prompt, p_len, r_len))
        if len(out) == num_prompts + extra:
            break
    if len(out) < num_prompts:
        raise ValueError(f"--dataset-path {path} has only {len(out)} usable conversations; lower --num-prompts")
    return out
