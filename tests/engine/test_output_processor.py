"""OutputProcessor: n > 1 fan-in, FINAL_ONLY vs DELTA, stop strings -> abort, logprobs, metrics."""
from __future__ import annotations

from engine_tokenizer import build_tokenizer

from strataserve.engine.output_processor import OutputProcessor, RequestOutputKind, child_seed
from strataserve.types.outputs import TokenLogprobs
from strataserve.types.protocol import EngineCoreOutput, EngineCoreOutputs
from strataserve.types.sampling import SamplingParams


def outs(*items):
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=r, new_token_ids=t, **kw) for r, t, kw in items])


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_n_children_have_distinct_ids_and_seeds_and_final_output_is_in_index_order():
    tok = build_tokenizer()
    op = OutputProcessor(tok)
    core = op.add_request("r", "p", [5, 6], SamplingParams(n=3, seed=7, max_tokens=4), eos_token_id=1)
    assert [c.request_id for c in core] == ["r-0", "r-1", "r-2"]
    assert [c.sampling_params.n for c in core] == [1, 1, 1]
    seeds = [c.sampling_params.seed for c in core]
    assert seeds[0] == 7 and len(set(seeds)) == 3 and seeds[1] == child_seed(7, 1)
    a, b = ids(tok, "hello"), ids(tok, " world")
    r = op.process_outputs(outs(("r-1", a, {}), ("r-0", b, {"finish_reason": "length"})))
    assert r.request_outputs == []  # FINAL_ONLY waits for every completion
    r = op.process_outputs(outs(("r-2", a + b, {"finish_reason": "stop", "stop_reason": 9}),
                                ("r-1", b, {"finish_reason": "length"})))
    (ro,) = r.request_outputs
    assert ro.finished and [c.index for c in ro.outputs] == [0, 1, 2]
    # r-2 ended on stop token id 9: as vLLM, that last token's text is not part of its output
    assert [c.text for c in ro.outputs] == [" world", "hello world", tok.decode((a + b)[:-1])]
    assert ro.outputs[2].finish_reason == "stop" and ro.outputs[2].stop_reason == 9
    assert ro.metrics.first_token_time is not None and ro.metrics.finished_time >= ro.metrics.first_token_time
    assert not op.has_unfinished_requests()


def test_delta_outputs_carry_only_new_pieces_of_changed_completions():
    tok = build_tokenizer()
    op = OutputProcessor(tok)
    op.add_request("d", None, [5], SamplingParams(n=2, max_tokens=8), kind=RequestOutputKind.DELTA)
    t = ids(tok, "emoji 🙂 ok")
    steps = [[("d-0", t[:2], {}), ("d-1", t[:1], {})], [("d-0", t[2:4], {})],
             [("d-0", t[4:], {"finish_reason": "length"}), ("d-1", t[1:], {"finish_reason": "length"})]]
    texts, toks, finished = {0: "", 1: ""}, {0: [], 1: []}, []
    for s in steps:
        (ro,) = op.process_outputs(outs(*s)).request_outputs
        changed = {c.index for c in ro.outputs}
        assert changed == {int(r[-1]) for r, _, _ in s}
        for c in ro.outputs:
            texts[c.index] += c.text
            toks[c.index] += c.token_ids
            assert "\ufffd" not in c.text
        finished.append(ro.finished)
    assert finished == [False, False, True]
    assert texts == {0: "emoji 🙂 ok", 1: "emoji 🙂 ok"} and toks == {0: t, 1: t}


def test_stop_string_finishes_and_asks_core_to_abort():
    tok = build_tokenizer()
    op = OutputProcessor(tok)
    op.add_request("s", None, [5], SamplingParams(stop=["STOP"], max_tokens=50), kind=RequestOutputKind.DELTA)
    t = ids(tok, "stop here STOP there")
    r1 = op.process_outputs(outs(("s", t[:2], {})))
    r2 = op.process_outputs(outs(("s", t[2:], {})))
    assert r1.reqs_to_abort == [] and r2.reqs_to_abort == ["s"]
    (ro,) = r2.request_outputs
    c = ro.outputs[0]
    assert ro.finished and c.finish_reason == "stop" and c.stop_reason == "STOP"
    assert r1.request_outputs[0].outputs[0].text + c.text == "stop here "
    # Late tokens from the core (before it saw the abort) are ignored.
    assert op.process_outputs(outs(("s", [7], {}))).request_outputs == []


def test_stop_string_matching_on_the_core_finished_token_does_not_abort():
    tok = build_tokenizer()
    op = OutputProcessor(tok)
    op.add_request("s", None, [5], SamplingParams(stop=["fox"]))
    r = op.process_outputs(outs(("s", ids(tok, "quick brown fox"), {"finish_reason": "length"})))
    assert r.reqs_to_abort == []
    assert r.request_outputs[0].outputs[0].text == "quick brown " and r.request_outputs[0].outputs[0].stop_reason == "fox"


def test_logprobs_become_dicts_with_decoded_tokens():
    tok = build_tokenizer()
    op = OutputProcessor(tok)
    op.add_request("l", None, [5], SamplingParams(logprobs=2))
    h, w = ids(tok, "hello")[0], ids(tok, " world")[0]
    lp = [TokenLogprobs(h, -0.1, 1, [h, w], [-0.1, -2.5]), TokenLogprobs(w, -3.0, 3, [h, 300], [-0.2, -0.9])]
    r = op.process_outputs(outs(("l", [h, w], {"new_logprobs": lp, "finish_reason": "length"})))
    c = r.request_outputs[0].outputs[0]
    assert abs(c.cumulative_logprob - (-3.1)) < 1e-9
    assert set(c.logprobs[0]) == {h, w} and c.logprobs[0][w].rank == 2
    assert c.logprobs[1][w].rank == 3 and c.logprobs[1][w].decoded_token == tok.decode([w])
    assert set(c.logprobs[1]) == {w, h, 300}


def test_abort_returns_unfinished_core_ids_and_duplicate_ids_are_rejected():
    import pytest

    op = OutputProcessor(build_tokenizer())
    op.add_request("a", None, [5], SamplingParams(n=2))
    with pytest.raises(ValueError, match="already in use"):
        op.add_request("a", None, [5], SamplingParams())
    op.process_outputs(outs(("a-1", [7], {"finish_reason": "length"})))
    assert op.abort_requests(["a", "zzz"]) == ["a-0"]
    assert not op.has_unfinished_requests()
