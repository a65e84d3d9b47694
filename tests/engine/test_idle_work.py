"""Deferred start-up work done while the engine is idle (mixed-step CUDA graph capture, runner/mixed_graph.py):
the core process's loop does one piece at a time between non-blocking polls, stops once the core has none left,
and never lets it delay a request; the engine core offers it only when nothing runs or waits."""
from __future__ import annotations

import threading
import time

import msgspec
import zmq

from strataserve.engine.core_proc import ADD, SHUTDOWN, serve_core
from strataserve.engine.engine_core import EngineCore
from strataserve.types.protocol import EngineCoreOutputs, EngineCoreRequest
from strataserve.types.sampling import SamplingParams

from engine_fakes import FakeRunner, engine_config


class _IdleCore:
    """A core with ``pieces`` pieces of idle work; it records what it was asked to do, in order."""

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces
        self.log: list[str] = []
        self.pending: list[str] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def idle_work(self) -> bool:
        self.log.append("idle")
        time.sleep(0.01)
        self.pieces -= 1
        return self.pieces > 0

    def add_request(self, request: EngineCoreRequest) -> None:
        self.log.append(f"add {request.request_id}")
        self.pending.append(request.request_id)

    def abort_requests(self, ids: list[str]) -> None:  # pragma: no cover - not sent here
        pass

    def step(self) -> EngineCoreOutputs:
        self.log.append("step")
        self.pending.clear()
        return EngineCoreOutputs(outputs=[])

    def shutdown(self) -> None:
        self.log.append("shutdown")


def _serve(core: _IdleCore):
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    in_port = push.bind_to_random_port("tcp://127.0.0.1")
    out_port = pull.bind_to_random_port("tcp://127.0.0.1")
    t = threading.Thread(target=serve_core, args=(core, f"tcp://127.0.0.1:{in_port}",
                                                  f"tcp://127.0.0.1:{out_port}", lambda: False), daemon=True)
    t.start()
    return ctx, push, pull, t


def _wait(pred, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_loop_does_idle_work_piece_by_piece_and_serves_requests_between():
    core = _IdleCore(pieces=40)
    ctx, push, pull, t = _serve(core)
    try:
        _wait(lambda: core.log.count("idle") >= 3)
        req = EngineCoreRequest(request_id="r1", prompt_token_ids=[5, 6], sampling_params=SamplingParams())
        push.send_multipart([ADD, msgspec.msgpack.encode(req)])
        _wait(lambda: "step" in core.log)
        i = core.log.index("add r1")
        # the request went in after at most one more piece, and was stepped before any further idle work
        assert core.log[i + 1] == "step" and 3 <= core.log[:i].count("idle") < 40
        _wait(lambda: core.pieces == 0)
        n = len(core.log)
        time.sleep(0.3)  # the work is done: the loop blocks on the socket instead of asking again
        assert len(core.log) == n and core.log.count("idle") == 40
        push.send_multipart([SHUTDOWN])
        t.join(5)
        assert not t.is_alive() and core.log[-1] == "shutdown"
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_engine_core_offers_idle_work_only_when_nothing_runs():
    calls = []

    class Runner(FakeRunner):
        def idle_work(self) -> bool:
            calls.append(1)
            return True

    core = EngineCore(engine_config(), runner=Runner())
    assert core.idle_work() is True and len(calls) == 1
    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=[3, 4, 5],
                                       sampling_params=SamplingParams(max_tokens=2)))
    assert core.idle_work() is False and len(calls) == 1  # a request waits: no idle work
    while core.has_unfinished_requests():
        core.step()
    assert core.idle_work() is True and len(calls) == 2
    # a runner without deferred work: nothing to do
    assert EngineCore(engine_config(), runner=FakeRunner()).idle_work() is False
