"""A server whose whole KV cache holds fewer tokens than ``max_model_len`` (it starts, with a warning): a prompt
that fits the context but not the cache is a 400 before any output, streamed or not, on every generation route,
with the param and code of a context-length error. Before, the engine refused it only once a stream's 200 had
gone out (an error event in a 200 stream), and a plain request's 400 named no param."""
from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
from api_server import MODEL, launch

from strataserve.api.serving import ServerState

LONG = "ab " * 150  # about 300 tokens: under max_model_len (512), over this cache (about 190)


@pytest.fixture(scope="module")
def small_cache(tiny_ckpt, tmp_path_factory):
    srv = launch(tiny_ckpt, tmp_path_factory.mktemp("small_cache") / "server.log", "--kv-cache-memory-gib", "0.0001")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(small_cache) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{small_cache.url}/v1", api_key=small_cache.api_key, max_retries=0, timeout=60)


def _is_cache_error(err: openai.BadRequestError, param: str) -> None:
    body = err.body
    assert err.status_code == 400
    assert body["param"] == param and body["code"] == "context_length_exceeded"
    assert "KV cache holds" in body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_prompt_over_the_cache_is_400_before_output(client, stream):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=2, stream=stream)
    _is_cache_error(err.value, "prompt")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_prompt_over_the_cache_is_400_before_output(client, stream):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=2,
                                       stream=stream)
    _is_cache_error(err.value, "messages")


def test_responses_stream_over_the_cache_is_400_before_output(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=LONG, max_output_tokens=2, stream=True)
    _is_cache_error(err.value, "input")


def test_a_prompt_that_fits_the_cache_still_streams(client):
    chunks = list(client.completions.create(model=MODEL, prompt="ab " * 20, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3


def _front(pool: int | None) -> SimpleNamespace:
    return SimpleNamespace(inputs=SimpleNamespace(max_pool_tokens=pool))


def _state(engine) -> ServerState:
    return ServerState(engine=engine, tokenizer=None, model_name="m", max_model_len=512, metrics=None,
                       max_inflight_seqs=8)


def test_the_cache_size_is_the_smallest_replicas_and_unknown_is_none():
    assert _state(_front(192)).max_pool_tokens == 192
    assert _state(SimpleNamespace(engines=[_front(320), _front(192)])).max_pool_tokens == 192
    assert _state(SimpleNamespace(engines=[_front(320), SimpleNamespace()])).max_pool_tokens is None
    assert _state(object()).max_pool_tokens is None
