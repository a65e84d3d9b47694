"""Value types of the ``strata`` command's flags: each parses one flag's text or raises ``ArgumentTypeError``
saying what to give instead (argparse then prints the usage and that message); and the one check of flag values
that needs more than their text (the TLS pair, loaded once)."""
from __future__ import annotations

import argparse
from typing import Callable


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def _number(text: str, give: str, ok: Callable[[float], bool], must: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: give {give}") from None
    if not ok(value):  # the comparisons also refuse nan
        raise argparse.ArgumentTypeError(f"{text}: must be {must}")
    return value


def positive_float(text: str) -> float:
    return _number(text, "a number of seconds", lambda v: v > 0, "> 0")


def positive_mib(text: str) -> float:
    """A size in MiB (the body, queue and gRPC message limits)."""
    return _number(text, "a size in MiB", lambda v: 0 < v < float("inf"), "a size in MiB > 0")


def seconds(text: str) -> float:
    """A time in seconds >= 0 (0: at once)."""
    return _number(text, "a number of seconds", lambda v: 0 <= v < float("inf"), "a number of seconds >= 0")


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


def str_list(text: str) -> list[str]:
    """A JSON list (vLLM's form: '["https://a.example"]') or comma-separated values."""
    import json

    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text}: not a JSON list ({exc})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{text}: give a JSON list of strings")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


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


def check_tls_pair(certfile: str, keyfile: str) -> None:
    """Load the pair once before anything starts: a bad one would otherwise fail deep in uvicorn or gRPC (gRPC
    says only that it cannot bind the port)."""
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a usable certificate and key "
                         f"(PEM, the key matching the certificate): {exc}") from None
