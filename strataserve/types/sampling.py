"""Sampling parameters, named and defaulted as vLLM's ``SamplingParams`` so a vLLM user switches by import."""
from __future__ import annotations

import copy
import enum
import json
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any

# Upper bound on top-N logprobs, like OpenAI's top_logprobs limit.
MAX_LOGPROBS = 20


def _fail(name: str, value: object, want: str) -> None:
    raise ValueError(f"{name}={value!r} is out of range: {want}")


def token_id(name: str, value: object) -> int:
    """An integer token id (numpy / torch integers too); a float or bool is refused, not truncated."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    _fail(name, value, "token ids are integers")
    raise AssertionError  # unreachable: _fail raises


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class GuidedDecodingParams:
    """One output constraint (vLLM's ``GuidedDecodingParams`` / ``StructuredOutputsParams``): exactly one of a JSON
    schema, a regex, a list of choices, an EBNF grammar, or any JSON object. ``json`` may be given as a dict; it is
    kept as canonical JSON text so equal schemas share one compiled grammar and the params stay msgspec-encodable.
    """

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.dumps(self.json))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"guided json schema is not JSON-serialisable: {exc}") from None
        if self.choice is not None:
            object.__setattr__(self, "choice", [str(c) for c in self.choice])
            if not self.choice:
                _fail("choice", self.choice, "give at least one choice")
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"guided decoding takes exactly one of json, regex, choice, grammar, json_object; got "
                             f"{', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"


#: vLLM's newer name for the same thing
StructuredOutputsParams = GuidedDecodingParams


def _logit_bias(bias: dict) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON strings or ints) as {int id: float}, each id and bias checked."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, str) else token_id("logit_bias", key)
        except ValueError:
            _fail("logit_bias", key, "keys must be token ids (integers)")
        if token < 0:
            _fail("logit_bias", key, "token ids must be >= 0")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            _fail(f"logit_bias[{key}]", value, "must be a number in [-100, 100]")
        out[token] = float(value)
    return out


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k. ``seed`` makes the request's samples depend only
    on (seed, position in the output), never on what else shares the batch. ``logprobs`` = N returns the chosen
    token's logprob plus the top N (0 = chosen only, None = none). ``stop`` strings are cut from the returned text
    unless ``include_stop_str_in_output``. ``logit_bias`` {token id: bias in [-100, 100]} is added to those logits
    before penalties and sampling (OpenAI's parameter; -100 in effect bans a token, +100 forces it).
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
    #: constrain the output with a grammar (``structured_outputs`` is accepted as vLLM's newer name)
    guided_decoding: GuidedDecodingParams | None = None
    #: logprobs of every prompt token after the first (top N; 0 = the prompt token's own only)
    prompt_logprobs: int | None = None
    structured_outputs: GuidedDecodingParams | None = None
    logit_bias: dict[int, float] | None = None
    #: what ``AsyncLLM.generate`` yields (vLLM's): the text so far (CUMULATIVE), only what is new (DELTA, the
    #: server's), or the finished output alone (FINAL_ONLY)
    output_kind: RequestOutputKind = field(default_factory=lambda: RequestOutputKind.CUMULATIVE)
    #: vLLM's: sample only among these token ids
    allowed_token_ids: list[int] | None = None
    #: vLLM's: words never to write. Each is tokenized with and without a leading space; a word of several tokens
    #: is banned at its last token when the output ends with the others
    bad_words: list[str] | None = None
    #: vLLM's: keep only the last k prompt tokens (-1: as many as max_model_len allows)
    truncate_prompt_tokens: int | None = None
    #: ``bad_words`` as token-id sequences; the front end fills it in from the tokenizer
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed",
                     "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                _fail(name, value, "must be an integer")  # else a 2.5 failed deep in the sampler, or rounded
            if value is not None and not isinstance(value, int):
                object.__setattr__(self, name, int(value))  # numpy integers: plain ints, as msgspec sends them
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
            except ValueError:
                _fail("output_kind", self.output_kind, "must be cumulative, delta or final_only")
        # Accept a single stop string / tuple like vLLM does; store lists so msgspec round-trips them.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        elif not isinstance(self.stop, list):
            object.__setattr__(self, "stop", list(self.stop or []))
        if any(not isinstance(s, str) for s in self.stop):
            _fail("stop", self.stop, "stop strings are text (token ids go in stop_token_ids)")
        object.__setattr__(self, "stop_token_ids", [token_id("stop_token_ids", t) for t in self.stop_token_ids or []])
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                _fail(name, value, "must be a number")
            object.__setattr__(self, name, float(value))
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
        if self.structured_outputs is not None:
            if self.guided_decoding is not None and self.guided_decoding != self.structured_outputs:
                raise ValueError("give guided_decoding or structured_outputs, not both")
            object.__setattr__(self, "guided_decoding", self.structured_outputs)
            object.__setattr__(self, "structured_outputs", None)
        if isinstance(self.guided_decoding, dict):
            object.__setattr__(self, "guided_decoding", GuidedDecodingParams(**self.guided_decoding))
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            _fail("prompt_logprobs", self.prompt_logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        if any(not s for s in self.stop):
            _fail("stop", self.stop, "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "token ids must be >= 0")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias) or None)
        self._check_vllm_extras()

    def _check_vllm_extras(self) -> None:
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in ids):
                _fail("allowed_token_ids", self.allowed_token_ids, "must be a non-empty list of token ids (>= 0)")
            object.__setattr__(self, "allowed_token_ids", [int(t) for t in ids])
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            if any(not isinstance(w, str) or not w.strip() for w in words):
                _fail("bad_words", self.bad_words, "must be a list of non-empty strings")
            object.__setattr__(self, "bad_words", words or None)
        t = self.truncate_prompt_tokens
        if t is not None and t < 1 and t != -1:
            _fail("truncate_prompt_tokens", t, "must be >= 1, or -1 for max_model_len")
        if self.bad_words_token_ids is not None:
            object.__setattr__(self, "bad_words_token_ids", [list(map(int, w)) for w in self.bad_words_token_ids])

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's): change it without touching this one."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def truncate_prompt(ids: list[int], keep: int, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` prompt tokens (-1: the last ``max_model_len``)."""
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} is more than the model's context ({max_model_len} tokens): "
                         f"give at most {max_model_len}, or -1")
    return ids[-keep:]
