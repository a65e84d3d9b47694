"""Start-up timing: named phases and their wall seconds, for the breakdown ``strata serve`` prints when it is ready
(engine process: spawn, imports, weights, KV sizing, graph capture, ...; API process: imports, tokenizer, HTTP).
Neutral module: the runner, the engine process and the API process all record into a ``Phases``."""
from __future__ import annotations

import gc
import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Iterator

_IMPORTED = time.monotonic()


def process_age() -> float:
    """Seconds since this process started (Linux: its start time in /proc; elsewhere since this module loaded)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class Phases:
    """An ordered record of (phase, seconds)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, float]] = []

    def add(self, name: str, seconds: float) -> None:
        self.items.append((name, round(seconds, 3)))

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)


def format_phases(items: list[tuple[str, float]] | list[list]) -> str:
    """``weights 3.1 s · KV sizing 0.4 s · ...`` (phases under 5 ms left out)."""
    return " · ".join(f"{name} {sec:.2f} s" for name, sec in items if sec >= 0.005)


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (imports, tokenizer, model, app: ~260k in the API process)
    out of the collector's generations, so a full collection walks only what came after: in the API process those
    walks took ~85 ms each, every stream stalled meanwhile (``docs/performance.md``, "GC"). Objects frozen are
    still freed by reference counting; only cycles among them stay. Call once a process is ready; returns how many
    objects are frozen (0 with ``STRATA_GC_FREEZE=0``)."""
    from strataserve import envs

    if not envs.STRATA_GC_FREEZE:
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()



@contextmanager
def heap_set_aside() -> Iterator[None]:
    """For the offline ``LLM``'s generate loop, which runs in the caller's own process (so its heap is not frozen
    for good, as the server's processes freeze theirs): objects alive when the loop starts are left out of the
    collector's walks while it runs and handed back to the oldest generation at its end. Each full collection
    otherwise walks the whole start-up heap (~400k objects: torch, transformers, the model), and a loop that
    allocates much (logprobs: a few objects per token) sets off many: 11.6 µs per output position for logprobs'
    objects instead of 1.3 (``docs/performance.md``, "The offline loop's heap set aside"). Nothing is collected
    less in the end; only when. Left alone where a freeze is already in place (the caller's own, or an outer
    loop's), and with ``STRATA_GC_FREEZE=0``."""
    from strataserve import envs

    if not envs.STRATA_GC_FREEZE or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def leave_stopping_to_the_parent() -> None:
    """For a child process of ``strata serve`` (engine core, tensor-parallel rank, isolated Python model). A signal
    sent to the whole process group (Ctrl-C; SIGTERM from systemd, ``timeout``, supervisord's ``stopasgroup``)
    reaches the children too, but the front drains first and then stops them itself: so SIGINT is ignored, and
    SIGTERM ends the child only once its parent is gone (Linux's parent-death signal sends one)."""
    parent = os.getppid()

    def on_term(*_: object) -> None:
        if os.getppid() != parent:
            sys.exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_term)
