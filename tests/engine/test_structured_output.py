"""Structured outputs offline (``SamplingParams(guided_decoding=...)``) on a tiny random Qwen3 checkpoint.

Constrained outputs must satisfy their constraint (jsonschema validates JSON, regex fullmatches, choice is one of
the choices) in batches mixed with free requests; greedy constrained tokens must equal an independent reference
(HF transformers logits masked by a fresh xgrammar matcher, argmax); async scheduling gives the same tokens."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from _tiny_models import load_hf_model, make_tiny_checkpoint
from strataserve import LLM, SamplingParams
from strataserve.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from strataserve.types.sampling import GuidedDecodingParams
from strataserve.engine.structured_output import StructuredOutputManager
from strataserve.grammar import build_grammar
from strataserve.runner.model_runner import ModelRunner

xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "home": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 999}},
                 "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "kind", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{2,3}-[a-f]{2}"
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_so"))


def _llm(ckpt, async_scheduling: bool = False, num_blocks: int = 256) -> LLM:
    cfg = EngineConfig(ModelConfig(model=str(ckpt), dtype="float32", device="cpu"),
                       CacheConfig(block_size=4, num_blocks=num_blocks),
                       SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64), RunnerConfig(mode="eager"))
    runner = ModelRunner(cfg, async_scheduling=async_scheduling)
    return LLM(ckpt, device="cpu", dtype="float32", block_size=4, num_blocks=num_blocks, max_num_seqs=16,
               max_num_batched_tokens=64, runner=runner)


def _mixed_params() -> list[SamplingParams]:
    g = GuidedDecodingParams
    ps = [SamplingParams(temperature=0.9, seed=i, max_tokens=120, guided_decoding=g(json=SCHEMA)) for i in range(3)]
    ps += [SamplingParams(temperature=0.0, max_tokens=120, guided_decoding=g(json=SCHEMA)),
           SamplingParams(temperature=0.0, max_tokens=12, guided_decoding=g(regex=REGEX)),
           SamplingParams(temperature=1.0, max_tokens=12, guided_decoding=g(choice=CHOICES)),
           SamplingParams(temperature=0.0, max_tokens=60, guided_decoding=g(json_object=True)),
           SamplingParams(temperature=0.8, max_tokens=20),  # free
           SamplingParams(temperature=0.0, max_tokens=20)]  # free
    return ps


def _matcher(tok, spec):
    """A fresh matcher built here from the HF tokenizer, independent of the engine's."""
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=512, stop_token_ids=[tok.eos_token_id])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(build_grammar(spec)))


def _check(outs, params, tok) -> None:
    for o, p in zip(outs, params):
        c = o.outputs[0]
        spec = p.guided_decoding
        if spec is None:
            continue
        if spec.json_object:  # free-form keys may outrun max_tokens on a random model: then a valid prefix
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict)
            else:
                matcher = _matcher(tok, spec)
                assert all(matcher.accept_token(t) for t in c.token_ids)
            continue
        assert c.finish_reason == "stop", (c.text, spec)  # the grammar ended it, not max_tokens
        if spec.json is not None:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        elif spec.regex is not None:
            assert re.fullmatch(REGEX, c.text), c.text
        else:
            assert c.text in CHOICES


def test_mixed_batch_constraints_hold_sync_and_async(ckpt):
    params = _mixed_params()
    prompts = [f"item {i}: " for i in range(len(params))]
    llm = _llm(ckpt)
    outs_sync = llm.generate(prompts, params, use_tqdm=False)
    _check(outs_sync, params, llm.get_tokenizer())
    llm_async = _llm(ckpt, async_scheduling=True)
    assert llm_async.engine.core._async
    outs_async = llm_async.generate(prompts, params, use_tqdm=False)
    _check(outs_async, params, llm.get_tokenizer())
    assert llm.engine.core.scheduler.num_constrained == llm_async.engine.core.scheduler.num_constrained == 0
    # a KV pool too small for the batch: preemption (recompute) while tokens are in flight keeps matchers in step
    llm_small = _llm(ckpt, async_scheduling=True, num_blocks=48)
    outs_small = llm_small.generate(prompts, params, use_tqdm=False)
    assert llm_small.engine.core.stats().num_preemptions > 0
    _check(outs_small, params, llm.get_tokenizer())
    for o1, o2, p in zip(outs_sync, outs_small, params):
        if p.greedy:
            assert o1.outputs[0].token_ids == o2.outputs[0].token_ids
    # greedy rows do not depend on scheduling: identical tokens with the mask computed ahead of the tokens
    for o1, o2, p in zip(outs_sync, outs_async, params):
        if p.greedy:
            assert o1.outputs[0].token_ids == o2.outputs[0].token_ids


def test_greedy_constrained_tokens_equal_hf_argmax_over_allowed(ckpt):
    """Reference: HF logits of the last position, forbidden tokens dropped by an independent matcher, argmax."""
    llm = _llm(ckpt)
    spec = GuidedDecodingParams(json=SCHEMA)
    prompt = "a record: "
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=80, guided_decoding=spec),
                       use_tqdm=False)[0]
    got = out.outputs[0].token_ids
    hf = load_hf_model(ckpt)
    tok = llm.get_tokenizer()
    vocab = hf.config.vocab_size
    matcher = _matcher(tok, spec)
    ids = list(out.prompt_token_ids)
    ref: list[int] = []
    mask = xgr.allocate_token_bitmask(1, vocab)
    with torch.inference_mode():
        while len(ref) < len(got):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            matcher.fill_next_token_bitmask(mask)
            allowed = torch.tensor([(int(mask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
            nxt = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            ref.append(nxt)
            if nxt == tok.eos_token_id:
                break
            assert matcher.accept_token(nxt)
            ids.append(nxt)
    assert got == ref


def test_invalid_specs_are_value_errors(ckpt):
    llm = _llm(ckpt)
    bad = [GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
           GuidedDecodingParams(regex="([a-z"), GuidedDecodingParams(grammar="root ::= missing_rule")]
    for spec in bad:
        with pytest.raises(ValueError, match="invalid guided decoding") as err:
            llm.generate(["x"], SamplingParams(max_tokens=4, guided_decoding=spec), use_tqdm=False)
        assert ".cc:" not in str(err.value) and "/project/" not in str(err.value)  # no C++ log prefix
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    # vLLM's newer name is the same thing
    sp = SamplingParams(structured_outputs=GuidedDecodingParams(choice=["a", "b"]))
    assert sp.guided_decoding == GuidedDecodingParams(choice=["a", "b"]) and sp.structured_outputs is None


def test_grammars_compile_once_per_spec(ckpt):
    mgr = StructuredOutputManager(str(ckpt), 512, [2])
    a = mgr.compile(GuidedDecodingParams(json=SCHEMA))
    b = mgr.compile(GuidedDecodingParams(json=json.dumps(SCHEMA)))  # same schema given as text
    c = mgr.compile(GuidedDecodingParams(regex=REGEX))
    assert a is b and c is not a


def test_check_guided_compiles_a_valid_spec_once_and_always_rejects_a_bad_one(monkeypatch):
    from strataserve import grammar

    calls = []
    real = grammar.build_grammar
    monkeypatch.setattr(grammar, "build_grammar", lambda spec: calls.append(spec) or real(spec))
    good = GuidedDecodingParams(regex="[a-z]{3} unique-to-this-test")
    grammar.check_guided(good)
    grammar.check_guided(GuidedDecodingParams(regex="[a-z]{3} unique-to-this-test"))  # equal spec: cached
    assert len(calls) == 1
    bad = GuidedDecodingParams(json={"type": "nonsense-type"})
    for _ in range(2):  # an invalid spec is never cached: each request gets its 400
        with pytest.raises(ValueError, match="invalid guided decoding json"):
            grammar.check_guided(bad)
    assert len(calls) == 3


@pytest.mark.parametrize("spec, accepted", [
    (GuidedDecodingParams(choice=["a\x85c", "b"]), "a\x85c"),
    (GuidedDecodingParams(json={"enum": ["a\x85c", "a\x1fA"]}), '"a\x85c"'),
    (GuidedDecodingParams(json={"enum": ["a\x85c", "a\x1fA"]}), '"a\\u001fA"'),
    (GuidedDecodingParams(grammar='root ::= "a\\u0085c"'), "a\x85c"),
    (GuidedDecodingParams(regex="a\x85c"), "a\x85c"),
])
def test_text_with_escapes_compiles_to_itself(ckpt, spec, accepted):
    # xgrammar's compile_grammar(Grammar) goes through the grammar's printed form, where "\x85c" reads back as
    # U+085C: the engine compiles from the source text, so the constraint accepts exactly what was asked
    mgr = StructuredOutputManager(str(ckpt), 512, [2])
    matcher = xgr.GrammarMatcher(mgr.compile(spec))
    assert matcher.accept_string(accepted)
    matcher.reset()
    assert not matcher.accept_string(accepted.replace("\x85c", "\u085c").replace("u001fA", "u01fa"))


def test_bitmasks_filled_on_several_threads_give_the_same_tokens(ckpt, monkeypatch):
    """``STRATA_GRAMMAR_THREADS``: the batch fill on 3 threads constrains exactly as on one (greedy rows equal,
    every constraint held); unset, a CPU engine keeps one thread and an accelerator's gets half the cores (<= 8)."""
    from strataserve import envs
    from strataserve.engine.structured_output import fill_threads_for

    params = _mixed_params()
    prompts = [f"item {i}: " for i in range(len(params))]
    one = _llm(ckpt).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(envs, "STRATA_GRAMMAR_THREADS", 3)
    llm = _llm(ckpt)
    assert llm.engine.core.structured.fill_threads == 3
    three = llm.generate(prompts, params, use_tqdm=False)
    _check(three, params, llm.get_tokenizer())
    for a, b, p in zip(one, three, params):
        if p.greedy:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
    monkeypatch.setattr(envs, "STRATA_GRAMMAR_THREADS", None)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert fill_threads_for(torch.device("cpu")) == 1
    assert fill_threads_for(torch.device("cuda", 0)) == 8
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert fill_threads_for(torch.device("cuda", 0)) == 2
