"""The model server's table of repository models, and how each loaded ensemble's state follows its step models
(a step not ready, or loaded again with a config that no longer fits, makes the ensemble UNAVAILABLE with the
reason; it is READY again once the step is)."""
from __future__ import annotations

from dataclasses import dataclass, field

from strataserve.modelserver.config import ModelSpec
from strataserve.modelserver.ensemble import validate_ensemble
from strataserve.modelserver.model import ServedVersion
from strataserve.types.tensors import ModelServerError


@dataclass
class Entry:
    """One repository model as the server holds it: its served versions and their listed states."""

    name: str
    spec: ModelSpec | None = None
    versions: dict[int, ServedVersion] = field(default_factory=dict)  # ready ones
    states: dict[str, tuple[str, str]] = field(default_factory=dict)  # version ("" = whole model) -> state, reason
    fingerprint: tuple | None = None
    explicit: bool = False  # asked for by load() / load_models, not only loaded as an ensemble's step
    loading: bool = False  # a load() of it is in progress (its states are still the old ones meanwhile)
    steps: tuple[str, ...] = ()  # an ensemble's step models (of the config it was last loaded with)
    waiting: str = ""  # an ensemble with versions that cannot serve: why (a step model is not ready)


class Entries(dict[str, Entry]):
    """Name -> Entry."""

    def lookup_spec(self, name: str, version: int) -> ModelSpec | None:
        entry = self.get(name)
        if entry is None or not entry.versions or entry.waiting:
            return None
        if version >= 0 and version not in entry.versions:
            return None
        return entry.spec

    def not_ready_reason(self, name: str) -> str:
        entry = self.get(name)
        if entry is None:
            return "not loaded"
        if entry.versions and entry.waiting:
            return entry.waiting
        reasons = [r for s, r in entry.states.values() if r and s != "READY"]
        return "; ".join(dict.fromkeys(reasons)) or "not loaded"

    def ensemble_problem(self, spec: ModelSpec) -> str:
        """Why a loaded ensemble cannot serve now ("" when it can)."""
        for i, step in enumerate(spec.ensemble_steps):
            if self.lookup_spec(step.model_name, step.model_version) is None:
                version = "" if step.model_version < 0 else f" version {step.model_version}"
                return (f"ensemble '{spec.name}' step {i}: model '{step.model_name}'{version} is not ready "
                        f"({self.not_ready_reason(step.model_name)})")
        try:
            validate_ensemble(spec, self.lookup_spec)  # a step model loaded again with another config
        except ModelServerError as e:
            return e.message
        return ""

    def refresh_ensembles(self) -> None:
        """Make each loaded ensemble's state follow its step models (nested ensembles: until nothing changes)."""
        for _ in range(len(self) + 1):
            changed = False
            for entry in list(self.values()):
                if entry.spec is None or entry.spec.backend != "ensemble" or not entry.versions:
                    continue
                why = self.ensemble_problem(entry.spec)
                if why != entry.waiting:
                    entry.waiting, changed = why, True
                    for v in entry.versions:
                        entry.states[str(v)] = ("UNAVAILABLE", why) if why else ("READY", "")
            if not changed:
                return

    def not_ready(self) -> list[str]:
        """The models that make the server not ready under strict readiness (Triton's rule: every version of
        every model it knows is READY, except versions unloaded on request): one that failed to load (any
        version), one loading, one that cannot serve now (an isolated process restarting), and an ensemble whose
        steps are down for another reason than an unload (Triton unloads such an ensemble with its step). A model
        that load() is loading counts while it serves no version: loaded again after an unload, it is listed
        "unloaded" until its load ends, which alone would not count."""
        return sorted(name for name, entry in self.items() if self._blocks(entry, frozenset()))

    def _blocks(self, entry: Entry, seen: frozenset[str]) -> bool:
        if entry.loading and not entry.versions:  # one that serves keeps serving until the new load replaces it
            return True
        if entry.versions and entry.waiting:  # an ensemble waiting for its step models
            down = [s for s in entry.steps if self.lookup_spec(s, -1) is None]
            seen = seen | {entry.name}
            # no step down: they are up but no longer fit its config, which only a new load can fix
            return not down or any(s in seen or s not in self or self._blocks(self[s], seen) for s in down)
        if not entry.states:  # being loaded (explicit), or never loaded (unloaded after a failed load)
            return entry.explicit
        if any(state != "READY" and not reason.startswith("unloaded") for state, reason in entry.states.values()):
            return True
        return not all(v.healthy() for v in entry.versions.values())

    def used_by_an_ensemble(self, name: str) -> bool:
        return any(e.versions and e.spec is not None and any(s.model_name == name for s in e.spec.ensemble_steps)
                   for e in self.values())
