"""Dynamic batcher with preferred batch sizes, as Triton's GetDynamicBatch forms batches: every preferred size
counts (not only the largest), a formable preferred batch runs at once, and only a batch that is not (yet) a
preferred size waits for max_queue_delay."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _model_repos import add_python_scale
from ms_helpers import outputs, request, run, serving

from strataserve.modelserver.batcher import batch_cut

DELAY_S = 30.0  # far longer than any test may take: a request that waits for it fails the test (by timeout)


@pytest.mark.parametrize("rows, preferred, delay_s, waited_s, expected", [
    ([1], (2, 4), DELAY_S, 0.0, None),  # not a preferred size yet: wait for more
    ([1, 1], (2, 4), DELAY_S, 0.0, 2),  # the smaller preferred size goes at once
    ([1, 1, 1], (2, 4), DELAY_S, 0.0, 2),  # the largest preferred prefix goes; the rest waits
    ([1, 1, 1, 1, 1], (2, 4), DELAY_S, 0.0, 4),
    ([2, 1, 1], (2, 4), DELAY_S, 0.0, 3),
    ([3, 2], (4,), DELAY_S, 0.0, 1),  # more rows than the largest preferred size: what fits below it goes
    ([6], (4,), DELAY_S, 0.0, 1),  # one request beyond the largest preferred size goes alone
    ([1, 1, 1], (2, 4), DELAY_S, DELAY_S, 3),  # after the delay, everything that fits goes
    ([1], (), DELAY_S, 0.0, None),  # no preferred sizes: wait for max_batch_size rows...
    ([4, 4], (), DELAY_S, 0.0, 2),  # ...which go at once
    ([1, 1, 1], (2,), 0.0, 0.0, 2),  # no delay: a preferred prefix still cuts the batch (Triton does)
    ([1, 1, 1], (4,), 0.0, 0.0, 3),  # no delay and no preferred prefix: everything goes
])
def test_batch_cut_follows_tritons_rule(rows, preferred, delay_s, waited_s, expected):
    assert batch_cut(rows, preferred, 8, delay_s, waited_s) == expected


def _model(repo) -> None:
    add_python_scale(repo, max_queue_delay_us=int(DELAY_S * 1e6), preferred=(2, 4))


def _batch(resp) -> int:
    return int(outputs(resp)["BATCH"][0, 0])


def test_a_smaller_preferred_size_runs_without_waiting_for_the_delay(tmp_path):
    _model(tmp_path)
    x = np.zeros((1, 3), np.float32)

    async def main():
        async with serving(tmp_path) as server:
            # before the fix, two requests waited the whole delay: the timeout (well under it) fails the test
            two = await asyncio.wait_for(asyncio.gather(*(server.infer(request("py_scale", IN=x))
                                                          for _ in range(2))), DELAY_S / 3)
            four = await asyncio.wait_for(asyncio.gather(*(server.infer(request("py_scale", IN=x))
                                                           for _ in range(4))), DELAY_S / 3)
            return [_batch(r) for r in two], [_batch(r) for r in four]

    two, four = run(main())
    assert two == [2, 2]
    assert four in ([4] * 4, [2] * 4)  # 4 queued at once, or 2 + 2 if the batcher woke in between


def test_the_largest_preferred_prefix_runs_and_the_rest_waits(tmp_path):
    """Three queued rows with preferred [2, 4]: two run at once as a batch of 2; the third is not a preferred size
    on its own and stays queued until a fourth request makes it one."""
    _model(tmp_path)
    x = np.zeros((1, 3), np.float32)

    async def main():
        async with serving(tmp_path) as server:
            tasks = [asyncio.ensure_future(server.infer(request("py_scale", IN=x))) for _ in range(3)]
            pending = set(tasks)
            while len(pending) > 1:  # before the fix, none finished before the delay: the timeout fails the test
                _, pending = await asyncio.wait(pending, timeout=DELAY_S / 3, return_when=asyncio.FIRST_COMPLETED)
                assert pending != set(tasks), "no request was answered well within the delay"
            first = sorted(_batch(t.result()) for t in tasks if t not in pending)
            waiting = pending.pop()
            await asyncio.sleep(0.2)
            still_queued = not waiting.done()
            fourth = await asyncio.wait_for(server.infer(request("py_scale", IN=x)), DELAY_S / 3)
            third = await asyncio.wait_for(waiting, DELAY_S / 3)
            return first, still_queued, _batch(third), _batch(fourth)

    first, still_queued, third, fourth = run(main())
    assert first == [2, 2] and still_queued and third == fourth == 2
