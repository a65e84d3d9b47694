"""--limit-max-tokens holds a request that sets no output budget (unset or null) to the limit: RequestLimits.check
fills in a Capped budget and resolve_max_tokens reads it as an upper bound, never as a request to refuse."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from strataserve.api.errors import APIError
from strataserve.api.limits import Capped, RequestLimits
from strataserve.api.request_params import resolve_max_tokens


def _state(max_model_len: int = 100, **defaults) -> SimpleNamespace:
    return SimpleNamespace(max_model_len=max_model_len, sampling_defaults=defaults)


def test_an_unset_budget_becomes_the_limit_on_each_route_shape():
    limits = RequestLimits(max_tokens=20)
    chat = SimpleNamespace(n=1, max_tokens=None, max_completion_tokens=None, stop=None, logit_bias=None)
    limits.check(chat)
    assert chat.max_tokens == 20 and isinstance(chat.max_tokens, Capped) and chat.max_completion_tokens is None
    completions = SimpleNamespace(n=1, max_tokens=None, stop=None, logit_bias=None)
    limits.check(completions)
    assert completions.max_tokens == 20
    given = SimpleNamespace(n=1, max_tokens=None, max_completion_tokens=7, stop=None, logit_bias=None)
    limits.check(given)
    assert given.max_tokens is None and given.max_completion_tokens == 7  # a given budget is left alone
    with pytest.raises(APIError) as err:
        limits.check(SimpleNamespace(n=1, max_tokens=30, stop=None, logit_bias=None))
    assert err.value.status == 400 and err.value.param == "max_tokens"
    unlimited = SimpleNamespace(n=1, max_tokens=None, stop=None, logit_bias=None)
    RequestLimits().check(unlimited)
    assert unlimited.max_tokens is None  # no limit: the rest of the context, as before
    assert limits.default_max_tokens(16) == 16 and limits.default_max_tokens(64) == 20


def test_a_capped_budget_is_an_upper_bound():
    assert resolve_max_tokens(_state(), 10, Capped(20), "max_tokens") == 20
    assert resolve_max_tokens(_state(), 90, Capped(20), "max_tokens") == 10  # the rest of the context, no 400
    assert resolve_max_tokens(_state(max_tokens=8), 10, Capped(20), "max_tokens") == 8  # checkpoint's, as vLLM
    with pytest.raises(APIError):
        resolve_max_tokens(_state(), 90, 20, "max_tokens")  # an explicit budget that does not fit is still a 400
