"""Offline ``LLM`` / ``LLMEngine`` front end over the fake runner and the in-memory test tokenizer."""
from __future__ import annotations

import pytest
from engine_fakes import FakeRunner, reference_output
from engine_tokenizer import build_tokenizer

from strataserve import LLM, SamplingParams


def make_llm(num_blocks=256, block_size=4, max_model_len=128, **kw) -> tuple[LLM, FakeRunner]:
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
    return LLM("fake", runner=runner, tokenizer_obj=build_tokenizer(), **kw), runner


def test_generate_accepts_vllm_prompt_forms_and_keeps_input_order():
    llm, _ = make_llm()
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    texts = ["hello world", "the quick brown fox jumps", "emoji 🙂"]
    outs = llm.generate(texts, sp)
    assert [o.prompt for o in outs] == texts
    for o, t in zip(outs, texts):
        ids = tok.encode(t)
        assert o.prompt_token_ids == ids
        assert o.outputs[0].token_ids == reference_output(ids, 5)
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert o.outputs[0].finish_reason == "length" and o.finished
    one = llm.generate("hello world", sp)
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    by_ids = llm.generate([[5, 6, 7], {"prompt_token_ids": [8, 9]}], [sp, SamplingParams(max_tokens=2, ignore_eos=True)])
    assert by_ids[0].prompt is None and by_ids[0].outputs[0].token_ids == reference_output([5, 6, 7], 5)
    assert by_ids[1].outputs[0].token_ids == reference_output([8, 9], 2)
    assert llm.generate([5, 6, 7], sp)[0].outputs[0].token_ids == reference_output([5, 6, 7], 5)
    assert llm.engine.core.scheduler.kv.num_free_blocks == 256


def test_n_siblings_share_prompt_blocks_through_the_prefix_cache():
    llm, runner = make_llm()
    prompt = list(range(10, 50))  # 40 tokens = 10 blocks of 4; siblings may reuse 9 (last token recomputed)
    (out,) = llm.generate([prompt], SamplingParams(n=4, max_tokens=3, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    stats = llm.engine.stats
    assert stats.prefix_cache_hits == 3 * 36
    computed = sum(len(c.token_ids) for so in runner.steps for c in so.chunks)
    assert computed == 40 + 3 * 4 + 4 * 2  # one full prefill, three 4-token tails, two decode steps each


def test_stop_string_cuts_text_and_frees_the_request_in_the_core():
    llm, _ = make_llm()
    tok = llm.get_tokenizer()
    prompt = [5, 6, 7]
    full = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop = full.text[10:13]
    assert stop and stop not in full.text[:10]
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))
    c = o.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == full.text[:full.text.index(stop)]
    assert len(c.token_ids) < 40
    assert not llm.engine.core.has_unfinished_requests()
    assert llm.engine.core.scheduler.kv.num_free_blocks == 256
    del tok


def test_bad_inputs_raise_value_errors_that_say_what_to_change():
    llm, _ = make_llm(max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):
        llm.generate([[5], list(range(3, 40))])
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 100000]])
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="not a directory"):
        LLM("/nonexistent/model")
    with pytest.raises(TypeError, match="unexpected argument"):
        LLM("fake", runner=FakeRunner(), tokenizer_obj=build_tokenizer(), bogus=1)
    # Nothing leaked from the failed batches; the engine still serves.
    assert not llm.engine.core.has_unfinished_requests()
    assert llm.engine.core.scheduler.kv.num_free_blocks == 256
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids == \
        reference_output([5, 6], 2)


def test_max_tokens_beyond_context_is_clipped_with_finish_reason_length():
    llm, _ = make_llm(max_model_len=20)
    (o,) = llm.generate([list(range(3, 13))], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(o.outputs[0].token_ids) == 10 and o.outputs[0].finish_reason == "length"


def test_forced_preemption_and_chunked_prefill_keep_outputs_exact():
    llm, runner = make_llm(num_blocks=16, max_num_batched_tokens=8)
    prompts = [list(range(3 + i, 20 + i)) for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    for o, p in zip(outs, prompts):
        assert o.outputs[0].token_ids == reference_output(p, 20)
    assert llm.engine.stats.num_preemptions > 0
    assert max(so.total_num_scheduled_tokens for so in runner.steps) <= 8


def test_logprobs_and_metrics_offline():
    runner = FakeRunner(num_blocks=64, block_size=4, logprobs=True)
    llm = LLM("fake", runner=runner, tokenizer_obj=build_tokenizer())
    (o,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True))
    c = o.outputs[0]
    assert len(c.logprobs) == 3 and all(t in d for t, d in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(-1.5)
    m = o.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_offline_llm_does_one_piece_of_idle_work_at_init():
    """An offline LLM never idles, so the largest prompt-step graph (whose capture compiles the large steps'
    kernel variants) is captured at init instead of in the first big generate(); only that one piece."""
    class IdleRunner(FakeRunner):
        def __init__(self) -> None:
            super().__init__(num_blocks=64, block_size=4, max_model_len=128)
            self.idle_calls = 0

        def idle_work(self) -> bool:
            self.idle_calls += 1
            return True  # more would remain: init must still stop after one piece

    runner = IdleRunner()
    llm = LLM("fake", runner=runner, tokenizer_obj=build_tokenizer())
    assert runner.idle_calls == 1
    out = llm.generate("hello world", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and runner.idle_calls == 1  # generate() does no idle work
