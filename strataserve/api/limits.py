"""Operator limits on what one OpenAI request may ask for, checked at the door before any tokenising.

Each limit answers 400 naming the field, the value and the limit, so a client knows what to change. Defaults
are generous (a normal client never meets them) but bounded, so no single request can pin the engine or the
detokeniser: e.g. 10,000 stop strings would be searched after every token.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from strataserve.api.errors import bad_request
from strataserve.api.protocol import MAX_N


class Capped(int):
    """A ``max_tokens`` the server filled in for a request that set none: its limit. ``resolve_max_tokens`` reads
    it as "at most this" (the rest of the context when less), never as a request it must refuse."""


# the output budget fields of the chat and completions routes (an unset budget is filled in the last one);
# /v1/responses echoes its max_output_tokens in the response, so it keeps its own check (responses.py)
_BUDGET_FIELDS = ("max_completion_tokens", "max_tokens")


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = MAX_N
    max_tokens: int | None = None  # None: the context length is the only bound
    max_prompt_tokens: int | None = None
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # length of one stop string
    max_logit_bias: int = 300  # entries, OpenAI's own bound

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and v < 1:
                raise ValueError(f"{f.name}={v}: must be >= 1")

    def default_max_tokens(self, value: int | None) -> int | None:
        """The output budget of a request that set none (``value``: the default it would get, None for the rest of
        the context), held to the limit: an unset or null max_tokens must not get past it (vLLM's
        ``--max-tokens``-like caps clamp the default; only an explicit larger value is refused)."""
        if self.max_tokens is None:
            return value
        return Capped(self.max_tokens) if value is None else min(value, self.max_tokens)

    def check(self, body: Any) -> None:
        """The body's n, max_tokens, stop strings and logit_bias against the limits. A body that sets no output
        budget gets the limit as its budget (a ``Capped`` value), so the routes stop there; a protocol default above
        the limit (a field the client left out: ``model_fields_set``) is lowered to it, never refused."""
        if body.n > self.max_n:
            raise bad_request(f"n={body.n} is above this server's limit of {self.max_n}", param="n",
                              code="limit_exceeded")
        present = [name for name in _BUDGET_FIELDS if hasattr(body, name)]
        given = getattr(body, "model_fields_set", None)  # None (a plain object): every field is the client's
        for name in present:
            v = getattr(body, name)
            if v is None or self.max_tokens is None or v <= self.max_tokens:
                continue
            if given is not None and name not in given:
                # the protocol's default (completions' 16), not the client's: held to the limit like an unset one
                setattr(body, name, self.max_tokens)
                continue
            raise bad_request(f"{name}={v} is above this server's limit of {self.max_tokens}", param=name,
                              code="limit_exceeded")
        if present and all(getattr(body, name) is None for name in present):
            setattr(body, present[-1], self.default_max_tokens(None))
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > self.max_stop:
            raise bad_request(f"{len(stops)} stop strings given; this server allows at most {self.max_stop}",
                              param="stop", code="limit_exceeded")
        for s in stops:
            if len(s) > self.max_stop_chars:
                raise bad_request(f"a stop string of {len(s)} characters is longer than this server's limit of "
                                  f"{self.max_stop_chars}", param="stop", code="limit_exceeded")
        if body.logit_bias and len(body.logit_bias) > self.max_logit_bias:
            raise bad_request(f"logit_bias has {len(body.logit_bias)} entries; this server allows at most "
                              f"{self.max_logit_bias}", param="logit_bias", code="limit_exceeded")

    def check_prompt(self, num_tokens: int) -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise bad_request(f"the prompt has {num_tokens} tokens, above this server's limit of "
                              f"{self.max_prompt_tokens}; shorten it", param="prompt", code="limit_exceeded")
