"""``CpuThreadGovernor``: the CPU engine's torch thread count, lowered while its threads wait for a core.

Why: every torch op is an OpenMP region that ends at a barrier, so with N threads a step advances only as fast as
the slowest thread gets a core. When other processes keep a core busy (another job on a shared machine), a worker
thread waits in the run queue through many of a step's few hundred regions and the others wait for it at each
barrier: one thread then outruns two (docs/performance.md, "CPU threads"). Short bursts of other work (the API
process and clients of ``strata serve``) cost far less than the core a thread fewer gives up.

What it measures: how long its own threads sat runnable without a core. The kernel keeps that per thread in
``/proc/self/task/<tid>/schedstat`` (run time, run-queue wait). Every ``window_s`` it takes the largest wait
fraction among the process's busy threads (the slowest thread is the one every barrier waits for):
- above ``_WAIT_HIGH`` with more than one thread: one thread fewer;
- otherwise, below the starting count: after ``probe_s`` it tries one thread more, and keeps it if that window's
  wait stays under the bar; a failed try doubles the time to the next one (up to ``_MAX_PROBE_S``), so a machine
  that stays busy is probed rarely.
Measured on 2 cores (docs/performance.md, "CPU threads"): behind ``strata serve`` at concurrency 64 the engine's
two threads wait 11-19% of the time (two threads: ~40% more tokens/s than one); next to one process spinning on
a core they wait 34-41% (one thread: 42-52% more than two). The bar sits between.

Linux with schedstat (``/proc/self/schedstat``) only; elsewhere, or with ``STRATA_CPU_THREADS=fixed``, the count
stays as torch set it.
"""
from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger(__name__)

# Largest run-queue wait fraction (of the window's wall time) one busy thread may show before a thread is dropped.
_WAIT_HIGH = 0.3
# A thread counts as busy in a window when it ran at least this fraction of it (idle helper threads are left out).
_BUSY_MIN = 0.1
_WINDOW_S = 0.25
_PROBE_S = 1.0
_MAX_PROBE_S = 16.0

ThreadTimes = dict[int, tuple[int, int]]  # tid -> (ns on a core, ns waiting in the run queue), cumulative


def read_thread_times(pid: int | str = "self") -> ThreadTimes:
    """Cumulative run and run-queue wait nanoseconds of each thread of ``pid`` (threads that end are skipped)."""
    out: ThreadTimes = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat", "rb") as f:
                run, wait, _ = f.read().split()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (int(run), int(wait))
    return out


def busy_fractions(before: ThreadTimes, after: ThreadTimes, wall_s: float) -> list[tuple[float, float]]:
    """(run, run-queue wait) fractions of ``wall_s`` for the threads that ran at least ``_BUSY_MIN`` of it and
    existed at both readings."""
    wall_ns = wall_s * 1e9
    if wall_ns <= 0:
        return []
    out = []
    for tid, (run1, wait1) in after.items():
        prev = before.get(tid)
        if prev is not None and run1 - prev[0] >= _BUSY_MIN * wall_ns:
            out.append(((run1 - prev[0]) / wall_ns, (wait1 - prev[1]) / wall_ns))
    return out


def max_wait_fraction(before: ThreadTimes, after: ThreadTimes, wall_s: float) -> float:
    """Largest run-queue wait fraction among the busy threads (the one every barrier waits for)."""
    return max((wait for _, wait in busy_fractions(before, after, wall_s)), default=0.0)


class CpuThreadGovernor:
    """Call ``tick()`` once per engine step; it measures and decides at most once per ``window_s``."""

    def __init__(self, max_threads: int | None = None, window_s: float = _WINDOW_S, probe_s: float = _PROBE_S,
                 max_probe_s: float = _MAX_PROBE_S) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.window_s = window_s
        self.probe_s = probe_s
        self.max_probe_s = max_probe_s
        self.threads = torch.get_num_threads()
        self.changes = 0
        self.last_wait = 0.0  # the latest window's largest wait fraction
        self._probing = False  # the current window tries one thread more than the last settled count
        self._probe_wait_s = probe_s
        self._next_probe = 0.0
        self._t0: float | None = None
        self._times0: ThreadTimes = {}
        self._idle_since: float | None = None  # set by release(): torch has its own count back meanwhile

    @property
    def probing(self) -> bool:
        """The current window tries one thread more than the count last settled on."""
        return self._probing

    @classmethod
    def for_device(cls, device: torch.device | str | None) -> "CpuThreadGovernor | None":
        """A governor for a CPU engine on Linux (with schedstat) and more than one thread allowed (None otherwise)."""
        from strataserve import envs

        if envs.STRATA_CPU_THREADS != "adaptive" or device is None or torch.device(device).type != "cpu":
            return None
        if not os.path.exists("/proc/self/schedstat") or torch.get_num_threads() < 2:
            return None
        return cls()

    def tick(self) -> None:
        """End the window when due: measure it and adjust the thread count."""
        now = time.monotonic()
        if self._idle_since is not None:
            self._resume(now)
        if self._t0 is not None and now < self._t0 + self.window_s:
            return
        try:
            times = read_thread_times()
        except OSError:
            return
        if self._t0 is not None:
            self.observe(max_wait_fraction(self._times0, times, now - self._t0), now)
        self._t0, self._times0 = now, times

    def observe(self, wait: float, now: float) -> int:
        """Fold in one window's largest wait fraction (seen at time ``now``); apply and return the thread count."""
        self.last_wait = wait
        want = self.threads
        if wait > _WAIT_HIGH and self.threads > 1:
            # A failed try waits twice as long for the next one; contention that arrives anew starts afresh.
            self._probe_wait_s = min(2 * self._probe_wait_s, self.max_probe_s) if self._probing else self.probe_s
            self._next_probe = now + self._probe_wait_s
            want = self.threads - 1
        elif self._probing:
            self._probe_wait_s = self.probe_s  # the try held: the extra thread stays
        elif self.threads < self.max_threads and now >= self._next_probe:
            want = self.threads + 1
        self._probing = want > self.threads
        self._apply(want)
        return self.threads

    def _apply(self, want: int) -> None:
        want = max(1, min(self.max_threads, want))
        if want != self.threads:
            log.debug("CPU engine threads %d -> %d (largest run-queue wait %.0f%%)", self.threads, want,
                      100 * self.last_wait)
            torch.set_num_threads(want)
            self.threads = want
            self.changes += 1

    def release(self) -> None:
        """The engine went idle: torch gets its starting count back (an in-process engine shares it with the
        caller). The count chosen so far resumes with the next step, unless the pause outlasted the longest
        probe interval; the next busy stretch starts a fresh window either way."""
        if self._idle_since is None:
            self._idle_since = time.monotonic()
            if self._probing:  # an untried extra thread is not kept: resume at the count last settled on
                self.threads -= 1
            if self.threads != self.max_threads:
                torch.set_num_threads(self.max_threads)
        self._probing = False
        self._t0 = None

    def _resume(self, now: float) -> None:
        idle_s, self._idle_since = now - self._idle_since, None  # type: ignore[operator]
        if idle_s > self.max_probe_s:  # what was learnt is stale: start over at the full count
            self.threads, self._probe_wait_s, self._next_probe = self.max_threads, self.probe_s, 0.0
        elif self.threads != self.max_threads:
            torch.set_num_threads(self.threads)
