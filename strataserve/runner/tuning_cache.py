"""Start-up measurements kept on disk, so that a restart on the same machine reuses them instead of measuring again.

A record is JSON under ``STRATA_KERNEL_CACHE`` (default ``~/.cache/strataserve/kernels``), named by a hash of
everything its outcome depends on (the caller's ``key``: GPU, versions, shapes, candidates, kernel source). A
changed input gives another name, so nothing is ever stale; delete the folder to measure afresh. Reading or
writing failures only log: the caller measures as if nothing were cached.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from strataserve import envs

log = logging.getLogger(__name__)


def environment_key(weight, kernel_file: str) -> dict[str, Any]:
    """What every timing depends on besides the shapes and candidates: the GPU, ``weight``'s dtype, the torch and
    Triton versions and the kernel's source (a hash of ``kernel_file``)."""
    import torch
    import triton

    dev = weight.device
    cuda = dev.type == "cuda"
    return {"gpu": torch.cuda.get_device_name(dev) if cuda else str(dev),
            "capability": torch.cuda.get_device_capability(dev) if cuda else None,
            "dtype": str(weight.dtype), "torch": torch.__version__, "triton": triton.__version__,
            "kernel": hashlib.sha256(Path(kernel_file).read_bytes()).hexdigest()[:16]}


def record_path(kind: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(envs.STRATA_KERNEL_CACHE) / f"{kind}-{digest}.json"


def load(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())["value"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the unreadable tuning record %s (%s): measuring again", path, exc)
        return None


def save(path: Path, key: dict[str, Any], value: Any) -> None:
    """Atomically (a temporary file renamed), with the key beside the value for whoever reads the file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": value}, f, default=str, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep the tuning record %s (%s): the next start measures again", path, exc)
