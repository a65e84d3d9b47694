"""The CPU thread governor: a thread fewer while its threads wait for a core, probes to win it back."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from strataserve import envs
from strataserve.runner import cpu_threads
from strataserve.runner.cpu_threads import (CpuThreadGovernor, busy_fractions, max_wait_fraction,
                                             read_thread_times)


def test_drops_a_thread_under_contention_and_probes_back_with_backoff(two_threads):
    gov = CpuThreadGovernor(max_threads=2, probe_s=1.0, max_probe_s=4.0)
    assert gov.observe(0.15, now=0.0) == 2  # a busy front end's short bursts: both threads stay
    assert gov.observe(0.45, now=0.25) == 1 and torch.get_num_threads() == 1
    assert gov.observe(0.0, now=0.5) == 1  # no try before probe_s has passed
    assert gov.observe(0.0, now=1.25) == 2  # the try
    assert gov.observe(0.5, now=1.5) == 1  # ... failed: the next one waits twice as long
    assert gov.observe(0.0, now=3.0) == 1
    assert gov.observe(0.0, now=3.5) == 2
    assert gov.observe(0.4, now=3.75) == 1  # failed again: 4 s (the cap), not 8
    assert gov.observe(0.0, now=7.5) == 1
    assert gov.observe(0.0, now=7.75) == 2
    assert gov.observe(0.1, now=8.0) == 2  # the try held
    assert gov.observe(0.1, now=8.25) == 2
    assert gov.observe(0.6, now=8.5) == 1  # new contention: the probe interval starts afresh at probe_s
    assert gov.observe(0.0, now=9.5) == 2
    assert gov.changes == 8 and torch.get_num_threads() == 2


def test_never_below_one_thread_nor_above_the_starting_count(two_threads):
    gov = CpuThreadGovernor(max_threads=2)
    for i in range(4):  # 0 .. 0.75 s: contended, and no try before 1 s
        gov.observe(0.9, now=i * 0.25)
    assert gov.threads == 1
    gov.observe(0.0, now=100.0)
    gov.observe(0.0, now=200.0)
    assert gov.threads == 2 and torch.get_num_threads() == 2


def test_release_hands_torch_its_count_back_and_resumes(two_threads, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cpu_threads, "read_thread_times", lambda pid="self": {})
    gov = CpuThreadGovernor(max_threads=2, max_probe_s=16.0)
    gov.observe(0.5, now=0.0)
    assert gov.threads == 1
    gov.release()  # idle: an in-process engine's caller gets its threads back
    assert torch.get_num_threads() == 2
    clock[0] = 0.5
    gov.tick()  # busy again soon after: what was learnt still holds
    assert gov.threads == 1 and torch.get_num_threads() == 1
    gov.release()
    clock[0] = 60.0
    gov.tick()  # after a long pause it starts over at the full count
    assert gov.threads == 2 and torch.get_num_threads() == 2
    gov.observe(0.5, now=60.5)
    gov.observe(0.0, now=62.0)
    assert gov.threads == 2 and gov.probing
    gov.release()  # idle in the middle of a try: the try is not taken as passed
    clock[0] = 62.5
    gov.tick()
    assert gov.threads == 1 and not gov.probing and torch.get_num_threads() == 1


def test_wait_fraction_counts_busy_threads_only():
    before = {1: (0, 0), 2: (0, 0), 3: (0, 0)}
    after = {1: (int(0.6e9), int(0.2e9)),   # busy, waited 20% of the second
             2: (int(0.05e9), int(0.9e9)),  # an idle helper thread: its waits do not count
             3: (int(0.5e9), int(0.35e9)),  # busy, waited 35%: the slowest thread decides
             4: (int(1e9), int(1e9))}       # new in this window: no baseline
    assert max_wait_fraction(before, after, 1.0) == pytest.approx(0.35)
    assert sorted(busy_fractions(before, after, 1.0)) == [pytest.approx((0.5, 0.35)), pytest.approx((0.6, 0.2))]
    assert max_wait_fraction(before, before, 1.0) == 0.0


# A spinner signals once it spins: the contention phase starts from there, not from a guess at start-up time.
_SPIN = "import sys\nsys.stdout.write('x')\nsys.stdout.flush()\nwhile True:\n    pass\n"


def _start_spinners(n: int) -> list[subprocess.Popen]:
    procs = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.PIPE))
        for p in procs:
            assert p.stdout.read(1) == b"x", "a spinner died before spinning"
    except BaseException:
        _stop(procs)
        raise
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()  # reaped: nothing of theirs is left on a core for the quiet phase
        p.stdout.close()


def _runnable() -> str:
    """The machine's runnable tasks (``/proc/loadavg``'s 4th field: running/total), for the failure message."""
    with open("/proc/loadavg") as f:
        return f.read().split()[3]


# Generous, because a loaded CI machine slows the test, not the governor's decisions: each wait below ends as soon
# as the state it waits for is reached, so an idle machine takes only the time the behaviour needs (~2 s). Under
# pytest's 300 s timeout, so that a failure says what the governor saw.
_LIMIT_S = 240.0


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux schedstat")
def test_real_contention_drops_a_thread_and_quiet_wins_it_back(two_threads):
    """Two processes spinning on a two-core machine: torch's two threads wait for a core most of the time. Once
    they stop, a try of the second thread holds. That needs the two cores free: other processes that keep them
    busy for the whole limit rightly keep the governor at one thread (the message then shows them)."""
    assert read_thread_times()[os.getpid()][0] > 0  # this thread's own run time
    if (os.cpu_count() or 1) != 2:
        pytest.skip("written for two cores: the spinners must outnumber the free ones")
    # Short windows and tries: on a machine that other work keeps busy in bursts, a try needs only a short quiet
    # stretch to land in.
    gov = CpuThreadGovernor(max_threads=2, window_s=0.1, probe_s=0.3, max_probe_s=0.6)
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    end = time.monotonic() + _LIMIT_S

    def work(until) -> None:
        while not until() and time.monotonic() < end:
            for _ in range(20):
                a @ b
            gov.tick()

    spinners = _start_spinners(2)
    try:
        work(lambda: gov.threads == 1)
        assert gov.threads == 1, f"largest wait {gov.last_wait:.2f} with two spinners"
        work(lambda: gov.probing)  # a try of the second thread comes probe_s later ...
        assert gov.probing, "no try of a second thread under contention"
        work(lambda: not gov.probing)  # ... and the window it runs in takes it back
        assert gov.threads == 1, f"a try held with two spinners (largest wait {gov.last_wait:.2f})"
    finally:
        _stop(spinners)
    work(lambda: gov.threads == 2 and not gov.probing)  # a try at least every 0.7 s; one holds once quiet
    assert gov.threads == 2 and not gov.probing, \
        f"largest wait {gov.last_wait:.2f} after the spinners stopped; runnable tasks now {_runnable()}"


def test_only_for_cpu_engines_and_can_be_fixed(two_threads, monkeypatch):
    assert CpuThreadGovernor.for_device(None) is None
    assert CpuThreadGovernor.for_device("cuda") is None
    gov = CpuThreadGovernor.for_device("cpu")
    assert gov is not None
    gov.tick()
    gov.tick()
    assert gov.threads == 2
    gov.release()
    monkeypatch.setattr(envs, "STRATA_CPU_THREADS", "fixed")
    assert CpuThreadGovernor.for_device("cpu") is None
