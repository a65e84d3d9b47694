"""Service-level classes: which class a request belongs to, and what that class promises.

The class comes from the ``x-sla-class`` header, or from the API key when keys are mapped to classes in the
config. A mapped key is a ceiling, not a suggestion: its requests may ask (by header) for a class of equal or
lower priority, never a higher one, so a batch key cannot buy interactive latency by setting a header.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from strataserve.api.errors import APIError

SLA_HEADER = "x-sla-class"


@dataclass(frozen=True)
class SLA:
    name: str
    priority: int = 0  # lower runs first, as the engine orders its queues
    ttft_ms: float | None = None
    tpot_ms: float | None = None


class SLAPolicy:
    def __init__(self, classes: Mapping[str, SLA], default: str, key_classes: Mapping[str, str] | None = None):
        if default not in classes:
            raise ValueError(f"default SLA class {default!r} is not declared")
        self.classes = dict(classes)
        self.default = default
        self.key_classes = dict(key_classes or {})

    @classmethod
    def single(cls) -> "SLAPolicy":
        return cls({"default": SLA("default")}, "default")

    def names(self) -> list[str]:
        return list(self.classes)

    def resolve(self, header: str | None, api_key: str | None) -> SLA:
        """The class of a request; 400 for an unknown class, 403 for one above the key's class."""
        ceiling = self.classes[self.key_classes[api_key]] if api_key in self.key_classes else None
        if header:
            sla = self.classes.get(header.strip())
            if sla is None:
                raise APIError(400, f"unknown SLA class {header!r} in the {SLA_HEADER} header: use one of "
                               f"{', '.join(self.classes)}", param=SLA_HEADER, code="unknown_sla_class")
            if ceiling is not None and sla.priority < ceiling.priority:
                raise APIError(403, f"this API key is limited to SLA class {ceiling.name!r}; it cannot ask for "
                               f"{sla.name!r}", param=SLA_HEADER, code="sla_class_forbidden")
            return sla
        return ceiling if ceiling is not None else self.classes[self.default]


def bearer_key(authorization: str | None) -> str | None:
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None
