"""``AsyncOmniVoice`` with a long input (tiny checkpoint, CPU, no HTTP): its sentence pieces reach the scheduler a
few at a time, so the first piece's audio comes before the last piece runs, another request runs between the
pieces instead of after the whole clip, a closed stream runs no further piece, and which pieces share a batch
changes no sample of a seeded request. The runner is gated (one batch per release) so that what is asserted
follows from the order of events, not from timing."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from _tiny_omnivoice import make_tiny_omnivoice
from strataserve.engine.omnivoice_requests import ChunkPolicy
from strataserve.engine.omnivoice_tts import AsyncOmniVoice
from strataserve.models.omnivoice.loader import load_omnivoice
from strataserve.types.speech import SpeechParams

#: one piece per sentence under POLICY; equal-length pieces, which a batched decode would stack
LONG = " ".join(["The cat sat on the mat."] * 4 + ["A dog ran in the park."] * 4)
SHORT = "Hello there."
POLICY = ChunkPolicy(chunk_threshold_s=2.0, chunk_s=1.5)
PARAMS = SpeechParams(seed=7, num_step=2)


@pytest.fixture(scope="module")
def ov(tmp_path_factory):
    path, _ = make_tiny_omnivoice(tmp_path_factory.mktemp("omnivoice") / "ckpt")
    return load_omnivoice(path, device="cpu")


class Gate:
    """Wraps the runner: each batch waits for a release and records its request ids."""

    def __init__(self, tts: AsyncOmniVoice) -> None:
        self.batches: list[list[str]] = []
        self.sem = threading.Semaphore(0)
        self.inner = tts.runner.generate
        tts.runner.generate = self.generate

    def generate(self, reqs, should_stop=None):
        assert self.sem.acquire(timeout=60), "the test never released this batch"
        self.batches.append([r.request_id for r in reqs])
        return self.inner(reqs, should_stop)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.sem.release()

    def batch_of(self, rid: str) -> int:
        return next(i for i, b in enumerate(self.batches) if rid in b)


def _run(tts: AsyncOmniVoice, coro):
    try:
        return asyncio.run(coro)
    finally:
        tts.shutdown()


def test_pieces_are_fed_progressively_and_other_requests_interleave(ov):
    tts = AsyncOmniVoice(ov, policy=POLICY)
    gate = Gate(tts)

    async def main():
        long = tts.synthesize(LONG, params=PARAMS, request_id="long")
        n = len(long.reqs)
        assert n >= 6
        it = long.__aiter__()
        gate.release()
        first = await it.__anext__()  # the first batch alone gave audio
        assert len(first) > 0 and gate.batches == [["long.0", "long.1"]]
        short = tts.synthesize(SHORT, params=PARAMS, request_id="short")
        gate.release(100)
        rest = [c async for c in it]
        got_short = [c async for c in short]
        return n, rest, got_short

    n, rest, got_short = _run(tts, main())
    assert len(rest) == n - 1 and len(got_short) == 1
    assert all(sum(rid.startswith("long.") for rid in b) <= 2 for b in gate.batches)
    # the short request ran between the long one's pieces, well before its last piece
    assert gate.batch_of("short.0") < gate.batch_of(f"long.{n - 1}")
    assert tts.num_waiting == 0


def test_a_closed_stream_runs_no_further_piece(ov):
    tts = AsyncOmniVoice(ov, policy=POLICY)
    gate = Gate(tts)
    timings = []
    tts.observers.append(timings.append)

    async def main():
        long = tts.synthesize(LONG, params=PARAMS, request_id="long")
        it = long.__aiter__()
        gate.release()
        await it.__anext__()
        await it.aclose()  # the client hung up after the first piece
        gate.release(100)
        after = [c async for c in tts.synthesize(SHORT, params=PARAMS, request_id="after")]
        return len(long.reqs), after

    n, after = _run(tts, main())
    ran = [rid for b in gate.batches for rid in b if rid.startswith("long.")]
    # what was queued when it closed (at most two pieces ahead) may have run; nothing was submitted after
    assert set(ran) <= {"long.0", "long.1", "long.2", "long.3"} and n > 4, ran
    assert len(after) == 1 and [t.finish_reason for t in timings] == ["abort", "stop"]


def test_batch_composition_changes_no_sample(ov):
    """The same seeded long request alone, beside other requests, and with all its pieces in one batch; and its
    first piece (seed + 0) against that sentence sent alone."""
    async def clip(tts, text=LONG, others=0):
        rest = [tts.synthesize(LONG, params=SpeechParams(seed=1, num_step=2)) for _ in range(others)]
        main = tts.synthesize(text, params=PARAMS)
        got = [c async for c in main]
        for o in rest:
            [c async for c in o]
        return got, main.frames

    outs = []
    for ahead, others in ((2, 0), (2, 2), (16, 0)):
        tts = AsyncOmniVoice(ov, policy=POLICY, pieces_ahead=ahead)
        outs.append(_run(tts, clip(tts, others=others)))
    for chunks, frames in outs[1:]:
        assert frames == outs[0][1]  # tokens never depended on the batch
        assert all(np.array_equal(a, b) for a, b in zip(chunks, outs[0][0], strict=True))  # nor does the decode
    tts = AsyncOmniVoice(ov, policy=POLICY)
    (alone,), _ = _run(tts, clip(tts, text=LONG.split(". ")[0] + "."))
    assert np.array_equal(outs[0][0][0], alone)


def test_a_running_batch_whose_requests_all_hung_up_stops(ov):
    """Both pieces of a batch cancelled while it runs (here: while the gate holds it): none of its steps run
    (no batch statistics), no callback comes, and the scheduler serves the next request."""
    tts = AsyncOmniVoice(ov, policy=POLICY)
    gate = Gate(tts)
    finished, answers = [], []
    tts.runner.observers.append(finished.append)
    reqs, _ = tts.requests.build("gone", LONG, params=PARAMS)
    for r in reqs[:2]:
        tts.scheduler.submit(r, lambda *a: answers.append(a))
    for _ in range(6000):  # until the worker has taken the batch: it waits at the gate
        if tts.scheduler.num_running == 2:
            break
        threading.Event().wait(0.01)
    for r in reqs[:2]:
        tts.scheduler.cancel(r.request_id)
    gate.release(100)
    after = _run(tts, _collect(lambda: tts.synthesize(SHORT, params=PARAMS, request_id="after")))
    assert gate.batches[0] == ["gone.0", "gone.1"] and answers == [] and len(after) == 1
    assert len(finished) == len(gate.batches) - 1  # every batch but the abandoned one ran to its end


async def _collect(start):
    return [c async for c in start()]
