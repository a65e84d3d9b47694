"""Scheduler + KV cache manager driven through EngineCore by a fake runner (no model)."""
from __future__ import annotations

import random

import pytest
from engine_fakes import EOS, FakeRunner, engine_config, reference_output

from strataserve.engine.engine_core import EngineCore
from strataserve.types.protocol import EngineCoreRequest
from strataserve.types.sampling import SamplingParams


def make_core(num_blocks=64, block_size=4, max_model_len=256, **cfg) -> tuple[EngineCore, FakeRunner]:
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
    return EngineCore(engine_config(**cfg), runner=runner), runner


def req(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0, arrival: float = 0.0,
        **sp) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, eos_token_id=EOS, priority=priority,
                             arrival_time=arrival, sampling_params=SamplingParams(max_tokens=max_tokens, **sp))


def run_all(core: EngineCore, max_steps: int = 10_000) -> dict[str, tuple[list[int], str, object, int]]:
    """Step until idle; return rid -> (tokens, finish_reason, stop_reason, num_cached_tokens)."""
    toks: dict[str, list[int]] = {}
    done: dict[str, tuple] = {}
    cached: dict[str, int] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.request_id not in cached:
                cached[o.request_id] = o.num_cached_tokens
            if o.finish_reason:
                done[o.request_id] = (toks[o.request_id], o.finish_reason, o.stop_reason, cached[o.request_id])
    else:
        raise AssertionError("engine did not finish")
    return done


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def assert_all_blocks_free(core: EngineCore) -> None:
    pool = core.scheduler.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    assert not core.scheduler.running and core.scheduler.num_waiting == 0


def test_continuous_batching_outputs_match_reference_and_requests_join_mid_flight():
    rng = random.Random(0)
    core, runner = make_core(max_num_seqs=4, max_num_batched_tokens=32)
    prompts = {f"r{i}": rand_prompt(rng, rng.randint(1, 30)) for i in range(12)}
    lens = {f"r{i}": rng.randint(1, 12) for i in range(12)}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, lens[rid], ignore_eos=True))
    done = run_all(core)
    for rid, p in prompts.items():
        assert done[rid][0] == reference_output(p, lens[rid]), rid
        assert done[rid][1] == "length"
    # Continuous batching: some step admits a new request while another is mid-decode.
    assert any(so.new_requests and any(c.start_pos > 0 and len(c.token_ids) == 1 for c in so.chunks)
               for so in runner.steps)
    for so in runner.steps:
        assert so.total_num_scheduled_tokens == sum(len(c.token_ids) for c in so.chunks) <= 32
        assert len(so.chunks) <= 4
    assert_all_blocks_free(core)


def test_chunked_prefill_is_mixed_with_decodes_under_the_token_budget():
    core, runner = make_core(max_num_batched_tokens=8)
    core.add_request(req("short", [5, 6, 7], 10, ignore_eos=True))
    first_tok = core.step().outputs[0].new_token_ids  # prefill of "short"
    core.add_request(req("long", list(range(10, 40)), 3, ignore_eos=True))
    done = run_all(core)
    long_chunks = [(so, c) for so in runner.steps for c in so.chunks if c.req_id == "long" and not c.sample]
    assert len(long_chunks) >= 3  # 30 prompt tokens through a budget of 8 (1 taken by the decode)
    so, first = long_chunks[0]
    assert first.start_pos == 0 and len(first.token_ids) == 7
    assert any(c.req_id == "short" and len(c.token_ids) == 1 for c in so.chunks)
    assert done["long"][0] == reference_output(list(range(10, 40)), 3)
    assert first_tok + done["short"][0] == reference_output([5, 6, 7], 10)


def test_no_chunking_waits_for_room_for_the_whole_prompt():
    core, runner = make_core(max_num_batched_tokens=16, chunked=False)
    core.add_request(req("a", list(range(3, 13)), 4, ignore_eos=True))
    core.add_request(req("b", list(range(20, 30)), 4, ignore_eos=True))
    run_all(core)
    for so in runner.steps:
        for c in so.chunks:
            if c.start_pos == 0:
                assert c.sample, "a prompt was split although chunked prefill is off"


def test_preemption_by_recompute_keeps_outputs_exact():
    rng = random.Random(1)
    core, runner = make_core(num_blocks=12, block_size=4)  # 48 slots for 6 requests of up to ~30 tokens
    prompts = {f"r{i}": rand_prompt(rng, rng.randint(8, 16)) for i in range(6)}
    for rid, p in prompts.items():
        core.add_request(req(rid, p, 14, ignore_eos=True))
    done = run_all(core)
    assert core.stats().num_preemptions > 0
    for rid, p in prompts.items():
        assert done[rid][0] == reference_output(p, 14)
    # A preempted request is told to the runner as finished, then re-sent with its output tokens.
    resent = [nr for so in runner.steps for nr in so.new_requests if nr.output_token_ids]
    assert resent
    assert_all_blocks_free(core)


def test_preemption_victim_is_lowest_priority_then_newest():
    core, runner = make_core(num_blocks=7, block_size=4)  # all three fit until they need a third block
    core.add_request(req("high", list(range(3, 10)), 12, priority=0, arrival=1.0, ignore_eos=True))
    core.add_request(req("low-old", list(range(20, 27)), 12, priority=5, arrival=2.0, ignore_eos=True))
    core.add_request(req("low-new", list(range(40, 47)), 12, priority=5, arrival=3.0, ignore_eos=True))
    preempted: list[str] = []
    seen: set[str] = set()
    while core.has_unfinished_requests():
        core.step()
        so = runner.steps[-1]
        for rid in so.finished_req_ids:
            if rid in core.scheduler.requests and rid not in seen:
                preempted.append(rid)
                seen.add(rid)
    assert preempted and preempted[0] == "low-new"
    assert "high" not in preempted


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    core, runner = make_core(max_num_seqs=1)
    for rid, prio, t in [("c", 3, 1.0), ("a", 0, 3.0), ("b", 0, 4.0), ("d", 1, 0.5)]:
        core.add_request(req(rid, [7, 8, 9], 2, priority=prio, arrival=t, ignore_eos=True))
    run_all(core)
    order = [nr.req_id for so in runner.steps for nr in so.new_requests]
    assert order == ["a", "b", "d", "c"]


def test_abort_frees_blocks_at_once_and_runner_forgets():
    core, runner = make_core()
    core.add_request(req("a", list(range(3, 20)), 50, ignore_eos=True))
    core.add_request(req("b", list(range(30, 40)), 50, ignore_eos=True))
    core.add_request(req("w", list(range(30, 40)), 50, ignore_eos=True))
    core.step()
    core.step()
    assert core.scheduler.kv.num_free_blocks < 64
    core.abort_requests(["a", "b", "w", "unknown"])
    assert core.scheduler.kv.num_free_blocks == 64
    assert not core.has_unfinished_requests()
    core.add_request(req("c", [3, 4, 5], 1))
    run_all(core)
    assert {"a", "b"} <= set(runner.steps[-1].finished_req_ids)
    assert_all_blocks_free(core)


def test_abort_of_waiting_request_before_it_ran():
    core, runner = make_core(max_num_seqs=1)
    core.add_request(req("a", [3, 4, 5], 3, ignore_eos=True))
    core.add_request(req("b", [6, 7, 8], 3, ignore_eos=True))
    core.step()
    core.abort_requests(["b"])
    done = run_all(core)
    assert "b" not in done and core.stats().num_waiting == 0
    assert all(nr.req_id != "b" for so in runner.steps for nr in so.new_requests)


def test_prefix_cache_hit_in_whole_blocks_and_counters():
    core, runner = make_core(block_size=4)
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    core.add_request(req("a", shared + [1, 3], 2, ignore_eos=True))
    run_all(core)
    core.add_request(req("b", shared + [9, 9, 9], 2, ignore_eos=True))
    done = run_all(core)
    assert done["b"][3] == 8  # the two full shared blocks; the partial third one is recomputed
    first_b = next(c for so in runner.steps for c in so.chunks if c.req_id == "b")
    assert first_b.start_pos == 8
    assert done["b"][0] == reference_output(shared + [9, 9, 9], 2)
    s = core.stats()
    assert s.prefix_cache_queries == 12 + 13 and s.prefix_cache_hits == 8
    assert s.prompt_tokens == 12 + 5 and s.generation_tokens == 4


def test_prefix_cache_hit_ending_exactly_at_a_block_boundary_recomputes_the_last_block():
    core, runner = make_core(block_size=4)
    prompt = list(range(50, 62))  # exactly 3 blocks
    core.add_request(req("a", prompt, 1))
    run_all(core)
    core.add_request(req("b", prompt, 3, ignore_eos=True))
    done = run_all(core)
    assert done["b"][3] == 8  # 2 blocks: the last token must be computed, so its block is not taken
    assert done["b"][0] == reference_output(prompt, 3)
    # A prompt one token longer hits all three blocks.
    core.add_request(req("c", prompt + [5], 1))
    assert run_all(core)["c"][3] == 12


def test_prefix_caching_disabled_never_hits():
    core, _ = make_core(prefix=False)
    for rid in "ab":
        core.add_request(req(rid, list(range(3, 30)), 2))
        assert run_all(core)[rid][3] == 0
    assert core.stats().prefix_cache_hits == 0


def test_identical_prompts_arriving_together_share_prompt_blocks():
    core, runner = make_core(block_size=4)
    prompt = list(range(200, 222))  # 5 full blocks + 2 tokens
    for i in range(4):
        core.add_request(req(f"p-{i}", prompt, 3, ignore_eos=True))
    done = run_all(core)
    hits = sorted(d[3] for d in done.values())
    assert hits == [0, 20, 20, 20]
    assert core.stats().prefix_cache_hits == 60
    for d in done.values():
        assert d[0] == reference_output(prompt, 3)


def test_stop_rules_eos_stop_token_min_tokens_and_max_model_len():
    prompt = [11, 12, 13]
    ref = reference_output(prompt, 30)
    core, _ = make_core(max_model_len=64)
    # stop token id = the 4th generated token; min_tokens 6 forbids stopping there.
    core.add_request(req("stop", prompt, 30, stop_token_ids=[ref[3]]))
    core.add_request(req("min", prompt, 30, stop_token_ids=[ref[3]], min_tokens=6))
    core.add_request(req("len", prompt, 5))
    core.add_request(req("ctx", prompt, None))
    done = run_all(core)
    assert done["stop"][:3] == (ref[:4], "stop", ref[3])
    assert done["min"][0][:6] == ref[:6] and len(done["min"][0]) >= 6
    assert done["len"][:2] == (ref[:5], "length")
    assert len(done["ctx"][0]) == 64 - 3 and done["ctx"][1] == "length"


def test_eos_stops_unless_ignore_eos(monkeypatch):
    import engine_fakes

    monkeypatch.setattr(engine_fakes, "next_token", lambda toks: EOS if len(toks) == 6 else 9)
    core, _ = make_core()
    core.add_request(req("eos", [3, 4, 5, 6], 10))
    core.add_request(req("ign", [3, 4, 5, 6], 10, ignore_eos=True))
    done = run_all(core)
    assert done["eos"][:3] == ([9, 9, EOS], "stop", None)
    assert done["ign"][0] == [9, 9, EOS] + [9] * 7 and done["ign"][1] == "length"


def test_bad_prompts_are_rejected_with_clear_errors():
    core, _ = make_core(num_blocks=8, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="empty"):
        core.add_request(req("e", []))
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request(req("l", [5] * 100))
    with pytest.raises(ValueError, match="KV cache"):
        core.add_request(req("k", [5] * 33))
    core.add_request(req("ok", [5] * 32, 4))  # fills the pool exactly: generation capped by the pool
    done = run_all(core)
    assert done["ok"][1] == "length" and len(done["ok"][0]) == 1
    core.add_request(req("dup", [5, 6], 50))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(req("dup", [5, 6], 5))


def test_step_with_nothing_to_do_reports_stats_only():
    core, runner = make_core()
    out = core.step()
    assert out.outputs == [] and out.stats.num_total_blocks == 64 and not runner.steps


def test_victim_already_scheduled_in_this_step_is_unscheduled():
    core, runner = make_core(num_blocks=5, block_size=4)
    core.add_request(req("low", list(range(3, 10)), 12, priority=5, arrival=1.0, ignore_eos=True))
    first = core.step().outputs[0].new_token_ids
    core.add_request(req("high", list(range(20, 27)), 12, priority=0, arrival=2.0, ignore_eos=True))
    done = run_all(core)
    step = next(so for so in runner.steps if "low" in so.finished_req_ids)
    assert all(c.req_id != "low" for c in step.chunks)  # its chunk of that step was withdrawn
    assert any(c.req_id == "high" for c in step.chunks)
    assert first + done["low"][0] == reference_output(list(range(3, 10)), 12)
    assert done["high"][0] == reference_output(list(range(20, 27)), 12)
    assert_all_blocks_free(core)


def test_higher_priority_request_preempts_a_lower_one_when_the_batch_is_full():
    """SLA classes: a batch-class flood fills every slot; an interactive request arriving later is admitted in
    the very next step (the lowest-priority running request is preempted), and everything still finishes with
    the reference output and no leaked block."""
    core, runner = make_core(max_num_seqs=2, max_num_batched_tokens=64)
    toks: dict[str, list[int]] = {}

    def step() -> set[str]:
        outs = core.step().outputs
        for o in outs:
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        return {o.request_id for o in outs}

    for i in range(2):
        core.add_request(req(f"batch{i}", list(range(10 + i, 20 + i)), 40, priority=10, arrival=float(i + 1),
                             ignore_eos=True))
    for _ in range(3):
        step()
    assert {r.request_id for r in core.scheduler.running} == {"batch0", "batch1"}
    core.add_request(req("inter", list(range(50, 58)), 4, priority=0, arrival=9.0, ignore_eos=True))
    assert step() == {"inter"}, "the interactive request's first step is its own (no lower-class decodes)"
    assert "batch1" not in {r.request_id for r in core.scheduler.running}  # newest of the lowest class
    assert core.scheduler.num_preemptions == 1
    for rid, (rest, *_) in run_all(core).items():
        toks[rid] = toks.get(rid, []) + rest
    assert toks["inter"] == reference_output(list(range(50, 58)), 4)
    for i in range(2):
        assert toks[f"batch{i}"] == reference_output(list(range(10 + i, 20 + i)), 40)
    assert_all_blocks_free(core)


def test_equal_priority_never_preempts_for_a_slot():
    core, _ = make_core(max_num_seqs=1, max_num_batched_tokens=64)
    core.add_request(req("a", list(range(10, 20)), 10, priority=3, arrival=0.5, ignore_eos=True))
    core.step()
    core.add_request(req("b", list(range(30, 40)), 10, priority=3, arrival=1.0, ignore_eos=True))
    core.step()
    assert [r.request_id for r in core.scheduler.running] == ["a"]
    assert core.scheduler.num_preemptions == 0
    run_all(core)
    assert_all_blocks_free(core)
