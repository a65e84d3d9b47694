"""Front-end validation: turns a user prompt + SamplingParams into token ids the engine core will accept.

Shared by the offline ``LLMEngine`` and the async ``AsyncLLM`` so both reject the same inputs with the same
messages. Limits come from the core (``max_model_len``, KV pool size). Policy, as vLLM: a prompt that leaves no
room for one output token is rejected; ``max_tokens`` beyond what is left of ``max_model_len`` is clipped (the
completion then ends with finish_reason "length").
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from strataserve.engine.request import check_prompt_length
from strataserve.types.sampling import SamplingParams, token_id, truncate_prompt
from strataserve.grammar import check_guided

PromptType = str | Sequence[int] | Mapping[str, Any]


def as_tokenizer(tokenizer: Any) -> Any:
    """Accept a strataserve ``Tokenizer`` or a bare HF tokenizer; return a strataserve ``Tokenizer``."""
    from strataserve.models.tokenizer import Tokenizer

    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    eos = getattr(tokenizer, "eos_token_id", None)
    return Tokenizer(tokenizer, () if eos is None else (int(eos),))


def load_tokenizer(model_dir: str, skip: bool = False) -> Any:
    """The checkpoint's tokenizer, or None when ``skip`` (``skip_tokenizer_init``)."""
    from strataserve.models.tokenizer import Tokenizer

    return None if skip else Tokenizer.from_pretrained(model_dir)


def model_config_or_none(model_dir: str) -> Any:
    """The checkpoint's ``DecoderConfig`` (vocab_size = embedding rows, often more than the tokenizer's ids; eos
    ids without a tokenizer), or None when the folder has no readable config (engines over fake runners)."""
    from strataserve.models.hf_config import load_decoder_config

    try:
        return load_decoder_config(model_dir)
    except (ValueError, OSError):
        return None


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, max_pool_tokens: int, model_config: Any = None) -> None:
        self.tokenizer = tokenizer  # strataserve Tokenizer (or None: token-id prompts only)
        self.max_model_len = max_model_len
        self.max_pool_tokens = max_pool_tokens
        eos = tuple(tokenizer.eos_token_ids if tokenizer is not None else getattr(model_config, "eos_token_ids", ()))
        self.eos_token_id: int | None = eos[0] if eos else None
        self._extra_eos = list(eos[1:])  # generation_config may list several; the rest act as stop tokens
        # valid prompt ids: the model's embedding rows (config.json) when known, else the tokenizer's ids
        self.vocab_size = (getattr(model_config, "vocab_size", None)
                       or (tokenizer.vocab_size if tokenizer is not None else None))

    def process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """Return (prompt text or None, prompt token ids, params to send). Raises ValueError on bad input."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        params = replace(params)  # a snapshot, checked again: a SamplingParams may have been changed since it was made
        text, ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        self._check_vocab_params(params)
        if params.bad_words and params.bad_words_token_ids is None:
            params = replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))
        check_guided(params.guided_decoding)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (this engine skipped it): use stop_token_ids")
        check_prompt_length(len(ids), self.max_model_len, self.max_pool_tokens)
        if self._extra_eos and not params.ignore_eos:
            extra = [t for t in self._extra_eos if t not in params.stop_token_ids]
            if extra:
                params = replace(params, stop_token_ids=list(params.stop_token_ids) + extra)
        return text, ids, params

    def _check_vocab_params(self, params: SamplingParams) -> None:
        """Token ids a request names must exist (vLLM refuses them too; a bias on a missing id did nothing)."""
        if self.vocab_size is None:
            return
        for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in ids or () if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is out of range: ids must be in [0, {self.vocab_size})")

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give prompt token ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(str(prompt["prompt"]))
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, Sequence):
            return None, self._check_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        try:
            out = [token_id("prompt_token_ids", t) for t in ids]
        except TypeError:
            raise ValueError("prompt_token_ids must be a list of integers") from None
        if out and (min(out) < 0 or (self.vocab_size is not None and max(out) >= self.vocab_size)):
            bad = min(out) if min(out) < 0 else max(out)
            raise ValueError(f"prompt token id {bad} is out of range: ids must be in [0, {self.vocab_size})")
        return out


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Each word as the tokenizer writes it at the start of the text and after a space (vLLM's rule: the spaced
    form is kept when it is a different word token of the same length)."""
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer (this engine skipped it): use logit_bias to ban token ids")
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if bare:
            out.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out
