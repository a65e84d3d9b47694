"""The NAR batching thread, driven by a fake runner (no model): requests arriving within the window share a batch,
batches never mix num_step or guidance on/off, the cap holds, a failing batch fails only its requests, a cancelled
waiting request gets no callback, shutdown fails what waits."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from strataserve.types.errors import EngineDeadError
from strataserve.engine.nar_scheduler import NARScheduler
from strataserve.runner.nar_runner import NARRequest, UnmaskSettings


class FakeRunner:
    len_step = 16

    def __init__(self, gate: threading.Event | None = None, fail_on: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.gate, self.fail_on = gate, fail_on

    def generate(self, reqs, should_stop=None):
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append([r.request_id for r in reqs])
        if self.fail_on in self.batches[-1]:
            raise RuntimeError("boom")
        return [torch.full((8, r.target_len), i) for i, r in enumerate(reqs)]


def _req(rid: str, steps: int = 4, guidance: float = 2.0, n: int = 5) -> NARRequest:
    return NARRequest(rid, torch.zeros(8, 3 + n, dtype=torch.long), 3, n, UnmaskSettings(num_step=steps,
                                                                                           guidance_scale=guidance))


class Collector:
    def __init__(self, expect: int) -> None:
        self.got: dict[str, object] = {}
        self.expect, self.done = expect, threading.Event()

    def __call__(self, req, tokens, wav, err) -> None:
        self.got[req.request_id] = err if err is not None else (tokens.shape, wav)
        if len(self.got) >= self.expect:
            self.done.set()


def test_window_batches_and_groups_by_steps_and_guidance():
    gate = threading.Event()
    runner = FakeRunner(gate)
    sched = NARScheduler(runner, lambda toks: [t.float().sum() for t in toks], window_s=0.2, max_batch=3)
    col = Collector(6)
    try:
        for req in (_req("a"), _req("b"), _req("c", steps=8), _req("d", guidance=0.0), _req("e"), _req("f")):
            sched.submit(req, col)
        gate.set()
        assert col.done.wait(10)
    finally:
        sched.shutdown()
    assert all(not isinstance(v, BaseException) for v in col.got.values())
    assert col.got["a"][0] == (8, 5)
    groups = [sorted(b) for b in runner.batches]
    assert ["a", "b"] in groups and ["c"] in groups and ["d"] in groups  # the first window held a, b, c (cap 3)
    assert all(len(b) <= 3 for b in groups) and sorted(sum(groups, [])) == list("abcdef")


def test_failed_batch_fails_its_requests_only_and_cancel_drops_a_waiting_one():
    gate = threading.Event()
    runner = FakeRunner(gate, fail_on="x")
    sched = NARScheduler(runner, None, window_s=0.0, max_batch=1)
    col = Collector(2)
    try:
        sched.submit(_req("x"), col)
        time.sleep(0.1)  # x is running (blocked on the gate)
        sched.submit(_req("y"), col)
        sched.submit(_req("z"), col)
        sched.cancel("z")
        gate.set()
        assert col.done.wait(10)
        time.sleep(0.2)
    finally:
        sched.shutdown()
    assert isinstance(col.got["x"], RuntimeError) and col.got["y"] == ((8, 5), None)
    assert "z" not in col.got
    with pytest.raises(EngineDeadError):
        sched.check_health()


def test_shutdown_fails_waiting_requests():
    gate = threading.Event()
    sched = NARScheduler(FakeRunner(gate), None, window_s=0.0, max_batch=1)
    col = Collector(2)
    sched.submit(_req("p"), col)
    time.sleep(0.1)
    sched.submit(_req("q"), col)
    threading.Timer(0.2, gate.set).start()
    sched.shutdown()
    assert col.done.wait(10)
    assert col.got["p"] == ((8, 5), None) and isinstance(col.got["q"], EngineDeadError)
    with pytest.raises(ValueError, match="max_batch"):
        NARScheduler(FakeRunner(), None, max_batch=0)
