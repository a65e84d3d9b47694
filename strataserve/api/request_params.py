"""A generation request's fields as the engine takes them: token ids checked against the vocabulary, the prompt
truncated and fitted to the context, ``max_tokens`` resolved, and the SamplingParams (the checkpoint's defaults
for what the request leaves unset). Every refusal is a 400 naming the field."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strataserve.api.errors import bad_request, from_value_error
from strataserve.api.limits import Capped
from strataserve.types.sampling import RequestOutputKind, SamplingParams, truncate_prompt

if TYPE_CHECKING:
    from strataserve.api.serving import ServerState


def check_token_ids(state: ServerState, ids: list[int], param: str = "prompt") -> None:
    vocab = state.vocab_size
    for t in ids:
        if t < 0 or (vocab is not None and t >= vocab):
            raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab})", param=param)


def vllm_extras(state: ServerState, body: Any) -> dict[str, Any]:
    """SamplingParams fields of vLLM's ``allowed_token_ids`` / ``bad_words``, checked now (a stream would
    otherwise report them after its 200)."""
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:
            raise bad_request("allowed_token_ids is empty: give the token ids to sample from",
                              param="allowed_token_ids")
        check_token_ids(state, body.allowed_token_ids, "allowed_token_ids")
    if body.bad_words and state.tokenizer is None:
        raise bad_request("bad_words need a tokenizer; this server has none (--skip-tokenizer-init): ban token ids "
                          "with logit_bias", param="bad_words")
    return {"allowed_token_ids": body.allowed_token_ids, "bad_words": body.bad_words or None}


def truncated(state: ServerState, ids: list[int], keep: int | None, param: str = "truncate_prompt_tokens"
              ) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (done here, so usage counts them)."""
    if keep is None:
        return ids
    if keep < 1 and keep != -1:
        raise bad_request(f"truncate_prompt_tokens={keep}: must be >= 1, or -1 for max_model_len", param=param)
    try:
        return truncate_prompt(ids, keep, state.max_model_len)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


def resolve_max_tokens(state: ServerState, num_prompt: int, max_tokens: int | None, param: str,
                       prompt_param: str = "prompt") -> int:
    """Check the prompt fits the context (and the whole KV cache) and return the output budget, by vLLM's
    ``get_max_tokens`` rule: a request's value as given (a 400 when it does not fit); an unset one (``None``) the
    checkpoint's ``max_new_tokens`` (generation_config.json), else the rest of the context, whichever is less. The
    checkpoint's value is a default only, never a ceiling on a value the request gave (vLLM #34063). A ``Capped``
    budget (``--limit-max-tokens`` standing in for an unset one) is unset too, with the limit as one more bound.
    ``prompt_param``: the field the prompt came in (chat's is ``messages``), named in the errors."""
    if num_prompt == 0:
        raise bad_request("the prompt is empty: give at least one token", param=prompt_param)
    limit = state.max_model_len
    if num_prompt >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but the prompt has {num_prompt} "
                          "tokens; shorten the prompt.", param=prompt_param, code="context_length_exceeded")
    pool = getattr(state, "max_pool_tokens", None)  # a duck-typed state (tests, tools) may not say
    if pool is not None and num_prompt > pool:  # else the engine refuses it, and a stream's 200 has gone out
        raise bad_request(f"the prompt has {num_prompt} tokens but this server's whole KV cache holds {pool}: "
                          "shorten the prompt (or start the server with more KV cache memory).",
                          param=prompt_param, code="context_length_exceeded")
    if max_tokens is None or isinstance(max_tokens, Capped):
        bounds = (limit - num_prompt, state.sampling_defaults.get("max_tokens"), max_tokens)
        return int(min(b for b in bounds if b is not None))  # a plain int: msgpack / msgspec refuse int subclasses
    if max_tokens < 1:
        raise bad_request(f"{param}={max_tokens} is out of range: must be >= 1", param=param)
    if num_prompt + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has {num_prompt} and "
                          f"{param} asks for {max_tokens} more. Set {param} to at most {limit - num_prompt}.",
                          param=param, code="context_length_exceeded")
    return max_tokens


def check_prompt_logprobs(body: Any) -> None:
    """vLLM's ``prompt_logprobs`` (completions and chat) come whole in a response body, never in a stream: a 400
    now, before the stream's 200. Their range is SamplingParams' check (``make_params``)."""
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs are not returned in streams (as in vLLM): use stream=false",
                          param="prompt_logprobs")


def make_params(defaults: dict[str, Any] | None = None, **kwargs: Any) -> SamplingParams:
    """SamplingParams from request fields; one left ``None`` takes ``defaults`` (the checkpoint's), else
    SamplingParams' default. Range errors become 400s."""
    merged: dict[str, Any] = {"output_kind": RequestOutputKind.DELTA, **(defaults or {})}  # streams send what is new
    merged.update((k, v) for k, v in kwargs.items() if v is not None)
    try:
        return SamplingParams(**merged)
    except ValueError as exc:
        raise from_value_error(exc) from None
