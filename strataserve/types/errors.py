"""Errors every layer may raise or catch (the API maps them to HTTP/gRPC statuses)."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core stopped (crashed or was shut down); requests in flight cannot complete."""


class EngineStartupError(RuntimeError):
    """The engine process could not load the model; the message says why."""
