"""The CPU thread governor: one thread while other processes want the cores, all of them again when they leave."""
from __future__ import annotations

import pytest
import torch

from strataserve import envs
from strataserve.runner.cpu_threads import CpuThreadGovernor


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_follows_the_free_cores_with_hysteresis(two_threads):
    gov = CpuThreadGovernor(max_threads=2)
    assert gov.observe(3) == 2  # one busy sample is smoothed away
    gov.others = 0.0
    for _ in range(10):
        gov.observe(2)  # two other runnable threads on two cores, for a while
    assert gov.threads == 1 and torch.get_num_threads() == 1
    gov.observe(0)
    assert gov.threads == 1  # one quiet sample does not flip it back
    for _ in range(20):
        gov.observe(0)
    assert gov.threads == 2 and torch.get_num_threads() == 2
    assert gov.changes == 2
    for _ in range(10):
        gov.observe(2)
    gov.release()  # the engine went idle: torch gets its count back
    assert torch.get_num_threads() == 2 and gov.threads == 2


def test_only_for_cpu_engines_and_can_be_fixed(two_threads, monkeypatch):
    assert CpuThreadGovernor.for_device(None) is None
    assert CpuThreadGovernor.for_device("cuda") is None
    gov = CpuThreadGovernor.for_device("cpu")
    assert gov is not None
    gov.tick()  # samples this machine's /proc
    assert 1 <= gov.threads <= 2 and gov.others >= 0
    gov.release()
    monkeypatch.setattr(envs, "STRATA_CPU_THREADS", "fixed")
    assert CpuThreadGovernor.for_device("cpu") is None
