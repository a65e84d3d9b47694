"""Async scheduling: step N+1 is scheduled before step N's tokens are known (pending tokens), driven through
EngineCore by a fake runner that resolves them from its own state. Outputs must equal the synchronous
reference exactly, under preemption, prefix caching, stop tokens, aborts and id reuse."""
from __future__ import annotations

import random

from engine_fakes import EOS, AsyncFakeRunner, engine_config, next_token, reference_output
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strataserve.engine.engine_core import EngineCore
from strataserve.types.protocol import EngineCoreRequest
from strataserve.types.sampling import SamplingParams


def make(num_blocks=64, max_model_len=64, **cfg) -> tuple[EngineCore, AsyncFakeRunner]:
    runner = AsyncFakeRunner(num_blocks=num_blocks, block_size=4, max_model_len=max_model_len)
    return EngineCore(engine_config(**cfg), runner=runner), runner


def req(rid, prompt, max_tokens, **sp) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, eos_token_id=EOS,
                             sampling_params=SamplingParams(max_tokens=max_tokens, **sp))


def collect(core: EngineCore, outputs: dict, finished: dict) -> None:
    for o in core.step().outputs:
        outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finish_reason:
            assert o.request_id not in finished, f"{o.request_id} finished twice"
            finished[o.request_id] = o.finish_reason


def run(core: EngineCore, outputs: dict, finished: dict, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return
        collect(core, outputs, finished)
    raise AssertionError("engine did not finish")


def test_steps_are_scheduled_ahead_and_outputs_match_the_reference():
    core, runner = make(num_blocks=200, max_model_len=128)
    rng = random.Random(1)
    prompts = {f"r{i}": ([rng.randrange(3, 400) for _ in range(rng.randint(1, 20))], rng.randint(1, 30))
               for i in range(8)}
    for rid, (p, m) in prompts.items():
        core.add_request(req(rid, p, m, ignore_eos=True))
    outputs, finished = {}, {}
    run(core, outputs, finished)
    assert runner.num_pending_chunks > 0  # decodes really went out before their token was known
    for rid, (p, m) in prompts.items():
        assert outputs[rid] == reference_output(p, m), rid
        assert finished[rid] == "length"
    pool = core.scheduler.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks and not core.has_step_in_flight()


def test_stop_token_mid_flight_discards_the_extra_token():
    core, runner = make()
    prompt = [5, 6, 7]
    ref = reference_output(prompt, 20)
    stop = ref[4]  # the 5th token stops it, while the 6th step is already scheduled
    core.add_request(req("a", prompt, 20, stop_token_ids=[stop]))
    outputs, finished = {}, {}
    run(core, outputs, finished)
    assert outputs["a"] == ref[:ref.index(stop) + 1] and finished["a"] == "stop"
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_sync_only_requests_disable_scheduling_ahead_while_unfinished():
    core, runner = make()
    core.add_request(req("bad", [5, 6, 7], 6, bad_words_token_ids=[[11, 12]], ignore_eos=True))
    outputs, finished = {}, {}
    run(core, outputs, finished)
    assert runner.num_pending_chunks == 0
    assert outputs["bad"] == reference_output([5, 6, 7], 6)
    core.add_request(req("plain", [5, 6, 7], 6, ignore_eos=True))
    run(core, outputs, finished)
    assert runner.num_pending_chunks > 0


def test_sync_only_request_arriving_mid_flight_stops_scheduling_ahead_until_it_finishes():
    core, runner = make()
    core.add_request(req("plain", [5, 6, 7], 12, ignore_eos=True))
    outputs, finished = {}, {}
    for _ in range(3):
        collect(core, outputs, finished)
    assert core.has_step_in_flight() and runner.num_pending_chunks > 0
    core.add_request(req("pen", [8, 9], 4, ignore_eos=True, prompt_logprobs=1))
    before = runner.num_pending_chunks
    while "pen" not in finished:
        collect(core, outputs, finished)
        if "pen" not in finished:
            assert runner.num_pending_chunks == before  # nothing scheduled ahead while "pen" is unfinished
    run(core, outputs, finished)
    assert outputs["plain"] == reference_output([5, 6, 7], 12)
    assert outputs["pen"] == reference_output([8, 9], 4)


def test_seeds_logprobs_penalties_min_tokens_and_one_token_bad_words_keep_scheduling_ahead():
    """What the runner's sampler takes from the step itself (positions, device-side pending tokens, deferred
    logprobs) does not need the host to hold every past token: such requests stay asynchronous."""
    for i, sp in enumerate([dict(seed=3), dict(logprobs=2), dict(repetition_penalty=1.2, frequency_penalty=0.5),
                            dict(min_tokens=4), dict(bad_words_token_ids=[[11], [12]])]):
        core, runner = make()
        core.add_request(req(f"r{i}", [5, 6, 7], 6, ignore_eos=True, **sp))
        outputs, finished = {}, {}
        run(core, outputs, finished)
        assert runner.num_pending_chunks > 0, sp
        assert outputs[f"r{i}"] == reference_output([5, 6, 7], 6)


def test_abort_and_reuse_of_the_id_while_a_step_is_in_flight():
    core, runner = make()
    core.add_request(req("x", [9, 8, 7], 30, ignore_eos=True))
    outputs, finished = {}, {}
    for _ in range(4):
        collect(core, outputs, finished)
    assert core.has_step_in_flight()
    core.abort_requests(["x"])
    outputs.pop("x", None)
    core.add_request(req("x", [11, 12], 5, ignore_eos=True))  # same id, new request: stale tokens must not leak
    run(core, outputs, finished)
    assert outputs["x"] == reference_output([11, 12], 5)
    pool = core.scheduler.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


_op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 30), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, min_size=6, max_size=40), num_blocks=st.integers(6, 16), budget=st.integers(4, 40),
       prefix=st.booleans())
def test_exact_outputs_and_block_accounting_under_preemption_prefix_hits_stops_and_aborts(ops, num_blocks, budget,
                                                                                           prefix):
    runner = AsyncFakeRunner(num_blocks=num_blocks, block_size=4, max_model_len=64)
    core = EngineCore(engine_config(max_num_seqs=6, max_num_batched_tokens=budget, prefix=prefix), runner=runner)
    pool = core.scheduler.kv.pool
    rng = random.Random(len(ops))
    shared = [rng.randrange(3, 400) for _ in range(16)]
    prompts: dict[str, tuple[list[int], int, tuple[int, ...]]] = {}
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    aborted: set[str] = set()
    n = 0
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, shared_blocks, with_stop = op
            prompt = (shared[:4 * shared_blocks] + [rng.randrange(3, 400) for _ in range(plen)])
            prompt = prompt[:min(len(prompt), num_blocks * 4, 63)]
            stops = (next_token(prompt + [next_token(prompt)]),) if with_stop else ()
            rid = f"r{n}"
            n += 1
            prompts[rid] = (prompt, max_tokens, stops)
            core.add_request(req(rid, prompt, max_tokens, ignore_eos=True, stop_token_ids=list(stops)))
        elif op[0] == "abort":
            rid = f"r{op[1]}"
            core.abort_requests([rid])
            if rid not in finished:
                aborted.add(rid)
        else:
            for _ in range(op[1]):
                collect(core, outputs, finished)
        pool.check_invariants()
    run(core, outputs, finished)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks and all(c == 0 for c in pool.ref_cnt)
    for rid, (prompt, max_tokens, stops) in prompts.items():
        ref = reference_output(prompt, max_tokens, stop_ids=stops, max_len=min(64, num_blocks * 4 + 1))
        got = outputs.get(rid, [])
        if rid in aborted:
            assert got == ref[:len(got)]
        else:
            assert got == ref, rid
