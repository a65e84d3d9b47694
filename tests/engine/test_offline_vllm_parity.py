"""vLLM behaviours of the offline API a ported script relies on: a stop token's text stays out of the output,
``LLM.chat`` takes OpenAI content parts, tools, a template and template arguments as vLLM's does, a grammar ends
the output even with ``ignore_eos``, bad ``SamplingParams`` fail where they are made, and a shut-down or dropped
``LLM`` says so and frees its engine."""
from __future__ import annotations

import gc

import pytest

from _tiny_models import make_tiny_checkpoint, make_tiny_tokenizer
from strataserve import LLM, SamplingParams
from strataserve.types.sampling import GuidedDecodingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("parity"))
    engine = LLM(str(path), device="cpu", dtype="float32", num_blocks=64)
    yield engine
    engine.shutdown()


def test_a_stop_token_id_leaves_its_text_out(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = llm.generate(["hello world"], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    stop = base.token_ids[3]
    first = base.token_ids.index(stop)  # it may come earlier too
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop],
                                include_stop_str_in_output=include)
        out = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids[:first + 1] and out.stop_reason == stop  # its id stays
        assert out.text == tok.decode(base.token_ids[:first + 1 if include else first])


def test_chat_takes_vllm_arguments(llm):
    tok = make_tiny_tokenizer(512)
    params = SamplingParams(temperature=0, max_tokens=1)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    assert llm.chat(parts, params, use_tqdm=False)[0].prompt == tok.apply_chat_template(
        [{"role": "user", "content": "hi\nthere"}], tokenize=False, add_generation_prompt=True)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if tools %}T{% endif %}" \
               "{% if add_generation_prompt %}>{% endif %}"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "x"}]
    out = llm.chat(msgs, params, use_tqdm=False, chat_template=template, tools=tools)[0]
    assert out.prompt == "[x]T>"
    # template arguments override the others, as vLLM merges them
    out = llm.chat(msgs, params, use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"add_generation_prompt": False})[0]
    assert out.prompt == "[x]"
    with pytest.raises(ValueError, match="conversation"):
        llm.chat("hi", params, use_tqdm=False)
    with pytest.raises(ValueError, match="text"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params,
                 use_tqdm=False)


def test_a_grammar_ends_the_output_even_with_ignore_eos(llm):
    pytest.importorskip("xgrammar")
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True,
                                guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
        out = llm.generate(["answer:"], params, use_tqdm=False)[0].outputs[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop", out.text


@pytest.mark.parametrize("field,value", [("top_k", 2.5), ("n", 2.0), ("seed", 1.5), ("max_tokens", 3.5),
                                         ("logprobs", True)])
def test_non_integer_counts_fail_where_they_are_made(field, value):
    with pytest.raises(ValueError, match=f"{field}=.*integer"):
        SamplingParams(**{field: value})


def test_shut_down_or_dropped(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path)
    llm = LLM(str(path), device="cpu", dtype="float32", num_blocks=16)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["x"], use_tqdm=False)
    llm.shutdown()  # twice is fine
    dropped = LLM(str(path), device="cpu", dtype="float32", num_blocks=16)
    finalizer = dropped._stop
    del dropped
    gc.collect()
    assert not finalizer.alive  # the dropped LLM's engine was shut down with it


def test_generation_config_gives_the_sampling_defaults(tmp_path, caplog):
    """As vLLM's ``generation_config="auto"``: a request that leaves a field unset takes the checkpoint's
    generation_config.json value (offline and served); ``vllm`` ignores the file; a value SamplingParams would
    refuse is left out rather than failing every request."""
    import json

    from strataserve.api.request_params import make_params
    from strataserve.models.generation_defaults import sampling_defaults

    path = make_tiny_checkpoint("llama", tmp_path / "ckpt")
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.9, top_k=1, top_p=0.0, max_new_tokens=5)  # top_p 0 is out of SamplingParams' range
    (path / "generation_config.json").write_text(json.dumps(config))
    defaults = sampling_defaults(path)
    assert defaults == {"temperature": 0.9, "top_k": 1, "max_tokens": 5} and "top_p" in caplog.text
    assert sampling_defaults(path, "vllm") == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(path, str(tmp_path))
    served = make_params(defaults, temperature=None, top_k=None, n=2)
    assert (served.temperature, served.top_k, served.n) == (0.9, 1, 2)
    assert make_params(defaults, temperature=0.3).temperature == 0.3  # a field the request sets is its own
    llm = LLM(str(path), device="cpu", dtype="float32", num_blocks=32)
    try:
        assert llm.get_default_sampling_params().top_k == 1
        greedy = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
        for out in llm.generate(["hello"] * 3, use_tqdm=False):  # top_k 1: greedy, 5 tokens, whatever the draw
            assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_generation_config_flag_reaches_the_served_model(tmp_path):
    from rich.console import Console

    from strataserve.cli import _serve_options, build_parser

    path = make_tiny_checkpoint("llama", tmp_path)
    for argv, want in (([], "auto"), (["--generation-config", "vllm"], "vllm")):
        options = _serve_options(build_parser().parse_args(["serve", str(path), *argv]), Console(quiet=True))
        assert options.llms[0].generation_config == want


def test_strata_generate_refuses_what_it_cannot_do(tmp_path, capsys):
    """``strata generate`` prints text from text prompts: --skip-tokenizer-init is refused in a sentence (it was
    accepted and ignored), and a bad engine flag is an error line, not a traceback."""
    import signal

    from strataserve.cli import main

    path = make_tiny_checkpoint("llama", tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["generate", str(path), "--skip-tokenizer-init", "--prompt", "x"]) == 2
        assert "needs the tokenizer" in capsys.readouterr().err
        assert main(["generate", str(path), "--device", "cpu", "-tp", "3", "--prompt", "x"]) == 2
        assert capsys.readouterr().err.startswith("error:")
    finally:
        signal.signal(signal.SIGTERM, before)  # main() installs its own handler


def test_allowed_token_ids_bad_words_and_truncate_prompt_tokens(llm):
    """vLLM's SamplingParams extras: sampling limited to allowed ids; a bad word's token sequence never appears
    (at the start or after a space); a truncated prompt runs as its last k tokens would; ids must exist."""
    tok = llm.get_tokenizer()
    prompt = "the cat sat on the mat and the dog"
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = llm.generate([prompt], greedy)[0].outputs[0]
    allowed = sorted(set(base.token_ids[2:6]))
    for sp in (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
               SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)):
        assert set(llm.generate([prompt], sp)[0].outputs[0].token_ids) <= set(allowed)
    word = tok.decode(base.token_ids[:2]).strip()  # what greedy writes first, banned
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                bad_words=[word]))[0].outputs[0]
    seqs = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    for seq in seqs:
        assert not any(out.token_ids[i:i + len(seq)] == seq for i in range(len(out.token_ids))), (word, out.text)
    assert out.token_ids != base.token_ids
    ids = tok.encode(prompt)
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                truncate_prompt_tokens=3))[0]
    assert cut.prompt_token_ids == ids[-3:]
    alone = llm.generate([{"prompt_token_ids": ids[-3:]}], SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True))[0]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    for bad in ({"allowed_token_ids": [10**6]}, {"logit_bias": {10**6: 1.0}}, {"truncate_prompt_tokens": 10**6}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            llm.generate([prompt], SamplingParams(**bad))


def test_llm_seed_makes_unseeded_sampling_repeat(tmp_path):
    """LLM(seed=...) seeds the engine's generator, as vLLM's does: the same script samples the same text again;
    another seed samples other text."""
    path = make_tiny_checkpoint("llama", tmp_path / "m")
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # no per-request seed

    def run(seed: int) -> list[list[int]]:
        engine = LLM(str(path), device="cpu", dtype="float32", num_blocks=32, seed=seed)
        try:
            return [o.outputs[0].token_ids for o in engine.generate(["a b c", "d e f"], sp)]
        finally:
            engine.shutdown()

    first = run(7)
    assert run(7) == first and run(8) != first


def test_sampling_params_are_mutable_as_vllms_and_checked_when_used(llm):
    """vLLM's own example sets fields on get_default_sampling_params(); a changed value is checked at generate.
    Token ids are integers (numpy / torch ones too): a float is refused, not truncated."""
    import numpy as np

    sp = llm.get_default_sampling_params()
    sp.max_tokens, sp.temperature = 3, 0.0
    copy = sp.clone()
    copy.max_tokens = 5
    assert sp.max_tokens == 3 and len(llm.generate(["a b"], sp)[0].outputs[0].token_ids) <= 3
    sp.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["a b"], sp)
    ok = llm.generate([{"prompt_token_ids": [1, np.int64(44)]}], copy)[0]
    assert ok.prompt_token_ids == [1, 44]
    for bad, field in (({"prompt_token_ids": [1, 44.9]}, "prompt_token_ids"),):
        with pytest.raises(ValueError, match=field):
            llm.generate([bad], copy)
    for kw, field in ((dict(stop_token_ids=[2.5]), "stop_token_ids"), (dict(stop=[1]), "stop"),
                      (dict(logit_bias={9.7: 1}), "logit_bias"), (dict(temperature="0.5"), "temperature")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(5)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate("hi", {"max_tokens": 2})


def test_async_llm_from_engine_args_as_vllm_builds_it(tmp_path):
    """vLLM's async entry point: AsyncLLM.from_engine_args(AsyncEngineArgs(model=...)), the core in its own
    process; greedy output equals the offline LLM's."""
    import asyncio

    from strataserve import AsyncEngineArgs, AsyncLLM

    path = make_tiny_checkpoint("llama", tmp_path / "m")
    args = AsyncEngineArgs(model=str(path), device="cpu", dtype="float32", num_gpu_blocks_override=32)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run() -> list[int]:
        engine = AsyncLLM.from_engine_args(args)
        try:
            return [o async for o in engine.generate("a b c", sp, "r")][-1].outputs[0].token_ids
        finally:
            engine.shutdown()

    offline = LLM(str(path), device="cpu", dtype="float32", num_blocks=32)
    try:
        want = offline.generate(["a b c"], sp)[0].outputs[0].token_ids
    finally:
        offline.shutdown()
    assert asyncio.run(run()) == want
    assert args.create_engine_config() == AsyncEngineArgs(str(path), device="cpu", dtype="float32",
                                                          num_gpu_blocks_override=32).create_engine_config()
