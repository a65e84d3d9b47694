"""More than one name for a served model: vLLM's ``--served-model-name NAME [ALIAS ...]``.

Every name routes to the model and is listed in ``/v1/models`` (vLLM lists one card per name); responses, metrics
and logs use the first name, as vLLM's do. The aliases are a map in front of the router's own lookup, so the
backends, their metrics and their lifecycle stay keyed by the one real name.
"""
from __future__ import annotations

from strataserve.router.router import Router
from strataserve.router.types import Backend, Payload


class AliasRouter(Router):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aliases: dict[str, str] = {}  # alias -> the backend's name

    def add(self, backend: Backend) -> None:
        if backend.name in self.aliases:
            raise ValueError(f"model name {backend.name!r} is served twice: give each model its own name")
        super().add(backend)

    def add_alias(self, alias: str, name: str) -> None:
        """Serve the model ``name`` under ``alias`` too."""
        if name not in self.backends:
            raise ValueError(f"no model {name!r} to give the name {alias!r}")
        if alias in self.backends or alias in self.aliases:
            raise ValueError(f"model name {alias!r} is served twice: give each model its own name")
        self.aliases[alias] = name

    def aliases_of(self, name: str) -> list[str]:
        return [alias for alias, target in self.aliases.items() if target == name]

    def names(self) -> list[str]:
        return [*super().names(), *self.aliases]

    def resolve(self, model: str | None, payload: Payload) -> Backend:
        return super().resolve(self.aliases.get(model, model) if model is not None else None, payload)
