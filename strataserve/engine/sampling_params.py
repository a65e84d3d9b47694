"""Sampling parameters, named and defaulted as vLLM's ``SamplingParams`` so a vLLM user switches by import."""
from __future__ import annotations

from dataclasses import dataclass, field

# Upper bound on top-N logprobs, like OpenAI's top_logprobs limit.
MAX_LOGPROBS = 20


def _fail(name: str, value: object, want: str) -> None:
    raise ValueError(f"{name}={value!r} is out of range: {want}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k. ``seed`` makes the request's samples depend only
    on (seed, position in the output), never on what else shares the batch. ``logprobs`` = N returns the chosen
    token's logprob plus the top N (0 = chosen only, None = none). ``stop`` strings are cut from the returned text
    unless ``include_stop_str_in_output``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Accept a single stop string / tuple like vLLM does; store lists so msgspec round-trips them.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        elif not isinstance(self.stop, list):
            object.__setattr__(self, "stop", list(self.stop or []))
        if not isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.n < 1:
            _fail("n", self.n, "must be >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            _fail("temperature", self.temperature, "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            _fail("top_k", self.top_k, "must be -1 (disabled), 0 (disabled) or a positive count")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _fail("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _fail("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            _fail("repetition_penalty", self.repetition_penalty, "must be in (0, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            _fail("min_tokens", self.min_tokens, "must be >= 0 and <= max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _fail("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        if any(not s for s in self.stop):
            _fail("stop", self.stop, "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
