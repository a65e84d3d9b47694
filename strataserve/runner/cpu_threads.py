"""``CpuThreadGovernor``: the CPU engine's torch thread count, following how many cores other work leaves free.

Why: every torch op is an OpenMP region that ends at a barrier, so with N threads a step advances only as fast as
the slowest thread gets a core. On a machine whose cores other processes also want (the API process and clients of
``strata serve``, other jobs), the worker threads wait for each other through every one of the few hundred
regions of a step; one thread then outruns two (docs/performance.md, "CPU threads"). On an idle machine two
threads are faster. So the engine loop samples the number of runnable threads of the whole machine
(``/proc/loadavg``) minus its own, smooths it, and uses ``cores - others`` threads (at least 1, at most the count
torch started with), with hysteresis so that it does not flap.

Linux only (``/proc``); elsewhere, or with ``STRATA_CPU_THREADS=fixed``, the count stays as torch set it.
"""
from __future__ import annotations

import os
import time

import torch

# Seconds between samples (one sample costs ~0.1 ms: a few small /proc reads), smoothing weight of a new sample,
# and how far the free-core estimate must pass a boundary before the count changes.
_INTERVAL_S = 0.02
_ALPHA = 0.2
_HYSTERESIS = 0.3


def _runnable_total() -> int:
    with open("/proc/loadavg", "rb") as f:
        return int(f.read().split()[3].split(b"/")[0])


def _runnable_own() -> int:
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"R":
            n += 1
    return n


class CpuThreadGovernor:
    """Call ``tick()`` once per engine step; it re-samples at most every ``_INTERVAL_S`` seconds."""

    def __init__(self, max_threads: int | None = None, interval_s: float = _INTERVAL_S) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.interval_s = interval_s
        self.threads = torch.get_num_threads()
        self.others = 0.0  # smoothed runnable threads that are not ours
        self.changes = 0
        self._next = 0.0

    @classmethod
    def for_device(cls, device: torch.device | str | None) -> "CpuThreadGovernor | None":
        """A governor for a CPU engine on Linux with more than one thread allowed (None otherwise)."""
        from strataserve import envs

        if envs.STRATA_CPU_THREADS != "adaptive" or device is None or torch.device(device).type != "cpu":
            return None
        if not os.path.exists("/proc/loadavg") or torch.get_num_threads() < 2:
            return None
        return cls()

    def tick(self) -> None:
        """Sample (when due) and adjust the thread count."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        try:
            others = max(0, _runnable_total() - _runnable_own())
        except (OSError, ValueError, IndexError):
            return
        self.observe(others)

    def observe(self, others: int) -> int:
        """Fold one sample in and apply the thread count it leads to (returned)."""
        self.others += _ALPHA * (others - self.others)
        free = self.max_threads - self.others
        want = self.threads
        if free < self.threads - _HYSTERESIS - 0.5:
            want = self.threads - 1
        elif free > self.threads + _HYSTERESIS + 0.5:
            want = self.threads + 1
        want = max(1, min(self.max_threads, want))
        if want != self.threads:
            torch.set_num_threads(want)
            self.threads = want
            self.changes += 1
        return want

    def release(self) -> None:
        """Back to the starting count (the engine went idle); the smoothed load is kept for the next tick."""
        if self.threads != self.max_threads:
            torch.set_num_threads(self.max_threads)
            self.threads = self.max_threads
