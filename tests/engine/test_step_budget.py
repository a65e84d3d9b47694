"""The per-step prefill budget (``engine/step_budget.py``) and the scheduler's decode-first ordering under it.

The scheduler is driven by the fake runner of ``engine_fakes`` and a simulated device whose step time is a known
linear function of the step's decodes and prefill tokens, so every cap the budget computes can be checked exactly.
"""
from __future__ import annotations

import random

import pytest
from engine_fakes import EOS, AsyncFakeRunner, FakeRunner, engine_config, reference_output

from strataserve.config import SchedulerConfig
from strataserve.engine.engine_core import EngineCore
from strataserve.engine.request import Request
from strataserve.engine.scheduler import Scheduler
from strataserve.cli import build_parser
from strataserve.cli import engine_config as engine_config_from_args
from strataserve.engine.step_budget import AUTO_TARGET_STEP_MS, StepBudget, step_budget_for
from strataserve.types.protocol import EngineCoreRequest
from strataserve.types.sampling import SamplingParams

# Simulated device: a step costs a fixed part, a little per decode and more per prefill token.
FIXED_S, PER_DECODE_S, PER_PREFILL_S = 2e-3, 1e-5, 1e-4


def device_seconds(decodes: int, prefill: int) -> float:
    return FIXED_S + PER_DECODE_S * decodes + PER_PREFILL_S * prefill


def request(rid: str, prompt: list[int], max_tokens: int, seq: int) -> Request:
    core_req = EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, eos_token_id=EOS, arrival_time=float(seq),
                                 sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return Request.from_core_request(core_req, max_model_len=512, max_pool_tokens=512 * 4, seq=seq)


def drive(budget: StepBudget | None, arrivals: dict[int, list[tuple[str, list[int], int]]], max_tokens: int = 64,
          num_blocks: int = 512) -> tuple[dict[str, list[int]], list[tuple[int, int, set[str], set[str]]]]:
    """Run the scheduler over the fake runner; requests join at the step index given in ``arrivals``.

    Returns each request's tokens and, per step: (decodes, prefill tokens, ids that were decoding before the step,
    ids that got a one-token chunk in it)."""
    cfg = SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=64)
    sched = Scheduler(cfg, num_blocks=num_blocks, block_size=4, max_model_len=512, step_budget=budget)
    runner = FakeRunner(num_blocks=num_blocks, block_size=4, max_model_len=512)
    tokens: dict[str, list[int]] = {}
    steps = []
    seq = 0
    for step in range(10_000):
        for rid, prompt, n in arrivals.get(step, []):
            sched.add_request(request(rid, prompt, n, seq))
            seq += 1
        if not sched.has_unfinished_requests() and step > max(arrivals):
            break
        decoding = {r.request_id for r in sched.running if r.num_computed_tokens == len(r.all_token_ids) - 1}
        so = sched.schedule()
        if not so.chunks:
            continue
        one = {c.req_id for c in so.chunks if len(c.token_ids) == 1}
        d = sum(len(c.token_ids) == 1 for c in so.chunks)
        p = so.total_num_scheduled_tokens - d
        assert so.total_num_scheduled_tokens == sum(len(c.token_ids) for c in so.chunks) <= max_tokens
        steps.append((d, p, decoding, one))
        result = runner.execute(so)
        if budget is not None:
            budget.observe(d, p, device_seconds(d, p))
        for o in sched.update_from_output(so, result):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    else:
        raise AssertionError("scheduler did not finish")
    return tokens, steps


def test_budget_before_and_after_timing():
    b = StepBudget(target_ms=10.0, max_tokens=512, min_prefill=8)
    assert b.prefill_cap(0) == 512 and b.prefill_cap(5) == 507  # nothing timed yet: the old behaviour
    b.observe(0, 400, 0.040)  # a prefill-only step: 100 us per token
    b.observe(4, 0, 0.002)  # decode-only steps: 2 ms
    b.observe(4, 0, 0.002)
    assert b.estimates == (pytest.approx(0.002), pytest.approx(1e-4))
    assert b.prefill_cap(4) == 80  # (10 - 2) ms / 0.1 ms
    assert b.prefill_cap(0) == 512  # no decodes: the whole budget
    b.observe(4, 0, 0.012)  # decodes alone get slower: the median of 2, 2, 12, 12 ms is 7 ms
    b.observe(4, 0, 0.012)
    assert b.prefill_cap(4) == 30
    b.observe(4, 0, 0.012)  # ... and then slower than the target
    assert b.prefill_cap(4) == 8  # the floor: prompts keep moving
    assert b.prefill_cap(510) == 2  # never beyond max_tokens


def test_token_cost_is_the_median_of_recent_steps():
    """One unusually efficient step does not raise the cap: the per-token cost is the median, so steps sized
    from it land on the target rather than past it."""
    b = StepBudget(target_ms=30.0, max_tokens=4096, min_prefill=8)
    b.observe(8, 0, 0.005)  # decodes alone: 5 ms
    for tokens, seconds in ((1024, 0.0255), (1024, 0.0255), (2048, 0.035)):  # 20, 20 and 14.6 us per token
        b.observe(8, tokens, seconds)
    assert b.estimates[1] == pytest.approx(0.0205 / 1024)
    assert b.prefill_cap(8) == int(0.025 / (0.0205 / 1024))  # 1248 tokens: (30 - 5) ms at 20 us each


def test_budget_rejects_bad_settings_and_is_off_by_default():
    with pytest.raises(ValueError, match="target_ms"):
        StepBudget(0.0, 64)
    with pytest.raises(ValueError, match="target_step_ms"):
        SchedulerConfig(target_step_ms=-1)
    assert step_budget_for(SchedulerConfig()) is None
    budget = step_budget_for(SchedulerConfig(target_step_ms=7, max_num_batched_tokens=99))
    assert budget is not None and budget.target_s == 0.007 and budget.max_tokens == 99


def test_steps_with_decodes_carry_only_the_prefill_that_fits_the_target_and_decodes_never_wait():
    rng = random.Random(0)
    target_ms = 8.0
    budget = StepBudget(target_ms, max_tokens=256, min_prefill=16)
    arrivals: dict[int, list] = {}
    prompts = {}
    for i in range(24):
        rid = f"r{i}"
        prompts[rid] = ([rng.randrange(3, 400) for _ in range(rng.randint(40, 200))], rng.randint(4, 24))
        arrivals.setdefault(rng.randrange(0, 60), []).append((rid, *prompts[rid]))
    tokens, steps = drive(budget, arrivals, max_tokens=256)
    for rid, (prompt, n) in prompts.items():
        assert tokens[rid] == reference_output(prompt, n), rid
    # cap for d decodes, once both estimates come from the simulated device: (target - decode time) / token cost
    capped = 0
    for d, p, decoding, one in steps:
        assert decoding <= one, "a running decode was left out of a step"
        if d:
            exact = int((target_ms / 1e3 - FIXED_S - PER_DECODE_S * d) / PER_PREFILL_S) + 2  # medians lag a little
            assert p <= max(exact, 16), (d, p)
            capped += p > 0
    assert capped >= 10  # prompts did join running decodes
    assert any(d == 0 and p > 100 for d, p, _, _ in steps)  # with nothing decoding a step takes far more
    # the same requests without a budget: the same tokens, and steps with decodes carrying more prefill
    free_tokens, free_steps = drive(None, arrivals, max_tokens=256)
    assert free_tokens == tokens
    assert max(p for d, p, _, _ in free_steps if d) > max(p for d, p, _, _ in steps if d)


def test_decodes_are_scheduled_before_a_running_chunked_prefill():
    # "long" is mid-prefill and placed ahead of "short" in admission order (as a resumed preemption can be):
    # short's decode still comes first, and long's chunk gets what is left of the 8-token budget.
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), num_blocks=64, block_size=4, max_model_len=256)
    runner = FakeRunner(num_blocks=64, block_size=4, max_model_len=256)
    sched.add_request(request("short", [5, 6, 7], 8, 0))
    sched.add_request(request("long", list(range(10, 60)), 2, 1))
    so = sched.schedule()  # short's 3 prompt tokens + long's first 5
    sched.update_from_output(so, runner.execute(so))
    assert [r.request_id for r in sched.running] == ["short", "long"]
    sched.running.reverse()
    for _ in range(3):
        so = sched.schedule()
        assert [(c.req_id, len(c.token_ids)) for c in so.chunks] == [("short", 1), ("long", 7)]
        sched.update_from_output(so, runner.execute(so))


def test_auto_target_paces_only_runners_whose_steps_are_device_timed():
    """``target_step_ms=None`` (auto, `strata serve`'s default): the automatic target where steps with prompt
    tokens replay graphs, no pacing elsewhere; an explicit value wins either way."""
    auto = SchedulerConfig(target_step_ms=None)
    budget = step_budget_for(auto, device_timed=True)
    assert budget is not None and budget.target_s == AUTO_TARGET_STEP_MS / 1e3
    assert step_budget_for(auto, device_timed=False) is None
    assert step_budget_for(SchedulerConfig(target_step_ms=0), device_timed=True) is None
    assert step_budget_for(SchedulerConfig(target_step_ms=9), device_timed=False).target_s == 0.009

    class GraphRunner(FakeRunner):
        mixed_step_graphs = True

    core = EngineCore(engine_config(target_step_ms=None), runner=GraphRunner(num_blocks=64, block_size=4))
    assert core.scheduler.step_budget is not None
    assert core.scheduler.step_budget.target_s == AUTO_TARGET_STEP_MS / 1e3
    core = EngineCore(engine_config(target_step_ms=None), runner=FakeRunner(num_blocks=64, block_size=4))
    assert core.scheduler.step_budget is None
    args = build_parser().parse_args(["serve"])
    assert engine_config_from_args(args, "m").scheduler.target_step_ms is None  # serve: auto
    args = build_parser().parse_args(["serve", "--target-step-ms", "0"])
    assert engine_config_from_args(args, "m").scheduler.target_step_ms == 0
    args = build_parser().parse_args(["serve", "--target-step-ms", "auto"])
    assert engine_config_from_args(args, "m").scheduler.target_step_ms is None
    for bad in ("-1", "fast"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--target-step-ms", bad])


def test_engine_core_times_steps_and_feeds_the_budget():
    core = EngineCore(engine_config(target_step_ms=50.0), runner=FakeRunner(num_blocks=64, block_size=4))
    budget = core.scheduler.step_budget
    assert budget is not None and budget.target_s == 0.05
    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=list(range(3, 200)), eos_token_id=EOS,
                                       sampling_params=SamplingParams(max_tokens=4, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    decode_s, token_s = budget.estimates
    assert decode_s > 0 and token_s is not None and token_s > 0


class _FrozenBudget(StepBudget):
    """Estimates set once and never moved by real timings, so the schedule is the same on any machine."""

    def __init__(self, target_ms: float, max_tokens: int, min_prefill: int, decode_s: float, token_s: float) -> None:
        super().__init__(target_ms, max_tokens, min_prefill)
        super().observe(1, 0, decode_s)
        super().observe(0, 100, 100 * token_s)

    def observe(self, num_decodes: int, num_prefill: int, seconds: float) -> None:
        pass


def test_greedy_tokens_of_a_real_model_do_not_depend_on_the_budget(tmp_path):
    from _tiny_models import make_tiny_checkpoint

    from strataserve import LLM

    ckpt = make_tiny_checkpoint("llama", tmp_path / "tiny")
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 250) for _ in range(rng.randint(12, 60))]} for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def make() -> LLM:
        return LLM(model=str(ckpt), dtype="float32", device="cpu", block_size=4, num_blocks=256,
                   max_num_batched_tokens=64, target_step_ms=0)

    free = make()
    assert free.engine.core.scheduler.step_budget is None
    ref = [o.outputs[0].token_ids for o in free.generate(prompts, params, use_tqdm=False)]
    paced = make()
    budget = _FrozenBudget(5.0, 64, min_prefill=4, decode_s=1e-3, token_s=1e-3)  # 4 prefill tokens beside decodes
    assert budget.prefill_cap(3) == 4
    core = paced.engine.core
    core.scheduler.step_budget = budget
    mixes: list[tuple[int, int]] = []
    execute = core.runner.execute

    def recording(so):
        d = sum(len(c.token_ids) == 1 for c in so.chunks)
        mixes.append((d, so.total_num_scheduled_tokens - d))
        return execute(so)
    core.runner.execute = recording
    out = [o.outputs[0].token_ids for o in paced.generate(prompts, params, use_tqdm=False)]
    assert out == ref
    assert all(p <= 4 for d, p in mixes if d)  # every step with decodes kept to the cap
    assert sum(1 for d, p in mixes if d and p) >= 10  # and prompts were fed beside decodes, 4 tokens at a time
    assert any(d == 0 and p > 4 for d, p in mixes)


class _Event:
    """A CUDA event's stand-in: a time on the simulated device's clock."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, end: "_Event") -> float:
        return (end.t - self.t) * 1e3  # ms, as torch.cuda.Event.elapsed_time


class _Launched:
    def __init__(self, out, event: _Event) -> None:
        self.out, self.done_event = out, event

    def result(self):
        return self.out


class _ClockedRunner(AsyncFakeRunner):
    """Async fake runner whose steps end on a simulated device clock (``device_seconds`` per step)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.clock = 0.0

    def launch(self, so):
        d = sum(len(c.token_ids) == 1 for c in so.chunks)
        self.clock += device_seconds(d, so.total_num_scheduled_tokens - d)
        return _Launched(self.execute(so), _Event(self.clock))


def test_async_engine_times_steps_between_the_device_events():
    core = EngineCore(engine_config(target_step_ms=8.0, max_num_batched_tokens=256),
                      runner=_ClockedRunner(num_blocks=512, block_size=4, max_model_len=512))
    rng = random.Random(2)
    prompts = {f"r{i}": [rng.randrange(3, 400) for _ in range(rng.randint(60, 200))] for i in range(12)}
    for rid, p in prompts.items():
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=p, eos_token_id=EOS,
                                           sampling_params=SamplingParams(max_tokens=20, ignore_eos=True)))
        for _ in range(3):  # requests join while others decode
            core.step()
    while core.has_unfinished_requests():
        core.step()
    decode_s, token_s = core.scheduler.step_budget.estimates
    # the estimates are the simulated device's: the engine read the events, not its own (instant) host clock
    assert FIXED_S < decode_s < device_seconds(12, 0)
    assert token_s == pytest.approx(PER_PREFILL_S, rel=0.2)
