"""Read a checkpoint's weight files into the OS page cache from a background thread, while the engine process is
still importing torch.

Why: on a cold start (files not in the page cache: a reboot, a model evicted by others) the loader waits on the
disk, tensor by tensor, after ~2.5-5 s of imports during which the disk sat idle. Plain sequential reads into a
scratch buffer keep the disk busy from the process's first moments; the loader then finds the pages cached.
(``posix_fadvise(WILLNEED)`` was tried first: the loader's reads after it ran 4x slower than a cold read here.)

Only standard-library imports, so it can start before torch loads. Bounded by the memory available when it starts
(half of it, so the pages read first are still cached when the loader gets there); files in the loader's order.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_CHUNK = 8 << 20


def weight_files(model_dir: str | Path) -> list[Path]:
    """The folder's ``*.safetensors`` files in name order (the shards' load order)."""
    folder = Path(model_dir)
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def available_memory() -> int:
    """Bytes of memory the OS reports available (0 where it cannot say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def prefetch_files(files: list[Path], budget: int) -> threading.Thread | None:
    """Start a daemon thread reading ``files`` in order, at most ``budget`` bytes in all; None if nothing to do."""
    if not files or budget <= 0:
        return None

    def run() -> None:
        left = budget
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # the loader reports a missing or unreadable file itself
            try:
                offset = 0
                while left > 0:
                    n = os.preadv(fd, [view[:min(_CHUNK, left)]], offset)
                    if n <= 0:
                        break
                    offset += n
                    left -= n
            except OSError as exc:
                log.debug("prefetch of %s stopped: %s", path, exc)
            finally:
                os.close(fd)
            if left <= 0:
                return

    t = threading.Thread(target=run, name="strata-prefetch", daemon=True)
    t.start()
    return t


def prefetch_checkpoint(model_dir: str | Path) -> threading.Thread | None:
    """``prefetch_files`` over the checkpoint's weight files, within half the available memory."""
    return prefetch_files(weight_files(model_dir), available_memory() // 2)
