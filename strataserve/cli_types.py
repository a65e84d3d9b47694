"""Value types of the ``strata`` command's flags: each parses one flag's text or raises ``ArgumentTypeError``
saying what to give instead (argparse then prints the usage and that message)."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: give a number of seconds") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text}: must be > 0")
    return value


def step_ms(text: str) -> float | None:
    """``--target-step-ms``: milliseconds >= 0, or ``auto`` (None: the engine decides, ``engine/step_budget.py``)."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: give milliseconds (0 = off) or auto") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0 (0 turns step pacing off) or auto")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: a port is in 0..65535")
    return value


def api_key(text: str) -> str:
    """A key to require; an empty one (``--api-key "$KEY"`` with KEY unset) would serve everyone without one."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the key is empty (an unset variable in --api-key \"$KEY\", or an empty "
                                         "STRATA_API_KEY?): give a key, or leave the flag out to serve without one")
    return text
