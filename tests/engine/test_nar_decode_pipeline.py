"""The NAR scheduler's audio decode on its own thread: a batch's clips are decoded while the next batch unmasks,
a failed decode fails only its batch, shutdown lets an unmasked batch finish decoding before it fails what waits,
and a decode thread that dies stops the scheduler instead of leaving requests waiting forever."""
from __future__ import annotations

import threading

import pytest
import torch

from strataserve.engine.nar_scheduler import NARScheduler
from strataserve.types.errors import EngineDeadError
from test_nar_scheduler import Collector, FakeRunner, _req


class SignallingRunner(FakeRunner):
    """Sets ``started[id]`` as it begins unmasking the batch holding that request."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.started: dict[str, threading.Event] = {}

    def event(self, rid: str) -> threading.Event:
        return self.started.setdefault(rid, threading.Event())

    def generate(self, reqs, should_stop=None):
        for r in reqs:
            self.event(r.request_id).set()
        return super().generate(reqs, should_stop)


def test_a_batch_decodes_while_the_next_one_unmasks():
    runner = SignallingRunner()
    overlapped: list[bool] = []
    threads: set[str] = set()

    def decode(toks):
        threads.add(threading.current_thread().name)
        if not overlapped:  # a's clips: finish only once b's unmasking has begun
            overlapped.append(runner.event("b").wait(5))
        return [t.float().sum() for t in toks]

    sched = NARScheduler(runner, decode, window_s=0.0, max_batch=1)
    col = Collector(2)
    try:
        sched.submit(_req("a"), col)
        runner.event("a").wait(5)
        sched.submit(_req("b"), col)
        assert col.done.wait(10)
    finally:
        sched.shutdown()
    assert overlapped == [True]  # on one thread b could not start before a's decode returned
    assert threads == {"strata-nar-decode"}
    assert col.got["a"] == ((8, 5), torch.tensor(0.0)) and col.got["b"] == ((8, 5), torch.tensor(0.0))


def test_a_failed_decode_fails_its_batch_only():
    def decode(toks):
        if toks[0].shape[1] == 7:
            raise RuntimeError("codec broke")
        return [t.float().sum() for t in toks]

    sched = NARScheduler(FakeRunner(), decode, window_s=0.0, max_batch=1)
    col = Collector(2)
    try:
        sched.submit(_req("bad", n=7), col)
        sched.submit(_req("good"), col)
        assert col.done.wait(10)
        sched.check_health()
    finally:
        sched.shutdown()
    assert isinstance(col.got["bad"], RuntimeError) and "codec broke" in str(col.got["bad"])
    assert col.got["good"][0] == (8, 5)


def _gated_decode(gate: threading.Event):
    def decode(toks):
        gate.wait(10)
        return [t.float().sum() for t in toks]
    return decode


def _submit_in_order(sched: NARScheduler, runner: SignallingRunner, rids: str, done) -> None:
    """One at a time, each after the previous one's unmasking began (the last one is only queued)."""
    for rid in rids:
        sched.submit(_req(rid), done)
        if rid != rids[-1]:
            assert runner.event(rid).wait(5)


def test_shutdown_finishes_the_unmasked_batches_and_fails_what_waits():
    runner, gate = SignallingRunner(), threading.Event()
    calls: dict[str, int] = {}

    class Counting(Collector):
        def __call__(self, req, tokens, wav, err) -> None:
            calls[req.request_id] = calls.get(req.request_id, 0) + 1
            super().__call__(req, tokens, wav, err)

    sched = NARScheduler(runner, _gated_decode(gate), window_s=0.0, max_batch=1)
    col = Counting(4)
    # p decodes (held by the gate), q waits in the hand-over, r is unmasked and waits to be handed over, s queues
    _submit_in_order(sched, runner, "pqrs", col)
    stopper = threading.Thread(target=sched.shutdown)
    stopper.start()
    while not sched._stop:
        stopper.join(0.01)
    gate.set()
    stopper.join(30)
    assert not stopper.is_alive() and col.done.wait(10)
    assert [col.got[r][0] for r in "pqr"] == [(8, 5)] * 3
    assert isinstance(col.got["s"], EngineDeadError) and "s" not in runner.started
    assert calls == {"p": 1, "q": 1, "r": 1, "s": 1}
    with pytest.raises(EngineDeadError):
        sched.check_health()


def test_a_dead_decode_thread_stops_the_scheduler():
    class Fatal(BaseException):
        pass

    def boom(req, tokens, wav, err):  # a callback that escapes every handler kills the decode thread
        raise Fatal("callback crashed")

    runner, gate = SignallingRunner(), threading.Event()
    sched = NARScheduler(runner, _gated_decode(gate), window_s=0.0, max_batch=1)
    col = Collector(3)
    try:
        sched.submit(_req("x"), boom)
        assert runner.event("x").wait(5)
        _submit_in_order(sched, runner, "yzw", col)  # y in the hand-over, z unmasked behind it, w queued
        gate.set()
        assert col.done.wait(10)  # none of them waits forever
        with pytest.raises(EngineDeadError, match="callback crashed"):
            sched.check_health()
        with pytest.raises(EngineDeadError):
            sched.submit(_req("v"), col)
    finally:
        sched.shutdown()
    assert sorted(col.got) == ["w", "y", "z"] and all(isinstance(v, EngineDeadError) for v in col.got.values())
