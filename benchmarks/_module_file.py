"""Import another version of a module from a file (e.g. ``git show REV:strataserve/kernels/decode_attention.py``),
for the A/B benchmarks that time this tree's kernels against an earlier tree's in the same run."""
from __future__ import annotations

import importlib.util
from types import ModuleType


def load_module(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python module file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
