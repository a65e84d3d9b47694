"""One output-budget rule on /v1/completions and /v1/chat/completions, vLLM's ``get_max_tokens``: a budget the
request gives is used as given; an unset one (chat: absent or null; completions: null, since an absent one is the
API's 16) takes the checkpoint's generation_config ``max_new_tokens`` within the context left, and
``--limit-max-tokens`` (a ``Capped`` budget) is one more bound on it."""
from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
from api_server import MODEL, launch

from strataserve.api.limits import Capped
from strataserve.api.request_params import resolve_max_tokens

GEN_MAX = 7  # the checkpoint's max_new_tokens in these tests


def _state(max_model_len: int = 100, **defaults) -> SimpleNamespace:
    return SimpleNamespace(max_model_len=max_model_len, sampling_defaults=defaults)


def test_an_unset_budget_takes_the_checkpoint_default_within_the_context():
    assert resolve_max_tokens(_state(max_tokens=GEN_MAX), 10, None, "max_tokens") == GEN_MAX
    assert resolve_max_tokens(_state(max_tokens=GEN_MAX), 97, None, "max_tokens") == 3  # the context is less
    assert resolve_max_tokens(_state(), 10, None, "max_tokens") == 90  # no default: the rest of the context


def test_a_given_budget_is_not_capped_by_the_checkpoint_default():
    """vLLM #34063: generation_config's max_new_tokens is a default, not a ceiling."""
    assert resolve_max_tokens(_state(max_tokens=GEN_MAX), 10, 30, "max_tokens") == 30


def test_the_server_limit_bounds_the_checkpoint_default():
    assert resolve_max_tokens(_state(max_tokens=GEN_MAX), 10, Capped(5), "max_tokens") == 5
    assert resolve_max_tokens(_state(max_tokens=GEN_MAX), 10, Capped(20), "max_tokens") == GEN_MAX
    assert type(resolve_max_tokens(_state(max_tokens=GEN_MAX), 10, Capped(5), "max_tokens")) is int


@pytest.fixture(scope="module")
def gc_client(tiny_ckpt, tmp_path_factory):
    """A server of the tiny checkpoint whose generation config says max_new_tokens=7."""
    folder = tmp_path_factory.mktemp("gencfg")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": GEN_MAX}))
    srv = launch(tiny_ckpt, folder / "server.log", "--generation-config", str(folder))
    try:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=60)
    finally:
        srv.stop()


PROMPT = "the cat sat on the mat"
EXTRA = {"ignore_eos": True}  # every budget is spent, so completion_tokens is the budget


def test_chat_and_completions_share_the_rule(gc_client):
    chat = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], extra_body=EXTRA)
    assert gc_client.chat.completions.create(**chat).usage.completion_tokens == GEN_MAX
    assert gc_client.chat.completions.create(max_tokens=None, **chat).usage.completion_tokens == GEN_MAX
    assert gc_client.chat.completions.create(max_tokens=10, **chat).usage.completion_tokens == 10
    assert gc_client.chat.completions.create(max_completion_tokens=9, **chat).usage.completion_tokens == 9
    comp = dict(model=MODEL, prompt=PROMPT, extra_body=EXTRA)
    assert gc_client.completions.create(max_tokens=None, **comp).usage.completion_tokens == GEN_MAX  # was the rest of the context
    assert gc_client.completions.create(**comp).usage.completion_tokens == 16  # the API's default, as vLLM's
    assert gc_client.completions.create(max_tokens=10, **comp).usage.completion_tokens == 10
