"""What ``strata bench serve`` sends and when: the measured requests, the probe / warm-up requests, arrival times.

Warm-ups must not touch the measured prompts: a server with a prefix cache would then answer those from cache and
the measured TTFT would look many times better than it is. So the probe and the warm-ups get their own prompts of
the same shape: the random datasets drawn with a seed derived from ``--seed`` (no prefix in common, the shared
``--random-prefix-len`` prefix included), ShareGPT from conversations after the measured ones.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import time
from typing import Any, AsyncIterator

import numpy as np
from rich.console import Console

from strataserve.bench import datasets as ds
from strataserve.bench.client import is_chat

CHAT_ENDPOINT = "/v1/chat/completions"


def endpoint_of(args: argparse.Namespace) -> str:
    if args.endpoint:
        return args.endpoint
    return CHAT_ENDPOINT if args.backend == "openai-chat" else "/v1/completions"


def warmup_seed(seed: int) -> int:
    """A seed no user would pick by hand, derived from ``seed``: its prompts share nothing with the measured ones,
    nor with the measured prompts of a later run at ``seed + 1``."""
    return int(np.random.SeedSequence([seed, 0x5741524D]).generate_state(1, np.uint64)[0])


def _draw(args: argparse.Namespace, tokenizer: Any, count: int, seed: int, extra: int = 0) -> list[ds.SampleRequest]:
    vocab = args.random_vocab_size or (len(tokenizer) if tokenizer is not None else 1000)
    special = set(tokenizer.all_special_ids) if tokenizer is not None else set()
    if args.dataset_name == "random":
        return ds.random_requests(count, args.random_input_len, args.random_output_len, args.random_range_ratio, vocab,
                                  seed, special, prefix_len=args.random_prefix_len)
    if args.dataset_name == "prefix-repetition":
        return ds.prefix_repetition_requests(
            count, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, vocab, seed, special,
        )
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
    return ds.sharegpt_requests(args.dataset_path, count, seed, tokenizer, args.sharegpt_output_len, extra=extra)


def _as_text(args: argparse.Namespace, tokenizer: Any, samples: list[ds.SampleRequest]) -> list[ds.SampleRequest]:
    """Token prompts become text when the endpoint (chat) or --prompt-format asks for it."""
    endpoint = endpoint_of(args)
    chat = is_chat(endpoint)
    if chat and args.prompt_format == "ids":
        raise ValueError(f"--prompt-format ids: {endpoint} takes text messages; use auto or text")
    want_text = args.prompt_format == "text" or (args.prompt_format == "auto" and chat)
    if want_text and samples and not isinstance(samples[0].prompt, str):
        if tokenizer is None:
            raise ValueError(f"text prompts are needed: pass --tokenizer to decode the {args.dataset_name} token prompts")
        samples = [ds.SampleRequest(tokenizer.decode(s.prompt), s.prompt_len, s.expected_output_len) for s in samples]
    return samples


def load_samples(args: argparse.Namespace, tokenizer: Any, count: int) -> list[ds.SampleRequest]:
    """``count`` measured requests of the chosen dataset."""
    return _as_text(args, tokenizer, _draw(args, tokenizer, count, args.seed))


def load_workload(
    args: argparse.Namespace, tokenizer: Any, console: Console | None = None
) -> tuple[list[ds.SampleRequest], list[ds.SampleRequest]]:
    """(measured requests, at least one probe / warm-up request that shares no prompt with them)."""
    n, w = args.num_prompts, max(1, args.num_warmups)
    if args.dataset_name != "sharegpt":
        return load_samples(args, tokenizer, n), _as_text(args, tokenizer, _draw(args, tokenizer, w, warmup_seed(args.seed)))
    drawn = _as_text(args, tokenizer, _draw(args, tokenizer, n, args.seed, extra=w))
    measured, spare = drawn[:n], drawn[n:]
    if not spare:  # every usable conversation is measured: nothing else of the same shape to warm up with
        (console or Console(stderr=True)).print(
            "[yellow]warning:[/] the ShareGPT file has no usable conversation beyond --num-prompts, so the probe"
            f"{' and warm-ups reuse' if args.num_warmups else ' reuses'} the first measured prompt (a prefix cache"
            " will favour it); lower --num-prompts to avoid this")
        spare = measured[:1]
    return measured, spare


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start, as vLLM's ``get_request``: one gamma gap (shape ``burstiness``, mean
    1/rate; constant for ``burstiness`` inf) before each request, cumulated, then rescaled so the last arrival is at
    exactly n/rate, so the offered load does not depend on the seed. All zeros for an infinite rate."""
    if not math.isfinite(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return times * (n / rate / times[-1]) if times[-1] > 0 else times


async def arrivals(offsets: np.ndarray) -> AsyncIterator[int]:
    """Yield 0..n-1 at ``offsets``; sleeps to absolute targets so loop lag does not accumulate."""
    start = time.perf_counter()
    for i, target in enumerate(offsets.tolist()):
        delay = start + target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield i
